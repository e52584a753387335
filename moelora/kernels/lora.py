"""Multi-LoRA in one launch: dense `add_lora_`; the split shrink the folded attention LoRA uses
(`lora_shrink_split`); and the per-row gathers of a row's adapter.

Semantics: y[t, slice_i] += scaling[s] * (x[t] @ A[s, i].T) @ B[s, slice_i].T, s = slot[t].

Algorithm (add_lora_, the dense layers). A program owns a tile of 16 tokens and a group of
64 to 256 columns of one slice. It shrinks its rows against the A of several slots at once:
the slots go SG at a time (SG * rank tile <= 64 columns), one dot per input tile for the whole
group, so the serial chain does not grow with each adapter the tile mixes. Each row then keeps
its own slot's columns of the shrink, and one dot per 64 columns expands them. Slots no row of
the tile uses, and rows of A or B past a slot's real rank, are masked off, so they are never
read: a rank-8 adapter in a rank-64 pool reads 8 rows.

Decode steps (up to 256 tokens) fold the attention's LoRA into the norms and rotary instead of
add_lora_ (layers/attention_lora.py says what is folded where): there a program owns a row,
gets its adapter with `lora_row` / `lora_slot`, and the o projection's shrink is
`lora_shrink_split`, KS programs per row over slices of the input, summed by the norm that
expands it (a split decode computes it in the attention's combine instead:
paged_attention_o_shrink).

What keeps the path free when no adapter is active: the slot of each row and the slot's
enabled flag are gathered first (`active_slots`); a tile whose rows have no enabled slot skips
everything else.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from moelora.kernels.dot import dot
from moelora.kernels.pdl import pdl_kwargs, pdl_wait
from moelora.kernels.sizes import cdiv, next_power_of_2
from moelora.step.lora import (
    A_EXPERT,
    A_OFF,
    A_SLICE,
    B_EXPERT,
    B_OFF,
    B_ROW,
    RANK,
    TABLE_WIDTH,
    LoraBatchInfo,
    LoraWeights,
)

# the table's columns, as the kernels name them (module-level ints are constants to Triton)
TAB_A_OFF, TAB_A_SLICE, TAB_B_OFF = tl.constexpr(A_OFF), tl.constexpr(A_SLICE), tl.constexpr(B_OFF)
TAB_B_ROW, TAB_RANK = tl.constexpr(B_ROW), tl.constexpr(RANK)
TAB_A_EXPERT, TAB_B_EXPERT = tl.constexpr(A_EXPERT), tl.constexpr(B_EXPERT)
TAB_WIDTH = tl.constexpr(TABLE_WIDTH)


@triton.jit
def aligned(offset, ALIGN: tl.constexpr):
    """offset (loaded from a LoRA table), shown to be a multiple of ALIGN (LoraWeights.a_align):
    what the compiler cannot see in a loaded value, and needs to vectorize and pipeline the
    loads that start there. Rounding down leaves the value as it is (the invariant holds); a
    product by a constant is what the alignment analysis reads, where tl.multiple_of on a
    value returned from a jit function is lost."""
    return offset // ALIGN * ALIGN


@triton.jit
def lora_row(slot_ptr, enabled_ptr, rank_ptr, scaling_ptr, row):
    """(slot, rank, scaling) of the row's adapter; rank 0 when the row has none enabled. Two
    dependent loads: the slot, then its flag, rank and scaling together."""
    return lora_slot(tl.load(slot_ptr + row), enabled_ptr, rank_ptr, scaling_ptr)


@triton.jit
def lora_slot(slot, enabled_ptr, rank_ptr, scaling_ptr):
    """lora_row for a slot already loaded (kernels ask for it first, their rows next, then
    this: the dependent gather then overlaps the rows' loads)."""
    slot_c = tl.maximum(slot, 0)
    on = tl.load(enabled_ptr + slot_c, mask=slot >= 0, other=0) != 0
    rank = tl.load(rank_ptr + slot_c, mask=slot >= 0, other=0)
    return slot_c.to(tl.int64), tl.where(on, rank, 0), tl.load(scaling_ptr + slot_c)


@triton.jit
def module_slots(slot_ptr, enabled_ptr, tab_ptr, tokens, ok, TW: tl.constexpr):
    """Each row's slot where it is enabled and its adapter has the module's factors (its rank
    in the module's table above 0), else -1: rows of the given tokens, `ok` masking them."""
    slot = tl.load(slot_ptr + tokens, mask=ok, other=-1)
    safe = tl.maximum(slot, 0).to(tl.int64)
    # the flag and the rank both loaded on the slot alone (a table row exists for every slot):
    # one round trip after the slot's, not two in a row
    on = tl.load(enabled_ptr + safe, mask=slot >= 0, other=0) != 0
    rank = tl.load(tab_ptr + safe * TW + TAB_RANK, mask=slot >= 0, other=0)
    return tl.where(on & (rank > 0), slot, -1)


@triton.jit
def _lora_shrink_kernel(
    x_ptr,  # [T, K_in], row stride stride_xt
    w_ptr,  # the arena: slot s's A [NS, r, K_in] where row s of the table says
    tab_ptr,  # [S, TW] int64 (step/lora.LoraWeights.table)
    part_ptr,  # [T, KS, NS, R] float32 out, written for rows with an enabled slot only
    slot_ptr,
    enabled_ptr,
    rank_ptr,
    scaling_ptr,
    K_in,
    stride_xt,
    TW: tl.constexpr,
    NS: tl.constexpr,
    R: tl.constexpr,
    RP: tl.constexpr,
    BK: tl.constexpr,
    A_ALIGN: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_wait(PDL)  # first: see kernels/pdl.py
    # -- one row, one BK-wide slice of its input; rows without an adapter leave at once --
    row = tl.program_id(0).to(tl.int64)
    ks = tl.program_id(1)
    slot, rank, scaling = lora_row(slot_ptr, enabled_ptr, rank_ptr, scaling_ptr, row)
    if rank == 0:
        return
    # the module's own rank and place; rank 0 (the slot's adapter has no such module) still
    # writes its rows, zeros: readers check only the slot
    rank = tl.load(tab_ptr + slot * TW + TAB_RANK)
    a_slot = w_ptr + aligned(tl.load(tab_ptr + slot * TW + TAB_A_OFF), A_ALIGN)
    a_slice = aligned(tl.load(tab_ptr + slot * TW + TAB_A_SLICE), A_ALIGN)
    offs_k = ks * BK + tl.arange(0, BK)
    k_ok = offs_k < K_in
    offs_r = tl.arange(0, RP)
    r_ok = offs_r < rank
    x = tl.load(x_ptr + row * stride_xt + offs_k, mask=k_ok, other=0.0).to(tl.float32)
    for i in tl.static_range(NS):
        a = tl.load(
            a_slot + i * a_slice + offs_r[:, None] * K_in + offs_k[None, :],
            mask=r_ok[:, None] & k_ok[None, :],
            other=0.0,
        )  # [RP, BK]
        part = tl.sum(a.to(tl.float32) * x[None, :], axis=1) * scaling
        dst = part_ptr + ((row * tl.num_programs(1) + ks) * NS + i) * R + offs_r
        tl.store(dst, part, mask=offs_r < R)  # zeros past the rank: whole rows


def lora_shrink_split(x: torch.Tensor, lora: LoraWeights, info: LoraBatchInfo) -> torch.Tensor:
    """Semantics: see reference.lora_shrink_split: reference.lora_shrink in KS partial sums,
    summed by the reader; part[t, j] is row t's shrink over input columns j*BK .. (j+1)*BK.

    x [T, in] (last dim contiguous); lora's A read through its table. Returns [T, KS, n, R]
    float32; rows whose token has no enabled slot are left unwritten (readers check the slot).

    Why split: a row's whole A (128 KB for a rank-16 o_proj of 4096 inputs) read by one
    program is bound by that program's load latency; KS programs each read one slice at once.
    """
    T, K_in = x.shape
    n, R = len(lora.out_slices), lora.max_rank
    assert lora.num_experts == 0 and lora.in_features == K_in, (lora.in_features, x.shape)
    assert x.stride(-1) == 1 and lora.table.is_contiguous(), (x.stride(), lora.table.stride())
    assert info.slot_of_token.shape[0] >= T, (info.slot_of_token.shape, T)
    RP = next_power_of_2(R)
    BK = min(max(8192 // RP, 16), next_power_of_2(K_in))  # [RP, BK]: 64 values a lane
    KS = cdiv(K_in, BK)
    part = torch.empty(T, KS, n, R, dtype=torch.float32, device=x.device)
    if T == 0:
        return part
    _lora_shrink_kernel[(T, KS)](
        x_ptr=x,
        w_ptr=lora.arena,
        tab_ptr=lora.table,
        part_ptr=part,
        slot_ptr=info.slot_of_token,
        enabled_ptr=info.slot_enabled,
        rank_ptr=info.rank_of_slot,
        scaling_ptr=info.scaling_of_slot,
        K_in=K_in,
        stride_xt=x.stride(0),
        TW=TABLE_WIDTH,
        NS=n,
        R=R,
        RP=RP,
        BK=BK,
        A_ALIGN=lora.a_align,
        num_warps=4,
        **pdl_kwargs(x.device),
    )
    return part


@triton.jit
def active_slots(slot_ptr, token_rows, row_ok, enabled_ptr):
    """[BM] slot of each row, or -1 where the row is padding, on the base model or disabled.
    (The grouped MoE GEMMs split this: slots before their main loop, flags after it, in
    moe_lora.lora_rows, so the dependent gather does not hold back the loop's first loads.)"""
    slot = tl.load(slot_ptr + token_rows, mask=row_ok, other=-1)
    on = tl.load(enabled_ptr + tl.maximum(slot, 0), mask=slot >= 0, other=0)
    return tl.where(on != 0, slot, -1)


# one compile for every batch size (graph capture) and every group of slices
@triton.jit(do_not_specialize=["T", "SLICE0", "ROW0"])
def _add_lora_kernel(
    # Pointers.
    y_ptr,  # [T, out], updated in place
    x_ptr,  # [T, in]
    w_ptr,  # the arena: slot s's A [n, r, in] and B [out, r] where row s of the table says
    tab_ptr,  # [S, TW] int64 (step/lora.LoraWeights.table): places, strides, the module's rank
    slot_ptr,  # [T] int32
    enabled_ptr,  # [S] int32
    scaling_ptr,  # [S] float32
    # Sizes: tokens, input features, and the output slices (size 0 when absent).
    T,
    K_in,
    N0,
    N1,
    N2,
    N3,
    # Where this launch's group of slices starts among the module's: its first slice's index
    # in A, and its first row of B (y_ptr points at that column of the output).
    SLICE0,
    ROW0,
    # Strides (last dims contiguous).
    stride_yt,
    stride_xt,
    # Meta-parameters: S slots taken SG at a time (with GROUP_GRID one group a program, the
    # group program_id(2), else all in turn); a program expands CW columns, BN at a time.
    TW: tl.constexpr,
    S: tl.constexpr,
    S_PAD: tl.constexpr,
    SG: tl.constexpr,
    GROUP_GRID: tl.constexpr,
    BT: tl.constexpr,
    CW: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    BR: tl.constexpr,
    A_ALIGN: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_wait(PDL)  # first: see kernels/pdl.py
    # -- map program ids to a token tile and to (slice, group of CW columns) --
    pid_t = tl.program_id(0)
    pid_c = tl.program_id(1)
    offs_t = pid_t * BT + tl.arange(0, BT)
    t_ok = offs_t < T
    # A step with no enabled slot (a base-only batch) exits after one load of the S flags
    # instead of two dependent gathers (the rows' slots, then their flags): this launch runs
    # in every decode graph, so its empty path is what base requests pay.
    offs_s = tl.arange(0, S_PAD)
    any_on = tl.max(tl.load(enabled_ptr + offs_s, mask=offs_s < S, other=0), axis=0)
    if any_on == 0:
        return
    slot_rows = active_slots(slot_ptr, offs_t, t_ok, enabled_ptr)
    # tokens on the base model, padding and disabled slots: nothing to do
    if tl.max(slot_rows, axis=0) < 0:
        return
    groups0 = tl.cdiv(N0, CW)
    groups1 = tl.cdiv(N1, CW)
    groups2 = tl.cdiv(N2, CW)
    in_1 = pid_c >= groups0
    in_2 = pid_c >= groups0 + groups1
    in_3 = pid_c >= groups0 + groups1 + groups2
    slice_i = in_1.to(tl.int32) + in_2.to(tl.int32) + in_3.to(tl.int32)
    slice_start = tl.where(in_1, N0, 0) + tl.where(in_2, N1, 0) + tl.where(in_3, N2, 0)
    slice_size = tl.where(in_3, N3, tl.where(in_2, N2, tl.where(in_1, N1, N0)))
    skipped = tl.where(in_1, groups0, 0) + tl.where(in_2, groups1, 0) + tl.where(in_3, groups2, 0)
    col0 = (pid_c - skipped) * CW

    # Column j of the shrink is rank row j % BR of slot s0 + j // BR: the SG slots of a group
    # shrink in one dot per input tile, so the serial chain is K_in / BK steps however many
    # adapters the tile mixes. Rows of A past a slot's rank and slots no row of the tile uses
    # are masked, so they are never read.
    offs_j = tl.arange(0, SG * BR)
    offs_k = tl.arange(0, BK)
    x_rows = offs_t.to(tl.int64) * stride_xt
    # a row has one slot, so the programs of different groups write different rows
    s_first = tl.program_id(2) * SG if GROUP_GRID else 0
    s_end = s_first + SG if GROUP_GRID else S
    for s0 in range(s_first, s_end, SG):
        j_slot = s0 + offs_j // BR
        j_r = offs_j % BR
        mine = slot_rows[:, None] == j_slot[None, :]  # [BT, SG*BR]
        used = tl.max(mine.to(tl.int32), axis=0)
        if tl.max(used, axis=0) > 0:
            # each column's slot row of the table: the module's rank (0: none) and places
            tab_j = tab_ptr + j_slot.to(tl.int64) * TW
            s_ok = j_slot < S
            j_ok = (used > 0) & (j_r < tl.load(tab_j + TAB_RANK, mask=s_ok, other=0))
            rows_g = (slot_rows >= s0) & (slot_rows < s0 + SG)
            # -- shrink: x[rows] @ A[slots of the group].T, [BT, SG*BR] --
            a_j = w_ptr + aligned(tl.load(tab_j + TAB_A_OFF, mask=s_ok, other=0), A_ALIGN)
            a_slice = aligned(tl.load(tab_j + TAB_A_SLICE, mask=s_ok, other=0), A_ALIGN)
            a_j += (SLICE0 + slice_i) * a_slice + j_r * K_in
            xa = tl.zeros((BT, SG * BR), dtype=tl.float32)
            for k0 in range(0, K_in, BK):
                k_ok = offs_k < K_in - k0
                xt = tl.load(
                    x_ptr + x_rows[:, None] + (k0 + offs_k)[None, :],
                    mask=rows_g[:, None] & k_ok[None, :],
                    other=0.0,
                )
                at = tl.load(
                    a_j[None, :] + (k0 + offs_k)[:, None],
                    mask=j_ok[None, :] & k_ok[:, None],
                    other=0.0,
                )
                xa = dot(xt, at, xa)
            # -- each row keeps its own slot's columns, scaled; then expand CW columns --
            scale_j = tl.load(scaling_ptr + j_slot, mask=j_slot < S, other=0.0)
            xs = tl.where(mine, xa * scale_j[None, :], 0.0).to(w_ptr.dtype.element_ty)
            b_j = w_ptr + tl.load(tab_j + TAB_B_OFF, mask=s_ok, other=0) + j_r
            b_row = tl.load(tab_j + TAB_B_ROW, mask=s_ok, other=0)
            for c0 in range(0, CW, BN):
                offs_c = col0 + c0 + tl.arange(0, BN)
                n_ok = offs_c < slice_size
                offs_n = slice_start + offs_c
                bt = tl.load(
                    b_j[:, None] + (ROW0 + offs_n)[None, :].to(tl.int64) * b_row[:, None],
                    mask=j_ok[:, None] & n_ok[None, :],
                    other=0.0,
                )  # [SG*BR, BN]
                delta = dot(xs, bt, tl.zeros((BT, BN), dtype=tl.float32))
                y_ptrs = y_ptr + offs_t[:, None].to(tl.int64) * stride_yt + offs_n[None, :]
                mask = rows_g[:, None] & n_ok[None, :]
                y = tl.load(y_ptrs, mask=mask, other=0.0)
                tl.store(y_ptrs, (y.to(tl.float32) + delta).to(y.dtype), mask=mask)


PREFILL_ROWS = 256  # past this many rows (no decode graph is larger) add_lora_ takes prefill tiles
SLICES_A_LAUNCH = 4  # the kernel's N0..N3: Qwen3.5's in_proj (q|k|v, z, b, a) in one launch


def rank_block(max_rank: int) -> int:
    """The rank tile: a power of two, at least 16 (the smallest tl.dot side)."""
    return max(16, next_power_of_2(max_rank))


@functools.cache
def multiprocessors(device: torch.device) -> int:
    """The device's multiprocessors (0 off CUDA): add_lora_tiles sizes its grid by them."""
    if device.type != "cuda":
        return 0
    return torch.cuda.get_device_properties(device).multi_processor_count


def add_lora_tiles(T: int, S: int, R: int, sizes: Sequence[int], sms: int = 0) -> dict[str, int]:
    """_add_lora_kernel's meta-parameters for T rows, S slots of rank R, output slices `sizes`,
    on a device of sms multiprocessors (0: unknown).

    A program's chain is (in / BK) shrink steps then (CW / BN) expand steps, each waiting on a
    load's latency, so both stay short: the slots go SG at a time in a 64-column group with
    256-deep tiles, and programs expand few columns when few row tiles share the work (more
    programs, each shrinking again from L2)."""
    BN, BR = 64, rank_block(R)
    SG = max(1, min(next_power_of_2(S), 64 // BR))
    widest = BN * cdiv(max(sizes), BN)
    if T > PREFILL_ROWS:
        # prefill: every program shrinks its rows again, so at 16 rows x 256 columns a
        # 4096-token q|k|v reads x 20 times and A 5120 times; 64 rows x 1024 columns read each
        # 16 times fewer. 128-deep input tiles, not 64: fewer steps in each program's chain. A
        # shrink launch then an expand launch over small column groups does not beat this one
        prefill = dict(
            S=S, S_PAD=next_power_of_2(S), SG=SG, GROUP_GRID=False, BT=64, BN=BN, BK=128, BR=BR
        )
        wide = min(1024, widest)
        if sms and cdiv(T, 64) * sum(cdiv(n, wide) for n in sizes) >= 2 * sms:
            # enough programs for two a multiprocessor at 1024 columns: their registers capped
            # at 168 (ptxas spills a few) let three share one, two stages deep; the capped wide
            # tile beats both the uncapped one and 512 columns there
            return prefill | dict(CW=wide, maxnreg=168, num_stages=2)
        # fewer programs (o at 4096 rows: 128 at 1024 columns, under one a multiprocessor):
        # 512 columns, twice the programs, so that every multiprocessor has one
        return prefill | dict(CW=min(512, widest))
    BK = 256 if SG * BR <= 64 else 128
    CW = min(64 if T <= 16 else 128 if T <= 64 else 256, widest)
    # decode: a program per group of slots (GROUP_GRID), where one walking the groups in turn
    # would chain each group's shrink after the last
    return dict(
        S=S, S_PAD=next_power_of_2(S), SG=SG, GROUP_GRID=True, BT=16, CW=CW, BN=BN, BK=BK, BR=BR
    )


def add_lora_(
    y: torch.Tensor,
    x: torch.Tensor,
    lora: LoraWeights,
    info: LoraBatchInfo,
    *,
    tiles: dict[str, int] | None = None,
) -> torch.Tensor:
    """Semantics: y[t, slice_i] += scaling[s] * (x[t] @ A[s, i].T) @ B[s, slice_i].T, s = slot[t].

    y: [T, out], x: [T, in], same dtype, last dims contiguous; lora's factors read through
    its table (any layout it describes), any number of slices. In place (one launch for each
    SLICES_A_LAUNCH slices: every projection's in one); returns y.
    tiles: BT, CW, BK and any launch options (maxnreg, num_stages) in place of
    add_lora_tiles' (benchmarks sweep them; the default's launch options are dropped).
    """
    T, K_in = x.shape
    n, out = len(lora.out_slices), lora.out_features
    assert y.shape == (T, out) and y.dtype == x.dtype, (y.shape, y.dtype, x.shape, x.dtype)
    assert lora.in_features == K_in and lora.num_experts == 0, (lora.in_features, x.shape)
    assert lora.arena.dtype == x.dtype, (lora.arena.dtype, x.dtype)
    assert x.stride(1) == 1 and y.stride(1) == 1 and lora.table.is_contiguous()
    if T == 0:
        return y
    row0 = 0
    for slice0 in range(0, n, SLICES_A_LAUNCH):
        group = list(lora.out_slices[slice0 : slice0 + SLICES_A_LAUNCH])
        sizes = group + [0] * (SLICES_A_LAUNCH - len(group))
        meta = _add_lora_meta(T, lora, info, sizes, x.device, tiles)
        _launch_add_lora(y[:, row0:], x, lora, info, sizes, meta, slice0, row0)
        row0 += sum(group)
    return y


def _add_lora_meta(
    T: int,
    lora: LoraWeights,
    info: LoraBatchInfo,
    sizes: list[int],
    device: torch.device,
    tiles: dict[str, int] | None,
) -> dict[str, int]:
    """_add_lora_kernel's meta-parameters for T rows: add_lora_tiles', with the caller's
    tiles in place of its own where given."""
    S, R = lora.num_slots, lora.max_rank
    # prefill tiles may take the step's rank (LoraBatchInfo.rank_tile): their K blocking does
    # not follow it, and the rank rows it drops are zeros
    tile_rank = info.rank_tile if info.rank_tile and T > PREFILL_ROWS else R
    assert tile_rank <= R, (info.rank_tile, R)
    meta = add_lora_tiles(T, S, tile_rank, sizes, multiprocessors(device))
    if tiles:  # a candidate runs with its own launch options only
        meta = {k: v for k, v in meta.items() if k not in ("maxnreg", "num_stages")} | tiles
    return meta


def _launch_add_lora(
    y: torch.Tensor,
    x: torch.Tensor,
    lora: LoraWeights,
    info: LoraBatchInfo,
    sizes: list[int],
    meta: dict[str, int],
    slice0: int = 0,
    row0: int = 0,
) -> None:
    """One _add_lora_kernel launch for the slices `sizes` (padded to 4 with zeros), the
    module's slices slice0 on, its output rows row0 on (y starts at row0's column)."""
    T, K_in = x.shape
    groups = cdiv(meta["S"], meta["SG"]) if meta["GROUP_GRID"] else 1
    grid = (cdiv(T, meta["BT"]), sum(cdiv(size, meta["CW"]) for size in sizes), groups)
    _add_lora_kernel[grid](
        y_ptr=y,
        x_ptr=x,
        w_ptr=lora.arena,
        tab_ptr=lora.table,
        slot_ptr=info.slot_of_token,
        enabled_ptr=info.slot_enabled,
        scaling_ptr=info.scaling_of_slot,
        T=T,
        K_in=K_in,
        N0=sizes[0],
        N1=sizes[1],
        N2=sizes[2],
        N3=sizes[3],
        SLICE0=slice0,
        ROW0=row0,
        stride_yt=y.stride(0),
        stride_xt=x.stride(0),
        TW=TABLE_WIDTH,
        A_ALIGN=lora.a_align,
        **meta,
        **pdl_kwargs(x.device),
    )
