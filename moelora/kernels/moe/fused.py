"""Fused MoE with the MoE LoRA in its epilogues.

Semantics: out[t] = sum_k w[t,k] * (silu_and_mul(x[t] @ W13[e].T + d13) @ W2[e].T + d2),
e = ids[t, k]; d13, d2 are the LoRA deltas of token t's adapter slot for expert e.

Algorithm. The T*K (token, expert) pairs are the rows of two grouped GEMMs.
  1. Align (moe_align.py, one launch of a few programs; two past PMAX pairs): sort the pairs
     by expert and pad each expert's group to BM rows, so every BM-row block uses one expert.
     Buffers are sized from T*K, E and BM only.
  2. gate_up: a program owns one block and BN columns of both gate and up, so SiLU-and-mul is
     applied in registers and only h = [rows, I] is written.
  3. down: a program owns one block and BN columns of H, multiplies by the routing weight and
     writes one row per pair; a last small kernel sums each token's K rows.

GPT-OSS adds biases (b13 [E, 2I], b2 [E, H], added to the fp32 accumulators like the LoRA
deltas) and its clamped SwiGLU (reference.swiglu_oai); both are constexpr options, so the other
architectures compile kernels without them. Its MXFP4 experts (mxfp4_layout.Mxfp4Weight)
stay packed: with the MXFP4 constexpr both GEMMs take their main loop from mxfp4.py, which loads
[BK/2, BN] code bytes and [BK/32, BN] scale bytes a tile, expands them to x's dtype in registers
and feeds the same tl.dot; the epilogues (LoRA, biases, activation) are the same code. BK is then
a multiple of 32, and so are H and I (the format's groups). Block-FP8 experts
(fp8_block.Fp8Weight) likewise stay e4m3 codes: with the FP8 constexpr the main loops come from
fp8.py, which feeds the code tiles in x's dtype to the same tl.dot and applies each 128 x 128
block's scale to the partial product of its 128-deep slice of K; BK then divides 128.

The LoRA deltas are added to the fp32 accumulators before the activation / the routing
weight. Each shrink is done once per pair (moe_lora: x @ A13.T by extra programs of the align
kernel, h @ A2.T split over gate_up's column blocks) and the GEMM epilogues only expand. A
block gathers its rows' slots before the main loop and their flags after it; a step whose
any_enabled flag is 0 skips the LoRA code, so a batch without active adapters runs the same
launches as the base MoE and pays only those gathers (and align programs that exit at once).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from moelora.kernels.dot import dot
from moelora.kernels.fp8_block import FP8_BLOCK, Fp8Weight
from moelora.kernels.lora import rank_block
from moelora.kernels.moe.align import PairShrink, launch_align, num_blocks
from moelora.kernels.moe.config import MoeConfig, default_config
from moelora.kernels.moe.fp8 import (
    down_fp8_loop,
    fp8_tiles_fit,
    gate_up_fp8_loop,
    quantize_rows_fp8,
    quantized_rows,
)
from moelora.kernels.moe.lora import (
    PAIR_SPLITS,
    block_shrink_kernel,
    block_slots,
    down_partial_shrink,
    expand_rows,
    lora_rows,
    module_rows,
    packed_walk,
    pair_shrink_block_k,
)
from moelora.kernels.moe.mxfp4 import down_mxfp4_loop, gate_up_mxfp4_loop
from moelora.kernels.moe.mxfp4_layout import MXFP4_GROUP, Mxfp4Weight
from moelora.kernels.pdl import pdl_kwargs, pdl_wait
from moelora.kernels.reference import SWIGLU_OAI_ALPHA, SWIGLU_OAI_LIMIT
from moelora.kernels.sizes import cdiv, next_power_of_2
from moelora.step.lora import TABLE_WIDTH, LoraBatchInfo, LoraWeights

# block-FP8 experts, weight-only, bf16 on the GPU: the code tiles by bit placement
# (fp8.e4m3_bf16_placed: the conversions' values, off the conversion pipe) or converted; the
# placement is the faster where it was timed (decode, every batch size)
FP8_PLACED = True
W8A8_H_GROUPS = (64, 128)  # h's columns a scale under W8A8: gate_up's tile width (MoeConfig)
MAX_SHRINK_PROGRAMS = 2048  # most programs the align launch adds for the pair shrink
SHRINK_WARPS = 8  # warps of the align launch when it shrinks pairs too
HALF_SPLITS_FROM = 512  # pairs from which a shrink job does twice the rows, PAIR_SPLITS / 2 a pair
# pairs from which gate_up's shrink runs block by block (moe_lora.block_shrink_kernel): past
# every decode graph's pairs (256 rows at top-8), so prefill steps of more than 256 tokens at
# top-8, not only past the align's PMAX: the pair shrink reads each pair's expert's whole A13,
# 0.5 GB a layer for a 512-token prompt's 4096 pairs (Qwen3-30B-A3B, rank 16)
BLOCK_SHRINK_FROM = 2049
# deterministic inference's tiles (deterministic_config): the K depth every tuned bucket of the
# H200 table takes but its smallest; the pipeline's stages within STAGE_BYTES, the shared memory
# a Hopper block may opt in to (227 KiB)
DETERMINISTIC_BK = 128
STAGE_BYTES = 227 * 1024
BLOCK_SHRINK_K = 64  # its input chunk
# ... where one program takes one slot of a block (below BLOCK_SHRINK_FROM pairs): few
# programs, each a chain of H / BK dependent steps, so up to this deep while A's tile stays
# within SLOT_SHRINK_TILE bytes; the chunk changes no sum (a row's product is the same
# ascending chain of k16 MMAs at any chunk: tests/gpu's determinism tests compare the shrinks)
SLOT_SHRINK_K = 256
SLOT_SHRINK_TILE = 16384
ACTIVATIONS = ("silu", "swiglu_oai")  # the gate_up kernel's ACTIVATION, by index
_ALPHA = tl.constexpr(SWIGLU_OAI_ALPHA)
_LIMIT = tl.constexpr(SWIGLU_OAI_LIMIT)

# 1. Align: moe_align.py (its last launch, with LoRA, also shrinks each pair: see moe_lora.py).

# --------------------------------------------------------------------------------------------
# 2. gate_up GEMM + LoRA + SiLU-and-mul.
# --------------------------------------------------------------------------------------------


@triton.jit
def _tile(NUM_M, NUM_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(block, column block) of this program. GROUP_M 0: a 2D grid, blocks fastest. Else a 1D
    grid in groups of GROUP_M blocks, each group's programs sweeping all NUM_N column blocks
    (its blocks fastest): a block's rows and its expert's weight columns are then read while
    still in L2, where blocks-fastest streams every block's rows (h: 75 MB at 4096 tokens)
    once per column block and the L2 keeps none of them."""
    if GROUP_M == 0:
        return tl.program_id(0), tl.program_id(1)
    else:
        pid = tl.program_id(0)
        group = pid // (GROUP_M * NUM_N)
        first = group * GROUP_M
        size = tl.minimum(NUM_M - first, GROUP_M)
        within = pid - group * (GROUP_M * NUM_N)
        return first + within % size, within // size


@triton.jit
def _block_rows(pid_m, sorted_pair_ptr, expert_of_block_ptr, BM: tl.constexpr):
    """Expert and [BM] pairs of block pid_m (pair -1: padding row); expert -1: unused block."""
    offs_m = tl.arange(0, BM)
    expert = tl.load(expert_of_block_ptr + pid_m)
    pair = tl.load(sorted_pair_ptr + pid_m * BM + offs_m)
    return expert, pair


@triton.jit(do_not_specialize=["NUM_M"])  # one compile for every block count
def _gate_up_kernel(
    # Pointers: activations, weights, output, the align's blocks.
    x_ptr,  # [T, H]
    w13_ptr,  # [E, 2I, H]; with MXFP4 its code bytes [E, 2I, H/2] uint8; with FP8 its codes
    w13_scale_ptr,  # [E, 2I, H/32] uint8 with MXFP4; [E, 2I/128, H/128] float32 with FP8
    w13_desc,  # TMA descriptor of w13 as [E*2I, H], tiles [BN, BK]; only with TMA
    h_ptr,  # [NB*BM, I] out: silu(gate) * up, one row per block row (with STORE_H)
    xq_ptr,  # W8A8 only: x's codes [T, H] e4m3 and scales [T, H/128] (fp8.quantize_rows_fp8)
    xs_ptr,
    hq_ptr,  # W8A8 only, out: h's codes [NB*BM, I] e4m3 and scales [NB*BM, I/BN] float32
    hs_ptr,
    sorted_pair_ptr,  # [NB*BM] int32: pair of each block row, -1 for padding
    expert_of_block_ptr,  # [NB] int32: -1 for unused blocks
    # Pointers: LoRA batch info, weights and scratch (unused unless HAS_LORA / HAS_LORA2).
    slot_ptr,
    enabled_ptr,
    scaling_ptr,
    lora13_ptr,  # the arena of gate_up's LoRA: slot s's B13 [(E | 1,) 2I, r] per tab13_ptr
    tab13_ptr,  # [S, TABLE_WIDTH] int64 (step/lora.LoraWeights.table)
    xa13_ptr,  # [P, 2, BR] fp32, from the align kernel
    lora2_ptr,  # the arena of down's LoRA: slot s's A2 [(E | 1,) 1, r, I] per tab2_ptr; h's
    tab2_ptr,  # ... columns feed xa2 here
    xa2_ptr,  # [P, BR] fp32
    any_ptr,  # [1] int32: any slot enabled in this step (LoraBatchInfo.any_enabled)
    bias_ptr,  # [E, 2I] gate then up, only with HAS_BIAS
    # Sizes.
    H,
    I,
    NUM_M,  # blocks (NB)
    # Strides (last dims contiguous).
    stride_xt,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    # Meta-parameters.
    K: tl.constexpr,
    S: tl.constexpr,
    HAS_LORA: tl.constexpr,
    HAS_LORA2: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ACTIVATION: tl.constexpr,  # 0: silu(gate) * up; 1: GPT-OSS's clamped SwiGLU
    MXFP4: tl.constexpr,  # packed experts, expanded a tile at a time (mxfp4.py)
    MXFP4_EXPAND: tl.constexpr,  # ... how (_Experts.expand)
    MXFP4_SUB_K: tl.constexpr,  # ... in sub-tiles this deep (MoeConfig.mxfp4_sub_k)
    FP8: tl.constexpr,  # block-FP8 experts, scaled a 128-deep slice of K at a time (fp8.py)
    W8A8: tl.constexpr,  # ... on FP8 tensor cores, on the activations' codes (fp8.py)
    FP8_PLACED: tl.constexpr,  # ... weight-only, their code tiles in bf16 by bit placement
    STORE_H: tl.constexpr,  # h in x's dtype (W8A8 without down's LoRA by blocks needs codes only)
    TMA: tl.constexpr,  # weight tiles through w13_desc (MoeConfig.tma)
    PACK: tl.constexpr,
    A2_ALIGN: tl.constexpr,  # down's LoraWeights.a_align (its A2 read by the partial shrink)
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    BR: tl.constexpr,
    NUM_N: tl.constexpr,  # column blocks (_tile)
    GROUP_M: tl.constexpr,  # program order (MoeConfig.group_m)
    PDL: tl.constexpr,
):
    pdl_wait(PDL)  # first: see kernels/pdl.py
    # -- map the program to a block of pairs (one expert) and BN columns of gate and up --
    pid_m, pid_n = _tile(NUM_M, NUM_N, GROUP_M)
    expert, pair = _block_rows(pid_m, sorted_pair_ptr, expert_of_block_ptr, BM)
    if expert < 0:
        return
    row_ok = pair >= 0
    token = tl.where(row_ok, pair // K, 0)
    if HAS_LORA or HAS_LORA2:
        # the slots are gathered before the main loop so their latency hides behind the weight
        # stream; their flags, scalings and each module's rank after it (moe_lora.lora_rows,
        # module_rows). The step's
        # "any slot enabled" lets a batch without adapters skip the per-block test (a
        # cross-warp reduction) in the epilogue.
        slot_rows = tl.load(slot_ptr + token, mask=row_ok, other=-1)
        lora_on = tl.load(any_ptr) != 0
    offs_n = pid_n * BN + tl.arange(0, BN)
    n_ok = offs_n < I
    offs_k = tl.arange(0, BK)
    x_rows = token.to(tl.int64) * stride_xt
    w_e = w13_ptr + expert.to(tl.int64) * stride_we

    # -- main loop: both accumulators share each x tile --
    if MXFP4:
        acc_g, acc_u = gate_up_mxfp4_loop(
            x_ptr=x_ptr,
            x_rows=x_rows,
            row_ok=row_ok,
            w_e=w_e,
            s_e=w13_scale_ptr + expert.to(tl.int64) * stride_se,
            offs_n=offs_n,
            n_ok=n_ok,
            H=H,
            I=I,
            stride_wn=stride_wn,
            stride_sn=stride_sn,
            BM=BM,
            BN=BN,
            BK=BK,
            EXPAND=MXFP4_EXPAND,
            SUB_K=MXFP4_SUB_K,
        )
    elif FP8:
        acc_g, acc_u = gate_up_fp8_loop(
            x_ptr=x_ptr,
            x_rows=x_rows,
            row_ok=row_ok,
            w_e=w_e,
            s_e=w13_scale_ptr + expert.to(tl.int64) * stride_se,
            offs_n=offs_n,
            n_ok=n_ok,
            H=H,
            I=I,
            stride_wn=stride_wn,
            stride_sn=stride_sn,
            BM=BM,
            BN=BN,
            BK=BK,
            xq_ptr=xq_ptr,
            xs_ptr=xs_ptr,
            tokens=token.to(tl.int64),
            W8A8=W8A8,
            w_desc=w13_desc,
            w_row=expert * (2 * I) + pid_n * BN,
            TMA=TMA,
            PLACED=FP8_PLACED,
        )
    elif TMA:
        # W13's rows of this program's gate and up columns, as rows of the [E*2I, H] view:
        # the TMA zero-fills past H, and rows past I (a last column block of gate) belong to
        # columns the store masks
        w_row = expert * (2 * I) + pid_n * BN
        acc_g = tl.zeros((BM, BN), dtype=tl.float32)
        acc_u = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, H, BK):
            xt = tl.load(
                x_ptr + x_rows[:, None] + (k0 + offs_k)[None, :],
                mask=row_ok[:, None] & (offs_k < H - k0)[None, :],
                other=0.0,
            )
            acc_g = dot(xt, w13_desc.load([w_row, k0]).T, acc_g)
            acc_u = dot(xt, w13_desc.load([w_row + I, k0]).T, acc_u)
    else:
        wg_ptrs = w_e + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None]  # [BK, BN]
        wu_ptrs = wg_ptrs + I * stride_wn
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
        slot_on, scale_rows = lora_rows(slot_rows, enabled_ptr, scaling_ptr)
    if HAS_LORA:
        slot13, rank13 = module_rows(slot_rows, slot_on, tab13_ptr)
    if HAS_LORA2:
        slot2, rank2 = module_rows(slot_rows, slot_on, tab2_ptr)
    if HAS_LORA:
        if lora_on:  # a base-only step skips even the reduction of block_slots
            packed, any_rows = block_slots(slot13, rank13, PACK)
            if any_rows:
                offs_r = tl.arange(0, BR)
                xa_ptrs = xa13_ptr + pair[:, None] * 2 * BR + offs_r[None, :]
                on = (slot13 >= 0)[:, None]
                xa_g = tl.load(xa_ptrs, mask=on, other=0.0)
                xa_u = tl.load(xa_ptrs + BR, mask=on, other=0.0)
                acc_g, acc_u = expand_rows(
                    acc0=acc_g,
                    acc1=acc_u,
                    xa0=xa_g,
                    xa1=xa_u,
                    slot_rows=slot13,
                    rank_rows=rank13,
                    scale_rows=scale_rows,
                    packed=packed,
                    w_ptr=lora13_ptr,
                    tab_ptr=tab13_ptr,
                    expert=expert,
                    offs_n0=offs_n,
                    offs_n1=I + offs_n,
                    n_ok=n_ok,
                    S=S,
                    BR=BR,
                    TWO=True,
                    PACK=PACK,
                )

    # -- bias, activation and store --
    if HAS_BIAS:
        bias_e = bias_ptr + expert.to(tl.int64) * 2 * I
        acc_g += tl.load(bias_e + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        acc_u += tl.load(bias_e + I + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    if ACTIVATION == 1:
        gate = tl.minimum(acc_g, _LIMIT)
        up = tl.minimum(tl.maximum(acc_u, -_LIMIT), _LIMIT)
        h = (up + 1.0) * (gate / (1.0 + tl.exp(-_ALPHA * gate)))
    else:
        h = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
    h_rows = pid_m * BM + tl.arange(0, BM)
    h_offs = h_rows[:, None].to(tl.int64) * I + offs_n[None, :]
    # W8A8 quantizes h's float32 values: rounded to x's dtype first, the e4m3 rounding of a
    # value that lands on a midpoint would be a second one (the reference rounds once)
    if W8A8:  # the tile's BN columns are one of h's groups (_check_tiles)
        hq, h_scale = quantized_rows(h)
        tl.store(hq_ptr + h_offs, hq, mask=row_ok[:, None] & n_ok[None, :])
        tl.store(hs_ptr + h_rows.to(tl.int64) * (I // BN) + pid_n, h_scale, mask=row_ok)
    h = h.to(h_ptr.dtype.element_ty)
    if STORE_H:
        tl.store(h_ptr + h_offs, h, mask=row_ok[:, None] & n_ok[None, :])

    # -- this block's share of the down LoRA shrink: h[:, cols] @ A2[s, e, :, cols].T --
    if HAS_LORA2:
        if lora_on:
            packed, any_rows = block_slots(slot2, rank2, PACK)
            if any_rows:
                down_partial_shrink(
                    xa2_ptr=xa2_ptr,
                    pair=pair,
                    h=h,
                    slot_rows=slot2,
                    rank_rows=rank2,
                    packed=packed,
                    w_ptr=lora2_ptr,
                    tab_ptr=tab2_ptr,
                    expert=expert,
                    I=I,
                    offs_n=offs_n,
                    n_ok=n_ok,
                    S=S,
                    BM=BM,
                    BR=BR,
                    PACK=PACK,
                    A_ALIGN=A2_ALIGN,
                )


# --------------------------------------------------------------------------------------------
# 3. down GEMM + LoRA, weighted by the routing weight.
# --------------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["NUM_M"])  # one compile for every block count
def _down_kernel(
    # Pointers: activations, weights, output, routing, the align's blocks.
    h_ptr,  # [NB*BM, I], block rows
    hq_ptr,  # W8A8 only: h's codes and scales (the gate_up kernel's)
    hs_ptr,
    w2_ptr,  # [E, H, I]; with MXFP4 its code bytes [E, H, I/2] uint8; with FP8 its codes
    w2_scale_ptr,  # [E, H, I/32] uint8 with MXFP4; [E, H/128, I/128] float32 with FP8
    h_desc,  # TMA descriptors, only with TMA: h [NB*BM, I] in tiles [BM, BK],
    w2_desc,  # ... and w2 as [E*H, I] in tiles [BN, BK]
    out_ptr,  # [P, H]: w[pair] * (h @ W2[e].T + d2), one row per pair
    topk_weights_ptr,  # [P] float32
    sorted_pair_ptr,  # [NB*BM] int32: pair of each block row, -1 for padding
    expert_of_block_ptr,  # [NB] int32: -1 for unused blocks
    # Pointers: LoRA batch info, weights and scratch (unused unless HAS_LORA).
    slot_ptr,
    enabled_ptr,
    scaling_ptr,
    lora2_ptr,  # the arena of down's LoRA: slot s's B2 [(E | 1,) H, r] per tab2_ptr
    tab2_ptr,  # [S, TABLE_WIDTH] int64 (step/lora.LoraWeights.table)
    xa2_ptr,  # [P, BR] fp32: h @ A2.T of each pair with an enabled slot
    any_ptr,  # [1] int32: any slot enabled in this step (LoraBatchInfo.any_enabled)
    bias_ptr,  # [E, H], only with HAS_BIAS
    # Sizes.
    H,
    I,
    NUM_M,  # blocks (NB)
    # Strides (last dims contiguous).
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    # Meta-parameters.
    K: tl.constexpr,
    S: tl.constexpr,
    PACK: tl.constexpr,
    HAS_LORA: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    MXFP4: tl.constexpr,  # packed experts, expanded a tile at a time (mxfp4.py)
    MXFP4_EXPAND: tl.constexpr,  # ... how (_Experts.expand)
    MXFP4_SUB_K: tl.constexpr,  # ... in sub-tiles this deep (MoeConfig.mxfp4_sub_k)
    FP8: tl.constexpr,  # block-FP8 experts, scaled a 128-deep slice of K at a time (fp8.py)
    W8A8: tl.constexpr,  # ... on FP8 tensor cores, on the activations' codes (fp8.py)
    FP8_PLACED: tl.constexpr,  # ... weight-only, their code tiles in bf16 by bit placement
    TMA: tl.constexpr,  # tiles through h_desc and w2_desc (MoeConfig.tma)
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    BR: tl.constexpr,
    NUM_N: tl.constexpr,  # column blocks (_tile)
    GROUP_M: tl.constexpr,  # program order (MoeConfig.group_m)
    PDL: tl.constexpr,
):
    pdl_wait(PDL)  # first: see kernels/pdl.py
    # -- map the program to a block of pairs (one expert) and BN columns of the output --
    pid_m, pid_n = _tile(NUM_M, NUM_N, GROUP_M)
    expert, pair = _block_rows(pid_m, sorted_pair_ptr, expert_of_block_ptr, BM)
    if expert < 0:
        return
    row_ok = pair >= 0
    if HAS_LORA:  # the slots now, their flags and ranks after the main loop (moe_lora.lora_rows)
        slot_rows = tl.load(slot_ptr + tl.where(row_ok, pair // K, 0), mask=row_ok, other=-1)
        lora_on = tl.load(any_ptr) != 0
    offs_n = pid_n * BN + tl.arange(0, BN)
    n_ok = offs_n < H
    h_rows = pid_m * BM + tl.arange(0, BM)
    offs_k = tl.arange(0, BK)
    h_offs = h_rows.to(tl.int64) * I

    # -- main loop --
    if MXFP4:
        acc = down_mxfp4_loop(
            h_ptr=h_ptr,
            h_offs=h_offs,
            row_ok=row_ok,
            w_e=w2_ptr + expert.to(tl.int64) * stride_we,
            s_e=w2_scale_ptr + expert.to(tl.int64) * stride_se,
            offs_n=offs_n,
            n_ok=n_ok,
            I=I,
            stride_wn=stride_wn,
            stride_sn=stride_sn,
            BM=BM,
            BN=BN,
            BK=BK,
            EXPAND=MXFP4_EXPAND,
            SUB_K=MXFP4_SUB_K,
        )
    elif FP8:
        acc = down_fp8_loop(
            h_ptr=h_ptr,
            h_offs=h_offs,
            row_ok=row_ok,
            w_e=w2_ptr + expert.to(tl.int64) * stride_we,
            s_e=w2_scale_ptr + expert.to(tl.int64) * stride_se,
            offs_n=offs_n,
            n_ok=n_ok,
            I=I,
            stride_wn=stride_wn,
            stride_sn=stride_sn,
            BM=BM,
            BN=BN,
            BK=BK,
            hq_ptr=hq_ptr,
            hs_ptr=hs_ptr,
            h_rows=h_rows.to(tl.int64),
            W8A8=W8A8,
            w_desc=w2_desc,
            w_row=expert * H + pid_n * BN,
            TMA=TMA,
            PLACED=FP8_PLACED,
        )
    elif TMA:
        # the block's rows of h are contiguous: its padding rows are read unmasked (their
        # products land in rows the store masks); W2's rows past H, as for gate_up's TMA
        w_row = expert * H + pid_n * BN
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, I, BK):
            ht = h_desc.load([pid_m * BM, k0])
            acc = dot(ht, w2_desc.load([w_row, k0]).T, acc)
    else:
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

    # -- epilogue: LoRA delta (only blocks with an enabled slot), routing weight, store --
    if HAS_LORA:
        slot_on, scale_rows = lora_rows(slot_rows, enabled_ptr, scaling_ptr)
        slot2, rank2 = module_rows(slot_rows, slot_on, tab2_ptr)
        if lora_on:
            packed, any_rows = block_slots(slot2, rank2, PACK)
            if any_rows:
                offs_r = tl.arange(0, BR)
                xa = tl.load(
                    xa2_ptr + pair[:, None] * BR + offs_r[None, :],
                    mask=(slot2 >= 0)[:, None],
                    other=0.0,
                )
                acc, _ = expand_rows(
                    acc0=acc,
                    acc1=acc,
                    xa0=xa,
                    xa1=xa,
                    slot_rows=slot2,
                    rank_rows=rank2,
                    scale_rows=scale_rows,
                    packed=packed,
                    w_ptr=lora2_ptr,
                    tab_ptr=tab2_ptr,
                    expert=expert,
                    offs_n0=offs_n,
                    offs_n1=offs_n,
                    n_ok=n_ok,
                    S=S,
                    BR=BR,
                    TWO=False,
                    PACK=PACK,
                )
    if HAS_BIAS:
        bias = tl.load(bias_ptr + expert.to(tl.int64) * H + offs_n, mask=n_ok, other=0.0)
        acc += bias.to(tl.float32)[None, :]
    weight = tl.load(topk_weights_ptr + pair, mask=row_ok, other=0.0)
    out_ptrs = out_ptr + pair[:, None].to(tl.int64) * H + offs_n[None, :]
    out = (acc * weight[:, None]).to(out_ptr.dtype.element_ty)
    tl.store(out_ptrs, out, mask=row_ok[:, None] & n_ok[None, :])


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


@dataclass(frozen=True)
class _Half:
    """One half of the MoE LoRA (gate_up's or down's) as the launches take it."""

    on: bool
    arena: torch.Tensor  # LoraWeights.arena: every slot's factors, where table says
    table: torch.Tensor  # LoraWeights.table [S, TABLE_WIDTH] int64
    slices: int  # A's slices: 2 (gate, up) or 1 (down)
    a_align: int = 1  # LoraWeights.a_align


@dataclass(frozen=True)
class _Lora:
    """The MoE LoRA as the launches take it. Where a half, or the whole path, is off, its
    pointers are `unused` and its strides 0: the kernels' constexpr flags keep them unread."""

    gate_up: _Half
    down: _Half
    S: int  # slots
    BR: int  # rank tile
    PACK: bool  # the epilogues' slot walk reads one int64 (moe_lora.packed_walk)
    slot: torch.Tensor  # LoraBatchInfo.slot_of_token
    enabled: torch.Tensor  # .slot_enabled
    scaling: torch.Tensor  # .scaling_of_slot
    any_on: torch.Tensor  # .any_enabled
    unused: torch.Tensor  # the one placeholder for a pointer no kernel reads
    by_block: bool = False  # the shrinks run block by block (_by_block)

    @property
    def on(self) -> bool:
        return self.gate_up.on or self.down.on


@dataclass(frozen=True)
class _Experts:
    """One expert weight as a launch takes it: a tensor [E, N, K], MXFP4 code bytes
    [E, N, K/2] and scale bytes [E, N, K/32], or block-FP8 codes [E, N, K] and scales
    [E, N/128, K/128] (the scales `unused` for a tensor)."""

    w: torch.Tensor
    scales: torch.Tensor
    strides: tuple[int, int]  # expert, row (of w)
    scale_strides: tuple[int, int]  # expert, row (0, 0 for a tensor)
    mxfp4: bool
    # MXFP4 tiles: 0 by arithmetic; where inline PTX runs (bf16 on the GPU) and
    # MoeConfig.mxfp4_lut: 1 by table lookups, 2 by bit placement if the scales are small;
    # 3 by bit placement from the GPU layout (Mxfp4Weight.swizzled), whatever the config
    expand: int
    sub_k: int = 0  # the PTX expansions' sub-tile depth (MoeConfig.mxfp4_sub_k)
    tma: bool = False  # tiles through TMA descriptors (_tma)
    fp8: bool = False  # block-FP8 codes and scales
    w8a8: bool = False  # ... on FP8 tensor cores (MoeConfig.w8a8)
    fp8_placed: bool = False  # ... weight-only, the code tiles by bit placement (FP8_PLACED)

    def launch_args(self, name: str, block: tuple[int, int]) -> dict:
        """The GEMM kernels' weight arguments, by keyword: NAME_ptr, NAME_scale_ptr, the
        strides, the MXFP4 flags, and with TMA NAME_desc, w's [E*N, K] view in block tiles."""
        E, N, _ = self.w.shape
        return {
            f"{name}_desc": _desc(self.w, E * N, block) if self.tma else None,
            "TMA": self.tma,
            f"{name}_ptr": self.w,
            f"{name}_scale_ptr": self.scales,
            "stride_we": self.strides[0],
            "stride_wn": self.strides[1],
            "stride_se": self.scale_strides[0],
            "stride_sn": self.scale_strides[1],
            "MXFP4": self.mxfp4,
            "MXFP4_EXPAND": self.expand,
            "MXFP4_SUB_K": self.sub_k,
            "FP8": self.fp8,
            "W8A8": self.w8a8,
            "FP8_PLACED": self.fp8_placed,
        }


def _runs_ptx(x: torch.Tensor) -> bool:
    """Whether the weights' tiles may expand by inline PTX: bf16 activations on the GPU (the
    interpreter runs no PTX)."""
    return (
        x.dtype == torch.bfloat16
        and x.device.type == "cuda"
        and os.environ.get("TRITON_INTERPRET") != "1"
    )


def _experts(
    w: torch.Tensor | Mxfp4Weight | Fp8Weight,
    unused: torch.Tensor,
    x: torch.Tensor,
    cfg: MoeConfig,
) -> _Experts:
    if isinstance(w, Fp8Weight):  # TMA: the code tiles, through the codes' descriptor
        c, s = w.codes, w.scale_inv
        strides = (c.stride(0), c.stride(1)), (s.stride(0), s.stride(1))
        placed = FP8_PLACED and not cfg.w8a8 and _runs_ptx(x)
        fp8 = dict(fp8=True, w8a8=cfg.w8a8, tma=_tma(cfg, c), fp8_placed=placed)
        return _Experts(c, s, *strides, mxfp4=False, expand=0, **fp8)
    if isinstance(w, Mxfp4Weight):
        b, s = w.blocks, w.scales
        # the lookups and the bit placement are inline PTX (no interpreter) and give bf16
        # (mxfp4.lut_tile_dot)
        ptx = cfg.mxfp4_lut and _runs_ptx(x)
        expand = (2 if w.small_scales else 1) if ptx else 0
        if w.swizzled:  # the GPU layout is read by its own bit placement only
            if not (x.dtype == torch.bfloat16 and x.device.type == "cuda"):
                raise ValueError(
                    f"MXFP4 experts in the GPU layout (Mxfp4Weight.swizzled) take bfloat16 "
                    f"activations on CUDA, not {x.dtype} on {x.device.type}"
                )
            expand = 3
            # a tile reads its scales unmasked: its last must end within the padded row
            G, row = w.scales.shape[2], w.scales.stride(1)
            for bk in (cfg.block_k, cfg.block_k_down):
                if -(-G // (bk // MXFP4_GROUP)) * (bk // MXFP4_GROUP) > row:
                    raise ValueError(
                        f"MoeConfig tiles {bk} deep: the GPU layout's MXFP4 scale rows of {G} "
                        f"groups are padded to {row}, too few for them"
                    )
        strides = (b.stride(0), b.stride(1)), (s.stride(0), s.stride(1))
        return _Experts(b, s, *strides, True, expand, cfg.mxfp4_sub_k)
    return _Experts(w, unused, (w.stride(0), w.stride(1)), (0, 0), False, 0, tma=_tma(cfg, w))


@dataclass(frozen=True)
class _Pairs:
    """The T*K (token, expert) pairs as the GEMMs take them: the align's NB blocks of BM rows
    (one expert each), and the LoRA shrinks' scratch, one row per pair."""

    K: int
    weights: torch.Tensor  # [P] float32, the routing weight of each pair
    BM: int
    NB: int
    sorted_pair: torch.Tensor  # [NB*BM] int32
    expert_of_block: torch.Tensor  # [NB] int32
    xa13: torch.Tensor  # [P, 2, BR] fp32 x @ A13.T (unused without LoRA)
    xa2: torch.Tensor  # [P, BR] fp32 h @ A2.T (unused without LoRA)
    by_block: bool = False  # the shrinks run block by block (_block_shrink), not by pair


def _half(lora: LoraWeights | None, info: LoraBatchInfo | None, unused: torch.Tensor) -> _Half:
    if lora is None or info is None:
        return _Half(False, unused, unused, 0)
    table = lora.table
    assert table.shape[1] == TABLE_WIDTH and table.is_contiguous(), table.shape
    return _Half(True, lora.arena, table, len(lora.out_slices), lora.a_align)


def _by_block(gate_up_on: bool, P: int, S: int, deterministic: bool = False) -> bool:
    """Whether the shrinks run block by block (_block_shrink) rather than by pair: at every
    size where deterministic (the pair shrink sums a row otherwise, and down's by atomics)."""
    return gate_up_on and (deterministic or P >= BLOCK_SHRINK_FROM) and S <= 63


def deterministic_config(cfg: MoeConfig) -> MoeConfig:
    """The tiles of deterministic inference: DETERMINISTIC_BK deep in both GEMMs; only the
    rows and columns a tile covers follow the token count (a row's sum is the same whichever
    MMA shape its tile's rows take: tests/gpu's rows-alone test, from 1 row to 4096). A tile
    made deeper stages fewer tiles where the tuned stages no longer fit (_stages_within): the
    pipeline's depth changes no sum."""
    stages_down, bk = cfg.down_launch()[1], DETERMINISTIC_BK
    # a stage's bytes: gate_up's block of x and gate's and up's tiles, down's block of h and
    # w2's tile, as bf16 (FP8 and MXFP4 experts' tiles are smaller: the bound holds for them)
    return dataclasses.replace(
        cfg,
        w8a8=False,  # its rounding of the activations is the deterministic mode's to decide
        block_k=bk,
        block_k_down=bk,
        num_stages=_stages_within(cfg.num_stages, (cfg.block_m + 2 * cfg.block_n) * bk * 2),
        num_stages_down=_stages_within(stages_down, (cfg.block_m + cfg.block_n_down) * bk * 2),
    )


def _stages_within(stages: int, stage_bytes: int) -> int:
    """At most `stages` of `stage_bytes` each within STAGE_BYTES, and at least 2 (one stage
    would leave the loads unpipelined; no tuned tile needs fewer to fit)."""
    return max(2, min(stages, STAGE_BYTES // stage_bytes))


def _lora(
    lora13: LoraWeights | None,
    lora2: LoraWeights | None,
    info: LoraBatchInfo | None,
    unused: torch.Tensor,
    P: int,
    deterministic: bool = False,
) -> _Lora:
    """Both halves share the batch info; S and the rank tile come from whichever is present:
    the pool's, or where the shrinks run block by block the step's (LoraBatchInfo.rank_tile:
    there the tile changes no sum, only how many zero rank rows they carry)."""
    gate_up, down = _half(lora13, info, unused), _half(lora2, info, unused)
    if gate_up.on and down.on:
        assert lora13.max_rank == lora2.max_rank, (lora13.max_rank, lora2.max_rank)
        assert lora13.num_slots == lora2.num_slots, (lora13.num_slots, lora2.num_slots)
    either = lora13 if gate_up.on else (lora2 if down.on else None)
    on = either is not None
    S = either.num_slots if on else 1
    rank = either.max_rank if on else 16
    by_block = _by_block(gate_up.on, P, S, deterministic)
    if on and info.rank_tile and by_block:
        assert info.rank_tile <= rank, (info.rank_tile, rank)
        rank = info.rank_tile
    return _Lora(
        gate_up=gate_up,
        down=down,
        S=S,
        BR=rank_block(rank),
        PACK=on and packed_walk(S, rank),
        slot=info.slot_of_token if on else unused,
        enabled=info.slot_enabled if on else unused,
        scaling=info.scaling_of_slot if on else unused,
        any_on=info.any_enabled if on else unused,
        unused=unused,
        by_block=by_block,
    )


def _align(
    x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, E: int, BM: int, lora: _Lora
) -> _Pairs:
    """The align launch (past PMAX pairs, after moe_align's count launch): programs 0..NA-1
    group the pairs by expert; with LoRA, more programs of the same launch shrink each pair
    (moe_lora.pair_shrink), `splits` jobs a pair on at most MAX_SHRINK_PROGRAMS programs, each
    of which costs a base-only step a load. Only a launch with LoRA gets SHRINK_WARPS: they
    would slow down the align alone."""
    P = ids.numel()
    NB = num_blocks(P, E, BM)
    sorted_pair = torch.empty(NB * BM, dtype=torch.int32, device=x.device)
    expert_of_block = torch.empty(NB, dtype=torch.int32, device=x.device)
    xa13 = xa2 = lora.unused
    if lora.on:  # scratch only pairs with an enabled slot write and read
        xa13 = torch.empty(P, 2, lora.BR, dtype=torch.float32, device=x.device)
        xa2 = torch.empty(P, lora.BR, dtype=torch.float32, device=x.device)
    K = P // x.shape[0]
    splits = PAIR_SPLITS if P < HALF_SPLITS_FROM else PAIR_SPLITS // 2
    # from BLOCK_SHRINK_FROM pairs the shrink runs block by block after the align instead
    by_block = lora.by_block
    shrink = PairShrink(
        x=x,
        slot=lora.slot,
        enabled=lora.enabled,
        any_on=lora.any_on,
        arena13=lora.gate_up.arena,
        table13=lora.gate_up.table,
        xa13=xa13,
        xa2=xa2,
        K=K,
        has13=lora.gate_up.on,
        has2=lora.down.on,
        BR=lora.BR,
        BKS=pair_shrink_block_k(lora.BR, splits),
        splits=splits,
        a13_align=lora.gate_up.a_align,
        programs=min(P * splits, MAX_SHRINK_PROGRAMS) if lora.on and not by_block else 0,
        num_warps=SHRINK_WARPS,
    )
    launch_align(ids, sorted_pair, expert_of_block, E=E, BM=BM, shrink=shrink)
    pairs = _Pairs(K, weights, BM, NB, sorted_pair, expert_of_block, xa13, xa2, by_block)
    if by_block:
        _block_shrink(x, pairs, lora, lora.gate_up, pairs.xa13, block_rows=False)
    return pairs


def _block_shrink(
    rows: torch.Tensor,
    pairs: _Pairs,
    lora: _Lora,
    half: _Half,
    xa: torch.Tensor,
    *,
    block_rows: bool,
) -> None:
    """A shrink block by block at prefill sizes (moe_lora.block_shrink_kernel): gate_up's from
    x after the align (instead of the align's pair shrink programs), down's from h's block rows
    after gate_up (instead of gate_up's atomic adds). Below BLOCK_SHRINK_FROM pairs (only
    deterministic inference shrinks by block there) one program a block and slot: few blocks,
    each holding many slots."""
    slot_grid = pairs.weights.numel() < BLOCK_SHRINK_FROM
    block_shrink_kernel[(pairs.NB, lora.S if slot_grid else 1)](
        x_ptr=rows,
        sorted_pair_ptr=pairs.sorted_pair,
        expert_of_block_ptr=pairs.expert_of_block,
        slot_ptr=lora.slot,
        enabled_ptr=lora.enabled,
        any_ptr=lora.any_on,
        w_ptr=half.arena,
        tab_ptr=half.table,
        xa_ptr=xa,
        H=rows.shape[1],
        stride_xt=rows.stride(0),
        K=pairs.K,
        S=lora.S,
        HALVES=half.slices,
        BLOCK_ROWS=block_rows,
        SLOT_GRID=slot_grid,
        BM=pairs.BM,
        BK=_slot_shrink_k(half.slices, lora.BR) if slot_grid else BLOCK_SHRINK_K,
        BR=lora.BR,
        A_ALIGN=half.a_align,
        num_warps=4 if pairs.BM <= 64 else 8,
        **pdl_kwargs(rows.device),
    )


def _slot_shrink_k(halves: int, BR: int) -> int:
    """The slot shrink's input chunk: SLOT_SHRINK_K, halved while A's bf16 tile
    [BK, halves * BR] is past SLOT_SHRINK_TILE bytes, down to BLOCK_SHRINK_K."""
    bk = SLOT_SHRINK_K
    while bk > BLOCK_SHRINK_K and bk * halves * BR * 2 > SLOT_SHRINK_TILE:
        bk //= 2
    return bk


def _tma(cfg: MoeConfig, w: torch.Tensor) -> bool:
    """Whether the GEMMs take their tiles through TMA descriptors: MoeConfig.tma, for weights
    in x's dtype at 16-byte addresses whose rows are whole 16-byte units (the descriptors'
    alignment rules)."""
    return (
        cfg.tma
        and isinstance(w, torch.Tensor)
        and w.data_ptr() % 16 == 0
        and all(n * w.element_size() % 16 == 0 for n in w.shape[1:])
    )


def _desc(t: torch.Tensor, rows: int, block: tuple[int, int]) -> TensorDescriptor:
    """A TMA descriptor of contiguous t as a [rows, last dim] matrix, in tiles of block."""
    return TensorDescriptor(t, [rows, t.shape[-1]], [t.shape[-1], 1], list(block))


def _order(NB: int, num_n: int, cfg: MoeConfig) -> tuple[tuple[int, ...], dict]:
    """The grid and program-order arguments of a GEMM of NB blocks x num_n column blocks."""
    grid = (NB * num_n,) if cfg.group_m else (NB, num_n)
    return grid, dict(NUM_M=NB, NUM_N=num_n, GROUP_M=cfg.group_m)


def _gate_up(
    x: torch.Tensor,
    w13: torch.Tensor | Mxfp4Weight | Fp8Weight,
    pairs: _Pairs,
    lora: _Lora,
    cfg: MoeConfig,
    launch: dict,
    *,
    bias: torch.Tensor | None,
    activation: str,
) -> torch.Tensor:
    """h [NB*BM, I] = silu(gate) * up of each block row, gate_up's LoRA delta added before the
    activation; with down's LoRA each program also adds its columns' share of h @ A2.T. W8A8:
    (h, its codes, its scales), h written only where down's LoRA shrinks by block (reads h)."""
    _, I2, H = w13.shape
    I = I2 // 2
    h = torch.empty(pairs.NB * pairs.BM, I, dtype=x.dtype, device=x.device)
    xq, xs, hq, hs = _w8a8_codes(x, h, cfg, lora.unused)
    grid, order = _order(pairs.NB, cdiv(I, cfg.block_n), cfg)
    _gate_up_kernel[grid](
        x_ptr=x,
        **_experts(w13, lora.unused, x, cfg).launch_args("w13", (cfg.block_n, cfg.block_k)),
        h_ptr=h,
        xq_ptr=xq,
        xs_ptr=xs,
        hq_ptr=hq,
        hs_ptr=hs,
        STORE_H=not cfg.w8a8 or (pairs.by_block and lora.down.on),
        sorted_pair_ptr=pairs.sorted_pair,
        expert_of_block_ptr=pairs.expert_of_block,
        slot_ptr=lora.slot,
        enabled_ptr=lora.enabled,
        scaling_ptr=lora.scaling,
        lora13_ptr=lora.gate_up.arena,
        tab13_ptr=lora.gate_up.table,
        xa13_ptr=pairs.xa13,
        lora2_ptr=lora.down.arena,
        tab2_ptr=lora.down.table,
        xa2_ptr=pairs.xa2,
        any_ptr=lora.any_on,
        bias_ptr=lora.unused if bias is None else bias,
        H=H,
        I=I,
        stride_xt=x.stride(0),
        K=pairs.K,
        S=lora.S,
        HAS_LORA=lora.gate_up.on,
        HAS_LORA2=lora.down.on and not pairs.by_block,
        HAS_BIAS=bias is not None,
        ACTIVATION=ACTIVATIONS.index(activation),
        PACK=lora.PACK,
        A2_ALIGN=lora.down.a_align,
        BM=pairs.BM,
        BN=cfg.block_n,
        BK=cfg.block_k,
        BR=lora.BR,
        **order,
        **launch,
    )
    return (h, hq, hs) if cfg.w8a8 else h


def _w8a8_codes(x: torch.Tensor, h: torch.Tensor, cfg: MoeConfig, unused: torch.Tensor) -> tuple:
    """W8A8's (x's codes, x's scales, h's codes, h's scales buffers); unused where not W8A8."""
    if not cfg.w8a8:
        return unused, unused, unused, unused
    rows, I = h.shape
    hq = torch.empty(rows, I, dtype=torch.float8_e4m3fn, device=x.device)
    hs = torch.empty(rows, I // cfg.block_n, dtype=torch.float32, device=x.device)
    return *quantize_rows_fp8(x), hq, hs


def _down(
    h: torch.Tensor | tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    w2: torch.Tensor | Mxfp4Weight | Fp8Weight,
    pairs: _Pairs,
    lora: _Lora,
    cfg: MoeConfig,
    launch: dict,
    *,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """[P, H]: w[pair] * (h @ W2[e].T + d2), one row per pair; where the shrinks run block by
    block, down's (h @ A2.T) first. h: _gate_up's (W8A8: with h's codes and scales)."""
    h, hq, hs = h if isinstance(h, tuple) else (h, lora.unused, lora.unused)
    if pairs.by_block and lora.down.on:
        _block_shrink(h, pairs, lora, lora.down, pairs.xa2, block_rows=True)
    _, H, I = w2.shape
    pair_out = torch.empty(pairs.weights.numel(), H, dtype=h.dtype, device=h.device)
    warps, stages = cfg.down_launch()
    launch = launch | dict(num_warps=warps, num_stages=stages)
    grid, order = _order(pairs.NB, cdiv(H, cfg.block_n_down), cfg)
    experts = _experts(w2, lora.unused, h, cfg)
    tma_h = experts.tma and not experts.fp8  # FP8's loop reads h by pointers (or its codes)
    _down_kernel[grid](
        h_ptr=h,
        hq_ptr=hq,
        hs_ptr=hs,
        **experts.launch_args("w2", (cfg.block_n_down, cfg.block_k_down)),
        h_desc=_desc(h, h.shape[0], (pairs.BM, cfg.block_k_down)) if tma_h else None,
        out_ptr=pair_out,
        topk_weights_ptr=pairs.weights,
        sorted_pair_ptr=pairs.sorted_pair,
        expert_of_block_ptr=pairs.expert_of_block,
        slot_ptr=lora.slot,
        enabled_ptr=lora.enabled,
        scaling_ptr=lora.scaling,
        lora2_ptr=lora.down.arena,
        tab2_ptr=lora.down.table,
        xa2_ptr=pairs.xa2,
        any_ptr=lora.any_on,
        bias_ptr=lora.unused if bias is None else bias,
        H=H,
        I=I,
        K=pairs.K,
        S=lora.S,
        PACK=lora.PACK,
        HAS_LORA=lora.down.on,
        HAS_BIAS=bias is not None,
        BM=pairs.BM,
        BN=cfg.block_n_down,
        BK=cfg.block_k_down,
        BR=lora.BR,
        **order,
        **launch,
    )
    return pair_out


def _sum_topk(pair_out: torch.Tensor, out: torch.Tensor, K: int) -> None:
    """out[t] = the sum of token t's K rows of pair_out [T*K, H], in order (reference.sum_rows)."""
    T, H = out.shape
    BH = min(1024, next_power_of_2(H))
    _sum_topk_kernel[(T, cdiv(H, BH))](
        pair_out_ptr=pair_out, out_ptr=out, H=H, K=K, BH=BH, **pdl_kwargs(out.device)
    )


def fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor | Mxfp4Weight | Fp8Weight,
    w2: torch.Tensor | Mxfp4Weight | Fp8Weight,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    lora13: LoraWeights | None = None,
    lora2: LoraWeights | None = None,
    info: LoraBatchInfo | None = None,
    sum_topk: bool = True,
    b13: torch.Tensor | None = None,
    b2: torch.Tensor | None = None,
    activation: str = "silu",
    config: MoeConfig | None = None,
    deterministic: bool = False,
) -> torch.Tensor:
    """Semantics: out[t] = sum_k w[t,k] * (silu_and_mul(x[t] @ W13[e].T + d13) @ W2[e].T + d2);
    with b13 [E, 2I], b2 [E, H] and activation as reference.fused_moe has them.

    With sum_topk=False it returns the K weighted rows [T, K, H] unsummed (reference.sum_rows
    of them is out): the next rms_norm adds them, one launch fewer.

    x [T, H]; w13 [E, 2I, H]; w2 [E, H, I] (contiguous, x's dtype; or both Mxfp4Weight, H and
    I multiples of 32, or both Fp8Weight, read a tile at a time); topk_weights [T, K] float32;
    topk_ids [T, K] int32. lora13: gate_up's factors (slices (I, I) over H inputs, E experts),
    lora2: down's ((H,) over I), in x's dtype, each read through its own table (its own ranks,
    a factor shared by every expert stored once). Returns [T, H]. No host sync: capturable.
    deterministic: deterministic_config's tiles and the shrinks block by block at every size,
    so that a row's bits do not follow the token count.
    """
    T, K = x.shape[0], topk_ids.shape[1]
    E, H, I, kind = _expert_sizes(x, w13, w2, b13, b2)
    assert topk_ids.shape == topk_weights.shape == (T, K), (topk_ids.shape, topk_weights.shape)
    assert topk_ids.dtype == torch.int32 and topk_weights.dtype == torch.float32
    assert activation in ACTIVATIONS, activation
    _check_lora(lora13, (I, I), H, E, x.dtype)
    _check_lora(lora2, (H,), I, E, x.dtype)
    out = torch.empty(T, H, dtype=x.dtype, device=x.device)
    if T == 0:
        return out
    cfg = config or default_config(
        T, E, H, I, K, x.device, mxfp4=kind == "mxfp4", fp8=kind == "fp8"
    )
    if deterministic:  # a row's sums do not follow the token count (deterministic_config)
        cfg = deterministic_config(cfg)
    _check_tiles(cfg, kind, H, I)
    ids = topk_ids.contiguous().view(-1)
    weights = topk_weights.contiguous().view(-1)
    # ids stands for every pointer no kernel reads; it is int32 because the align kernel's LoRA
    # branch, compiled even where it never runs, loads slots and flags through its pointers
    lora = _lora(lora13, lora2, info, unused=ids, P=ids.numel(), deterministic=deterministic)
    launch = _launch_options(cfg, x.device)
    pairs = _align(x, ids, weights, E, cfg.block_m, lora)
    h = _gate_up(x, w13, pairs, lora, cfg, launch, bias=b13, activation=activation)
    pair_out = _down(h, w2, pairs, lora, cfg, launch, bias=b2)
    if not sum_topk:
        return pair_out.view(T, K, H)
    _sum_topk(pair_out, out, K)
    return out


def _kind(w: torch.Tensor | Mxfp4Weight | Fp8Weight) -> str:
    """How the GEMMs read an expert weight: "mxfp4", "fp8" or "dense"."""
    return "mxfp4" if isinstance(w, Mxfp4Weight) else "fp8" if isinstance(w, Fp8Weight) else "dense"


def _expert_sizes(
    x: torch.Tensor,
    w13: torch.Tensor | Mxfp4Weight | Fp8Weight,
    w2: torch.Tensor | Mxfp4Weight | Fp8Weight,
    b13: torch.Tensor | None,
    b2: torch.Tensor | None,
) -> tuple[int, int, int, str]:
    """(E, H, I, the experts' _kind, the same for both) of w13 [E, 2I, H] and w2 [E, H, I],
    checked against each other, x [T, H] and the biases."""
    H = x.shape[1]
    E, I2, _ = w13.shape
    I = I2 // 2
    assert w13.shape == (E, 2 * I, H) and w2.shape == (E, H, I), (x.shape, w13.shape, w2.shape)
    assert w13.is_contiguous() and w2.is_contiguous() and x.stride(1) == 1
    kind = _kind(w13)
    assert _kind(w2) == kind, (type(w13), type(w2))
    assert kind != "mxfp4" or (H % MXFP4_GROUP == 0 and I % MXFP4_GROUP == 0), (H, I)
    for bias, shape in ((b13, (E, 2 * I)), (b2, (E, H))):
        assert bias is None or (bias.shape == shape and bias.is_contiguous()), (shape, bias)
    return E, H, I, kind


def _check_tiles(cfg: MoeConfig, kind: str, H: int, I: int) -> None:
    """The tiles fit the experts' format: MXFP4's groups of 32, FP8's blocks of 128; W8A8's
    are one of the activations' groups deep (x's 128 columns, h's gate_up's width), so none
    may be ragged."""
    depths = (cfg.block_k, cfg.block_k_down)
    assert kind != "mxfp4" or all(bk % MXFP4_GROUP == 0 for bk in depths), cfg
    assert kind == "fp8" or not cfg.w8a8, cfg
    if not cfg.w8a8:
        assert kind != "fp8" or all(fp8_tiles_fit(bk) for bk in depths), cfg
        return
    assert H % FP8_BLOCK[1] == 0 and I % FP8_BLOCK[1] == 0, (H, I)
    # x's groups are 128 columns; gate_up's epilogue quantizes h a tile at a time, so h's
    # groups are its BN columns, and down's tiles are one such group deep
    assert cfg.block_n in W8A8_H_GROUPS and fp8_tiles_fit(cfg.block_k, FP8_BLOCK[1]), cfg
    assert fp8_tiles_fit(cfg.block_k_down, cfg.block_n), cfg


def _check_lora(
    lora: LoraWeights | None, slices: tuple[int, ...], K_in: int, E: int, dtype: torch.dtype
) -> None:
    """lora (where given) is the MoE linear of output `slices`, K_in inputs and E experts."""
    if lora is not None:
        shape = (tuple(lora.out_slices), lora.in_features, lora.num_experts, lora.arena.dtype)
        assert shape == (slices, K_in, E, dtype), (shape, slices, K_in, E, dtype)


def _launch_options(cfg: MoeConfig, device: torch.device) -> dict:
    """The GEMM launches' options: cfg's warps, stages and register cap, and PDL's."""
    launch = dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages, **cfg.register_limit())
    launch |= pdl_kwargs(device)
    return launch


def fused_moe_align(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    E: int,
    BM: int,
    lora13: LoraWeights | None = None,
    lora2: LoraWeights | None = None,
    info: LoraBatchInfo | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Step 1 of fused_moe alone, launched as fused_moe launches it (with LoRA, the pair shrink
    programs ride along): sorted_pair [NB*BM] and expert_of_block [NB] (moe_align.py). Arguments
    as fused_moe's; for benchmarks of the align launch."""
    ids = topk_ids.contiguous().view(-1)
    lora = _lora(lora13, lora2, info, unused=ids, P=ids.numel())
    pairs = _align(x, ids, topk_weights.contiguous().view(-1), E, BM, lora)
    return pairs.sorted_pair, pairs.expert_of_block
