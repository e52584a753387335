"""Triton rms_norm and rope_store_kv on the GPU at real sizes, against the torch references.

float32: assert_close(rtol=1e-5, atol=1e-5). bfloat16: the kernels round in the references'
order, so almost every element is bit-equal; the rest come from the float32 sum of squares
(another order, another rsqrt) flipping one rounding of the normed value, which the weight
product can carry to 2 ulps (and rotary's cancellation to more, in absolute terms of the
result). Hence: <= 1% of elements differ (a wrong rounding order makes most of them differ),
rms_norm elements within 2 bf16 ulps, and the relative error of the whole output <= 1e-2.
The KV store fused into rope_store_kv must cache exactly what store_kv would from the
returned k.
The CUDA-graph tests capture the kernels once and replay them with new inputs.
The LoRA folded into rms_norm_lora and rope_store_kv (bf16) is checked against the reference run in
float32 on float32 copies: max abs error <= 2e-2 of the reference's max abs, on the rows whose
slot is enabled for the shrink (the kernel leaves the others unwritten).
Legend: T = tokens, N = hidden, Hq/Hkv = query/kv heads, D = head dim, L = table rows.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():  # before any kernel module is imported (see kernels/conftest)
    pytest.skip("needs a CUDA device", allow_module_level=True)
pytest.importorskip("triton")

sys.path.insert(0, str(Path(__file__).parents[1] / "kernels"))
from cuda_graphs import capture  # noqa: E402
from lora_cases import batch_info, lora_weights  # noqa: E402

from moelora.kernels import reference  # noqa: E402
from moelora.kernels.attention.norm_rope import rms_norm, rms_norm_lora, rope_store_kv  # noqa: E402
from moelora.step.lora import FoldedLora, LoraWeights  # noqa: E402

DEV = "cuda"
EPS = 1e-6
Hq, Hkv, D, L = 32, 4, 128, 4096


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    ref = ref.float()
    return ((out.float() - ref).norm() / ref.norm().clamp(min=1e-12)).item()


def _bf16_ulp(x: torch.Tensor) -> torch.Tensor:
    mag = x.float().abs().clamp(min=2.0**-126)
    return torch.exp2(torch.floor(torch.log2(mag)) - 7)  # 8 significant bits


def _assert_matches(out: torch.Tensor, ref: torch.Tensor, *, max_ulps: int | None = None):
    assert out.dtype == ref.dtype and out.shape == ref.shape
    if out.dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
        return
    differ = (out != ref).float().mean().item()
    assert differ <= 1e-2, f"{differ:.2%} of elements differ"
    assert _rel_err(out, ref) <= 1e-2
    if max_ulps is not None:
        a, b = out.float(), ref.float()
        ulp = _bf16_ulp(torch.maximum(a.abs(), b.abs()))
        assert ((a - b).abs() <= max_ulps * ulp).all(), ((a - b).abs() / ulp).max()


def _rope_inputs(T: int, dtype: torch.dtype):
    qkv = torch.randn(T, (Hq + 2 * Hkv) * D, device=DEV, dtype=dtype)
    q, k, v = qkv.split([Hq * D, Hkv * D, Hkv * D], dim=-1)
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, D, 2, device=DEV, dtype=torch.float32) / D))
    freqs = torch.outer(torch.arange(L, device=DEV, dtype=torch.float32), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)  # [L, D]
    positions = torch.randint(0, L, (T,), device=DEV)
    views = q.view(T, Hq, D), k.view(T, Hkv, D), v.view(T, Hkv, D)
    return *views, positions, emb.cos(), emb.sin()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("T", [1, 7, 256])
@pytest.mark.parametrize("N", [2048, 4096])
@pytest.mark.parametrize("with_residual", [True, False])
def test_rms_norm_gpu(dtype, T, N, with_residual):
    torch.manual_seed(T * N)
    x = torch.randn(T, N, device=DEV, dtype=dtype)
    weight = (1 + 0.5 * torch.randn(N, device=DEV)).to(dtype)
    residual = torch.randn(T, N, device=DEV, dtype=dtype) if with_residual else None
    out, s = rms_norm(x, weight, EPS, residual)
    ref_out, ref_s = reference.rms_norm(x, weight, EPS, residual)
    _assert_matches(out, ref_out, max_ulps=2)
    assert torch.equal(s, ref_s)


def test_rms_norm_gpu_strided_rows():
    """The "full" q norm reads the q slice of the fused qkv output."""
    torch.manual_seed(0)
    qkv = torch.randn(64, (Hq + 2 * Hkv) * D, device=DEV, dtype=torch.bfloat16)
    q = qkv[:, : Hq * D]
    weight = (1 + 0.5 * torch.randn(Hq * D, device=DEV)).to(torch.bfloat16)
    _assert_matches(rms_norm(q, weight, EPS)[0], reference.rms_norm(q, weight, EPS)[0], max_ulps=2)


@pytest.mark.parametrize("T", [1, 8, 64])
@pytest.mark.parametrize("gated", [True, False])
def test_rms_norm_joins_the_shared_expert_gpu(T, gated):
    """bf16, Qwen3.5's sizes (top-8 rows, the shared expert and its gate as views of SparseMoE's
    w_in product): the join inside the norm gives add_shared_expert's launch and then the
    norm's bits exactly."""
    from moelora.kernels.mlp import add_shared_expert

    torch.manual_seed(T + gated)
    N, K, dtype = 2048, 8, torch.bfloat16
    rows = torch.randn(T, K, N, device=DEV, dtype=dtype)
    product = torch.randn(T, 256 + N + 8, device=DEV, dtype=dtype)
    shared, gate = product[:, 256 : 256 + N], product[:, 256 + N : 257 + N] if gated else None
    weight = (1 + 0.5 * torch.randn(N, device=DEV)).to(dtype)
    residual = torch.randn(T, N, device=DEV, dtype=dtype)
    out, s = rms_norm(rows, weight, EPS, residual, shared=shared, shared_gate=gate)
    want_out, want_s = rms_norm(add_shared_expert(rows, shared, gate), weight, EPS, residual)
    assert torch.equal(out, want_out) and torch.equal(s, want_s)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("T", [1, 7, 256])
@pytest.mark.parametrize("with_norm", [True, False])
def test_rope_store_kv_gpu(dtype, T, with_norm):
    torch.manual_seed(T)
    q, k, _, positions, cos, sin = _rope_inputs(T, dtype)
    q_norm = (1 + 0.5 * torch.randn(D, device=DEV)).to(dtype) if with_norm else None
    k_norm = (1 + 0.5 * torch.randn(D, device=DEV)).to(dtype) if with_norm else None
    out = rope_store_kv(q, k, positions, cos, sin, q_norm, k_norm, EPS)
    ref = reference.rope_store_kv(q, k, positions, cos, sin, q_norm, k_norm, EPS)
    _assert_matches(out[0], ref[0])
    _assert_matches(out[1], ref[1])


@pytest.mark.parametrize("T", [1, 7, 2048])
def test_rope_store_kv_partial_rotary_gpu(T):
    """Partial rotary with per-head norms (Qwen3.5: a quarter of each head rotates), bf16."""
    torch.manual_seed(T + 4)
    q, k, _, positions, cos, sin = _rope_inputs(T, torch.bfloat16)
    q_norm = (1 + 0.5 * torch.randn(D, device=DEV)).to(torch.bfloat16)
    k_norm = (1 + 0.5 * torch.randn(D, device=DEV)).to(torch.bfloat16)
    args = (q, k, positions, cos, sin, q_norm, k_norm, EPS)
    out = rope_store_kv(*args, rotary_dim=D // 4)
    ref = reference.rope_store_kv(*args, rotary_dim=D // 4)
    _assert_matches(out[0], ref[0])
    _assert_matches(out[1], ref[1])


@pytest.mark.parametrize("T", [1, 7, 2048])
def test_rope_store_kv_interleaved_gpu(T):
    """MLA's rotary (DeepSeek's adjacent pairs): q_pe [T, 16, 64] and the k_pe head, strided
    views of the projections' outputs, in bf16; the reference reorders, then rotates."""
    torch.manual_seed(T + 3)
    R, heads = 64, 16
    q = torch.randn(T, heads, 192, device=DEV, dtype=torch.bfloat16)[..., 128:]
    k = torch.randn(T, 576, device=DEV, dtype=torch.bfloat16)[:, 512:].view(T, 1, R)
    inv_freq = 1.0 / (1e4 ** (torch.arange(0, R, 2, device=DEV, dtype=torch.float32) / R))
    freqs = torch.outer(torch.arange(L, device=DEV, dtype=torch.float32), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    positions = torch.randint(0, L, (T,), device=DEV)
    args = (q, k, positions, emb.cos(), emb.sin(), None, None, EPS)
    out = rope_store_kv(*args, interleaved=True)
    ref = reference.rope_store_kv(*args, interleaved=True)
    _assert_matches(out[0], ref[0])
    _assert_matches(out[1], ref[1])
    # with MLA's store: the key head and the latent (512 wide, as v) into one buffer's views
    latent = torch.randn(T, 1, 512, device=DEV, dtype=torch.bfloat16)
    buffer = torch.zeros(T // 16 + 2, 16, 1, 512 + R, device=DEV, dtype=torch.bfloat16)
    slots = torch.randperm(buffer.shape[0] * 16, device=DEV)[:T]
    caches = dict(
        v=latent, k_cache=buffer[..., 512:], v_cache=buffer[..., :512], slot_mapping=slots
    )
    _, k_out = rope_store_kv(*args, **caches, interleaved=True)
    want = torch.zeros_like(buffer)
    reference.store_kv(k_out, latent, want[..., 512:], want[..., :512], slots)
    assert torch.equal(buffer, want)
    # and with kv_a_layernorm inside (v_norm): the latent normed in place, then stored
    weight = (1 + 0.5 * torch.randn(512, device=DEV)).to(torch.bfloat16)
    raw = latent.clone()
    _, k_normed = rope_store_kv(*args, **caches, interleaved=True, v_norm=weight)
    _assert_matches(latent[:, 0], reference.rms_norm(raw[:, 0], weight, EPS)[0], max_ulps=2)
    want = torch.zeros_like(buffer)
    reference.store_kv(k_normed, latent, want[..., 512:], want[..., :512], slots)
    assert torch.equal(buffer, want) and torch.equal(k_normed, k_out)


def test_cuda_graph_replay_with_new_inputs():
    """Captured once; each replay sees new activations and positions written in place."""
    T, N, dtype = 64, 2048, torch.bfloat16
    torch.manual_seed(1)
    x = torch.randn(T, N, device=DEV, dtype=dtype)
    residual = torch.randn(T, N, device=DEV, dtype=dtype)
    weight = (1 + 0.5 * torch.randn(N, device=DEV)).to(dtype)
    q, k, _, positions, cos, sin = _rope_inputs(T, dtype)
    q_norm = (1 + 0.5 * torch.randn(D, device=DEV)).to(dtype)
    k_norm = (1 + 0.5 * torch.randn(D, device=DEV)).to(dtype)

    def step():
        return rms_norm(x, weight, EPS, residual), rope_store_kv(
            q, k, positions, cos, sin, q_norm, k_norm, EPS
        )

    graph, ((out, s), (q_out, k_out)) = capture(step)

    for _ in range(3):
        x.copy_(torch.randn(T, N, device=DEV))
        residual.copy_(torch.randn(T, N, device=DEV))
        q.copy_(torch.randn(T, Hq, D, device=DEV))
        k.copy_(torch.randn(T, Hkv, D, device=DEV))
        positions.copy_(torch.randint(0, L, (T,), device=DEV))
        graph.replay()
        torch.cuda.synchronize()
        ref_out, ref_s = reference.rms_norm(x, weight, EPS, residual)
        _assert_matches(out, ref_out, max_ulps=2)
        assert torch.equal(s, ref_s)
        ref_q, ref_k = reference.rope_store_kv(q, k, positions, cos, sin, q_norm, k_norm, EPS)
        _assert_matches(q_out, ref_q)
        _assert_matches(k_out, ref_k)


SENTINEL = 1234.0  # finite, so torch.equal compares it; no rotated or copied value is this
NUM_PAGES, PAGE_SIZE = 64, 16


def _store_inputs(T: int, dtype: torch.dtype):
    """Fused-qkv views of q, k, v; caches full of the sentinel; slots with padded rows (-1)."""
    q, k, v, positions, cos, sin = _rope_inputs(T, dtype)
    shape = (NUM_PAGES, PAGE_SIZE, Hkv, D)
    k_cache = torch.full(shape, SENTINEL, device=DEV, dtype=dtype)
    v_cache = torch.full(shape, SENTINEL, device=DEV, dtype=dtype)
    slots = torch.randperm(NUM_PAGES * PAGE_SIZE, device=DEV)[:T]
    slots[T // 2 :: 3] = -1
    return q, k, v, positions, cos, sin, k_cache, v_cache, slots


def _assert_stored(k_out, v, k_cache, v_cache, slots):
    k_sep, v_sep = torch.full_like(k_cache, SENTINEL), torch.full_like(v_cache, SENTINEL)
    reference.store_kv(k_out, v, k_sep, v_sep, slots)
    assert torch.equal(k_cache, k_sep) and torch.equal(v_cache, v_sep)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("T", [1, 7, 256])
@pytest.mark.parametrize("with_norm", [True, False])
def test_rope_store_kv_caches_gpu(dtype, T, with_norm):
    torch.manual_seed(T + 1)
    q, k, v, positions, cos, sin, k_cache, v_cache, slots = _store_inputs(T, dtype)
    q_norm = (1 + 0.5 * torch.randn(D, device=DEV)).to(dtype) if with_norm else None
    k_norm = (1 + 0.5 * torch.randn(D, device=DEV)).to(dtype) if with_norm else None
    caches = dict(v=v, k_cache=k_cache, v_cache=v_cache, slot_mapping=slots)
    q_out, k_out = rope_store_kv(q, k, positions, cos, sin, q_norm, k_norm, EPS, **caches)
    _assert_stored(k_out, v, k_cache, v_cache, slots)
    ref_q, ref_k = reference.rope_store_kv(q, k, positions, cos, sin, q_norm, k_norm, EPS)
    _assert_matches(q_out, ref_q)
    _assert_matches(k_out, ref_k)


def test_rope_store_kv_cuda_graph():
    """Replays write new k and v to new slots; the slots of earlier replays keep their values."""
    T, dtype = 64, torch.bfloat16
    torch.manual_seed(2)
    q, k, v, positions, cos, sin, k_cache, v_cache, slots = _store_inputs(T, dtype)
    q_norm = (1 + 0.5 * torch.randn(D, device=DEV)).to(dtype)
    k_norm = (1 + 0.5 * torch.randn(D, device=DEV)).to(dtype)
    caches = dict(v=v, k_cache=k_cache, v_cache=v_cache, slot_mapping=slots)

    def step():
        return rope_store_kv(q, k, positions, cos, sin, q_norm, k_norm, EPS, **caches)

    graph, (q_out, k_out) = capture(step)

    k_expect, v_expect = k_cache.clone(), v_cache.clone()
    for i in range(3):
        q.copy_(torch.randn(T, Hq, D, device=DEV))
        k.copy_(torch.randn(T, Hkv, D, device=DEV))
        v.copy_(torch.randn(T, Hkv, D, device=DEV))
        positions.copy_(torch.randint(0, L, (T,), device=DEV))
        # disjoint slot ranges per replay, some rows padded
        slots.copy_(torch.randperm(NUM_PAGES * PAGE_SIZE // 4, device=DEV)[:T] * 4 + i)
        slots[::5] = -1
        graph.replay()
        torch.cuda.synchronize()
        reference.store_kv(k_out, v, k_expect, v_expect, slots)
        assert torch.equal(k_cache, k_expect) and torch.equal(v_cache, v_expect)
        ref_q, ref_k = reference.rope_store_kv(q, k, positions, cos, sin, q_norm, k_norm, EPS)
        _assert_matches(q_out, ref_q)
        _assert_matches(k_out, ref_k)


# -- the LoRA folded into the norm and the rotary, bf16 against the float32 reference ----------
# N = hidden (2048). rms_norm_lora's expand: o's LoRA, lora_shrink_split's KS partial shrinks of
# the attention output [T, Hq D = 4096] expanded by o's B into N; its shrink: q|k|v's A over N
# (slices Hq D | Hkv D | Hkv D). R = pool rank.
LORA_TOL = 2e-2  # max abs error relative to the reference's max abs
LORA_N, LORA_K_IN = 2048, Hq * D


def _f32(lora: LoraWeights) -> LoraWeights:
    return LoraWeights.dense(lora.a.float(), lora.b.float(), lora.out_slices)


def _max_rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    ref = ref.float()
    return ((out.float() - ref).abs().max() / ref.abs().max().clamp(min=1e-12)).item()


def _enabled_rows(info, T: int) -> torch.Tensor:
    slots = info.slot_of_token[:T]
    return (slots >= 0) & (info.slot_enabled[slots.clamp(min=0).long()] != 0)


def _lora_info(T: int, spread: str, R: int):
    """batch_info whose rank-16 slots take the pool rank R and rank-8 ones R // 2 + 3 (when
    R > 16), so that ranks past 16 are exercised."""
    info = batch_info(T, spread, DEV)
    if R > 16:
        ranks = info.rank_of_slot
        ranks[ranks == 16] = R
        ranks[ranks == 8] = R // 2 + 3
    return info


def _partials(x_in: torch.Tensor, lora_in: LoraWeights, info, KS: int) -> torch.Tensor:
    """lora_shrink_split's output for KS slices of the input columns, [T, KS, 1, R] float32;
    rows without an enabled slot are NaN (the Triton split leaves them unwritten)."""
    parts = []
    for cols in torch.arange(x_in.shape[1], device=DEV).chunk(KS):
        a = lora_in.a[..., cols].contiguous()
        lora = LoraWeights.dense(a, lora_in.b, lora_in.out_slices)
        parts.append(reference.lora_shrink(x_in[:, cols], lora, info))
    part = torch.stack(parts, dim=1)
    part[~_enabled_rows(info, x_in.shape[0])] = float("nan")
    return part


def _norm_lora_inputs(T: int, R: int, info, *, with_residual: bool = True, KS: int = 8):
    """x, weight, residual, expand (o's LoRA into N, its partials), shrink = q|k|v's LoRA."""
    dtype, S, ranks = torch.bfloat16, info.num_slots, info.rank_of_slot.cpu()
    x = torch.randn(T, LORA_N, device=DEV, dtype=dtype)
    weight = (1 + 0.5 * torch.randn(LORA_N, device=DEV)).to(dtype)
    residual = torch.randn(T, LORA_N, device=DEV, dtype=dtype) if with_residual else None
    x_in = torch.randn(T, LORA_K_IN, device=DEV, dtype=dtype)
    lora_in = lora_weights(S, (), 1, R, LORA_K_IN, (LORA_N,), ranks, dtype, DEV)
    expand = FoldedLora(_partials(x_in, lora_in, info, KS), lora_in, info)
    slices = (Hq * D, Hkv * D, Hkv * D)
    shrink = lora_weights(S, (), 3, R, LORA_N, slices, ranks, dtype, DEV)
    return x, weight, residual, expand, shrink


def _assert_norm_lora(out, s, folded, info, x, weight, residual, expand, shrink):
    """Against reference.rms_norm_lora in bf16 (_assert_matches: the kernel rounds in its
    order) and in float32 on float32 copies (LORA_TOL); the shrink on enabled rows only."""
    T = x.shape[0]
    on = _enabled_rows(info, T)
    bf_expand = f32_expand = None
    if expand is not None:  # the reference reads every row
        part = expand.shrunk.nan_to_num(0.0)
        bf_expand = FoldedLora(part, expand.weights, info)
        f32_expand = FoldedLora(part, _f32(expand.weights), info)
    bf = reference.rms_norm_lora(x, weight, EPS, residual, info, shrink=shrink, expand=bf_expand)
    f32 = reference.rms_norm_lora(
        x.float(),
        weight.float(),
        EPS,
        None if residual is None else residual.float(),
        info,
        shrink=None if shrink is None else _f32(shrink),
        expand=f32_expand,
    )
    if expand is None:  # the plain norm, as test_rms_norm_gpu checks it
        _assert_matches(out, bf[0], max_ulps=2)
        assert torch.equal(s, bf[1])
    else:
        _assert_matches(out, bf[0])
        _assert_matches(s, bf[1])
    assert _max_rel(out, f32[0]) <= LORA_TOL
    assert _max_rel(s, f32[1]) <= LORA_TOL
    if shrink is None:
        assert folded is None
        return
    assert folded.weights is shrink and folded.info is info
    shrunk, ref_shrunk = folded.shrunk, f32[2].shrunk
    assert shrunk.shape == ref_shrunk.shape and shrunk.dtype == torch.float32
    assert torch.isfinite(shrunk[on]).all()
    if on.any():
        assert _max_rel(shrunk[on], ref_shrunk[on]) <= LORA_TOL


@pytest.mark.parametrize("T", [1, 64, 200])
@pytest.mark.parametrize("R", [16, 64])
@pytest.mark.parametrize("spread", ["mixed", "distinct", "one"])
def test_rms_norm_lora_gpu(T, R, spread):
    """The post-attention norm: o's LoRA into x, the residual add, q|k|v's shrink of out."""
    torch.manual_seed(T + R)
    info = _lora_info(T, spread, R)
    x, weight, residual, expand, shrink = _norm_lora_inputs(T, R, info)
    out, s, folded = rms_norm_lora(x, weight, EPS, residual, info, shrink=shrink, expand=expand)
    _assert_norm_lora(out, s, folded, info, x, weight, residual, expand, shrink)


@pytest.mark.parametrize("mode", ["expand", "shrink"])
def test_rms_norm_lora_gpu_one_side(mode):
    """Only the expand (with the residual), or only the shrink (the first layer's input norm:
    no residual, s is x itself)."""
    T, R = 64, 16
    torch.manual_seed(3)
    info = _lora_info(T, "mixed", R)
    with_residual = mode == "expand"
    x, weight, residual, expand, shrink = _norm_lora_inputs(T, R, info, with_residual=with_residual)
    if mode == "expand":
        shrink = None
    else:
        expand = None
    out, s, folded = rms_norm_lora(x, weight, EPS, residual, info, shrink=shrink, expand=expand)
    if mode == "shrink":
        assert s is x
    _assert_norm_lora(out, s, folded, info, x, weight, residual, expand, shrink)


@pytest.mark.parametrize("T", [1, 64])
@pytest.mark.parametrize("with_norm", [True, False])
@pytest.mark.parametrize("rotary_dim", [0, D // 2])  # D // 2: GLM-4.5's partial rotary
def test_rope_store_kv_lora_gpu(T, with_norm, rotary_dim):
    """q|k|v take the expand of the shrink (base rows of the shrink are NaN: never read), then
    the norm, the rotary and the KV store; against the float32 reference."""
    dtype, R, K_IN = torch.bfloat16, 16, LORA_N
    torch.manual_seed(T + 7)
    q, k, v, positions, cos, sin, k_cache, v_cache, slots = _store_inputs(T, dtype)
    if T == 1:
        slots.fill_(5)  # the one row is stored
    q_norm = (1 + 0.5 * torch.randn(D, device=DEV)).to(dtype) if with_norm else None
    k_norm = (1 + 0.5 * torch.randn(D, device=DEV)).to(dtype) if with_norm else None
    info = batch_info(T, "one" if T == 1 else "mixed", DEV)
    slices = (Hq * D, Hkv * D, Hkv * D)
    ranks = info.rank_of_slot.cpu()
    lora_qkv = lora_weights(info.num_slots, (), 3, R, K_IN, slices, ranks, dtype, DEV)
    shrunk = reference.lora_shrink(torch.randn(T, K_IN, device=DEV, dtype=dtype), lora_qkv, info)
    k_shrunk = shrunk.clone()
    k_shrunk[~_enabled_rows(info, T)] = float("nan")
    # the references, on copies of the caches, before the kernel runs
    bf_caches = dict(k_cache=k_cache.clone(), v_cache=v_cache.clone(), slot_mapping=slots)
    rope = (positions, cos, sin, q_norm, k_norm, EPS)
    expand = FoldedLora(shrunk, lora_qkv, info)
    partial = dict(rotary_dim=rotary_dim)
    bf_q, bf_k = reference.rope_store_kv(q, k, *rope, v=v, expand=expand, **bf_caches, **partial)
    qf, kf, vf = q.float(), k.float(), v.float()
    k_ref = torch.full(k_cache.shape, SENTINEL, device=DEV)
    v_ref = torch.full(v_cache.shape, SENTINEL, device=DEV)

    kernel_expand = FoldedLora(k_shrunk, lora_qkv, info)
    caches = dict(v=v, k_cache=k_cache, v_cache=v_cache, slot_mapping=slots)
    q_out, k_out = rope_store_kv(q, k, *rope, **caches, expand=kernel_expand, **partial)
    f32_norms = [None if w is None else w.float() for w in (q_norm, k_norm)]
    f32_caches = dict(v=vf, k_cache=k_ref, v_cache=v_ref, slot_mapping=slots)
    f32_expand = FoldedLora(shrunk, _f32(lora_qkv), info)
    ref_q, ref_k = reference.rope_store_kv(
        qf, kf, positions, cos, sin, *f32_norms, EPS, **f32_caches, expand=f32_expand, **partial
    )
    assert q_out.dtype == dtype and q_out.shape == (T, Hq, D) and q_out.is_contiguous()
    assert k_out.dtype == dtype and k_out.shape == (T, Hkv, D) and k_out.is_contiguous()
    assert torch.isfinite(q_out).all() and torch.isfinite(k_out).all()
    assert _max_rel(q_out, ref_q) <= LORA_TOL
    assert _max_rel(k_out, ref_k) <= LORA_TOL
    # and the bf16 reference, as test_rope_store_kv_caches_gpu checks the rotary alone
    _assert_matches(q_out, bf_q)
    _assert_matches(k_out, bf_k)
    # the cached k is exactly the returned k; both caches against the reference where stored
    k_sep = torch.full_like(k_cache, SENTINEL)
    reference.store_kv(k_out, v, k_sep, torch.full_like(v_cache, SENTINEL), slots)
    assert torch.equal(k_cache, k_sep)
    _assert_caches_near((k_cache, v_cache), (k_ref, v_ref), slots)
    stored = slots[slots >= 0]
    bf_v = bf_caches["v_cache"].view(-1, Hkv, D)[stored]
    _assert_matches(v_cache.view(-1, Hkv, D)[stored], bf_v)


def _assert_caches_near(caches, ref_caches, slots) -> None:
    """Stored rows within LORA_TOL of the reference's; the others keep the sentinel."""
    stored = slots[slots >= 0]
    untouched = torch.ones(NUM_PAGES * PAGE_SIZE, dtype=torch.bool, device=DEV)
    untouched[stored] = False
    for cache, ref_cache in zip(caches, ref_caches):
        flat, ref_flat = cache.view(-1, Hkv, D), ref_cache.view(-1, Hkv, D)
        assert (flat[untouched] == SENTINEL).all()
        assert _max_rel(flat[stored], ref_flat[stored]) <= LORA_TOL


def test_rms_norm_lora_cuda_graph():
    """Captured once with shrink and expand; each replay sees a new batch info (slots, enabled
    flags, scalings), new activations and new partial shrinks written in place."""
    T, R = 64, 16
    torch.manual_seed(4)
    info = _lora_info(T, "mixed", R)
    x, weight, residual, expand, shrink = _norm_lora_inputs(T, R, info)
    part, lora_in = expand.shrunk, expand.weights

    def step():
        return rms_norm_lora(x, weight, EPS, residual, info, shrink=shrink, expand=expand)

    graph, (out, s, folded) = capture(step)

    for spread in ("distinct", "none", "one", "mixed"):
        new = _lora_info(T, spread, R)
        for dst, src in zip(
            (info.slot_of_token, info.rank_of_slot, info.scaling_of_slot, info.slot_enabled),
            (new.slot_of_token, new.rank_of_slot, new.scaling_of_slot, new.slot_enabled),
        ):
            dst.copy_(src)
        x.copy_(torch.randn(T, LORA_N, device=DEV))
        residual.copy_(torch.randn(T, LORA_N, device=DEV))
        x_in = torch.randn(T, LORA_K_IN, device=DEV, dtype=x.dtype)
        part.copy_(_partials(x_in, lora_in, info, part.shape[1]))
        graph.replay()
        torch.cuda.synchronize()
        _assert_norm_lora(out, s, folded, info, x, weight, residual, expand, shrink)
