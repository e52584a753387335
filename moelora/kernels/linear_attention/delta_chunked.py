"""gated_delta.gated_delta_rule for prefill chunks in Triton, in blocks of tokens: the chunked form
whose reference is gated_delta.chunked_delta_rule (transformers' and fla's algorithm).

Algorithm. A sequence's chunk is cut into blocks of CHUNK tokens from its first row. Within a
block (cumulative log decay c_i, normed k and scaled q as in the token loop), the delta rule's
tokens are linked by the strictly lower triangular A[i, j] = beta_i (k_i . k_j) exp(c_i - c_j);
with T = (I + A)^-1:
    w = T (beta k exp(c)),  u = T (beta v)                      (per block, from its own inputs)
    v' = u - w S,  o = (q exp(c)) S + tril(q k^T exp(c_i - c_j)) v',
    S <- exp(c_last) S + (k exp(c_last - c))^T v'                 (block after block)
for the state S entering the block. Two launches:
  - _prepare_kernel, one program per (value head, block), every block of the step at once:
    A by one dot, T by forward substitution over the block's rows in registers (exact float32
    arithmetic), w and u by two dots, stored as scratch rows beside the step's rows (float32,
    or bf16 as fla keeps them: ChunkedConfig.scratch); with ChunkedConfig.prepared also q and k
    as the chain uses them (normed, scaled, decayed), so that no program of the chain norms
    them again.
  - _blocks_kernel, one program per (sequence, value head, BLOCK_V value columns): the state
    tile [K, BLOCK_V] in float32 registers, loaded from the sequence's slot (zeros from position
    0), the blocks in order, each a few dots; the tile goes back to the slot at the end.
The serial chain is a sequence's blocks, not its tokens. Blocks start at the chunk's first row,
so a prompt's bits depend on its chunking (deterministic inference keeps the token loop of
delta_rule.py). The dots take tf32 tensor cores on the GPU in this first cut. Graphs and
padding: see sequences.py; the prepare kernel's grid walks the step's work table
(paged.attention_work).

Legend: T = tokens, B = sequences, S = state slots, Hk = q/k heads, H = value heads,
K = key head dim, V = value head dim, C = CHUNK.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from moelora.kernels.attention.paged import attention_work
from moelora.kernels.gated_delta import _L2_EPS, CHUNK
from moelora.kernels.linear_attention.sequences import (
    check_delta_inputs,
    sequence,
    step_sequences,
    strides,
    zero_padded_rows,
)
from moelora.kernels.pdl import pdl_kwargs, pdl_wait
from moelora.kernels.reference import WORK_SEQ
from moelora.kernels.sizes import cdiv, next_power_of_2

if TYPE_CHECKING:
    from moelora.step.batch import AttentionMetadata

_WORK_SEQ = tl.constexpr(WORK_SEQ)  # a work entry: sequence * WORK_SEQ + blocks from its last
# _system_kernel's share of the launches' common arguments (it reads no v; PDL apart)
_SYSTEM_META = ("H", "K", "eps", "GROUPS", "C", "BLOCK_K", "DOT_PRECISION", "num_warps")


@dataclass(frozen=True)
class ChunkedConfig:
    chunk: int  # tokens a block
    block_v: int  # value columns a _blocks_kernel program
    num_warps: int
    num_stages: int  # of _blocks_kernel's loop over blocks: its loads of the next ones
    solve_warps: int  # _solve_kernel's: its tiles are [chunk / 4, chunk / 4]
    # tl.dot's for bf16 and fp16 inputs: tf32 tensor cores on the GPU (float32 dots by FMA
    # spill heavily at these tiles: bench/compile_audit.py); exact float32 in the interpreter
    dot_precision: str
    # q and k normed, scaled and decayed once a block by _wu_kernel into scratch rows, so the
    # serial _blocks_kernel loads them rather than norming q and k in each of its programs
    prepared: bool = False
    # the scratch rows' dtype (w, u and prepared q, k): "float32", or "bfloat16" as fla keeps
    # w (the chain's dots then take the state and v' in bf16); float32 models keep float32
    scratch: str = "float32"


# fla's block of 64 tokens; 32 value columns give 4 programs a value head, so one sequence of
# Qwen3.5's 32 heads fills 128 multiprocessors; 4 warps: the fastest of the H100 sweep. q and k
# prepared in bf16 rows keep the serial chain's programs within their registers on sm_90 (no
# spill: bench/compile_audit.py), where norming them in every program spills.
CONFIG = ChunkedConfig(
    chunk=CHUNK,
    block_v=32,
    num_warps=4,
    num_stages=2,
    solve_warps=2,
    dot_precision="tf32",
    prepared=True,
    scratch="bfloat16",
)
# The interpreter runs every program in numpy: blocks of 4 give short test chunks several.
INTERPRETER_CONFIG = ChunkedConfig(
    chunk=4, block_v=16, num_warps=1, num_stages=1, solve_warps=1, dot_precision="ieee"
)


@triton.jit
def _unit_rows(x, eps):
    """Each row x / sqrt(|x|^2 + eps), in float32: the reference's _l2norm."""
    return x * tl.rsqrt(tl.sum(x * x, axis=1) + eps)[:, None]


@triton.jit
def _block_rows(q_or_k_ptr, rows, ok, offs_k, k_ok, stride_t):
    """[C, BLOCK_K] float32 rows of one q/k head (zeros past the sequence)."""
    ptrs = q_or_k_ptr + rows[:, None] * stride_t + offs_k[None, :]
    return tl.load(ptrs, mask=ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)


@triton.jit
def _substitute_row(a_i, t, idx, i):
    """Row i of (I + a)^-1 into t, for a strictly lower triangular [S, S] a whose row i is a_i
    [S] and whose rows before i are done in t: row i = e_i - sum_{j<i} a_ij row j (rows j >= i
    of t are still e_j, and a_ij = 0 there)."""
    row = tl.where(idx == i, 1.0, 0.0) - tl.sum(a_i[:, None] * t, axis=0)
    return tl.where(idx[:, None] == i, row[None, :], t)


@triton.jit
def _a_row(
    a_ptr, first, n, start, h, H, C: tl.constexpr, D: tl.constexpr, i, idx, SUB: tl.constexpr
):
    """Row i [SUB] of the diagonal block D of the scratch's A (zeros past the sequence)."""
    r = first + D * SUB + i
    ptrs = a_ptr + ((start + r).to(tl.int64) * H + h) * C + D * SUB + idx
    return tl.load(ptrs, mask=(idx < SUB) & (r < n), other=0.0)


@triton.jit
def _inverse_diagonal(a_ptr, first, n, start, h, H, C: tl.constexpr, SUB: tl.constexpr):
    """(I + a)^-1 of the four [SUB, SUB] diagonal blocks of the scratch's A, by forward
    substitution in exact float32 arithmetic, the four chains side by side, each step's rows
    of A loaded (cache hits) rather than picked out of a tile by a reduction (fla's)."""
    idx = tl.arange(0, SUB)
    eye = (idx[:, None] == idx[None, :]).to(tl.float32)
    t0, t1, t2, t3 = eye, eye, eye, eye
    at = (first, n, start, h, H, C)
    for i in range(1, SUB):
        t0 = _substitute_row(_a_row(a_ptr, *at, 0, i, idx, SUB), t0, idx, i)
        t1 = _substitute_row(_a_row(a_ptr, *at, 1, i, idx, SUB), t1, idx, i)
        t2 = _substitute_row(_a_row(a_ptr, *at, 2, i, idx, SUB), t2, idx, i)
        t3 = _substitute_row(_a_row(a_ptr, *at, 3, i, idx, SUB), t3, idx, i)
    return t0, t1, t2, t3


@triton.jit
def _mm(a, b):
    """a @ b in float32 products (the inverse's merges, exact as the substitution)."""
    return tl.dot(a, b, input_precision="ieee")


@triton.jit
def _scratch_block(
    a_ptr,
    first,
    n,
    start,
    h,
    H,
    C: tl.constexpr,
    I: tl.constexpr,
    J: tl.constexpr,
    SUB: tl.constexpr,
):
    """Pointers and mask of the [SUB, SUB] block (I, J) of a block's [C, C] matrix in the
    [T, H, C] float32 scratch (rows past the sequence masked)."""
    idx = tl.arange(0, SUB)
    r = first + I * SUB + idx
    rows = (start + r).to(tl.int64)
    ptrs = a_ptr + (rows[:, None] * H + h) * C + (J * SUB + idx)[None, :]
    return ptrs, (r < n)[:, None] & (idx < SUB)[None, :]


@triton.jit
def _load_block(
    a_ptr,
    first,
    n,
    start,
    h,
    H,
    C: tl.constexpr,
    I: tl.constexpr,
    J: tl.constexpr,
    SUB: tl.constexpr,
):
    ptrs, ok = _scratch_block(a_ptr, first, n, start, h, H, C, I, J, SUB)
    return tl.load(ptrs, mask=ok, other=0.0)


@triton.jit
def _store_block(
    a_ptr,
    x,
    first,
    n,
    start,
    h,
    H,
    C: tl.constexpr,
    I: tl.constexpr,
    J: tl.constexpr,
    SUB: tl.constexpr,
):
    ptrs, ok = _scratch_block(a_ptr, first, n, start, h, H, C, I, J, SUB)
    tl.store(ptrs, x, mask=ok)


@triton.jit
def _invert_blocks(a_ptr, first, n, start, h, H, C: tl.constexpr):
    """(I + A)^-1 of the block's strictly lower [C, C] A, in place in the scratch, by blocks of
    SUB = C / 4 rows: the diagonal blocks' inverses by substitution (SUB - 1 serial steps, the
    four side by side), then block forward substitution, T_ij = -T_ii sum_{j<=m<i} A_im T_mj,
    by small float32 dots (fla's solve_tril). Blocks above the diagonal are left as they are."""
    SUB: tl.constexpr = C // 4
    at = (first, n, start, h, H, C)
    t0, t1, t2, t3 = _inverse_diagonal(a_ptr, *at, SUB)
    a10 = _load_block(a_ptr, *at, 1, 0, SUB)
    a20 = _load_block(a_ptr, *at, 2, 0, SUB)
    a21 = _load_block(a_ptr, *at, 2, 1, SUB)
    a30 = _load_block(a_ptr, *at, 3, 0, SUB)
    a31 = _load_block(a_ptr, *at, 3, 1, SUB)
    a32 = _load_block(a_ptr, *at, 3, 2, SUB)
    t10 = -_mm(t1, _mm(a10, t0))
    t21 = -_mm(t2, _mm(a21, t1))
    t20 = -_mm(t2, _mm(a20, t0) + _mm(a21, t10))
    t32 = -_mm(t3, _mm(a32, t2))
    t31 = -_mm(t3, _mm(a31, t1) + _mm(a32, t21))
    t30 = -_mm(t3, _mm(a30, t0) + _mm(a31, t10) + _mm(a32, t20))
    tl.debug_barrier()  # every thread's loads of A before any store of T over it
    _store_block(a_ptr, t0, *at, 0, 0, SUB)
    _store_block(a_ptr, t1, *at, 1, 1, SUB)
    _store_block(a_ptr, t2, *at, 2, 2, SUB)
    _store_block(a_ptr, t3, *at, 3, 3, SUB)
    _store_block(a_ptr, t10, *at, 1, 0, SUB)
    _store_block(a_ptr, t20, *at, 2, 0, SUB)
    _store_block(a_ptr, t21, *at, 2, 1, SUB)
    _store_block(a_ptr, t30, *at, 3, 0, SUB)
    _store_block(a_ptr, t31, *at, 3, 1, SUB)
    _store_block(a_ptr, t32, *at, 3, 2, SUB)


@triton.jit
def _work_block(work_ptr, cu_seqlens_q_ptr, C: tl.constexpr):
    """(entry, start, n, first) of the program's block: its work entry (< 0: none), its
    sequence's first row and length, and the block's first row in the sequence."""
    entry = tl.load(work_ptr + tl.program_id(1))
    e = tl.maximum(entry, 0)
    b = e // _WORK_SEQ
    start = tl.load(cu_seqlens_q_ptr + b)
    n = tl.load(cu_seqlens_q_ptr + b + 1) - start
    return entry, start, n, (tl.cdiv(n, C) - 1 - e % _WORK_SEQ) * C


@triton.jit
def _gated_rows(
    k_head,
    g_ptr,
    beta_ptr,
    rows,
    ok,
    h,
    offs_k,
    k_ok,
    stride_kt,
    stride_gt,
    stride_gh,
    stride_bt,
    stride_bh,
    eps,
):
    """A block's normed k [C, BLOCK_K], beta [C] and cumulative log decay c [C], float32,
    zeros past the sequence (where g = 0 keeps c)."""
    k = _unit_rows(_block_rows(k_head, rows, ok, offs_k, k_ok, stride_kt), eps)
    beta = tl.load(beta_ptr + rows * stride_bt + h * stride_bh, mask=ok, other=0.0).to(tl.float32)
    c = tl.cumsum(tl.load(g_ptr + rows * stride_gt + h * stride_gh, mask=ok, other=0.0), axis=0)
    return k, beta, c


@triton.jit
def _system_kernel(
    # Pointers.
    k_ptr,  # [T, Hk, K], strided by stride_kt, stride_kh, K contiguous
    g_ptr,  # [T, H] float32, strided by stride_gt, stride_gh
    beta_ptr,  # [T, H], strided by stride_bt, stride_bh
    a_ptr,  # [T, H, C] float32 contiguous scratch: A of the step's rows, written
    cu_seqlens_q_ptr,  # [B + 1] int32
    work_ptr,  # [NW] int32: each program's (sequence, block), attention_work at C
    # Sizes and strides.
    H,
    K,
    stride_kt,
    stride_kh,
    stride_gt,
    stride_gh,
    stride_bt,
    stride_bh,
    eps,
    # Meta-parameters.
    GROUPS: tl.constexpr,  # H // Hk
    C: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    PDL: tl.constexpr,
):
    """A of one (value head, block): [C, C] strictly lower, by one dot."""
    pdl_wait(PDL)  # first: see kernels/pdl.py
    h = tl.program_id(0)
    entry, start, n, first = _work_block(work_ptr, cu_seqlens_q_ptr, C)
    if entry < 0:
        return  # past the step's blocks (a graph's grid is sized for its largest step)
    idx = tl.arange(0, C)
    ok = first + idx < n
    rows = (start + first + idx).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    k, beta, c = _gated_rows(
        k_ptr + (h // GROUPS) * stride_kh,
        g_ptr,
        beta_ptr,
        rows,
        ok,
        h,
        offs_k,
        offs_k < K,
        stride_kt,
        stride_gt,
        stride_gh,
        stride_bt,
        stride_bh,
        eps,
    )
    # the exponent masked first (exp(c_i - c_j) > 1 above the diagonal)
    lower = idx[None, :] < idx[:, None]
    decay = tl.exp(tl.where(lower, c[:, None] - c[None, :], 0.0))
    kk = tl.dot(k, tl.trans(k), input_precision=DOT_PRECISION)
    a_ptrs = a_ptr + (rows[:, None] * H + h) * C + idx[None, :]
    tl.store(a_ptrs, tl.where(lower, beta[:, None] * kk * decay, 0.0), mask=ok[:, None])


@triton.jit
def _solve_kernel(
    a_ptr,  # [T, H, C] float32 contiguous scratch: A in, (I + A)^-1 out (its lower blocks)
    cu_seqlens_q_ptr,  # [B + 1] int32
    work_ptr,  # [NW] int32
    H,
    C: tl.constexpr,
    PDL: tl.constexpr,
):
    """(I + A)^-1 of one (value head, block), in place (_invert_blocks). Its tiles are
    [C / 4, C / 4]: a warp or two, whose sums need no block-wide barrier."""
    pdl_wait(PDL)  # first: see kernels/pdl.py
    entry, start, n, first = _work_block(work_ptr, cu_seqlens_q_ptr, C)
    if entry < 0:
        return
    _invert_blocks(a_ptr, first, n, start, tl.program_id(0), H, C)


@triton.jit
def _wu_kernel(
    # Pointers.
    q_ptr,  # [T, Hk, K], strided by stride_qt, stride_qh, K contiguous
    k_ptr,  # [T, Hk, K], strided by stride_kt, stride_kh, K contiguous
    v_ptr,  # [T, H, V], strided by stride_vt, stride_vh, V contiguous
    g_ptr,  # [T, H] float32, strided by stride_gt, stride_gh
    beta_ptr,  # [T, H], strided by stride_bt, stride_bh
    a_ptr,  # [T, H, C] float32 contiguous: (I + A)^-1 (_solve_kernel's) in, the within-block
    # scores tril(q k^T exp(c_i - c_j)) out, for _blocks_kernel
    w_ptr,  # [T, H, K] scratch dtype, contiguous: written for the step's rows
    u_ptr,  # [T, H, V] scratch dtype, contiguous: written for the step's rows
    qg_ptr,  # [T, H, K] scratch dtype: q scale exp(c), normed (PREPARED; else unused)
    kd_ptr,  # [T, H, K] scratch dtype: k exp(c_last - c), normed (PREPARED; else unused)
    cu_seqlens_q_ptr,  # [B + 1] int32
    work_ptr,  # [NW] int32
    # Sizes and strides.
    H,
    K,
    V,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_gt,
    stride_gh,
    stride_bt,
    stride_bh,
    scale,  # K ** -0.5
    eps,
    # Meta-parameters.
    GROUPS: tl.constexpr,
    C: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    PREPARED: tl.constexpr,
    PDL: tl.constexpr,
):
    """w = T (beta k exp(c)) and u = T (beta v) of one (value head, block), by one dot each;
    then the block's within scores over T in the scratch (the serial _blocks_kernel's largest
    dot, taken out of its chain), and with PREPARED its q and k rows as the chain uses them."""
    pdl_wait(PDL)  # first: see kernels/pdl.py
    h = tl.program_id(0)
    entry, start, n, first = _work_block(work_ptr, cu_seqlens_q_ptr, C)
    if entry < 0:
        return
    idx = tl.arange(0, C)
    ok = first + idx < n
    rows = (start + first + idx).to(tl.int64)
    offs_k, offs_v = tl.arange(0, BLOCK_K), tl.arange(0, BLOCK_V)
    k_ok, v_ok = offs_k < K, offs_v < V
    k, beta, c = _gated_rows(
        k_ptr + (h // GROUPS) * stride_kh,
        g_ptr,
        beta_ptr,
        rows,
        ok,
        h,
        offs_k,
        k_ok,
        stride_kt,
        stride_gt,
        stride_gh,
        stride_bt,
        stride_bh,
        eps,
    )
    # T is block lower triangular: the blocks above the diagonal (never written) masked
    below = (idx[None, :] // (C // 4)) <= (idx[:, None] // (C // 4))
    t = tl.load(
        a_ptr + (rows[:, None] * H + h) * C + idx[None, :], mask=ok[:, None] & below, other=0.0
    )
    w = tl.dot(t, k * (beta * tl.exp(c))[:, None], input_precision=DOT_PRECISION)
    k_rows = (rows[:, None] * H + h) * K + offs_k[None, :]  # of the [T, H, K] scratch
    rows_ok = ok[:, None] & k_ok[None, :]
    tl.store(w_ptr + k_rows, w.to(w_ptr.dtype.element_ty), mask=rows_ok)
    v = tl.load(
        v_ptr + h * stride_vh + rows[:, None] * stride_vt + offs_v[None, :],
        mask=ok[:, None] & v_ok[None, :],
        other=0.0,
    ).to(tl.float32)
    u = tl.dot(t, v * beta[:, None], input_precision=DOT_PRECISION)
    tl.store(
        u_ptr + (rows[:, None] * H + h) * V + offs_v[None, :],
        u.to(u_ptr.dtype.element_ty),
        mask=ok[:, None] & v_ok[None, :],
    )
    q_head = q_ptr + (h // GROUPS) * stride_qh
    q = _unit_rows(_block_rows(q_head, rows, ok, offs_k, k_ok, stride_qt), eps) * scale
    if PREPARED:  # rows past the sequence have g = 0: c's last entry is the block's decay
        c_last = tl.sum(tl.where(idx == C - 1, c, 0.0), axis=0)
        qg = q * tl.exp(c)[:, None]
        tl.store(qg_ptr + k_rows, qg.to(qg_ptr.dtype.element_ty), mask=rows_ok)
        kd = k * tl.exp(c_last - c)[:, None]
        tl.store(kd_ptr + k_rows, kd.to(kd_ptr.dtype.element_ty), mask=rows_ok)
    causal = idx[None, :] <= idx[:, None]
    qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
    within = tl.where(causal, qk * tl.exp(tl.where(causal, c[:, None] - c[None, :], 0.0)), 0.0)
    tl.debug_barrier()  # every thread's loads of T before the scores go over it
    tl.store(a_ptr + (rows[:, None] * H + h) * C + idx[None, :], within, mask=ok[:, None])


@triton.jit
def _blocks_kernel(
    # Pointers.
    q_ptr,  # [T, Hk, K], strided by stride_qt, stride_qh, K contiguous
    k_ptr,  # [T, Hk, K], strided by stride_kt, stride_kh, K contiguous
    g_ptr,  # [T, H] float32, strided by stride_gt, stride_gh
    a_ptr,  # [T, H, C] float32 contiguous: the within-block scores (_wu_kernel's)
    w_ptr,  # [T, H, K] scratch dtype, contiguous (_wu_kernel's)
    u_ptr,  # [T, H, V] scratch dtype, contiguous (_wu_kernel's)
    qg_ptr,  # [T, H, K] scratch dtype (_wu_kernel's, PREPARED; else unused)
    kd_ptr,  # [T, H, K] scratch dtype (_wu_kernel's, PREPARED; else unused)
    state_ptr,  # [S, H, K, V] float32 contiguous: read, then written for the batch's slots
    out_ptr,  # [T, H, V] contiguous, v's dtype
    cu_seqlens_q_ptr,  # [B + 1] int32
    seq_lens_ptr,  # [B] int32
    state_slots_ptr,  # [B] int32
    # Sizes and strides.
    num_seqs,
    num_rows,
    H,
    K,
    V,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_gt,
    stride_gh,
    scale,  # K ** -0.5
    eps,
    # Meta-parameters.
    GROUPS: tl.constexpr,
    C: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    PREPARED: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_wait(PDL)  # first: see kernels/pdl.py
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_k = tl.arange(0, BLOCK_K)
    offs_v = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    k_ok, v_ok = offs_k < K, offs_v < V
    tile_ok = k_ok[:, None] & v_ok[None, :]
    zero_padded_rows(out_ptr + h * V + offs_v, v_ok, b, cu_seqlens_q_ptr, num_seqs, num_rows, H * V)
    start, n, continues, slot = sequence(b, cu_seqlens_q_ptr, seq_lens_ptr, state_slots_ptr)
    if n == 0:
        return  # a padded sequence: its slot stays as it is

    s_ptrs = state_ptr + ((slot * H + h) * K + offs_k[:, None]) * V + offs_v[None, :]
    s = tl.load(s_ptrs, mask=tile_ok & continues, other=0.0)
    idx = tl.arange(0, C)
    q_head = q_ptr + (h // GROUPS) * stride_qh
    k_head = k_ptr + (h // GROUPS) * stride_kh
    for first in range(0, n, C):
        r = first + idx
        ok = r < n
        rows = (start + r).to(tl.int64)
        k_rows = (rows[:, None] * H + h) * K + offs_k[None, :]  # of the [T, H, K] scratch
        rows_ok = ok[:, None] & k_ok[None, :]
        g = tl.load(g_ptr + rows * stride_gt + h * stride_gh, mask=ok, other=0.0)
        c_last = tl.sum(g, axis=0)  # rows past the sequence have g = 0
        if PREPARED:
            qg = tl.load(qg_ptr + k_rows, mask=rows_ok, other=0.0)
            k_out = tl.load(kd_ptr + k_rows, mask=rows_ok, other=0.0)
        else:
            c = tl.cumsum(g, axis=0)
            q = _unit_rows(_block_rows(q_head, rows, ok, offs_k, k_ok, stride_qt), eps) * scale
            k = _unit_rows(_block_rows(k_head, rows, ok, offs_k, k_ok, stride_kt), eps)
            qg = q * tl.exp(c)[:, None]
            k_out = k * tl.exp(c_last - c)[:, None]
        w = tl.load(w_ptr + k_rows, mask=rows_ok, other=0.0)
        u = tl.load(
            u_ptr + (rows[:, None] * H + h) * V + offs_v[None, :],
            mask=ok[:, None] & v_ok[None, :],
            other=0.0,
        ).to(tl.float32)
        # a bf16 scratch's dots take the state in bf16 too (fla's); float32's, tf32 or ieee
        v_new = u - tl.dot(w, s.to(w.dtype), input_precision=DOT_PRECISION)  # [C, BLOCK_V]
        within = tl.load(a_ptr + (rows[:, None] * H + h) * C + idx[None, :], mask=ok[:, None])
        o = tl.dot(qg, s.to(qg.dtype), input_precision=DOT_PRECISION)
        o = tl.dot(within, v_new, acc=o, input_precision=DOT_PRECISION)
        tl.store(
            out_ptr + (rows[:, None] * H + h) * V + offs_v[None, :],
            o.to(out_ptr.dtype.element_ty),
            mask=ok[:, None] & v_ok[None, :],
        )
        s = tl.dot(
            tl.trans(k_out),
            v_new.to(k_out.dtype),
            acc=s * tl.exp(c_last),
            input_precision=DOT_PRECISION,
        )
    tl.store(s_ptrs, s, mask=tile_ok)


def chunked_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    attn: AttentionMetadata,
    *,
    config: ChunkedConfig | None = None,
) -> torch.Tensor:
    """Semantics: gated_delta.gated_delta_rule's up to float rounding, with delta_rule's
    contract on shapes, padding and graphs; scratch of [T, H, K + V] (3K + V prepared) in
    config.scratch's dtype, and float32 [T, H, C]. config: tests."""
    check_delta_inputs(q, k, v, g, beta, state)
    (T, Hk, K), (H, V), B = q.shape, v.shape[1:], step_sequences(attn)
    out = torch.empty(T, H, V, dtype=v.dtype, device=v.device)
    if T == 0:
        return out
    config = config or (CONFIG if v.is_cuda else INTERPRETER_CONFIG)
    a, scratch = _scratch(v, K, config)
    common = dict(
        H=H,
        K=K,
        V=V,
        eps=_L2_EPS,
        GROUPS=H // Hk,
        C=config.chunk,
        BLOCK_K=max(next_power_of_2(K), 16),
        DOT_PRECISION="ieee" if v.dtype == torch.float32 else config.dot_precision,
        PREPARED=config.prepared,
        num_warps=config.num_warps,
        **pdl_kwargs(v.device),
    )
    _launch_prepare(q, k, v, g, beta, a, scratch, attn, config, common)
    block_v = max(min(config.block_v, next_power_of_2(V)), 16)  # tl.dot's least width
    _blocks_kernel[(B, H, cdiv(V, block_v))](
        q_ptr=q,
        k_ptr=k,
        g_ptr=g,
        a_ptr=a,
        **scratch,
        state_ptr=state,
        out_ptr=out,
        cu_seqlens_q_ptr=attn.cu_seqlens_q,
        seq_lens_ptr=attn.seq_lens,
        state_slots_ptr=attn.state_slots,
        num_seqs=B,
        num_rows=T,
        **strides("q", q),
        **strides("k", k),
        **strides("g", g),
        scale=K**-0.5,
        BLOCK_V=block_v,
        num_stages=_chain_stages(config, scratch["w_ptr"].dtype),
        **common,
    )
    return out


def _chain_stages(config: ChunkedConfig, rows: torch.dtype) -> int:
    """_blocks_kernel's stages: prepared float32 rows at two stages need more shared memory than
    sm_90 has (bench/compile_audit.py), so they take one."""
    return 1 if config.prepared and rows == torch.float32 else config.num_stages


def _scratch(v: torch.Tensor, K: int, config: ChunkedConfig) -> tuple[torch.Tensor, dict]:
    """(A's float32 [T, H, C], the kernels' w_ptr, u_ptr, qg_ptr and kd_ptr): the rows
    _wu_kernel writes for the chain, in config.scratch's dtype; qg and kd are w's tensor
    without config.prepared (PREPARED off: neither read nor written)."""
    (T, H, V), device = v.shape, v.device
    a = torch.empty(T, H, config.chunk, dtype=torch.float32, device=device)
    # float32 models (the GPU's comparisons with transformers) keep float32 rows and products
    dt = torch.float32 if v.dtype == torch.float32 else getattr(torch, config.scratch)
    k_rows = torch.empty(3 if config.prepared else 1, T, H, K, dtype=dt, device=device)
    w, qg, kd = k_rows if config.prepared else (k_rows[0],) * 3
    u = torch.empty(T, H, V, dtype=dt, device=device)
    return a, dict(w_ptr=w, u_ptr=u, qg_ptr=qg, kd_ptr=kd)


def _launch_prepare(q, k, v, g, beta, a, scratch, attn, config: ChunkedConfig, common: dict):
    """w and u (and q, k as the chain uses them: scratch's rows) of every block of the step (its
    work table at config.chunk): A, its inverse, then w and u, three launches over the same
    (value head, block) grid."""
    work = attention_work(attn.cu_seqlens_q, k.shape[0], config.chunk)
    grid = (v.shape[1], work.shape[0])
    rows = dict(cu_seqlens_q_ptr=attn.cu_seqlens_q, work_ptr=work)
    gated = dict(k_ptr=k, g_ptr=g, beta_ptr=beta, **strides("k", k), **strides("g", g))
    gated |= strides("b", beta)
    system = {name: common[name] for name in _SYSTEM_META}
    _system_kernel[grid](a_ptr=a, **rows, **gated, **system, **pdl_kwargs(v.device))
    _solve_kernel[grid](
        a_ptr=a,
        **rows,
        H=common["H"],
        C=common["C"],
        num_warps=config.solve_warps,
        **pdl_kwargs(v.device),
    )
    _wu_kernel[grid](
        q_ptr=q,
        v_ptr=v,
        a_ptr=a,
        **scratch,
        **rows,
        **gated,
        **strides("q", q),
        **strides("v", v),
        scale=k.shape[2] ** -0.5,
        BLOCK_V=max(next_power_of_2(v.shape[2]), 16),
        **common,
    )
