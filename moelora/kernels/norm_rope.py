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

Rounding. Every op is computed in float32 and rounded once to the input dtype, which is what
torch's elementwise kernels do for bf16 and fp16 (a product of two bf16 is exact in float32).
The kernels are compiled without fp fusion so that float32 inputs are not contracted to an FMA
that torch's separate mul and add never form; only the sum of squares differs in order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Legend: T = tokens, N = row width, Hq/Hkv = query/kv heads, D = head dim, L = table rows.


@triton.jit
def _rms_norm_kernel(
    # Pointers.
    x_ptr,  # [T, N], row stride stride_xt, last dim contiguous
    res_ptr,  # [T, N] or x_ptr when HAS_RESIDUAL is False (never read then)
    weight_ptr,  # [N], x's dtype
    out_ptr,  # [T, N] contiguous
    sum_ptr,  # [T, N] contiguous, x + residual; unused without a residual
    # Sizes and strides.
    N,
    stride_xt,
    stride_rt,
    eps,
    # Meta-parameters.
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # -- map the program to its row --
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    dtype = out_ptr.dtype.element_ty

    # -- the residual add, rounded to x's dtype like torch's add --
    x = tl.load(x_ptr + row * stride_xt + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_rt + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(dtype)
        tl.store(sum_ptr + row * N + offs, x, mask=mask)

    # -- the norm in float32; masked lanes are 0 and add nothing to the sum of squares --
    h = x.to(tl.float32)
    scale = tl.rsqrt(tl.sum(h * h, axis=0) / N + eps)
    normed = (h * scale).to(dtype)

    # -- the weight multiplies the rounded norm, and the product is rounded again --
    w = tl.load(weight_ptr + offs, mask=mask, other=0.0)
    out = (w.to(tl.float32) * normed.to(tl.float32)).to(dtype)
    tl.store(out_ptr + row * N + offs, out, mask=mask)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Semantics: s = x + residual (x alone when None); out = weight * rmsnorm(s).

    x, residual: [T, N] (rows may be strided, the last dim contiguous), same dtype; weight: [N]
    in x's dtype. Returns (out [T, N] contiguous, s): s is x itself without a residual, else a
    new contiguous tensor.
    """
    N = x.shape[-1]
    assert x.dim() == 2 and x.stride(-1) == 1, (x.shape, x.stride())
    assert weight.shape == (N,) and weight.dtype == x.dtype, (weight.shape, weight.dtype, x.dtype)
    assert weight.is_contiguous()
    if residual is not None:
        assert residual.shape == x.shape and residual.dtype == x.dtype, (
            residual.shape,
            residual.dtype,
        )
        assert residual.stride(-1) == 1, residual.stride()
    T = x.shape[0]
    out = torch.empty(T, N, dtype=x.dtype, device=x.device)
    s = x if residual is None else torch.empty(T, N, dtype=x.dtype, device=x.device)
    if T == 0:
        return out, s
    BLOCK = triton.next_power_of_2(N)
    res = x if residual is None else residual
    _rms_norm_kernel[(T,)](
        x, res, weight, out, s,
        N, x.stride(0), res.stride(0), eps,
        HAS_RESIDUAL=residual is not None, BLOCK=BLOCK,
        num_warps=min(max(BLOCK // 512, 1), 8), enable_fp_fusion=False,
    )  # fmt: skip
    return out, s


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
    eps,
    # Meta-parameters.
    HAS_NORM: tl.constexpr,
    STORE_KV: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # -- map the program to one head of one token: q heads, then k heads, then v heads --
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    offs = tl.arange(0, BLOCK_D)
    mask = offs < D
    dtype = q_out_ptr.dtype.element_ty

    # -- the cache row of this token, as store_kv computes it; padded rows (-1) store nothing --
    if STORE_KV:
        slot = tl.load(slot_ptr + t)
        cache_row = (slot // page_size) * stride_cp + (slot % page_size) * stride_cs
        store_mask = mask & (slot >= 0)
        if h >= Hq + Hkv:
            # v heads are only copied; they have no other output
            hv = h - Hq - Hkv
            x_v = tl.load(v_ptr + t * stride_vt + hv * stride_vh + offs, mask=store_mask)
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
    half = D // 2
    partner = (offs + half) % D
    x = tl.load(src + offs, mask=mask, other=0.0).to(tl.float32)
    x_rot = tl.load(src + partner, mask=mask, other=0.0).to(tl.float32)

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
) -> tuple[torch.Tensor, torch.Tensor]:
    """Semantics: per-head RMSNorm of q and k (when weights are given), then rotate-half rotary;
    with v and the caches, then store_kv(k_out, v, k_cache, v_cache, slot_mapping).

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
    q_out = torch.empty(T, Hq, D, dtype=q.dtype, device=q.device)
    k_out = torch.empty(T, Hkv, D, dtype=q.dtype, device=q.device)
    if T == 0:
        return q_out, k_out
    has_norm = q_norm is not None
    v_stride = v.stride()[:2] if store else (0, 0)
    cache_stride = k_cache.stride()[:3] if store else (0, 0, 0)
    page_size = k_cache.shape[1] if store else 1
    _rope_qk_kernel[(T, Hq + (2 if store else 1) * Hkv)](
        q, k, v if store else q, positions, cos, sin,
        q_norm if has_norm else q, k_norm if has_norm else q, q_out, k_out,
        k_cache if store else q, v_cache if store else q, slot_mapping if store else positions,
        Hq, Hkv, D, page_size, q.stride(0), q.stride(1), k.stride(0), k.stride(1), *v_stride,
        cos.stride(0), sin.stride(0), *cache_stride, eps,
        HAS_NORM=has_norm, STORE_KV=store, BLOCK_D=triton.next_power_of_2(D),
        num_warps=1 if D <= 128 else 2, enable_fp_fusion=False,
    )  # fmt: skip
    return q_out, k_out
