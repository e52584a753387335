"""Qwen3-MoE: per-head q/k RMSNorm, no qkv bias, optional dense layers."""

from moelora.models.config import ModelConfig, common_fields, sparse_layer_pattern


def model_config(hf) -> ModelConfig:
    return ModelConfig(
        **common_fields(hf, "qwen3_moe"),
        qkv_bias=bool(getattr(hf, "attention_bias", False)),
        qk_norm="head",
        num_experts=hf.num_experts,
        top_k=hf.num_experts_per_tok,
        moe_intermediate_size=hf.moe_intermediate_size,
        renormalize=bool(hf.norm_topk_prob),
        sparse_layers=sparse_layer_pattern(hf),
    )
