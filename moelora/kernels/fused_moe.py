"""Fused MoE with the MoE LoRA in its epilogues.

Semantics: out[t] = sum_k w[t,k] * (silu_and_mul(x[t] @ W13[e].T + d13) @ W2[e].T + d2),
e = ids[t, k]; d13, d2 are the LoRA deltas of token t's adapter slot for expert e.

Algorithm. The T*K (token, expert) pairs are the rows of two grouped GEMMs.
  1. Align (moe_align.py, one launch of a few programs): sort the pairs by expert and pad each
     expert's group to BM rows, so every BM-row block uses one expert. Buffers are sized from
     T*K, E and BM only.
  2. gate_up: a program owns one block and BN columns of both gate and up, so SiLU-and-mul is
     applied in registers and only h = [rows, I] is written.
  3. down: a program owns one block and BN columns of H, multiplies by the routing weight and
     writes one row per pair; a last small kernel sums each token's K rows.
For one token the pairs already have distinct experts, so a "direct" path (config.direct) skips
the align (a block is one pair) and its down kernel loops over the token's K experts and writes
the sum itself: two launches in all. On the H200 it lost to the grouped path even at one token
(its programs each stream one expert's rows, too few to fill the GPU), so tuned configs and the
default use the grouped path; it stays for devices where launches cost more.

The LoRA deltas are added to the fp32 accumulators before the activation / the routing
weight. On the grouped path each shrink is done once per pair (moe_lora: x @ A13.T by extra
programs of the align kernel, h @ A2.T split over gate_up's column blocks) and the GEMM
epilogues only expand; the direct path shrinks inside its programs (lora.lora_delta). A block
gathers its rows' slots before the main loop and their flags after it; a step whose
any_enabled flag is 0 skips the LoRA code, so a batch without active adapters runs the same
launches as the base MoE and pays only those gathers (and align programs that exit at once).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moelora.kernels.dot import dot
from moelora.kernels.lora import active_slots, lora_delta, rank_block, shrink_block_k
from moelora.kernels.moe_align import align_kernel, align_plan, num_blocks
from moelora.kernels.moe_config import MoeConfig, default_config
from moelora.kernels.moe_lora import (
    PAIR_SPLITS,
    block_slots,
    down_partial_shrink,
    expand_rows,
    lora_rows,
    packed_walk,
    pair_shrink_block_k,
)
from moelora.kernels.pdl import pdl_kwargs, pdl_wait
from moelora.step.lora import LoraBatchInfo, LoraWeights

MAX_SHRINK_PROGRAMS = 2048  # most programs the align launch adds for the pair shrink
SHRINK_WARPS = 8  # warps of the align launch when it shrinks pairs too
HALF_SPLITS_FROM = 512  # pairs from which a shrink job does twice the rows, PAIR_SPLITS / 2 a pair

# 1. Align: moe_align.py (one launch; with LoRA it also shrinks each pair, see moe_lora.py).

# --------------------------------------------------------------------------------------------
# 2. gate_up GEMM + LoRA + SiLU-and-mul.
# --------------------------------------------------------------------------------------------


@triton.jit
def _block_rows(
    pid_m,
    topk_ids_ptr,
    sorted_pair_ptr,
    expert_of_block_ptr,
    BM: tl.constexpr,
    DIRECT: tl.constexpr,
):
    """Expert and [BM] pairs of block pid_m (pair -1: padding row); expert -1: unused block."""
    offs_m = tl.arange(0, BM)
    if DIRECT:
        expert = tl.load(topk_ids_ptr + pid_m)
        pair = tl.where(offs_m == 0, pid_m, -1)
    else:
        expert = tl.load(expert_of_block_ptr + pid_m)
        pair = tl.load(sorted_pair_ptr + pid_m * BM + offs_m)
    return expert, pair


@triton.jit
def _gate_up_kernel(
    # Pointers: activations, weights, outputs, routing.
    x_ptr,  # [T, H]
    w13_ptr,  # [E, 2I, H]
    h_ptr,  # [rows, I] out: silu(gate) * up, row = block row (grouped) or pair (direct)
    topk_ids_ptr,
    sorted_pair_ptr,
    expert_of_block_ptr,
    # Pointers: LoRA batch info and weights (unused unless HAS_LORA).
    slot_ptr,
    enabled_ptr,
    rank_ptr,
    scaling_ptr,
    a_ptr,  # [S, E, 2, R, H]
    b_ptr,  # [S, E, 2I, R]
    xa13_ptr,  # [P, 2, BR] fp32, from the align kernel (grouped path)
    a2_ptr,  # [S, E, 1, R, I]: h's columns feed xa2 here (grouped path)
    xa2_ptr,  # [P, BR] fp32
    any_ptr,  # [1] int32: any slot enabled in this step (LoraBatchInfo.any_enabled)
    # Sizes.
    H,
    I,
    # Strides (last dims contiguous).
    stride_xt,
    stride_we,
    stride_wn,
    stride_as,
    stride_ae,
    stride_ai,
    stride_ar,
    stride_bs,
    stride_be,
    stride_bn,
    stride_a2s,
    stride_a2e,
    stride_a2r,
    # Meta-parameters.
    K: tl.constexpr,
    S: tl.constexpr,
    HAS_LORA: tl.constexpr,
    HAS_LORA2: tl.constexpr,
    DIRECT: tl.constexpr,
    PACK: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    BKL: tl.constexpr,
    BR: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_wait(PDL)  # first: see kernels/pdl.py
    # -- map the program to a block of pairs (one expert) and BN columns of gate and up --
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert, pair = _block_rows(
        pid_m, topk_ids_ptr, sorted_pair_ptr, expert_of_block_ptr, BM, DIRECT
    )
    if expert < 0:
        return
    row_ok = pair >= 0
    token = tl.where(row_ok, pair // K, 0)
    if HAS_LORA or HAS_LORA2:
        # the slots are gathered before the main loop so their latency hides behind the weight
        # stream; their flags, ranks and scalings after it (moe_lora.lora_rows). The step's
        # "any slot enabled" lets a batch without adapters skip the per-block test (a
        # cross-warp reduction) in the epilogue.
        slot_rows = tl.load(slot_ptr + token, mask=row_ok, other=-1)
        lora_on = tl.load(any_ptr) != 0
    offs_n = pid_n * BN + tl.arange(0, BN)
    n_ok = offs_n < I
    offs_k = tl.arange(0, BK)
    x_rows = token.to(tl.int64) * stride_xt
    w_e = w13_ptr + expert.to(tl.int64) * stride_we
    wg_ptrs = w_e + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None]  # [BK, BN]
    wu_ptrs = wg_ptrs + I * stride_wn

    # -- main loop: both accumulators share each x tile --
    acc_g = tl.zeros((BM, BN), dtype=tl.float32)
    acc_u = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, H, BK):
        k_ok = offs_k < H - k0
        xt = tl.load(
            x_ptr + x_rows[:, None] + (k0 + offs_k)[None, :],
            mask=row_ok[:, None] & k_ok[None, :],
            other=0.0,
        )
        w_mask = k_ok[:, None] & n_ok[None, :]
        acc_g = dot(xt, tl.load(wg_ptrs, mask=w_mask, other=0.0), acc_g)
        acc_u = dot(xt, tl.load(wu_ptrs, mask=w_mask, other=0.0), acc_u)
        wg_ptrs += BK
        wu_ptrs += BK

    # -- epilogue: LoRA deltas of gate and up (only blocks with an enabled slot) --
    if HAS_LORA or HAS_LORA2:
        slot_rows, rank_rows, scale_rows = lora_rows(slot_rows, enabled_ptr, rank_ptr, scaling_ptr)
    if HAS_LORA:
        if lora_on:  # a base-only step skips even the reduction of block_slots
            packed, any_rows = block_slots(slot_rows, rank_rows, PACK)
            if any_rows:
                b_e = b_ptr + expert.to(tl.int64) * stride_be
                if DIRECT:  # no align kernel ran: shrink here
                    a_e = a_ptr + expert.to(tl.int64) * stride_ae
                    acc_g, acc_u = lora_delta(
                        acc_g, acc_u, x_ptr, x_rows, slot_rows, H, a_e, stride_as, stride_ai,
                        stride_ar, b_e, stride_bs, stride_bn, offs_n, I + offs_n, n_ok,
                        rank_ptr, scaling_ptr, S, True, BM, BKL, BR,
                    )  # fmt: skip
                else:
                    offs_r = tl.arange(0, BR)
                    xa_ptrs = xa13_ptr + pair[:, None] * 2 * BR + offs_r[None, :]
                    on = (slot_rows >= 0)[:, None]
                    xa_g = tl.load(xa_ptrs, mask=on, other=0.0)
                    xa_u = tl.load(xa_ptrs + BR, mask=on, other=0.0)
                    acc_g, acc_u = expand_rows(
                        acc_g, acc_u, xa_g, xa_u, slot_rows, rank_rows, scale_rows, packed, b_e,
                        stride_bs, stride_bn, offs_n, I + offs_n, n_ok, S, BR, True, PACK,
                    )  # fmt: skip

    # -- activation and store --
    h = (acc_g / (1.0 + tl.exp(-acc_g)) * acc_u).to(h_ptr.dtype.element_ty)
    if DIRECT:
        h_rows = pair
    else:
        h_rows = pid_m * BM + tl.arange(0, BM)
    h_ptrs = h_ptr + h_rows[:, None].to(tl.int64) * I + offs_n[None, :]
    tl.store(h_ptrs, h, mask=row_ok[:, None] & n_ok[None, :])

    # -- this block's share of the down LoRA shrink: h[:, cols] @ A2[s, e, :, cols].T --
    if HAS_LORA2 and not DIRECT:
        if lora_on:
            packed, any_rows = block_slots(slot_rows, rank_rows, PACK)
            if any_rows:
                a2_e = a2_ptr + expert.to(tl.int64) * stride_a2e
                down_partial_shrink(
                    xa2_ptr, pair, h, slot_rows, rank_rows, packed, a2_e, stride_a2s, stride_a2r,
                    offs_n, n_ok, S, BM, BR, PACK,
                )  # fmt: skip


# --------------------------------------------------------------------------------------------
# 3. down GEMM + LoRA, weighted by the routing weight.
# --------------------------------------------------------------------------------------------


@triton.jit
def _down_tile(
    h_ptr, h_rows, row_ok, slot_rows, w2_ptr, expert, offs_n, n_ok, I,
    stride_we, stride_wn,
    rank_ptr, scaling_ptr, a_ptr, b_ptr,
    stride_as, stride_ae, stride_ar, stride_bs, stride_be, stride_bn,
    S: tl.constexpr, HAS_LORA: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, BKL: tl.constexpr, BR: tl.constexpr,
):  # fmt: skip
    """[BM, BN] fp32: rows h_rows of h times W2[expert, offs_n].T, plus their LoRA delta."""
    offs_k = tl.arange(0, BK)
    h_offs = h_rows.to(tl.int64) * I
    w_ptrs = (
        w2_ptr
        + expert.to(tl.int64) * stride_we
        + offs_n[None, :].to(tl.int64) * stride_wn
        + offs_k[:, None]
    )
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, I, BK):
        k_ok = offs_k < I - k0
        ht = tl.load(
            h_ptr + h_offs[:, None] + (k0 + offs_k)[None, :],
            mask=row_ok[:, None] & k_ok[None, :],
            other=0.0,
        )
        acc = dot(ht, tl.load(w_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0), acc)
        w_ptrs += BK
    if HAS_LORA:
        if tl.max(slot_rows, axis=0) >= 0:
            acc, _ = lora_delta(
                acc, acc, h_ptr, h_offs, slot_rows, I,
                a_ptr + expert.to(tl.int64) * stride_ae, stride_as, 0, stride_ar,
                b_ptr + expert.to(tl.int64) * stride_be, stride_bs, stride_bn, offs_n, offs_n,
                n_ok, rank_ptr, scaling_ptr, S, False, BM, BKL, BR,
            )  # fmt: skip
    return acc


@triton.jit
def _down_kernel(
    # Pointers: activations, weights, output, routing.
    h_ptr,  # [NB*BM, I], block rows
    w2_ptr,  # [E, H, I]
    out_ptr,  # [P, H]: w[pair] * (h @ W2[e].T + d2), one row per pair
    topk_weights_ptr,  # [P] float32
    topk_ids_ptr,
    sorted_pair_ptr,
    expert_of_block_ptr,
    # Pointers: LoRA batch info and weights (unused unless HAS_LORA).
    slot_ptr,
    enabled_ptr,
    rank_ptr,
    scaling_ptr,
    a_ptr,  # [S, E, 1, R, I] (unused: the shrink is in xa2)
    b_ptr,  # [S, E, H, R]
    xa2_ptr,  # [P, BR] fp32: h @ A2.T of each pair with an enabled slot
    any_ptr,  # [1] int32: any slot enabled in this step (LoraBatchInfo.any_enabled)
    # Sizes.
    H,
    I,
    # Strides (last dims contiguous).
    stride_we,
    stride_wn,
    stride_as,
    stride_ae,
    stride_ar,
    stride_bs,
    stride_be,
    stride_bn,
    # Meta-parameters.
    K: tl.constexpr,
    S: tl.constexpr,
    PACK: tl.constexpr,
    HAS_LORA: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    BKL: tl.constexpr,
    BR: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_wait(PDL)  # first: see kernels/pdl.py
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert, pair = _block_rows(pid_m, topk_ids_ptr, sorted_pair_ptr, expert_of_block_ptr, BM, 0)
    if expert < 0:
        return
    row_ok = pair >= 0
    slot_rows = tl.full((BM,), -1, tl.int32)
    if HAS_LORA:  # the slots now, their flags after the main loop (moe_lora.lora_rows)
        slot_rows = tl.load(slot_ptr + tl.where(row_ok, pair // K, 0), mask=row_ok, other=-1)
        lora_on = tl.load(any_ptr) != 0
    offs_n = pid_n * BN + tl.arange(0, BN)
    n_ok = offs_n < H
    acc = _down_tile(
        h_ptr, pid_m * BM + tl.arange(0, BM), row_ok, slot_rows, w2_ptr, expert, offs_n, n_ok,
        I, stride_we, stride_wn, rank_ptr, scaling_ptr, a_ptr, b_ptr,
        stride_as, stride_ae, stride_ar, stride_bs, stride_be, stride_bn,
        S, False, BM, BN, BK, BKL, BR,
    )  # fmt: skip
    if HAS_LORA:
        slot_rows, rank_rows, scale_rows = lora_rows(slot_rows, enabled_ptr, rank_ptr, scaling_ptr)
        if lora_on:
            packed, any_rows = block_slots(slot_rows, rank_rows, PACK)
            if any_rows:
                offs_r = tl.arange(0, BR)
                xa = tl.load(
                    xa2_ptr + pair[:, None] * BR + offs_r[None, :],
                    mask=(slot_rows >= 0)[:, None],
                    other=0.0,
                )
                acc, _ = expand_rows(
                    acc, acc, xa, xa, slot_rows, rank_rows, scale_rows, packed,
                    b_ptr + expert.to(tl.int64) * stride_be, stride_bs, stride_bn, offs_n,
                    offs_n, n_ok, S, BR, False, PACK,
                )  # fmt: skip
    weight = tl.load(topk_weights_ptr + pair, mask=row_ok, other=0.0)
    out_ptrs = out_ptr + pair[:, None].to(tl.int64) * H + offs_n[None, :]
    out = (acc * weight[:, None]).to(out_ptr.dtype.element_ty)
    tl.store(out_ptrs, out, mask=row_ok[:, None] & n_ok[None, :])


@triton.jit
def _down_direct_kernel(
    # Pointers (as _down_kernel; h rows are pairs and out is [T, H], the final output).
    h_ptr,
    w2_ptr,
    out_ptr,
    topk_weights_ptr,
    topk_ids_ptr,
    slot_ptr,
    enabled_ptr,
    rank_ptr,
    scaling_ptr,
    a_ptr,
    b_ptr,
    # Sizes.
    H,
    I,
    # Strides (last dims contiguous).
    stride_we,
    stride_wn,
    stride_as,
    stride_ae,
    stride_ar,
    stride_bs,
    stride_be,
    stride_bn,
    # Meta-parameters.
    K: tl.constexpr,
    S: tl.constexpr,
    HAS_LORA: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    BKL: tl.constexpr,
    BR: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_wait(PDL)  # first: see kernels/pdl.py
    # -- a program owns one token and BN columns; it walks the token's K experts --
    token = tl.program_id(0)
    offs_n = tl.program_id(1) * BN + tl.arange(0, BN)
    n_ok = offs_n < H
    offs_m = tl.arange(0, BM)
    row_ok = offs_m == 0  # a one-row tile: tl.tl.dot needs 16 rows, the other rows are masked
    slot_rows = tl.full((BM,), -1, tl.int32)
    if HAS_LORA:
        slot_rows = active_slots(slot_ptr, tl.where(row_ok, token, 0), row_ok, enabled_ptr)
    total = tl.zeros((BN,), dtype=tl.float32)
    for k in range(0, K):
        pair = token * K + k
        expert = tl.load(topk_ids_ptr + pair)
        acc = _down_tile(
            h_ptr, tl.where(row_ok, pair, 0), row_ok, slot_rows, w2_ptr, expert, offs_n, n_ok,
            I, stride_we, stride_wn, rank_ptr, scaling_ptr, a_ptr, b_ptr,
            stride_as, stride_ae, stride_ar, stride_bs, stride_be, stride_bn,
            S, HAS_LORA, BM, BN, BK, BKL, BR,
        )  # fmt: skip
        total += tl.sum(acc, axis=0) * tl.load(topk_weights_ptr + pair)
    out_ptrs = out_ptr + token.to(tl.int64) * H + offs_n
    tl.store(out_ptrs, total.to(out_ptr.dtype.element_ty), mask=n_ok)


@triton.jit
def _sum_topk_kernel(
    pair_out_ptr,  # [T*K, H]
    out_ptr,  # [T, H]
    H,
    K: tl.constexpr,
    BH: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_wait(PDL)  # first: see kernels/pdl.py
    token = tl.program_id(0)
    offs = tl.program_id(1) * BH + tl.arange(0, BH)
    ok = offs < H
    rows = pair_out_ptr + token.to(tl.int64) * K * H + offs
    total = tl.zeros((BH,), dtype=tl.float32)
    for k in range(0, K):
        total += tl.load(rows + k * H, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + token.to(tl.int64) * H + offs, total.to(out_ptr.dtype.element_ty), mask=ok)


# --------------------------------------------------------------------------------------------
# The wrapper (tile configs: moe_config.py).
# --------------------------------------------------------------------------------------------


def _lora_args(lora: LoraWeights | None, info: LoraBatchInfo | None, fallback: torch.Tensor):
    """(a, b, a strides s/e/i/r, b strides s/e/n) or placeholders when the path is off."""
    if lora is None or info is None:
        return fallback, fallback, (0, 0, 0, 0), (0, 0, 0)
    a, b = lora.a, lora.b
    assert a.is_contiguous() and b.is_contiguous()
    return a, b, (a.stride(0), a.stride(1), a.stride(2), a.stride(3)), b.stride()[:3]


def fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    lora13: LoraWeights | None = None,
    lora2: LoraWeights | None = None,
    info: LoraBatchInfo | None = None,
    config: MoeConfig | None = None,
    sum_topk: bool = True,
) -> torch.Tensor:
    """Semantics: out[t] = sum_k w[t,k] * (silu_and_mul(x[t] @ W13[e].T + d13) @ W2[e].T + d2).

    With sum_topk=False the grouped path returns the K weighted rows [T, K, H] unsummed
    (reference.sum_rows of them is out): the next rms_norm adds them, one launch fewer.

    x [T, H]; w13 [E, 2I, H]; w2 [E, H, I] (contiguous, x's dtype); topk_weights [T, K] float32;
    topk_ids [T, K] int32. lora13.a [S, E, 2, R, H], lora13.b [S, E, 2I, R]; lora2.a
    [S, E, 1, R, I], lora2.b [S, E, H, R]. Returns [T, H]. No host sync: capturable.
    """
    T, H = x.shape
    E, I2, _ = w13.shape
    I = I2 // 2
    K = topk_ids.shape[1]
    assert w13.shape == (E, 2 * I, H) and w2.shape == (E, H, I), (x.shape, w13.shape, w2.shape)
    assert w13.is_contiguous() and w2.is_contiguous() and x.stride(1) == 1
    assert topk_ids.shape == topk_weights.shape == (T, K), (topk_ids.shape, topk_weights.shape)
    assert topk_ids.dtype == torch.int32 and topk_weights.dtype == torch.float32
    out = torch.empty(T, H, dtype=x.dtype, device=x.device)
    if T == 0:
        return out
    cfg = config or default_config(T, E, H, I, K, x.device)
    ids = topk_ids.contiguous().view(-1)
    weights = topk_weights.contiguous().view(-1)
    P = T * K

    # LoRA: both halves share the batch info; S and R come from whichever is present.
    has13 = lora13 is not None and info is not None
    has2 = lora2 is not None and info is not None
    a13, b13, sa13, sb13 = _lora_args(lora13, info, w13)
    a2, b2, sa2, sb2 = _lora_args(lora2, info, w2)
    any_lora = lora13 if has13 else (lora2 if has2 else None)
    S = any_lora.a.shape[0] if any_lora is not None else 1
    BR = rank_block(any_lora.max_rank) if any_lora is not None else 16
    BKL = shrink_block_k(any_lora.max_rank) if any_lora is not None else 16
    PACK = any_lora is not None and packed_walk(S, any_lora.max_rank)
    slot, enabled, rank, scaling, any_on = (
        (
            info.slot_of_token,
            info.slot_enabled,
            info.rank_of_slot,
            info.scaling_of_slot,
            info.any_enabled,
        )
        if any_lora is not None
        else (ids, ids, ids, weights, ids)
    )
    launch = dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_kwargs(x.device))

    if has13 and has2:
        assert lora13.max_rank == lora2.max_rank, (lora13.a.shape, lora2.a.shape)
    xa13 = xa2 = weights  # placeholders, replaced on the grouped path with LoRA
    if cfg.direct:
        NB, BM = P, 16
        sorted_pair = expert_of_block = ids  # unused by the direct kernels
        h = torch.empty(P, I, dtype=x.dtype, device=x.device)
    else:
        BM = cfg.block_m
        NB = num_blocks(P, E, BM)
        sorted_pair = torch.empty(NB * BM, dtype=torch.int32, device=x.device)
        expert_of_block = torch.empty(NB, dtype=torch.int32, device=x.device)
        if any_lora is not None:  # scratch only pairs with an enabled slot write and read
            xa13 = torch.empty(P, 2, BR, dtype=torch.float32, device=x.device)
            xa2 = torch.empty(P, BR, dtype=torch.float32, device=x.device)
        # programs 0..NA-1 align; with LoRA, NS more shrink the pairs (moe_lora.pair_shrink),
        # `splits` jobs a pair, at most MAX_SHRINK_PROGRAMS programs: each costs a base-only
        # step a load. Measured on an H200 (decode steps, 8 adapters): SHRINK_WARPS 8 instead
        # of align's 4 made steps 1.5% faster at one token and 0.5% at 64 (it would cost
        # LoRA-disabled steps 0.4% at one token, so only a LoRA launch gets them); half the
        # splits 0.5% more at 512 pairs, but 2.7% slower at 8 (half the programs)
        NA, align_meta = align_plan(P, NB)
        splits = PAIR_SPLITS if P < HALF_SPLITS_FROM else PAIR_SPLITS // 2
        NS = 0
        if any_lora is not None:
            NS = min(P * splits, MAX_SHRINK_PROGRAMS)
            align_meta["num_warps"] = max(align_meta["num_warps"], SHRINK_WARPS)
        align_kernel[(NA + NS,)](
            ids, sorted_pair, expert_of_block,
            x, slot, enabled, rank, a13, xa13, xa2, any_on,
            P, E, NB, H, NA, max(NS, 1), x.stride(0), *sa13,
            K=K, HAS13=has13, HAS2=has2, BR=BR, BKS=pair_shrink_block_k(BR, splits), SPLITS=splits,
            BM=BM, E_PAD=triton.next_power_of_2(E), CH=64, **align_meta, **pdl_kwargs(x.device),
        )  # fmt: skip
        h = torch.empty(NB * BM, I, dtype=x.dtype, device=x.device)

    _gate_up_kernel[(NB, triton.cdiv(I, cfg.block_n))](
        x, w13, h, ids, sorted_pair, expert_of_block,
        slot, enabled, rank, scaling, a13, b13, xa13, a2, xa2, any_on,
        H, I, x.stride(0), w13.stride(0), w13.stride(1), *sa13, *sb13, sa2[0], sa2[1], sa2[3],
        K=K, S=S, HAS_LORA=has13, HAS_LORA2=has2, DIRECT=cfg.direct, PACK=PACK,
        BM=BM, BN=cfg.block_n, BK=cfg.block_k, BKL=BKL, BR=BR, **launch,
    )  # fmt: skip

    down_args = (
        slot, enabled, rank, scaling, a2, b2, H, I, w2.stride(0), w2.stride(1),
        sa2[0], sa2[1], sa2[3], *sb2,
    )  # fmt: skip
    down_meta = dict(
        K=K, S=S, HAS_LORA=has2, BM=BM, BN=cfg.block_n_down, BK=cfg.block_k_down, BKL=BKL, BR=BR
    )
    grid_n = triton.cdiv(H, cfg.block_n_down)
    if cfg.direct:
        _down_direct_kernel[(T, grid_n)](
            h, w2, out, weights, ids, *down_args, **down_meta, **launch
        )
        return out
    pair_out = torch.empty(P, H, dtype=x.dtype, device=x.device)
    _down_kernel[(NB, grid_n)](
        h, w2, pair_out, weights, ids, sorted_pair, expert_of_block, *down_args[:6], xa2, any_on,
        *down_args[6:], PACK=PACK, **down_meta, **launch,
    )  # fmt: skip
    if not sum_topk:
        return pair_out.view(T, K, H)
    BH = min(1024, triton.next_power_of_2(H))
    _sum_topk_kernel[(T, triton.cdiv(H, BH))](pair_out, out, H, K=K, BH=BH, **pdl_kwargs(x.device))
    return out
