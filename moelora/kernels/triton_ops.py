"""The Triton kernel tables the engine uses on CUDA (see ops.make_ops)."""

from __future__ import annotations

import dataclasses

from moelora.kernels.fused_moe import fused_moe
from moelora.kernels.linear import batch_invariant_linear, linear
from moelora.kernels.lora import add_lora_
from moelora.kernels.norm_rope import rms_norm, rms_norm_lora, rope_qk
from moelora.kernels.ops import Ops
from moelora.kernels.paged_attention import paged_attention, paged_attention_lora
from moelora.kernels.reference import linear as cublas_linear
from moelora.kernels.routing import route_topk

TRITON_OPS = Ops(
    name="triton",
    linear=batch_invariant_linear,
    route_topk=route_topk,
    fused_moe=fused_moe,
    add_lora_=add_lora_,
    paged_attention=paged_attention,
    paged_attention_lora=paged_attention_lora,
    rms_norm=rms_norm,
    rms_norm_lora=rms_norm_lora,
    rope_qk=rope_qk,
)

# EngineConfig.projections (see kernels/linear.py): the default table is "batch-invariant"
PROJECTIONS = {
    "batch-invariant": TRITON_OPS,
    "skinny": dataclasses.replace(TRITON_OPS, name="triton-skinny", linear=linear),
    "cublas": dataclasses.replace(TRITON_OPS, name="triton-cublas", linear=cublas_linear),
}
