"""Triton rms_norm and rope_qk on the GPU at real sizes, against the torch references.

float32: assert_close(rtol=1e-5, atol=1e-5). bfloat16: the kernels round in the references'
order, so almost every element is bit-equal; the rest come from the float32 sum of squares
(another order, another rsqrt) flipping one rounding of the normed value, which the weight
product can carry to 2 ulps (and rotary's cancellation to more, in absolute terms of the
result). Hence: <= 1% of elements differ (a wrong rounding order makes most of them differ),
rms_norm elements within 2 bf16 ulps, and the relative error of the whole output <= 1e-2.
The KV store fused into rope_qk must cache exactly what store_kv would from the returned k.
The CUDA-graph tests capture the kernels once and replay them with new inputs.
Legend: T = tokens, N = hidden, Hq/Hkv = query/kv heads, D = head dim, L = table rows.
"""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():  # before any kernel module is imported (see kernels/conftest)
    pytest.skip("needs a CUDA device", allow_module_level=True)
pytest.importorskip("triton")

from moelora.kernels import reference  # noqa: E402
from moelora.kernels.norm_rope import rms_norm, rope_qk  # noqa: E402

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


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("T", [1, 7, 256])
@pytest.mark.parametrize("with_norm", [True, False])
def test_rope_qk_gpu(dtype, T, with_norm):
    torch.manual_seed(T)
    q, k, _, positions, cos, sin = _rope_inputs(T, dtype)
    q_norm = (1 + 0.5 * torch.randn(D, device=DEV)).to(dtype) if with_norm else None
    k_norm = (1 + 0.5 * torch.randn(D, device=DEV)).to(dtype) if with_norm else None
    out = rope_qk(q, k, positions, cos, sin, q_norm, k_norm, EPS)
    ref = reference.rope_qk(q, k, positions, cos, sin, q_norm, k_norm, EPS)
    _assert_matches(out[0], ref[0])
    _assert_matches(out[1], ref[1])


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
        return rms_norm(x, weight, EPS, residual), rope_qk(
            q, k, positions, cos, sin, q_norm, k_norm, EPS
        )

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        (out, s), (q_out, k_out) = step()

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
        ref_q, ref_k = reference.rope_qk(q, k, positions, cos, sin, q_norm, k_norm, EPS)
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
def test_rope_qk_store_kv_gpu(dtype, T, with_norm):
    torch.manual_seed(T + 1)
    q, k, v, positions, cos, sin, k_cache, v_cache, slots = _store_inputs(T, dtype)
    q_norm = (1 + 0.5 * torch.randn(D, device=DEV)).to(dtype) if with_norm else None
    k_norm = (1 + 0.5 * torch.randn(D, device=DEV)).to(dtype) if with_norm else None
    caches = dict(v=v, k_cache=k_cache, v_cache=v_cache, slot_mapping=slots)
    q_out, k_out = rope_qk(q, k, positions, cos, sin, q_norm, k_norm, EPS, **caches)
    _assert_stored(k_out, v, k_cache, v_cache, slots)
    ref_q, ref_k = reference.rope_qk(q, k, positions, cos, sin, q_norm, k_norm, EPS)
    _assert_matches(q_out, ref_q)
    _assert_matches(k_out, ref_k)


def test_rope_qk_store_kv_cuda_graph():
    """Replays write new k and v to new slots; the slots of earlier replays keep their values."""
    T, dtype = 64, torch.bfloat16
    torch.manual_seed(2)
    q, k, v, positions, cos, sin, k_cache, v_cache, slots = _store_inputs(T, dtype)
    q_norm = (1 + 0.5 * torch.randn(D, device=DEV)).to(dtype)
    k_norm = (1 + 0.5 * torch.randn(D, device=DEV)).to(dtype)
    caches = dict(v=v, k_cache=k_cache, v_cache=v_cache, slot_mapping=slots)

    def step():
        return rope_qk(q, k, positions, cos, sin, q_norm, k_norm, EPS, **caches)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        q_out, k_out = step()

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
        ref_q, ref_k = reference.rope_qk(q, k, positions, cos, sin, q_norm, k_norm, EPS)
        _assert_matches(q_out, ref_q)
        _assert_matches(k_out, ref_k)
