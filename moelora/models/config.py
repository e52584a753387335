"""ModelConfig: the architecture facts the shared layers need, read from a HF config once."""

from __future__ import annotations

from dataclasses import dataclass

from moelora.errors import ModelConfigError


@dataclass(frozen=True)
class ModelConfig:
    arch: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: str  # "none" | "head" (per-head RMSNorm, Qwen3) | "full" (over all heads, OLMoE)
    clip_qkv: float | None
    num_experts: int
    top_k: int
    moe_intermediate_size: int
    renormalize: bool
    scoring: str  # "softmax" | "sigmoid"
    sparse_layers: tuple[bool, ...]  # per layer: MoE (True) or dense MLP (False)
    intermediate_size: int  # of dense layers
    shared_expert_intermediate_size: int  # 0 = no shared expert
    eos_token_ids: tuple[int, ...]

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


def common_fields(hf, arch: str) -> dict:
    """Fields every supported architecture reads the same way."""
    if getattr(hf, "hidden_act", "silu") != "silu":
        raise ModelConfigError(f"hidden_act={hf.hidden_act!r} is not supported: expected 'silu'")
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    eos = hf.eos_token_id
    return dict(
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
        clip_qkv=None,
        eos_token_ids=tuple([eos] if isinstance(eos, int) else (eos or [])),
        scoring="softmax",
        intermediate_size=getattr(hf, "intermediate_size", 0) or 0,
        shared_expert_intermediate_size=0,
    )


def sparse_layer_pattern(hf) -> tuple[bool, ...]:
    """Qwen-style: dense where mlp_only_layers lists the layer or decoder_sparse_step skips it."""
    only_dense = set(getattr(hf, "mlp_only_layers", None) or [])
    step = getattr(hf, "decoder_sparse_step", 1) or 1
    return tuple(
        i not in only_dense and hf.num_experts > 0 and (i + 1) % step == 0
        for i in range(hf.num_hidden_layers)
    )
