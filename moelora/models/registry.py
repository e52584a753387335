"""HF `architectures` name -> the function that reads its config into a ModelConfig."""

from __future__ import annotations

from collections.abc import Callable

from moelora.config import ModelConfig
from moelora.errors import ModelConfigError
from moelora.models import gpt_oss, mixtral, olmoe, qwen2_moe, qwen3_moe

ARCHITECTURES: dict[str, Callable] = {
    "Qwen3MoeForCausalLM": qwen3_moe.model_config,
    "Qwen2MoeForCausalLM": qwen2_moe.model_config,
    "MixtralForCausalLM": mixtral.model_config,
    "OlmoeForCausalLM": olmoe.model_config,
    "GptOssForCausalLM": gpt_oss.model_config,
}


def read_model_config(model_path: str) -> tuple[ModelConfig, object]:
    """The ModelConfig and the HF config (kept for rotary parameters)."""
    from transformers import AutoConfig

    try:
        hf = AutoConfig.from_pretrained(model_path)
    except (OSError, ValueError) as e:
        raise ModelConfigError(f"cannot read a model config from {model_path!r}: {e}") from e
    archs = getattr(hf, "architectures", None) or []
    for arch in archs:
        if arch in ARCHITECTURES:
            if getattr(hf, "use_sliding_window", False):
                raise ModelConfigError(
                    f"{model_path}: use_sliding_window=True is not supported: expected False"
                )
            return ARCHITECTURES[arch](hf), hf
    raise ModelConfigError(
        f"{model_path}: architectures={archs} is not supported: expected one of "
        f"{sorted(ARCHITECTURES)}"
    )
