"""Triton rms_norm and rope_qk against their torch references, in the interpreter.

Inputs are strided views where the engine passes them: a row slice of a wider tensor for the
norm (the "full" q/k norm of a fused qkv output), q, k and v heads inside the fused qkv rows.
Legend: T = tokens, N = row width, Hq/Hkv = query/kv heads, D = head dim, L = table rows.
"""

from __future__ import annotations

import pytest
import torch

from moelora.kernels import reference
from moelora.kernels.norm_rope import rms_norm, rope_qk

# float32 differs by a few ulps: the sum of squares is reduced in another order
TOL = {torch.float32: dict(rtol=4e-6, atol=1e-6), torch.float16: dict(rtol=2e-3, atol=2e-3)}
EPS = 1e-6


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("T", [1, 7, 33])
@pytest.mark.parametrize("N", [64, 96, 256])
@pytest.mark.parametrize("with_residual", [True, False])
@pytest.mark.parametrize("strided", [True, False])
def test_rms_norm_matches_reference(poison_empty, dtype, T, N, with_residual, strided):
    torch.manual_seed(T * N)
    wide = torch.randn(T, N + 24 if strided else N, dtype=dtype)
    x = wide[:, 8 : 8 + N] if strided else wide  # [T, N], row stride > N when strided
    weight = (1 + 0.5 * torch.randn(N)).to(dtype)
    residual = torch.randn(T, N, dtype=dtype) if with_residual else None
    out, s = rms_norm(x, weight, EPS, residual)
    ref_out, ref_s = reference.rms_norm(x, weight, EPS, residual)
    assert out.shape == (T, N) and out.is_contiguous() and out.dtype == dtype
    torch.testing.assert_close(out, ref_out, **TOL[dtype])
    if with_residual:
        assert torch.equal(s, ref_s)
    else:
        assert s is x


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("T", [1, 7, 33])
@pytest.mark.parametrize("Hq,Hkv", [(4, 2), (8, 8)])
@pytest.mark.parametrize("D", [16, 64])
@pytest.mark.parametrize("with_norm", [True, False])
def test_rope_qk_matches_reference(poison_empty, dtype, T, Hq, Hkv, D, with_norm):
    torch.manual_seed(T * D + Hq)
    q, k, _, positions, cos, sin, q_norm, k_norm = _rope_inputs(dtype, T, Hq, Hkv, D, with_norm)
    q_out, k_out = rope_qk(q, k, positions, cos, sin, q_norm, k_norm, EPS)
    ref_q, ref_k = reference.rope_qk(q, k, positions, cos, sin, q_norm, k_norm, EPS)
    assert q_out.shape == (T, Hq, D) and q_out.is_contiguous() and q_out.dtype == dtype
    assert k_out.shape == (T, Hkv, D) and k_out.is_contiguous() and k_out.dtype == dtype
    torch.testing.assert_close(q_out, ref_q, **TOL[dtype])
    torch.testing.assert_close(k_out, ref_k, **TOL[dtype])


def _rope_inputs(dtype: torch.dtype, T: int, Hq: int, Hkv: int, D: int, with_norm: bool):
    L = 64
    qkv = torch.randn(T, (Hq + 2 * Hkv) * D, dtype=dtype)  # the fused projection's output
    q, k, v = qkv.split([Hq * D, Hkv * D, Hkv * D], dim=-1)
    # strided: token stride (Hq + 2 Hkv) D
    q, k, v = q.view(T, Hq, D), k.view(T, Hkv, D), v.view(T, Hkv, D)
    positions = torch.randint(0, L, (T,))
    inv_freq = 1.0 / (10000 ** (torch.arange(0, D, 2, dtype=torch.float32) / D))
    freqs = torch.outer(torch.arange(L, dtype=torch.float32), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)  # [L, D]
    q_norm = (1 + 0.5 * torch.randn(D)).to(dtype) if with_norm else None
    k_norm = (1 + 0.5 * torch.randn(D)).to(dtype) if with_norm else None
    return q, k, v, positions, emb.cos(), emb.sin(), q_norm, k_norm


SENTINEL = 1234.0  # finite, so torch.equal compares it; no rotated or copied value is this


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("T", [1, 9])
@pytest.mark.parametrize("Hq,Hkv", [(4, 2), (4, 4)])
@pytest.mark.parametrize("D", [16, 64])
@pytest.mark.parametrize("with_norm", [True, False])
def test_rope_qk_stores_kv(poison_empty, dtype, T, Hq, Hkv, D, with_norm):
    """The fused store caches exactly what store_kv would from the returned k, and v as given;
    rows with slot -1 and slots nobody maps keep the sentinel."""
    torch.manual_seed(T * D + Hq + 1)
    q, k, v, positions, cos, sin, q_norm, k_norm = _rope_inputs(dtype, T, Hq, Hkv, D, with_norm)
    num_pages, page_size = 5, 4
    slots = torch.randperm(num_pages * page_size)[:T]
    if T > 1:
        slots[[0, T - 2]] = -1  # padded rows of a graph batch
    k_cache = torch.full((num_pages, page_size, Hkv, D), SENTINEL, dtype=dtype)
    v_cache = torch.full_like(k_cache, SENTINEL)
    caches = dict(v=v, k_cache=k_cache, v_cache=v_cache, slot_mapping=slots)
    q_out, k_out = rope_qk(q, k, positions, cos, sin, q_norm, k_norm, EPS, **caches)

    # bit-identical to the separate store of the kernel's own k
    k_sep, v_sep = torch.full_like(k_cache, SENTINEL), torch.full_like(v_cache, SENTINEL)
    reference.store_kv(k_out, v, k_sep, v_sep, slots)
    assert torch.equal(k_cache, k_sep) and torch.equal(v_cache, v_sep)
    stored = (k_cache != SENTINEL).all(-1).all(-1).flatten()
    assert stored.sum() == (slots >= 0).sum()

    # and to the reference, up to the rotary's own tolerance
    k_ref, v_ref = torch.full_like(k_cache, SENTINEL), torch.full_like(v_cache, SENTINEL)
    ref_caches = dict(v=v, k_cache=k_ref, v_cache=v_ref, slot_mapping=slots)
    ref_q, ref_k = reference.rope_qk(q, k, positions, cos, sin, q_norm, k_norm, EPS, **ref_caches)
    torch.testing.assert_close(q_out, ref_q, **TOL[dtype])
    torch.testing.assert_close(k_out, ref_k, **TOL[dtype])
    torch.testing.assert_close(k_cache, k_ref, **TOL[dtype])
    assert torch.equal(v_cache, v_ref)
