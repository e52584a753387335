"""Align for the fused MoE: the (token, expert) pairs sorted by expert, each expert's group padded
to BM rows, so every BM-row block of the grouped GEMMs uses one expert.

Semantics: sorted_pair = the pair indices, stably sorted by expert, each expert's run padded with
-1 to a multiple of BM rows, then -1 up to NB*BM; expert_of_block[b] = the expert of rows
b*BM..b*BM+BM-1, -1 past the used blocks (align_reference is the torch statement of it).

Algorithm. Buffers are sized from P = T*K, E and BM only, and nothing syncs with the host, so
the launches are capturable in a CUDA graph. Up to PMAX pairs (every decode batch), the align is
one launch of NA programs that never talk to each other: each loads all P expert ids at once,
histograms them into per-expert counts and turns those into each expert's first row (a cumsum
of ceil(count / BM) * BM). Then program a
  - places its PCH pairs: row = expert's first row + pairs of that expert in earlier programs
    (a histogram of ids[:a*PCH]) + those earlier in its own chunk (a [PCH, PCH] compare);
  - writes its RB blocks: the expert of each block (experts that end at or before it) and -1
    in the block's rows past its expert's last pair.
Pair rows and padding rows are disjoint, so the two halves need no ordering.

Past PMAX (prefill) a histogram of all P ids in every program would cost P x NA, so the counts
come from a launch before: align_count_kernel histograms each chunk of CB pairs into a table
counts [NC, E_PAD]. Program a of the align launch sums that (small) table for every expert's
count and for each expert's pairs in chunks before a, and places chunk a by sorting it on
(expert, pair) keys: a pair's rank among its expert's pairs of the chunk is its place in the
sorted chunk less the chunk's pairs of smaller experts, and pairs of one expert keep their
order. Blocks are written as above. When the MoE has LoRA, programs from NA on of the align
launch do each pair's gate_up shrink (moe_lora.pair_shrink, SPLITS jobs a pair), so that costs
no launch of its own.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from moelora.kernels.moe.lora import pair_shrink
from moelora.kernels.pdl import pdl_kwargs, pdl_wait
from moelora.kernels.sizes import cdiv, next_power_of_2

# Largest P aligned in one launch: every program holds all P ids in registers.
PMAX = 4096
# Past PMAX: chunks of CB pairs, a power of two from CHUNK_MIN to CHUNK_MAX (each CB is a compile
# of its own), so that the chunks number at most the count table's rows a program loads at once.
CHUNK_MIN, CHUNK_MAX = 256, 1024
COUNT_TILE = 16384  # elements of the [NT, E_PAD] tile of counts an align program loads at once


@triton.jit
def _align_parallel(
    a,
    topk_ids_ptr,
    sorted_pair_ptr,
    expert_of_block_ptr,
    P,
    E,
    NB,
    BM: tl.constexpr,
    E_PAD: tl.constexpr,
    P_PAD: tl.constexpr,
    PCH: tl.constexpr,
    RB: tl.constexpr,
):
    """Align program a of NA: pairs a*PCH.. and blocks a*RB.. (see the module docstring)."""
    # -- every program: counts and first row of each expert, from all P ids --
    offs_p = tl.arange(0, P_PAD)
    ids_all = tl.load(topk_ids_ptr + offs_p, mask=offs_p < P, other=0)
    counts = tl.histogram(ids_all, E_PAD, mask=offs_p < P)
    blocks = (counts + BM - 1) // BM
    blocks_end = tl.cumsum(blocks, axis=0)
    row_start = (blocks_end - blocks) * BM

    # -- pairs p0..p0+PCH-1: expert's first row + rank among the expert's pairs --
    p0 = a * PCH
    if p0 < P:
        before = tl.histogram(ids_all, E_PAD, mask=offs_p < p0)  # same expert, earlier chunks
        offs_c = p0 + tl.arange(0, PCH)
        c_ok = offs_c < P
        ids = tl.load(topk_ids_ptr + offs_c, mask=c_ok, other=0)
        first = tl.gather(row_start + before, ids, 0)
        earlier = (ids[:, None] == ids[None, :]) & (offs_c[None, :] < offs_c[:, None])
        rank = tl.sum(earlier.to(tl.int32), axis=1)  # same expert, earlier in this chunk
        tl.store(sorted_pair_ptr + first + rank, offs_c, mask=c_ok)

    _write_blocks(
        b0=a * RB,
        sorted_pair_ptr=sorted_pair_ptr,
        expert_of_block_ptr=expert_of_block_ptr,
        counts=counts,
        blocks_end=blocks_end,
        row_start=row_start,
        E=E,
        NB=NB,
        BM=BM,
        E_PAD=E_PAD,
        RB=RB,
    )


@triton.jit
def _write_blocks(
    b0,
    sorted_pair_ptr,
    expert_of_block_ptr,
    counts,  # [E_PAD] pairs of each expert
    blocks_end,  # [E_PAD] cumsum of each expert's blocks
    row_start,  # [E_PAD] each expert's first row
    E,
    NB,
    BM: tl.constexpr,
    E_PAD: tl.constexpr,
    RB: tl.constexpr,
):
    """Blocks b0..b0+RB-1: their expert, and -1 in rows past the expert's last pair."""
    if b0 < NB:
        offs_e = tl.arange(0, E_PAD)
        b = b0 + tl.arange(0, RB)
        e = tl.sum((blocks_end[None, :] <= b[:, None]).to(tl.int32), axis=1)  # [RB]
        tl.store(expert_of_block_ptr + b, tl.where(e < E, e, -1), mask=b < NB)
        # rows of expert e holding a pair end at row_start + count; past the used blocks no
        # expert matches (or a padded one with count 0 at the end), so the whole block is -1
        pairs_end = tl.sum(tl.where(offs_e[None, :] == e[:, None], row_start + counts, 0), 1)
        rows = b[:, None] * BM + tl.arange(0, BM)[None, :]  # [RB, BM]
        pad = (rows >= pairs_end[:, None]) & (b < NB)[:, None]
        tl.store(sorted_pair_ptr + rows, -1, mask=pad)


@triton.jit(do_not_specialize=["P"])
def align_count_kernel(
    topk_ids_ptr,  # [P] int32
    counts_ptr,  # [NC, E_PAD] int32 out: pairs of each expert in each chunk of CB pairs
    P,
    CB: tl.constexpr,
    E_PAD: tl.constexpr,
    PDL: tl.constexpr,
):
    """The chunked align's first launch: program c histograms pairs c*CB..c*CB+CB-1."""
    pdl_wait(PDL)  # first: see kernels/pdl.py
    c = tl.program_id(0)
    offs = c * CB + tl.arange(0, CB)
    ids = tl.load(topk_ids_ptr + offs, mask=offs < P, other=0)
    counts = tl.histogram(ids, E_PAD, mask=offs < P)
    tl.store(counts_ptr + c * E_PAD + tl.arange(0, E_PAD), counts)


@triton.jit
def _align_chunked(
    a,
    topk_ids_ptr,
    counts_ptr,
    sorted_pair_ptr,
    expert_of_block_ptr,
    P,
    E,
    NB,
    NC,
    BM: tl.constexpr,
    E_PAD: tl.constexpr,
    CB: tl.constexpr,
    NT: tl.constexpr,
    RB: tl.constexpr,
):
    """Align program a of NA past PMAX: chunk a of CB pairs and blocks a*RB.. (see the module
    docstring), from align_count_kernel's table counts [NC, E_PAD]."""
    # -- every expert's pairs, those in chunks before a, and chunk a's own: sums of the table --
    offs_e = tl.arange(0, E_PAD)
    counts = tl.zeros((E_PAD,), dtype=tl.int32)
    before = tl.zeros((E_PAD,), dtype=tl.int32)
    mine = tl.zeros((E_PAD,), dtype=tl.int32)
    for r0 in range(0, NC, NT):
        rows = r0 + tl.arange(0, NT)
        tile = tl.load(
            counts_ptr + rows[:, None] * E_PAD + offs_e[None, :], mask=(rows < NC)[:, None], other=0
        )
        counts += tl.sum(tile, axis=0)
        before += tl.sum(tl.where((rows < a)[:, None], tile, 0), axis=0)
        mine += tl.sum(tl.where((rows == a)[:, None], tile, 0), axis=0)
    blocks = (counts + BM - 1) // BM
    blocks_end = tl.cumsum(blocks, axis=0)
    row_start = (blocks_end - blocks) * BM

    # -- chunk a, sorted on (expert, pair): its i-th pair goes to its expert's first row + the
    #    expert's pairs in earlier chunks + i - the chunk's pairs of smaller experts; the pair in
    #    the key keeps one expert's pairs in pair order (stable) --
    if a < NC:
        offs_c = tl.arange(0, CB)
        p_ok = a * CB + offs_c < P
        # past P: expert E_PAD, above every real one, so those sort last and are not stored
        ids = tl.load(topk_ids_ptr + a * CB + offs_c, mask=p_ok, other=E_PAD)
        key = tl.sort(ids * CB + offs_c)
        expert = key // CB
        smaller = tl.cumsum(mine, axis=0) - mine
        first = tl.gather(row_start + before - smaller, tl.minimum(expert, E_PAD - 1), 0)
        tl.store(sorted_pair_ptr + first + offs_c, a * CB + key % CB, mask=expert < E_PAD)

    _write_blocks(
        b0=a * RB,
        sorted_pair_ptr=sorted_pair_ptr,
        expert_of_block_ptr=expert_of_block_ptr,
        counts=counts,
        blocks_end=blocks_end,
        row_start=row_start,
        E=E,
        NB=NB,
        BM=BM,
        E_PAD=E_PAD,
        RB=RB,
    )


# Sizes that change with the batch are not specialized on (divisibility by 16): each graph
# batch size would otherwise compile its own variant, and capture pays for every compile.
@triton.jit(do_not_specialize=["P", "NB", "NC", "NA", "NS"])
def align_kernel(
    # Pointers.
    topk_ids_ptr,  # [P] int32, P = T*K pairs, pair p = (token p // K, choice p % K)
    sorted_pair_ptr,  # [NB*BM] int32 out: pair of each row, -1 for padding rows
    expert_of_block_ptr,  # [NB] int32 out: expert of each block, -1 for unused blocks
    counts_ptr,  # [NC, E_PAD] int32: align_count_kernel's table past PMAX (unused up to PMAX)
    # Pointers of the LoRA shrink programs (pid >= NA), see moe_lora.pair_shrink.
    x_ptr,
    slot_ptr,
    enabled_ptr,
    lora13_ptr,  # the arena holding A13
    tab13_ptr,  # A13's table (step/lora.LoraWeights.table)
    xa13_ptr,
    xa2_ptr,
    any_ptr,  # [1] int32: whether any slot is enabled this step
    # Sizes: pairs, experts, blocks (an upper bound on the blocks used), chunks (past PMAX),
    # hidden, align programs, shrink programs.
    P,
    E,
    NB,
    NC,
    H,
    NA,
    NS,
    # Strides.
    stride_xt,
    # Meta-parameters: LoRA shrink, then align (align_plan picks CHUNKED and the tiles).
    K: tl.constexpr,
    HAS13: tl.constexpr,
    HAS2: tl.constexpr,
    BR: tl.constexpr,
    BKS: tl.constexpr,
    SPLITS: tl.constexpr,
    A13_ALIGN: tl.constexpr,
    BM: tl.constexpr,
    E_PAD: tl.constexpr,
    CHUNKED: tl.constexpr,  # past PMAX: counts from align_count_kernel, chunks of CB pairs
    P_PAD: tl.constexpr,
    PCH: tl.constexpr,
    CB: tl.constexpr,
    NT: tl.constexpr,
    RB: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_wait(PDL)  # first: see kernels/pdl.py
    pid = tl.program_id(0)
    if pid >= NA:
        # the gate_up LoRA shrink: SPLITS jobs a pair, walked by the NS programs from NA on
        # (a job's sums do not depend on which program runs it); a step without an enabled
        # slot costs each program one load
        if tl.load(any_ptr) != 0:
            for job in range(pid - NA, P * SPLITS, NS):
                pair_shrink(
                    job=job,
                    K=K,
                    topk_ids_ptr=topk_ids_ptr,
                    x_ptr=x_ptr,
                    stride_xt=stride_xt,
                    H=H,
                    slot_ptr=slot_ptr,
                    enabled_ptr=enabled_ptr,
                    w_ptr=lora13_ptr,
                    tab_ptr=tab13_ptr,
                    xa13_ptr=xa13_ptr,
                    xa2_ptr=xa2_ptr,
                    HAS13=HAS13,
                    HAS2=HAS2,
                    BR=BR,
                    BKS=BKS,
                    SPLITS=SPLITS,
                    A_ALIGN=A13_ALIGN,
                )
    elif CHUNKED:
        _align_chunked(
            a=pid,
            topk_ids_ptr=topk_ids_ptr,
            counts_ptr=counts_ptr,
            sorted_pair_ptr=sorted_pair_ptr,
            expert_of_block_ptr=expert_of_block_ptr,
            P=P,
            E=E,
            NB=NB,
            NC=NC,
            BM=BM,
            E_PAD=E_PAD,
            CB=CB,
            NT=NT,
            RB=RB,
        )
    else:
        _align_parallel(
            a=pid,
            topk_ids_ptr=topk_ids_ptr,
            sorted_pair_ptr=sorted_pair_ptr,
            expert_of_block_ptr=expert_of_block_ptr,
            P=P,
            E=E,
            NB=NB,
            BM=BM,
            E_PAD=E_PAD,
            P_PAD=P_PAD,
            PCH=PCH,
            RB=RB,
        )


def align_plan(P: int, NB: int, *, E: int, BM: int, pmax: int = PMAX) -> tuple[int, dict]:
    """(NA, meta-parameters) of the align programs for P pairs and NB blocks: NA depends on P,
    NB (so on P, E, BM) only, never on the ids, so a graph replay launches the same grid. Past
    pmax, meta's CB is the chunk of align_count_kernel's cdiv(P, CB) programs."""
    if P > pmax:
        return _chunked_plan(P, NB, E=E, BM=BM)
    # narrow programs up to 1024 pairs; past that every program's histogram of all P ids
    # dominates, so fewer, wider ones
    small = P <= 1024
    PCH, RB = (16, 2) if small else (32, 4)
    NA = max(cdiv(P, PCH), cdiv(NB, RB))
    # the histogram's width: at least a warp's lanes, in powers of 4 (not 2): each width is a
    # compile of its own, and a cold graph capture pays for every one
    P_PAD = max(64, 4 ** math.ceil(math.log(P, 4) - 1e-9))
    meta = dict(CHUNKED=False, P_PAD=P_PAD, PCH=PCH, CB=1, NT=1, RB=RB)
    return NA, meta | dict(num_warps=4 if small else 8)


def _chunked_plan(P: int, NB: int, *, E: int, BM: int) -> tuple[int, dict]:
    """Chunks of CB pairs, as few as NT (one load of the count table) while CB <= CHUNK_MAX;
    RB blocks a program, about a chunk's rows (at least 4), so the block writers add few
    programs to the chunks'."""
    NT = min(128, COUNT_TILE // next_power_of_2(E))
    CB = min(max(next_power_of_2(cdiv(P, NT)), CHUNK_MIN), CHUNK_MAX)
    RB = max(4, CB // BM)
    NA = max(cdiv(P, CB), cdiv(NB, RB))
    return NA, dict(CHUNKED=True, P_PAD=1, PCH=1, CB=CB, NT=NT, RB=RB, num_warps=8)


def count_table(ids: torch.Tensor, *, E: int, CB: int) -> torch.Tensor:
    """align_count_kernel over ids [P] (int32, contiguous): counts [cdiv(P, CB), E_PAD] int32,
    the pairs of each expert in each chunk of CB pairs. No host sync."""
    E_PAD = next_power_of_2(E)
    NC = cdiv(ids.numel(), CB)
    counts = torch.empty(NC, E_PAD, dtype=torch.int32, device=ids.device)
    align_count_kernel[(NC,)](
        topk_ids_ptr=ids,
        counts_ptr=counts,
        P=ids.numel(),
        CB=CB,
        E_PAD=E_PAD,
        num_warps=4,
        **pdl_kwargs(ids.device),
    )
    return counts


@dataclass(frozen=True)
class PairShrink:
    """The LoRA programs of the align launch (moe_lora.pair_shrink): `programs` of them, after
    the align's own, walk `splits` jobs a pair: xa13[pair] = x[token] @ A13[s, e].T, and
    xa2[pair] zeroed for gate_up's partial down shrinks. The default, PairShrink(), is the align
    alone: no such program runs, and launch_align passes one placeholder for each pointer left
    None (never read)."""

    x: torch.Tensor | None = None  # [T, H], last dim contiguous
    slot: torch.Tensor | None = None  # LoraBatchInfo.slot_of_token
    enabled: torch.Tensor | None = None  # .slot_enabled
    any_on: torch.Tensor | None = None  # .any_enabled
    arena13: torch.Tensor | None = None  # LoraWeights.arena of gate_up's A13 [(E | 1,) 2, r, H]
    table13: torch.Tensor | None = None  # ... and its table [S, TABLE_WIDTH] int64
    xa13: torch.Tensor | None = None  # [P, 2, BR] fp32 out
    xa2: torch.Tensor | None = None  # [P, BR] fp32 out
    K: int = 1
    has13: bool = False
    has2: bool = False
    BR: int = 16
    BKS: int = 16
    splits: int = 1
    a13_align: int = 1  # gate_up's LoraWeights.a_align
    programs: int = 0  # NS
    num_warps: int = 0  # the launch runs at least this many warps when programs > 0

    def pointers(self, unused: torch.Tensor) -> dict[str, torch.Tensor]:
        """align_kernel's LoRA pointers, `unused` for each one left None. It must be int32: the
        LoRA branch's slot and flag loads are compiled even when no program runs it."""
        named = dict(
            x_ptr=self.x,
            slot_ptr=self.slot,
            enabled_ptr=self.enabled,
            lora13_ptr=self.arena13,
            tab13_ptr=self.table13,
            xa13_ptr=self.xa13,
            xa2_ptr=self.xa2,
            any_ptr=self.any_on,
        )
        return {name: unused if ptr is None else ptr for name, ptr in named.items()}


def launch_align(
    ids: torch.Tensor,
    sorted_pair: torch.Tensor,
    expert_of_block: torch.Tensor,
    *,
    E: int,
    BM: int,
    shrink: PairShrink,
    pmax: int | None = None,
) -> None:
    """align_kernel over ids [P] (int32, contiguous) into sorted_pair [NB*BM] and
    expert_of_block [NB]: NA programs align, shrink.programs more shrink; past pmax (PMAX when
    None) align_count_kernel runs first. No host sync."""
    P, NB = ids.numel(), expert_of_block.numel()
    NA, meta = align_plan(P, NB, E=E, BM=BM, pmax=PMAX if pmax is None else pmax)
    counts = count_table(ids, E=E, CB=meta["CB"]) if meta["CHUNKED"] else ids
    if shrink.programs:
        meta["num_warps"] = max(meta["num_warps"], shrink.num_warps)
    align_kernel[(NA + shrink.programs,)](
        topk_ids_ptr=ids,
        sorted_pair_ptr=sorted_pair,
        expert_of_block_ptr=expert_of_block,
        counts_ptr=counts,
        **shrink.pointers(unused=ids),
        P=P,
        E=E,
        NB=NB,
        NC=counts.shape[0] if meta["CHUNKED"] else 1,
        H=0 if shrink.x is None else shrink.x.shape[1],
        NA=NA,
        NS=max(shrink.programs, 1),
        stride_xt=0 if shrink.x is None else shrink.x.stride(0),
        K=shrink.K,
        HAS13=shrink.has13,
        HAS2=shrink.has2,
        BR=shrink.BR,
        BKS=shrink.BKS,
        SPLITS=shrink.splits,
        A13_ALIGN=shrink.a13_align,
        BM=BM,
        E_PAD=next_power_of_2(E),
        **meta,
        **pdl_kwargs(ids.device),
    )


def num_blocks(P: int, E: int, BM: int) -> int:
    """Upper bound on the BM-row blocks used: every expert with a pair wastes < BM rows."""
    return min(P, cdiv(P + min(E, P) * (BM - 1), BM))


def moe_align(
    topk_ids: torch.Tensor, E: int, BM: int, *, pmax: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Semantics: see the module docstring. topk_ids [T, K] int32, ids in [0, E); past pmax
    (PMAX when None) pairs, the chunked path.

    Returns sorted_pair [NB*BM] int32 and expert_of_block [NB] int32, NB = num_blocks(T*K, E, BM).
    fused_moe's launch adds its LoRA shrink programs (PairShrink); this is the align alone.
    """
    assert topk_ids.dtype == torch.int32, topk_ids.dtype
    ids = topk_ids.contiguous().view(-1)
    P = ids.numel()
    NB = num_blocks(P, E, BM)
    sorted_pair = torch.empty(NB * BM, dtype=torch.int32, device=ids.device)
    expert_of_block = torch.empty(NB, dtype=torch.int32, device=ids.device)
    if P == 0:
        return sorted_pair, expert_of_block
    launch_align(ids, sorted_pair, expert_of_block, E=E, BM=BM, shrink=PairShrink(), pmax=pmax)
    return sorted_pair, expert_of_block


def align_reference(
    topk_ids: torch.Tensor, E: int, BM: int, NB: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The align in torch: a stable sort of the pairs by expert, each expert's run padded."""
    ids = topk_ids.reshape(-1).long()
    counts = torch.bincount(ids, minlength=E)
    blocks = (counts + BM - 1) // BM
    order = torch.sort(ids, stable=True).indices
    expert = ids[order]
    rank = torch.arange(ids.numel(), device=ids.device) - (torch.cumsum(counts, 0) - counts)[expert]
    row_start = (torch.cumsum(blocks, 0) - blocks) * BM
    sorted_pair = torch.full((NB * BM,), -1, dtype=torch.int32, device=ids.device)
    sorted_pair[row_start[expert] + rank] = order.to(torch.int32)
    expert_of_block = torch.full((NB,), -1, dtype=torch.int32, device=ids.device)
    used = int(blocks.sum())
    expert_of_block[:used] = torch.repeat_interleave(torch.arange(E, device=ids.device), blocks)
    return sorted_pair, expert_of_block
