"""kv_b_proj's LoRA under absorbed MLA in Triton (kernels/attention/mla_lora.py) vs the torch loops
(kernels/mla.lora_q_, lora_out_), in the interpreter (conftest sets it), float32 and float16.

The factors sit in the arena's compact layout with NaN gaps between slots (lora_cases.
compact_weights), at mixed ranks in a pool of max rank 8, so a read past a slot's rank or in
another slot's place shows up. Slots: 0 (rank 4) and 2 (rank 8) enabled, 1 disabled, 3 enabled but
without kv_b_proj (its module rank 0); tokens on the base model, and padded rows whose slot entries
past T hold a real slot, which the kernels must not read.
Legend: T = tokens, Hh = heads, N = qk_nope_head_dim, V = v_head_dim, L = kv_lora_rank.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton decorates the kernels

import pytest  # noqa: E402
import torch  # noqa: E402
from lora_cases import compact_weights, lora_weights  # noqa: E402

from moelora.kernels import mla  # noqa: E402
from moelora.kernels.attention import mla_lora  # noqa: E402
from moelora.step.lora import NO_SLOT, LoraBatchInfo, LoraWeights  # noqa: E402

MAX_RANK = 8
MODULE_RANKS = [4, 8, 8, 0]  # slot 3's adapter has no kv_b_proj
# tokens: two adapters, the base, a disabled slot, the slot without kv_b_proj; 2 padded rows
SLOTS = [0, 2, NO_SLOT, 1, 2, 0, 3, NO_SLOT, 0, NO_SLOT, NO_SLOT]
PAD_ROWS = 2
UNTOUCHED = [s not in (0, 2) for s in SLOTS]  # rows whose target must keep its bits
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=2e-3, rtol=2e-3)}


def kv_b_lora(Hh: int, N: int, V: int, L: int, dtype: torch.dtype, seed: int) -> LoraWeights:
    """kv_b_proj's factors over 4 slots: A [1, r, L], B [Hh (N + V), r], compact."""
    torch.manual_seed(seed)
    ranks = torch.tensor(MODULE_RANKS)
    dense = lora_weights(4, (), 1, MAX_RANK, L, (Hh * (N + V),), ranks, dtype)
    return compact_weights(dense, MODULE_RANKS)[0]


def batch_info(slots: list[int]) -> LoraBatchInfo:
    """The step's info over static buffers 3 rows longer than the step: the rows past it name
    slot 0, as a previous, longer step left them."""
    return LoraBatchInfo(
        torch.tensor(slots + [0] * 3, dtype=torch.int32),
        torch.tensor([4, 8, 8, 8], dtype=torch.int32),  # the adapters' ranks
        torch.tensor([0.5, 2.0, 1.5, 3.0]),
        torch.tensor([1, 0, 1, 1], dtype=torch.int32),
    )


def both(fn_name: str, target: torch.Tensor, source: torch.Tensor, lora, info):
    """(Triton's target, torch's target), each updated from a copy of `target`."""
    got, expected = target.clone(), target.clone()
    getattr(mla_lora, fn_name)(got, source, lora, info)
    getattr(mla, fn_name)(expected, source, lora, info)
    return got, expected


def check(got: torch.Tensor, expected: torch.Tensor, before: torch.Tensor, dtype) -> None:
    assert torch.isfinite(got).all(), "a NaN gap or a padded value was read"
    torch.testing.assert_close(got, expected, **TOL[dtype])
    untouched = torch.tensor(UNTOUCHED)
    assert torch.equal(got[untouched], before[untouched]), "a row without a slot was changed"
    assert not torch.equal(got[~untouched], before[~untouched]), "no LoRA was added"


SHAPES = [(2, 8, 8, 16), (3, 16, 8, 32), (4, 8, 16, 32), (6, 8, 8, 16)]  # (Hh, N, V, L)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("a_tile", [mla_lora.A_TILE, 64])  # 64: L in tiles of 8
@pytest.mark.parametrize("Hh,N,V,L", SHAPES)
def test_query_side(monkeypatch, Hh, N, V, L, a_tile, dtype):
    monkeypatch.setattr(mla_lora, "A_TILE", a_tile)
    lora = kv_b_lora(Hh, N, V, L, dtype, seed=Hh + N)
    T = len(SLOTS)
    q_nope = torch.randn(T, Hh, N).to(dtype)
    q_lat = torch.randn(T, Hh, L)
    got, expected = both("lora_q_", q_lat, q_nope, lora, batch_info(SLOTS))
    check(got, expected, q_lat, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("a_tile", [mla_lora.A_TILE, 64])
@pytest.mark.parametrize("Hh,N,V,L", SHAPES)
def test_output_side(monkeypatch, Hh, N, V, L, a_tile, dtype):
    monkeypatch.setattr(mla_lora, "A_TILE", a_tile)
    lora = kv_b_lora(Hh, N, V, L, dtype, seed=Hh + V)
    T = len(SLOTS)
    o_lat = torch.randn(T, Hh, L)
    o_lat[T - PAD_ROWS :] = 0  # latent_attention's padded rows
    out = torch.randn(T, Hh, V)
    got, expected = both("lora_out_", out, o_lat, lora, batch_info(SLOTS))
    check(got, expected, out, dtype)


@pytest.mark.parametrize("Hh,N,V,L", SHAPES[:2])
def test_output_side_rounded(Hh, N, V, L):
    """rounded=: every row, a corrected one or not, rounded into the model's dtype (float16
    here) in the same launch: what the reference rounds, and out itself left unwritten."""
    dtype = torch.float16
    lora = kv_b_lora(Hh, N, V, L, dtype, seed=Hh + V + 1)
    T = len(SLOTS)
    o_lat, out = torch.randn(T, Hh, L), torch.randn(T, Hh, V)
    got, expected = torch.full((2, T, Hh, V), 7.0, dtype=dtype)
    before = out.clone()
    mla_lora.lora_out_(out, o_lat, lora, batch_info(SLOTS), rounded=got)
    assert torch.equal(out, before), "out is not written with rounded"
    mla.lora_out_(out.clone(), o_lat, lora, batch_info(SLOTS), rounded=expected)
    torch.testing.assert_close(got.float(), expected.float(), **TOL[dtype])
    untouched = torch.tensor(UNTOUCHED)
    assert torch.equal(got[untouched], before[untouched].to(dtype)), "a base row's rounding"
    assert not torch.equal(got[~untouched], before[~untouched].to(dtype)), "no LoRA was added"


def test_strided_targets():
    """q_nope as the layer passes it (a slice of q's heads) and targets that are views with
    strides of their own: the kernels follow the strides."""
    Hh, N, V, L, R = 3, 8, 8, 16, 4
    lora = kv_b_lora(Hh, N, V, L, torch.float32, seed=1)
    T = len(SLOTS)
    q_nope = torch.randn(T, Hh, N + R)[..., :N]
    q_lat = torch.randn(Hh, T, L).transpose(0, 1)
    got, expected = both("lora_q_", q_lat, q_nope, lora, batch_info(SLOTS))
    check(got, expected, q_lat, torch.float32)
    out = torch.randn(T, V, Hh).permute(0, 2, 1)
    got, expected = both("lora_out_", out, torch.randn(T, Hh, L), lora, batch_info(SLOTS))
    check(got, expected, out, torch.float32)


def test_new_slot_assignments_in_place():
    """A graph's replay: the same info buffers rewritten in place with slots 0 and 2 swapped and
    a base token given an adapter; each launch follows what the buffers hold."""
    Hh, N, V, L = 2, 8, 8, 16
    lora = kv_b_lora(Hh, N, V, L, torch.float32, seed=2)
    T = len(SLOTS)
    info = batch_info(SLOTS)
    q_nope, q_lat = torch.randn(T, Hh, N), torch.randn(T, Hh, L)
    first, _ = both("lora_q_", q_lat, q_nope, lora, info)
    swapped = [{0: 2, 2: 0}.get(s, s) for s in SLOTS]
    swapped[2] = 0
    info.slot_of_token[:T] = torch.tensor(swapped, dtype=torch.int32)
    got, expected = both("lora_q_", q_lat, q_nope, lora, info)
    torch.testing.assert_close(got, expected, **TOL[torch.float32])
    assert not torch.equal(got[2], q_lat[2]), "the base token's new adapter was not read"
    assert not torch.allclose(got[0], first[0]), "slot 0's factors equal slot 2's: a weak test"


def test_no_enabled_slot_changes_nothing():
    Hh, N, V, L = 2, 8, 8, 16
    lora = kv_b_lora(Hh, N, V, L, torch.float32, seed=3)
    T = len(SLOTS)
    info = batch_info(SLOTS)
    info.slot_enabled.zero_()
    q_lat, out = torch.randn(T, Hh, L), torch.randn(T, Hh, V)
    got_q, got_out = q_lat.clone(), out.clone()
    mla_lora.lora_q_(got_q, torch.randn(T, Hh, N), lora, info)
    mla_lora.lora_out_(got_out, torch.randn(T, Hh, L), lora, info)
    assert torch.equal(got_q, q_lat) and torch.equal(got_out, out)
