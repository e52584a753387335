"""The elementwise steps around a dense MLP and a shared expert, in Triton: the SwiGLU of a dense
layer or shared expert, and the sum that joins the routed experts' top-k rows and the shared
expert (gated or not). Their references are reference.silu_and_mul and add_shared_expert.

Why: each is two to four of torch's elementwise launches, a few microseconds apiece in a decode
step's graph, and a torch launch also breaks the chain of programmatic dependent launches
(kernels/pdl.py). One program owns a block of one row.

Rounding. Each step is computed in float32 and rounded to the input dtype where torch's
separate ops round (silu, then the product; the top-k sum, the gate, its product, the sum),
so the bits are torch's but where float32 sigmoid and exp themselves round differently.
Compiled without fp fusion: torch's separate mul and add never form an FMA.

Legend: T = tokens, I = intermediate, K = top-k rows, H = hidden.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moelora.kernels.pdl import pdl_kwargs, pdl_wait
from moelora.kernels.sizes import cdiv, next_power_of_2

BLOCK = 1024  # a program's columns


@triton.jit
def _silu_and_mul_kernel(
    # Pointers.
    gate_up_ptr,  # [T, 2I], row stride stride_gt
    out_ptr,  # [T, I] contiguous
    # Sizes and strides.
    I,
    stride_gt,
    # Meta-parameters.
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_wait(PDL)  # first: see kernels/pdl.py
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < I
    dtype = out_ptr.dtype.element_ty
    gate = tl.load(gate_up_ptr + row * stride_gt + offs, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + row * stride_gt + I + offs, mask=ok, other=0.0).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    tl.store(out_ptr + row * I + offs, (act * up).to(dtype), mask=ok)


@triton.jit
def _add_shared_kernel(
    # Pointers.
    rows_ptr,  # [T, K, H] contiguous (K = 1: the routed experts' sum)
    shared_ptr,  # [T, H], row stride stride_st
    gate_ptr,  # [T] logits, row stride stride_gt; with GATED
    out_ptr,  # [T, H] contiguous
    # Sizes and strides.
    H,
    stride_st,
    stride_gt,
    # Meta-parameters.
    K: tl.constexpr,
    GATED: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_wait(PDL)  # first: see kernels/pdl.py
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < H
    dtype = out_ptr.dtype.element_ty
    # -- the routed experts' K rows, in order from zero, rounded (reference.sum_rows) --
    total = tl.zeros((BLOCK,), dtype=tl.float32)
    for k in range(0, K):
        total += tl.load(rows_ptr + (row * K + k) * H + offs, mask=ok, other=0.0).to(tl.float32)
    total = total.to(dtype).to(tl.float32)
    # -- the shared expert, scaled by its sigmoid gate (each rounded) --
    shared = tl.load(shared_ptr + row * stride_st + offs, mask=ok, other=0.0).to(tl.float32)
    if GATED:
        logit = tl.load(gate_ptr + row * stride_gt).to(tl.float32)
        gate = (1.0 / (1.0 + tl.exp(-logit))).to(dtype).to(tl.float32)
        shared = (gate * shared).to(dtype).to(tl.float32)
    tl.store(out_ptr + row * H + offs, (total + shared).to(dtype), mask=ok)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """Semantics: reference.silu_and_mul's: silu(x[..., :I]) * x[..., I:].

    gate_up [T, 2I], the last dim contiguous. Returns [T, I] in its dtype."""
    assert gate_up.dim() == 2 and gate_up.stride(1) == 1, (gate_up.shape, gate_up.stride())
    T, I = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(T, I, dtype=gate_up.dtype, device=gate_up.device)
    if T == 0:
        return out
    block = min(BLOCK, next_power_of_2(I))
    _silu_and_mul_kernel[(T, cdiv(I, block))](
        gate_up_ptr=gate_up,
        out_ptr=out,
        I=I,
        stride_gt=gate_up.stride(0),
        BLOCK=block,
        num_warps=4,
        enable_fp_fusion=False,
        **pdl_kwargs(gate_up.device),
    )
    return out


def add_shared_expert(
    moe_out: torch.Tensor, shared: torch.Tensor, gate_logits: torch.Tensor | None = None
) -> torch.Tensor:
    """Semantics: reference.add_shared_expert's: sum_rows(moe_out) + shared, the shared
    expert first scaled by sigmoid(gate_logits) where given.

    moe_out [T, K, H] contiguous (fused_moe(sum_topk=False)) or [T, H]; shared [T, H] and
    gate_logits [T, 1], last dims contiguous, moe_out's dtype. Returns [T, H]."""
    rows = moe_out if moe_out.dim() == 3 else moe_out[:, None]
    T, K, H = rows.shape
    assert rows.is_contiguous() and shared.shape == (T, H) and shared.stride(1) == 1
    assert gate_logits is None or gate_logits.shape == (T, 1), gate_logits.shape
    out = torch.empty(T, H, dtype=shared.dtype, device=shared.device)
    if T == 0:
        return out
    block = min(BLOCK, next_power_of_2(H))
    _add_shared_kernel[(T, cdiv(H, block))](
        rows_ptr=rows,
        shared_ptr=shared,
        gate_ptr=shared if gate_logits is None else gate_logits,
        out_ptr=out,
        H=H,
        stride_st=shared.stride(0),
        stride_gt=0 if gate_logits is None else gate_logits.stride(0),
        K=K,
        GATED=gate_logits is not None,
        BLOCK=block,
        num_warps=4,
        enable_fp_fusion=False,
        **pdl_kwargs(shared.device),
    )
    return out
