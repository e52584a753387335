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
  --mxfp4), a CUDA engine makes them packed MXFP4 instead (kernels/moe/mxfp4_layout.py), never bf16;
- deepseek-v2-lite: deepseek-ai/DeepSeek-V2-Lite (27 layers, MLA without q_lora_rank, 64
  experts, top-6, 2 shared, hidden 2048, expert intermediate 1408, YaRN);
- moonlight-16b-a3b: moonshotai/Moonlight-16B-A3B, the DeepSeek-V3 architecture at that size
  (sigmoid routing with a correction bias, routed_scaling_factor 2.446);
- glm-4.5-air: zai-org/GLM-4.5-Air (128 experts, top-8, hidden 4096, 96 query and 8 KV heads of
  128, half of each head rotated) at 24 of its 46 layers: the whole model does not fit on one
  H200 in bf16 (shape_config(num_layers=46) gives the release's depth);
- glm-4.5-air-fp8: GLM-4.5-Air whole (46 layers, 106B parameters) with FP8_QUANTIZATION as its
  quantization_config: the largest MoE of the served families that one H200 holds only in FP8
  (experts kept block-FP8, the rest bf16: 114 GB of weights; bf16: 214 GB). No Qwen3-MoE,
  Mixtral, Qwen2-MoE or OLMoE release falls between: Qwen3-235B-A22B needs 235 GB in FP8,
  Mixtral-8x22B 146 GB (no room left for a KV cache), and the others fit in bf16. An engine
  that does not keep the experts FP8 (ModelConfig.experts_fp8) makes them bf16: too big;
- qwen3.5-moe-35b-a3b: Qwen3.5-35B-A3B's text model (40 layers, three gated DeltaNet to one
  gated attention, 256 experts, top-8, a gated shared expert, hidden 2048, expert intermediate
  512), transformers' Qwen3_5MoeTextConfig defaults;
- qwen3-next-80b-a3b: Qwen3-Next-80B-A3B (48 layers, the same pattern, 512 experts, top-10),
  transformers' Qwen3NextConfig defaults.
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
# the block-FP8 quantization_config of Qwen3-*-FP8 (models/quantization.py reads it): e4m3 codes,
# a float32 scale per 128x128 block, activations quantized at run time
FP8_QUANTIZATION: Mapping[str, object] = MappingProxyType(
    dict(quant_method="fp8", fmt="e4m3", activation_scheme="dynamic", weight_block_size=[128, 128])
)
# deepseek-ai/DeepSeek-V2-Lite's config.json (its auto_map and torch_dtype left out)
DEEPSEEK_V2_LITE: Mapping[str, object] = MappingProxyType(
    dict(
        architectures=["DeepseekV2ForCausalLM"],
        model_type="deepseek_v2",
        vocab_size=102400,
        hidden_size=2048,
        intermediate_size=10944,
        moe_intermediate_size=1408,
        num_hidden_layers=27,
        num_attention_heads=16,
        num_key_value_heads=16,
        n_shared_experts=2,
        n_routed_experts=64,
        num_experts_per_tok=6,
        routed_scaling_factor=1.0,
        kv_lora_rank=512,
        q_lora_rank=None,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        topk_method="greedy",
        n_group=1,
        topk_group=1,
        norm_topk_prob=False,
        first_k_dense_replace=1,
        moe_layer_freq=1,
        max_position_embeddings=163840,
        rope_theta=10000,
        rope_scaling=dict(
            type="yarn",
            factor=40,
            original_max_position_embeddings=4096,
            beta_fast=32,
            beta_slow=1,
            mscale=0.707,
            mscale_all_dim=0.707,
        ),
        rms_norm_eps=1e-6,
        attention_bias=False,
        tie_word_embeddings=False,
        hidden_act="silu",
        bos_token_id=100000,
        eos_token_id=100001,
    )
)
# moonshotai/Moonlight-16B-A3B's config.json
MOONLIGHT_16B_A3B: Mapping[str, object] = MappingProxyType(
    dict(
        architectures=["DeepseekV3ForCausalLM"],
        model_type="deepseek_v3",
        vocab_size=163840,
        hidden_size=2048,
        intermediate_size=11264,
        moe_intermediate_size=1408,
        num_hidden_layers=27,
        num_attention_heads=16,
        num_key_value_heads=16,
        n_shared_experts=2,
        n_routed_experts=64,
        num_experts_per_tok=6,
        routed_scaling_factor=2.446,
        kv_lora_rank=512,
        q_lora_rank=None,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        n_group=1,
        topk_group=1,
        norm_topk_prob=True,
        first_k_dense_replace=1,
        moe_layer_freq=1,
        max_position_embeddings=8192,
        rope_theta=50000.0,
        rms_norm_eps=1e-5,
        attention_bias=False,
        tie_word_embeddings=False,
        hidden_act="silu",
        bos_token_id=163584,
        eos_token_id=163585,
    )
)
# zai-org/GLM-4.5-Air's config.json, at 24 of its 46 layers (bf16 weights of all 46: 212 GB)
GLM_4_5_AIR: Mapping[str, object] = MappingProxyType(
    dict(
        architectures=["Glm4MoeForCausalLM"],
        model_type="glm4_moe",
        vocab_size=151552,
        hidden_size=4096,
        intermediate_size=10944,
        moe_intermediate_size=1408,
        num_hidden_layers=24,
        num_attention_heads=96,
        num_key_value_heads=8,
        head_dim=128,
        n_routed_experts=128,
        n_shared_experts=1,
        num_experts_per_tok=8,
        first_k_dense_replace=1,
        n_group=1,
        topk_group=1,
        routed_scaling_factor=1.0,
        norm_topk_prob=True,
        partial_rotary_factor=0.5,
        rope_theta=1000000,
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
        attention_bias=True,
        use_qk_norm=False,
        num_nextn_predict_layers=1,
        tie_word_embeddings=False,
        hidden_act="silu",
        pad_token_id=151329,
        eos_token_id=[151329, 151336, 151338],
    )
)

GLM_4_5_AIR_FP8: Mapping[str, object] = MappingProxyType(
    {
        **GLM_4_5_AIR,
        "num_hidden_layers": 46,
        "quantization_config": dict(FP8_QUANTIZATION),
    }
)


def _qwen3_next(arch: str, model_type: str, **differs: object) -> Mapping[str, object]:
    """The hybrid Qwen shapes: transformers 5.17's default config of each class (three gated
    DeltaNet layers, then one gated full attention, over and over)."""
    common: dict[str, object] = dict(
        architectures=[arch],
        model_type=model_type,
        vocab_size=151936,
        hidden_size=2048,
        num_hidden_layers=48,
        num_attention_heads=16,
        num_key_value_heads=2,
        head_dim=256,
        linear_num_key_heads=16,
        linear_num_value_heads=32,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_conv_kernel_dim=4,
        moe_intermediate_size=512,
        shared_expert_intermediate_size=512,
        rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25),
        max_position_embeddings=32768,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        hidden_act="silu",
    )
    config = {**common, **differs}
    config["layer_types"] = (["linear_attention"] * 3 + ["full_attention"]) * (
        int(config["num_hidden_layers"]) // 4  # type: ignore[call-overload]
    )
    return MappingProxyType(config)


# the text model of Qwen3.5-35B-A3B (Qwen3_5MoeTextConfig's defaults: 40 layers, 256 experts
# top-8); and Qwen3-Next-80B-A3B (Qwen3NextConfig's: 48 layers, 512 experts top-10)
QWEN3_5_MOE_35B_A3B = _qwen3_next(
    "Qwen3_5MoeForCausalLM",
    "qwen3_5_moe_text",
    vocab_size=248320,
    num_hidden_layers=40,
    num_experts=256,
    num_experts_per_tok=8,
)
QWEN3_NEXT_80B_A3B = _qwen3_next(
    "Qwen3NextForCausalLM",
    "qwen3_next",
    num_experts=512,
    num_experts_per_tok=10,
    intermediate_size=5632,
    norm_topk_prob=True,
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
        "deepseek-v2-lite": DEEPSEEK_V2_LITE,
        "moonlight-16b-a3b": MOONLIGHT_16B_A3B,
        "glm-4.5-air": GLM_4_5_AIR,
        "glm-4.5-air-fp8": GLM_4_5_AIR_FP8,
        "qwen3.5-moe-35b-a3b": QWEN3_5_MOE_35B_A3B,
        "qwen3-next-80b-a3b": QWEN3_NEXT_80B_A3B,
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
