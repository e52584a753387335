"""Mixtral: every layer sparse, top-k weights always renormalised, no qk norm, no bias."""

from moelora.config import ModelConfig
from moelora.models import common


def model_config(hf) -> ModelConfig:
    max_len = hf.max_position_embeddings
    window = getattr(hf, "sliding_window", None)
    if window:
        # attention is full within the window: serve sequences no longer than it
        max_len = min(max_len, window)
    return common.model_config(
        hf,
        "mixtral",
        max_position_embeddings=max_len,
        qkv_bias=False,
        num_experts=hf.num_local_experts,
        moe_intermediate_size=hf.intermediate_size,
        renormalize=True,
    )
