"""The Triton kernel tables the engine uses on CUDA (see ops.make_ops)."""

from __future__ import annotations

import dataclasses

from moelora.kernels.fused_moe import fused_moe
from moelora.kernels.linear import BatchInvariantLinear
from moelora.kernels.lora import add_lora_
from moelora.kernels.norm_rope import rms_norm, rms_norm_lora, rope_qk
from moelora.kernels.ops import Ops
from moelora.kernels.paged_attention import paged_attention, paged_attention_lora
from moelora.kernels.reference import linear as cublas_linear
from moelora.kernels.routing import route_topk

TRITON_OPS = Ops(
    name="triton",
    linear=cublas_linear,
    route_topk=route_topk,
    fused_moe=fused_moe,
    add_lora_=add_lora_,
    paged_attention=paged_attention,
    paged_attention_lora=paged_attention_lora,
    rms_norm=rms_norm,
    rms_norm_lora=rms_norm_lora,
    rope_qk=rope_qk,
)


def with_projections(projections: str) -> Ops:
    """TRITON_OPS with the dense projections EngineConfig.projections names (kernels/linear.py).
    A new table each call: a BatchInvariantLinear keeps what it measured on its engine."""
    if projections == "cublas":
        return dataclasses.replace(TRITON_OPS, name="triton-cublas")
    linear = BatchInvariantLinear(skinny=projections == "skinny")
    return dataclasses.replace(TRITON_OPS, name=f"triton-{projections}", linear=linear)
