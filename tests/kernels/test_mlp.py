"""The dense MLP's and the shared expert's elementwise kernels (kernels/mlp.py) vs their torch
references, in the interpreter (conftest sets it), float32 and float16, on fresh random inputs
at widths that leave a partial block.

Legend: T = tokens, I = intermediate, K = top-k rows, H = hidden.
"""

from __future__ import annotations

import pytest
import torch
from lora_cases import compact_weights, lora_weights

from moelora.kernels import mlp, reference
from moelora.kernels.attention.output_gate import output_gate
from moelora.step.lora import NO_SLOT, FoldedLora, LoraBatchInfo

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


# silu_and_mul_lora: gate_up_proj's LoRA (shrunk before, as the norm does) expanded into gate
# and up, down_proj's shrunk from h. Slots: 0 (rank 4) and 2 (rank 8) enabled with both
# modules, 1 disabled, 3 enabled with gate_up's factors only (its down rank 0); base rows and
# padded rows past T that name slot 0.
LORA_SLOTS = [0, 2, NO_SLOT, 1, 2, 0, 3, NO_SLOT]
GATE_UP_RANKS, DOWN_RANKS = [4, 8, 8, 4], [4, 8, 8, 0]


def mlp_lora_info() -> LoraBatchInfo:
    return LoraBatchInfo(
        torch.tensor(LORA_SLOTS + [0] * 3, dtype=torch.int32),
        torch.tensor([4, 8, 8, 4], dtype=torch.int32),
        torch.tensor([0.5, 2.0, 1.5, 3.0]),
        torch.tensor([1, 0, 1, 1], dtype=torch.int32),
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("I", [96, 600])  # 600: three column blocks, the last partial
@pytest.mark.parametrize("halves", ["both", "expand", "shrink"])
def test_silu_and_mul_lora_matches_reference(poison_empty, dtype, I, halves):
    """Both halves against reference.silu_and_mul_lora (compact factors with NaN gaps): h
    within rounding, the shrink's partials summed equal reference.lora_shrink on the rows
    with down_proj's factors (slots 0 and 2), rows without a slot as silu_and_mul gives."""
    H, T = 40, len(LORA_SLOTS)
    info = mlp_lora_info()
    dense = lora_weights(4, (), 2, 8, H, (I, I), torch.tensor(GATE_UP_RANKS), dtype)
    gate_up_lora = compact_weights(dense, GATE_UP_RANKS)[0]
    dense = lora_weights(4, (), 1, 8, I, (H,), torch.tensor(DOWN_RANKS), dtype)
    down_lora = compact_weights(dense, DOWN_RANKS)[0]
    x = torch.randn(T, H).to(dtype)
    expand = None
    if halves != "shrink":
        expand = FoldedLora(reference.lora_shrink(x, gate_up_lora, info), gate_up_lora, info)
    shrink = None if halves == "expand" else down_lora
    gate_up = (2 * torch.randn(T, 2 * I + 16)).to(dtype)[:, : 2 * I]  # strided rows
    h, down = mlp.silu_and_mul_lora(gate_up, info, expand=expand, shrink=shrink)
    want, want_down = reference.silu_and_mul_lora(gate_up, info, expand=expand, shrink=shrink)
    assert h.shape == (T, I) and h.dtype == dtype and torch.isfinite(h).all()
    # the delta's sum in another order than the reference's matmul
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else TOL[dtype]
    torch.testing.assert_close(h, want, **tol)
    base = torch.tensor([s in (NO_SLOT, 1) for s in LORA_SLOTS])
    assert torch.equal(h[base], mlp.silu_and_mul(gate_up)[base]), "a base row changed"
    if expand is not None:
        assert not torch.allclose(h[~base], mlp.silu_and_mul(gate_up)[~base])
    if shrink is None:
        assert down is None
        return
    rows = torch.tensor([s in (0, 2) for s in LORA_SLOTS])
    assert down.weights is down_lora and down.shrunk.shape == (T, -(-I // 256), 1, 8)
    got = down.shrunk[rows].sum(dim=1)
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(got, want_down.shrunk[rows].sum(dim=1), **tol)
    assert got.abs().amax() > 0
