"""The dense MLP's and the shared expert's elementwise kernels (kernels/mlp.py) vs their torch
references, in the interpreter (conftest sets it), float32 and float16, on fresh random inputs
at widths that leave a partial block.

Legend: T = tokens, I = intermediate, K = top-k rows, H = hidden.
"""

from __future__ import annotations

import pytest
import torch

from moelora.kernels import mlp, reference
from moelora.kernels.attention.output_gate import output_gate

TOL = {torch.float32: dict(atol=1e-6, rtol=1e-6), torch.float16: dict(atol=1e-3, rtol=1e-3)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("T,I", [(1, 96), (5, 1100)])
def test_silu_and_mul_matches_reference(poison_empty, dtype, T, I):
    gate_up = (2 * torch.randn(T, 2 * I + 16)).to(dtype)[:, : 2 * I]  # strided rows
    got = mlp.silu_and_mul(gate_up)
    assert got.shape == (T, I) and got.dtype == dtype
    torch.testing.assert_close(got, reference.silu_and_mul(gate_up), **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("K", [0, 1, 6])  # 0: the routed experts already summed, [T, H]
@pytest.mark.parametrize("gated", [True, False])
def test_add_shared_expert_matches_reference(poison_empty, dtype, K, gated):
    T, H = 3, 1100
    moe_out = torch.randn(T, H, dtype=dtype) if K == 0 else torch.randn(T, K, H, dtype=dtype)
    shared = torch.randn(T, H + 8, dtype=dtype)[:, :H]  # strided rows
    gate_logits = (2 * torch.randn(T, 4)).to(dtype)[:, :1] if gated else None
    got = mlp.add_shared_expert(moe_out, shared, gate_logits)
    assert got.shape == (T, H) and got.dtype == dtype
    want = reference.add_shared_expert(moe_out, shared, gate_logits)
    torch.testing.assert_close(got, want, **TOL[dtype])
    if gated:  # the gate scales: without it the sum is elsewhere
        assert not torch.allclose(got, reference.add_shared_expert(moe_out, shared), **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("T", [1, 3])
def test_output_gate_matches_reference(poison_empty, dtype, T):
    """The gated attention's output gate (kernels/attention/output_gate.py), its gate a strided
    view beside each head's query as qkv_proj leaves it."""
    Hq, D = 5, 24
    out = torch.randn(T, Hq + 1, D).to(dtype)[:, 1:]  # strided rows are fine too
    q_gate = (2 * torch.randn(T, Hq, 2, D)).to(dtype)
    gate = q_gate[:, :, 1]
    got = output_gate(out, gate)
    assert got.shape == (T, Hq, D) and got.dtype == dtype
    torch.testing.assert_close(got, reference.output_gate(out, gate), **TOL[dtype])
