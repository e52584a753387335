"""Mixtral: every layer sparse, top-k weights always renormalised, no qk norm, no bias."""

from moelora.models.config import ModelConfig, common_fields


def model_config(hf) -> ModelConfig:
    fields = common_fields(hf, "mixtral")
    window = getattr(hf, "sliding_window", None)
    if window:
        # attention is full within the window: serve sequences no longer than it
        fields["max_position_embeddings"] = min(fields["max_position_embeddings"], window)
    return ModelConfig(
        **fields,
        qkv_bias=False,
        qk_norm="none",
        num_experts=hf.num_local_experts,
        top_k=hf.num_experts_per_tok,
        moe_intermediate_size=hf.intermediate_size,
        renormalize=True,
        sparse_layers=(True,) * hf.num_hidden_layers,
    )
