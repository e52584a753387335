"""HF `architectures` name -> the function that reads its config into a ModelConfig."""

from __future__ import annotations

from collections.abc import Callable

from moelora.config import ModelConfig
from moelora.errors import ModelConfigError
from moelora.models import (
    deepseek,
    glm4_moe,
    gpt_oss,
    mixtral,
    olmoe,
    qwen2_moe,
    qwen3_moe,
    qwen3_next,
)

ARCHITECTURES: dict[str, Callable] = {
    "Qwen3MoeForCausalLM": qwen3_moe.model_config,
    "Qwen2MoeForCausalLM": qwen2_moe.model_config,
    "MixtralForCausalLM": mixtral.model_config,
    "OlmoeForCausalLM": olmoe.model_config,
    "GptOssForCausalLM": gpt_oss.model_config,
    "DeepseekV2ForCausalLM": deepseek.v2_model_config,
    "DeepseekV3ForCausalLM": deepseek.v3_model_config,
    "Glm4MoeForCausalLM": glm4_moe.model_config,
    "Qwen3NextForCausalLM": qwen3_next.next_model_config,
    "Qwen3_5MoeForCausalLM": qwen3_next.qwen3_5_moe_model_config,
    "Qwen3_5MoeForConditionalGeneration": qwen3_next.qwen3_5_moe_model_config,
}
# multimodal checkpoints served as their text model: its text_config is the model's config
_TEXT_MODEL_OF = ("Qwen3_5MoeForConditionalGeneration",)


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
            if arch in _TEXT_MODEL_OF:
                hf = hf.get_text_config()
            if getattr(hf, "use_sliding_window", False):
                raise ModelConfigError(
                    f"{model_path}: use_sliding_window=True is not supported: expected False"
                )
            mc = ARCHITECTURES[arch](hf)
            _check_partial_rotary(model_path, hf, mc)
            return mc, hf
    raise ModelConfigError(
        f"{model_path}: architectures={archs} is not supported: expected one of "
        f"{sorted(ARCHITECTURES)}"
    )


def _check_partial_rotary(model_path: str, hf, mc: ModelConfig) -> None:
    """Rotary on part of each head only where the architecture reads it (ModelConfig.rotary_dim)."""
    factor = (getattr(hf, "rope_parameters", None) or {}).get("partial_rotary_factor") or 1.0
    if factor != 1.0 and not mc.rotary_dim:
        raise ModelConfigError(
            f"{model_path}: partial_rotary_factor={factor} is not supported for {mc.arch}: "
            "expected 1.0"
        )
