"""Align for the fused MoE: the (token, expert) pairs sorted by expert, each expert's group padded
to BM rows, so every BM-row block of the grouped GEMMs uses one expert.

Algorithm (one program; buffers sized from T*K, E and BM only, no host sync): count the pairs
of each expert with one-hot sums over chunks of pairs, turn the counts into each expert's first
block (a cumsum of ceil(count / BM)), then place every pair at its expert's first row plus its
rank among the expert's pairs (a cumsum down the one-hot chunk plus the count of earlier
chunks). Padding rows hold -1, unused blocks expert -1. When the MoE has LoRA, programs 1..P
of the same launch do each pair's gate_up shrink (moe_lora.pair_shrink), so that costs no
launch of its own.
"""

from __future__ import annotations

import triton
import triton.language as tl

from moelora.kernels.moe_lora import pair_shrink


@triton.jit
def align_kernel(
    # Pointers.
    topk_ids_ptr,  # [P] int32, P = T*K pairs, pair p = (token p // K, choice p % K)
    sorted_pair_ptr,  # [NB*BM] int32 out: pair of each row, -1 for padding rows
    expert_of_block_ptr,  # [NB] int32 out: expert of each block, -1 for unused blocks
    # Pointers of the LoRA shrink programs (pid >= 1), see moe_lora.pair_shrink.
    x_ptr,
    slot_ptr,
    enabled_ptr,
    rank_ptr,
    a13_ptr,
    xa13_ptr,
    xa2_ptr,
    # Sizes: pairs, experts, blocks (an upper bound on the blocks used), hidden.
    P,
    E,
    NB,
    H,
    # Strides.
    stride_xt,
    stride_as,
    stride_ae,
    stride_ai,
    stride_ar,
    # Meta-parameters.
    K: tl.constexpr,
    HAS13: tl.constexpr,
    HAS2: tl.constexpr,
    BR: tl.constexpr,
    BKS: tl.constexpr,
    BM: tl.constexpr,
    E_PAD: tl.constexpr,
    CH: tl.constexpr,
):
    pid = tl.program_id(0)
    if pid > 0:  # one program per pair: its gate_up LoRA shrink (exits unless its slot is on)
        pair_shrink(
            pid - 1, K, topk_ids_ptr, x_ptr, stride_xt, H, slot_ptr, enabled_ptr, rank_ptr,
            a13_ptr, stride_as, stride_ae, stride_ai, stride_ar, xa13_ptr, xa2_ptr,
            HAS13, HAS2, BR, BKS,
        )  # fmt: skip
        return
    offs_e = tl.arange(0, E_PAD)
    offs_c = tl.arange(0, CH)

    # -- pass 1: pairs per expert, then the first block of each expert --
    counts = tl.zeros((E_PAD,), dtype=tl.int32)
    for p0 in range(0, P, CH):
        ids = tl.load(topk_ids_ptr + p0 + offs_c, mask=p0 + offs_c < P, other=-1)
        counts += tl.sum((ids[:, None] == offs_e[None, :]).to(tl.int32), axis=0)
    blocks = (counts + BM - 1) // BM
    blocks_end = tl.cumsum(blocks, axis=0)
    blocks_start = blocks_end - blocks

    # -- expert of each block: the number of experts that end at or before it --
    for b0 in range(0, NB, CH):
        b = b0 + offs_c
        e = tl.sum((blocks_end[None, :] <= b[:, None]).to(tl.int32), axis=1)
        tl.store(expert_of_block_ptr + b, tl.where(e < E, e, -1), mask=b < NB)

    # -- pass 2: every row starts as padding, then each pair goes to its place --
    for r0 in range(0, NB * BM, CH):
        tl.store(sorted_pair_ptr + r0 + offs_c, -1, mask=r0 + offs_c < NB * BM)
    tl.debug_barrier()  # the padding stores above must land before the pair stores below
    seen = tl.zeros((E_PAD,), dtype=tl.int32)
    for p0 in range(0, P, CH):
        p_ok = p0 + offs_c < P
        ids = tl.load(topk_ids_ptr + p0 + offs_c, mask=p_ok, other=-1)
        onehot = (ids[:, None] == offs_e[None, :]).to(tl.int32)  # [CH, E_PAD]
        rank = tl.sum(tl.cumsum(onehot, axis=0) * onehot, axis=1) - 1
        first = tl.sum(onehot * (blocks_start * BM + seen)[None, :], axis=1)
        tl.store(sorted_pair_ptr + first + rank, p0 + offs_c, mask=p_ok)
        seen += tl.sum(onehot, axis=0)
