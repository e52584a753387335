"""OLMoE: q/k RMSNorm over all heads at once, optional qkv clipping, every layer sparse."""

from moelora.models.config import ModelConfig, common_fields


def model_config(hf) -> ModelConfig:
    fields = common_fields(hf, "olmoe")
    fields["clip_qkv"] = getattr(hf, "clip_qkv", None)
    return ModelConfig(
        **fields,
        qkv_bias=bool(getattr(hf, "attention_bias", False)),
        qk_norm="full",
        num_experts=hf.num_experts,
        top_k=hf.num_experts_per_tok,
        moe_intermediate_size=hf.intermediate_size,
        renormalize=bool(hf.norm_topk_prob),
        sparse_layers=(True,) * hf.num_hidden_layers,
    )
