"""OLMoE: q/k RMSNorm over all heads at once, optional qkv clipping, every layer sparse."""

from moelora.config import ModelConfig
from moelora.models import common


def model_config(hf) -> ModelConfig:
    return common.model_config(
        hf,
        "olmoe",
        qk_norm="full",
        clip_qkv=getattr(hf, "clip_qkv", None),
        moe_intermediate_size=hf.intermediate_size,
    )
