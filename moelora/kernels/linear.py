"""A skinny linear for decode steps of a few tokens: y = x @ W.T (+ bias) with W streamed once.

Semantics: y[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]), fp32 accumulation, y in x's dtype.

Why not cuBLAS. At one token a projection is a pure weight stream (q|k|v reads 21 MB at a
Qwen3-30B-A3B layer, o 16.8 MB), and cuBLAS took 8.6 µs for q|k|v, 10.0 µs for o and 5.6 µs
for the 0.5 MB router on an H200, against 4.9, 4.0 and 0.1 µs at the copy bandwidth (this
kernel: 6.4, 5.3 and 1.5; bench/results/linear-h200.md). A cuBLAS launch also breaks the chain
of programmatic dependent launches (pdl.py): the kernel after it cannot start early.

Why it is opt-in (EngineConfig.skinny_projections). Its sums are not cuBLAS's, and cuBLAS
still takes the bigger batches, so a request's bf16 outputs can differ by a rounding between
running alone and in a batch, enough to flip a near-tied expert choice
(bench/results/decode-h200.md); cuBLAS alone keeps them identical.

Algorithm. The grid is a few programs per SM; each walks slabs of BN output columns by
BN x K weights (K <= MAX_K: the whole reduction is one register tile), grid-stride. A program
issues the load of its first slab before `pdl_wait`, so the weight stream starts while the
kernel before is still finishing (W is a model weight: nothing in a step writes it); then it
waits and loads every row of x at once (M <= BM, from L2: all programs read the same rows).
In the walk the next slab's load is in flight while this one is reduced against each row, so
each program always has a load outstanding (one slab a program, one launch wave, measured
1.2 to 1.4 times slower). No split-K: the slabs are narrow enough to feed every SM.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from moelora.kernels import reference
from moelora.kernels.pdl import pdl_kwargs, pdl_wait

MAX_ROWS = 8  # the rows a program reduces its slab against; past them cuBLAS
MAX_K = 8192  # the slab is one register tile: BN * next_pow2(K) elements per program
MAX_SLAB = 16384  # elements: two slabs are 128 registers a thread at 8 warps


@triton.jit(do_not_specialize=["M", "N"])  # one compile for every row count and width
def _skinny_linear_kernel(
    # Pointers.
    x_ptr,  # [M, K]
    w_ptr,  # [N, K]
    bias_ptr,  # [N] or unused
    y_ptr,  # [M, N]
    # Sizes and strides.
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_ym,
    # Meta-parameters.
    BM: tl.constexpr,  # rows handled: M <= BM, rows past M are masked
    BN: tl.constexpr,
    BK: tl.constexpr,  # next_pow2(K): the whole reduction in one tile
    HAS_BIAS: tl.constexpr,
    PDL: tl.constexpr,
):
    # -- the first slab before the wait: W is static during the step, x is not --
    pid = tl.program_id(0)
    step = tl.num_programs(0)
    offs_k = tl.arange(0, BK)
    k_ok = offs_k < K
    w_ptrs = w_ptr + tl.arange(0, BN)[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
    offs_n = pid * BN + tl.arange(0, BN)
    w = tl.load(
        w_ptrs + pid * BN * stride_wn, mask=(offs_n < N)[:, None] & k_ok[None, :], other=0.0
    )
    pdl_wait(PDL)  # x is the kernel before's output: nothing of it is read above this line
    # every row of x at once (a tuple: one load each, all in flight together)
    offs_m = tl.arange(0, BM)
    xs = ()
    for m in tl.static_range(BM):
        xs = xs + (tl.load(x_ptr + m * stride_xm + offs_k, mask=k_ok & (m < M), other=0.0),)
    # -- walk the column blocks grid-stride, the next slab in flight during this one's math --
    for block in range(pid, tl.cdiv(N, BN), step):
        offs_next = (block + step) * BN + tl.arange(0, BN)  # past N: masked, never read
        w_next = tl.load(
            w_ptrs + (block + step).to(tl.int64) * BN * stride_wn,
            mask=(offs_next < N)[:, None] & k_ok[None, :],
            other=0.0,
        )
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for m in tl.static_range(BM):
            y = tl.sum(w.to(tl.float32) * xs[m].to(tl.float32)[None, :], axis=1)
            acc = tl.where(offs_m[:, None] == m, y[None, :], acc)
        offs_n = block * BN + tl.arange(0, BN)
        n_ok = offs_n < N
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        y_ptrs = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=(offs_m < M)[:, None] & n_ok[None, :])
        w = w_next


def max_rows(N: int) -> int:
    """The most rows at which the skinny kernel beats cuBLAS for N outputs. Each row costs a
    cross-thread reduction per output, so the break-even falls with N: on an H200 q|k|v
    (N = 5120, 6144) takes it at one token, o (2048, 4096) up to 2 rows, a router (128) up to
    MAX_ROWS (bench/results/linear-h200.md)."""
    return MAX_ROWS if N <= 256 else 2 if N <= 4096 else 1


def fits(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether `linear` takes the skinny kernel for this product (else cuBLAS)."""
    return (
        x.dim() == 2
        and 0 < x.shape[0] <= max_rows(w.shape[0])
        and x.shape[1] <= MAX_K
        and x.stride(1) == 1
        and w.stride(1) == 1
        and x.dtype == w.dtype
    )


class SkinnyConfig(NamedTuple):
    block_n: int  # output columns per slab
    programs: int  # the grid; each program walks ceil(blocks / programs) slabs
    num_warps: int


def skinny_config(N: int, K: int, sms: int, *, in_flight: int = 65536) -> SkinnyConfig:
    """Four columns a slab (narrower while there are fewer slabs than programs), and as many
    programs an SM as keep `in_flight` weights loading on it: each program has two slabs out.
    On an H200 that is 4 programs an SM at K = 2048 and 2 at K = 4096, the best of the sweep
    in bench/linear.py (one slab a program, one wave: 1.2 to 1.4 times slower)."""
    BK = triton.next_power_of_2(K)
    bn = max(1, min(4, MAX_SLAB // BK))
    per_sm = max(1, min(4, in_flight // (2 * bn * BK)))
    while bn > 1 and triton.cdiv(N, bn) < per_sm * sms:
        bn //= 2
    programs = min(triton.cdiv(N, bn), per_sm * sms)
    return SkinnyConfig(bn, programs, 8 if bn * BK >= 8192 else 4)


@functools.cache
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # the interpreter: a small grid, every program walking several slabs
    return torch.cuda.get_device_properties(device).multi_processor_count


def skinny_linear(
    x: torch.Tensor,
    w: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    config: SkinnyConfig | None = None,
) -> torch.Tensor:
    """Semantics: y = x @ w.T (+ bias), fp32 accumulation.

    x: [M, K] with 1 <= M <= MAX_ROWS, K <= MAX_K, unit last stride; w: [N, K] same dtype,
    unit last stride; bias: [N] or None. Returns y [M, N] in x's dtype."""
    M, K = x.shape
    assert 0 < M <= MAX_ROWS and K <= MAX_K, (x.shape, w.shape)
    assert x.stride(1) == 1 and w.stride(1) == 1, (x.stride(), w.stride())
    assert x.dtype == w.dtype, (x.dtype, w.dtype)
    N = w.shape[0]
    assert w.shape[1] == K and (bias is None or bias.shape == (N,)), (x.shape, w.shape)
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    BN, programs, num_warps = config or skinny_config(N, K, _sm_count(x.device))
    _skinny_linear_kernel[(programs,)](
        x, w, bias if bias is not None else w, y,
        M, N, K, x.stride(0), w.stride(0), y.stride(0),
        BM=triton.next_power_of_2(M), BN=BN, BK=triton.next_power_of_2(K),
        HAS_BIAS=bias is not None, num_warps=num_warps, **pdl_kwargs(x.device),
    )  # fmt: skip
    return y


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Semantics: F.linear(x, w, bias); the skinny kernel when it fits, else cuBLAS."""
    if fits(x, w):
        return skinny_linear(x, w, bias)
    return reference.linear(x, w, bias)
