"""GPT-OSS: sliding-window and full attention layers as `layer_types` says, attention sinks,
biases on q/k/v/o, the router and the experts, YaRN rotary, top-k over the router's logits then
a softmax over the k chosen (the same weights as a softmax, top-k and renormalize), the clamped
SwiGLU, and fused experts stored [E, in, out] with gate and up in alternate columns (converted
once at load: loader.py)."""

from moelora.config import ModelConfig
from moelora.errors import ModelConfigError
from moelora.models import common
from moelora.models.quantization import quant_method

_LAYER_TYPES = ("sliding_attention", "full_attention")
# what GPT-OSS's released checkpoints hold: bf16 tensors or MXFP4 experts (*_blocks, *_scales)
_QUANT_METHODS = ("mxfp4",)


def model_config(hf) -> ModelConfig:
    layer_types = list(getattr(hf, "layer_types", None) or [])
    if len(layer_types) != hf.num_hidden_layers or set(layer_types) - set(_LAYER_TYPES):
        raise ModelConfigError(
            f"layer_types={layer_types} is not supported: expected {hf.num_hidden_layers} "
            f"entries, each one of {list(_LAYER_TYPES)}"
        )
    window = getattr(hf, "sliding_window", None) or 0
    if "sliding_attention" in layer_types and window < 1:
        raise ModelConfigError(
            f"sliding_window={window!r} is not supported with sliding_attention layers: "
            "expected an integer >= 1"
        )
    if not getattr(hf, "attention_bias", True):
        raise ModelConfigError("attention_bias=False is not supported for gpt_oss: expected True")
    mxfp4 = quant_method(hf, "gpt_oss", _QUANT_METHODS) == "mxfp4"
    for name in ("hidden_size", "intermediate_size"):
        if mxfp4 and getattr(hf, name) % 32:
            raise ModelConfigError(
                f"{name}={getattr(hf, name)} is not supported with MXFP4 experts: expected a "
                "multiple of 32 (the format's groups)"
            )
    return common.model_config(
        hf,
        "gpt_oss",
        quant_methods=_QUANT_METHODS,
        num_experts=hf.num_local_experts,
        moe_intermediate_size=hf.intermediate_size,
        intermediate_size=0,
        renormalize=True,
        qkv_bias=True,
        sliding_window=window,
        sliding_layers=tuple(t == "sliding_attention" for t in layer_types),
        attention_sinks=True,
        o_bias=True,
        router_bias=True,
        expert_bias=True,
        activation="swiglu_oai",
        experts_layout="interleaved_in_out",
        experts_mxfp4=mxfp4,
    )
