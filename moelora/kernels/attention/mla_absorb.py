"""MLA's absorption of kv_b_proj in Triton, kv_b_proj's LoRA inside: each head's queries into
the latent space and its weighted latents out of it (kernels/mla.absorb_q and absorb_out, with
their lora_q_ and lora_out_ corrections, are the references).

Semantics: out[t, h] = a[t, h] @ W[h] + scaling[s] * (a[t, h] @ F1[s, h]) @ F2[s, h] for each
token t whose slot s is enabled and has kv_b_proj's factors A [r, L], B [Hh (N + V), r] (its
module rank in the table above 0), the first term alone for every other token. W[h] is a
[K, NOUT] view of head h's rows of kv_b [Hh (N + V), L]: its N key rows as they lie (q side:
K = N, NOUT = L; F1 = B_k[h], F2 = A), or its V value rows transposed (out side: K = L,
NOUT = V; F1 = A.T, F2 = B_v[h].T). One program owns a block of BT tokens, one head and BN
output columns, and walks K in BK steps, reading kv_b in its own dtype (no float32 copy of the
weight).

kv_b_proj's LoRA rides in the same launch (a correction of its own would be two more graph
nodes a layer, each paid by base tokens too). A program reads its rows' slots first; where none
of them has an enabled slot with kv_b_proj's factors (a base-only batch, padding) it adds
nothing and reads no factor. Otherwise it takes the slots its rows hold G at a time (G RP =
LORA_COLS, or fewer where the block holds fewer rows: G_BY_ROWS), the largest first: the rows
times the G slots' F1 side by side [K, G RP] into u [BT, G RP], over K in BK steps; u kept
where a column's slot is its row's, times that slot's scaling; then u times the G slots' F2
stacked [G RP, BN] into the accumulator. A pass walks K once for G adapters: one pass a slot
left a block of 8 adapters' rows serial in its loads (the out side's K is L). On the sides in
FUSED_SIDES, in blocks of at most FUSED_MAX_ROWS rows (a decode step of one token), the first
pass takes no walk of its own: its F1 tiles are dotted with the rows the base's walk loads.
Rows of A and columns of B past the module's rank are masked off, never read.

Precision. The references compute in float32 on the weight's values. Products of two bf16 (or
fp16) values are exact in float32, so the q side's dot on the tensor cores, with a float32
accumulator, is the reference's sum of the same products. The out side's rows are float32 (the
attention's output): each is split into a high part in the weight's dtype and the remainder,
rounded to it too, and both are dotted with the weight (the weight itself is exact in its
dtype), which leaves about 2^-16 of a row's relative error, near float32's own rounding of the
sums. The LoRA's float32 u is split the same way against F2. float32 weights (the GPU tests
against transformers) take ieee float32 dots.

No host read and a grid from shapes only (the slots are read through the tables by the
kernel): a decode step captures it in its graph and replays it with new slots.

Legend: T = tokens, Hh = heads, N = qk_nope_head_dim, V = v_head_dim, L = kv_lora_rank,
r = a slot's rank, RP = the pool's max rank padded to a power of two (16 at least, for the
dots), S = adapter slots.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from moelora.kernels.lora import TAB_A_OFF, TAB_B_OFF, TAB_B_ROW, TAB_RANK, aligned, module_slots
from moelora.kernels.pdl import pdl_kwargs, pdl_wait
from moelora.kernels.sizes import cdiv, next_power_of_2
from moelora.step.lora import TABLE_WIDTH, LoraBatchInfo, LoraWeights

# how a program's dot reads its rows: "plain" (the weight's dtype), "split" (float32 rows as
# two parts in the weight's dtype), "ieee" (float32 weight)
_DOTS = ("plain", "split", "ieee")
# columns of u a pass of kv_b_proj's LoRA takes: the factors of 128 // RP slots side by side,
# so a block of rows with several adapters walks K once for each 128 // RP of them, not once
# each (8 adapters of rank 16 in one pass)
LORA_COLS = 128
# the absorption's sides ("q", "out") whose first LoRA pass rides in the base's walk over K:
# the pass's F1 tiles dotted with the rows the base loads, so that up to LORA_COLS // RP
# adapters cost no second serial walk (the other passes walk K after it, as unfused ones do)
FUSED_SIDES: tuple[str, ...] = ("q", "out")
# ... and only for launches whose token blocks hold at most this many rows (a decode step of
# one token: its block's one slot is the first pass whole; deciding to fuse waits for the
# rows' slots before the base's walk, which costs every launch that fuses, base rows too)
FUSED_MAX_ROWS = 1
# G no larger than the rows a token block holds (a power of two at least): a block's rows hold
# no more distinct slots than that, so a decode step of one token dots 1 slot's RP columns,
# not LORA_COLS mostly masked
G_BY_ROWS = True
# programs a launch should make at least (the GPU's SMs, about): a decode step's few tokens
# take the smallest token block that does, so the out side's 2 column blocks a head are not 32
# programs each walking K = L = 512 (and once more per pass of kv_b_proj's LoRA) on 132 SMs
FILL = 128


@triton.jit
def _mma(x, w, acc, DOT: tl.constexpr):
    """acc + x @ w, as DOT says (_DOTS): x in w's dtype, float32 x split in two parts of it, or
    float32 ieee."""
    if DOT == "ieee":
        return tl.dot(x.to(tl.float32), w, acc=acc, input_precision="ieee")
    elif DOT == "split":
        high = x.to(w.dtype)
        low = (x - high.to(tl.float32)).to(w.dtype)
        return tl.dot(low, w, acc=tl.dot(high, w, acc=acc))
    else:
        return tl.dot(x, w, acc=acc)


@triton.jit
def _pass_columns(
    todo,  # [BT] each row's slot not yet taken by a pass, -1 without one
    head,
    lw_ptr,
    tab_ptr,
    K: tl.constexpr,
    NOUT: tl.constexpr,
    HEAD_ROWS: tl.constexpr,
    ROW0: tl.constexpr,  # 0: the q side
    TW: tl.constexpr,
    RP: tl.constexpr,
    G: tl.constexpr,  # slots a pass
    A_ALIGN: tl.constexpr,
):
    """One pass's [G RP] columns, the G largest slots left in todo (-1 past the last): (each
    column's slot, whether it is within its slot's rank, its row of A and column of B_k[h] or
    B_v[h] as pointers, B's row stride, todo without the pass's slots)."""
    offs_c = tl.arange(0, G * RP)
    r_of_c = offs_c % RP
    col_slot = tl.full((G * RP,), -1, tl.int32)
    for g in tl.static_range(G):
        slot = tl.max(todo, 0)
        col_slot = tl.where(offs_c // RP == g, slot, col_slot)
        todo = tl.where(todo == slot, -1, todo)
    entry = tab_ptr + tl.maximum(col_slot, 0).to(tl.int64) * TW
    # the entry's four values in one round trip (all on the slot alone; c_ok masks the reads)
    has = col_slot >= 0
    c_ok = has & (r_of_c < tl.load(entry + TAB_RANK, mask=has, other=0))
    a_col = lw_ptr + aligned(tl.load(entry + TAB_A_OFF, mask=has, other=0), A_ALIGN)
    b_row = tl.load(entry + TAB_B_ROW, mask=has, other=0)
    # A's row r (of L) and B_k[h]'s or B_v[h]'s column r, for each column c
    a_col += r_of_c * (K if ROW0 != 0 else NOUT)
    b_col = lw_ptr + tl.load(entry + TAB_B_OFF, mask=has, other=0) + r_of_c
    b_col += (head * HEAD_ROWS + ROW0).to(tl.int64) * b_row
    return col_slot, c_ok, a_col, b_col, b_row, todo


@triton.jit
def _f1_tile(a_col, b_col, b_row, c_ok, k0, offs_k, K: tl.constexpr, ROW0: tl.constexpr):
    """A pass's F1 rows k0 + offs_k [BK, G RP]: B_k[h] on the q side, A.T on the out side."""
    k_ok = (k0 + offs_k) < K
    if ROW0 == 0:
        f1 = b_col[None, :] + (k0 + offs_k)[:, None] * b_row[None, :]
    else:
        f1 = a_col[None, :] + (k0 + offs_k)[:, None]
    return tl.load(f1, mask=k_ok[:, None] & c_ok[None, :], other=0.0)


@triton.jit
def _f2_tile(a_col, b_col, b_row, c_ok, offs_n, n_ok, ROW0: tl.constexpr):
    """A pass's F2 [G RP, BN]: A's columns offs_n on the q side, B_v[h].T's on the out side."""
    if ROW0 == 0:  # F2 = A: [G RP, NOUT]
        f2 = a_col[:, None] + offs_n[None, :]
    else:  # F2 = B_v[h].T
        f2 = b_col[:, None] + offs_n[None, :] * b_row[:, None]
    return tl.load(f2, mask=c_ok[:, None] & n_ok[None, :], other=0.0)


@triton.jit
def _u_walk(
    a_rows,
    rows_ok,
    a_col,
    b_col,
    b_row,
    c_ok,
    K: tl.constexpr,
    ROW0: tl.constexpr,
    DOT: tl.constexpr,
    BT: tl.constexpr,
    BK: tl.constexpr,
    GRP: tl.constexpr,
):
    """A pass's u [BT, G RP] (GRP = G RP): the rows where rows_ok times its F1, over K."""
    offs_k = tl.arange(0, BK)
    u = tl.zeros((BT, GRP), dtype=tl.float32)
    for k0 in range(0, K, BK):
        k_ok = (k0 + offs_k) < K
        x = tl.load(
            a_rows + (k0 + offs_k)[None, :], mask=rows_ok[:, None] & k_ok[None, :], other=0.0
        )
        u = _mma(x, _f1_tile(a_col, b_col, b_row, c_ok, k0, offs_k, K, ROW0), u, DOT)
    return u


@triton.jit
def _pass_out(
    acc, u, slots, col_slot, c_ok, a_col, b_col, b_row, scaling_ptr, offs_n, n_ok, ROW0, DOT
):
    """acc + a pass's u [BT, G RP] (the rows times its F1), kept where a column's slot is its
    row's, times that slot's scaling, times its F2 stacked [G RP, BN]."""
    mine = (slots[:, None] == col_slot[None, :]) & (col_slot >= 0)[None, :]  # [BT, G RP]
    scale = tl.load(scaling_ptr + col_slot, mask=c_ok, other=0.0)
    u = tl.where(mine, u * scale[None, :], 0.0)
    f2 = _f2_tile(a_col, b_col, b_row, c_ok, offs_n, n_ok, ROW0)
    if DOT == "ieee":
        return _mma(u, f2, acc, "ieee")
    else:
        return _mma(u, f2, acc, "split")


@triton.jit
def _lora_delta(
    acc,
    a_rows,  # [BT, 1] pointers: the rows of the program's head
    slots,  # [BT] each row's slot (module_slots), -1 without one
    todo,  # [BT] ... where no pass has taken it yet, else -1
    head,
    offs_n,
    n_ok,
    lw_ptr,
    tab_ptr,
    scaling_ptr,
    K: tl.constexpr,
    NOUT: tl.constexpr,
    HEAD_ROWS: tl.constexpr,
    ROW0: tl.constexpr,  # 0: the q side
    DOT: tl.constexpr,
    TW: tl.constexpr,
    RP: tl.constexpr,
    G: tl.constexpr,  # slots a pass
    A_ALIGN: tl.constexpr,
    BT: tl.constexpr,
    BK: tl.constexpr,
):
    """acc + each row's scaling * (a @ F1) @ F2 of its slot in todo (the module docstring), G
    slots a pass, the largest left first, each pass a walk over K of its own."""
    while tl.max(todo, 0) >= 0:
        col_slot, c_ok, a_col, b_col, b_row, todo = _pass_columns(
            todo, head, lw_ptr, tab_ptr, K, NOUT, HEAD_ROWS, ROW0, TW, RP, G, A_ALIGN
        )
        mine = (slots[:, None] == col_slot[None, :]) & (col_slot >= 0)[None, :]
        rows_ok = tl.max(mine.to(tl.int32), 1) > 0
        u = _u_walk(a_rows, rows_ok, a_col, b_col, b_row, c_ok, K, ROW0, DOT, BT, BK, G * RP)
        pass_ = (col_slot, c_ok, a_col, b_col, b_row)
        acc = _pass_out(acc, u, slots, *pass_, scaling_ptr, offs_n, n_ok, ROW0, DOT)
    return acc


@triton.jit
def _kv_b_tiles(a_rows, w_head, k0, offs_k, t_ok, offs_n, n_ok, stride_wk, stride_wn, K):
    """The program's rows k0 + offs_k [BT, BK] and W[h]'s [BK, BN] tile."""
    k_ok = (k0 + offs_k) < K
    a = tl.load(a_rows + (k0 + offs_k)[None, :], mask=t_ok[:, None] & k_ok[None, :], other=0.0)
    w = tl.load(
        w_head + (k0 + offs_k)[:, None] * stride_wk + offs_n[None, :] * stride_wn,
        mask=k_ok[:, None] & n_ok[None, :],
        other=0.0,
    )
    return a, w


@triton.jit
def _o_shrink(
    out,  # [BT, BN] the program's rounded output
    todo,  # [BT] each row's slot (module_slots on o_proj's table), -1 without one
    offs_t,
    offs_n,
    n_ok,
    head,
    o_lw_ptr,
    o_tab_ptr,
    scaling_ptr,
    part_ptr,
    NOUT: tl.constexpr,
    HEADS: tl.constexpr,
    R_PART: tl.constexpr,
    RPO: tl.constexpr,
    ODOT: tl.constexpr,
    O_ALIGN: tl.constexpr,
    TW: tl.constexpr,
):
    """o_proj's LoRA shrink of the program's columns, for the rows with a slot: part[t, j] =
    scaling * out[t, cols] @ A_o[:, head * V + cols].T, j = head * blocks + this block (blocks:
    the grid's column blocks), the other rows left unwritten."""
    offs_r = tl.arange(0, RPO)
    blocks = tl.num_programs(2)
    j = head * blocks + tl.program_id(2)
    while tl.max(todo, 0) >= 0:
        slot = tl.max(todo, 0)
        mine = todo == slot
        todo = tl.where(mine, -1, todo)
        entry = o_tab_ptr + slot.to(tl.int64) * TW
        a_ptr = o_lw_ptr + aligned(tl.load(entry + TAB_A_OFF), O_ALIGN) + head * NOUT
        r_ok = offs_r < tl.load(entry + TAB_RANK)
        a = tl.load(
            a_ptr + offs_r[None, :] * (HEADS * NOUT) + offs_n[:, None],
            mask=n_ok[:, None] & r_ok[None, :],
            other=0.0,
        )  # [BN, RPO]: A_o's columns of this block, transposed
        x = tl.where(mine[:, None], out, 0.0)
        shrunk = _mma(x, a, tl.zeros((out.shape[0], RPO), dtype=tl.float32), ODOT)
        shrunk *= tl.load(scaling_ptr + slot)
        dst = part_ptr + (offs_t.to(tl.int64) * (HEADS * blocks) + j)[:, None] * R_PART
        tl.store(dst + offs_r[None, :], shrunk, mask=mine[:, None] & (offs_r < R_PART)[None, :])


@triton.jit
def _all_expanded(offs_t, t_ok, cu_q_ptr, seq_lens_ptr, cu_k_ptr, num_seqs, B_PAD: tl.constexpr):
    """Whether every row of the block (offs_t where t_ok) belongs to a sequence that attends in
    the expanded form (its expanded keys, cu_k's, are all its seq_len keys); rows past the last
    sequence (padding) count as not."""
    offs_b = tl.arange(0, B_PAD)
    ends = tl.load(cu_q_ptr + 1 + offs_b, mask=offs_b < num_seqs, other=2147483647)
    seq = tl.sum((ends[None, :] <= offs_t[:, None]).to(tl.int32), axis=1)  # [BT]
    ok = t_ok & (seq < num_seqs)
    keys = tl.load(cu_k_ptr + seq + 1, mask=ok, other=0) - tl.load(cu_k_ptr + seq, mask=ok, other=0)
    expanded = ok & (keys == tl.load(seq_lens_ptr + seq, mask=ok, other=-1))
    return tl.min(tl.where(t_ok, expanded.to(tl.int32), 1), 0) > 0


@triton.jit(do_not_specialize=["T"])  # one compile for every batch size (graph capture)
def _absorb_kernel(
    # Pointers.
    a_ptr,  # [T, Hh, K] rows
    w_ptr,  # kv_b [Hh * HEAD_ROWS, L]
    out_ptr,  # [T, Hh, NOUT] float32 (or the rows' final dtype: rounded once)
    lw_ptr,  # with LORA: the arena, slot s's A [1, r, L] and B [Hh (N + V), r] as its row says
    tab_ptr,  # [S, TW] int64 (step/lora.LoraWeights.table)
    slot_ptr,  # [>= T] int32
    enabled_ptr,  # [S] int32
    scaling_ptr,  # [S] float32
    o_lw_ptr,  # with O_SHRINK: o_proj's arena, its A [1, r, Hh V] as a row of o_tab says
    o_tab_ptr,  # [S, TW] int64
    part_ptr,  # [T, Hh * (NOUT / BN blocks), 1, R_PART] float32: o_proj's partial shrinks
    cu_q_ptr,  # with SKIP: [B + 1] int32, the step's cu_seqlens_q
    seq_lens_ptr,  # [B] int32
    cu_k_ptr,  # [B + 1] int32, ExpandedKv.cu_seqlens_k
    # Sizes and strides.
    T,
    num_seqs,
    stride_at,
    stride_ah,
    stride_ot,
    stride_oh,
    stride_wr,  # kv_b's row stride
    stride_wk,  # W[h]'s, along K and NOUT: (stride_wr, 1) q side, (1, stride_wr) out side
    stride_wn,
    # Meta-parameters.
    K: tl.constexpr,
    NOUT: tl.constexpr,
    HEAD_ROWS: tl.constexpr,  # N + V: kv_b's rows a head
    ROW0: tl.constexpr,  # W[h]'s first row inside the head's: 0 (keys) or N (values)
    DOT: tl.constexpr,  # one of _DOTS
    LORA: tl.constexpr,  # kv_b_proj's LoRA compiled in
    TW: tl.constexpr,
    RP: tl.constexpr,
    G: tl.constexpr,  # kv_b_proj's slots a pass of the LoRA (_lora_delta)
    FUSED: tl.constexpr,  # its first pass dotted in the base's walk over K (FUSED_SIDES)
    A_ALIGN: tl.constexpr,
    O_SHRINK: tl.constexpr,  # the out side: o_proj's LoRA shrink of the rounded output too
    HEADS: tl.constexpr,
    R_PART: tl.constexpr,
    RPO: tl.constexpr,
    ODOT: tl.constexpr,
    O_ALIGN: tl.constexpr,
    SKIP: tl.constexpr,  # blocks whose rows all attend in the expanded form write nothing
    B_PAD: tl.constexpr,  # with SKIP: the sequences, padded to a power of two
    BT: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_wait(PDL)  # first: see kernels/pdl.py
    # -- program -> (token block, head, output columns) --
    pid_t = tl.program_id(0)
    head = tl.program_id(1)
    offs_t = pid_t * BT + tl.arange(0, BT)
    offs_n = tl.program_id(2) * BN + tl.arange(0, BN)
    offs_k = tl.arange(0, BK)
    t_ok = offs_t < T
    n_ok = offs_n < NOUT
    if SKIP:
        if _all_expanded(offs_t, t_ok, cu_q_ptr, seq_lens_ptr, cu_k_ptr, num_seqs, B_PAD):
            return  # nobody reads these rows: the expanded form computes them
    a_rows = a_ptr + offs_t[:, None].to(tl.int64) * stride_at + head * stride_ah
    w_head = w_ptr + (head * HEAD_ROWS + ROW0).to(tl.int64) * stride_wr

    # -- accumulate over K in fp32; kv_b_proj's LoRA: nothing read where no row has an enabled
    # slot with its factors, its first pass's G slots dotted with the same rows in the same walk
    # over K (one walk for up to G adapters: a decode step's usual case), further passes after --
    tiles = (offs_k, t_ok, offs_n, n_ok, stride_wk, stride_wn, K)
    acc = tl.zeros((BT, BN), dtype=tl.float32)
    if LORA:
        slots = module_slots(slot_ptr, enabled_ptr, tab_ptr, offs_t, t_ok, TW)
        todo = slots  # the rows' slots no pass has taken yet
        if FUSED and tl.max(slots, 0) >= 0:
            col_slot, c_ok, a_col, b_col, b_row, todo = _pass_columns(
                slots, head, lw_ptr, tab_ptr, K, NOUT, HEAD_ROWS, ROW0, TW, RP, G, A_ALIGN
            )
            u = tl.zeros((BT, G * RP), dtype=tl.float32)
            for k0 in range(0, K, BK):
                a, w = _kv_b_tiles(a_rows, w_head, k0, *tiles)
                acc = _mma(a, w, acc, DOT)
                u = _mma(a, _f1_tile(a_col, b_col, b_row, c_ok, k0, offs_k, K, ROW0), u, DOT)
            pass_ = (col_slot, c_ok, a_col, b_col, b_row)
            acc = _pass_out(acc, u, slots, *pass_, scaling_ptr, offs_n, n_ok, ROW0, DOT)
        else:
            for k0 in range(0, K, BK):
                a, w = _kv_b_tiles(a_rows, w_head, k0, *tiles)
                acc = _mma(a, w, acc, DOT)
        acc = _lora_delta(
            acc,
            a_rows,
            slots,
            todo,
            head,
            offs_n,
            n_ok,
            lw_ptr,
            tab_ptr,
            scaling_ptr,
            K=K,
            NOUT=NOUT,
            HEAD_ROWS=HEAD_ROWS,
            ROW0=ROW0,
            DOT=DOT,
            TW=TW,
            RP=RP,
            G=G,
            A_ALIGN=A_ALIGN,
            BT=BT,
            BK=BK,
        )
    else:
        for k0 in range(0, K, BK):
            a, w = _kv_b_tiles(a_rows, w_head, k0, *tiles)
            acc = _mma(a, w, acc, DOT)

    # -- store the block's rows --
    out_ptrs = out_ptr + offs_t[:, None].to(tl.int64) * stride_ot + head * stride_oh
    out = acc.to(out_ptr.dtype.element_ty)
    tl.store(out_ptrs + offs_n[None, :], out, mask=t_ok[:, None] & n_ok[None, :])

    # -- o_proj's LoRA shrink of the rows that have its factors, which the next norm expands --
    if O_SHRINK:
        todo = module_slots(slot_ptr, enabled_ptr, o_tab_ptr, offs_t, t_ok, TW)
        if tl.max(todo, 0) >= 0:
            _o_shrink(
                out,
                todo,
                offs_t,
                offs_n,
                n_ok,
                head,
                o_lw_ptr,
                o_tab_ptr,
                scaling_ptr,
                part_ptr,
                NOUT=NOUT,
                HEADS=HEADS,
                R_PART=R_PART,
                RPO=RPO,
                ODOT=ODOT,
                O_ALIGN=O_ALIGN,
                TW=TW,
            )


class SkipExpanded(NamedTuple):
    """A prefill step's sequences that attend in the expanded form (ExpandedKv: all seq_lens[b]
    of sequence b's keys expanded, cu_seqlens_k's rows): the absorption need not compute their
    rows (the latent attention skips them, the expanded attention writes their output), and a
    token block whose rows all belong to them writes nothing. Padded rows are computed."""

    cu_seqlens_q: torch.Tensor  # [B + 1] int32
    seq_lens: torch.Tensor  # [B] int32
    cu_seqlens_k: torch.Tensor  # [B + 1] int32


def absorb_q(
    q_nope: torch.Tensor,
    kv_b: torch.Tensor,
    *,
    lora: LoraWeights | None = None,
    info: LoraBatchInfo | None = None,
    skip: SkipExpanded | None = None,
) -> torch.Tensor:
    """Semantics: kernels/mla.absorb_q's: q_lat[t, h] = q_nope[t, h] @ W_k[h] (head h's first N
    rows of kv_b), with lora and info kv_b_proj's correction (kernels/mla.lora_q_) in the same
    launch. q_nope [T, Hh, N]; kv_b [Hh (N + V), L]; lora: kv_b_proj's, read through its
    table. Returns [T, Hh, L] float32; with skip, rows of expanded sequences may be left
    unwritten (SkipExpanded)."""
    L = kv_b.shape[1]
    return _absorb(q_nope, kv_b, L, row0=0, transposed=False, lora=lora, info=info, skip=skip)[0]


def absorb_out(
    o_lat: torch.Tensor,
    kv_b: torch.Tensor,
    qk_nope_head_dim: int,
    out_dtype: torch.dtype = torch.float32,
    *,
    lora: LoraWeights | None = None,
    info: LoraBatchInfo | None = None,
    skip: SkipExpanded | None = None,
) -> torch.Tensor:
    """Semantics: kernels/mla.absorb_out's: out[t, h] = o_lat[t, h] @ W_v[h].T (head h's rows
    of kv_b after its first qk_nope_head_dim), with lora and info kv_b_proj's correction
    (kernels/mla.lora_out_) added in the same launch, rounded to out_dtype once. o_lat
    [T, Hh, L] float32. Returns [T, Hh, V] in out_dtype; with skip, rows of expanded sequences
    may be left unwritten (SkipExpanded)."""
    V = kv_b.shape[0] // o_lat.shape[1] - qk_nope_head_dim
    return _absorb(
        o_lat,
        kv_b,
        V,
        row0=qk_nope_head_dim,
        transposed=True,
        out_dtype=out_dtype,
        lora=lora,
        info=info,
        skip=skip,
    )[0]


def absorb_out_o_shrink(
    o_lat: torch.Tensor,
    kv_b: torch.Tensor,
    qk_nope_head_dim: int,
    out_dtype: torch.dtype,
    *,
    lora: LoraWeights | None,
    info: LoraBatchInfo,
    o_lora: LoraWeights,
) -> tuple[torch.Tensor, torch.Tensor]:
    """absorb_out, and in the same launch o_proj's LoRA shrink of its rounded output as
    [T, Hh V] (reference.lora_shrink_split's semantics): (out, part [T, KS, 1, R] float32, the
    partial shrinks over KS slices of o_proj's input, which the next norm sums and expands;
    rows without an enabled slot with o_proj's factors are left unwritten)."""
    V = kv_b.shape[0] // o_lat.shape[1] - qk_nope_head_dim
    return _absorb(
        o_lat,
        kv_b,
        V,
        row0=qk_nope_head_dim,
        transposed=True,
        out_dtype=out_dtype,
        lora=lora,
        info=info,
        o_lora=o_lora,
    )


def _absorb(
    a: torch.Tensor,
    kv_b: torch.Tensor,
    n_out: int,
    *,
    row0: int,
    transposed: bool,
    out_dtype: torch.dtype = torch.float32,
    lora: LoraWeights | None = None,
    info: LoraBatchInfo | None = None,
    o_lora: LoraWeights | None = None,
    skip: SkipExpanded | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(out [T, Hh, n_out] = a [T, Hh, K] @ W[h] in float32, rounded to out_dtype, W[h] head
    h's kv_b rows from row0 on, as they lie [K, n_out] or transposed [n_out, K] -> [K, n_out];
    with lora and info kv_b_proj's correction added; o_proj's partial shrinks with o_lora)."""
    T, Hh, K = a.shape
    assert a.stride(2) == 1 and kv_b.stride(1) == 1, (a.stride(), kv_b.stride())
    head_rows, L = kv_b.shape[0] // Hh, kv_b.shape[1]
    assert kv_b.shape[0] % Hh == 0 and (K if transposed else n_out) == L, (kv_b.shape, a.shape)
    assert row0 + (n_out if transposed else K) <= head_rows, (row0, n_out, K, head_rows)
    BN, BK = 64, 64
    BT = row_block(T, Hh * cdiv(n_out, BN))
    rows = min(T, BT)  # the most a program's token block holds
    out = torch.empty(T, Hh, n_out, dtype=out_dtype, device=a.device)
    o_args, part = _o_shrink_args(out, kv_b, info, o_lora, cdiv(n_out, BN))
    if T == 0:
        return out, part
    stride_wk, stride_wn = (1, kv_b.stride(0)) if transposed else (kv_b.stride(0), 1)
    _absorb_kernel[(cdiv(T, BT), Hh, cdiv(n_out, BN))](
        a_ptr=a,
        w_ptr=kv_b,
        out_ptr=out,
        **_lora_args(a, kv_b, lora, info, rows),
        **o_args,
        **_skip_args(skip, kv_b),
        T=T,
        stride_at=a.stride(0),
        stride_ah=a.stride(1),
        stride_ot=out.stride(0),
        stride_oh=out.stride(1),
        stride_wr=kv_b.stride(0),
        stride_wk=stride_wk,
        stride_wn=stride_wn,
        K=K,
        NOUT=n_out,
        HEAD_ROWS=head_rows,
        ROW0=row0,
        DOT=_dot(a.dtype, kv_b.dtype),
        TW=TABLE_WIDTH,
        FUSED=("out" if transposed else "q") in FUSED_SIDES and rows <= FUSED_MAX_ROWS,
        BT=BT,
        BN=BN,
        BK=BK,
        num_warps=4,
        num_stages=2,
        **pdl_kwargs(a.device),
    )
    return out, part


def _skip_args(skip: SkipExpanded | None, kv_b: torch.Tensor) -> dict:
    """The kernel's arguments for SKIP (pointers without a tensor name kv_b, never read)."""
    if skip is None:
        unused = dict(cu_q_ptr=kv_b, seq_lens_ptr=kv_b, cu_k_ptr=kv_b)
        return dict(unused, num_seqs=0, SKIP=False, B_PAD=1)
    B = skip.seq_lens.shape[0]
    assert skip.cu_seqlens_q.shape == skip.cu_seqlens_k.shape == (B + 1,), skip
    return dict(
        cu_q_ptr=skip.cu_seqlens_q,
        seq_lens_ptr=skip.seq_lens,
        cu_k_ptr=skip.cu_seqlens_k,
        num_seqs=B,
        SKIP=True,
        B_PAD=next_power_of_2(max(B, 1)),
    )


def row_block(T: int, programs_per_block: int) -> int:
    """BT: the largest of 64 / 32 tokens that T fills more than half of and whose blocks make
    FILL programs (each of programs_per_block heads and column blocks), else 16."""
    for bt in (64, 32):
        if T > bt // 2 and cdiv(T, bt) * programs_per_block >= FILL:
            return bt
    return 16


def _lora_args(
    a: torch.Tensor,
    kv_b: torch.Tensor,
    lora: LoraWeights | None,
    info: LoraBatchInfo | None,
    rows: int,
) -> dict:
    """The kernel's arguments for kv_b_proj's LoRA and the step's slots: the factors where
    both are given (checked against the rows a [T, Hh, K] and kv_b), the slots where info is
    (LORA off without the factors; pointers without a tensor name kv_b, never read); rows: the
    most a program's token block holds (G_BY_ROWS)."""
    slots = dict(slot_ptr=kv_b, enabled_ptr=kv_b, scaling_ptr=kv_b)
    if info is not None:
        assert info.slot_of_token.shape[0] >= a.shape[0], (info.slot_of_token.shape, a.shape)
        slots = dict(
            slot_ptr=info.slot_of_token,
            enabled_ptr=info.slot_enabled,
            scaling_ptr=info.scaling_of_slot,
        )
    if lora is None or info is None:
        return dict(slots, lw_ptr=kv_b, tab_ptr=kv_b, LORA=False, RP=16, G=1, A_ALIGN=1)
    assert lora.in_features == kv_b.shape[1] and len(lora.out_slices) == 1, lora.in_features
    assert lora.num_experts == 0 and lora.out_features == kv_b.shape[0], lora.out_features
    assert lora.arena.dtype == kv_b.dtype, (lora.arena.dtype, kv_b.dtype)
    assert lora.table.is_contiguous(), lora.table.stride()
    rp = max(16, next_power_of_2(lora.max_rank))  # 16: the dots' least
    g = max(1, LORA_COLS // rp)
    if G_BY_ROWS:
        g = min(g, next_power_of_2(rows))
    return dict(
        slots,
        lw_ptr=lora.arena,
        tab_ptr=lora.table,
        LORA=True,
        RP=rp,
        G=g,
        A_ALIGN=lora.a_align,
    )


def _o_shrink_args(
    out: torch.Tensor,
    kv_b: torch.Tensor,
    info: LoraBatchInfo | None,
    o_lora: LoraWeights | None,
    blocks: int,
) -> tuple[dict, torch.Tensor | None]:
    """(the kernel's arguments for o_proj's LoRA shrink, its partials [T, Hh * blocks, 1, R]),
    O_SHRINK off and no partials without o_lora."""
    T, Hh, V = out.shape
    if o_lora is None:
        unused = dict(o_lw_ptr=kv_b, o_tab_ptr=kv_b, part_ptr=kv_b, O_SHRINK=False)
        return dict(unused, HEADS=Hh, R_PART=1, RPO=16, ODOT="plain", O_ALIGN=1), None
    assert info is not None, "o_proj's shrink reads the step's slots"
    assert o_lora.in_features == Hh * V and o_lora.out_slices == (o_lora.out_features,)
    assert o_lora.num_experts == 0 and o_lora.table.is_contiguous(), o_lora.table.stride()
    R = o_lora.max_rank
    part = torch.empty(T, Hh * blocks, 1, R, dtype=torch.float32, device=out.device)
    args = dict(o_lw_ptr=o_lora.arena, o_tab_ptr=o_lora.table, part_ptr=part, O_SHRINK=True)
    rpo = max(16, next_power_of_2(R))
    odot = _dot(out.dtype, o_lora.arena.dtype)
    return dict(args, HEADS=Hh, R_PART=R, RPO=rpo, ODOT=odot, O_ALIGN=o_lora.a_align), part


def _dot(a_dtype: torch.dtype, w_dtype: torch.dtype) -> str:
    """The kernel's DOT for rows of a_dtype and a weight of w_dtype."""
    if w_dtype == torch.float32:
        return "ieee"
    if a_dtype == torch.float32:
        return "split"
    assert a_dtype == w_dtype, (a_dtype, w_dtype)
    return "plain"
