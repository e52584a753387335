"""MoE-LoRA pieces that the grouped fused-MoE kernels call; each shrink is done once per pair.

Semantics (per (token, expert e) pair whose slot s is enabled):
  gate_up += scaling[s] * (x @ A13[s, e, i].T) @ B13[s, e, slice_i].T   (before the activation)
  down    += scaling[s] * (h @ A2[s, e].T) @ B2[s, e].T                   (before the top-k sum)

Algorithm. A shrink reads the whole input row (H or I long) but produces only `rank` numbers, so
repeating it in every column block of the GEMMs would give every program a serial loop over the
whole row. Here it is split by who has the data anyway:
  - x @ A13.T: extra programs of the align kernel walk PAIR_SPLITS jobs per pair (half as
    many, twice the rows each, from fused_moe.HALF_SPLITS_FROM pairs on) (`pair_shrink`),
    each writing a few of the pair's rows of xa13 [P, 2, R] (fp32) over all of H. Jobs of
    pairs without an enabled slot exit at once; the programs do nothing when no slot is
    enabled. The first job of each pair zeroes its xa2 row. Each pair reads its expert's
    whole A13 (2 x R x H): at prefill sizes (from fused_moe.BLOCK_SHRINK_FROM pairs) that is
    gigabytes, so there a launch after the align shrinks block by block instead
    (`block_shrink_kernel`): a block's rows share one expert, and each slot present in it
    reads that expert's A13 once, as one tensor-core product.
  - h @ A2.T: each gate_up program holds BN columns of h; it multiplies them by the matching
    BN columns of A2 and atomically adds the partial product into xa2 [P, R] (fp32). Where
    gate_up's shrink runs block by block, so does this one, in a launch between gate_up and
    down reading h's block rows (no atomics: at 4096 tokens of one adapter the adds cost
    gate_up more than the launch takes, and their order varied from run to run).
  - both expands (`expand_rows`) run in the GEMM epilogues: per slot in the block, one B tile
    (gate and up: two), the next slot's loaded while this one's dots run.
No scratch is read for a pair without an enabled slot, so none needs clearing.

Every factor is read through its target's table (step/lora.LoraWeights.table): slot s's A and
B of expert e start at OFF + e * EXPERT in the arena (EXPERT 0: one factor shared by every
expert), at the module's own rank. gate_up and down are separate targets, each with its own
table and rank (PEFT's rank_pattern): a row counts for a target only where its slot's adapter
has that module (module_rows), so a module absent from an adapter (rank 0) is skipped, and
its scratch rows are neither written by the block shrinks nor read.
"""

from __future__ import annotations

import triton
import triton.language as tl

from moelora.kernels.dot import dot
from moelora.kernels.lora import (
    TAB_A_EXPERT,
    TAB_A_OFF,
    TAB_A_SLICE,
    TAB_B_EXPERT,
    TAB_B_OFF,
    TAB_B_ROW,
    TAB_RANK,
    TAB_WIDTH,
    aligned,
)
from moelora.kernels.pdl import pdl_wait


@triton.jit
def pair_shrink(
    job,
    K,
    topk_ids_ptr,
    x_ptr,  # [T, H]
    stride_xt,
    H,
    slot_ptr,
    enabled_ptr,
    w_ptr,  # the arena: slot s's A13 [(E | 1,) 2, r, H] where row s of tab_ptr says
    tab_ptr,  # [S, TAB_WIDTH] int64: A13's table (step/lora.LoraWeights.table)
    xa13_ptr,  # [P, 2, BR] fp32 out
    xa2_ptr,  # [P, BR] fp32 out: zeroed for gate_up's atomic adds
    HAS13: tl.constexpr,
    HAS2: tl.constexpr,
    BR: tl.constexpr,
    BKS: tl.constexpr,
    SPLITS: tl.constexpr,  # jobs a pair: each shrinks 2 * BR / SPLITS of its rows
    A_ALIGN: tl.constexpr,  # A13's LoraWeights.a_align
):
    """xa13[pair, i] = x[token] @ A13[s, e, i].T for the pair's enabled slot s (zeros where
    its adapter has no gate_up module); else nothing.
        Job j does rows (j % SPLITS) * RCH .. + RCH of pair j // SPLITS's 2 * BR (gate's, then
        up's): a pair's 2 x R x H of A is read by SPLITS jobs in parallel, where one job a pair
        would read it a chunk at a time, each chunk a round trip."""
    RCH: tl.constexpr = 2 * BR // SPLITS
    pair = job // SPLITS
    part = job % SPLITS
    token = pair // K
    slot = tl.load(slot_ptr + token)
    if slot >= 0:
        if tl.load(enabled_ptr + slot) != 0:
            if HAS2:
                if part == 0:
                    offs_r = tl.arange(0, BR)
                    tl.store(xa2_ptr + pair * BR + offs_r, tl.zeros((BR,), dtype=tl.float32))
            if HAS13:
                expert = tl.load(topk_ids_ptr + pair)
                half = (part * RCH) // BR
                offs_r = (part * RCH) % BR + tl.arange(0, RCH)
                row = tab_ptr + slot.to(tl.int64) * TAB_WIDTH
                r_ok = offs_r < tl.load(row + TAB_RANK)
                a_off = aligned(tl.load(row + TAB_A_OFF), A_ALIGN)
                a = w_ptr + a_off + half * aligned(tl.load(row + TAB_A_SLICE), A_ALIGN)
                a_expert = aligned(tl.load(row + TAB_A_EXPERT), A_ALIGN)
                a = a + expert.to(tl.int64) * a_expert + offs_r[:, None] * H
                offs_k = tl.arange(0, BKS)
                xa = tl.zeros((RCH,), dtype=tl.float32)
                for k0 in range(0, H, BKS):
                    k_ok = offs_k < H - k0
                    xk = tl.load(x_ptr + token.to(tl.int64) * stride_xt + k0 + offs_k, mask=k_ok)
                    ak = tl.load(
                        a + k0 + offs_k[None, :], mask=r_ok[:, None] & k_ok[None, :], other=0.0
                    )
                    xa += tl.sum(ak.to(tl.float32) * xk.to(tl.float32)[None, :], axis=1)
                tl.store(xa13_ptr + (pair * 2 + half) * BR + offs_r, xa)


@triton.jit
def lora_rows(slot_rows, enabled_ptr, scaling_ptr):
    """(slot, scaling) of each row; slot -1 where the row has no enabled slot. The GEMMs gather
    the slots before their main loop and call this and module_rows after it: the gathers wait
    on the slots only, so they go out together, one round trip."""
    has = slot_rows >= 0
    safe = tl.maximum(slot_rows, 0)
    on = tl.load(enabled_ptr + safe, mask=has, other=0) != 0
    scaling = tl.load(scaling_ptr + safe, mask=has, other=0.0)
    return tl.where(on, slot_rows, -1), scaling


@triton.jit
def module_rows(slot_rows, slot_on, tab_ptr):
    """(slot, rank) of each row for one target (tab_ptr its table): the module's own rank,
    from the slot as gathered (slot_rows); slot -1 and rank 0 where lora_rows found no enabled
    slot (slot_on -1) or the slot's adapter has no such module."""
    has = slot_rows >= 0
    row = tab_ptr + tl.maximum(slot_rows, 0).to(tl.int64) * TAB_WIDTH
    rank = tl.load(row + TAB_RANK, mask=has, other=0).to(tl.int32)
    rank = tl.where(slot_on >= 0, rank, 0)
    return tl.where(rank > 0, slot_on, -1), rank


@triton.jit
def next_slot(slot_rows, s, S: tl.constexpr):
    """The smallest slot above s among the block's rows, or S when none is left."""
    return tl.min(tl.where(slot_rows > s, slot_rows, S), axis=0)


@triton.jit
def _slot_rank(slot_rows, rank_rows, s):
    """Slot s's rank (0 when no row has it, s == S included: its tiles then load nothing)."""
    return tl.max(tl.where(slot_rows == s, rank_rows, 0), axis=0)


@triton.jit
def _or(a, b):
    return a | b


@triton.jit
def block_slots(slot_rows, rank_rows, PACK: tl.constexpr):
    """(packed, whether a row of the block has an enabled slot), for the epilogues of one block.

    With PACK (S <= 8 slots, ranks < 128: packed_walk), packed is the block's slots and ranks in
    one int64, byte s = slot s's rank (0: no row has it; bit 63 stays clear): one reduction
    across the block's warps for the whole walk and for the test, where next_slot and
    _slot_rank are two a step and the test one more. Else packed is 0 (unused) and the test is
    a reduction of its own."""
    if PACK:
        shift = (8 * tl.maximum(slot_rows, 0)).to(tl.int64)
        bits = tl.where(slot_rows >= 0, rank_rows.to(tl.int64) << shift, tl.zeros_like(shift))
        packed = tl.reduce(bits, 0, _or)
        return packed, packed != 0
    else:
        return 0, tl.max(slot_rows, axis=0) >= 0


@triton.jit
def _walk_next(slot_rows, rank_rows, packed, s, S: tl.constexpr, PACK: tl.constexpr):
    """(The smallest slot above s that a row of the block uses, or S; its rank, 0 for S.)
    With PACK it is read off packed in scalar arithmetic: the lowest set bit above byte s
    (x & -x), its index from the exponent of its exact float32."""
    if PACK:
        later = s + 1 < S
        rest = packed >> (8 * tl.minimum(s + 1, S - 1)).to(tl.int64)
        rest = tl.where(later, rest, tl.zeros_like(rest))
        low = rest & -rest
        bit = (low.to(tl.float32).to(tl.int32, bitcast=True) >> 23) - 127
        nxt = tl.where(rest != 0, s + 1 + bit // 8, S)
        byte = packed >> (8 * tl.minimum(nxt, S - 1)).to(tl.int64)
        rank = tl.where(nxt < S, (byte & 255).to(tl.int32), 0)
    else:
        nxt = next_slot(slot_rows, s, S)
        rank = _slot_rank(slot_rows, rank_rows, nxt)
    return nxt, rank


@triton.jit
def _place(
    w_ptr, tab_ptr, s, expert, rank, OFF: tl.constexpr, EXPERT: tl.constexpr, ALIGN: tl.constexpr
):
    """Where slot s's factor (A: OFF = TAB_A_OFF; B: TAB_B_OFF) of `expert` starts in the
    arena, its offset and expert stride multiples of ALIGN (kernels/lora.aligned). Rank 0 (no
    row of the block has the slot; s == S, past the table, included): the table is not read,
    and nor is the factor (its tiles are masked by the rank)."""
    row = tab_ptr + s.to(tl.int64) * TAB_WIDTH
    live = rank > 0
    off = aligned(tl.load(row + OFF, mask=live, other=0), ALIGN)
    stride = aligned(tl.load(row + EXPERT, mask=live, other=0), ALIGN)
    return w_ptr + off + expert.to(tl.int64) * stride


@triton.jit
def _b_row(tab_ptr, s, rank):
    """Slot s's B row stride (its rank columns are contiguous); as _place for rank 0."""
    return tl.load(tab_ptr + s.to(tl.int64) * TAB_WIDTH + TAB_B_ROW, mask=rank > 0, other=0)


@triton.jit
def _b_tile(b_s, b_row, offs_n, n_ok, rank, BR: tl.constexpr):
    """[BR, BN]: B[offs_n, :BR].T of the factor at b_s (row stride b_row), rows past the rank
    masked off (never read)."""
    offs_r = tl.arange(0, BR)
    return tl.load(
        b_s + offs_n[None, :].to(tl.int64) * b_row + offs_r[:, None],
        mask=n_ok[None, :] & (offs_r < rank)[:, None],
        other=0.0,
    )


@triton.jit
def _a_tile(a_s, stride_ar, offs_n, n_ok, rank, BR: tl.constexpr):
    """[BN, BR]: A[:BR, offs_n].T of the factor at a_s, columns past the rank masked off
    (never read)."""
    offs_r = tl.arange(0, BR)
    return tl.load(
        a_s + offs_r[None, :] * stride_ar + offs_n[:, None],
        mask=n_ok[:, None] & (offs_r < rank)[None, :],
        other=0.0,
    )


@triton.jit
def down_partial_shrink(
    xa2_ptr,  # [P, BR] fp32, zeroed by pair_shrink for pairs with an enabled slot
    pair,  # [BM]
    h,  # [BM, BN] this program's columns of h, in the dtype h is stored in
    slot_rows,  # [BM] from module_rows (down's)
    rank_rows,  # [BM] from module_rows (down's)
    packed,  # block_slots of the rows
    w_ptr,  # the arena: slot s's A2 [(E | 1,) 1, r, I] where row s of tab_ptr says
    tab_ptr,  # [S, TAB_WIDTH] int64: A2's table
    expert,  # this block's expert
    I,  # A2's input (h's columns): its rank row stride
    offs_n,
    n_ok,
    S: tl.constexpr,
    BM: tl.constexpr,
    BR: tl.constexpr,
    PACK: tl.constexpr,
    A_ALIGN: tl.constexpr,  # A2's LoraWeights.a_align
):
    """xa2[pair] += h[:, cols] @ A2[s, e, :, cols].T, per row's slot (the other columns' shares
    come from the other column blocks). Walks the block's slots as expand_rows does."""
    part = tl.zeros((BM, BR), dtype=tl.float32)
    s, rank = _walk_next(slot_rows, rank_rows, packed, -1, S, PACK)
    a_s = _place(w_ptr, tab_ptr, s, expert, rank, TAB_A_OFF, TAB_A_EXPERT, A_ALIGN)
    at = _a_tile(a_s, I, offs_n, n_ok, rank, BR)
    while s < S:
        s_next, rank_next = _walk_next(slot_rows, rank_rows, packed, s, S, PACK)
        a_next = _place(w_ptr, tab_ptr, s_next, expert, rank_next, TAB_A_OFF, TAB_A_EXPERT, A_ALIGN)
        at_next = _a_tile(a_next, I, offs_n, n_ok, rank_next, BR)
        part = dot(tl.where((slot_rows == s)[:, None], h, 0.0).to(at.dtype), at, part)
        s = s_next
        at = at_next
    offs_r = tl.arange(0, BR)
    active = slot_rows >= 0
    tl.atomic_add(
        xa2_ptr + pair[:, None] * BR + offs_r[None, :], part, mask=active[:, None], sem="relaxed"
    )


@triton.jit
def expand_rows(
    acc0,  # [BM, BN] fp32
    acc1,  # [BM, BN] fp32, only with TWO
    xa0,  # [BM, BR] fp32 shrink of each row (zero past its slot's rank)
    xa1,  # [BM, BR] fp32, only with TWO
    slot_rows,  # [BM] from module_rows (this target's)
    rank_rows,  # [BM]
    scale_rows,  # [BM] from lora_rows
    packed,  # block_slots of the rows
    w_ptr,  # the arena: slot s's B [(E | 1,) out, r] where row s of tab_ptr says
    tab_ptr,  # [S, TAB_WIDTH] int64: B's table
    expert,  # this block's expert
    offs_n0,
    offs_n1,
    n_ok,
    S: tl.constexpr,
    BR: tl.constexpr,
    TWO: tl.constexpr,
    PACK: tl.constexpr,
):
    """acc_i[m] += scaling[s] * xa_i[m] @ B[s, cols_i].T for each row m of slot s, i < 2 if TWO
    (gate and up share the walk). Only the slots the block's rows use are visited, in
    ascending order, and the next slot's tiles are loaded before this slot's dots: each step
    then waits on the next slot's row of the table and its tiles (two dependent loads), with
    no rank or scaling load in the chain."""
    xs0 = xa0 * scale_rows[:, None]
    xs1 = xa1 * scale_rows[:, None]
    s, rank = _walk_next(slot_rows, rank_rows, packed, -1, S, PACK)
    # B's rank columns (its tiles' contiguous side) are as many as the rank: no alignment
    b_s = _place(w_ptr, tab_ptr, s, expert, rank, TAB_B_OFF, TAB_B_EXPERT, 1)
    b_row = _b_row(tab_ptr, s, rank)
    bt0 = _b_tile(b_s, b_row, offs_n0, n_ok, rank, BR)
    bt1 = bt0
    if TWO:
        bt1 = _b_tile(b_s, b_row, offs_n1, n_ok, rank, BR)
    while s < S:
        s_next, rank_next = _walk_next(slot_rows, rank_rows, packed, s, S, PACK)
        b_s = _place(w_ptr, tab_ptr, s_next, expert, rank_next, TAB_B_OFF, TAB_B_EXPERT, 1)
        b_row = _b_row(tab_ptr, s_next, rank_next)
        bt0_next = _b_tile(b_s, b_row, offs_n0, n_ok, rank_next, BR)
        bt1_next = bt0_next
        if TWO:
            bt1_next = _b_tile(b_s, b_row, offs_n1, n_ok, rank_next, BR)
        rows_s = (slot_rows == s)[:, None]
        acc0 = dot(tl.where(rows_s, xs0, 0.0).to(bt0.dtype), bt0, acc0)
        if TWO:
            acc1 = dot(tl.where(rows_s, xs1, 0.0).to(bt1.dtype), bt1, acc1)
        s = s_next
        bt0 = bt0_next
        bt1 = bt1_next
    return acc0, acc1


@triton.jit
def block_shrink_kernel(
    # Pointers: the input, the align's blocks, LoRA batch info and A, the scratch.
    x_ptr,  # [T, H] tokens' rows, or with BLOCK_ROWS [NB*BM, H] the blocks' own rows (h)
    sorted_pair_ptr,  # [NB*BM] int32: pair of each block row, -1 for padding
    expert_of_block_ptr,  # [NB] int32: -1 for unused blocks
    slot_ptr,
    enabled_ptr,
    any_ptr,
    w_ptr,  # the arena: slot s's A [(E | 1,) HALVES, r, H]: A13 (HALVES 2) or A2 (1, H its I)
    tab_ptr,  # [S, TAB_WIDTH] int64: that A's table
    xa_ptr,  # [P, HALVES, BR] fp32 out
    # Sizes and strides (last dims contiguous).
    H,
    stride_xt,
    # Meta-parameters.
    K: tl.constexpr,
    S: tl.constexpr,
    HALVES: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    SLOT_GRID: tl.constexpr,  # one program a (block, slot), the slot program_id(1)
    BM: tl.constexpr,
    BK: tl.constexpr,
    BR: tl.constexpr,
    A_ALIGN: tl.constexpr,  # that A's LoraWeights.a_align
    PDL: tl.constexpr,
):
    """A shrink for one block of the align: xa[pair, i] = row @ A[s, e, i].T for the rows with
    an enabled slot s (e: the block's expert); the row is x[token] (gate_up's: xa13) or, with
    BLOCK_ROWS, the block's own row of h (down's: xa2, after gate_up). Column c of the
    [BM, HALVES * BR] product is half c // BR's rank row c % BR. Rows whose slot's adapter has
    no such module are left unwritten (their readers skip them: module_rows).

    SLOT_GRID: each program takes one slot of its block (the others exit at once), where one
    program a block walks its slots in turn, each a pass over H: at decode sizes a block holds
    up to S slots and the walk is the launch's time. A slot's product is the same either way."""
    pdl_wait(PDL)  # first: see kernels/pdl.py
    pid = tl.program_id(0)
    expert = tl.load(expert_of_block_ptr + pid)
    if expert < 0:
        return
    if tl.load(any_ptr) == 0:
        return
    offs_m = tl.arange(0, BM)
    pair = tl.load(sorted_pair_ptr + pid * BM + offs_m)
    row_ok = pair >= 0
    token = tl.where(row_ok, pair // K, 0)
    slot_rows = tl.load(slot_ptr + token, mask=row_ok, other=-1)
    safe = tl.maximum(slot_rows, 0)
    on = tl.load(enabled_ptr + safe, mask=slot_rows >= 0, other=0) != 0
    slot_rows = tl.where(on, slot_rows, -1)
    rows_on = slot_rows >= 0
    # which slots the block holds, one bit each (S <= 63: the wrapper checks)
    bits = tl.where(rows_on, tl.full((BM,), 1, tl.int64) << safe.to(tl.int64), 0)
    present = tl.reduce(bits, 0, _or)
    offs_c = tl.arange(0, HALVES * BR)
    half, r = offs_c // BR, offs_c % BR
    offs_k = tl.arange(0, BK)
    rows = pid * BM + offs_m if BLOCK_ROWS else token
    x_rows = x_ptr + rows[:, None].to(tl.int64) * stride_xt + offs_k[None, :]
    xa_ptrs = xa_ptr + pair[:, None] * HALVES * BR + offs_c[None, :]
    # slot by slot, each a pipelined loop over H of its own rows (a slot test inside the loop
    # over H would keep its loads from being pipelined: each step then waited on one load's
    # latency); with SLOT_GRID only this program's slot passes the rank load's mask
    mine = tl.program_id(1) if SLOT_GRID else -1
    for s in tl.static_range(S):
        row = tab_ptr + s * TAB_WIDTH
        held = ((present >> s) & 1) != 0
        if SLOT_GRID:
            held = held & (mine == s)
        rank = tl.load(row + TAB_RANK, mask=held, other=0)
        if rank > 0:  # a row of the block has the slot, and its adapter the module
            rows_s = slot_rows == s
            r_ok = r < rank
            a_off = aligned(tl.load(row + TAB_A_OFF), A_ALIGN)
            a_expert = aligned(tl.load(row + TAB_A_EXPERT), A_ALIGN)
            a_slice = aligned(tl.load(row + TAB_A_SLICE), A_ALIGN)
            a_e = w_ptr + a_off + expert.to(tl.int64) * a_expert
            a_s = a_e + half[None, :] * a_slice + r[None, :] * H
            a_s = a_s + offs_k[:, None]  # [BK, HALVES * BR]
            acc = tl.zeros((BM, HALVES * BR), dtype=tl.float32)
            for k0 in range(0, H, BK):
                k_ok = offs_k < H - k0
                xt = tl.load(x_rows + k0, mask=rows_s[:, None] & k_ok[None, :], other=0.0)
                a = tl.load(a_s + k0, mask=k_ok[:, None] & r_ok[None, :], other=0.0)
                acc = dot(xt, a, acc)
            tl.store(xa_ptrs, acc, mask=rows_s[:, None])


PAIR_SPLITS = 8  # pair_shrink jobs a pair: 4 rows each at rank 16


def pair_shrink_block_k(BR: int, splits: int) -> int:
    """Input chunk of pair_shrink: [2 * BR / splits, BKS] tiles of A, about 8K elements (all
    of a 2048-wide row at rank 16 and 8 splits: one round trip)."""
    return max(64, 8192 // (2 * BR // splits))


def packed_walk(num_slots: int, max_rank: int) -> bool:
    """Whether the epilogues' slot walk reads the slots and ranks off one int64 (PACK)."""
    return num_slots <= 8 and max_rank < 128
