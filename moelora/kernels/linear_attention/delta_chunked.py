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
    arithmetic), w and u by two dots, stored as float32 scratch rows beside the step's rows.
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


@dataclass(frozen=True)
class ChunkedConfig:
    chunk: int  # tokens a block
    block_v: int  # value columns a _blocks_kernel program
    num_warps: int
    num_stages: int  # of _blocks_kernel's loop over blocks: its loads of the next ones
    # tl.dot's for bf16 and fp16 inputs: tf32 tensor cores on the GPU (float32 dots by FMA
    # spill heavily at these tiles: bench/compile_audit.py); exact float32 in the interpreter
    dot_precision: str


# First cut, not yet run on a GPU: fla's block of 64 tokens; 32 value columns give 4 programs a
# value head, so one sequence of Qwen3.5's 32 heads fills 128 multiprocessors.
CONFIG = ChunkedConfig(chunk=CHUNK, block_v=32, num_warps=8, num_stages=2, dot_precision="tf32")
# The interpreter runs every program in numpy: blocks of 4 give short test chunks several.
INTERPRETER_CONFIG = ChunkedConfig(
    chunk=4, block_v=16, num_warps=1, num_stages=1, dot_precision="ieee"
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
def _inverse_unit_lower(a, C: tl.constexpr):
    """(I + a)^-1 for a [C, C] strictly lower triangular: row i = e_i - sum_{j<i} a_ij row j,
    the rows in order (rows j >= i are still e_j, and a_ij = 0 there)."""
    idx = tl.arange(0, C)
    t = (idx[:, None] == idx[None, :]).to(tl.float32)
    for i in range(1, C):
        a_i = tl.sum(tl.where(idx[:, None] == i, a, 0.0), axis=0)  # row i of a
        row = tl.where(idx == i, 1.0, 0.0) - tl.sum(a_i[:, None] * t, axis=0)
        t = tl.where(idx[:, None] == i, row[None, :], t)
    return t


@triton.jit
def _prepare_kernel(
    # Pointers.
    k_ptr,  # [T, Hk, K], strided by stride_kt, stride_kh, K contiguous
    v_ptr,  # [T, H, V], strided by stride_vt, stride_vh, V contiguous
    g_ptr,  # [T, H] float32, strided by stride_gt, stride_gh
    beta_ptr,  # [T, H], strided by stride_bt, stride_bh
    w_ptr,  # [T, H, K] float32 contiguous: written for the step's rows
    u_ptr,  # [T, H, V] float32 contiguous: written for the step's rows
    cu_seqlens_q_ptr,  # [B + 1] int32
    work_ptr,  # [NW] int32: each program's (sequence, block), attention_work at C
    # Sizes and strides.
    H,
    K,
    V,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_gt,
    stride_gh,
    stride_bt,
    stride_bh,
    eps,
    # Meta-parameters.
    GROUPS: tl.constexpr,  # H // Hk
    C: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_wait(PDL)  # first: see kernels/pdl.py
    h = tl.program_id(0)
    entry = tl.load(work_ptr + tl.program_id(1))
    if entry < 0:
        return  # past the step's blocks (a graph's grid is sized for its largest step)
    b = entry // _WORK_SEQ
    start = tl.load(cu_seqlens_q_ptr + b)
    n = tl.load(cu_seqlens_q_ptr + b + 1) - start
    idx = tl.arange(0, C)
    r = (tl.cdiv(n, C) - 1 - entry % _WORK_SEQ) * C + idx
    ok = r < n
    rows = (start + r).to(tl.int64)
    offs_k, offs_v = tl.arange(0, BLOCK_K), tl.arange(0, BLOCK_V)
    k_ok, v_ok = offs_k < K, offs_v < V

    k = _unit_rows(
        _block_rows(k_ptr + (h // GROUPS) * stride_kh, rows, ok, offs_k, k_ok, stride_kt), eps
    )
    v = tl.load(
        v_ptr + h * stride_vh + rows[:, None] * stride_vt + offs_v[None, :],
        mask=ok[:, None] & v_ok[None, :],
        other=0.0,
    ).to(tl.float32)
    beta = tl.load(beta_ptr + rows * stride_bt + h * stride_bh, mask=ok, other=0.0).to(tl.float32)
    c = tl.cumsum(tl.load(g_ptr + rows * stride_gt + h * stride_gh, mask=ok, other=0.0), axis=0)

    # A [C, C] strictly lower; the exponent masked first (exp(c_i - c_j) > 1 above the diagonal)
    lower = idx[None, :] < idx[:, None]
    decay = tl.exp(tl.where(lower, c[:, None] - c[None, :], 0.0))
    kk = tl.dot(k, tl.trans(k), input_precision=DOT_PRECISION)
    t = _inverse_unit_lower(tl.where(lower, beta[:, None] * kk * decay, 0.0), C)
    w = tl.dot(t, k * (beta * tl.exp(c))[:, None], input_precision=DOT_PRECISION)
    u = tl.dot(t, v * beta[:, None], input_precision=DOT_PRECISION)
    tl.store(
        w_ptr + (rows[:, None] * H + h) * K + offs_k[None, :], w, mask=ok[:, None] & k_ok[None, :]
    )
    tl.store(
        u_ptr + (rows[:, None] * H + h) * V + offs_v[None, :], u, mask=ok[:, None] & v_ok[None, :]
    )


@triton.jit
def _blocks_kernel(
    # Pointers.
    q_ptr,  # [T, Hk, K], strided by stride_qt, stride_qh, K contiguous
    k_ptr,  # [T, Hk, K], strided by stride_kt, stride_kh, K contiguous
    g_ptr,  # [T, H] float32, strided by stride_gt, stride_gh
    w_ptr,  # [T, H, K] float32 contiguous (_prepare_kernel's)
    u_ptr,  # [T, H, V] float32 contiguous (_prepare_kernel's)
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
    causal = idx[None, :] <= idx[:, None]
    q_head = q_ptr + (h // GROUPS) * stride_qh
    k_head = k_ptr + (h // GROUPS) * stride_kh
    for first in range(0, n, C):
        r = first + idx
        ok = r < n
        rows = (start + r).to(tl.int64)
        q = _unit_rows(_block_rows(q_head, rows, ok, offs_k, k_ok, stride_qt), eps) * scale
        k = _unit_rows(_block_rows(k_head, rows, ok, offs_k, k_ok, stride_kt), eps)
        g = tl.load(g_ptr + rows * stride_gt + h * stride_gh, mask=ok, other=0.0)
        c = tl.cumsum(g, axis=0)
        c_last = tl.sum(g, axis=0)  # rows past the sequence have g = 0
        w = tl.load(
            w_ptr + (rows[:, None] * H + h) * K + offs_k[None, :],
            mask=ok[:, None] & k_ok[None, :],
            other=0.0,
        )
        u = tl.load(
            u_ptr + (rows[:, None] * H + h) * V + offs_v[None, :],
            mask=ok[:, None] & v_ok[None, :],
            other=0.0,
        )
        v_new = u - tl.dot(w, s, input_precision=DOT_PRECISION)  # [C, BLOCK_V]
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        within = tl.where(causal, qk * tl.exp(tl.where(causal, c[:, None] - c[None, :], 0.0)), 0.0)
        o = tl.dot(q * tl.exp(c)[:, None], s, input_precision=DOT_PRECISION)
        o = tl.dot(within, v_new, acc=o, input_precision=DOT_PRECISION)
        tl.store(
            out_ptr + (rows[:, None] * H + h) * V + offs_v[None, :],
            o.to(out_ptr.dtype.element_ty),
            mask=ok[:, None] & v_ok[None, :],
        )
        k_out = k * tl.exp(c_last - c)[:, None]
        s = tl.dot(tl.trans(k_out), v_new, acc=s * tl.exp(c_last), input_precision=DOT_PRECISION)
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
    contract on shapes, padding and graphs; float32 scratch of [T, H, K + V]. config: tests."""
    check_delta_inputs(q, k, v, g, beta, state)
    (T, Hk, K), (H, V), B = q.shape, v.shape[1:], step_sequences(attn)
    out = torch.empty(T, H, V, dtype=v.dtype, device=v.device)
    if T == 0:
        return out
    config = config or (CONFIG if v.is_cuda else INTERPRETER_CONFIG)
    w = torch.empty(T, H, K, dtype=torch.float32, device=v.device)
    u = torch.empty(T, H, V, dtype=torch.float32, device=v.device)
    common = dict(
        H=H,
        K=K,
        V=V,
        eps=_L2_EPS,
        GROUPS=H // Hk,
        C=config.chunk,
        BLOCK_K=max(next_power_of_2(K), 16),
        # float32 models (the GPU's comparisons with transformers) keep float32 products
        DOT_PRECISION="ieee" if v.dtype == torch.float32 else config.dot_precision,
        num_warps=config.num_warps,
        **pdl_kwargs(v.device),
    )
    _launch_prepare(k, v, g, beta, w, u, attn, config, common)
    block_v = max(min(config.block_v, next_power_of_2(V)), 16)  # tl.dot's least width
    _blocks_kernel[(B, H, cdiv(V, block_v))](
        q_ptr=q,
        k_ptr=k,
        g_ptr=g,
        w_ptr=w,
        u_ptr=u,
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
        num_stages=config.num_stages,
        **common,
    )
    return out


def _launch_prepare(k, v, g, beta, w, u, attn, config: ChunkedConfig, common: dict) -> None:
    """_prepare_kernel over every block of the step (its work table at config.chunk)."""
    work = attention_work(attn.cu_seqlens_q, k.shape[0], config.chunk)
    _prepare_kernel[(v.shape[1], work.shape[0])](
        k_ptr=k,
        v_ptr=v,
        g_ptr=g,
        beta_ptr=beta,
        w_ptr=w,
        u_ptr=u,
        cu_seqlens_q_ptr=attn.cu_seqlens_q,
        work_ptr=work,
        **strides("k", k),
        **strides("v", v),
        **strides("g", g),
        **strides("b", beta),
        BLOCK_V=max(next_power_of_2(v.shape[2]), 16),
        **common,
    )
