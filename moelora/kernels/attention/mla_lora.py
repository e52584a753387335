"""kv_b_proj's LoRA under absorbed MLA in Triton: the two rank-r corrections that
kernels/mla.absorbed_attention adds on either side of the attention in the latent space, with the
factors read through the slot table, so that no step's slots reach the host and a CUDA graph can
capture the launches.

Semantics, per token t whose slot s is enabled (the torch loops kernels/mla.lora_q_ and
lora_out_ are the oracle), with A [r, L] and B [Hh (N + V), r] slot s's factors (LoraWeights.
factors), B_k[h] = B[h (N + V) : h (N + V) + N] and B_v[h] the V rows after:
  query side:  q_lat[t, h] += scaling[s] * (q_nope[t, h] @ B_k[h]) @ A
  output side: out[t, h]   += scaling[s] * (o_lat[t, h] @ A.T) @ B_v[h].T

Algorithm
---------
One program owns one token and a block of BLOCK_H heads. It loads the token's slot first and
leaves at once when the token has none enabled, or when the slot's adapter has no kv_b_proj (the
module's rank in the table is 0): a base token, a disabled slot or a padded row costs a program
that exits. Otherwise it takes its heads one at a time. The query side shrinks the head's q_nope
against B_k [N, r] into u [r], then expands u through A, BLOCK_L latent columns at a time, into
q_lat in place. The output side shrinks o_lat against A, BLOCK_L columns at a time, into w [r],
then expands w through B_v [V, r] into out in place. Rows of A and columns of B past the module's
real rank are masked off, never read; every sum runs in float32 on factors read in the arena's
dtype.

The grid is (T, head blocks), shapes only, and no argument depends on the step's slots, so a
graph replays with new slot assignments written into the batch info.

Legend: T = tokens, Hh = heads, N = qk_nope_head_dim, V = v_head_dim, L = kv_lora_rank,
r = the slot's rank, RP = the pool's max rank padded to a power of two.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moelora.kernels.lora import TAB_A_OFF, TAB_B_OFF, TAB_B_ROW, TAB_RANK, aligned, lora_row
from moelora.kernels.pdl import pdl_kwargs, pdl_wait
from moelora.kernels.sizes import cdiv, next_power_of_2
from moelora.step.lora import TABLE_WIDTH, LoraBatchInfo, LoraWeights

# Heads a program takes in turn: first cut, not yet measured on a GPU. Fewer heads a program
# means more programs for a decode step's few tokens; each head rereads A from the cache.
BLOCK_H = 4
A_TILE = 4096  # elements of A a program holds at once: [RP, BLOCK_L]


@triton.jit
def _kv_b_factors(tab_ptr, w_ptr, slot, TW, A_ALIGN: tl.constexpr):
    """(A's pointer, B's pointer, B's row stride, the module's rank) of an enabled slot, from
    its row of the table; rank 0: the slot's adapter has no kv_b_proj. A's offset is a
    multiple of A_ALIGN (LoraWeights.a_align)."""
    entry = tab_ptr + slot * TW
    a_ptr = w_ptr + aligned(tl.load(entry + TAB_A_OFF), A_ALIGN)
    b_ptr = w_ptr + tl.load(entry + TAB_B_OFF)
    return a_ptr, b_ptr, tl.load(entry + TAB_B_ROW), tl.load(entry + TAB_RANK)


@triton.jit
def _mla_lora_q_kernel(
    # Pointers
    q_lat_ptr,  # [T, Hh, L] float32, updated in place
    q_nope_ptr,  # [T, Hh, N], its last dimension contiguous
    w_ptr,  # the arena: slot s's A [1, r, L] and B [Hh (N + V), r] where row s of the table says
    tab_ptr,  # [S, TW] int64 (step/lora.LoraWeights.table)
    slot_ptr,  # [>= T] int32
    enabled_ptr,  # [S] int32
    rank_ptr,  # [S] int32
    scaling_ptr,  # [S] float32
    # Sizes
    num_heads,
    nope_dim,
    head_rows,  # N + V: B's rows a head
    latent_dim,
    # Strides
    stride_qt,
    stride_qh,
    stride_ql,
    stride_nt,
    stride_nh,
    # Meta-parameters
    TW: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_L: tl.constexpr,
    RP: tl.constexpr,
    A_ALIGN: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_wait(PDL)  # first: see kernels/pdl.py
    # -- the token's slot; tokens without one leave at once ------------------------------------
    row = tl.program_id(0).to(tl.int64)
    slot, rank, scaling = lora_row(slot_ptr, enabled_ptr, rank_ptr, scaling_ptr, row)
    if rank == 0:
        return
    a_ptr, b_ptr, b_row, rank = _kv_b_factors(tab_ptr, w_ptr, slot, TW, A_ALIGN)
    if rank == 0:
        return
    offs_r = tl.arange(0, RP)
    offs_n = tl.arange(0, BLOCK_N)
    offs_l = tl.arange(0, BLOCK_L)
    r_ok = offs_r < rank
    n_ok = offs_n < nope_dim

    # -- each head: u = scaling * q_nope B_k [r], then q_lat += u A, BLOCK_L columns at a time --
    for i in tl.static_range(BLOCK_H):
        head = tl.program_id(1) * BLOCK_H + i
        if head < num_heads:
            q = tl.load(
                q_nope_ptr + row * stride_nt + head * stride_nh + offs_n, mask=n_ok, other=0.0
            )
            b = tl.load(
                b_ptr + (head * head_rows + offs_n)[:, None] * b_row + offs_r[None, :],
                mask=n_ok[:, None] & r_ok[None, :],
                other=0.0,
            )  # [BLOCK_N, RP]
            u = tl.sum(q.to(tl.float32)[:, None] * b.to(tl.float32), axis=0) * scaling  # [RP]
            q_lat_row = q_lat_ptr + row * stride_qt + head * stride_qh
            for start in range(0, latent_dim, BLOCK_L):
                cols = start + offs_l
                l_ok = cols < latent_dim
                a = tl.load(
                    a_ptr + offs_r[:, None] * latent_dim + cols[None, :],
                    mask=r_ok[:, None] & l_ok[None, :],
                    other=0.0,
                )  # [RP, BLOCK_L]
                delta = tl.sum(u[:, None] * a.to(tl.float32), axis=0)
                dst = q_lat_row + cols * stride_ql
                tl.store(dst, tl.load(dst, mask=l_ok) + delta, mask=l_ok)


@triton.jit
def _mla_lora_out_kernel(
    # Pointers
    out_ptr,  # [T, Hh, V] float32, updated in place (without ROUNDED)
    rounded_ptr,  # [T, Hh, V] contiguous: with ROUNDED every row's out (+ delta), rounded
    o_lat_ptr,  # [T, Hh, L] float32, its last dimension contiguous
    w_ptr,  # the arena: slot s's A [1, r, L] and B [Hh (N + V), r] where row s of the table says
    tab_ptr,  # [S, TW] int64 (step/lora.LoraWeights.table)
    slot_ptr,  # [>= T] int32
    enabled_ptr,  # [S] int32
    rank_ptr,  # [S] int32
    scaling_ptr,  # [S] float32
    # Sizes
    num_heads,
    nope_dim,
    v_dim,
    head_rows,  # N + V: B's rows a head
    latent_dim,
    # Strides
    stride_ot,
    stride_oh,
    stride_ov,
    stride_lt,
    stride_lh,
    # Meta-parameters
    TW: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_L: tl.constexpr,
    RP: tl.constexpr,
    A_ALIGN: tl.constexpr,
    ROUNDED: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_wait(PDL)  # first: see kernels/pdl.py
    # -- the token's slot; tokens without one leave at once (rounded first, with ROUNDED) -------
    row = tl.program_id(0).to(tl.int64)
    slot, rank, scaling = lora_row(slot_ptr, enabled_ptr, rank_ptr, scaling_ptr, row)
    if rank == 0:
        if ROUNDED:
            _round_rows(
                out_ptr,
                rounded_ptr,
                row,
                num_heads,
                v_dim,
                stride_ot,
                stride_oh,
                stride_ov,
                BLOCK_H,
                BLOCK_V,
            )
        return
    a_ptr, b_ptr, b_row, rank = _kv_b_factors(tab_ptr, w_ptr, slot, TW, A_ALIGN)
    if rank == 0:
        if ROUNDED:
            _round_rows(
                out_ptr,
                rounded_ptr,
                row,
                num_heads,
                v_dim,
                stride_ot,
                stride_oh,
                stride_ov,
                BLOCK_H,
                BLOCK_V,
            )
        return
    offs_r = tl.arange(0, RP)
    offs_v = tl.arange(0, BLOCK_V)
    offs_l = tl.arange(0, BLOCK_L)
    r_ok = offs_r < rank
    v_ok = offs_v < v_dim

    # -- each head: w = scaling * o_lat A.T [r], BLOCK_L columns at a time, then out += w B_v.T --
    for i in tl.static_range(BLOCK_H):
        head = tl.program_id(1) * BLOCK_H + i
        if head < num_heads:
            o_lat_row = o_lat_ptr + row * stride_lt + head * stride_lh
            w = tl.zeros([RP], dtype=tl.float32)
            for start in range(0, latent_dim, BLOCK_L):
                cols = start + offs_l
                l_ok = cols < latent_dim
                o = tl.load(o_lat_row + cols, mask=l_ok, other=0.0)
                a = tl.load(
                    a_ptr + offs_r[:, None] * latent_dim + cols[None, :],
                    mask=r_ok[:, None] & l_ok[None, :],
                    other=0.0,
                )  # [RP, BLOCK_L]
                w += tl.sum(a.to(tl.float32) * o.to(tl.float32)[None, :], axis=1)
            b = tl.load(
                b_ptr + (head * head_rows + nope_dim + offs_v)[:, None] * b_row + offs_r[None, :],
                mask=v_ok[:, None] & r_ok[None, :],
                other=0.0,
            )  # [BLOCK_V, RP]
            delta = tl.sum(b.to(tl.float32) * (w * scaling)[None, :], axis=1)
            dst = out_ptr + row * stride_ot + head * stride_oh + offs_v * stride_ov
            total = tl.load(dst, mask=v_ok) + delta
            if ROUNDED:
                rounded = rounded_ptr + (row * num_heads + head) * v_dim + offs_v
                tl.store(rounded, total.to(rounded_ptr.dtype.element_ty), mask=v_ok)
            else:
                tl.store(dst, total, mask=v_ok)


@triton.jit
def _round_rows(
    out_ptr,
    rounded_ptr,
    row,
    num_heads,
    v_dim,
    stride_ot,
    stride_oh,
    stride_ov,
    BLOCK_H: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """This program's heads of out's row, rounded into rounded (a token without a correction)."""
    offs_v = tl.arange(0, BLOCK_V)
    v_ok = offs_v < v_dim
    for i in tl.static_range(BLOCK_H):
        head = tl.program_id(1) * BLOCK_H + i
        if head < num_heads:
            src = out_ptr + row * stride_ot + head * stride_oh + offs_v * stride_ov
            dst = rounded_ptr + (row * num_heads + head) * v_dim + offs_v
            tl.store(dst, tl.load(src, mask=v_ok).to(rounded_ptr.dtype.element_ty), mask=v_ok)


def lora_q_(
    q_lat: torch.Tensor, q_nope: torch.Tensor, lora: LoraWeights, info: LoraBatchInfo
) -> None:
    """Semantics: kernels/mla.lora_q_'s: q_lat[t, h] += scaling[s] * (q_nope[t, h] @ B_k[h]) @ A
    for each token t whose slot s is enabled and has kv_b_proj's factors.

    q_lat [T, Hh, L] float32, updated in place; q_nope [T, Hh, N] (last dimension contiguous);
    lora: kv_b_proj's, A [1, r, L] and B [Hh (N + V), r] read through its table. Reads no
    device value on the host: a CUDA graph captures it."""
    T, Hh, N = q_nope.shape
    head_rows, RP, block_l = _check(q_lat, q_nope, lora, info)
    assert q_nope.stride(2) == 1, q_nope.stride()
    if T == 0:
        return
    _mla_lora_q_kernel[(T, cdiv(Hh, BLOCK_H))](
        q_lat_ptr=q_lat,
        q_nope_ptr=q_nope,
        w_ptr=lora.arena,
        tab_ptr=lora.table,
        slot_ptr=info.slot_of_token,
        enabled_ptr=info.slot_enabled,
        rank_ptr=info.rank_of_slot,
        scaling_ptr=info.scaling_of_slot,
        num_heads=Hh,
        nope_dim=N,
        head_rows=head_rows,
        latent_dim=lora.in_features,
        stride_qt=q_lat.stride(0),
        stride_qh=q_lat.stride(1),
        stride_ql=q_lat.stride(2),
        stride_nt=q_nope.stride(0),
        stride_nh=q_nope.stride(1),
        TW=TABLE_WIDTH,
        BLOCK_H=BLOCK_H,
        BLOCK_N=next_power_of_2(N),
        BLOCK_L=block_l,
        RP=RP,
        A_ALIGN=lora.a_align,
        num_warps=4,
        **pdl_kwargs(q_lat.device),
    )


def lora_out_(
    out: torch.Tensor,
    o_lat: torch.Tensor,
    lora: LoraWeights,
    info: LoraBatchInfo,
    *,
    rounded: torch.Tensor | None = None,
) -> None:
    """Semantics: kernels/mla.lora_out_'s: out[t, h] += scaling[s] * (o_lat[t, h] @ A.T) @
    B_v[h].T for each token t whose slot s is enabled and has kv_b_proj's factors; with
    rounded, every row of that rounded into it instead (out is then not written).

    out [T, Hh, V] float32, updated in place; o_lat [T, Hh, L] (last dimension contiguous);
    rounded [T, Hh, V] contiguous; lora as lora_q_'s. Reads no device value on the host: a
    CUDA graph captures it."""
    T, Hh, V = out.shape
    head_rows, RP, block_l = _check(o_lat, out, lora, info)
    assert o_lat.stride(2) == 1, o_lat.stride()
    assert rounded is None or (rounded.shape == out.shape and rounded.is_contiguous())
    if T == 0:
        return
    _mla_lora_out_kernel[(T, cdiv(Hh, BLOCK_H))](
        out_ptr=out,
        rounded_ptr=out if rounded is None else rounded,
        o_lat_ptr=o_lat,
        w_ptr=lora.arena,
        tab_ptr=lora.table,
        slot_ptr=info.slot_of_token,
        enabled_ptr=info.slot_enabled,
        rank_ptr=info.rank_of_slot,
        scaling_ptr=info.scaling_of_slot,
        num_heads=Hh,
        nope_dim=head_rows - V,
        v_dim=V,
        head_rows=head_rows,
        latent_dim=lora.in_features,
        stride_ot=out.stride(0),
        stride_oh=out.stride(1),
        stride_ov=out.stride(2),
        stride_lt=o_lat.stride(0),
        stride_lh=o_lat.stride(1),
        TW=TABLE_WIDTH,
        BLOCK_H=BLOCK_H,
        BLOCK_V=next_power_of_2(V),
        BLOCK_L=block_l,
        RP=RP,
        A_ALIGN=lora.a_align,
        ROUNDED=rounded is not None,
        num_warps=4,
        **pdl_kwargs(out.device),
    )


def _check(
    latent: torch.Tensor, head_side: torch.Tensor, lora: LoraWeights, info: LoraBatchInfo
) -> tuple[int, int, int]:
    """(B's rows a head, the rank tile, the latent tile) after checking a side's shapes:
    latent [T, Hh, L] (q_lat or o_lat), head_side [T, Hh, N or V]."""
    T, Hh, L = latent.shape
    assert head_side.shape[:2] == (T, Hh), (latent.shape, head_side.shape)
    assert lora.in_features == L and len(lora.out_slices) == 1, (lora.in_features, L)
    assert lora.num_experts == 0 and lora.out_features % Hh == 0, (lora.out_features, Hh)
    assert lora.table.is_contiguous(), lora.table.stride()
    assert info.slot_of_token.shape[0] >= T, (info.slot_of_token.shape, T)
    RP = next_power_of_2(lora.max_rank)
    return lora.out_features // Hh, RP, min(next_power_of_2(L), max(A_TILE // RP, 16))
