"""Tiny Hugging Face MoE models, LoRA adapters and the transformers+PEFT reference (the oracle).

Everything is fp32, seeded and small (hidden 64, 4 q heads / 2 kv heads of 16, 2-3 layers,
4-8 experts, top-2, vocab 257), so the suite runs on a laptop CPU. Weights are drawn at unit
scale (not the 0.02 std of `from_config`), so greedy tokens are distinct and logits have real
spread; `reference_generate` also reports the top-1/top-2 logit margin so a test can tell an
engine mismatch from a near tie.

Facts these builders rely on (transformers 5.17, peft 0.21, checked in test_vs_transformers.py):
- `save_pretrained` writes experts per expert, as the Hub checkpoints do:
  `model.layers.{l}.mlp.experts.{e}.{gate,up,down}_proj.weight` (Mixtral:
  `model.layers.{l}.block_sparse_moe.experts.{e}.{w1,w3,w2}.weight`, router
  `block_sparse_moe.gate.weight`); at run time the model holds them fused,
  `mlp.experts.gate_up_proj` [E, 2I, H] (gate rows first) and `mlp.experts.down_proj` [E, H, I].
- PEFT `target_parameters` on those 3D tensors saves, for each targeted tensor, lora_A [r*E, in]
  and lora_B [out, r*E]; expert e uses A_e = lora_A[e*r:(e+1)*r] and B_e = lora_B[:, e::E]
  (B interleaved). When both are targeted, gate_up_proj is the inner wrapper
  (`mlp.experts.base_layer.lora_*`) and down_proj the outer (`mlp.experts.lora_*`); when only one
  is targeted, it alone is `mlp.experts.lora_*`.
"""

from __future__ import annotations

import json
import math
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

ARCHS = ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe")
VOCAB_SIZE = 257  # 256 byte-level tokens + <|endoftext|>
EOS_TOKEN_ID = 256
PEFT_PREFIX = "base_model.model."

_COMMON = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_experts_per_tok=2,
    rms_norm_eps=1e-6,
    max_position_embeddings=512,
    eos_token_id=EOS_TOKEN_ID,
    bos_token_id=None,
    pad_token_id=None,
)

# moe intermediate 40 keeps 2I (80) != H (64), so a transposed expert tensor cannot pass for a
# correct one.
_ARCH_CONFIG: dict[str, dict] = {
    "qwen3_moe": dict(
        num_hidden_layers=3,
        head_dim=16,
        num_experts=8,
        moe_intermediate_size=40,
        intermediate_size=96,
        norm_topk_prob=True,
        rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
    ),
    "qwen2_moe": dict(
        num_hidden_layers=3,
        num_experts=6,
        moe_intermediate_size=40,
        intermediate_size=96,
        shared_expert_intermediate_size=48,
        mlp_only_layers=[1],
        norm_topk_prob=False,
        qkv_bias=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    ),
    "mixtral": dict(
        num_hidden_layers=2,
        head_dim=16,
        num_local_experts=4,
        intermediate_size=40,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6},
    ),
    "olmoe": dict(
        num_hidden_layers=2,
        num_experts=8,
        intermediate_size=40,
        norm_topk_prob=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    ),
    # sliding, full, sliding; a window of 5 is shorter than every prompt but one plus its
    # output, so it matters in prefill and in decode; YaRN as the release has it, scaled down
    "gpt_oss": dict(
        num_hidden_layers=3,
        head_dim=16,
        num_local_experts=6,
        intermediate_size=40,
        sliding_window=5,
        rms_norm_eps=1e-5,
        rope_parameters={
            "rope_type": "yarn",
            "factor": 8.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 64,
            "rope_theta": 150000.0,
        },
    ),
}


def _classes(arch: str):
    import transformers

    names = {
        "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
        "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM"),
        "mixtral": ("MixtralConfig", "MixtralForCausalLM"),
        "olmoe": ("OlmoeConfig", "OlmoeForCausalLM"),
        "gpt_oss": ("GptOssConfig", "GptOssForCausalLM"),
    }[arch]
    return getattr(transformers, names[0]), getattr(transformers, names[1])


@dataclass(frozen=True)
class Dims:
    """What adapter builders need to know about a saved model."""

    arch: str
    hidden: int
    q_size: int
    kv_size: int
    num_layers: int
    num_experts: int
    moe_intermediate: int
    dense_intermediate: int
    shared_intermediate: int  # 0 = no shared expert
    sparse_layers: tuple[bool, ...]


def read_dims(model_path: str | Path) -> Dims:
    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(model_path)
    arch = hf.model_type
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    num_experts = getattr(hf, "num_local_experts", None) or hf.num_experts
    moe_i = getattr(hf, "moe_intermediate_size", None) or hf.intermediate_size
    dense_only = set(getattr(hf, "mlp_only_layers", None) or [])
    step = getattr(hf, "decoder_sparse_step", 1) or 1
    sparse = tuple(i not in dense_only and (i + 1) % step == 0 for i in range(hf.num_hidden_layers))
    return Dims(
        arch=arch,
        hidden=hf.hidden_size,
        q_size=hf.num_attention_heads * head_dim,
        kv_size=hf.num_key_value_heads * head_dim,
        num_layers=hf.num_hidden_layers,
        num_experts=num_experts,
        moe_intermediate=moe_i,
        dense_intermediate=hf.intermediate_size,
        shared_intermediate=getattr(hf, "shared_expert_intermediate_size", 0) or 0,
        sparse_layers=sparse,
    )


# ---------------------------------------------------------------------------------------------
# What the tests run

MAX_TOKENS = 8
# Different lengths, so prefill and decode batches are ragged.
PROMPTS: list[list[int]] = [
    [72, 101, 108, 108, 111],
    [3, 141, 59, 26, 53, 58, 97, 93, 238, 46, 26],
    [200, 7, 19],
    [88, 42, 17, 250, 1, 64, 128, 9],
    [12, 34, 56, 78, 90, 123, 145, 167, 189, 201, 223, 245, 11, 22],
]


def peft_targets(arch: str) -> list[str]:
    """Attention everywhere; Qwen2-MoE also its shared expert and dense-layer MLP."""
    attention = ["q_proj", "k_proj", "v_proj", "o_proj"]
    return attention + (["gate_proj", "up_proj", "down_proj"] if arch == "qwen2_moe" else [])


EXPERT_PARAMS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


# ---------------------------------------------------------------------------------------------
# Models


def make_model(
    arch: str,
    path: str | Path,
    *,
    tie_word_embeddings: bool = False,
    seed: int = 0,
    legacy_config: bool = False,
    **overrides,
) -> Path:
    """Build a tiny random `arch` model, save it (safetensors, per-expert keys) with a tokenizer.

    legacy_config rewrites config.json the way Hub checkpoints made before transformers 5 read
    (`rope_theta` / `rope_scaling` at top level, `num_experts`, `torch_dtype`); transformers 5
    loads both spellings to the same model.
    """
    config_cls, model_cls = _classes(arch)
    kwargs = {**_COMMON, **_ARCH_CONFIG[arch], **overrides}
    config = config_cls(tie_word_embeddings=tie_word_embeddings, **kwargs)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32).eval()
    _randomize(model, seed=seed, tied=tie_word_embeddings)
    path = Path(path)
    model.save_pretrained(path)
    _save_tokenizer(path)
    if legacy_config:
        _legacy_config(path / "config.json")
    return path


def _randomize(model: torch.nn.Module, *, seed: int, tied: bool) -> None:
    """Unit-scale weights: every linear maps unit inputs to unit outputs, logits spread ~3."""
    gen = torch.Generator().manual_seed(seed)
    hidden = model.config.hidden_size
    gpt_oss = model.config.model_type == "gpt_oss"
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            noise = torch.randn(p.shape, generator=gen)
            if gpt_oss and _randomize_gpt_oss(name, p, noise, hidden):
                continue
            if name == "model.norm.weight" and tied:  # small tied embeddings: lift the logits
                p.copy_(8.0 * (1.0 + 0.2 * noise))
            elif name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * noise)
            elif name.endswith(".bias"):
                p.copy_(0.3 * noise)
            elif "embed_tokens" in name:
                # tied: a large embedding would make every token predict itself
                p.copy_(noise * (0.05 if tied else 1.0))
            elif name == "lm_head.weight":
                p.copy_(noise * 3.0 / math.sqrt(hidden))
            elif name.endswith("mlp.gate.weight"):  # router: distinct, non-degenerate choices
                p.copy_(noise * 2.0 / math.sqrt(hidden))
            else:  # 2D linears [out, in] and 3D experts [E, out, in]: fan-in is the last dim
                p.copy_(noise / math.sqrt(p.shape[-1]))


def _randomize_gpt_oss(name: str, p: torch.Tensor, noise: torch.Tensor, hidden: int) -> bool:
    """GPT-OSS's own tensors (False: the common rule applies). Experts are [E, in, out]; gate_up
    at 3x unit scale so some gates and ups pass the SwiGLU's clamp at 7; sinks of about the
    scores' size, so they take a real share of the softmax."""
    if name.endswith("experts.gate_up_proj"):
        p.copy_(noise * 3.0 / math.sqrt(p.shape[1]))
    elif name.endswith("experts.down_proj"):
        p.copy_(noise / math.sqrt(p.shape[1]))
    elif name.endswith("_bias"):
        p.copy_(0.3 * noise)
    elif name.endswith("self_attn.sinks"):
        p.copy_(noise)
    elif name.endswith("mlp.router.weight"):
        p.copy_(noise * 2.0 / math.sqrt(hidden))
    else:
        return False
    return True


def _save_tokenizer(path: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab["<|endoftext|>"] = EOS_TOKEN_ID
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")
    fast.save_pretrained(path)


def _legacy_config(config_path: Path) -> None:
    cfg = json.loads(config_path.read_text())
    rope = dict(cfg.pop("rope_parameters", None) or {})
    cfg["rope_theta"] = rope.pop("rope_theta", 10000.0)
    rope_type = rope.pop("rope_type", "default")
    cfg["rope_scaling"] = None if rope_type == "default" else {"type": rope_type, **rope}
    if cfg["model_type"] in ("qwen3_moe", "qwen2_moe") and "num_local_experts" in cfg:
        cfg["num_experts"] = cfg.pop("num_local_experts")
    cfg["torch_dtype"] = cfg.pop("dtype", "float32")
    config_path.write_text(json.dumps(cfg, indent=2, sort_keys=True))


def load_hf_model(model_path: str | Path):
    """transformers' model of the folder in float32; a block-FP8 folder dequantized at load
    (FineGrainedFP8Config(dequantize=True)), on a machine with a GPU too."""
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config

    options = {}
    config = json.loads((Path(model_path) / "config.json").read_text())
    if (config.get("quantization_config") or {}).get("quant_method") == "fp8":
        options["quantization_config"] = FineGrainedFP8Config(dequantize=True)
    model = AutoModelForCausalLM.from_pretrained(
        model_path, dtype=torch.float32, attn_implementation="eager", **options
    )
    return model.eval()


# ---------------------------------------------------------------------------------------------
# Checkpoint layouts


def _expert_names(arch: str) -> tuple[str, tuple[str, str, str]]:
    """(MoE block name in per-expert checkpoints, names of gate / up / down)."""
    if arch == "mixtral":
        return "block_sparse_moe", ("w1", "w3", "w2")
    return "mlp", ("gate_proj", "up_proj", "down_proj")


def read_checkpoint(path: str | Path) -> dict[str, torch.Tensor]:
    path = Path(path)
    index = path / "model.safetensors.index.json"
    files = (
        sorted(set(json.loads(index.read_text())["weight_map"].values()))
        if index.exists()
        else ["model.safetensors"]
    )
    tensors: dict[str, torch.Tensor] = {}
    for name in files:
        tensors.update(load_file(path / name))
    return tensors


def to_fused(tensors: dict[str, torch.Tensor], arch: str) -> dict[str, torch.Tensor]:
    """Per-expert keys -> `model.layers.{l}.mlp.experts.gate_up_proj` [E,2I,H] / `down_proj`."""
    block, (gate, up, down) = _expert_names(arch)
    pat = re.compile(rf"model\.layers\.(\d+)\.{block}\.experts\.(\d+)\.(\w+)\.weight")
    experts: dict[int, dict[int, dict[str, torch.Tensor]]] = {}
    out: dict[str, torch.Tensor] = {}
    for key, t in tensors.items():
        m = pat.fullmatch(key)
        if m:
            experts.setdefault(int(m[1]), {}).setdefault(int(m[2]), {})[m[3]] = t
        else:
            out[key.replace(f".{block}.", ".mlp.")] = t  # Mixtral router: block_sparse_moe.gate
    for layer, by_expert in experts.items():
        ids = sorted(by_expert)
        assert ids == list(range(len(ids))), f"layer {layer}: experts {ids}"
        prefix = f"model.layers.{layer}.mlp.experts"
        out[f"{prefix}.gate_up_proj"] = torch.stack(
            [torch.cat([by_expert[e][gate], by_expert[e][up]], dim=0) for e in ids]
        )
        out[f"{prefix}.down_proj"] = torch.stack([by_expert[e][down] for e in ids])
    return out


def to_per_expert(tensors: dict[str, torch.Tensor], arch: str) -> dict[str, torch.Tensor]:
    """Fused 3D expert tensors -> per-expert keys (Mixtral: `block_sparse_moe.experts.{e}.w1`)."""
    block, (gate, up, down) = _expert_names(arch)
    pat = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)")
    out: dict[str, torch.Tensor] = {}
    for key, t in tensors.items():
        m = pat.fullmatch(key)
        if not m:
            if arch == "mixtral" and re.fullmatch(r"model\.layers\.\d+\.mlp\.gate\.weight", key):
                key = key.replace(".mlp.", f".{block}.")
            out[key] = t
            continue
        prefix = f"model.layers.{m[1]}.{block}.experts"
        for e in range(t.shape[0]):
            if m[2] == "gate_up_proj":
                g, u = t[e].chunk(2, dim=0)
                out[f"{prefix}.{e}.{gate}.weight"] = g.contiguous()
                out[f"{prefix}.{e}.{up}.weight"] = u.contiguous()
            else:
                out[f"{prefix}.{e}.{down}.weight"] = t[e].contiguous()
    return out


def write_checkpoint(src: str | Path, dst: str | Path, *, layout: str, shards: int = 1) -> Path:
    """Copy the model folder `src` to `dst` with experts in `layout` ("per_expert" | "fused").

    shards > 1 writes `model-0000i-of-0000n.safetensors` plus `model.safetensors.index.json`;
    keys are dealt round-robin, so one layer's experts land in several shards.
    """
    src, dst = Path(src), Path(dst)
    arch = json.loads((src / "config.json").read_text())["model_type"]
    tensors = read_checkpoint(src)
    is_fused = any(k.endswith("experts.gate_up_proj") for k in tensors)
    if layout == "fused" and not is_fused:
        tensors = to_fused(tensors, arch)
    elif layout == "per_expert" and is_fused:
        tensors = to_per_expert(tensors, arch)
    else:
        assert layout in ("fused", "per_expert"), layout
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and not f.name.startswith("model"):  # config, tokenizer
            shutil.copy(f, dst / f.name)
    keys = sorted(tensors)
    if shards == 1:
        save_file({k: tensors[k].contiguous() for k in keys}, dst / "model.safetensors")
        return dst
    names = [f"model-{i + 1:05d}-of-{shards:05d}.safetensors" for i in range(shards)]
    weight_map = {k: names[i % shards] for i, k in enumerate(keys)}
    for name in names:
        part = {k: tensors[k].contiguous() for k in keys if weight_map[k] == name}
        save_file(part, dst / name, metadata={"format": "pt"})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (dst / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return dst


# ---------------------------------------------------------------------------------------------
# Adapters


def make_peft_adapter(
    model_path: str | Path,
    adapter_path: str | Path,
    *,
    targets: list[str] | str | None,
    seed: int,
    rank: int,
    alpha: float,
    use_rslora: bool = False,
    rank_pattern: dict[str, int] | None = None,
    alpha_pattern: dict[str, float] | None = None,
    target_parameters: list[str] | None = None,
    layers_to_transform: list[int] | None = None,
    strength: float = 0.5,
    **lora_options,
) -> Path:
    """A PEFT LoRA adapter with random A and B (PEFT inits B to zero), saved by PEFT itself.

    Each adapted linear gets a delta of about `strength` times its base output's scale.
    lora_options go to LoraConfig as they are (use_dora, lora_bias, modules_to_save, ...).
    """
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=rank,
        lora_alpha=alpha,
        target_modules=targets,
        target_parameters=target_parameters,
        use_rslora=use_rslora,
        rank_pattern=rank_pattern or {},
        alpha_pattern=alpha_pattern or {},
        layers_to_transform=layers_to_transform,
        lora_dropout=0.0,
        **lora_options,
    )
    peft_model = get_peft_model(load_hf_model(model_path), config)
    _randomize_lora(peft_model, seed=seed, strength=strength)
    adapter_path = Path(adapter_path)
    peft_model.save_pretrained(adapter_path)
    return adapter_path


def _randomize_lora(peft_model, *, seed: int, strength: float) -> None:
    from peft.tuners.lora import LoraLayer

    gen = torch.Generator().manual_seed(seed)
    layers = sorted((name, m) for name, m in peft_model.named_modules() if isinstance(m, LoraLayer))
    with torch.no_grad():
        for _, layer in layers:
            for adapter, lora_a in layer.lora_A.items():
                a = lora_a.weight
                b = layer.lora_B[adapter].weight
                rank, scaling = layer.r[adapter], layer.scaling[adapter]
                a.copy_(torch.randn(a.shape, generator=gen) / math.sqrt(a.shape[1]))
                b_std = strength / (scaling * math.sqrt(rank))
                b.copy_(torch.randn(b.shape, generator=gen) * b_std)


def _adapter_config(
    model_path: Path, *, rank: int, alpha: float, targets: list[str], use_rslora: bool
) -> dict:
    """adapter_config.json as PEFT writes it (the fields engines and PEFT read)."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(model_path),
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": 0.0,
        "target_modules": sorted(targets),
        "target_parameters": None,
        "bias": "none",
        "lora_bias": False,
        "use_rslora": use_rslora,
        "use_dora": False,
        "modules_to_save": None,
        "fan_in_fan_out": False,
        "init_lora_weights": True,
        "layers_to_transform": None,
        "layers_pattern": None,
        "rank_pattern": {},
        "alpha_pattern": {},
        "inference_mode": True,
        "revision": None,
        "peft_version": "0.13.2",
    }


def _per_expert_modules(
    dims: Dims, arch: str, layers: list[int] | None, attention: tuple[str, ...]
) -> dict[str, tuple[int, int]]:
    """make_per_expert_adapter's modules in key order: module path -> (in, out)."""
    block, (gate, up, down) = _expert_names(arch)
    h, moe_i = dims.hidden, dims.moe_intermediate
    attn_shapes = {
        "q_proj": (h, dims.q_size),
        "k_proj": (h, dims.kv_size),
        "v_proj": (h, dims.kv_size),
        "o_proj": (dims.q_size, h),
    }
    modules: dict[str, tuple[int, int]] = {}  # module path -> (in, out)
    for layer in layers if layers is not None else range(dims.num_layers):
        base = f"model.layers.{layer}"
        for proj in attention:
            modules[f"{base}.self_attn.{proj}"] = attn_shapes[proj]
        if dims.sparse_layers[layer]:
            for e in range(dims.num_experts):
                ex = f"{base}.{block}.experts.{e}"
                modules[f"{ex}.{gate}"] = (h, moe_i)
                modules[f"{ex}.{up}"] = (h, moe_i)
                modules[f"{ex}.{down}"] = (moe_i, h)
            mlps = [(f"{base}.mlp.shared_expert", dims.shared_intermediate)]
        else:
            mlps = [(f"{base}.mlp", dims.dense_intermediate)]
        for mlp, inter in mlps:
            if inter:
                modules[f"{mlp}.gate_proj"] = (h, inter)
                modules[f"{mlp}.up_proj"] = (h, inter)
                modules[f"{mlp}.down_proj"] = (inter, h)
    return modules


def make_per_expert_adapter(
    model_path: str | Path,
    adapter_path: str | Path,
    *,
    seed: int,
    rank: int,
    alpha: float,
    arch: str,
    layers: list[int] | None = None,
    attention: tuple[str, ...] = ("q_proj", "v_proj", "o_proj"),
    use_rslora: bool = False,
    strength: float = 0.5,
) -> Path:
    """A hand-written adapter in the per-expert format of adapters trained before transformers 5.

    Keys: `base_model.model.model.layers.{l}.mlp.experts.{e}.gate_proj.lora_A.weight` [r, H],
    `.lora_B.weight` [I, r] (up_proj, down_proj likewise; Mixtral: `block_sparse_moe.experts.{e}`
    `.w1|w3|w2`), the listed attention projections, and for Qwen2-MoE the shared expert and the
    dense layers' MLP.
    """
    model_path, adapter_path = Path(model_path), Path(adapter_path)
    dims = read_dims(model_path)
    assert dims.arch == arch, (dims.arch, arch)
    modules = _per_expert_modules(dims, arch, layers, attention)
    scaling = alpha / math.sqrt(rank) if use_rslora else alpha / rank
    gen = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for module, (fan_in, fan_out) in modules.items():
        a = torch.randn(rank, fan_in, generator=gen) / math.sqrt(fan_in)
        b = torch.randn(fan_out, rank, generator=gen) * strength / (scaling * math.sqrt(rank))
        tensors[f"{PEFT_PREFIX}{module}.lora_A.weight"] = a
        tensors[f"{PEFT_PREFIX}{module}.lora_B.weight"] = b
    targets = sorted({m.rsplit(".", 1)[1] for m in modules})
    config = _adapter_config(
        model_path, rank=rank, alpha=alpha, targets=targets, use_rslora=use_rslora
    )
    adapter_path.mkdir(parents=True, exist_ok=True)
    (adapter_path / "adapter_config.json").write_text(json.dumps(config, indent=2))
    save_file(tensors, adapter_path / "adapter_model.safetensors", metadata={"format": "pt"})
    return adapter_path


def read_adapter(adapter_path: str | Path) -> tuple[dict, dict[str, torch.Tensor]]:
    adapter_path = Path(adapter_path)
    config = json.loads((adapter_path / "adapter_config.json").read_text())
    return config, load_file(adapter_path / "adapter_model.safetensors")


def write_adapter(adapter_path: str | Path, config: dict, tensors: dict[str, torch.Tensor]) -> Path:
    adapter_path = Path(adapter_path)
    adapter_path.mkdir(parents=True, exist_ok=True)
    (adapter_path / "adapter_config.json").write_text(json.dumps(config, indent=2))
    save_file(tensors, adapter_path / "adapter_model.safetensors", metadata={"format": "pt"})
    return adapter_path


def is_per_expert_adapter(adapter_path: str | Path) -> bool:
    with safe_open(Path(adapter_path) / "adapter_model.safetensors", "pt") as f:
        return any(re.search(r"\.experts\.\d+\.", k) for k in f.keys())


def expert_factors(
    lora_a: torch.Tensor, lora_b: torch.Tensor, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """PEFT target_parameters factors -> per-expert A [E, r, in] and B [E, out, r]."""
    rank = lora_a.shape[0] // num_experts
    a = lora_a.reshape(num_experts, rank, lora_a.shape[1])
    b = torch.stack([lora_b[:, e::num_experts] for e in range(num_experts)])
    return a, b


# ---------------------------------------------------------------------------------------------
# Reference


@dataclass(frozen=True)
class RefOutput:
    tokens: list[int]
    logprobs: list[float]  # log_softmax of the raw logits, at the chosen token
    margins: list[float]  # top-1 minus top-2 logit at each step (a near tie makes greedy fragile)


def _scaling(config: dict, module: str) -> float:
    from peft.utils.other import get_pattern_key

    rank = config["r"]
    alpha = config["lora_alpha"]
    rank = (config.get("rank_pattern") or {}).get(
        get_pattern_key((config.get("rank_pattern") or {}).keys(), module), rank
    )
    alpha = (config.get("alpha_pattern") or {}).get(
        get_pattern_key((config.get("alpha_pattern") or {}).keys(), module), alpha
    )
    return alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank


def merge_per_expert_adapter(model, adapter_path: str | Path) -> None:
    """W += scaling * B @ A for every module of a hand-written (per-expert) adapter, in place."""
    config, tensors = read_adapter(adapter_path)
    arch = model.config.model_type
    block, (gate, up, down) = _expert_names(arch)
    expert = re.compile(rf"(model\.layers\.\d+)\.{block}\.experts\.(\d+)\.(\w+)")
    params = dict(model.named_parameters())
    with torch.no_grad():
        for key in sorted(k for k in tensors if k.endswith(".lora_A.weight")):
            module = key[len(PEFT_PREFIX) : -len(".lora_A.weight")]
            a, b = tensors[key], tensors[f"{PEFT_PREFIX}{module}.lora_B.weight"]
            delta = _scaling(config, module) * (b @ a)
            m = expert.fullmatch(module)
            if not m:
                params[f"{module}.weight"].add_(delta)
                continue
            layer, e, proj = m[1], int(m[2]), m[3]
            experts = f"{layer}.mlp.experts"
            inter = params[f"{experts}.down_proj"].shape[-1]
            if proj == gate:
                params[f"{experts}.gate_up_proj"][e, :inter].add_(delta)
            elif proj == up:
                params[f"{experts}.gate_up_proj"][e, inter:].add_(delta)
            else:
                assert proj == down, module
                params[f"{experts}.down_proj"][e].add_(delta)


def load_reference_model(model_path: str | Path, adapter_path: str | Path | None):
    """transformers model, with the adapter applied by PEFT (or merged, for per-expert ones)."""
    model = load_hf_model(model_path)
    if adapter_path is None:
        return model
    if is_per_expert_adapter(adapter_path):
        merge_per_expert_adapter(model, adapter_path)
        return model
    from peft import PeftModel

    return PeftModel.from_pretrained(model, str(adapter_path)).eval()


@torch.no_grad()
def greedy(model, prompt: list[int], max_tokens: int) -> RefOutput:
    """Plain greedy loop, full recompute each step (no KV cache, no generate() logic, no EOS)."""
    ids = list(prompt)
    tokens, logprobs, margins = [], [], []
    for _ in range(max_tokens):
        logits = model(input_ids=torch.tensor([ids])).logits[0, -1].float()
        token = int(torch.argmax(logits))
        top2 = torch.topk(logits, 2).values
        tokens.append(token)
        logprobs.append(float(torch.log_softmax(logits, dim=-1)[token]))
        margins.append(float(top2[0] - top2[1]))
        ids.append(token)
    return RefOutput(tokens, logprobs, margins)


def reference_generate(
    model_path: str | Path,
    prompts: list[list[int]],
    adapters: list[str | Path | None],
    max_tokens: int,
) -> list[RefOutput]:
    """Greedy fp32 outputs of transformers(+PEFT), one request at a time, adapter per request."""
    assert len(prompts) == len(adapters)
    outputs: list[RefOutput | None] = [None] * len(prompts)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: extra threads only spin, worse on a busy machine
    try:
        for adapter in dict.fromkeys(adapters):
            model = load_reference_model(model_path, adapter)
            for i, (prompt, wanted) in enumerate(zip(prompts, adapters)):
                if wanted == adapter:
                    outputs[i] = greedy(model, prompt, max_tokens)
    finally:
        torch.set_num_threads(threads)
    return outputs  # type: ignore[return-value]


# ---------------------------------------------------------------------------------------------
# MXFP4 (GPT-OSS's release)

MXFP4_CONFIG = {
    "quant_method": "mxfp4",
    "modules_to_not_convert": [
        "model.layers.*.self_attn",
        "model.layers.*.mlp.router",
        "model.embed_tokens",
        "lm_head",
    ],
}


def write_mxfp4_checkpoint(src: str | Path, dst: str | Path, *, seed: int) -> Path:
    """`src` (a GPT-OSS folder) with its experts in MXFP4 the way openai/gpt-oss-* stores them:
    `mlp.experts.{gate_up,down}_proj_blocks` [E, out, in / 32, 16] uint8 (two e2m1 codes a
    byte, the low nibble first) and `_scales` [E, out, in / 32] uint8 (E8M0, bias 127), biases
    as they are, and config.json's quantization_config. The codes and scales are random (about
    unit-scale weights), not a quantization of src's experts."""
    src, dst = Path(src), Path(dst)
    gen = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for key, t in read_checkpoint(src).items():
        if not re.search(r"experts\.(gate_up|down)_proj$", key):
            tensors[key] = t
            continue
        E, fan_in, fan_out = t.shape
        assert fan_in % 32 == 0, f"{key}: in {fan_in} is not a multiple of 32"
        groups = (E, fan_out, fan_in // 32)
        tensors[f"{key}_blocks"] = torch.randint(0, 256, (*groups, 16), generator=gen).to(
            torch.uint8
        )
        # 2^-4 .. 2^-2 times codes of up to 6: about unit-scale weights at fan-in 64
        tensors[f"{key}_scales"] = torch.randint(123, 126, groups, generator=gen).to(torch.uint8)
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and not f.name.startswith("model"):
            shutil.copy(f, dst / f.name)
    config = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**config, "quantization_config": MXFP4_CONFIG}))
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def write_dequantized_checkpoint(src: str | Path, dst: str | Path) -> Path:
    """An MXFP4 folder dequantized to float32 by transformers' own function, without its
    quantization_config: what the reference loads."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    src, dst = Path(src), Path(dst)
    tensors = read_checkpoint(src)
    out = {k: t for k, t in tensors.items() if not k.endswith(("_blocks", "_scales"))}
    for key in [k for k in tensors if k.endswith("_blocks")]:
        base = key.removesuffix("_blocks")
        out[base] = convert_moe_packed_tensors(
            tensors[key], tensors[f"{base}_scales"], dtype=torch.float32
        )
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and not f.name.startswith("model"):
            shutil.copy(f, dst / f.name)
    config = json.loads((dst / "config.json").read_text())
    config.pop("quantization_config")
    (dst / "config.json").write_text(json.dumps(config))
    save_file({k: t.contiguous() for k, t in out.items()}, dst / "model.safetensors")
    return dst


def linear_shapes(model: Path, wanted: set[str]) -> dict[str, tuple[int, int]]:
    """Module path -> (in, out) of the model's nn.Linear projections named in `wanted` (the last
    part of the path) and of each expert's gate, up and down projections (fused 3D experts
    unfolded to per-expert keys), in key order."""
    hf_model = load_hf_model(model)
    shapes = {}
    for name, module in hf_model.named_modules():
        if isinstance(module, torch.nn.Linear) and name.rsplit(".", 1)[-1] in wanted:
            shapes[name] = (module.in_features, module.out_features)
        if name.endswith("mlp.experts"):
            E, two_i, h = module.gate_up_proj.shape
            for e in range(E):
                shapes[f"{name}.{e}.gate_proj"] = (h, two_i // 2)
                shapes[f"{name}.{e}.up_proj"] = (h, two_i // 2)
                shapes[f"{name}.{e}.down_proj"] = (two_i // 2, h)
    return dict(sorted(shapes.items()))


def write_adapter_of_shapes(
    model: Path, path: Path, modules: dict[str, tuple[int, int]], *, seed: int, rank: int
) -> Path:
    """A hand-written PEFT folder with a random lora_A and lora_B (never zero) on each module
    path -> (in, out) of `modules`; alpha 2 * rank."""
    alpha = 2.0 * rank
    scaling = alpha / rank
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for module, (fan_in, fan_out) in modules.items():
        a = torch.randn(rank, fan_in, generator=gen) / math.sqrt(fan_in)
        b = torch.randn(fan_out, rank, generator=gen) * 0.5 / (scaling * math.sqrt(rank))
        tensors[f"{PEFT_PREFIX}{module}.lora_A.weight"] = a
        tensors[f"{PEFT_PREFIX}{module}.lora_B.weight"] = b
    targets = sorted({m.rsplit(".", 1)[1] for m in modules})
    config = _adapter_config(model, rank=rank, alpha=alpha, targets=targets, use_rslora=False)
    path.mkdir(parents=True, exist_ok=True)
    (path / "adapter_config.json").write_text(json.dumps(config, indent=2))
    save_file(tensors, path / "adapter_model.safetensors", metadata={"format": "pt"})
    return path
