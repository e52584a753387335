"""RMSNorm (fused with the residual add) and per-head q/k norm fused with rotary, in Triton.

Semantics: see reference.rms_norm and reference.rope_qk; these have the same signatures and the
same rounding order, so that they replace ~45 tiny torch launches per decoder layer in a CUDA
graph without moving a single bit in bf16.

Algorithm. A norm program owns one row (N <= 8192) in one block of next_power_of_2(N) lanes:
it adds the residual and rounds the sum to the input dtype, reduces the squares in float32,
scales by rsqrt(mean + eps), rounds to the input dtype, multiplies by the weight and rounds
again, as torch's separate ops do. A rotary program owns one head of one token, q and k heads
in one grid: it loads the head's D values twice, once in place and once shifted by D/2, which
gives rotate_half without a shuffle (x_rot[d] = -x[d + D/2] for d < D/2, x[d - D/2] after),
normalizes both copies with the same row scale, then forms x * cos + x_rot * sin, each product
and the sum rounded to the input dtype.

The attention's LoRA, folded in (rms_norm_lora, rope_qk's lora): the input norm also shrinks
its output for q|k|v, each row's n * R shrink rows spread over programs that each redo the
cheap norm; rotary expands that shrink into each q, k and v head first (the delta rounded, then
added, as PEFT does) and swaps the halves of the head's delta for the partner lanes; the norm
after attention expands o's split shrink into the row before the residual add.

Rounding. Every op is computed in float32 and rounded once to the input dtype, which is what
torch's elementwise kernels do for bf16 and fp16 (a product of two bf16 is exact in float32).
The kernels are compiled without fp fusion so that float32 inputs are not contracted to an FMA
that torch's separate mul and add never form; only the sum of squares differs in order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moelora.kernels.lora import lora_slot
from moelora.kernels.pdl import pdl_kwargs, pdl_wait
from moelora.step.lora import LoraBatchInfo, LoraWeights

SHRINK_WIDE_T = 32  # rows from which a norm program shrinks twice the rank rows

# Legend: T = tokens, N = row width, Hq/Hkv = query/kv heads, D = head dim, L = table rows.


@triton.jit
def _rms_norm_kernel(
    # Pointers.
    x_ptr,  # [T, KX, N], strides stride_xt and stride_xk, last dim contiguous
    res_ptr,  # [T, N] or x_ptr when HAS_RESIDUAL is False (never read then)
    weight_ptr,  # [N], x's dtype
    out_ptr,  # [T, N] contiguous
    sum_ptr,  # [T, N] contiguous, x + residual; unused without a residual
    # LoRA shrink (SHRINK; x_ptr when unused): batch info ([T] int32, [S] int32, [S] int32,
    # [S] float32), the A of the projection that reads out [S, NS, R, N] and the shrink
    # [T, NS, R] float32, written for rows with an enabled slot only.
    slot_ptr,
    enabled_ptr,
    rank_ptr,
    scaling_ptr,
    a_ptr,
    shrunk_ptr,
    # LoRA expand (DELTA; x_ptr when unused): the partial shrinks of the projection that
    # produced x [T, KS, 1, R] float32 (paged_attention_lora) and its B [S, N, R].
    part_ptr,
    b_ptr,
    # Sizes and strides.
    N,
    stride_xt,
    stride_xk,
    stride_rt,
    eps,
    # Meta-parameters.
    KX: tl.constexpr,  # rows of x added first: the MoE's top-k rows (1: x is the row)
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
    SHRINK: tl.constexpr,
    DELTA: tl.constexpr,
    NS: tl.constexpr,
    R: tl.constexpr,
    RC: tl.constexpr,
    KS: tl.constexpr,
    KS_PAD: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_wait(PDL)  # first: see kernels/pdl.py
    # -- map the program to its row; with SHRINK, also to RC of the row's NS * R shrink rows --
    row = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    dtype = out_ptr.dtype.element_ty

    if SHRINK or DELTA:
        slot_in = tl.load(slot_ptr + row)
    if SHRINK:
        if g > 0:
            # only program 0 of a row has work without an adapter: the norm itself
            _, rank_g, _ = lora_slot(slot_in, enabled_ptr, rank_ptr, scaling_ptr)
            if rank_g == 0:
                return

    # -- the residual add, rounded to x's dtype like torch's add --
    # (the slot first, the row next, then the slot's flag and rank: in-order issue would
    # otherwise hold the row's loads behind the slot's two dependent gathers)
    if KX == 1:
        x = tl.load(x_ptr + row * stride_xt + offs, mask=mask, other=0.0)
    else:
        # the MoE's top-k rows, added as its own sum would: in k order, in fp32, then rounded
        x_sum = tl.zeros((BLOCK,), dtype=tl.float32)
        for k in tl.static_range(KX):
            xk = tl.load(x_ptr + row * stride_xt + k * stride_xk + offs, mask=mask, other=0.0)
            x_sum += xk.to(tl.float32)
        x = x_sum.to(dtype)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_rt + offs, mask=mask, other=0.0)
    w = tl.load(weight_ptr + offs, mask=mask, other=0.0)
    if SHRINK or DELTA:
        slot, rank, scaling = lora_slot(slot_in, enabled_ptr, rank_ptr, scaling_ptr)
    if SHRINK:
        offs_j = g * RC + tl.arange(0, RC)
        j_ok = (offs_j % R < rank) & (offs_j < NS * R)
        a = tl.load(
            a_ptr + slot * NS * R * N + offs_j[:, None] * N + offs[None, :],
            mask=j_ok[:, None] & mask[None, :],
            other=0.0,
        )  # [RC, BLOCK] this program's tile of A
    # -- the LoRA of the projection that produced x: sum its partial shrinks, expand the row --
    # RC rank rows per step, unrolled: every step's loads can be in flight at once.
    if DELTA:
        if rank > 0:
            delta = tl.zeros((BLOCK,), dtype=tl.float32)
            offs_ks = tl.arange(0, KS_PAD)
            for r0 in tl.static_range(0, R, RC):
                offs_r = r0 + tl.arange(0, RC)
                r_ok = offs_r < rank
                part = tl.load(
                    part_ptr + (row * KS + offs_ks[:, None]) * R + offs_r[None, :],
                    mask=(offs_ks[:, None] < KS) & r_ok[None, :],
                    other=0.0,
                )  # [KS, RC], already scaled
                b = tl.load(
                    b_ptr + slot * N * R + offs[:, None] * R + offs_r[None, :],
                    mask=mask[:, None] & r_ok[None, :],
                    other=0.0,
                )  # [BLOCK, RC]
                delta += tl.sum(b.to(tl.float32) * tl.sum(part, axis=0)[None, :], axis=1)
            # PEFT's order: the delta is rounded to x's dtype, then added
            x = (x.to(tl.float32) + delta.to(dtype).to(tl.float32)).to(dtype)
    if HAS_RESIDUAL:
        x = (x.to(tl.float32) + r.to(tl.float32)).to(dtype)
        if g == 0:
            tl.store(sum_ptr + row * N + offs, x, mask=mask)
    elif DELTA:
        tl.store(sum_ptr + row * N + offs, x, mask=mask)  # s is x, which the delta changed

    # -- the norm in float32; masked lanes are 0 and add nothing to the sum of squares --
    h = x.to(tl.float32)
    scale = tl.rsqrt(tl.sum(h * h, axis=0) / N + eps)
    normed = (h * scale).to(dtype)

    # -- the weight multiplies the rounded norm, and the product is rounded again --
    out = (w.to(tl.float32) * normed.to(tl.float32)).to(dtype)
    if g == 0:
        tl.store(out_ptr + row * N + offs, out, mask=mask)

    # -- this program's rows of out @ A.T, scaled; zeros past the rank (a whole shrink row) --
    if SHRINK:
        if rank > 0:
            s_j = tl.sum(a.to(tl.float32) * out.to(tl.float32)[None, :], axis=1) * scaling
            tl.store(shrunk_ptr + row * NS * R + offs_j, s_j, mask=offs_j < NS * R)


def _check_rows(x: torch.Tensor, residual: torch.Tensor | None) -> tuple[int, int]:
    """(KX, stride_xk) of x [T, N] or [T, KX, N] (the MoE's top-k rows); checks residual."""
    T, N = x.shape[0], x.shape[-1]
    assert x.dim() in (2, 3) and x.stride(-1) == 1, (x.shape, x.stride())
    assert x.dim() == 2 or residual is not None, "top-k rows are added into a residual"
    if residual is not None:
        assert residual.shape == (T, N) and residual.dtype == x.dtype, (residual.shape, x.shape)
        assert residual.stride(-1) == 1, residual.stride()
    return (x.shape[1], x.stride(1)) if x.dim() == 3 else (1, 0)


def _norm_warps(BLOCK: int, x: torch.Tensor) -> int:
    """A warp per 512 lanes of the row, up to 8; twice that when the row is the sum of the
    MoE's top-k rows: one program reads all K of them, and at a token or a few that is the
    whole launch, bound by how many loads it has in flight."""
    warps = min(max(BLOCK // 512, 1), 8)
    return min(2 * warps, 16) if x.dim() == 3 else warps


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Semantics: see reference.rms_norm: s = sum_rows(x) + residual (sum_rows(x) alone when
    None); out = weight * rmsnorm(s).

    x: [T, N], or [T, KX, N] rows to add first (the MoE's top-k rows: their sum needs no
    launch of its own), rows may be strided, the last dim contiguous; residual: [T, N] (needed
    with KX rows), same dtype; weight: [N] in x's dtype. Returns (out [T, N] contiguous, s): s
    is x itself without a residual, else a new contiguous tensor.
    """
    T, N = x.shape[0], x.shape[-1]
    KX, stride_xk = _check_rows(x, residual)
    assert weight.shape == (N,) and weight.dtype == x.dtype, (weight.shape, weight.dtype, x.dtype)
    assert weight.is_contiguous()
    out = torch.empty(T, N, dtype=x.dtype, device=x.device)
    s = x if residual is None else torch.empty(T, N, dtype=x.dtype, device=x.device)
    if T == 0:
        return out, s
    BLOCK = triton.next_power_of_2(N)
    res = x if residual is None else residual
    _rms_norm_kernel[(T, 1)](
        x, res, weight, out, s, *[x] * 8,
        N, x.stride(0), stride_xk, res.stride(0), eps,
        KX=KX, HAS_RESIDUAL=residual is not None, BLOCK=BLOCK,
        SHRINK=False, DELTA=False, NS=1, R=1, RC=1, KS=1, KS_PAD=1,
        num_warps=_norm_warps(BLOCK, x), enable_fp_fusion=False, **pdl_kwargs(x.device),
    )  # fmt: skip
    return out, s


def _rank_rows_per_step(T: int, rows: int, BLOCK: int, num_warps: int, shrink: bool) -> int:
    """RC rank rows per step (for the shrink: per program), a [RC, BLOCK] tile of A (or
    [BLOCK, RC] of B), at most 64 values a lane. Below SHRINK_WIDE_T rows a shrink takes at
    most 32, so that more programs read a row's A at once, each redoing the row's norm from L2:
    at a token or a few they are the whole launch, bound by how many loads each has in flight.
    From SHRINK_WIDE_T rows on there are programs enough, and each one's norm (the KX top-k
    rows, the residual and the weight: 40 KB at Qwen3's top 8) costs more L2 traffic than its
    tile of A."""
    per_lane = 64 if not shrink or T >= SHRINK_WIDE_T else 32
    return max(1, min(triton.next_power_of_2(rows), per_lane * 32 * num_warps // BLOCK))


def rms_norm_lora(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None,
    info: LoraBatchInfo,
    *,
    shrink: LoraWeights | None = None,
    delta: tuple[torch.Tensor, LoraWeights] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """rms_norm with the LoRA of the projections on either side of it folded in.

    Semantics: see reference.rms_norm_lora. x, residual: as rms_norm's; shrink.a
    [S, n, R, N] contiguous; delta = (partial shrinks [T, KS, 1, R] float32 from lora_shrink_split,
    LoRA weights with b [S, N, R] contiguous). Rows of shrunk whose token has no enabled slot
    are left unwritten (readers check the slot first). Returns (out, s, shrunk [T, n, R]
    float32, or None without shrink).

    Why here: neither half needs a launch of its own (a base-only batch pays one gather per
    row). Each row's n * R shrink rows are spread over programs, RC each, because one program
    reading a whole slot's A is bound by its own load latency (about 18 µs for 196 KB).
    """
    T, N = x.shape[0], x.shape[-1]
    KX, stride_xk = _check_rows(x, residual)
    assert weight.shape == (N,) and weight.dtype == x.dtype, (weight.shape, weight.dtype, x.dtype)
    assert info.slot_of_token.shape[0] >= T, (info.slot_of_token.shape, T)
    NS, R, KS = 1, 1, 1
    if shrink is not None:
        _, NS, R, N_a = shrink.a.shape
        assert N_a == N and shrink.a.is_contiguous(), (shrink.a.shape, N)
    if delta is not None:
        part, lora_in = delta
        S, R_d = lora_in.b.shape[0], lora_in.b.shape[2]
        assert lora_in.b.shape == (S, N, R_d) and lora_in.b.is_contiguous(), lora_in.b.shape
        assert part.shape[0] == T and part.shape[2:] == (1, R_d), (part.shape, T, R_d)
        assert part.is_contiguous() and part.dtype == torch.float32, (part.stride(), part.dtype)
        assert shrink is None or R_d == R, (R_d, R)
        R, KS = R_d, part.shape[1]
    out = torch.empty(T, N, dtype=x.dtype, device=x.device)
    s = (
        torch.empty(T, N, dtype=x.dtype, device=x.device)
        if residual is not None or delta is not None
        else x
    )
    shrunk = (
        torch.empty(T, NS, R, dtype=torch.float32, device=x.device) if shrink is not None else None
    )
    if T == 0:
        return out, s, shrunk
    BLOCK = triton.next_power_of_2(N)
    num_warps = _norm_warps(BLOCK, x)
    if delta is not None:
        # the expand's B tiles [BLOCK, RC] are loaded one after another by the row's one
        # program: twice the warps halve the steps
        num_warps = min(2 * num_warps, 16)
    RC = _rank_rows_per_step(T, NS * R, BLOCK, num_warps, shrink is not None)
    res = x if residual is None else residual
    _rms_norm_kernel[(T, triton.cdiv(NS * R, RC) if shrink is not None else 1)](
        x, res, weight, out, s,
        info.slot_of_token, info.slot_enabled, info.rank_of_slot, info.scaling_of_slot,
        shrink.a if shrink is not None else x, shrunk if shrunk is not None else x,
        delta[0] if delta is not None else x, delta[1].b if delta is not None else x,
        N, x.stride(0), stride_xk, res.stride(0), eps,
        KX=KX, HAS_RESIDUAL=residual is not None, BLOCK=BLOCK,
        SHRINK=shrink is not None, DELTA=delta is not None, NS=NS, R=R, RC=RC, KS=KS,
        KS_PAD=triton.next_power_of_2(KS),
        num_warps=num_warps, enable_fp_fusion=False, **pdl_kwargs(x.device),
    )  # fmt: skip
    return out, s, shrunk


@triton.jit
def _lora_expand_head(shrunk_ptr, b_ptr, t, rank, slice_i, col0, R: tl.constexpr,
                      RC: tl.constexpr, D: tl.constexpr):  # fmt: skip
    """(d, d_rot), [D] float32 each: d = shrunk[t, slice_i] @ B[col0 : col0 + D].T over the
    real rank (b_ptr: the slot's B, [out, R]) and d_rot = d with its halves swapped, the
    rotate_half partner of each lane. D is a power of two."""
    HALF: tl.constexpr = D // 2
    ii = tl.arange(0, 2)
    cols = col0 + ii[:, None] * HALF + tl.arange(0, HALF)[None, :]  # [2, HALF]
    d2 = tl.zeros((2, HALF), dtype=tl.float32)
    for r0 in tl.static_range(0, R, RC):
        offs_r = r0 + tl.arange(0, RC)
        r_ok = offs_r < rank
        s_r = tl.load(shrunk_ptr + (t * 3 + slice_i) * R + offs_r, mask=r_ok, other=0.0)
        b = tl.load(
            b_ptr + cols[:, :, None] * R + offs_r[None, None, :],
            mask=r_ok[None, None, :],
            other=0.0,
        )  # [2, HALF, RC]
        d2 += tl.sum(b.to(tl.float32) * s_r[None, None, :], axis=2)
    # the swap picks the other half's value plus an exact zero: no rounding, no second load
    other = ii[:, None, None] != ii[None, :, None]  # [2, 2, 1]
    d2_rot = tl.sum(tl.where(other, d2[None, :, :], 0.0), axis=1)
    return tl.reshape(d2, (D,)), tl.reshape(d2_rot, (D,))


@triton.jit
def _rope_qk_kernel(
    # Pointers.
    q_ptr,  # [T, Hq, D], strides (stride_qt, stride_qh, 1)
    k_ptr,  # [T, Hkv, D], strides (stride_kt, stride_kh, 1)
    v_ptr,  # [T, Hkv, D], strides (stride_vt, stride_vh, 1); q_ptr without STORE_KV
    pos_ptr,  # [T] int64
    cos_ptr,  # [L, D] float32, row stride stride_cl
    sin_ptr,  # [L, D] float32, row stride stride_sl
    q_norm_ptr,  # [D] in q's dtype, or q_ptr when HAS_NORM is False (never read then)
    k_norm_ptr,  # [D] likewise
    q_out_ptr,  # [T, Hq, D] contiguous
    k_out_ptr,  # [T, Hkv, D] contiguous
    k_cache_ptr,  # [num_pages, page_size, Hkv, D], strides (stride_cp, stride_cs, stride_ch, 1)
    v_cache_ptr,  # the same strides; both q_ptr without STORE_KV
    slot_ptr,  # [T] int64, -1 = do not store; pos_ptr without STORE_KV
    # LoRA (LORA): batch info as in _rms_norm_kernel, the q|k|v shrink [T, 3, R] float32 and
    # the q|k|v B [S, (Hq + 2 Hkv) D, R]; pos_ptr when unused.
    lslot_ptr,
    enabled_ptr,
    rank_ptr,
    scaling_ptr,
    shrunk_ptr,
    lb_ptr,
    # Sizes and strides.
    Hq,
    Hkv,
    D,
    page_size,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cl,
    stride_sl,
    stride_cp,
    stride_cs,
    stride_ch,
    stride_lbs,
    eps,
    # Meta-parameters.
    HAS_NORM: tl.constexpr,
    STORE_KV: tl.constexpr,
    BLOCK_D: tl.constexpr,
    LORA: tl.constexpr,
    R: tl.constexpr,
    RC: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_wait(PDL)  # first: see kernels/pdl.py
    # -- map the program to one head of one token: q heads, then k heads, then v heads --
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    offs = tl.arange(0, BLOCK_D)
    mask = offs < D
    dtype = q_out_ptr.dtype.element_ty
    half = D // 2
    partner = (offs + half) % D
    if LORA:
        lslot_in = tl.load(lslot_ptr + t)  # asked for first: its flag and rank depend on it
        # this head's slice of q|k|v (its columns start at h * D: v heads come last, as in
        # the grid)
        slice_i = (h >= Hq).to(tl.int32) + (h >= Hq + Hkv).to(tl.int32)

    # -- the cache row of this token, as store_kv computes it; padded rows (-1) store nothing --
    if STORE_KV:
        slot = tl.load(slot_ptr + t)
        cache_row = (slot // page_size) * stride_cp + (slot % page_size) * stride_cs
        store_mask = mask & (slot >= 0)
        if h >= Hq + Hkv:
            # v heads are only copied; they have no other output
            hv = h - Hq - Hkv
            x_v = tl.load(v_ptr + t * stride_vt + hv * stride_vh + offs, mask=store_mask)
            if LORA:
                lslot, rank, lscale = lora_slot(lslot_in, enabled_ptr, rank_ptr, scaling_ptr)
                lb_row = lb_ptr + lslot * stride_lbs
                if rank > 0:
                    d_v, d_unused = _lora_expand_head(shrunk_ptr, lb_row, t, rank, slice_i, h * D,
                                               R, RC, BLOCK_D)  # fmt: skip
                    x_v = (x_v.to(tl.float32) + d_v.to(dtype).to(tl.float32)).to(dtype)
            v_dst = v_cache_ptr + cache_row + hv * stride_ch + offs
            tl.store(v_dst, x_v.to(v_cache_ptr.dtype.element_ty), mask=store_mask)
            return

    if h < Hq:
        src = q_ptr + t * stride_qt + h * stride_qh
        dst = q_out_ptr + (t * Hq + h) * D
        norm_w = q_norm_ptr
    else:
        src = k_ptr + t * stride_kt + (h - Hq) * stride_kh
        dst = k_out_ptr + (t * Hkv + (h - Hq)) * D
        norm_w = k_norm_ptr

    # -- the head in place and its rotate_half partner, D/2 lanes away --
    x = tl.load(src + offs, mask=mask, other=0.0).to(tl.float32)
    x_rot = tl.load(src + partner, mask=mask, other=0.0).to(tl.float32)

    # -- the q|k|v projection's LoRA, expanded into this head (and its partner lanes) --
    if LORA:
        lslot, rank, lscale = lora_slot(lslot_in, enabled_ptr, rank_ptr, scaling_ptr)
        lb_row = lb_ptr + lslot * stride_lbs
        if rank > 0:
            d, d_rot = _lora_expand_head(shrunk_ptr, lb_row, t, rank, slice_i, h * D, R, RC,
                                         BLOCK_D)  # fmt: skip
            x = (x + d.to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
            x_rot = (x_rot + d_rot.to(dtype).to(tl.float32)).to(dtype).to(tl.float32)

    # -- per-head RMSNorm of both copies with the one row scale (reference.rms_norm's order) --
    if HAS_NORM:
        scale = tl.rsqrt(tl.sum(x * x, axis=0) / D + eps)
        w = tl.load(norm_w + offs, mask=mask, other=0.0).to(tl.float32)
        w_rot = tl.load(norm_w + partner, mask=mask, other=0.0).to(tl.float32)
        x = (w * (x * scale).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
        x_rot = (w_rot * (x_rot * scale).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    x_rot = tl.where(offs < half, -x_rot, x_rot)

    # -- x * cos + rotate_half(x) * sin with the tables rounded to x's dtype first --
    pos = tl.load(pos_ptr + t)
    c = tl.load(cos_ptr + pos * stride_cl + offs, mask=mask, other=0.0).to(dtype).to(tl.float32)
    s = tl.load(sin_ptr + pos * stride_sl + offs, mask=mask, other=0.0).to(dtype).to(tl.float32)
    a = (x * c).to(dtype).to(tl.float32)
    b = (x_rot * s).to(dtype).to(tl.float32)
    out = (a + b).to(dtype)
    tl.store(dst + offs, out, mask=mask)

    # -- the rotated k, rounded to x's dtype first, is what store_kv would cache from k_out --
    if STORE_KV:
        if h >= Hq:
            k_dst = k_cache_ptr + cache_row + (h - Hq) * stride_ch + offs
            tl.store(k_dst, out.to(k_cache_ptr.dtype.element_ty), mask=store_mask)


def rope_qk(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    q_norm: torch.Tensor | None,
    k_norm: torch.Tensor | None,
    eps: float,
    *,
    v: torch.Tensor | None = None,
    k_cache: torch.Tensor | None = None,
    v_cache: torch.Tensor | None = None,
    slot_mapping: torch.Tensor | None = None,
    lora: tuple[torch.Tensor, LoraWeights, LoraBatchInfo] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Semantics: per-head RMSNorm of q and k (when weights are given), then rotate-half rotary;
    with v and the caches, then store_kv(k_out, v, k_cache, v_cache, slot_mapping). With
    lora = (shrunk, lora_qkv, info), q|k|v first take reference.lora_expand_ of shrunk [T, 3, R]
    float32 (from rms_norm_lora; needs v); lora_qkv.b [S, (Hq + 2 Hkv) D, R] contiguous.

    q [T, Hq, D], k, v [T, Hkv, D] (strided views of the fused qkv output are fine, the last dim
    contiguous), same dtype; positions [T] int64; cos, sin [L, D] float32 tables; q_norm,
    k_norm [D] in q's dtype, or both None; k_cache, v_cache [num_pages, page_size, Hkv, D] with
    the same strides, the last dim contiguous; slot_mapping [T] int64, -1 for rows not stored.
    Returns new contiguous q [T, Hq, D], k [T, Hkv, D].
    """
    T, Hq, D = q.shape
    Hkv = k.shape[1]
    assert k.shape == (T, Hkv, D) and k.dtype == q.dtype, (q.shape, k.shape, q.dtype, k.dtype)
    assert q.stride(-1) == 1 and k.stride(-1) == 1, (q.stride(), k.stride())
    assert D % 2 == 0 and positions.shape == (T,), (D, positions.shape)
    assert cos.shape == sin.shape and cos.shape[1] == D, (cos.shape, sin.shape, D)
    assert cos.stride(-1) == 1 and sin.stride(-1) == 1, (cos.stride(), sin.stride())
    assert (q_norm is None) == (k_norm is None), "q_norm and k_norm come together"
    if q_norm is not None:
        for w in (q_norm, k_norm):
            assert w.shape == (D,) and w.dtype == q.dtype and w.is_contiguous(), (w.shape, w.dtype)
    store = slot_mapping is not None
    assert all((x is None) != store for x in (v, k_cache, v_cache)), "v, caches, slots together"
    if store:
        assert v.shape == k.shape and v.dtype == k.dtype, (v.shape, k.shape, v.dtype, k.dtype)
        assert v.stride(-1) == 1, v.stride()
        assert k_cache.ndim == 4 and k_cache.shape[2:] == (Hkv, D), (k_cache.shape, k.shape)
        assert v_cache.shape == k_cache.shape, (v_cache.shape, k_cache.shape)
        assert v_cache.stride() == k_cache.stride() and k_cache.stride(-1) == 1, k_cache.stride()
        assert slot_mapping.shape == (T,), slot_mapping.shape
    R = 1
    if lora is not None:
        shrunk, lora_qkv, info = lora
        assert store, "the folded LoRA needs v (and the caches): it expands into v as well"
        assert D & (D - 1) == 0, f"the folded LoRA needs a power-of-two head dim, got {D}"
        S, _, R = lora_qkv.b.shape
        assert lora_qkv.b.shape[1] == (Hq + 2 * Hkv) * D, (lora_qkv.b.shape, Hq, Hkv, D)
        assert lora_qkv.b.is_contiguous() and shrunk.is_contiguous(), "contiguous b, shrunk"
        assert shrunk.shape == (T, 3, R) and shrunk.dtype == torch.float32, shrunk.shape
        assert info.slot_of_token.shape[0] >= T, (info.slot_of_token.shape, T)
    q_out = torch.empty(T, Hq, D, dtype=q.dtype, device=q.device)
    k_out = torch.empty(T, Hkv, D, dtype=q.dtype, device=q.device)
    if T == 0:
        return q_out, k_out
    has_norm = q_norm is not None
    BLOCK_D = triton.next_power_of_2(D)
    # a [BLOCK_D, RC] tile of B is at most 32 values per lane
    num_warps = (1 if D <= 128 else 2) * (2 if lora is not None else 1)
    RC = max(1, min(triton.next_power_of_2(R), 32 * 32 * num_warps // BLOCK_D))
    lora_ptrs = (
        (info.slot_of_token, info.slot_enabled, info.rank_of_slot, info.scaling_of_slot,
         shrunk, lora_qkv.b)
        if lora is not None
        else (positions,) * 6
    )  # fmt: skip
    v_stride = v.stride()[:2] if store else (0, 0)
    cache_stride = k_cache.stride()[:3] if store else (0, 0, 0)
    page_size = k_cache.shape[1] if store else 1
    _rope_qk_kernel[(T, Hq + (2 if store else 1) * Hkv)](
        q, k, v if store else q, positions, cos, sin,
        q_norm if has_norm else q, k_norm if has_norm else q, q_out, k_out,
        k_cache if store else q, v_cache if store else q, slot_mapping if store else positions,
        *lora_ptrs,
        Hq, Hkv, D, page_size, q.stride(0), q.stride(1), k.stride(0), k.stride(1), *v_stride,
        cos.stride(0), sin.stride(0), *cache_stride,
        lora_qkv.b.stride(0) if lora is not None else 0, eps,
        HAS_NORM=has_norm, STORE_KV=store, BLOCK_D=BLOCK_D, LORA=lora is not None, R=R, RC=RC,
        num_warps=num_warps, enable_fp_fusion=False, **pdl_kwargs(q.device),
    )  # fmt: skip
    return q_out, k_out
