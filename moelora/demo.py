"""The built-in demo: a tiny random Qwen3-MoE checkpoint, its tokenizer and two LoRA adapters.

Everything is written deterministically (fixed seeds, a private torch.Generator) into a cache
folder, once. The folder is built under a temporary name and renamed into place, so a crash
never leaves a half-written demo behind; a marker file says the folder is complete.

The adapters use the two PEFT layouts moelora reads for MoE experts:
- `sql`: per-expert keys `mlp.experts.{e}.{gate,up,down}_proj`, plus attention q/k/v/o, r=8;
- `chat`: PEFT's `target_parameters` on the fused 3D expert weights, plus attention q/v, r=4.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from moelora.models.shapes import DEMO_SHAPE, ModelShape, model_config

DEMO_VERSION = "2"  # 2: the chat template renders tools
MARKER = "COMPLETE"
ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [ENDOFTEXT, IM_START, IM_END]
NUM_MERGES = 200

# ChatML, with Qwen's Hermes tool calls: an assistant's calls as <tool_call>{"name": ...,
# "arguments": ...}</tool_call>, tool results in a user turn as <tool_response>. The tools are
# listed by name only, in a system turn of their own: the demo's context is short. A chat
# without tools renders as plain ChatML.
CHATML_TEMPLATE = (
    "{% if tools %}{{ '<|im_start|>system\\nTools: ' }}"
    "{{ tools | map(attribute='function') | map(attribute='name') | join(', ') }}"
    '{{ \'. Call one as <tool_call>{"name": ..., "arguments": ...}</tool_call><|im_end|>\\n\' }}'
    "{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'tool' %}"
    "{{ '<|im_start|>user\\n<tool_response>\\n' + message['content'] + "
    "'\\n</tool_response><|im_end|>\\n' }}"
    "{% else %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] }}"
    "{% for call in message.get('tool_calls') or [] %}"
    "{% set args = call['function']['arguments'] %}"
    "{{ '\\n<tool_call>\\n{\"name\": \"' + call['function']['name'] + '\", \"arguments\": ' + "
    "(args if args is string else (args | tojson)) + '}\\n</tool_call>' }}"
    "{% endfor %}"
    "{{ '<|im_end|>' + '\\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# The text the demo tokenizer learns its merges from: a little English and a little SQL.
MERGE_TEXT = """
The quick brown fox jumps over the lazy dog. A mixture of experts routes each token to a few
experts out of many, so the model is large but every token touches only a small part of it.
Low-rank adapters add a small trained update to the weights of a model; many adapters can be
served in one batch, each request choosing its own. What is the capital of France? Paris is the
capital of France. Write a question and answer it in one sentence. Tell me a story about a cat.
SELECT name, count(*) FROM users WHERE age > 30 GROUP BY name ORDER BY name LIMIT 10;
SELECT id FROM orders JOIN users ON orders.user_id = users.id WHERE total > 100;
INSERT INTO users (name, age) VALUES ('alice', 31); UPDATE users SET age = 32 WHERE id = 1;
"""


@dataclass(frozen=True)
class DemoAssets:
    model: Path
    adapters: dict[str, Path]


ATTENTION_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj"]


def default_cache_dir() -> Path:
    return Path.home() / ".cache" / "moelora" / "demo"


def ensure_demo(cache_dir: Path | None = None) -> DemoAssets:
    """Return the demo's paths, writing the demo into `cache_dir` first if it is not complete."""
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    if not _is_complete(root):
        _build_atomically(root)
    return _assets(root)


def _assets(root: Path) -> DemoAssets:
    adapters = {name: root / "adapters" / name for name in ("sql", "chat")}
    return DemoAssets(model=root / "model", adapters=adapters)


def _is_complete(root: Path) -> bool:
    marker = root / MARKER
    return marker.is_file() and marker.read_text().strip() == DEMO_VERSION


def _build_atomically(root: Path) -> None:
    root.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{root.name}.tmp-", dir=root.parent))
    tmp.chmod(0o755)
    try:
        _write_demo(tmp)
        (tmp / MARKER).write_text(DEMO_VERSION + "\n")
        if root.exists():  # an old version, or a folder left by someone else: replace it
            shutil.rmtree(root, ignore_errors=True)
        try:
            os.replace(tmp, root)
        except OSError:
            if not _is_complete(root):  # another process did not win the race either
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _write_demo(root: Path) -> None:
    model = root / "model"
    model.mkdir(parents=True)
    write_model(model, DEMO_SHAPE, write_tokenizer(model), seed=0)
    adapters = _assets(root).adapters
    write_per_expert_adapter(adapters["sql"], DEMO_SHAPE, rank=8, seed=1)
    write_target_parameters_adapter(adapters["chat"], DEMO_SHAPE, rank=4, seed=2)


# ----------------------------------------------------------------------------- tokenizer


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: every byte maps to one printable character."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, map(chr, chars)))


def _learn_merges(words: list[str], num_merges: int) -> list[tuple[str, str]]:
    """Plain BPE over byte-level words; ties broken by the pair itself, so it is deterministic."""
    counts = Counter(words)
    splits = {word: list(word) for word in counts}
    merges: list[tuple[str, str]] = []
    for _ in range(num_merges):
        pairs: Counter[tuple[str, str]] = Counter()
        for word, n in counts.items():
            parts = splits[word]
            for pair in zip(parts, parts[1:]):
                pairs[pair] += n
        if not pairs:
            break
        best = max(pairs, key=lambda p: (pairs[p], p))
        merges.append(best)
        for word, parts in splits.items():
            merged, i = [], 0
            while i < len(parts):
                if i + 1 < len(parts) and (parts[i], parts[i + 1]) == best:
                    merged.append(parts[i] + parts[i + 1])
                    i += 2
                else:
                    merged.append(parts[i])
                    i += 1
            splits[word] = merged
    return merges


@dataclass(frozen=True)
class TokenizerInfo:
    vocab_size: int
    eos_ids: list[int]  # <|im_end|>, then <|endoftext|>
    quiet_ids: list[int]  # special tokens and tokens that are not printable ASCII


def write_tokenizer(folder: Path) -> TokenizerInfo:
    """Write a byte-level BPE tokenizer with ChatML special tokens."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    words = [w for w, _ in pre_tokenizer.pre_tokenize_str(MERGE_TEXT)]
    merges = _learn_merges(words, NUM_MERGES)
    vocab = {ch: i for i, ch in enumerate(_bytes_to_unicode().values())}
    for left, right in merges:
        vocab.setdefault(left + right, len(vocab))
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tokenizer.pre_tokenizer = pre_tokenizer
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(t, special=True) for t in SPECIAL_TOKENS])
    tokenizer.save(str(folder / "tokenizer.json"))

    ids = {t: tokenizer.token_to_id(t) for t in SPECIAL_TOKENS}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": IM_END,
        "pad_token": ENDOFTEXT,
        "additional_special_tokens": [IM_START, IM_END],
        "add_bos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 2048,
        "chat_template": CHATML_TEMPLATE,
    }
    _write_json(folder / "tokenizer_config.json", config)
    byte_of = {ch: b for b, ch in _bytes_to_unicode().items()}
    printable = {*range(0x20, 0x7F), ord("\n")}
    noisy = [i for t, i in vocab.items() if any(byte_of[ch] not in printable for ch in t)]
    return TokenizerInfo(
        vocab_size=tokenizer.get_vocab_size(),
        eos_ids=[ids[IM_END], ids[ENDOFTEXT]],
        quiet_ids=sorted([*noisy, *ids.values()]),
    )


# ----------------------------------------------------------------------------- model


def _randn(gen: torch.Generator, *shape: int, std: float) -> torch.Tensor:
    return torch.randn(*shape, generator=gen) * std


def _norm_weight(gen: torch.Generator, n: int) -> torch.Tensor:
    return 1.0 + _randn(gen, n, std=0.1)


def model_weights(shape: ModelShape, tok: TokenizerInfo, *, seed: int) -> dict[str, torch.Tensor]:
    """Random weights at a scale that keeps every sublayer's output comparable to the residual,
    so the greedy continuation depends on the context and on the adapter.

    The lm_head rows of special and unprintable tokens are shrunk, so greedy text is readable
    gibberish that rarely ends early.
    """
    gen = torch.Generator().manual_seed(seed)
    vocab_size = tok.vocab_size
    h, d, i = shape.hidden, shape.head_dim, shape.expert_intermediate
    q, kv = shape.q_heads * d, shape.kv_heads * d
    w = {"model.embed_tokens.weight": _randn(gen, vocab_size, h, std=1.0)}
    for layer in range(shape.layers):
        p = f"model.layers.{layer}."
        w[p + "input_layernorm.weight"] = _norm_weight(gen, h)
        w[p + "post_attention_layernorm.weight"] = _norm_weight(gen, h)
        w[p + "self_attn.q_proj.weight"] = _randn(gen, q, h, std=h**-0.5)
        w[p + "self_attn.k_proj.weight"] = _randn(gen, kv, h, std=h**-0.5)
        w[p + "self_attn.v_proj.weight"] = _randn(gen, kv, h, std=h**-0.5)
        w[p + "self_attn.o_proj.weight"] = _randn(gen, h, q, std=q**-0.5)
        w[p + "self_attn.q_norm.weight"] = _norm_weight(gen, d)
        w[p + "self_attn.k_norm.weight"] = _norm_weight(gen, d)
        w[p + "mlp.gate.weight"] = _randn(gen, shape.experts, h, std=2 * h**-0.5)
        for e in range(shape.experts):
            pe = f"{p}mlp.experts.{e}."
            w[pe + "gate_proj.weight"] = _randn(gen, i, h, std=h**-0.5)
            w[pe + "up_proj.weight"] = _randn(gen, i, h, std=h**-0.5)
            w[pe + "down_proj.weight"] = _randn(gen, h, i, std=2 * i**-0.5)
    w["model.norm.weight"] = _norm_weight(gen, h)
    w["lm_head.weight"] = _randn(gen, vocab_size, h, std=4 * h**-0.5)
    w["lm_head.weight"][tok.quiet_ids] *= 0.1
    return w


def write_model(folder: Path, shape: ModelShape, tok: TokenizerInfo, *, seed: int) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    config = model_config(shape, vocab_size=tok.vocab_size, eos_ids=tok.eos_ids)
    _write_json(folder / "config.json", config)
    generation = {"eos_token_id": tok.eos_ids, "pad_token_id": tok.eos_ids[1], "do_sample": False}
    _write_json(folder / "generation_config.json", generation)
    weights = model_weights(shape, tok, seed=seed)
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})


# ----------------------------------------------------------------------------- adapters


def _lora_pair(gen: torch.Generator, rank: int, d_in: int, d_out: int) -> tuple:
    # B is random too (PEFT starts it at zero): an adapter must visibly change the output.
    a = _randn(gen, rank, d_in, std=d_in**-0.5)
    b = _randn(gen, d_out, rank, std=rank**-0.5)
    return a, b


def _attention_dims(shape: ModelShape) -> dict[str, tuple[int, int]]:
    q, kv = shape.q_heads * shape.head_dim, shape.kv_heads * shape.head_dim
    h = shape.hidden
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h)}


def _adapter_config(rank: int, alpha: float, target_modules: list[str], **extra) -> dict:
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": "moelora-demo",
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": 0.0,
        "target_modules": target_modules,
        "bias": "none",
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "fan_in_fan_out": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "rank_pattern": {},
        "alpha_pattern": {},
        **extra,
    }


def write_per_expert_adapter(
    folder: Path, shape: ModelShape, *, rank: int, seed: int, alpha: float | None = None
) -> None:
    """PEFT adapter on attention q/k/v/o and every expert's gate/up/down, one key per expert."""
    gen = torch.Generator().manual_seed(seed)
    h, i = shape.hidden, shape.expert_intermediate
    expert_dims = {"gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}
    tensors: dict[str, torch.Tensor] = {}
    for layer in range(shape.layers):
        p = f"base_model.model.model.layers.{layer}."
        for name, (d_in, d_out) in _attention_dims(shape).items():
            _put_pair(tensors, f"{p}self_attn.{name}", _lora_pair(gen, rank, d_in, d_out))
        for e in range(shape.experts):
            for name, (d_in, d_out) in expert_dims.items():
                key = f"{p}mlp.experts.{e}.{name}"
                _put_pair(tensors, key, _lora_pair(gen, rank, d_in, d_out))
    targets = [*ATTENTION_MODULES, *expert_dims]
    config = _adapter_config(rank, alpha if alpha is not None else 2.0 * rank, targets)
    _write_adapter(folder, config, tensors)


def write_target_parameters_adapter(
    folder: Path, shape: ModelShape, *, rank: int, seed: int, alpha: float | None = None
) -> None:
    """PEFT >= 0.17 adapter on the fused 3D expert weights (`target_parameters`) plus q/v.

    E = experts, r = rank. gate_up: lora_A [r*E, H], lora_B [2I, r*E]; down: lora_A [r*E, I],
    lora_B [H, r*E]. Expert e uses A[e*r:(e+1)*r] and B[:, e::E] (B is interleaved).
    """
    gen = torch.Generator().manual_seed(seed)
    h, i, n = shape.hidden, shape.expert_intermediate, shape.experts
    dims = _attention_dims(shape)
    tensors: dict[str, torch.Tensor] = {}
    for layer in range(shape.layers):
        p = f"base_model.model.model.layers.{layer}."
        for name in ("q_proj", "v_proj"):
            _put_pair(tensors, f"{p}self_attn.{name}", _lora_pair(gen, rank, *dims[name]))
        a, b = _lora_pair(gen, rank * n, h, 2 * i)
        _put_pair(tensors, f"{p}mlp.experts.base_layer", (a, b * n**0.5))
        a, b = _lora_pair(gen, rank * n, i, h)
        _put_pair(tensors, f"{p}mlp.experts", (a, b * n**0.5))
    targets = ["q_proj", "v_proj"]
    extra = {"target_parameters": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]}
    config = _adapter_config(rank, alpha if alpha is not None else 2.0 * rank, targets, **extra)
    _write_adapter(folder, config, tensors)


def _put_pair(tensors: dict, prefix: str, pair: tuple[torch.Tensor, torch.Tensor]) -> None:
    tensors[f"{prefix}.lora_A.weight"] = pair[0].contiguous()
    tensors[f"{prefix}.lora_B.weight"] = pair[1].contiguous()


def _write_adapter(folder: Path, config: dict, tensors: dict[str, torch.Tensor]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    _write_json(folder / "adapter_config.json", config)
    save_file(tensors, str(folder / "adapter_model.safetensors"), metadata={"format": "pt"})


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n")
