"""Multi-head latent attention (DeepSeek) in Triton: the attention over the paged latent cache in
the latent space, with kv_b_proj's absorption on either side of it (mla_absorb.py: its LoRA,
and o_proj's LoRA shrink where asked, in the same launches). A prefill step's sequences given all
their keys expanded (kernels/mla.ExpandedKv) attend in that form instead (mla_expanded.py):
mla_attention runs both, each skipping the other's sequences.

Algorithm
---------
Every cached token holds one latent c [L] and one rotated key k_pe [R] that all heads share; the
score of head h's query row (q_lat, q_pe) for a token is scale * (q_lat . c + q_pe . k_pe), and
the output is the softmax-weighted sum of the latents. So the latent is at once key and value:
a program loads a KV tile of latents [BLOCK_N, L] once and uses it for both dots.

One program owns one sequence, a block of BLOCK_H heads and, in prefill, a block of BLOCK_Q query
tokens: its rows are the pairs (token, head), BLOCK_Q * BLOCK_H of them, and they all read the
same tiles. That sharing is MLA's bandwidth win in decode, where a program's rows are BLOCK_H
heads of the sequence's one new token. The program walks its KV range one BLOCK_N tile at a time,
gathering the tile's rows through the page table, and keeps the flash-attention running max,
running sum and fp32 accumulator [rows, L] (online softmax, base 2). Every tile computes the
causal mask (after the exponent), so a key's weight is computed alike in every tile.

Decode (at most one new token per sequence) cuts a sequence's range into S pieces when the
programs would not fill the GPU (flash-decoding): each piece writes its partial output with its
log-sum-exp and a second kernel combines them. The split length is computed inside the kernels
from seq_len, so the grids depend on shapes only and a decode step can be captured in a CUDA
graph; decode programs also zero the padded rows past cu_seqlens_q[-1] (no memset recorded).
Prefill takes its (sequence, query block) from a work table built on the device
(paged.attention_work), the longest blocks first, so its grid depends on shapes only too.

Legend: T = tokens, B = sequences, Hh = heads, L = kv_lora_rank, R = qk_rope_head_dim,
S = splits.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import torch
import triton
import triton.language as tl

from moelora.kernels.attention import mla_absorb, mla_expanded
from moelora.kernels.attention.paged import (
    LOG2_E,
    MAX_SPLITS,
    PROGRAMS_PER_SM,
    _split_len,
    attention_work,
)
from moelora.kernels.lora import lora_shrink_split
from moelora.kernels.mla import Absorption, ExpandedKv, absorbed_latents
from moelora.kernels.pdl import pdl_kwargs, pdl_wait
from moelora.kernels.reference import WORK_SEQ
from moelora.kernels.sizes import cdiv, next_power_of_2
from moelora.step.lora import FoldedLora, LoraBatchInfo, LoraWeights

if TYPE_CHECKING:
    from moelora.step.batch import AttentionMetadata

_WORK_SEQ = tl.constexpr(WORK_SEQ)  # a work entry: sequence * WORK_SEQ + blocks from its last


@dataclass(frozen=True)
class MlaConfig:
    """Tiles of one launch: a program's rows are block_m // block_h query tokens x block_h
    heads (a decode's one token x block_h heads)."""

    block_h: int
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


# First cut, not yet swept on a GPU: the accumulator is [rows, L] fp32 (L = 512 for DeepSeek-V3),
# so rows stay few; tl.dot wants at least 16 of them.
DECODE_CONFIG = MlaConfig(block_h=16, block_m=16, block_n=32, num_warps=4, num_stages=2)
PREFILL_CONFIG = MlaConfig(block_h=16, block_m=32, block_n=32, num_warps=8, num_stages=2)
# The interpreter runs every program in numpy: small tiles keep CPU tests fast; prefill heads
# in blocks of 2 so that small tests have several head blocks.
INTERPRETER_CONFIG = MlaConfig(block_h=2, block_m=16, block_n=16, num_warps=1, num_stages=1)


@triton.jit(do_not_specialize=["num_seqs", "num_rows"])  # one compile for all batch sizes
def _mla_attention_kernel(
    # Pointers
    q_lat_ptr,  # [T, Hh, L]
    q_pe_ptr,  # [T, Hh, R]
    latent_ptr,  # [P, page_size, 1, L]
    rope_ptr,  # [P, page_size, 1, R]
    out_ptr,  # [T, Hh, L] float32, its last dimension contiguous
    part_out_ptr,  # [B, Hh, S, L] float32, only with SPLIT
    part_lse_ptr,  # [B, Hh, S] float32 (base 2), only with SPLIT
    cu_seqlens_q_ptr,
    seq_lens_ptr,
    page_table_ptr,
    work_ptr,  # [NW] int32, only with WORK: each program's (sequence, block), attention_work
    cu_seqlens_k_ptr,  # [B + 1] int32, only with SKIP_EXPANDED: ExpandedKv.cu_seqlens_k
    # Sizes
    num_seqs,
    num_rows,
    num_heads,
    latent_dim,
    rope_dim,
    num_splits,
    scale_log2,
    # Strides
    stride_qt,
    stride_qh,
    stride_ql,
    stride_et,  # q_pe's
    stride_eh,
    stride_er,
    stride_cp,  # the latent cache's (page, slot in page, latent)
    stride_cs,
    stride_cl,
    stride_rp,  # the rope cache's
    stride_rs,
    stride_rr,
    stride_ot,
    stride_oh,
    stride_tb,  # the page table's
    stride_tp,
    # Meta-parameters
    BLOCK_H: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_R: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    SPLIT: tl.constexpr,
    ZERO_TAIL: tl.constexpr,
    WORK: tl.constexpr,  # prefill: the grid is (head blocks, work entries)
    SKIP_EXPANDED: tl.constexpr,  # sequences given all their keys expanded: that form's
    DOT_PRECISION: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_wait(PDL)  # first: see kernels/pdl.py
    BLOCK_M: tl.constexpr = BLOCK_Q * BLOCK_H

    # -- Map the program to (sequence, head block, query block, split) -------------------------
    if WORK:
        # entries past the step's blocks are -1 (a graph's grid is sized for its largest step)
        pid_h = tl.program_id(0)
        entry = tl.load(work_ptr + tl.program_id(1))
        if entry < 0:
            return
        pid_b = entry // _WORK_SEQ
        from_last = entry % _WORK_SEQ
        pid_s = 0
    else:
        pid_b = tl.program_id(0)
        pid_h = tl.program_id(1)
        pid_s = tl.program_id(2)
        from_last = 0
    offs_l = tl.arange(0, BLOCK_L)
    offs_e = tl.arange(0, BLOCK_R)
    l_mask = offs_l < latent_dim
    e_mask = offs_e < rope_dim

    if ZERO_TAIL:
        # Rows past the last sequence's tokens are padding: the first split of row pid_b zeroes
        # its heads (the decode grid has max(B, T) programs on axis 0).
        total_tokens = tl.load(cu_seqlens_q_ptr + num_seqs)
        if (pid_s == 0) & (pid_b >= total_tokens) & (pid_b < num_rows):
            offs_g = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
            zero_ptrs = (
                out_ptr
                + pid_b.to(tl.int64) * stride_ot
                + offs_g[:, None] * stride_oh
                + offs_l[None, :]
            )
            zeros = tl.zeros([BLOCK_H, BLOCK_L], dtype=tl.float32)
            tl.store(zero_ptrs, zeros, mask=(offs_g[:, None] < num_heads) & l_mask[None, :])
    if pid_b >= num_seqs:
        return

    q_start = tl.load(cu_seqlens_q_ptr + pid_b)
    q_len = tl.load(cu_seqlens_q_ptr + pid_b + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + pid_b)
    pid_m = tl.cdiv(q_len, BLOCK_Q) - 1 - from_last  # decode: 0, or -1 for a sequence without
    if pid_m < 0:
        return
    if SKIP_EXPANDED:
        expanded = tl.load(cu_seqlens_k_ptr + pid_b + 1) - tl.load(cu_seqlens_k_ptr + pid_b)
        if expanded == seq_len:
            return  # its rows stay zero (prefill output is zeroed)

    # -- Rows: (token, head) -------------------------------------------------------------------
    offs_m = tl.arange(0, BLOCK_M)
    tok = pid_m * BLOCK_Q + offs_m // BLOCK_H
    head = pid_h * BLOCK_H + offs_m % BLOCK_H
    row_mask = (tok < q_len) & (head < num_heads)
    q_pos = seq_len - q_len + tok
    row = (q_start + tok).to(tl.int64)
    q = tl.load(
        q_lat_ptr
        + row[:, None] * stride_qt
        + head[:, None] * stride_qh
        + offs_l[None, :] * stride_ql,
        mask=row_mask[:, None] & l_mask[None, :],
        other=0.0,
    )
    q_pe = tl.load(
        q_pe_ptr
        + row[:, None] * stride_et
        + head[:, None] * stride_eh
        + offs_e[None, :] * stride_er,
        mask=row_mask[:, None] & e_mask[None, :],
        other=0.0,
    )
    # the dots run in the cache's dtype (fp32 accumulators)
    q = q.to(latent_ptr.dtype.element_ty)
    q_pe = q_pe.to(rope_ptr.dtype.element_ty)

    # -- KV range: up to the block's last causal position, then this program's split -----------
    kv_end = tl.minimum(seq_len, seq_len - q_len + tl.minimum(q_len, (pid_m + 1) * BLOCK_Q))
    split_len = _split_len(kv_end, num_splits, BLOCK_N)
    kv_start = pid_s * split_len
    kv_stop = tl.minimum(kv_end, kv_start + split_len)
    if SPLIT:
        if kv_start >= kv_stop:
            return

    # -- Accumulate in fp32 with the online softmax --------------------------------------------
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_L], dtype=tl.float32)
    page_row_ptr = page_table_ptr + pid_b * stride_tb
    for start in range(kv_start, kv_stop, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        n_mask = offs_n < kv_stop
        page = tl.load(page_row_ptr + (offs_n // PAGE_SIZE) * stride_tp, mask=n_mask, other=0)
        page = page.to(tl.int64)
        in_page = offs_n % PAGE_SIZE
        c = tl.load(
            latent_ptr
            + (page * stride_cp + in_page * stride_cs)[:, None]
            + offs_l[None, :] * stride_cl,
            mask=n_mask[:, None] & l_mask[None, :],
            other=0.0,
        )  # [BLOCK_N, BLOCK_L]: the tile's keys and its values
        k_pe = tl.load(
            rope_ptr
            + (page * stride_rp + in_page * stride_rs)[:, None]
            + offs_e[None, :] * stride_rr,
            mask=n_mask[:, None] & e_mask[None, :],
            other=0.0,
        )
        qk = tl.dot(q, tl.trans(c), input_precision=DOT_PRECISION)
        qk = tl.dot(q_pe, tl.trans(k_pe), acc=qk, input_precision=DOT_PRECISION) * scale_log2
        visible = (offs_n[None, :] <= q_pos[:, None]) & n_mask[None, :]
        m_new = tl.maximum(m_i, tl.max(tl.where(visible, qk, float("-inf")), 1))
        # A row with nothing visible yet keeps max -inf; subtract 0 then so no NaN appears.
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.math.exp2(m_i - m_ref)
        p = tl.where(visible, tl.math.exp2(qk - m_ref[:, None]), 0.0)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(c.dtype), c, input_precision=DOT_PRECISION)
        m_i = m_new

    # -- Store: the normalized output, or the split's partial and its log-sum-exp -------------
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    out_mask = row_mask[:, None] & l_mask[None, :]
    if not SPLIT:
        out_ptrs = out_ptr + row[:, None] * stride_ot + head[:, None] * stride_oh + offs_l[None, :]
        tl.store(out_ptrs, out, mask=out_mask)
    else:
        # Decode: one token per sequence, so rows are heads.
        part_row = (pid_b.to(tl.int64) * num_heads + head) * num_splits + pid_s
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.math.log2(l_i))
        tl.store(part_lse_ptr + part_row, lse, mask=row_mask)
        tl.store(
            part_out_ptr + part_row[:, None] * latent_dim + offs_l[None, :], out, mask=out_mask
        )


@triton.jit
def _combine_splits_kernel(
    # Pointers
    part_out_ptr,  # [B, Hh, S, L] float32
    part_lse_ptr,  # [B, Hh, S] float32, base 2
    out_ptr,  # [T, Hh, L] float32, its last dimension contiguous
    cu_seqlens_q_ptr,
    seq_lens_ptr,
    # Sizes
    latent_dim,
    num_splits,
    # Strides
    stride_ot,
    stride_oh,
    # Meta-parameters
    SPLITS_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_L: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_wait(PDL)  # first: see kernels/pdl.py
    # One program per (sequence, head); sequences without a token write nothing.
    pid_b = tl.program_id(0)
    pid_h = tl.program_id(1)
    q_start = tl.load(cu_seqlens_q_ptr + pid_b)
    if tl.load(cu_seqlens_q_ptr + pid_b + 1) == q_start:
        return
    seq_len = tl.load(seq_lens_ptr + pid_b)
    num_active = tl.cdiv(seq_len, _split_len(seq_len, num_splits, BLOCK_N))

    offs_s = tl.arange(0, SPLITS_PAD)
    offs_l = tl.arange(0, BLOCK_L)
    first = (pid_b.to(tl.int64) * tl.num_programs(1) + pid_h) * num_splits
    lse = tl.load(part_lse_ptr + first + offs_s, mask=offs_s < num_active, other=float("-inf"))
    # seq_len 0 has no split: max -inf, no weight, output 0.
    lse_max = tl.max(lse, 0)
    lse_ref = tl.where(lse_max == float("-inf"), 0.0, lse_max)
    total = tl.sum(tl.math.exp2(lse - lse_ref), 0)
    acc = tl.zeros([BLOCK_L], dtype=tl.float32)
    # one split's partial at a time: [S, L] at once would not fit in registers at L = 512
    for s in range(0, num_active):
        weight = tl.math.exp2(tl.load(part_lse_ptr + first + s) - lse_ref)
        part = tl.load(part_out_ptr + (first + s) * latent_dim + offs_l, mask=offs_l < latent_dim)
        acc += weight * part
    out = acc / tl.where(total == 0.0, 1.0, total)
    out_ptrs = out_ptr + q_start.to(tl.int64) * stride_ot + pid_h * stride_oh + offs_l
    tl.store(out_ptrs, out, mask=offs_l < latent_dim)


def mla_attention(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    latent_cache: torch.Tensor,
    rope_cache: torch.Tensor,
    attn: AttentionMetadata,
    kv_b: torch.Tensor,
    scale: float,
    *,
    lora: LoraWeights | None = None,
    info: LoraBatchInfo | None = None,
    expanded: ExpandedKv | None = None,
) -> torch.Tensor:
    """Semantics: kernels/mla.mla_attention's, with the attention in the latent space by the
    kernel (latent_attention below), kv_b_proj's absorption by mla_absorb's kernel (kv_b read
    in its dtype), with kv_b_proj's LoRA in the same launches, which read the slots through
    the table (a decode step reads no device value on the host), and the expanded form by
    mla_expanded's kernel (a prefill step's grids depend on shapes only)."""
    args = (q_nope, q_pe, latent_cache, rope_cache, attn, kv_b, scale)
    if expanded is not None and expanded.every:
        out = q_nope.new_zeros(*q_nope.shape[:2], expanded.v.shape[-1])
    else:
        if lora is None or info is None:
            lora = info = None
        skip = None if expanded is None else expanded.cu_seqlens_k
        rows = (
            None
            if skip is None
            else mla_absorb.SkipExpanded(attn.cu_seqlens_q, attn.seq_lens, skip)
        )
        o_lat = absorbed_latents(_absorption(skip, rows), *args, lora=lora, info=info)
        N, dtype = q_nope.shape[2], q_nope.dtype
        out = mla_absorb.absorb_out(o_lat, kv_b, N, dtype, lora=lora, info=info, skip=rows)
    if expanded is not None:
        mla_expanded.expanded_attention_(out, q_nope, q_pe, expanded, attn, scale)
    return out


def mla_attention_o_shrink(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    latent_cache: torch.Tensor,
    rope_cache: torch.Tensor,
    attn: AttentionMetadata,
    kv_b: torch.Tensor,
    scale: float,
    *,
    lora: LoraWeights | None,
    info: LoraBatchInfo,
    o_lora: LoraWeights,
    expanded: ExpandedKv | None = None,
) -> tuple[torch.Tensor, FoldedLora]:
    """Semantics: kernels/mla.mla_attention_o_shrink's. In the latent form the shrink rides in
    the absorption's out-side launch (mla_absorb.absorb_out_o_shrink: one partial a head and
    column block), so o_proj's LoRA takes no launch of its own before the norm that expands
    it; with expanded keys (a prefill step) the rows are complete only after the expanded
    attention, and lora_shrink_split reads them then."""
    args = (q_nope, q_pe, latent_cache, rope_cache, attn, kv_b, scale)
    if expanded is not None:
        out = mla_attention(*args, lora=lora, info=info, expanded=expanded)
        shrunk = lora_shrink_split(out.reshape(out.shape[0], -1), o_lora, info)
        return out, FoldedLora(shrunk, o_lora, info)
    o_lat = absorbed_latents(_absorption(None, None), *args, lora=lora, info=info)
    N, dtype = q_nope.shape[2], q_nope.dtype
    out, shrunk = mla_absorb.absorb_out_o_shrink(
        o_lat, kv_b, N, dtype, lora=lora, info=info, o_lora=o_lora
    )
    return out, FoldedLora(shrunk, o_lora, info)


def _absorption(
    skip_expanded: torch.Tensor | None, rows: mla_absorb.SkipExpanded | None
) -> Absorption:
    """The query side's kernels: the absorption (with kv_b_proj's LoRA) and the attention, both
    skipping the rows of sequences that attend expanded (skip_expanded: their keys' rows;
    rows: the same as the absorption takes it)."""
    core = functools.partial(latent_attention, skip_expanded=skip_expanded)
    return Absorption(core=core, absorb_q=functools.partial(mla_absorb.absorb_q, skip=rows))


def latent_attention(
    q_lat: torch.Tensor,
    q_pe: torch.Tensor,
    latent_cache: torch.Tensor,
    rope_cache: torch.Tensor,
    attn: AttentionMetadata,
    scale: float,
    *,
    skip_expanded: torch.Tensor | None = None,
    config: MlaConfig | None = None,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Semantics: o[t, h] = causal softmax(scale * (q_lat[t, h] . c + q_pe[t, h] . k_pe)) @ c
    over the sequence's cached (c, k_pe), as kernels/mla.latent_attention (skip_expanded
    likewise: the rows of the sequences it gives all their keys zero, in a prefill step).

    q_lat [T, Hh, L], q_pe [T, Hh, R] float32 or the caches' dtype (the dots run in the caches'
    dtype); latent_cache [P, page_size, 1, L], rope_cache [P, page_size, 1, R] (views of one
    buffer are fine). Returns [T, Hh, L] float32; rows past cu_seqlens_q[-1] (padding) are
    zeros. With max_query_len <= 1 (decode) the launch reads no device value on the host and
    can be captured in a CUDA graph. config and num_splits: tests and benchmarks set them.
    """
    _check(q_lat, q_pe, latent_cache, rope_cache, attn)
    plan = _plan(q_lat, latent_cache, attn, config, num_splits)
    T, Hh, L = q_lat.shape
    B = attn.page_table.shape[0]
    # decode programs zero the padded rows themselves: nothing else is recorded
    alloc = torch.empty if plan.decode else torch.zeros
    out = alloc(T, Hh, L, dtype=torch.float32, device=q_lat.device)
    if T == 0 or B == 0:
        return out.zero_()
    part_out = part_lse = out  # unused without splits
    if plan.num_splits > 1:
        part_out = torch.empty(B, Hh, plan.num_splits, L, dtype=out.dtype, device=out.device)
        part_lse = torch.empty(B, Hh, plan.num_splits, dtype=out.dtype, device=out.device)
    launch = _Launch(q_lat, q_pe, latent_cache, rope_cache, attn, scale, out, part_out, part_lse)
    _launch_attention(launch, plan, skip_expanded=skip_expanded)
    if plan.num_splits > 1:
        _launch_combine(launch, plan)
    return out


def _check(
    q_lat: torch.Tensor,
    q_pe: torch.Tensor,
    latent_cache: torch.Tensor,
    rope_cache: torch.Tensor,
    attn: AttentionMetadata,
) -> None:
    T, Hh, L = q_lat.shape
    P, page_size, one, cache_l = latent_cache.shape
    assert one == 1 and cache_l == L, f"latent cache {tuple(latent_cache.shape)}, L {L}"
    R = rope_cache.shape[-1]
    assert rope_cache.shape == (P, page_size, 1, R), f"rope cache {tuple(rope_cache.shape)}"
    assert q_pe.shape == (T, Hh, R), f"q_pe {tuple(q_pe.shape)}, q_lat {tuple(q_lat.shape)}"
    dtype = latent_cache.dtype
    assert rope_cache.dtype == dtype, f"cache dtypes {dtype}, {rope_cache.dtype}"
    for q in (q_lat, q_pe):
        assert q.dtype in (torch.float32, dtype), f"q dtype {q.dtype}, caches {dtype}"
    num_seqs = attn.page_table.shape[0]
    assert attn.cu_seqlens_q.shape == (num_seqs + 1,), "cu_seqlens_q must be [B + 1]"
    assert attn.seq_lens.shape == (num_seqs,), "seq_lens must be [B]"


class _Plan(NamedTuple):
    """The tiles, split count and grid of one launch."""

    config: MlaConfig
    num_splits: int
    decode: bool  # at most one new token per sequence
    block_h: int
    block_q: int
    grid: tuple[int, int, int]
    work: torch.Tensor | None = None  # prefill: the work table (attention_work) the grid walks


def _plan(
    q_lat: torch.Tensor,
    latent_cache: torch.Tensor,
    attn: AttentionMetadata,
    config: MlaConfig | None,
    num_splits: int | None,
) -> _Plan:
    """Decode: one token's heads a program, split as decode_splits says where the caller gives
    no count. Prefill: block_m // block_h tokens of block_h heads a program, no split."""
    num_rows, num_heads, _ = q_lat.shape
    num_seqs, max_pages = attn.page_table.shape
    cuda = q_lat.is_cuda
    if attn.max_query_len <= 1:
        config = config or (DECODE_CONFIG if cuda else INTERPRETER_CONFIG)
        block_h = max(min(config.block_h, next_power_of_2(num_heads)), 16)  # rows for tl.dot
        head_blocks = cdiv(num_heads, block_h)
        if num_splits is None:
            max_kv_len = max_pages * latent_cache.shape[1]
            num_splits = decode_splits(num_seqs, head_blocks, max_kv_len, config, q_lat.device)
        grid = (max(num_seqs, num_rows), head_blocks, num_splits)
        return _Plan(config, num_splits, True, block_h, 1, grid)
    config = config or (PREFILL_CONFIG if cuda else INTERPRETER_CONFIG)
    block_h = min(config.block_h, next_power_of_2(num_heads))
    block_q = max(config.block_m // block_h, 1)
    work = attn.work
    if work is None or attn.work_block_q != block_q:  # planned for other tiles, or not at all
        work = attention_work(attn.cu_seqlens_q, num_rows, block_q)
    grid = (cdiv(num_heads, block_h), work.shape[0], 1)
    return _Plan(config, 1, False, block_h, block_q, grid, work)


def decode_splits(
    num_seqs: int, head_blocks: int, max_kv_len: int, config: MlaConfig, device: torch.device
) -> int:
    """The split count of a decode launch, from shapes and the device only (capturable): none
    when the B * head_blocks programs fill the multiprocessors, else about PROGRAMS_PER_SM
    programs per multiprocessor."""
    if device.type == "cuda":
        num_sms = torch.cuda.get_device_properties(device).multi_processor_count
    else:
        num_sms = 8
    programs = max(num_seqs * head_blocks, 1)
    if programs >= num_sms:
        return 1
    wanted = cdiv(PROGRAMS_PER_SM * num_sms, programs)
    return max(1, min(wanted, cdiv(max_kv_len, config.block_n), MAX_SPLITS))


class _Launch(NamedTuple):
    """What one launch reads and writes; the partials are `out` without splits."""

    q_lat: torch.Tensor
    q_pe: torch.Tensor
    latent_cache: torch.Tensor
    rope_cache: torch.Tensor
    attn: AttentionMetadata
    scale: float
    out: torch.Tensor
    part_out: torch.Tensor
    part_lse: torch.Tensor


def _launch_attention(
    a: _Launch, plan: _Plan, *, skip_expanded: torch.Tensor | None = None
) -> None:
    """One _mla_attention_kernel launch over plan.grid."""
    assert skip_expanded is None or not plan.decode, "a decode step has no expanded form"
    num_rows, num_heads, latent_dim = a.q_lat.shape
    c, r = a.latent_cache, a.rope_cache
    _mla_attention_kernel[plan.grid](
        q_lat_ptr=a.q_lat,
        q_pe_ptr=a.q_pe,
        latent_ptr=c,
        rope_ptr=r,
        out_ptr=a.out,
        part_out_ptr=a.part_out,
        part_lse_ptr=a.part_lse,
        cu_seqlens_q_ptr=a.attn.cu_seqlens_q,
        seq_lens_ptr=a.attn.seq_lens,
        page_table_ptr=a.attn.page_table,
        work_ptr=a.out if plan.work is None else plan.work,  # a.out: never read
        cu_seqlens_k_ptr=a.out if skip_expanded is None else skip_expanded,
        num_seqs=a.attn.page_table.shape[0],
        num_rows=num_rows,
        num_heads=num_heads,
        latent_dim=latent_dim,
        rope_dim=r.shape[-1],
        num_splits=plan.num_splits,
        scale_log2=a.scale * LOG2_E,
        stride_qt=a.q_lat.stride(0),
        stride_qh=a.q_lat.stride(1),
        stride_ql=a.q_lat.stride(2),
        stride_et=a.q_pe.stride(0),
        stride_eh=a.q_pe.stride(1),
        stride_er=a.q_pe.stride(2),
        stride_cp=c.stride(0),
        stride_cs=c.stride(1),
        stride_cl=c.stride(3),
        stride_rp=r.stride(0),
        stride_rs=r.stride(1),
        stride_rr=r.stride(3),
        stride_ot=a.out.stride(0),
        stride_oh=a.out.stride(1),
        stride_tb=a.attn.page_table.stride(0),
        stride_tp=a.attn.page_table.stride(1),
        BLOCK_H=plan.block_h,
        BLOCK_Q=plan.block_q,
        BLOCK_N=plan.config.block_n,
        BLOCK_L=next_power_of_2(latent_dim),
        BLOCK_R=max(next_power_of_2(r.shape[-1]), 16),
        PAGE_SIZE=c.shape[1],
        SPLIT=plan.num_splits > 1,
        ZERO_TAIL=plan.decode,
        WORK=plan.work is not None,
        SKIP_EXPANDED=skip_expanded is not None,
        DOT_PRECISION="ieee" if c.dtype == torch.float32 else None,
        num_warps=plan.config.num_warps,
        num_stages=plan.config.num_stages,
        **pdl_kwargs(a.q_lat.device),
    )


def _launch_combine(a: _Launch, plan: _Plan) -> None:
    """The combine of a split decode's partials into out."""
    num_heads, latent_dim = a.q_lat.shape[1:]
    _combine_splits_kernel[(a.attn.page_table.shape[0], num_heads)](
        part_out_ptr=a.part_out,
        part_lse_ptr=a.part_lse,
        out_ptr=a.out,
        cu_seqlens_q_ptr=a.attn.cu_seqlens_q,
        seq_lens_ptr=a.attn.seq_lens,
        latent_dim=latent_dim,
        num_splits=plan.num_splits,
        stride_ot=a.out.stride(0),
        stride_oh=a.out.stride(1),
        SPLITS_PAD=next_power_of_2(plan.num_splits),
        BLOCK_N=plan.config.block_n,
        BLOCK_L=next_power_of_2(latent_dim),
        **pdl_kwargs(a.q_lat.device),
    )
