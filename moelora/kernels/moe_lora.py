"""MoE-LoRA pieces that the grouped fused-MoE kernels call; each shrink is done once per pair.

Semantics (per (token, expert e) pair whose slot s is enabled):
  gate_up += scaling[s] * (x @ A13[s, e, i].T) @ B13[s, e, slice_i].T   (before the activation)
  down    += scaling[s] * (h @ A2[s, e].T) @ B2[s, e].T                   (before the top-k sum)

Algorithm. A shrink reads the whole input row (H or I long) but produces only `rank` numbers, so
repeating it in every column block of the GEMMs (as lora.lora_delta does) costs a serial loop
per program. Here it is split by who has the data anyway:
  - x @ A13.T: extra programs of the align kernel, one per pair (`pair_shrink`), write
    xa13 [P, 2, R] (fp32). Pairs without an enabled slot exit at once; so does the whole
    program when no slot is enabled. The same programs zero xa2 rows of their pair.
  - h @ A2.T: each gate_up program holds BN columns of h; it multiplies them by the matching
    BN columns of A2 and atomically adds the partial product into xa2 [P, R] (fp32).
  - both expands (`expand_rows`) run in the GEMM epilogues: per slot in the block, one B tile.
No scratch is read for a pair without an enabled slot, so none needs clearing.
"""

from __future__ import annotations

import triton
import triton.language as tl

from moelora.kernels.dot import dot


@triton.jit
def pair_shrink(
    pair,
    K,
    topk_ids_ptr,
    x_ptr,  # [T, H]
    stride_xt,
    H,
    slot_ptr,
    enabled_ptr,
    rank_ptr,
    a_ptr,  # A13 [S, E, 2, R, H]
    stride_as,
    stride_ae,
    stride_ai,
    stride_ar,
    xa13_ptr,  # [P, 2, BR] fp32 out
    xa2_ptr,  # [P, BR] fp32 out: zeroed for gate_up's atomic adds
    HAS13: tl.constexpr,
    HAS2: tl.constexpr,
    BR: tl.constexpr,
    BKS: tl.constexpr,
):
    """xa13[pair, i] = x[token] @ A13[s, e, i].T for the pair's enabled slot s; else nothing."""
    token = pair // K
    slot = tl.load(slot_ptr + token)
    if slot >= 0:
        if tl.load(enabled_ptr + slot) != 0:
            offs_r = tl.arange(0, BR)
            if HAS2:
                tl.store(xa2_ptr + pair * BR + offs_r, tl.zeros((BR,), dtype=tl.float32))
            if HAS13:
                expert = tl.load(topk_ids_ptr + pair)
                r_ok = offs_r < tl.load(rank_ptr + slot)
                a = a_ptr + slot * stride_as + expert.to(tl.int64) * stride_ae
                a = a + offs_r[:, None] * stride_ar
                offs_k = tl.arange(0, BKS)
                xa0 = tl.zeros((BR,), dtype=tl.float32)
                xa1 = tl.zeros((BR,), dtype=tl.float32)
                for k0 in range(0, H, BKS):
                    k_ok = offs_k < H - k0
                    xk = tl.load(x_ptr + token.to(tl.int64) * stride_xt + k0 + offs_k, mask=k_ok)
                    xk = xk.to(tl.float32)[None, :]
                    mask = r_ok[:, None] & k_ok[None, :]
                    a0 = tl.load(a + k0 + offs_k[None, :], mask=mask, other=0.0)
                    a1 = tl.load(a + stride_ai + k0 + offs_k[None, :], mask=mask, other=0.0)
                    xa0 += tl.sum(a0.to(tl.float32) * xk, axis=1)
                    xa1 += tl.sum(a1.to(tl.float32) * xk, axis=1)
                tl.store(xa13_ptr + pair * 2 * BR + offs_r, xa0)
                tl.store(xa13_ptr + pair * 2 * BR + BR + offs_r, xa1)


@triton.jit
def down_partial_shrink(
    xa2_ptr,  # [P, BR] fp32, zeroed by pair_shrink for pairs with an enabled slot
    pair,  # [BM]
    h,  # [BM, BN] this program's columns of h, in the dtype h is stored in
    slot_rows,  # [BM] from lora.active_slots
    a_ptr,  # A2 of slot 0 and this block's expert: [R, I] at slot stride stride_as
    stride_as,
    stride_ar,
    offs_n,
    n_ok,
    rank_ptr,
    S: tl.constexpr,
    BM: tl.constexpr,
    BR: tl.constexpr,
):
    """xa2[pair] += h[:, cols] @ A2[s, e, :, cols].T, per row's slot (the other columns' shares
    come from the other column blocks)."""
    offs_r = tl.arange(0, BR)
    part = tl.zeros((BM, BR), dtype=tl.float32)
    for s in range(0, S):
        rows_s = slot_rows == s
        if tl.max(rows_s.to(tl.int32), axis=0) > 0:
            r_ok = offs_r < tl.load(rank_ptr + s)
            at = tl.load(
                a_ptr + s * stride_as + offs_r[None, :] * stride_ar + offs_n[:, None],
                mask=n_ok[:, None] & r_ok[None, :],
                other=0.0,
            )  # [BN, BR]
            part = dot(tl.where(rows_s[:, None], h, 0.0).to(at.dtype), at, part)
    active = slot_rows >= 0
    tl.atomic_add(
        xa2_ptr + pair[:, None] * BR + offs_r[None, :], part, mask=active[:, None], sem="relaxed"
    )


@triton.jit
def expand_rows(
    acc,  # [BM, BN] fp32
    xa,  # [BM, BR] fp32 shrink of each row (zero past its slot's rank)
    slot_rows,  # [BM]
    b_ptr,  # B of slot 0 and this block's expert: [out, R]
    stride_bs,
    stride_bn,
    offs_n,
    n_ok,
    rank_ptr,
    scaling_ptr,
    S: tl.constexpr,
    BR: tl.constexpr,
):
    """acc[m] += scaling[s] * xa[m] @ B[s, cols].T for each row m of slot s."""
    offs_r = tl.arange(0, BR)
    for s in range(0, S):
        rows_s = slot_rows == s
        if tl.max(rows_s.to(tl.int32), axis=0) > 0:
            r_ok = offs_r < tl.load(rank_ptr + s)
            bt = tl.load(
                b_ptr + s * stride_bs + offs_n[None, :] * stride_bn + offs_r[:, None],
                mask=n_ok[None, :] & r_ok[:, None],
                other=0.0,
            )  # [BR, BN]
            xs = tl.where(rows_s[:, None], xa * tl.load(scaling_ptr + s), 0.0)
            acc = dot(xs.to(bt.dtype), bt, acc)
    return acc


def pair_shrink_block_k(max_rank: int) -> int:
    """Input chunk of pair_shrink: [BR, BKS] tiles of A, about 8K elements."""
    return max(64, 8192 // triton.next_power_of_2(max(max_rank, 16)))
