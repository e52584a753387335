"""Paged attention in Triton over the paged K/V cache, with GQA (rotary stores new K/V).

Algorithm
---------
A sequence's keys and values live in fixed-size pages of the cache; row b of the page table
lists its pages in order, so KV position n is at slot `page_table[b, n // page_size] *
page_size + n % page_size`. The new query tokens of a step sit at the end of their sequence:
token j of sequence b is at position `seq_len_b - q_len_b + j` and sees KV 0..that position.

One program owns one sequence, one KV head and a block of query rows (the last blocks first:
under the causal mask they have the most keys). A row is a pair
(token, query head): BLOCK_Q consecutive new tokens times the GROUP query heads that share the
KV head, so each KV tile is read once for the whole group. The program walks its KV range one
BLOCK_N tile at a time, gathering the tile's rows through the page table, and keeps the
flash-attention running max, running sum and fp32 accumulator (online softmax, base 2). The
tiles every row of the block sees whole come first and compute no mask; the mask of the others
applies after the exponent, so a key's weight is computed alike in both and a row's output
does not depend on where its block or chunk starts (tests/gpu/test_attention_gpu.py).

Decode (at most one new token per sequence) has few rows and long KV ranges, so its range is cut
into S pieces (flash-decoding): each program writes a partial output with its
log-sum-exp, and a second small kernel combines the pieces. The split length is computed inside
the kernels from seq_len, so the grids depend on tensor shapes only and a decode step can be
captured in a CUDA graph and replayed with new lengths and page tables; splits past the end of
a short sequence exit at once. Decode programs also zero the padded rows past cu_seqlens_q[-1],
so no memset is recorded. Prefill/extend has one program per BLOCK_Q tokens and KV head, no
split; a work table (attention_work, built once a step on the device from cu_seqlens_q) says
which sequence and block each program takes, so its grid too depends on shapes only: the step's
rows and sequences. A prefill step then can be captured as well, its grid sized for the largest
step of its row count, the programs past the step's blocks exiting at once.

Long prefill chunks with no KV before them (a prompt's first chunk, at least dense_from tokens)
can go to cuDNN's fused attention instead (torch's aten op, faster than this kernel at such
lengths): their keys and values are the step's own, gathered from the cache
by slot into contiguous tensors. Which kernel a sequence gets depends on its own chunk only
(dense_runs), but a prompt prefilled whole then has other bits than the same rows computed as a
later chunk: EngineConfig.prefill_attention_backend="triton" keeps them.

With the attention's LoRA folded (layers/attention_lora.py), a split decode's combine also
shrinks the o projection's LoRA from each head's output (paged_attention_o_shrink).

Two options serve GPT-OSS, as constexpr flags with their values in tensors or plain integers,
so a graph captures them like any other argument:
- a sliding window: the query at position p sees keys p - window < n <= p. A program's KV range
  starts at the tile (a multiple of BLOCK_N) holding its first row's window start (a decode's
  split covers only that range), and the tiles mask the keys outside each row's window;
- sinks, one learned logit per query head in the softmax's denominator: a program (or the
  combine, when split) adds exp(sink - max) to the running sum once, after the last tile.

Legend: T = tokens, B = sequences, P = pages per sequence, Hq / Hkv = query / KV heads,
D = head dim, S = splits, G = Hq // Hkv.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import torch
import triton
import triton.language as tl

from moelora.kernels.lora import (
    TAB_A_OFF,
    TAB_RANK,
    TAB_WIDTH,
    aligned,
    lora_shrink_split,
    lora_slot,
)
from moelora.kernels.pdl import pdl_kwargs, pdl_wait
from moelora.kernels.reference import WORK_SEQ
from moelora.kernels.sizes import cdiv, next_power_of_2
from moelora.step.batch import dense_runs
from moelora.step.lora import FoldedLora, LoraBatchInfo, LoraWeights

WORK_ROUNDS = 16  # rounds of a work table a program of attention_work places ([16, SEQS] tiles)

if TYPE_CHECKING:
    from moelora.step.batch import AttentionMetadata

LOG2_E = 1.4426950408889634
_LOG2_E = tl.constexpr(LOG2_E)  # what a kernel may read of a module global
_WORK_SEQ = tl.constexpr(WORK_SEQ)  # a work entry: sequence * WORK_SEQ + blocks from its last


@dataclass(frozen=True)
class AttentionConfig:
    """Tiles of one launch. block_m counts rows, i.e. tokens x padded query-head group."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


# Tuned on the H200 with `bench/attention.py --sweep` (bf16, Hq=32, Hkv=4, D=128, page 16):
# long KV tiles when each (sequence, KV head) has one program, shorter ones when it is split.
DECODE_CONFIG = AttentionConfig(block_m=16, block_n=128, num_warps=4, num_stages=2)
DECODE_SPLIT_CONFIG = AttentionConfig(block_m=16, block_n=64, num_warps=4, num_stages=2)
# Prefill: `bench/attention.py --prefill` (256 rows: 32 tokens x the group of 8 query heads)
PREFILL_CONFIG = AttentionConfig(block_m=256, block_n=64, num_warps=8, num_stages=3)
# The interpreter runs every program in numpy: small tiles keep CPU tests fast.
INTERPRETER_CONFIG = AttentionConfig(block_m=16, block_n=16, num_warps=1, num_stages=1)


def fit_head_dim(config: AttentionConfig, head_dim: int) -> AttentionConfig:
    """config with its KV tile and its rows cut in proportion past head_dim 128, where the
    tables above were tuned: the tiles' bytes stay as tuned (at 256, Qwen3.5's and Qwen3-Next's
    gated attention, the prefill tiles would ask for more shared memory than an H200 block has,
    and 256 rows' accumulator more registers than a thread has: it spilled, compiled for
    sm_90). Cutting the rows changes no row's sums: they follow the KV tiles only."""
    block_n = max(16, config.block_n * 128 // max(head_dim, 128))
    block_m = max(16, config.block_m * 128 // max(head_dim, 128))
    if (block_m, block_n) == (config.block_m, config.block_n):
        return config
    return dataclasses.replace(config, block_m=block_m, block_n=block_n)


# Prefill chunks from position 0 of at least this many tokens go to cuDNN (dense_runs): from
# this length cuDNN gains in every case, LoRA or not; below it a LoRA engine's prefill is bound
# by its host's launches and need not gain
DENSE_FROM = 8192
MAX_SPLITS = 64
PROGRAMS_PER_SM = 4  # a split decode aims at this many programs per multiprocessor


# ----------------------------------------------------------------------------------------------
# Attention over the paged cache
# ----------------------------------------------------------------------------------------------


@triton.jit
def _split_len(kv_len, num_splits, BLOCK_N: tl.constexpr):
    # Both kernels must agree on this: whole tiles, at least one, so seq_len 0 has no splits.
    per_split = tl.cdiv(tl.cdiv(kv_len, num_splits), BLOCK_N) * BLOCK_N
    return tl.maximum(per_split, BLOCK_N)


@triton.jit
def _window_start(first_pos, window, HAS_WINDOW: tl.constexpr, BLOCK_N: tl.constexpr):
    # The first key of the tile holding the first key the query at first_pos sees; the combine
    # asks it of the decode's one query, and must get what the attention kernel got. Tiles
    # start at multiples of BLOCK_N (the keys before the window masked), so a row's keys are
    # grouped into the same tiles whatever block or chunk its query is in.
    if HAS_WINDOW:
        return tl.maximum(first_pos - window + 1, 0) // BLOCK_N * BLOCK_N
    return 0


@triton.jit
def _attend_tile(
    q,
    m_i,
    l_i,
    acc,
    start,
    kv_stop,
    q_pos,
    window,
    page_row_ptr,
    k_head,
    v_head,
    scale_log2,
    stride_kp,
    stride_ks,
    stride_kd,
    stride_vp,
    stride_vs,
    stride_vd,
    stride_pt_p,
    offs_d,
    d_mask,
    BLOCK_N: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    MASKED: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """One KV tile of the online softmax: (m_i, l_i, acc) after keys start .. start+BLOCK_N-1,
    gathered through the page table. Without MASKED every row sees every key of the tile (the
    caller knows): no causal, range or window mask is computed; the visible keys' arithmetic
    is the masked tile's either way (see p)."""
    offs_n = start + tl.arange(0, BLOCK_N)
    if MASKED:
        n_mask = offs_n < kv_stop
        page = tl.load(page_row_ptr + (offs_n // PAGE_SIZE) * stride_pt_p, mask=n_mask, other=0)
        kv_mask = n_mask[:, None] & d_mask[None, :]
    else:
        page = tl.load(page_row_ptr + (offs_n // PAGE_SIZE) * stride_pt_p)
        kv_mask = d_mask[None, :]
    page = page.to(tl.int64)
    in_page = offs_n % PAGE_SIZE
    k = tl.load(
        k_head
        + page[:, None] * stride_kp
        + in_page[:, None] * stride_ks
        + offs_d[None, :] * stride_kd,
        mask=kv_mask,
        other=0.0,
    )
    qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
    if MASKED:
        visible = (offs_n[None, :] <= q_pos[:, None]) & n_mask[None, :]
        if HAS_WINDOW:
            visible = visible & (offs_n[None, :] > q_pos[:, None] - window)
        m_new = tl.maximum(m_i, tl.max(tl.where(visible, qk, float("-inf")), 1))
    else:
        m_new = tl.maximum(m_i, tl.max(qk, 1))
    # A row with nothing visible yet keeps max -inf; subtract 0 then so no NaN appears.
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.math.exp2(m_i - m_ref)
    # the mask applies to p, after the exponent: the compiler then fuses qk's scaling into
    # the subtraction (an FMA) in both kinds of tile alike, so a key's weight does not depend
    # on whether its tile was masked, i.e. on where the query's block or chunk starts
    p = tl.math.exp2(qk - m_ref[:, None])
    if MASKED:
        p = tl.where(visible, p, 0.0)
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(
        v_head
        + page[:, None] * stride_vp
        + in_page[:, None] * stride_vs
        + offs_d[None, :] * stride_vd,
        mask=kv_mask,
        other=0.0,
    )
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit(do_not_specialize=["num_seqs", "num_rows"])  # one compile for all batch sizes
def _paged_attention_kernel(
    # Pointers
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    part_out_ptr,  # [B, Hq, S, D] float32, only with SPLIT
    part_lse_ptr,  # [B, Hq, S] float32 (base 2), only with SPLIT
    cu_seqlens_q_ptr,
    seq_lens_ptr,
    page_table_ptr,
    sinks_ptr,  # [Hq] float32, only with HAS_SINKS
    work_ptr,  # [NW] int32, only with WORK: each program's (sequence, block), attention_work
    # Sizes
    num_seqs,
    num_rows,
    head_dim,
    num_splits,
    scale_log2,
    window,  # keys per query of a sliding window, only with HAS_WINDOW
    dense_from,  # > 0: sequences whose chunk starts at 0 with >= this many tokens are skipped
    # Strides
    stride_qt,
    stride_qh,
    stride_qd,
    stride_kp,
    stride_ks,
    stride_kh,
    stride_kd,
    stride_vp,
    stride_vs,
    stride_vh,
    stride_vd,
    stride_ot,
    stride_oh,
    stride_od,
    stride_pt_b,
    stride_pt_p,
    # Meta-parameters
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    SPLIT: tl.constexpr,
    ZERO_TAIL: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    WORK: tl.constexpr,  # prefill: the grid is (KV heads, work entries)
    DOT_PRECISION: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_wait(PDL)  # first: see kernels/pdl.py
    BLOCK_M: tl.constexpr = BLOCK_Q * GROUP_PAD

    # -- Map the program to (sequence, KV head, query block, split) ---------------------------
    if WORK:
        # the work table lists every (sequence, query block) in the order the blocks should
        # start: the last blocks of every sequence first (under the causal mask they have the
        # most keys), so the longest programs run in the first wave, not in the tail; entries
        # past the step's blocks are -1 (a graph's grid is sized for its largest step)
        pid_h = tl.program_id(0)
        num_q_heads = tl.num_programs(0) * GROUP
        entry = tl.load(work_ptr + tl.program_id(1))
        if entry < 0:
            return
        pid_b = entry // _WORK_SEQ
        from_last = entry % _WORK_SEQ
        pid_m = 0  # set from the sequence's query length below
        pid_s = 0
    else:
        pid_b = tl.program_id(0)
        pid_h = tl.program_id(1)
        pid_m = tl.num_programs(2) // num_splits - 1 - tl.program_id(2) // num_splits
        pid_s = tl.program_id(2) % num_splits
        num_q_heads = tl.num_programs(1) * GROUP
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < head_dim

    if ZERO_TAIL:
        # Rows past the last sequence's tokens are padding: the first program of row pid_b
        # zeroes it (the decode grid has max(B, T) programs on axis 0).
        total_tokens = tl.load(cu_seqlens_q_ptr + num_seqs)
        if (tl.program_id(2) == 0) & (pid_b >= total_tokens) & (pid_b < num_rows):
            offs_g = tl.arange(0, GROUP_PAD)
            zero_ptrs = (
                out_ptr
                + pid_b * stride_ot
                + (pid_h * GROUP + offs_g[:, None]) * stride_oh
                + offs_d[None, :] * stride_od
            )
            zeros = tl.zeros([GROUP_PAD, BLOCK_D], dtype=out_ptr.dtype.element_ty)
            tl.store(zero_ptrs, zeros, mask=(offs_g[:, None] < GROUP) & d_mask[None, :])
    if pid_b >= num_seqs:
        return

    q_start = tl.load(cu_seqlens_q_ptr + pid_b)
    q_len = tl.load(cu_seqlens_q_ptr + pid_b + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + pid_b)
    if WORK:
        pid_m = tl.cdiv(q_len, BLOCK_Q) - 1 - from_last
    if pid_m * BLOCK_Q >= q_len:
        return
    if dense_from > 0:
        if (seq_len == q_len) & (q_len >= dense_from):
            return  # the caller's dense attention writes these rows (dense_runs)

    # -- Rows: (token, query head of the group) ------------------------------------------------
    offs_r = tl.arange(0, BLOCK_M)
    tok = pid_m * BLOCK_Q + offs_r // GROUP_PAD
    head = pid_h * GROUP + offs_r % GROUP_PAD
    row_mask = (tok < q_len) & (offs_r % GROUP_PAD < GROUP)
    q_pos = seq_len - q_len + tok
    q_ptrs = (
        q_ptr
        + (q_start + tok)[:, None] * stride_qt
        + head[:, None] * stride_qh
        + offs_d[None, :] * stride_qd
    )
    q = tl.load(q_ptrs, mask=row_mask[:, None] & d_mask[None, :], other=0.0)

    # -- KV range: from the block's first window start (0 without a window) up to its last
    # causal position, then this program's split -----------------------------------------------
    kv_end = tl.minimum(seq_len, seq_len - q_len + tl.minimum(q_len, (pid_m + 1) * BLOCK_Q))
    kv_lo = _window_start(seq_len - q_len + pid_m * BLOCK_Q, window, HAS_WINDOW, BLOCK_N)
    split_len = _split_len(kv_end - kv_lo, num_splits, BLOCK_N)
    kv_start = kv_lo + pid_s * split_len
    kv_stop = tl.minimum(kv_end, kv_start + split_len)
    if SPLIT:
        if kv_start >= kv_stop:
            return

    # -- Accumulate in fp32 with the online softmax: first the tiles every row sees whole (no
    # mask), then the rest (the causal diagonal, the range's end, a window's edges) -----------
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    page_row_ptr = page_table_ptr + pid_b * stride_pt_b
    k_head = k_cache_ptr + pid_h * stride_kh
    v_head = v_cache_ptr + pid_h * stride_vh
    # keys up to the block's first position are every row's (a window's rows see fewer)
    whole_stop = kv_start
    if not HAS_WINDOW:
        first_pos = seq_len - q_len + pid_m * BLOCK_Q
        whole_stop = kv_start + (tl.minimum(kv_stop, first_pos + 1) - kv_start) // BLOCK_N * BLOCK_N
        whole_stop = tl.maximum(whole_stop, kv_start)
    for start in range(kv_start, whole_stop, BLOCK_N):
        m_i, l_i, acc = _attend_tile(
            q,
            m_i,
            l_i,
            acc,
            start,
            kv_stop,
            q_pos,
            window,
            page_row_ptr,
            k_head,
            v_head,
            scale_log2,
            stride_kp,
            stride_ks,
            stride_kd,
            stride_vp,
            stride_vs,
            stride_vd,
            stride_pt_p,
            offs_d,
            d_mask,
            BLOCK_N,
            PAGE_SIZE,
            False,
            HAS_WINDOW,
            DOT_PRECISION,
        )
    for start in range(whole_stop, kv_stop, BLOCK_N):
        m_i, l_i, acc = _attend_tile(
            q,
            m_i,
            l_i,
            acc,
            start,
            kv_stop,
            q_pos,
            window,
            page_row_ptr,
            k_head,
            v_head,
            scale_log2,
            stride_kp,
            stride_ks,
            stride_kd,
            stride_vp,
            stride_vs,
            stride_vd,
            stride_pt_p,
            offs_d,
            d_mask,
            BLOCK_N,
            PAGE_SIZE,
            True,
            HAS_WINDOW,
            DOT_PRECISION,
        )

    # -- Store: the normalized output, or the split's partial and its log-sum-exp -------------
    if HAS_SINKS and not SPLIT:  # split: the combine adds the sink, once
        sink = tl.load(sinks_ptr + head, mask=row_mask, other=0.0).to(tl.float32) * _LOG2_E
        m_new = tl.maximum(m_i, sink)  # finite: so is the sink
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.math.exp2(sink - m_new)
        acc = acc * alpha[:, None]
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    if not SPLIT:
        out_ptrs = (
            out_ptr
            + (q_start + tok)[:, None] * stride_ot
            + head[:, None] * stride_oh
            + offs_d[None, :] * stride_od
        )
        out_mask = row_mask[:, None] & d_mask[None, :]
        tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        # Decode: one token per sequence, so rows are the group's heads.
        part_row = (pid_b * num_q_heads + head) * num_splits + pid_s
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.math.log2(l_i))
        tl.store(part_lse_ptr + part_row, lse, mask=row_mask)
        part_ptrs = part_out_ptr + part_row[:, None] * head_dim + offs_d[None, :]
        tl.store(part_ptrs, out, mask=row_mask[:, None] & d_mask[None, :])


@triton.jit
def _combine_splits_kernel(
    # Pointers
    part_out_ptr,  # [B, Hq, S, D] float32
    part_lse_ptr,  # [B, Hq, S] float32, base 2
    out_ptr,
    cu_seqlens_q_ptr,
    seq_lens_ptr,
    sinks_ptr,  # [Hq] float32, only with HAS_SINKS
    a_ptr,  # the arena: slot s's A of the o projection [1, r, Hq * D]; only with SHRINK
    a_tab_ptr,  # [max_loras, TAB_WIDTH] int64: where (step/lora.LoraWeights.table)
    shrink_ptr,  # [T, Hq, 1, R] float32 out: each head's part of the shrink, only with SHRINK
    slot_ptr,
    enabled_ptr,
    rank_ptr,
    scaling_ptr,
    # Sizes
    head_dim,
    num_splits,
    window,  # only with HAS_WINDOW
    # Strides
    stride_ot,
    stride_oh,
    stride_od,
    # Meta-parameters
    SPLITS_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    SHRINK: tl.constexpr,
    R: tl.constexpr,
    RP: tl.constexpr,
    A_ALIGN: tl.constexpr,  # the o projection's LoraWeights.a_align
    PDL: tl.constexpr,
):
    pdl_wait(PDL)  # first: see kernels/pdl.py
    # One program per (sequence, query head); sequences without a token write nothing.
    pid_b = tl.program_id(0)
    pid_hq = tl.program_id(1)
    q_start = tl.load(cu_seqlens_q_ptr + pid_b)
    if tl.load(cu_seqlens_q_ptr + pid_b + 1) == q_start:
        return
    if SHRINK:
        slot = tl.load(slot_ptr + q_start)  # asked first: its flag's gather waits on it
    seq_len = tl.load(seq_lens_ptr + pid_b)
    span = seq_len - _window_start(seq_len - 1, window, HAS_WINDOW, BLOCK_N)
    num_active = tl.cdiv(span, _split_len(span, num_splits, BLOCK_N))

    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < num_active
    d_mask = offs_d < head_dim
    part_row = (pid_b * tl.num_programs(1) + pid_hq) * num_splits + offs_s
    lse = tl.load(part_lse_ptr + part_row, mask=s_mask, other=float("-inf"))
    parts = tl.load(
        part_out_ptr + part_row[:, None] * head_dim + offs_d[None, :],
        mask=s_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    # seq_len 0 has no split: max -inf, weights 0, output 0.
    lse_max = tl.max(lse, 0)
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + pid_hq).to(tl.float32) * _LOG2_E
        lse_max = tl.maximum(lse_max, sink)
    weight = tl.math.exp2(lse - tl.where(lse_max == float("-inf"), 0.0, lse_max))
    total = tl.sum(weight, 0)
    if HAS_SINKS:
        total += tl.math.exp2(sink - lse_max)
    out = tl.sum(weight[:, None] * parts, 0) / tl.where(total == 0.0, 1.0, total)
    out = out.to(out_ptr.dtype.element_ty)
    out_ptrs = out_ptr + q_start * stride_ot + pid_hq * stride_oh + offs_d * stride_od
    tl.store(out_ptrs, out, mask=d_mask)
    if SHRINK:
        # The o projection's LoRA shrink of this head's columns (of the rounded output, as
        # lora_shrink_split reads it): the heads' parts are summed by the norm that expands.
        # An enabled row is written whole: zeros past the module's rank, and all zeros where
        # the slot's adapter has no o module (table rank 0).
        slot, rank, scaling = lora_slot(slot, enabled_ptr, rank_ptr, scaling_ptr)
        if rank > 0:
            a_rank = tl.load(a_tab_ptr + slot * TAB_WIDTH + TAB_RANK)
            offs_r = tl.arange(0, RP)
            K_in = tl.num_programs(1) * head_dim
            a_off = aligned(tl.load(a_tab_ptr + slot * TAB_WIDTH + TAB_A_OFF), A_ALIGN)
            a_head = a_ptr + a_off + pid_hq * head_dim
            a = tl.load(
                a_head + offs_r[:, None] * K_in + offs_d[None, :],
                mask=(offs_r < a_rank)[:, None] & d_mask[None, :],
                other=0.0,
            )  # [RP, BLOCK_D]
            shrunk = tl.sum(a.to(tl.float32) * out.to(tl.float32)[None, :], axis=1) * scaling
            dst = shrink_ptr + (q_start.to(tl.int64) * tl.num_programs(1) + pid_hq) * R + offs_r
            tl.store(dst, shrunk, mask=offs_r < R)  # zeros past the rank: whole rows


@triton.jit
def _attention_work_kernel(
    # Pointers
    cu_seqlens_q_ptr,  # [B + 1] int32
    work_ptr,  # [NW] int32, written whole
    # Sizes
    num_seqs,
    num_entries,
    # Meta-parameters
    BLOCK_Q: tl.constexpr,
    ROUNDS: tl.constexpr,  # rounds, and entries of the -1 tail, a program
    SEQS: tl.constexpr,  # a power of two >= num_seqs
    PDL: tl.constexpr,
):
    """Rounds p * ROUNDS .. (p + 1) * ROUNDS - 1 of the table (p the program), every round at
    once: sequence b's entry of round r sits after the F(r) = sum_b' min(blocks_b', r) entries
    of the rounds before and the sequences before b that have a block r; and the -1 tail's
    entries of the same numbers, past the blocks. No program waits on another."""
    pdl_wait(PDL)  # first: see kernels/pdl.py
    offs = tl.arange(0, SEQS)
    in_range = offs < num_seqs
    first = tl.load(cu_seqlens_q_ptr + offs, mask=in_range, other=0)
    end = tl.load(cu_seqlens_q_ptr + offs + 1, mask=in_range, other=0)
    blocks = tl.where(in_range, (end - first + BLOCK_Q - 1) // BLOCK_Q, 0)
    r = tl.program_id(0) * ROUNDS + tl.arange(0, ROUNDS)
    take = (blocks[None, :] > r[:, None]).to(tl.int32)  # [ROUNDS, SEQS]
    before = tl.sum(tl.minimum(blocks[None, :], r[:, None]), axis=1)  # F(r)
    at = before[:, None] + tl.cumsum(take, axis=1) - take
    tl.store(work_ptr + at, offs[None, :] * _WORK_SEQ + r[:, None], mask=take > 0)
    tail = (r >= tl.sum(blocks, axis=0)) & (r < num_entries)  # entries numbered as the rounds
    tl.store(work_ptr + r, tl.full([ROUNDS], -1, tl.int32), mask=tail)


def prefill_block_q(
    num_q_heads: int, num_kv_heads: int, head_dim: int, device: torch.device
) -> int:
    """Query tokens a prefill program takes at the default tiles for head_dim (rows = tokens x
    the padded group of query heads)."""
    config = PREFILL_CONFIG if device.type == "cuda" else INTERPRETER_CONFIG
    config = fit_head_dim(config, head_dim)
    return max(config.block_m // next_power_of_2(num_q_heads // num_kv_heads), 1)


def attention_work(cu_seqlens_q: torch.Tensor, num_rows: int, block_q: int) -> torch.Tensor:
    """Semantics: see reference.attention_work: every (sequence, query block of block_q tokens)
    of a prefill step, the blocks r from their sequence's last in round r, sequences in order
    within a round; -1 past them. [cdiv(num_rows, block_q) + B] int32, which bounds the blocks
    of any step of num_rows rows (a graph's table fits every step of its size).

    One launch a step: the table is the same for every layer (plan_attention). Its programs
    take WORK_ROUNDS rounds each, side by side: no round waits on the one before, where one
    program walking a long prompt's hundreds of rounds in order costs a round's latency each."""
    num_seqs = cu_seqlens_q.shape[0] - 1
    assert num_seqs < WORK_SEQ // 2 and cdiv(num_rows, block_q) < WORK_SEQ, (num_seqs, num_rows)
    size = cdiv(num_rows, block_q) + num_seqs
    work = torch.empty(size, dtype=torch.int32, device=cu_seqlens_q.device)
    _attention_work_kernel[(cdiv(size, WORK_ROUNDS),)](
        cu_seqlens_q_ptr=cu_seqlens_q,
        work_ptr=work,
        num_seqs=num_seqs,
        num_entries=work.shape[0],
        BLOCK_Q=block_q,
        ROUNDS=WORK_ROUNDS,
        SEQS=max(256, next_power_of_2(num_seqs)),
        num_warps=4,
        **pdl_kwargs(cu_seqlens_q.device),
    )
    return work


def plan_attention(
    attn: AttentionMetadata,
    num_rows: int,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    *,
    deterministic: bool = False,
) -> AttentionMetadata:
    """The step's attention metadata with its prefill work table (attention_work) at the
    default tiles for head_dim, built once for every layer; a decode step's as it is, unless
    deterministic (its rows then take the prefill kernel too: paged_attention)."""
    if attn.max_query_len <= 1 and not deterministic:
        return attn
    block_q = prefill_block_q(num_q_heads, num_kv_heads, head_dim, attn.cu_seqlens_q.device)
    work = attention_work(attn.cu_seqlens_q, num_rows, block_q)
    return dataclasses.replace(attn, work=work, work_block_q=block_q)


def decode_plan(
    num_seqs: int, num_kv_heads: int, max_kv_len: int, device: torch.device
) -> tuple[AttentionConfig, int]:
    """Tiles and split count of a decode launch, from shapes and the device only (capturable).

    Without splits there are B * Hkv programs. When they fill the multiprocessors, splitting
    would only add the combine kernel and the partials' traffic; otherwise the range is split
    until there are about PROGRAMS_PER_SM programs per multiprocessor.
    """
    if device.type != "cuda":
        num_sms, split_config, config = 8, INTERPRETER_CONFIG, INTERPRETER_CONFIG
    else:
        num_sms = torch.cuda.get_device_properties(device).multi_processor_count
        split_config, config = DECODE_SPLIT_CONFIG, DECODE_CONFIG
    programs = max(num_seqs * num_kv_heads, 1)
    if programs >= num_sms:
        return config, 1
    wanted = cdiv(PROGRAMS_PER_SM * num_sms, programs)
    num_splits = max(1, min(wanted, cdiv(max_kv_len, split_config.block_n), MAX_SPLITS))
    return (split_config if num_splits > 1 else config), num_splits


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    attn: AttentionMetadata,
    scale: float,
    *,
    window: int = 0,
    sinks: torch.Tensor | None = None,
    dense_from: int = 0,
    deterministic: bool = False,
) -> torch.Tensor:
    """Semantics: causal softmax(q k^T * scale) v over each sequence's paged KV, with GQA;
    window > 0 and sinks [Hq] float32 as reference.paged_attention has them. dense_from > 0:
    prefill chunks from position 0 of at least that many tokens go to cuDNN (dense_runs).
    deterministic: a decode step's rows take the prefill kernel, as they do in a step with a
    prefill chunk (no split count that follows the batch size), so a row's bits do not
    depend on what shares its step.

    q: [T, Hq, D]; caches [num_pages, page_size, Hkv, D]; Hq % Hkv == 0. Returns [T, Hq, D].
    Rows of q past cu_seqlens_q[-1] (padding) are returned as zeros. With max_query_len <= 1
    (decode) the launch reads no device value on the host and can be captured in a CUDA graph.
    """
    return launch_paged_attention(
        q,
        k_cache,
        v_cache,
        attn,
        scale,
        window=window,
        sinks=sinks,
        dense_from=dense_from,
        deterministic=deterministic,
    )[0]


def paged_attention_o_shrink(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    attn: AttentionMetadata,
    scale: float,
    lora: LoraWeights,
    info: LoraBatchInfo,
    *,
    window: int = 0,
    sinks: torch.Tensor | None = None,
    dense_from: int = 0,
    deterministic: bool = False,
) -> tuple[torch.Tensor, FoldedLora]:
    """Semantics: see reference.paged_attention_o_shrink: (out, FoldedLora(lora_shrink_split(
    out as [T, Hq*D], lora, info), lora, info)), the o projection's LoRA shrunk from the
    attention's output, for the next norm to expand.

    A split decode computes the shrink in its combine kernel, KS = Hq partials (one head's
    columns each): no launch of its own, which a base-only batch would otherwise pay for.
    Otherwise it is lora_shrink_split's launch.
    """
    out, shrunk = launch_paged_attention(
        q,
        k_cache,
        v_cache,
        attn,
        scale,
        shrink=lora,
        info=info,
        window=window,
        sinks=sinks,
        dense_from=dense_from,
        deterministic=deterministic,
    )
    if shrunk is None:
        shrunk = lora_shrink_split(out.reshape(out.shape[0], -1), lora, info)
    return out, FoldedLora(shrunk, lora, info)


def launch_paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    attn: AttentionMetadata,
    scale: float,
    *,
    config: AttentionConfig | None = None,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
    shrink: LoraWeights | None = None,
    info: LoraBatchInfo | None = None,
    window: int = 0,
    sinks: torch.Tensor | None = None,
    dense_from: int = 0,
    deterministic: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """paged_attention with the tiles, the decode split count or the output given by the caller;
    returns (out, the shrink partials [T, Hq, 1, R] float32 of the o projection's LoRA `shrink`
    over `info`, or None). The partials come from the combine of a split decode only (see
    paged_attention_o_shrink).

    Tests pass a NaN-filled `out` to check that every row is written; benchmarks sweep tiles.
    """
    _check_attention(q, k_cache, v_cache, attn, window, sinks)
    plan = _plan(q, k_cache, attn, config, num_splits, deterministic=deterministic)
    runs = _cudnn_runs(q, attn, plan, window, sinks, dense_from)
    if runs and sum(L for _, L in runs) == q.shape[0]:  # every row dense: no Triton
        if out is None and len(runs) > 1:
            out = torch.empty_like(q)
        return _dense_attention(q, k_cache, v_cache, attn, scale, runs, out), None
    out, part_out, part_lse = _outputs(q, attn, plan, out)
    if q.shape[0] == 0 or attn.page_table.shape[0] == 0:
        return out.zero_(), None
    dense = dense_from if runs else 0  # the kernel skips what _dense_attention writes
    launch = _Attention(
        q, k_cache, v_cache, attn, scale, out, part_out, part_lse, window, sinks, dense
    )
    _launch_attention(launch, plan)
    if runs:
        _dense_attention(q, k_cache, v_cache, attn, scale, runs, out)
    if plan.num_splits == 1:
        return out, None
    return out, _launch_combine(launch, plan, shrink, info)


# ----------------------------------------------------------------------------------------------
# Long prefill chunks without KV before them: cuDNN's fused attention (contiguous K/V)
# ----------------------------------------------------------------------------------------------


def dense_length(L: int) -> int:
    """A dense sequence's length padded up: cuDNN builds a plan for every new shape (tens of
    milliseconds), so lengths come in 16 steps an octave (at most 1/16 of padding)."""
    step = max(256, (1 << (L.bit_length() - 1)) // 16)
    return cdiv(L, step) * step


def _cudnn_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float):
    """Causal attention by cuDNN: q [B, Hq, L, D], k and v [B, Hkv, L, D] (GQA as they are;
    strided views are fine) -> [B, Hq, L, D]. torch's aten op itself: through
    scaled_dot_product_attention and sdpa_kernel the same kernel costs the host several times
    the launch."""
    out = torch.ops.aten._scaled_dot_product_cudnn_attention(
        q, k, v, None, False, 0.0, True, False, scale=scale
    )
    return out[0]


@functools.cache
def _cudnn_attention_on(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether torch's cuDNN attention runs here (its build, the GPU, the dtype, the head
    size), tried once: where it does not, every row keeps the paged kernel."""
    q = torch.randn(1, 2, 64, head_dim, device=device, dtype=dtype)
    try:
        _cudnn_attention(q, q[:, :1], q[:, :1], 0.125)
    except (RuntimeError, NotImplementedError):
        return False
    return True


def cudnn_attention_runs(q: torch.Tensor) -> bool:
    return (
        q.is_cuda
        and q.dtype in (torch.bfloat16, torch.float16)
        and _cudnn_attention_on(q.device, q.dtype, q.shape[-1])
    )


def _dense_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    attn: AttentionMetadata,
    scale: float,
    runs: list[tuple[int, int]],
    out: torch.Tensor | None,
) -> torch.Tensor:
    """The rows of `runs` by cuDNN's causal attention (GQA), a sequence at a time, into out;
    out None: one sequence holds every row, and its output is returned as it is.

    A sequence's keys and values are gathered from the cache by its rows' slots (positions
    0 .. L - 1 in order), L padded up to dense_length(L): the padded queries come last and only
    they see the padded keys (the last row's, repeated), so the real rows' work is the
    unpadded one."""
    _, num_q_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    keys, values = (c.view(-1, num_kv_heads, head_dim) for c in (k_cache, v_cache))
    for row, L in runs:
        padded = dense_length(L)
        slots = attn.slot_mapping[row : row + L]
        qr = q[row : row + L]
        if padded > L:
            slots = torch.cat([slots, slots[-1:].expand(padded - L)])
            qr = torch.cat([qr, qr[-1:].expand(padded - L, -1, -1)])
        k, v = (c.index_select(0, slots)[None].transpose(1, 2) for c in (keys, values))
        o = _cudnn_attention(qr[None].transpose(1, 2), k, v, scale).transpose(1, 2)[0, :L]
        if out is None:
            return o  # a view of the first L rows: cuDNN writes them token-major
        out[row : row + L] = o
    return out


def _check_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    attn: AttentionMetadata,
    window: int,
    sinks: torch.Tensor | None,
) -> None:
    assert q.ndim == 3 and k_cache.ndim == 4, f"q {tuple(q.shape)}, cache {tuple(k_cache.shape)}"
    assert k_cache.shape == v_cache.shape, f"k {k_cache.shape} vs v cache {v_cache.shape}"
    _, num_q_heads, head_dim = q.shape
    _, _, num_kv_heads, cache_head_dim = k_cache.shape
    assert cache_head_dim == head_dim, f"head dim: q {head_dim}, cache {cache_head_dim}"
    assert num_q_heads % num_kv_heads == 0, f"Hq {num_q_heads} % Hkv {num_kv_heads} != 0"
    assert q.dtype == k_cache.dtype == v_cache.dtype, f"dtypes {q.dtype}, {k_cache.dtype}"
    num_seqs = attn.page_table.shape[0]
    assert attn.cu_seqlens_q.shape == (num_seqs + 1,), "cu_seqlens_q must be [B + 1]"
    assert attn.seq_lens.shape == (num_seqs,), "seq_lens must be [B]"
    assert window >= 0, window
    if sinks is not None:
        assert sinks.shape == (num_q_heads,) and sinks.dtype == torch.float32, sinks.shape


class _Plan(NamedTuple):
    """The tiles, split count and grid of one attention launch."""

    config: AttentionConfig
    num_splits: int
    decode: bool  # at most one new token per sequence
    group_pad: int
    block_q: int
    grid: tuple[int, int, int]
    work: torch.Tensor | None = None  # prefill: the work table (attention_work) the grid walks


def _plan(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    attn: AttentionMetadata,
    config: AttentionConfig | None,
    num_splits: int | None,
    *,
    deterministic: bool = False,
) -> _Plan:
    """decode_plan's tiles and splits where the caller gives none; prefill never splits, and
    deterministic decode steps take the prefill plan."""
    num_rows, num_q_heads, head_dim = q.shape
    _, page_size, num_kv_heads, _ = k_cache.shape
    num_seqs, max_pages = attn.page_table.shape
    group_pad = next_power_of_2(num_q_heads // num_kv_heads)
    if attn.max_query_len <= 1 and not deterministic:
        plan_config, plan_splits = decode_plan(
            num_seqs, num_kv_heads, max_pages * page_size, q.device
        )
        num_splits = num_splits or plan_splits
        config = config or fit_head_dim(plan_config, head_dim)
        # One token per sequence: rows are the group's heads, padded to the 16 tl.dot wants.
        grid = (max(num_seqs, num_rows), num_kv_heads, num_splits)
        return _Plan(config, num_splits, True, max(group_pad, 16), 1, grid)
    default = PREFILL_CONFIG if q.is_cuda else INTERPRETER_CONFIG
    config = config or fit_head_dim(default, head_dim)
    block_q = max(config.block_m // group_pad, 1)
    work = attn.work
    if work is None or attn.work_block_q != block_q:  # not planned, or other tiles asked for
        work = attention_work(attn.cu_seqlens_q, num_rows, block_q)
    grid = (num_kv_heads, work.shape[0], 1)
    return _Plan(config, 1, False, group_pad, block_q, grid, work)


def _cudnn_runs(
    q: torch.Tensor,
    attn: AttentionMetadata,
    plan: _Plan,
    window: int,
    sinks: torch.Tensor | None,
    dense_from: int,
) -> list[tuple[int, int]]:
    """The (first row, length) of each prefill chunk that cuDNN attends to (dense_runs): none
    for a decode, a sliding window or sinks, which only the paged kernel has."""
    dense = 0 if plan.decode or window or sinks is not None else dense_from
    return dense_runs(attn.chunks, dense) if dense and cudnn_attention_runs(q) else []


def _outputs(
    q: torch.Tensor, attn: AttentionMetadata, plan: _Plan, out: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out, part_out, part_lse): the output, zeroed where no program writes it, and a split
    decode's float32 partials ([B, Hq, splits, D] and [B, Hq, splits]; out without splits)."""
    if plan.decode:
        # Decode programs zero the padded rows themselves: nothing else is recorded.
        out = torch.empty_like(q) if out is None else out
    else:
        out = torch.zeros_like(q) if out is None else out.zero_()
    if plan.num_splits > 1:
        part_shape = (attn.page_table.shape[0], q.shape[1], plan.num_splits)
        part_out = q.new_empty(*part_shape, q.shape[2], dtype=torch.float32)
        return out, part_out, q.new_empty(*part_shape, dtype=torch.float32)
    return out, out, out  # the partials are unused


class _Attention(NamedTuple):
    """What one attention launch reads and writes; the partials are `out` without splits."""

    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    attn: AttentionMetadata
    scale: float
    out: torch.Tensor
    part_out: torch.Tensor
    part_lse: torch.Tensor
    window: int  # 0: no sliding window
    sinks: torch.Tensor | None
    dense_from: int  # 0, or the rows of dense_runs(attn.chunks, dense_from) are not written


def _launch_attention(a: _Attention, plan: _Plan) -> None:
    """One _paged_attention_kernel launch over plan.grid."""
    num_rows, num_q_heads, head_dim = a.q.shape
    num_kv_heads = a.k_cache.shape[2]
    _paged_attention_kernel[plan.grid](
        q_ptr=a.q,
        k_cache_ptr=a.k_cache,
        v_cache_ptr=a.v_cache,
        out_ptr=a.out,
        part_out_ptr=a.part_out,
        part_lse_ptr=a.part_lse,
        cu_seqlens_q_ptr=a.attn.cu_seqlens_q,
        seq_lens_ptr=a.attn.seq_lens,
        page_table_ptr=a.attn.page_table,
        sinks_ptr=a.out if a.sinks is None else a.sinks,  # a.out: never read
        work_ptr=a.out if plan.work is None else plan.work,
        num_seqs=a.attn.page_table.shape[0],
        num_rows=num_rows,
        head_dim=head_dim,
        num_splits=plan.num_splits,
        scale_log2=a.scale * LOG2_E,
        window=a.window,
        dense_from=a.dense_from,
        stride_qt=a.q.stride(0),
        stride_qh=a.q.stride(1),
        stride_qd=a.q.stride(2),
        stride_kp=a.k_cache.stride(0),
        stride_ks=a.k_cache.stride(1),
        stride_kh=a.k_cache.stride(2),
        stride_kd=a.k_cache.stride(3),
        stride_vp=a.v_cache.stride(0),
        stride_vs=a.v_cache.stride(1),
        stride_vh=a.v_cache.stride(2),
        stride_vd=a.v_cache.stride(3),
        stride_ot=a.out.stride(0),
        stride_oh=a.out.stride(1),
        stride_od=a.out.stride(2),
        stride_pt_b=a.attn.page_table.stride(0),
        stride_pt_p=a.attn.page_table.stride(1),
        GROUP=num_q_heads // num_kv_heads,
        GROUP_PAD=plan.group_pad,
        BLOCK_Q=plan.block_q,
        BLOCK_N=plan.config.block_n,
        BLOCK_D=next_power_of_2(head_dim),
        PAGE_SIZE=a.k_cache.shape[1],
        SPLIT=plan.num_splits > 1,
        ZERO_TAIL=plan.decode,
        HAS_WINDOW=a.window > 0,
        HAS_SINKS=a.sinks is not None,
        WORK=plan.work is not None,
        DOT_PRECISION="ieee" if a.q.dtype == torch.float32 else None,
        num_warps=plan.config.num_warps,
        num_stages=plan.config.num_stages,
        **pdl_kwargs(a.q.device),
    )


def _launch_combine(
    a: _Attention, plan: _Plan, shrink: LoraWeights | None, info: LoraBatchInfo | None
) -> torch.Tensor | None:
    """The combine of a split decode's partials; with `shrink`, also the o LoRA's shrink
    partials [T, Hq, 1, R] float32, which it returns (else None)."""
    num_rows, num_q_heads, head_dim = a.q.shape
    R, shrunk = 1, None
    if shrink is not None:
        n, R, K_a = len(shrink.out_slices), shrink.max_rank, shrink.in_features
        assert n == 1 and K_a == num_q_heads * head_dim, (shrink.out_slices, K_a, a.q.shape)
        assert shrink.num_experts == 0 and shrink.table.is_contiguous(), shrink.table.stride()
        assert info.slot_of_token.shape[0] >= num_rows, (info.slot_of_token.shape, num_rows)
        # rows without an enabled slot are left unwritten, as lora_shrink_split leaves them
        shrunk = a.q.new_empty(num_rows, num_q_heads, 1, R, dtype=torch.float32)
    on = shrink is not None
    unused = a.out  # the LoRA pointers without a shrink: never read
    _combine_splits_kernel[(a.attn.page_table.shape[0], num_q_heads)](
        part_out_ptr=a.part_out,
        part_lse_ptr=a.part_lse,
        out_ptr=a.out,
        cu_seqlens_q_ptr=a.attn.cu_seqlens_q,
        seq_lens_ptr=a.attn.seq_lens,
        sinks_ptr=unused if a.sinks is None else a.sinks,
        a_ptr=shrink.arena if on else unused,
        a_tab_ptr=shrink.table if on else unused,
        shrink_ptr=shrunk if on else unused,
        slot_ptr=info.slot_of_token if on else unused,
        enabled_ptr=info.slot_enabled if on else unused,
        rank_ptr=info.rank_of_slot if on else unused,
        scaling_ptr=info.scaling_of_slot if on else unused,
        head_dim=head_dim,
        num_splits=plan.num_splits,
        window=a.window,
        stride_ot=a.out.stride(0),
        stride_oh=a.out.stride(1),
        stride_od=a.out.stride(2),
        SPLITS_PAD=next_power_of_2(plan.num_splits),
        BLOCK_N=plan.config.block_n,
        BLOCK_D=next_power_of_2(head_dim),
        HAS_WINDOW=a.window > 0,
        HAS_SINKS=a.sinks is not None,
        SHRINK=on,
        R=R,
        RP=next_power_of_2(R),
        A_ALIGN=shrink.a_align if on else 1,
        **pdl_kwargs(a.q.device),
    )
    return shrunk
