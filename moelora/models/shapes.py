"""Named model shapes: the config.json of a known architecture, for runs with random weights
(load_format="dummy", no checkpoint). The benchmarks and `moelora bench --shape NAME` build their
engines from these, so a figure can be reproduced without downloading a model.

- qwen3-30b-a3b: Qwen3-30B-A3B (48 layers, 128 experts, top-8, hidden 2048, expert
  intermediate 768), the benchmarks' default shape;
- tiny-qwen3-moe: the demo model's shape (2 layers, 8 experts, hidden 64), for CPU smoke runs;
- gpt-oss-20b, gpt-oss-120b: openai/gpt-oss-{20b,120b}'s config.json (24 / 36 layers, 32 / 128
  experts, top-4, hidden and expert intermediate 2880, 64 query and 8 KV heads of 64, a
  128-token window on every other layer), without its quantization_config: dummy weights are
  bf16 experts. With MXFP4_QUANTIZATION added as its quantization_config (bench/decode.py
  --mxfp4), a CUDA engine makes them packed MXFP4 instead (kernels/moe/mxfp4_layout.py), never bf16.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

from moelora.errors import ConfigError


@dataclass(frozen=True)
class ModelShape:
    hidden: int
    layers: int
    q_heads: int
    kv_heads: int
    head_dim: int
    experts: int
    top_k: int
    expert_intermediate: int
    intermediate: int  # of a dense MLP layer


DEMO_SHAPE = ModelShape(
    hidden=64,
    layers=2,
    q_heads=4,
    kv_heads=2,
    head_dim=16,
    experts=8,
    top_k=2,
    expert_intermediate=32,
    intermediate=128,
)


def model_config(shape: ModelShape, *, vocab_size: int, eos_ids: list[int]) -> dict:
    """A Qwen3-MoE config.json of `shape` (the demo writes its model with it)."""
    return {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "vocab_size": vocab_size,
        "hidden_size": shape.hidden,
        "intermediate_size": shape.intermediate,
        "moe_intermediate_size": shape.expert_intermediate,
        "num_hidden_layers": shape.layers,
        "num_attention_heads": shape.q_heads,
        "num_key_value_heads": shape.kv_heads,
        "head_dim": shape.head_dim,
        "num_experts": shape.experts,
        "num_experts_per_tok": shape.top_k,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "hidden_act": "silu",
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "rms_norm_eps": 1e-6,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": False,
        "max_position_embeddings": 2048,
        "use_sliding_window": False,
        "sliding_window": None,
        "router_aux_loss_coef": 0.001,
        "output_router_logits": False,
        "initializer_range": 0.02,
        "use_cache": True,
        "torch_dtype": "float32",
        "bos_token_id": None,
        "eos_token_id": eos_ids[0],
    }


QWEN3_30B_A3B: Mapping[str, object] = MappingProxyType(
    dict(
        architectures=["Qwen3MoeForCausalLM"],
        model_type="qwen3_moe",
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=6144,
        moe_intermediate_size=768,
        num_hidden_layers=48,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        num_experts=128,
        num_experts_per_tok=8,
        norm_topk_prob=True,
        rms_norm_eps=1e-6,
        max_position_embeddings=40960,  # the released config's
        rope_theta=1e6,
        tie_word_embeddings=False,
        hidden_act="silu",
        eos_token_id=151645,
    )
)


def _gpt_oss(num_layers: int, num_experts: int) -> Mapping[str, object]:
    return MappingProxyType(
        dict(
            architectures=["GptOssForCausalLM"],
            model_type="gpt_oss",
            vocab_size=201088,
            hidden_size=2880,
            intermediate_size=2880,
            num_hidden_layers=num_layers,
            num_attention_heads=64,
            num_key_value_heads=8,
            head_dim=64,
            num_local_experts=num_experts,
            num_experts_per_tok=4,
            sliding_window=128,
            layer_types=["sliding_attention", "full_attention"] * (num_layers // 2),
            attention_bias=True,
            rms_norm_eps=1e-5,
            max_position_embeddings=131072,
            rope_parameters=dict(
                rope_type="yarn",
                factor=32.0,
                beta_fast=32.0,
                beta_slow=1.0,
                truncate=False,
                original_max_position_embeddings=4096,
                rope_theta=150000.0,
            ),
            tie_word_embeddings=False,
            hidden_act="silu",
            eos_token_id=200002,
            pad_token_id=199999,
        )
    )


# openai/gpt-oss-*'s quantization_config: its experts are MXFP4, the rest bf16
MXFP4_QUANTIZATION: Mapping[str, object] = MappingProxyType(
    dict(
        quant_method="mxfp4",
        modules_to_not_convert=[
            "model.layers.*.self_attn",
            "model.layers.*.mlp.router",
            "model.embed_tokens",
            "lm_head",
        ],
    )
)
GPT_OSS_20B = _gpt_oss(24, 32)
GPT_OSS_120B = _gpt_oss(36, 128)
TINY_QWEN3_MOE: Mapping[str, object] = MappingProxyType(
    model_config(DEMO_SHAPE, vocab_size=512, eos_ids=[511])
)
SHAPES: Mapping[str, Mapping[str, object]] = MappingProxyType(
    {
        "qwen3-30b-a3b": QWEN3_30B_A3B,
        "tiny-qwen3-moe": TINY_QWEN3_MOE,
        "gpt-oss-20b": GPT_OSS_20B,
        "gpt-oss-120b": GPT_OSS_120B,
    }
)


def shape_config(name: str, *, num_layers: int | None = None) -> dict:
    """A copy of the named shape's config.json, with num_hidden_layers replaced if given."""
    if name not in SHAPES:
        raise ConfigError(f"shape {name!r} is unknown: expected one of {', '.join(SHAPES)}")
    config = copy.deepcopy(dict(SHAPES[name]))  # the shape's own lists stay as they are
    if num_layers is not None:
        config["num_hidden_layers"] = num_layers
        if "layer_types" in config:  # one entry a layer: the pattern goes on as it started
            types = config["layer_types"]
            config["layer_types"] = [types[i % len(types)] for i in range(num_layers)]
    return config


def write_config_folder(config: Mapping[str, object], folder: str | Path) -> Path:
    """A model folder holding only config.json: enough for load_format="dummy"."""
    path = Path(folder)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(dict(config), indent=1))
    return path
