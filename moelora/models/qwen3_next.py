"""Qwen3-Next (Qwen3NextForCausalLM) and Qwen3.5-MoE's text model (Qwen3_5MoeForCausalLM, and
the text model of Qwen3_5MoeForConditionalGeneration checkpoints): hybrid decoders where the
layers layer_types names "linear_attention" are gated DeltaNet (ModelConfig.linear_attention)
and the others gated full attention (q_proj gives each head's query and a sigmoid gate on its
output; per-head q/k norm; rotary on partial_rotary_factor of each head). Every RMSNorm but
the DeltaNet's gated one scales by 1 + w. The MoE layers have a shared expert behind a
sigmoid gate. Multi-token-prediction weights (mtp.*) and a vision tower are skipped at load."""

from __future__ import annotations

from moelora.config import LinearAttentionConfig, ModelConfig
from moelora.errors import ModelConfigError
from moelora.models import common

_LAYER_TYPES = ("linear_attention", "full_attention")


def next_model_config(hf) -> ModelConfig:
    """Qwen3-Next: grouped input projections, norm_topk_prob, optional dense layers."""
    return _model_config(
        hf,
        "qwen3_next",
        grouped=True,
        sparse_layers=common.sparse_layer_pattern(hf),
        renormalize=bool(getattr(hf, "norm_topk_prob", True)),
    )


def qwen3_5_moe_model_config(hf) -> ModelConfig:
    """Qwen3.5-MoE's text model: separate input projections, every layer sparse, the top-k
    weights always renormalized."""
    return _model_config(
        hf,
        "qwen3_5_moe",
        grouped=False,
        sparse_layers=(True,) * hf.num_hidden_layers,
        renormalize=True,
    )


def _model_config(
    hf, arch: str, *, grouped: bool, sparse_layers: tuple[bool, ...], renormalize: bool
) -> ModelConfig:
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    factor = (hf.rope_parameters or {}).get("partial_rotary_factor") or 1.0
    rotary_dim = int(head_dim * factor)
    if rotary_dim % 2 or (head_dim - rotary_dim) % 2:
        raise ModelConfigError(
            f"partial_rotary_factor={factor} is not supported with head_dim={head_dim}: "
            "expected an even number of rotated dims and of dims left as they are"
        )
    if getattr(hf, "attention_bias", False):
        raise ModelConfigError(f"attention_bias=True is not supported for {arch}: expected False")
    return common.model_config(
        hf,
        arch,
        head_dim=head_dim,
        qk_norm="head",
        num_experts=hf.num_experts,
        sparse_layers=sparse_layers,
        intermediate_size=getattr(hf, "intermediate_size", 0) or 0,
        renormalize=renormalize,
        shared_expert_intermediate_size=hf.shared_expert_intermediate_size or 0,
        rotary_dim=0 if rotary_dim == head_dim else rotary_dim,
        linear_attention=linear_attention_config(hf, grouped=grouped),
        attn_output_gate=True,
        zero_centred_norm=True,
    )


def linear_attention_config(hf, *, grouped: bool) -> LinearAttentionConfig:
    types = list(hf.layer_types)
    unknown = sorted(set(types) - set(_LAYER_TYPES))
    if unknown or len(types) != hf.num_hidden_layers:
        raise ModelConfigError(
            f"layer_types={types} is not supported: expected {hf.num_hidden_layers} entries, "
            f"each one of {list(_LAYER_TYPES)}"
        )
    if hf.linear_num_value_heads % hf.linear_num_key_heads:
        raise ModelConfigError(
            f"linear_num_value_heads={hf.linear_num_value_heads} is not supported with "
            f"linear_num_key_heads={hf.linear_num_key_heads}: expected a multiple of it"
        )
    return LinearAttentionConfig(
        layers=tuple(t == "linear_attention" for t in types),
        num_k_heads=hf.linear_num_key_heads,
        num_v_heads=hf.linear_num_value_heads,
        head_k_dim=hf.linear_key_head_dim,
        head_v_dim=hf.linear_value_head_dim,
        conv_kernel=hf.linear_conv_kernel_dim,
        grouped_projections=grouped,
    )
