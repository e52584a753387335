"""Qwen2-MoE: qkv bias, a shared expert behind a sigmoid gate, optional dense layers."""

from moelora.config import ModelConfig
from moelora.models import common


def model_config(hf) -> ModelConfig:
    return common.model_config(
        hf,
        "qwen2_moe",
        qkv_bias=bool(getattr(hf, "qkv_bias", True)),
        shared_expert_intermediate_size=hf.shared_expert_intermediate_size or 0,
        sparse_layers=common.sparse_layer_pattern(hf),
    )
