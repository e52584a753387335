"""Triton rms_norm, rms_norm_lora and rope_store_kv against their torch references, in the
interpreter.

Inputs are strided views where the engine passes them: a row slice of a wider tensor for the
norm (the "full" q/k norm of a fused qkv output), q, k and v heads inside the fused qkv rows.
Legend: T = tokens, N = row width, Hq/Hkv = query/kv heads, D = head dim, L = table rows.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from lora_cases import SPREADS, batch_info, compact_weights, lora_weights, rel_err

from moelora.kernels import reference
from moelora.kernels.attention.norm_rope import rms_norm, rms_norm_lora, rope_store_kv
from moelora.step.lora import RANK, FoldedLora, LoraWeights

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
@pytest.mark.parametrize("T,KX", [(1, 8), (7, 2), (33, 6)])
def test_rms_norm_adds_top_k_rows_first(poison_empty, dtype, T, KX):
    """x [T, KX, N]: the MoE's top-k rows (fused_moe(sum_topk=False)), added in order in fp32
    and rounded, as the top-k sum kernel did: the same bits as the norm of their sum, for the
    plain norm and for the LoRA norm (q|k|v's shrink, the engine's input norm)."""
    torch.manual_seed(T * KX)
    N = 96
    rows = torch.randn(T, KX, N, dtype=dtype)
    weight = (1 + 0.5 * torch.randn(N)).to(dtype)
    residual = torch.randn(T, N, dtype=dtype)
    summed = reference.sum_rows(rows)
    assert summed.shape == (T, N) and summed.dtype == dtype
    out, s = rms_norm(rows, weight, EPS, residual)
    plain_out, plain_s = rms_norm(summed, weight, EPS, residual)
    assert torch.equal(out, plain_out) and torch.equal(s, plain_s)
    ref_out, ref_s = reference.rms_norm(rows, weight, EPS, residual)
    torch.testing.assert_close(out, ref_out, **TOL[dtype])
    assert torch.equal(s, ref_s)
    info = batch_info(T, "mixed")
    shrink = lora_weights(info.num_slots, (), 3, 16, N, (N, N, N), info.rank_of_slot, dtype)
    lora = rms_norm_lora(rows, weight, EPS, residual, info, shrink=shrink)
    plain = rms_norm_lora(summed, weight, EPS, residual, info, shrink=shrink)
    on = _enabled_rows(info, T)
    assert torch.equal(lora[0], plain[0]) and torch.equal(lora[1], plain[1])
    assert torch.equal(lora[2].shrunk[on], plain[2].shrunk[on])
    with pytest.raises(AssertionError, match="into a residual"):
        rms_norm(rows, weight, EPS)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("T,KX", [(1, 8), (7, 1), (33, 6)])
@pytest.mark.parametrize("gated", [True, False])
def test_rms_norm_joins_the_shared_expert(poison_empty, dtype, T, KX, gated):
    """shared=, shared_gate=: the MoE's shared expert (scaled by its sigmoid gate) joined with
    its top-k rows inside the norm: the same bits as add_shared_expert's launch, then the norm
    of its output, for the plain norm and the LoRA norm; strided views of a wider product, as
    SparseMoE.w_in's gives them; close to the reference (whose sigmoid is torch's)."""
    from moelora.kernels.mlp import add_shared_expert

    torch.manual_seed(T * KX + gated)
    N = 96
    rows = torch.randn(T, KX, N, dtype=dtype)
    rows = rows if KX > 1 else rows[:, 0]
    wide = torch.randn(T, N + 9, dtype=dtype)
    shared, gate = wide[:, 8 : 8 + N], wide[:, 2:3] if gated else None
    weight = (1 + 0.5 * torch.randn(N)).to(dtype)
    residual = torch.randn(T, N, dtype=dtype)
    joined = add_shared_expert(rows, shared, gate)
    out, s = rms_norm(rows, weight, EPS, residual, shared=shared, shared_gate=gate)
    plain_out, plain_s = rms_norm(joined, weight, EPS, residual)
    assert torch.equal(out, plain_out) and torch.equal(s, plain_s)
    kw = dict(shared=shared, shared_gate=gate)
    ref_out, ref_s = reference.rms_norm(rows, weight, EPS, residual, **kw)
    torch.testing.assert_close(out, ref_out, **TOL[dtype])
    torch.testing.assert_close(s, ref_s, **TOL[dtype])
    info = batch_info(T, "mixed")
    shrink = lora_weights(info.num_slots, (), 3, 16, N, (N, N, N), info.rank_of_slot, dtype)
    lora = rms_norm_lora(rows, weight, EPS, residual, info, shrink=shrink, **kw)
    plain = rms_norm_lora(joined, weight, EPS, residual, info, shrink=shrink)
    on = _enabled_rows(info, T)
    assert torch.equal(lora[0], plain[0]) and torch.equal(lora[1], plain[1])
    assert torch.equal(lora[2].shrunk[on], plain[2].shrunk[on])
    with pytest.raises(AssertionError, match="a gate without its shared expert"):
        rms_norm(rows, weight, EPS, residual, shared_gate=wide[:, :1])


# a program per (token, head) below ROPE_GROUP_FROM tokens: 33 tokens take no path that 7 do
# not, so they run at GQA heads only (the interpreter's time grows with tokens x heads)
ROPE_SIZES = [(T, Hq, Hkv) for T in (1, 7, 33) for Hq, Hkv in ((4, 2), (8, 8)) if T < 33 or Hq == 4]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("T,Hq,Hkv", ROPE_SIZES)
@pytest.mark.parametrize("D", [16, 64])
@pytest.mark.parametrize("with_norm", [True, False])
def test_rope_store_kv_matches_reference(poison_empty, dtype, T, Hq, Hkv, D, with_norm):
    torch.manual_seed(T * D + Hq)
    q, k, _, positions, cos, sin, q_norm, k_norm = _rope_inputs(dtype, T, Hq, Hkv, D, with_norm)
    q_out, k_out = rope_store_kv(q, k, positions, cos, sin, q_norm, k_norm, EPS)
    ref_q, ref_k = reference.rope_store_kv(q, k, positions, cos, sin, q_norm, k_norm, EPS)
    assert q_out.shape == (T, Hq, D) and q_out.is_contiguous() and q_out.dtype == dtype
    assert k_out.shape == (T, Hkv, D) and k_out.is_contiguous() and k_out.dtype == dtype
    torch.testing.assert_close(q_out, ref_q, **TOL[dtype])
    torch.testing.assert_close(k_out, ref_k, **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("T", [1, 9])
def test_rope_store_kv_interleaved_pairs(poison_empty, dtype, T):
    """DeepSeek's adjacent pairs (MLA's q_pe [T, Hh, R] and the one k_pe head, strided views):
    the reference's reorder then rotate-half, which is transformers' interleaved rotary; and
    not the plain rotary of the same inputs."""
    torch.manual_seed(T + 77)
    Hq, D = 4, 16
    q, k, _, positions, cos, sin, _, _ = _rope_inputs(dtype, T, Hq, 1, D, False)
    q_out, k_out = rope_store_kv(q, k, positions, cos, sin, None, None, EPS, interleaved=True)
    args = (q, k, positions, cos, sin, None, None, EPS)
    ref_q, ref_k = reference.rope_store_kv(*args, interleaved=True)
    torch.testing.assert_close(q_out, ref_q, **TOL[dtype])
    torch.testing.assert_close(k_out, ref_k, **TOL[dtype])
    plain_q, _ = reference.rope_store_kv(*args)
    assert not torch.allclose(q_out, plain_q, **TOL[dtype])
    # transformers' form: pairs (x[2i], x[2i + 1]) rotated by frequency i, evens then odds out
    half = D // 2
    x = q.float()
    c, s_ = cos[positions][:, None, :half], sin[positions][:, None, :half]
    even, odd = x[..., 0::2], x[..., 1::2]
    want = torch.cat([even * c - odd * s_, odd * c + even * s_], dim=-1)
    torch.testing.assert_close(q_out.float(), want, atol=5e-3, rtol=5e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("D,rotary_dim", [(16, 8), (64, 16)])
@pytest.mark.parametrize("with_norm", [True, False])
def test_rope_store_kv_partial_rotary(poison_empty, dtype, D, rotary_dim, with_norm):
    """Partial rotary (GLM-4.5, Qwen3.5): the lanes read the head's dims in
    partial_rotary_order, the norm weights too, and the result is stored in that order."""
    torch.manual_seed(D + rotary_dim)
    T, Hq, Hkv = 5, 4, 2
    q, k, v, positions, cos, sin, q_norm, k_norm = _rope_inputs(dtype, T, Hq, Hkv, D, with_norm)
    cos[:, rotary_dim // 2 : D // 2] = 1.0  # the passing dims' tables, as RotaryEmbedding's
    cos[:, D // 2 + rotary_dim // 2 :] = 1.0
    sin[:, rotary_dim // 2 : D // 2] = 0.0
    sin[:, D // 2 + rotary_dim // 2 :] = 0.0
    k_cache = torch.full((5, 4, Hkv, D), SENTINEL, dtype=dtype)
    v_cache = torch.full_like(k_cache, SENTINEL)
    slots = torch.randperm(20)[:T]
    args = (q, k, positions, cos, sin, q_norm, k_norm, EPS)
    caches = dict(v=v, k_cache=k_cache, v_cache=v_cache, slot_mapping=slots)
    q_out, k_out = rope_store_kv(*args, **caches, rotary_dim=rotary_dim)
    ref_caches = dict(caches, k_cache=k_cache.clone().fill_(SENTINEL))
    ref_caches["v_cache"] = v_cache.clone().fill_(SENTINEL)
    ref_q, ref_k = reference.rope_store_kv(*args, **ref_caches, rotary_dim=rotary_dim)
    torch.testing.assert_close(q_out, ref_q, **TOL[dtype])
    torch.testing.assert_close(k_out, ref_k, **TOL[dtype])
    torch.testing.assert_close(k_cache, ref_caches["k_cache"], **TOL[dtype])
    assert torch.equal(v_cache, ref_caches["v_cache"])
    plain_q, _ = reference.rope_store_kv(*args)
    assert not torch.allclose(q_out, plain_q, **TOL[dtype])


@pytest.mark.parametrize("T", [1, 9])
def test_rope_store_kv_stores_a_wider_v(poison_empty, T):
    """MLA's store: the rotated key head (R wide) and the latent (L wide) as its v, into caches
    that are views of one buffer side by side; rows with slot -1 and unmapped slots keep the
    sentinel, and the latents are stored as given."""
    torch.manual_seed(T + 5)
    dtype, Hq, R, L_ = torch.float16, 4, 16, 48
    q, k, _, positions, cos, sin, _, _ = _rope_inputs(dtype, T, Hq, 1, R, False)
    latent = torch.randn(T, 1, L_ + 8, dtype=dtype)[..., :L_]  # strided rows
    buffer = torch.full((5, 4, 1, L_ + R), SENTINEL, dtype=dtype)
    latent_cache, rope_cache = buffer[..., :L_], buffer[..., L_:]
    slots = torch.randperm(20)[:T]
    if T > 1:
        slots[1] = -1
    caches = dict(v=latent, k_cache=rope_cache, v_cache=latent_cache, slot_mapping=slots)
    args = (q, k, positions, cos, sin, None, None, EPS)
    _, k_out = rope_store_kv(*args, **caches, interleaved=True)
    want = torch.full_like(buffer, SENTINEL)
    ref_caches = dict(caches, k_cache=want[..., L_:], v_cache=want[..., :L_])
    reference.store_kv(k_out, latent, ref_caches["k_cache"], ref_caches["v_cache"], slots)
    assert torch.equal(buffer, want)
    assert (buffer != SENTINEL).all(-1).sum() == (slots >= 0).sum()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("T", [1, 9])
def test_rope_store_kv_norms_the_latent(poison_empty, dtype, T):
    """v_norm (MLA's kv_a_layernorm): the latent normed before its store, in place, padded rows
    (slot -1) too: the norm's numbers (rms_norm's), what the reference stores and leaves in v,
    and q and k as without it."""
    torch.manual_seed(T + 11)
    Hq, R, L_ = 4, 16, 48
    q, k, _, positions, cos, sin, _, _ = _rope_inputs(dtype, T, Hq, 1, R, False)
    latent = torch.randn(T, 1, L_ + 8, dtype=dtype)[..., :L_]  # strided rows
    weight = (1 + 0.5 * torch.randn(L_)).to(dtype)
    raw = latent.clone()
    buffers = [torch.full((5, 4, 1, L_ + R), SENTINEL, dtype=dtype) for _ in range(2)]
    slots = torch.randperm(20)[:T]
    if T > 1:
        slots[1] = -1
    args = (q, k, positions, cos, sin, None, None, EPS)
    outs = []
    for fn, buffer, v in (
        (rope_store_kv, buffers[0], latent),
        (reference.rope_store_kv, buffers[1], raw.clone()),
    ):
        caches = dict(v=v, k_cache=buffer[..., L_:], v_cache=buffer[..., :L_], slot_mapping=slots)
        outs.append((*fn(*args, **caches, interleaved=True, v_norm=weight), v))
    (q_out, k_out, normed), (ref_q, ref_k, ref_normed) = outs
    want = reference.rms_norm(raw[:, 0], weight, EPS)[0]
    torch.testing.assert_close(normed[:, 0], want, **TOL[dtype])
    torch.testing.assert_close(normed, ref_normed, **TOL[dtype])
    torch.testing.assert_close(buffers[0], buffers[1], **TOL[dtype])
    assert (buffers[0] != SENTINEL).all(-1).sum() == (slots >= 0).sum()
    plain_q, plain_k = rope_store_kv(*args, interleaved=True)
    assert torch.equal(q_out, plain_q) and torch.equal(k_out, plain_k)
    torch.testing.assert_close(q_out, ref_q, **TOL[dtype])
    with pytest.raises(AssertionError, match="v_norm norms the stored v"):
        rope_store_kv(*args, v_norm=weight)


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
def test_rope_store_kv_caches_k_and_v(poison_empty, dtype, T, Hq, Hkv, D, with_norm):
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
    q_out, k_out = rope_store_kv(q, k, positions, cos, sin, q_norm, k_norm, EPS, **caches)

    # bit-identical to the separate store of the kernel's own k
    k_sep, v_sep = torch.full_like(k_cache, SENTINEL), torch.full_like(v_cache, SENTINEL)
    reference.store_kv(k_out, v, k_sep, v_sep, slots)
    assert torch.equal(k_cache, k_sep) and torch.equal(v_cache, v_sep)
    stored = (k_cache != SENTINEL).all(-1).all(-1).flatten()
    assert stored.sum() == (slots >= 0).sum()

    # and to the reference, up to the rotary's own tolerance
    k_ref, v_ref = torch.full_like(k_cache, SENTINEL), torch.full_like(v_cache, SENTINEL)
    ref_caches = dict(v=v, k_cache=k_ref, v_cache=v_ref, slot_mapping=slots)
    ref_q, ref_k = reference.rope_store_kv(
        q, k, positions, cos, sin, q_norm, k_norm, EPS, **ref_caches
    )
    torch.testing.assert_close(q_out, ref_q, **TOL[dtype])
    torch.testing.assert_close(k_out, ref_k, **TOL[dtype])
    torch.testing.assert_close(k_cache, k_ref, **TOL[dtype])
    assert torch.equal(v_cache, v_ref)


# -- the LoRA folded into the norm and the rotary ------------------------------------------------
# rms_norm_lora folds in the second half of the LoRA of the projection that produced x (expand:
# lora_shrink_split's partial shrinks [T, KS, 1, R], expanded by lora_in's B into the N columns)
# and the first half of the LoRA of the projection that reads out (shrink: q|k|v, 3 slices).
# rope_store_kv(expand=...) expands q|k|v's shrink first. Slots have ranks {0, 1, 8, 16}
# (lora_cases), R = pool rank; _widen_ranks stretches them to a bigger pool. Rows without an
# enabled slot are the plain rms_norm's bit for bit; their shrinks are neither written nor read
# (NaN here).

LORA_TOL = {torch.float32: 1e-5, torch.float16: 5e-3}  # rel_err, as in test_lora


def _enabled_rows(info, T: int) -> torch.Tensor:
    slots = info.slot_of_token[:T]
    return (slots >= 0) & (info.slot_enabled[slots.clamp(min=0).long()] != 0)


def _widen_ranks(info, R: int) -> None:
    """In place: rank-16 slots take the pool rank R and rank-8 ones R // 2 + 3 (> 16), so the
    rank rows past the first 16 are read, and partly masked. Zero ranks stay zero."""
    ranks = info.rank_of_slot
    ranks[ranks == 16] = R
    ranks[ranks == 8] = R // 2 + 3


def _copy(lora: LoraWeights, a: torch.Tensor | None = None) -> LoraWeights:
    """lora (dense layout) in an arena of its own, with A `a` in place of its own if given:
    its .a and .b are views of the new arena, so writing them changes what kernels read."""
    ranks = lora.table[:, RANK].tolist()
    return LoraWeights.dense(lora.a if a is None else a, lora.b, lora.out_slices, ranks)


def _partials(x_in, lora_in, info, KS: int) -> torch.Tensor:
    """lora_shrink_split's output for KS slices of the input columns, [T, KS, 1, R] float32;
    rows without an enabled slot are NaN (the Triton split leaves them unwritten)."""
    parts = []
    for cols in torch.arange(x_in.shape[1]).chunk(KS):
        a = lora_in.a[..., cols].contiguous()
        parts.append(reference.lora_shrink(x_in[:, cols], _copy(lora_in, a), info))
    part = torch.stack(parts, dim=1)
    part[~_enabled_rows(info, x_in.shape[0])] = float("nan")
    return part


def _norm_lora_inputs(dtype, T, spread, with_residual, mode, R, N=64, KS=1, strided=False):
    """x [T, N] (a row slice of a wider tensor when strided); expand from x_in [T, 96]."""
    K_IN = 96
    info = batch_info(T, spread)
    if R > 16:
        _widen_ranks(info, R)
    S, ranks = info.num_slots, info.rank_of_slot
    wide = torch.randn(T, N + 24 if strided else N, dtype=dtype)
    x = wide[:, 8 : 8 + N] if strided else wide
    weight = (1 + 0.5 * torch.randn(N)).to(dtype)
    residual = torch.randn(T, N, dtype=dtype) if with_residual else None
    expand = shrink = None
    if mode in ("expand", "both"):
        lora_in = lora_weights(S, (), 1, R, K_IN, (N,), ranks, dtype)
        part = _partials(torch.randn(T, K_IN, dtype=dtype), lora_in, info, KS)
        expand = FoldedLora(part, lora_in, info)
    if mode in ("shrink", "both"):
        shrink = lora_weights(S, (), 3, R, N, (N, 16, 16), ranks, dtype)
    return info, x, weight, residual, expand, shrink


def _check_rms_norm_lora(info, x, weight, residual, expand, shrink, *, ref_lora=None):
    """Kernel vs reference on enabled rows; base rows bit-equal to the plain Triton rms_norm.
    ref_lora = (expand, shrink) for the reference when the kernel's weights carry garbage."""
    T, N = x.shape
    dtype = x.dtype
    x0 = x.clone()
    out, s, folded = rms_norm_lora(x, weight, EPS, residual, info, shrink=shrink, expand=expand)
    r_expand, r_shrink = ref_lora if ref_lora is not None else (expand, shrink)
    if r_expand is not None:  # the reference sums the partials of every row: zeros, not NaN
        r_expand = replace(r_expand, shrunk=r_expand.shrunk.nan_to_num(0.0))
    ref = reference.rms_norm_lora(x, weight, EPS, residual, info, shrink=r_shrink, expand=r_expand)
    ref_out, ref_s, ref_folded = ref
    assert torch.equal(x, x0), "x must not be modified"
    assert out.shape == (T, N) and out.is_contiguous() and out.dtype == dtype
    on = _enabled_rows(info, T)
    base = ~on

    plain_out, plain_s = rms_norm(x, weight, EPS, residual)
    assert torch.equal(out[base], plain_out[base])
    if expand is None:  # nothing changes x: out and s are the plain norm's on every row
        assert torch.equal(out, plain_out)
        assert s is x if residual is None else torch.equal(s, plain_s)
    else:
        assert s.shape == (T, N) and s.dtype == dtype
        assert torch.equal(s[base], plain_s[base])
        assert rel_err(s[on], ref_s[on]) <= LORA_TOL[dtype]
        if dtype == torch.float16:  # PEFT's order, delta rounded then added: ~every bit equal
            differ = (s[on] != ref_s[on]).sum().item()
            assert differ <= 0.02 * s[on].numel() + 1, f"{differ} of {s[on].numel()} differ"
    assert rel_err(out[on], ref_out[on]) <= LORA_TOL[dtype]

    if shrink is None:
        assert folded is None
    else:
        assert folded.weights is shrink and folded.info is info
        shrunk, ref_shrunk = folded.shrunk, ref_folded.shrunk
        assert shrunk.shape == ref_shrunk.shape and shrunk.dtype == torch.float32
        assert torch.isfinite(shrunk[on]).all()
        assert rel_err(shrunk[on], ref_shrunk[on]) <= LORA_TOL[dtype]


NORM_LORA_CASES = [  # (T, spread, with_residual, N, KS, strided): every spread, both residuals
    (1, "one", True, 64, 1, False),
    (7, "mixed", True, 96, 3, False),
    (7, "distinct", False, 64, 2, True),
    (7, "none", True, 64, 1, False),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("T,spread,with_residual,N,KS,strided", NORM_LORA_CASES)
@pytest.mark.parametrize("mode", ["expand", "shrink", "both"])
def test_rms_norm_lora_matches_reference(
    poison_empty, dtype, T, spread, with_residual, N, KS, strided, mode
):
    """expand: KS partial shrinks of a [T, 96] input through a one-slice lora_in into x; shrink:
    out through a 3-slice A over N; both: the engine's post-attention norm (o's LoRA in,
    q|k|v's out). Pool rank 16."""
    torch.manual_seed(T * 31 + N + len(spread) + len(mode))
    inputs = _norm_lora_inputs(dtype, T, spread, with_residual, mode, 16, N, KS, strided)
    _check_rms_norm_lora(*inputs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_rms_norm_lora_wide_shrink_programs(poison_empty, monkeypatch, dtype):
    """From SHRINK_WIDE_T rows on, a program shrinks twice the rank rows (half the programs a
    row): the same sums, checked at 7 rows with the threshold lowered to 1."""
    from moelora.kernels.attention import norm_rope

    assert norm_rope._rank_rows_per_step(7, 48, 64, 1, True) == 16
    monkeypatch.setattr(norm_rope, "SHRINK_WIDE_T", 1)
    assert norm_rope._rank_rows_per_step(7, 48, 64, 1, True) == 32
    torch.manual_seed(33)
    _check_rms_norm_lora(*_norm_lora_inputs(dtype, 7, "distinct", True, "both", 16, KS=2))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_rms_norm_lora_pool_rank_32(poison_empty, dtype):
    """Pool rank 32 with slot ranks {0, 1, 19, 32}: rank rows past 16, in both halves."""
    torch.manual_seed(32)
    _check_rms_norm_lora(*_norm_lora_inputs(dtype, 7, "distinct", True, "both", 32, KS=2))


def test_rms_norm_lora_rank_beyond_real_rank_is_ignored(poison_empty):
    """NaN past a slot's real rank must never be read: in the shrink's A (the kernel writes
    zeros there instead: an enabled row's shrink is whole), in lora_in's B and in the partial
    shrinks."""
    torch.manual_seed(5)
    inputs = _norm_lora_inputs(torch.float32, 8, "distinct", True, "both", 32, KS=2)
    info, x, weight, residual, expand, shrink = inputs
    part, lora_in = expand.shrunk, expand.weights
    bad_part = part.clone()
    bad_in, bad_shrink = _copy(lora_in), _copy(shrink)
    for t, s in enumerate(info.slot_of_token.tolist()):
        if s >= 0:
            bad_part[t, :, :, info.rank_of_slot[s] :] = float("nan")
    for s, r in enumerate(info.rank_of_slot.tolist()):
        bad_in.b[s, :, r:] = float("nan")
        bad_shrink.a[s, :, r:] = float("nan")
    bad_expand = FoldedLora(bad_part, bad_in, info)
    ref_lora = (expand, shrink)
    _check_rms_norm_lora(info, x, weight, residual, bad_expand, bad_shrink, ref_lora=ref_lora)


def _compact_ranks(info, absent: int) -> list[int]:
    """Module ranks for a compact arena: the slots' own ({0, 1, 8, 16} cycled), but slot
    `absent`'s adapter has no such module (rank 0) and slot 3's has it at rank 5, below its
    adapter's 16 (per-target ranks)."""
    ranks = info.rank_of_slot.tolist()
    ranks[absent], ranks[3] = 0, 5
    return ranks


@pytest.mark.parametrize("T,spread", [(7, "mixed"), (8, "distinct")])
def test_rms_norm_lora_reads_the_compact_arena(poison_empty, T, spread):
    """Both halves read their factors through their tables from compact arenas (slots at
    their modules' own ranks, regions out of slot order, NaN between them): o's B lacks
    slot 2's module, q|k|v's A slot 1's. The reference reads the same weights in the dense
    layout; no NaN may reach the output."""
    torch.manual_seed(T + len(spread))
    inputs = _norm_lora_inputs(torch.float32, T, spread, True, "both", 16, KS=2)
    info, x, weight, residual, expand, shrink = inputs
    c_in, d_in = compact_weights(expand.weights, _compact_ranks(info, absent=2))
    c_shrink, d_shrink = compact_weights(shrink, _compact_ranks(info, absent=1))
    part = _partials(torch.randn(T, 96), d_in, info, KS=2)
    c_expand, d_expand = FoldedLora(part, c_in, info), FoldedLora(part, d_in, info)
    ref_lora = (d_expand, d_shrink)
    _check_rms_norm_lora(info, x, weight, residual, c_expand, c_shrink, ref_lora=ref_lora)
    assert torch.isfinite(rms_norm_lora(x, weight, EPS, residual, info, expand=c_expand)[0]).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("KX", [1, 4])
def test_rms_norm_lora_expands_into_the_shared_expert(poison_empty, dtype, gated, KX):
    """A MoE's output joined in the norm (its top-k rows, the shared expert, its gate) with the
    shared expert's down_proj LoRA to expand (layers/mlp_lora.py): the delta goes into the
    shared expert's row before its gate, as PEFT adds it, and gate_up's shrink of the next MLP
    rides in the same launch. Against the reference; rows without a slot are the plain
    norm's bits."""
    T, N = 9, 64
    torch.manual_seed(KX + 2 * gated)
    info, x, weight, residual, expand, shrink = _norm_lora_inputs(
        dtype, T, "mixed", True, "both", 16, N=N, KS=3
    )
    rows = torch.randn(T, KX, N, dtype=dtype) if KX > 1 else x
    shared = torch.randn(T, N + 8, dtype=dtype)[:, :N]  # strided rows
    gate = (2 * torch.randn(T, 1)).to(dtype) if gated else None
    kw = dict(shared=shared, shared_gate=gate)
    out, s, folded = rms_norm_lora(
        rows, weight, EPS, residual, info, shrink=shrink, expand=expand, **kw
    )
    r_expand = replace(expand, shrunk=expand.shrunk.nan_to_num(0.0))
    ref = reference.rms_norm_lora(
        rows, weight, EPS, residual, info, shrink=shrink, expand=r_expand, **kw
    )
    on = _enabled_rows(info, T)
    assert rel_err(s[on], ref[1][on]) <= LORA_TOL[dtype]
    assert rel_err(out[on], ref[0][on]) <= LORA_TOL[dtype]
    plain_out, plain_s = rms_norm(rows, weight, EPS, residual, **kw)
    assert torch.equal(out[~on], plain_out[~on]) and torch.equal(s[~on], plain_s[~on])
    # the delta is the shared expert's: with a gate, it is scaled with it
    into_rows = reference.rms_norm_lora(
        reference.add_shared_expert(rows, shared, gate),
        weight,
        EPS,
        residual,
        info,
        expand=r_expand,
    )
    if gated:
        assert rel_err(s[on], into_rows[1][on]) > 10 * LORA_TOL[dtype]
    assert folded is not None and torch.isfinite(folded.shrunk[on]).all()


def _lora_qkv_inputs(dtype, T, spread, Hq, Hkv, D, R=16, K_IN=32):
    """Batch info, the q|k|v LoraWeights (in K_IN, slices Hq D | Hkv D | Hkv D) and the
    float32 shrink of a random x, as rms_norm_lora would hand it over."""
    info = batch_info(T, spread)
    slices = (Hq * D, Hkv * D, Hkv * D)
    lora_qkv = lora_weights(info.num_slots, (), 3, R, K_IN, slices, info.rank_of_slot, dtype)
    shrunk = reference.lora_shrink(torch.randn(T, K_IN, dtype=dtype), lora_qkv, info)
    return info, lora_qkv, shrunk


def _qkv_views(qkv: torch.Tensor, Hq: int, Hkv: int, D: int):
    T = qkv.shape[0]
    q, k, v = qkv.split([Hq * D, Hkv * D, Hkv * D], dim=-1)
    return q.view(T, Hq, D), k.view(T, Hkv, D), v.view(T, Hkv, D)


def _check_rope_store_kv_lora(
    dtype, T, spread, Hq, Hkv, D, with_norm, *, garbage=False, compact=False, rotary_dim=0
):
    """compact: the kernel reads B from the compact arena (_compact_ranks), the reference
    from the same weights in the dense layout. rotary_dim: partial rotary (the delta read in
    partial_rotary_order too)."""
    q, k, v, positions, cos, sin, q_norm, k_norm = _rope_inputs(dtype, T, Hq, Hkv, D, with_norm)
    qkv = torch.cat([t.reshape(T, -1) for t in (q, k, v)], dim=-1)  # [T, (Hq + 2 Hkv) D]
    info, lora_qkv, shrunk = _lora_qkv_inputs(dtype, T, spread, Hq, Hkv, D)
    k_lora = lora_qkv
    if compact:
        k_lora, lora_qkv = compact_weights(lora_qkv, _compact_ranks(info, absent=1))
    num_pages, page_size = 5, 4
    slots = torch.randperm(num_pages * page_size)[:T]
    if T > 2:
        slots[[0, T - 2]] = -1  # padded rows of a graph batch
    shape = (num_pages, page_size, Hkv, D)
    k_cache = torch.full(shape, SENTINEL, dtype=dtype)
    v_cache = torch.full(shape, SENTINEL, dtype=dtype)
    k_ref, v_ref = torch.full_like(k_cache, SENTINEL), torch.full_like(v_cache, SENTINEL)

    kq, kk, kv = _qkv_views(qkv.clone(), Hq, Hkv, D)  # strided, like the engine's
    rope = (positions, cos, sin, q_norm, k_norm, EPS)
    q_out, k_out = rope_store_kv(
        kq,
        kk,
        *rope,
        v=kv,
        k_cache=k_cache,
        v_cache=v_cache,
        slot_mapping=slots,
        expand=_kernel_expand(info, k_lora, shrunk, garbage=garbage),
        rotary_dim=rotary_dim,
    )
    rq, rk, rv = _qkv_views(qkv, Hq, Hkv, D)
    ref_q, ref_k = reference.rope_store_kv(
        rq,
        rk,
        *rope,
        v=rv,
        k_cache=k_ref,
        v_cache=v_ref,
        slot_mapping=slots,
        expand=FoldedLora(shrunk, lora_qkv, info),
        rotary_dim=rotary_dim,
    )

    assert q_out.shape == (T, Hq, D) and q_out.is_contiguous() and q_out.dtype == dtype
    assert k_out.shape == (T, Hkv, D) and k_out.is_contiguous() and k_out.dtype == dtype
    assert rel_err(q_out, ref_q) <= LORA_TOL[dtype]
    assert rel_err(k_out, ref_k) <= LORA_TOL[dtype]
    # the cached k is exactly the returned k, stored
    k_sep = torch.full_like(k_cache, SENTINEL)
    reference.store_kv(k_out, kv, k_sep, torch.full_like(v_cache, SENTINEL), slots)
    assert torch.equal(k_cache, k_sep)
    _check_caches_with_lora((k_cache, v_cache), (k_ref, v_ref), slots, rv, _enabled_rows(info, T))


def _kernel_expand(info, lora_qkv, shrunk, *, garbage: bool) -> FoldedLora:
    """What the kernel reads: base rows of the shrink are never written by rms_norm_lora (NaN
    here); with garbage, B's columns past each slot's real rank are NaN too."""
    k_shrunk = shrunk.clone()
    k_shrunk[~_enabled_rows(info, shrunk.shape[0])] = float("nan")
    k_lora = lora_qkv
    if garbage:
        k_lora = _copy(lora_qkv)
        for s, r in enumerate(info.rank_of_slot.tolist()):
            k_lora.b[s, :, r:] = float("nan")
    return FoldedLora(k_shrunk, k_lora, info)


def _check_caches_with_lora(caches, ref_caches, slots, v, on) -> None:
    """Stored rows against the reference (v takes its delta too); the rest keep the sentinel.
    v of rows without an enabled slot (`on` False) is stored as given."""
    k_cache, v_cache = caches
    dtype, (Hkv, D) = k_cache.dtype, k_cache.shape[2:]
    flat = lambda c: c.view(-1, Hkv, D)  # noqa: E731
    stored = slots[slots >= 0]
    untouched = torch.ones(flat(k_cache).shape[0], dtype=torch.bool)
    untouched[stored] = False
    for cache, ref_cache in zip(caches, ref_caches):
        assert (flat(cache)[untouched] == SENTINEL).all()
        assert rel_err(flat(cache)[stored], flat(ref_cache)[stored]) <= LORA_TOL[dtype]
    plain = (slots >= 0) & ~on
    assert torch.equal(flat(v_cache)[slots[plain]], v[plain])
    # v + delta in PEFT's order (the delta rounded, then added): in float16, ~every bit equal
    # to the reference's
    if dtype == torch.float16:
        got, want = flat(v_cache)[stored], flat(ref_caches[1])[stored]
        differ = (got != want).sum().item()
        assert differ <= 0.02 * got.numel() + 1, f"{differ} of {got.numel()} differ"


def test_rope_store_kv_prefill_programs_of_several_tokens(poison_empty, monkeypatch):
    """From ROPE_GROUP_FROM tokens (lowered to 16 here) a program takes 8 tokens of its head:
    29 tokens leave the last program 5, and padded rows (-1) among them; the same values as
    the reference, every row stored where its slot says."""
    from moelora.kernels.attention import norm_rope

    monkeypatch.setattr(norm_rope, "ROPE_GROUP_FROM", 16)
    torch.manual_seed(29)
    T, Hq, Hkv, D, dtype = 29, 1, 1, 16, torch.float32
    q, k, v, positions, cos, sin, q_norm, k_norm = _rope_inputs(dtype, T, Hq, Hkv, D, True)
    num_pages, page_size = 12, 4
    slots = torch.randperm(num_pages * page_size)[:T]
    slots[[3, T - 1]] = -1
    caches = [torch.full((num_pages, page_size, Hkv, D), SENTINEL, dtype=dtype) for _ in "kv"]
    refs = [c.clone() for c in caches]
    args = (q, k, positions, cos, sin, q_norm, k_norm, EPS)
    got = rope_store_kv(*args, v=v, k_cache=caches[0], v_cache=caches[1], slot_mapping=slots)
    want = reference.rope_store_kv(*args, v=v, k_cache=refs[0], v_cache=refs[1], slot_mapping=slots)
    for a, b in zip((*got, *caches), (*want, *refs)):
        torch.testing.assert_close(a, b, **TOL[dtype])
    assert (caches[1] != SENTINEL).all(-1).all(-1).flatten().sum() == T - 2


ROPE_LORA_CASES = [(1, "one", 16), (9, "mixed", 64), (9, "distinct", 16), (9, "none", 16)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("T,spread,D", ROPE_LORA_CASES)
@pytest.mark.parametrize("with_norm", [True, False])
def test_rope_store_kv_lora_matches_reference(poison_empty, dtype, T, spread, D, with_norm):
    """q|k|v take the expand of the shrink before the norm and rotary; v is stored with its
    delta. Base rows of the shrink are NaN: the kernel must check the slot first."""
    torch.manual_seed(T * D + len(spread) + with_norm)
    _check_rope_store_kv_lora(dtype, T, spread, 4, 2, D, with_norm)


@pytest.mark.parametrize("warps,lane_values", [(2, 32), (2, 8), (1, 4)])
def test_rope_store_kv_lora_at_other_expand_launches(poison_empty, monkeypatch, warps, lane_values):
    """The expand's warps and B tile per lane (ROPE_EXPAND_WARPS, ROPE_EXPAND_LANE_VALUES) set
    RC, so the rank runs in 1 to 16 chunks of a 64-dim head: the same values at each."""
    from moelora.kernels.attention import norm_rope

    monkeypatch.setattr(norm_rope, "ROPE_EXPAND_WARPS", warps)
    monkeypatch.setattr(norm_rope, "ROPE_EXPAND_LANE_VALUES", lane_values)
    torch.manual_seed(warps * 100 + lane_values)
    _check_rope_store_kv_lora(torch.float32, 9, "mixed", 4, 2, 64, True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("T,spread", [(1, "one"), (9, "mixed")])
def test_rope_store_kv_lora_partial_rotary(poison_empty, dtype, T, spread):
    """GLM-4.5's folded attention LoRA: each lane takes the delta of the dim it reads under
    partial_rotary_order (half of a 64-dim head rotating here), its partner the swapped half."""
    torch.manual_seed(T + len(spread) + 11)
    _check_rope_store_kv_lora(dtype, T, spread, 4, 2, 64, True, rotary_dim=32)


def test_rope_store_kv_lora_rank_beyond_real_rank_is_ignored(poison_empty):
    """NaN in the columns of B past a slot's real rank must never be read."""
    torch.manual_seed(11)
    _check_rope_store_kv_lora(torch.float32, 9, "distinct", 4, 2, 16, True, garbage=True)


@pytest.mark.parametrize("T,spread", [(9, "mixed"), (8, "distinct")])
def test_rope_store_kv_lora_reads_the_compact_arena(poison_empty, T, spread):
    """The q|k|v B read through its table from a compact arena (mixed module ranks, slot 1
    without the module, NaN between regions) equals the dense layout's reference."""
    torch.manual_seed(T * 3 + len(spread))
    _check_rope_store_kv_lora(torch.float32, T, spread, 4, 2, 16, True, compact=True)


@pytest.mark.parametrize("spread", SPREADS)
def test_reference_add_lora_is_the_per_row_formula(spread):
    """reference.add_lora_ (now lora_shrink + lora_expand_) still computes, per row,
    y[t, slice_i] += scaling[s] * (x[t] @ A[s, i].T) @ B[s, slice_i].T, here in float64."""
    torch.manual_seed(3)
    T, H, slices = 9, 40, (24, 8, 8)
    info = batch_info(T, spread)
    lora = lora_weights(info.num_slots, (), 3, 16, H, slices, info.rank_of_slot, torch.float32)
    x, y = torch.randn(T, H), torch.randn(T, sum(slices))
    out = reference.add_lora_(y.clone(), x, lora, info)

    expect = y.double()
    for t, s in enumerate(info.slot_of_token.tolist()):
        if s < 0 or info.slot_enabled[s] == 0:
            continue
        scaling = info.scaling_of_slot[s].double()
        starts = [sum(slices[:i]) for i in range(len(slices))]
        for i, (start, size) in enumerate(zip(starts, slices)):
            a = lora.a[s, i].double()  # [R, H]
            b = lora.b[s, start : start + size].double()  # [size, R]
            expect[t, start : start + size] += scaling * (x[t].double() @ a.T) @ b.T
    on = _enabled_rows(info, T)
    assert torch.equal(out[~on], y[~on])
    assert rel_err(out - y, expect - y.double()) <= 1e-6
