"""gated_delta.rms_norm_gated in Triton: gated DeltaNet's output norm, gated by silu(z).

Algorithm. One program per BLOCK_R rows: each row normed in float32 and rounded to x's dtype
before the weight multiplies it (the product rounded), the gate's silu in float32, the last
product rounded once, as the reference rounds.

Legend: N = rows (tokens x value heads), H = value heads, D = row width (the value head dim).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moelora.kernels.pdl import pdl_kwargs, pdl_wait
from moelora.kernels.sizes import cdiv, next_power_of_2

NORM_ROWS = 8  # rows a gated-norm program takes


@triton.jit
def _rms_norm_gated_kernel(
    # Pointers.
    x_ptr,  # [N / HEADS, HEADS, D], strides (stride_xt, stride_xh, 1)
    gate_ptr,  # the same shape, strides (stride_gt, stride_gh, 1)
    weight_ptr,  # [D], x's dtype
    out_ptr,  # [N, D] contiguous
    # Sizes and strides.
    num_rows,
    D,
    HEADS,  # rows a token: row r is token r // HEADS's head r % HEADS
    stride_xt,
    stride_xh,
    stride_gt,
    stride_gh,
    eps,
    # Meta-parameters.
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_wait(PDL)  # first: see kernels/pdl.py
    rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    offs = tl.arange(0, BLOCK_D)
    ok = (rows < num_rows)[:, None] & (offs < D)[None, :]
    dtype = out_ptr.dtype.element_ty
    token, head = rows // HEADS, rows % HEADS
    x_rows = x_ptr + token * stride_xt + head * stride_xh
    x = tl.load(x_rows[:, None] + offs[None, :], mask=ok, other=0.0)
    gate_rows = gate_ptr + token * stride_gt + head * stride_gh
    gate = tl.load(gate_rows[:, None] + offs[None, :], mask=ok, other=0.0)
    w = tl.load(weight_ptr + offs, mask=offs < D, other=0.0)

    # -- the norm in float32, rounded; the weight's product rounded; masked lanes add nothing --
    h = x.to(tl.float32)
    scale = tl.rsqrt(tl.sum(h * h, axis=1) / D + eps)
    normed = (h * scale[:, None]).to(dtype)
    weighted = (w.to(tl.float32)[None, :] * normed.to(tl.float32)).to(dtype)

    # -- the gate's silu in float32, the product rounded once --
    z = gate.to(tl.float32)
    out = weighted.to(tl.float32) * (z / (1.0 + tl.exp(-z)))
    tl.store(out_ptr + rows[:, None] * D + offs[None, :], out.to(dtype), mask=ok)


def rms_norm_gated(
    x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """Semantics: see gated_delta.rms_norm_gated: out = weight * rmsnorm(x) * silu(gate), the
    norm in float32 cast back to x's dtype before the weight, the gate's silu in float32.
    x, gate: [N, D] or [T, H, D] (a row a head; in_proj's z slice as it lies), strided, D
    contiguous; weight: [D] in x's dtype. Returns x's shape, contiguous, in x's dtype."""
    assert gate.shape == x.shape and x.dim() in (2, 3), (gate.shape, x.shape)
    assert x.stride(-1) == gate.stride(-1) == 1, (x.stride(), gate.stride())
    D = x.shape[-1]
    assert weight.shape == (D,) and weight.dtype == x.dtype, (weight.shape, weight.dtype)
    assert weight.is_contiguous(), weight.stride()
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    N = out.numel() // D
    if N == 0:
        return out
    x3, gate3 = (t if t.dim() == 3 else t[:, None] for t in (x, gate))
    BLOCK_D = next_power_of_2(D)
    _rms_norm_gated_kernel[(cdiv(N, NORM_ROWS),)](
        x_ptr=x,
        gate_ptr=gate,
        weight_ptr=weight,
        out_ptr=out,
        num_rows=N,
        D=D,
        HEADS=x3.shape[1],
        stride_xt=x3.stride(0),
        stride_xh=x3.stride(1),
        stride_gt=gate3.stride(0),
        stride_gh=gate3.stride(1),
        eps=eps,
        BLOCK_R=NORM_ROWS,
        BLOCK_D=BLOCK_D,
        num_warps=min(max(NORM_ROWS * BLOCK_D // 512, 1), 8),
        enable_fp_fusion=False,
        **pdl_kwargs(x.device),
    )
    return out
