"""Qwen3-MoE: per-head q/k RMSNorm, optional dense layers."""

from moelora.config import ModelConfig
from moelora.models import common


def model_config(hf) -> ModelConfig:
    return common.model_config(
        hf, "qwen3_moe", qk_norm="head", sparse_layers=common.sparse_layer_pattern(hf)
    )
