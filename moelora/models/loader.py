"""Checkpoint loading: HF safetensors (one file or shards) into the shared decoder stack.

Names are canonicalised once (Mixtral's block_sparse_moe/w1/w3/w2 become mlp/gate/up/down), so
one table serves every architecture. Experts may be stored per expert or as fused 3D tensors.
Quantized weights are dequantized on the way in: MXFP4 experts here (unless the model keeps them
packed), block-FP8 weights in models/quantization.py (but for experts the model keeps in FP8,
whose codes and scales go to its Fp8Weight's parameters).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import torch

from moelora.errors import ModelConfigError
from moelora.kernels.fp8_block import FP8_BLOCK, FP8_DTYPE, FP8_MAX
from moelora.kernels.moe.mxfp4_layout import Mxfp4Weight
from moelora.kernels.reference import dequantize_mxfp4
from moelora.layers.linear_attention import GatedDeltaNet
from moelora.layers.moe import DenseMLP, SparseMoE
from moelora.models.model import MoeCausalLM
from moelora.models.quantization import SCALE_SUFFIX, fp8_weights

_ALIASES = [
    (re.compile(r"\.block_sparse_moe\."), ".mlp."),
    (re.compile(r"\.experts\.(\d+)\.w1(?=\.|$)"), r".experts.\1.gate_proj"),
    (re.compile(r"\.experts\.(\d+)\.w3(?=\.|$)"), r".experts.\1.up_proj"),
    (re.compile(r"\.experts\.(\d+)\.w2(?=\.|$)"), r".experts.\1.down_proj"),
    (re.compile(r"\.mlp\.router\."), ".mlp.gate."),  # GPT-OSS
    (re.compile(r"\.mlp\.shared_experts\."), ".mlp.shared_expert."),  # DeepSeek, GLM-4.5
    (re.compile(r"^language_model\."), ""),  # Qwen3.5-MoE's multimodal checkpoints
]
# weights of no module moelora builds: multi-token prediction (Qwen3-Next, Qwen3.5) and the
# vision tower of a multimodal checkpoint served as its text model
_SKIPPED = re.compile(r"^(mtp|visual)\.")
# RMSNorms that scale by 1 + w (ModelConfig.zero_centred_norm): the loader stores 1 + w, the
# float32 sum transformers forms (gated DeltaNet's own norm scales by w)
_ZERO_CENTRED = re.compile(
    r"^(norm|layers\.\d+\.(input_layernorm|post_attention_layernorm|self_attn\.[qk]_norm))"
    r"\.weight$"
)
# gated DeltaNet (layers/linear_attention.py): the input projections, slices of its in_proj
# (Qwen3-Next: qkvz, ba; Qwen3.5: qkv, z, b, a), and its own parameters
# by LinearAttentionConfig.grouped_projections
LINEAR_IN = {
    True: {"in_proj_qkvz": 0, "in_proj_ba": 1},
    False: {"in_proj_qkv": 0, "in_proj_z": 1, "in_proj_b": 2, "in_proj_a": 3},
}
_LINEAR_OWN = {
    "conv1d.weight": "conv1d",
    "dt_bias": "dt_bias",
    "A_log": "A_log",
    "norm.weight": "norm.weight",
    "out_proj.weight": "out_proj.weight",
}
_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
_QKV = {"q_proj": 0, "k_proj": 1, "v_proj": 2}
# MLA (layers/mla.py): the two projections of the hidden state, slices of qkv_proj (q_proj is
# slice 0 too), and the projections and norms of its own
_MLA_A = {"q_a_proj": 0, "kv_a_proj_with_mqa": 1}
_MLA_OWN = ("q_b_proj", "kv_b_proj", "q_a_layernorm", "kv_a_layernorm")
_GATE_UP = {"gate_proj": 0, "up_proj": 1}
_LINEAR_PARTS = ("weight", "bias", "weight" + SCALE_SUFFIX)  # a LoraLinear's, _slice's kinds
# one kept-FP8 expert's weights (kernels/fp8_block.Fp8Weight): gate's and up's halves of w13
_FP8_EXPERT = {"gate_proj.weight": 0, "up_proj.weight": 1, "down_proj.weight": None}


def canonical_name(name: str) -> str:
    """HF key -> our naming: no 'model.' prefix, Mixtral aliases folded."""
    name = name.removeprefix("model.")
    for pattern, repl in _ALIASES:
        name = pattern.sub(repl, name)
    return name


def safetensors_files(model_path: str) -> list[Path]:
    folder = Path(model_path)
    index = folder / "model.safetensors.index.json"
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [folder / s for s in shards]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelConfigError(f"{model_path}: no *.safetensors file found")
    return files


def stores_fused_experts(model_path: str) -> bool:
    """Whether the checkpoint stores its experts fused (experts.gate_up_proj), by its tensors'
    names: the index's, or the files' headers (no tensor is read)."""
    return any(key.endswith(".experts.gate_up_proj") for key in checkpoint_keys(model_path))


def checkpoint_keys(model_path: str) -> list[str]:
    from safetensors import safe_open

    index = Path(model_path) / "model.safetensors.index.json"
    if index.exists():
        return list(json.loads(index.read_text())["weight_map"])
    keys: list[str] = []
    for f in safetensors_files(model_path):
        with safe_open(str(f), framework="pt") as fh:
            keys.extend(fh.keys())
    return keys


def iter_tensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    for f in files:
        with safe_open(str(f), framework="pt") as fh:
            for key in fh.keys():
                yield key, fh.get_tensor(key)


def dequantized(
    tensors: Iterator[tuple[str, torch.Tensor]], dtype: torch.dtype, *, packed: bool
) -> Iterator[tuple[str, torch.Tensor | Mxfp4Weight]]:
    """MXFP4 pairs (`X_blocks` [E, out, in / 32, 16], `X_scales` [E, out, in / 32], in any order
    and any shards) -> `X` [E, in, out] in dtype, the layout of the tensor the release quantized
    (transformers' dequantization); or, packed, `X` as the Mxfp4Weight [E, out, in] of the same
    bytes: the release packs the input axis, which is K in moelora's layout too."""
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in tensors:
        base, _, kind = key.rpartition("_")
        if kind not in ("blocks", "scales"):
            yield key, t
            continue
        pair = halves.setdefault(base, {})
        pair[kind] = t
        if len(pair) == 2:
            del halves[base]
            blocks, scales = pair["blocks"], pair["scales"]
            if packed:
                yield base, Mxfp4Weight(blocks.flatten(2).to(torch.uint8), scales.to(torch.uint8))
            else:
                yield base, dequantize_mxfp4(blocks, scales, dtype).transpose(1, 2)
    for base, pair in halves.items():
        missing = "scales" if "blocks" in pair else "blocks"
        raise ModelConfigError(f"checkpoint has {base}_{sorted(pair)[0]} but no {base}_{missing}")


def load_weights(model: MoeCausalLM, model_path: str) -> None:
    """Copy every checkpoint tensor into its place; refuse unknown, misshapen or missing ones.
    MXFP4 experts are dequantized to the model's dtype on the way, unless the model keeps them
    packed (ModelConfig.experts_mxfp4); block-FP8 weights too, unless they are experts the
    model keeps in FP8 (ModelConfig.experts_fp8, models/quantization.py)."""
    filled: dict[int, int] = {}  # id(parameter) -> elements written
    for target, source in placed_tensors(model, model_path):
        target.copy_(source)
        base = target if target._base is None else target._base
        filled[id(base)] = filled.get(id(base), 0) + target.numel()
    check_filled(model, filled, model_path)


def placed_tensors(
    model: MoeCausalLM, model_path: str
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """(view of a parameter of `model`, checkpoint tensor of its shape) for every checkpoint
    tensor, in the checkpoint's order; unknown or misshapen tensors refused. `model` may be on
    the meta device: its views then say where each tensor goes (models/shard.py)."""
    dtype, packed = model.embed_tokens.dtype, model.cfg.experts_mxfp4
    tensors = iter_tensors(safetensors_files(model_path))
    cfg = model.cfg
    tensors = fp8_weights(
        tensors,
        cfg.weights_fp8,
        dtype,
        model_path,
        keep_experts=cfg.experts_fp8,
        keep_projections=cfg.projections_fp8,
    )
    for key, tensor in dequantized(tensors, dtype, packed=packed):
        name = canonical_name(key)
        if name.endswith("rotary_emb.inv_freq"):
            continue
        for target, source in _targets(model, name, tensor):
            if source.shape != target.shape:
                raise ModelConfigError(
                    f"{model_path}: weight {key!r} has shape {tuple(source.shape)}, expected "
                    f"{tuple(target.shape)}"
                )
            if target.dtype == FP8_DTYPE and source.dtype != FP8_DTYPE:
                raise ModelConfigError(
                    f"{model_path}: weight {key!r} is {source.dtype}, but the model keeps it "
                    "block-FP8 with its neighbours: expected float8_e4m3fn with a "
                    "weight_scale_inv, as the checkpoint's other attention projections"
                )
            yield target, source


def check_filled(model: MoeCausalLM, filled: dict[int, int], model_path: str) -> None:
    """A ModelConfigError naming the parameters the checkpoint did not fill whole."""
    missing = [n for n, p in model.named_parameters() if filled.get(id(p), 0) < p.numel()]
    if missing:
        raise ModelConfigError(f"{model_path}: checkpoint lacks weights for {missing[:5]}")


def _targets(model: MoeCausalLM, name: str, t: torch.Tensor):
    """(destination view, source tensor) pairs for one checkpoint tensor."""
    if _SKIPPED.match(name):
        return []
    if model.cfg.zero_centred_norm and _ZERO_CENTRED.match(name):
        t = t.float() + 1.0
    if name == "embed_tokens.weight":
        return [(model.embed_tokens, t)]
    if name == "norm.weight":
        return [(model.norm.weight, t)]
    if name == "lm_head.weight":
        if model.cfg.tie_word_embeddings:
            return []  # tied: the embedding is the head
        return [(model.lm_head, t)]
    m = _LAYER.match(name)
    if m is None:
        raise ModelConfigError(f"checkpoint weight {name!r} matches no module of the model")
    i, rest = int(m.group(1)), m.group(2)
    if len(model.layers) <= i < len(model.layers) + model.cfg.mtp_layers:
        return []  # a multi-token-prediction layer (models/deepseek.py)
    if i >= len(model.layers):
        raise ModelConfigError(f"checkpoint weight {name!r}: layer {i} >= {len(model.layers)}")
    return _layer_targets(model.layers[i], i, rest, t)


def _layer_targets(layer, i: int, rest: str, t: torch.Tensor):
    attn, mlp = layer.self_attn, layer.mlp
    parts = rest.split(".")
    if rest in ("input_layernorm.weight", "post_attention_layernorm.weight"):
        return [(getattr(layer, parts[0]).weight, t)]
    if rest == "self_attn.sinks" and layer.self_attn.sinks is not None:
        return [(attn.sinks, t)]
    if parts[0] == "self_attn" and len(parts) == 3:
        mod, kind = parts[1], parts[2]
        if mod in _QKV:
            return [(_slice(attn.qkv_proj, kind, _QKV[mod]), t)]
        if mod in _MLA_A and hasattr(attn, "kv_b_proj"):
            return [(_slice(attn.qkv_proj, kind, _MLA_A[mod]), t)]
        if mod in _MLA_OWN and kind == "weight" and getattr(attn, mod, None) is not None:
            return [(getattr(attn, mod).weight, t)]
        if mod == "q_b_proj" and kind == "weight" + SCALE_SUFFIX and attn.q_b_proj is not None:
            return [(_slice(attn.q_b_proj, kind, 0), t)]
        if mod == "o_proj" and kind == "weight":
            return [(attn.o_proj.weight, t)]
        if mod == "o_proj" and kind == "weight" + SCALE_SUFFIX:
            return [(_slice(attn.o_proj, kind, 0), t)]
        if mod == "o_proj" and kind == "bias" and attn.o_proj.bias is not None:
            return [(attn.o_proj.bias, t)]
        if mod in ("q_norm", "k_norm") and hasattr(attn, mod):
            return [(getattr(attn, mod).weight, t)]
    if parts[0] == "mlp":
        return _mlp_targets(mlp, i, parts[1:], t)
    if parts[0] == "linear_attn" and isinstance(attn, GatedDeltaNet):
        found = _linear_targets(attn, ".".join(parts[1:]), t)
        if found is not None:
            return found
    raise ModelConfigError(f"checkpoint weight 'layers.{i}.{rest}' matches no module of the model")


def _linear_targets(attn: GatedDeltaNet, rest: str, t: torch.Tensor):
    """A gated DeltaNet weight's place, or None where it has none."""
    proj, _, kind = rest.partition(".")
    slices = LINEAR_IN[attn.la.grouped_projections]
    if proj in slices and kind == "weight":
        return [(_slice(attn.in_proj, kind, slices[proj]), t)]
    if rest in _LINEAR_OWN:
        return [(attn.get_parameter(_LINEAR_OWN[rest]), t)]
    return None


def _mlp_targets(mlp, i: int, parts: list[str], t: torch.Tensor):
    if isinstance(mlp, DenseMLP):
        found = _dense_targets(mlp, parts, t)
    elif parts == ["gate", "weight"]:
        found = [(mlp.gate, t)]
    elif parts == ["gate", "bias"] and mlp.gate_bias is not None:
        found = [(mlp.gate_bias, t)]
    elif parts == ["gate", "e_score_correction_bias"] and mlp.e_score_correction_bias is not None:
        found = [(mlp.e_score_correction_bias, t)]
    elif parts[0] == "experts":
        found = _expert_targets(mlp, parts[1:], t)
    elif parts == ["shared_expert_gate", "weight"] and mlp.shared_expert_gate is not None:
        found = [(mlp.shared_expert_gate, t)]
    elif parts[0] == "shared_expert" and mlp.shared_expert is not None:
        found = _dense_targets(mlp.shared_expert, parts[1:], t)
    else:
        found = None
    if found is None:
        name = f"layers.{i}.mlp.{'.'.join(parts)}"
        raise ModelConfigError(f"checkpoint weight {name!r} matches no module of the model")
    return found


def _expert_targets(mlp: SparseMoE, parts: list[str], t: torch.Tensor):
    """Fused 3D tensors (gate_up_proj [E, 2I, H], down_proj [E, H, I]) or one expert's."""
    I = mlp.w2.shape[2]
    if mlp.cfg.experts_layout == "interleaved_in_out":
        return _interleaved_targets(mlp, parts, t)
    if mlp.cfg.experts_fp8:
        return _fp8_targets(mlp, parts, t)
    if parts == ["gate_up_proj"]:
        return [(mlp.w13, t)]
    if parts == ["down_proj"]:
        return [(mlp.w2, t)]
    if len(parts) == 3 and parts[0].isdigit() and parts[2] == "weight":
        e, proj = int(parts[0]), parts[1]
        if e >= mlp.w13.shape[0]:
            return None
        if proj in _GATE_UP:
            s = _GATE_UP[proj]
            return [(mlp.w13[e, s * I : (s + 1) * I], t)]
        if proj == "down_proj":
            return [(mlp.w2[e], t)]
    return None


def _interleaved_targets(mlp: SparseMoE, parts: list[str], t: torch.Tensor):
    """GPT-OSS's experts, converted once: gate_up_proj [E, H, 2I] with gate in the even
    columns and up in the odd ones -> w13 [E, 2I, H] gate rows then up rows; down_proj
    [E, I, H] -> w2 [E, H, I]; the biases alike."""
    name = ".".join(parts)
    if name in ("gate_up_proj", "down_proj") and mlp.cfg.experts_mxfp4:
        return _packed_targets(mlp, name, t)
    if name == "gate_up_proj" and t.dim() == 3:
        return [(mlp.w13, _deinterleave(t, dim=2).transpose(1, 2))]
    if name == "gate_up_proj_bias" and mlp.w13_bias is not None:
        return [(mlp.w13_bias, _deinterleave(t, dim=1))]
    if name == "down_proj" and t.dim() == 3:
        return [(mlp.w2, t.transpose(1, 2))]
    if name == "down_proj_bias" and mlp.w2_bias is not None:
        return [(mlp.w2_bias, t)]
    return None


def _packed_targets(mlp: SparseMoE, name: str, t: torch.Tensor | Mxfp4Weight):
    """GPT-OSS's MXFP4 experts kept packed: the release's [E, out, in] codes and scales are
    moelora's [E, N, K] already (K = in); gate_up's rows are de-interleaved, whole rows of
    codes and scales, so no group is split."""
    if not isinstance(t, Mxfp4Weight):
        raise ModelConfigError(
            f"checkpoint weight {name!r} is not MXFP4 (*_blocks, *_scales), but the config's "
            "quantization_config says mxfp4"
        )
    if name == "gate_up_proj":
        w = mlp.w13
        return [
            (w.blocks, _deinterleave(t.blocks, dim=1)),
            (w.scales, _deinterleave(t.scales, dim=1)),
        ]
    return [(mlp.w2.blocks, t.blocks), (mlp.w2.scales, t.scales)]


def _fp8_targets(mlp: SparseMoE, parts: list[str], t: torch.Tensor):
    """Block-FP8 experts kept as codes and scales (ModelConfig.experts_fp8): a tensor of codes
    into the rows of Fp8Weight.codes its bf16 twin would fill (fused ones as they are: [E, 2I, H]
    and [E, H, I], moelora's layout), its X_scale_inv into the same blocks' rows of scale_inv.
    A per-expert gate and up each fill their half of w13's grid, which starts on a block."""
    name = ".".join(parts)
    scales = name.endswith(SCALE_SUFFIX)
    name = name.removesuffix(SCALE_SUFFIX)
    w13, w2 = mlp.w13, mlp.w2
    w13, w2 = (w13.scale_inv, w2.scale_inv) if scales else (w13.codes, w2.codes)
    if not scales and t.dtype != FP8_DTYPE:
        raise ModelConfigError(
            f"checkpoint weight 'experts.{name}' is {t.dtype}: expected float8_e4m3fn codes "
            f"with a {SCALE_SUFFIX}, as the model keeps its experts in block FP8"
        )
    e, _, rest = name.partition(".")
    if name in ("gate_up_proj", "down_proj"):
        return [(w13 if name == "gate_up_proj" else w2, t)]
    if not e.isdigit() or int(e) >= w13.shape[0] or rest not in _FP8_EXPERT:
        return None
    if rest == "down_proj.weight":
        return [(w2[int(e)], t)]
    if mlp.w2.shape[2] % FP8_BLOCK[0]:  # engine/build.py keeps these from such a model
        raise ModelConfigError(
            f"checkpoint weight 'experts.{name}': gate and up stored apart, expert intermediate "
            f"size {mlp.w2.shape[2]} not a multiple of {FP8_BLOCK[0]}: their blocks cannot share "
            "the fused MoE's one grid of scales"
        )
    half, s = w13.shape[1] // 2, _FP8_EXPERT[rest]
    return [(w13[int(e), s * half : (s + 1) * half], t)]


def _deinterleave(t: torch.Tensor, *, dim: int) -> torch.Tensor:
    """Alternate entries along dim (gate, up, gate, up, ...) -> all gates, then all ups."""
    n = t.shape[dim]
    halves = [t.index_select(dim, torch.arange(s, n, 2, device=t.device)) for s in (0, 1)]
    return torch.cat(halves, dim=dim)


def _dense_targets(mlp: DenseMLP, parts: list[str], t: torch.Tensor):
    if len(parts) != 2 or parts[1] != "weight":
        return None
    size = mlp.down_proj.in_features
    if parts[0] in _GATE_UP:
        s = _GATE_UP[parts[0]]
        return [(mlp.gate_up_proj.weight[s * size : (s + 1) * size], t)]
    if parts[0] == "down_proj":
        return [(mlp.down_proj.weight, t)]
    return None


def _slice(linear, kind: str, index: int) -> torch.Tensor:
    """The rows of slice `index` of a LoraLinear's weight, bias or weight_scale_inv (a kept FP8
    weight's: its slices before the last end on a block, LoraLinear's invariant)."""
    offsets = [0]
    for size in linear.out_slices:
        offsets.append(offsets[-1] + size)
    full = getattr(linear, kind, None) if kind in _LINEAR_PARTS else None
    if full is None:
        raise ModelConfigError(f"checkpoint has a {kind} this model's config does not declare")
    if kind == "weight" + SCALE_SUFFIX:  # rows of 128-row blocks
        rows = FP8_BLOCK[0]
        return full[offsets[index] // rows : -(-offsets[index + 1] // rows)]
    return full[offsets[index] : offsets[index + 1]]


def settle(model: MoeCausalLM) -> None:
    """What a model's layers derive from their weights once loaded, dummy or not (the MoE
    layers' MXFP4 scale range, their input products made one)."""
    for module in model.modules():
        if isinstance(module, SparseMoE):
            module.settle_packed()
            module.fuse_inputs()


def fill_dummy(model: MoeCausalLM, seed: int) -> None:
    """load_format='dummy': random weights of a sensible scale, made on the model's device."""
    gen = torch.Generator(device=model.embed_tokens.device).manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.fill_(1.0)
        elif p.dtype == FP8_DTYPE:  # FP8 codes, one expert (or projection) at a time: e4m3's range
            for codes in p if p.dim() == 3 else [p]:
                full = torch.empty(codes.shape, device=codes.device)
                codes.copy_(full.uniform_(-FP8_MAX, FP8_MAX, generator=gen))
        elif name.endswith(SCALE_SUFFIX):  # their scales: weights within +-0.02 as the rest
            p.fill_(0.02 / FP8_MAX)
        elif name.endswith("_blocks"):  # MXFP4 experts, made packed: every code
            p.random_(0, 256, generator=gen)
        elif name.endswith("_scales"):  # 2^-8 .. 2^-6 times codes of mean size 2.25: ~0.02
            p.random_(119, 122, generator=gen)
        else:
            p.uniform_(-0.02, 0.02, generator=gen)
