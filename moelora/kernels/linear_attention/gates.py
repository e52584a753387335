"""gated_delta.delta_gates in Triton: gated DeltaNet's per-head decay and write strength, beta =
sigmoid(b) and g = -exp(A_log) softplus(a + dt_bias), from in_proj's b and a slices.

Why: in torch these are seven elementwise launches a layer (the casts, exp, softplus, the
products), each a few microseconds in a decode step's graph. One program owns BLOCK_T tokens of
every head.

Rounding: float32 throughout as the reference, beta rounded to b's dtype as torch's sigmoid of
b is; softplus is x past 20 and log1p(exp(x)) below (torch's threshold), log1p taken as
log(u) * y / (u - 1) with u = 1 + y (within a few float32 ulps of log1p, also where exp(x) is
far below float32's epsilon), so g may differ from torch's in its last bits.

Legend: T = tokens, H = value heads.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moelora.kernels.pdl import pdl_kwargs, pdl_wait
from moelora.kernels.sizes import cdiv, next_power_of_2

GATE_TOKENS = 16  # tokens a program takes
SOFTPLUS_THRESHOLD = 20.0  # torch's: softplus(x) = x past it


@triton.jit
def _delta_gates_kernel(
    # Pointers.
    a_ptr,  # [T, H], rows strided by stride_at
    b_ptr,  # [T, H], rows strided by stride_bt
    a_log_ptr,  # [H]
    dt_bias_ptr,  # [H]
    g_ptr,  # [T, H] float32, contiguous
    beta_ptr,  # [T, H] in b's dtype, contiguous
    # Sizes and strides.
    T,
    H,
    stride_at,
    stride_bt,
    # Meta-parameters.
    BLOCK_T: tl.constexpr,
    BLOCK_H: tl.constexpr,
    THRESHOLD: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_wait(PDL)  # first: see kernels/pdl.py
    rows = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    heads = tl.arange(0, BLOCK_H)
    ok = (rows < T)[:, None] & (heads < H)[None, :]
    b = tl.load(b_ptr + rows[:, None] * stride_bt + heads[None, :], mask=ok, other=0.0)
    beta = 1.0 / (1.0 + tl.exp(-b.to(tl.float32)))
    tl.store(beta_ptr + rows[:, None] * H + heads[None, :], beta.to(b.dtype), mask=ok)

    # -- g = -exp(A_log) * softplus(a + dt_bias), in float32 --
    a = tl.load(a_ptr + rows[:, None] * stride_at + heads[None, :], mask=ok, other=0.0)
    dt_bias = tl.load(dt_bias_ptr + heads, mask=heads < H, other=0.0).to(tl.float32)
    decay = -tl.exp(tl.load(a_log_ptr + heads, mask=heads < H, other=0.0).to(tl.float32))
    g = log_decay(a, dt_bias[None, :], decay[None, :], THRESHOLD)
    tl.store(g_ptr + rows[:, None] * H + heads[None, :], g, mask=ok)


@triton.jit
def log_decay(a, dt_bias, decay, THRESHOLD: tl.constexpr):
    """g = decay * softplus(a + dt_bias) in float32 (decay = -exp(A_log)), as this module's
    docstring computes it; the delta rule's kernel computes it so too where it reads a."""
    x = a.to(tl.float32) + dt_bias
    y = tl.exp(tl.minimum(x, THRESHOLD))
    u = 1.0 + y
    exact = u == 1.0  # y below float32's epsilon: log1p(y) is y
    log1p = tl.where(exact, y, tl.log(u) * (y / tl.where(exact, 1.0, u - 1.0)))
    softplus = tl.where(x > THRESHOLD, x, log1p)
    return decay * softplus


@triton.jit
def write_strength(b):
    """beta = sigmoid(b), rounded to b's dtype (as stored), in float32."""
    return (1.0 / (1.0 + tl.exp(-b.to(tl.float32)))).to(b.dtype).to(tl.float32)


def delta_gates(
    a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Semantics: gated_delta.delta_gates's: g = -exp(A_log) softplus(a + dt_bias) in float32,
    beta = sigmoid(b) in b's dtype.

    a, b [T, H] (rows may be strided, the last dim contiguous); A_log, dt_bias [H]. Returns
    (g [T, H] float32, beta [T, H]), contiguous."""
    T, H = b.shape
    assert a.shape == (T, H) and a.stride(1) == b.stride(1) == 1, (a.shape, a.stride(), b.stride())
    assert A_log.shape == dt_bias.shape == (H,), (A_log.shape, dt_bias.shape)
    g = torch.empty(T, H, dtype=torch.float32, device=b.device)
    beta = torch.empty(T, H, dtype=b.dtype, device=b.device)
    if T == 0:
        return g, beta
    _delta_gates_kernel[(cdiv(T, GATE_TOKENS),)](
        a_ptr=a,
        b_ptr=b,
        a_log_ptr=A_log,
        dt_bias_ptr=dt_bias,
        g_ptr=g,
        beta_ptr=beta,
        T=T,
        H=H,
        stride_at=a.stride(0),
        stride_bt=b.stride(0),
        BLOCK_T=GATE_TOKENS,
        BLOCK_H=next_power_of_2(H),
        THRESHOLD=SOFTPLUS_THRESHOLD,
        num_warps=1,
        enable_fp_fusion=False,
        **pdl_kwargs(b.device),
    )
    return g, beta
