"""Qwen2-MoE: qkv bias, a shared expert behind a sigmoid gate, optional dense layers."""

from moelora.models.config import ModelConfig, common_fields, sparse_layer_pattern


def model_config(hf) -> ModelConfig:
    fields = common_fields(hf, "qwen2_moe")
    fields["shared_expert_intermediate_size"] = hf.shared_expert_intermediate_size or 0
    return ModelConfig(
        **fields,
        qkv_bias=bool(getattr(hf, "qkv_bias", True)),
        qk_norm="none",
        num_experts=hf.num_experts,
        top_k=hf.num_experts_per_tok,
        moe_intermediate_size=hf.moe_intermediate_size,
        renormalize=bool(hf.norm_topk_prob),
        sparse_layers=sparse_layer_pattern(hf),
    )
