"""reference.output_gate in Triton: the gated attention's output (Qwen3-Next, Qwen3.5) scaled by
the sigmoid of its gate, in one launch where torch takes two.

Each step in float32, rounded to the input dtype where torch's separate ops round (the
sigmoid, then the product); compiled without fp fusion. The gate is read as qkv_proj left it:
a strided view [T, Hq, D] beside each head's query. One program owns a block of a token's row.

Legend: T = tokens, Hq = query heads, D = head dim.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moelora.kernels.pdl import pdl_kwargs, pdl_wait
from moelora.kernels.sizes import cdiv, next_power_of_2

BLOCK = 1024  # a program's elements of a row


@triton.jit
def _output_gate_kernel(
    # Pointers.
    out_ptr,  # [T, Hq, D], strides (stride_ot, stride_oh, 1): the attention's output
    gate_ptr,  # [T, Hq, D], strides (stride_gt, stride_gh, 1)
    y_ptr,  # [T, Hq, D] contiguous
    # Sizes and strides.
    Hq,
    D,
    stride_ot,
    stride_oh,
    stride_gt,
    stride_gh,
    # Meta-parameters.
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_wait(PDL)  # first: see kernels/pdl.py
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)  # within the token's Hq * D
    ok = offs < Hq * D
    dtype = y_ptr.dtype.element_ty
    head, d = offs // D, offs % D
    gate = tl.load(gate_ptr + row * stride_gt + head * stride_gh + d, mask=ok, other=0.0)
    sig = (1.0 / (1.0 + tl.exp(-gate.to(tl.float32)))).to(dtype).to(tl.float32)
    x = tl.load(out_ptr + row * stride_ot + head * stride_oh + d, mask=ok, other=0.0)
    x = x.to(tl.float32)
    tl.store(y_ptr + row * Hq * D + offs, (x * sig).to(dtype), mask=ok)


def output_gate(out: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """Semantics: reference.output_gate's: out * sigmoid(gate).

    out, gate [T, Hq, D], the last dims contiguous, one dtype. Returns [T, Hq, D]
    contiguous."""
    T, Hq, D = out.shape
    assert gate.shape == out.shape and gate.stride(2) == out.stride(2) == 1
    assert gate.dtype == out.dtype, (gate.dtype, out.dtype)
    y = torch.empty(T, Hq, D, dtype=out.dtype, device=out.device)
    if T == 0:
        return y
    block = min(BLOCK, next_power_of_2(Hq * D))
    _output_gate_kernel[(T, cdiv(Hq * D, block))](
        out_ptr=out,
        gate_ptr=gate,
        y_ptr=y,
        Hq=Hq,
        D=D,
        stride_ot=out.stride(0),
        stride_oh=out.stride(1),
        stride_gt=gate.stride(0),
        stride_gh=gate.stride(1),
        BLOCK=block,
        num_warps=4,
        enable_fp_fusion=False,
        **pdl_kwargs(out.device),
    )
    return y
