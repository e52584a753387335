"""What every supported architecture reads the same way from a Hugging Face config: each
architecture's module names only the fields where it differs."""

from __future__ import annotations

from moelora.config import ModelConfig
from moelora.errors import ModelConfigError
from moelora.models.quantization import quant_method


def model_config(
    hf, arch: str, *, quant_methods: tuple[str, ...] = ("fp8",), **differs
) -> ModelConfig:
    """The ModelConfig of `hf` read the common way, with `differs` replacing fields; a
    quantization_config other than `quant_methods` is refused."""
    fp8 = quant_method(hf, arch, quant_methods) == "fp8"
    if getattr(hf, "hidden_act", "silu") != "silu":
        raise ModelConfigError(f"hidden_act={hf.hidden_act!r} is not supported: expected 'silu'")
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    eos = hf.eos_token_id
    fields = dict(
        arch=arch,
        vocab_size=hf.vocab_size,
        hidden_size=hf.hidden_size,
        num_layers=hf.num_hidden_layers,
        num_heads=hf.num_attention_heads,
        num_kv_heads=getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads,
        head_dim=head_dim,
        rms_norm_eps=hf.rms_norm_eps,
        max_position_embeddings=hf.max_position_embeddings,
        tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
        qkv_bias=bool(getattr(hf, "attention_bias", False)),
        qk_norm="none",
        clip_qkv=None,
        num_experts=getattr(hf, "num_experts", 0),
        top_k=hf.num_experts_per_tok,
        moe_intermediate_size=getattr(hf, "moe_intermediate_size", 0),
        renormalize=bool(getattr(hf, "norm_topk_prob", False)),
        scoring="softmax",
        sparse_layers=(True,) * hf.num_hidden_layers,
        intermediate_size=getattr(hf, "intermediate_size", 0) or 0,
        shared_expert_intermediate_size=0,
        eos_token_ids=tuple([eos] if isinstance(eos, int) else (eos or [])),
        sliding_window=0,
        sliding_layers=(False,) * hf.num_hidden_layers,
        attention_sinks=False,
        o_bias=False,
        router_bias=False,
        expert_bias=False,
        activation="silu",
        experts_layout="gate_up_rows",
        experts_mxfp4=False,
        weights_fp8="checkpoint" if fp8 else "none",
    )
    return ModelConfig(**{**fields, **differs})


def sparse_layer_pattern(hf) -> tuple[bool, ...]:
    """Qwen-style: dense where mlp_only_layers lists the layer or decoder_sparse_step skips it."""
    only_dense = set(getattr(hf, "mlp_only_layers", None) or [])
    step = getattr(hf, "decoder_sparse_step", 1) or 1
    return tuple(
        i not in only_dense and hf.num_experts > 0 and (i + 1) % step == 0
        for i in range(hf.num_hidden_layers)
    )
