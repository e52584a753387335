"""kv_b_proj's LoRA under absorbed MLA, inside the Triton absorption's launches
(kernels/attention/mla_absorb.py), vs the torch references (kernels/mla.absorb_q and
absorb_out with lora_q_ and lora_out_), in the interpreter (conftest sets it), float32 and
float16.

The factors sit in the arena's compact layout with NaN gaps between slots (lora_cases.
compact_weights), at mixed ranks in a pool of max rank 8, so a read past a slot's rank or in
another slot's place shows up. Slots: 0 (rank 4) and 2 (rank 8) enabled, 1 disabled, 3 enabled but
without kv_b_proj (its module rank 0); tokens on the base model, and padded rows whose slot entries
past T hold a real slot, which the kernel must not read. Rows without a correction must keep the
bits of the absorption without LoRA.
Legend: T = tokens, Hh = heads, N = qk_nope_head_dim, V = v_head_dim, L = kv_lora_rank.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton decorates the kernels

import pytest  # noqa: E402
import torch  # noqa: E402
from lora_cases import compact_weights, lora_weights  # noqa: E402

from moelora.kernels import mla, reference  # noqa: E402
from moelora.kernels.attention import mla_absorb  # noqa: E402
from moelora.step.lora import NO_SLOT, LoraBatchInfo, LoraWeights  # noqa: E402

MAX_RANK = 8
MODULE_RANKS = [4, 8, 8, 0]  # slot 3's adapter has no kv_b_proj
# tokens: two adapters, the base, a disabled slot, the slot without kv_b_proj; 2 padded rows
SLOTS = [0, 2, NO_SLOT, 1, 2, 0, 3, NO_SLOT, 0, NO_SLOT, NO_SLOT]
UNTOUCHED = [s not in (0, 2) for s in SLOTS]  # rows that take no correction
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


def kv_b_of(Hh: int, N: int, V: int, L: int, dtype: torch.dtype) -> torch.Tensor:
    return (torch.randn(Hh * (N + V), L) / L**0.5).to(dtype)


def check(got: torch.Tensor, expected: torch.Tensor, base: torch.Tensor, dtype) -> None:
    """got close to the reference; its rows without a correction equal to the absorption
    without LoRA (`base`), and the others not."""
    assert torch.isfinite(got).all(), "a NaN gap or a padded value was read"
    torch.testing.assert_close(got.float(), expected.float(), **TOL[dtype])
    untouched = torch.tensor(UNTOUCHED)
    assert torch.equal(got[untouched], base[untouched]), "a row without a slot was changed"
    assert not torch.equal(got[~untouched], base[~untouched]), "no LoRA was added"


SHAPES = [(2, 8, 8, 16), (3, 16, 8, 32), (4, 8, 16, 32), (6, 24, 20, 80)]  # (Hh, N, V, L)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("Hh,N,V,L", SHAPES)
def test_query_side(Hh, N, V, L, dtype):
    lora = kv_b_lora(Hh, N, V, L, dtype, seed=Hh + N)
    T, kv_b = len(SLOTS), kv_b_of(Hh, N, V, L, dtype)
    q_nope = torch.randn(T, Hh, N).to(dtype)
    info = batch_info(SLOTS)
    got = mla_absorb.absorb_q(q_nope, kv_b, lora=lora, info=info)
    expected = mla.absorb_q(q_nope, kv_b, lora=lora, info=info)
    assert got.dtype == torch.float32 and got.shape == (T, Hh, L)
    check(got, expected, mla_absorb.absorb_q(q_nope, kv_b), dtype)


F32, F16 = torch.float32, torch.float16


@pytest.mark.parametrize("dtype,out_dtype", [(F32, F32), (F16, F32), (F16, F16)])
@pytest.mark.parametrize("Hh,N,V,L", SHAPES)
def test_output_side(Hh, N, V, L, dtype, out_dtype):
    """The correction before the one rounding to out_dtype (the model's dtype in a step)."""
    lora = kv_b_lora(Hh, N, V, L, dtype, seed=Hh + V)
    T, kv_b = len(SLOTS), kv_b_of(Hh, N, V, L, dtype)
    o_lat = torch.randn(T, Hh, L)
    o_lat[T - 2 :] = 0  # latent_attention's padded rows
    info = batch_info(SLOTS)
    got = mla_absorb.absorb_out(o_lat, kv_b, N, out_dtype, lora=lora, info=info)
    expected = mla.absorb_out(o_lat, kv_b, N, out_dtype, lora=lora, info=info)
    assert got.dtype == out_dtype and got.shape == (T, Hh, V)
    check(got, expected, mla_absorb.absorb_out(o_lat, kv_b, N, out_dtype), dtype)


def test_strided_queries():
    """q_nope as the layer passes it: a slice of q's heads, rows strided by N + R."""
    Hh, N, V, L, R = 3, 8, 8, 16, 4
    lora = kv_b_lora(Hh, N, V, L, torch.float32, seed=1)
    T, kv_b = len(SLOTS), kv_b_of(Hh, N, V, L, torch.float32)
    q_nope = torch.randn(T, Hh, N + R)[..., :N]
    info = batch_info(SLOTS)
    got = mla_absorb.absorb_q(q_nope, kv_b, lora=lora, info=info)
    expected = mla.absorb_q(q_nope, kv_b, lora=lora, info=info)
    check(got, expected, mla_absorb.absorb_q(q_nope, kv_b), torch.float32)


def both_sides_match(q_nope, o_lat, kv_b, lora: LoraWeights, info: LoraBatchInfo) -> None:
    """The kernel's absorb_q and absorb_out, with the LoRA, equal to the references."""
    N = q_nope.shape[2]
    got = mla_absorb.absorb_q(q_nope, kv_b, lora=lora, info=info)
    torch.testing.assert_close(got, mla.absorb_q(q_nope, kv_b, lora=lora, info=info))
    got = mla_absorb.absorb_out(o_lat, kv_b, N, lora=lora, info=info)
    torch.testing.assert_close(got, mla.absorb_out(o_lat, kv_b, N, lora=lora, info=info))


# how the first pass of kv_b_proj's LoRA is scheduled (mla_absorb's module settings): its own
# walk after the base's, or in the base's walk at every block size; G by the rows or not; the
# module's own (fused at one row, G by the rows)
VARIANTS = {
    "apart": dict(FUSED_SIDES=(), G_BY_ROWS=False),
    "fused": dict(FUSED_SIDES=("q", "out"), FUSED_MAX_ROWS=1 << 30, G_BY_ROWS=False),
    "apart, G by rows": dict(FUSED_SIDES=(), G_BY_ROWS=True),
    "default": {},
}


def set_variant(monkeypatch, variant: str) -> None:
    for name, value in VARIANTS[variant].items():
        monkeypatch.setattr(mla_absorb, name, value)


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("fill,blocks", [(1, 1), (mla_absorb.FILL, 3)])
def test_rows_of_many_token_blocks(monkeypatch, fill, blocks, variant):
    """40 tokens of every slot mixed, in one token block of 64 (FILL = 1: blocks of the rows
    alone) or three of 16 (the GPU-filling rule, at these few heads and columns), each block
    its own walk over the slots its rows hold; the first pass as each variant schedules it."""
    monkeypatch.setattr(mla_absorb, "FILL", fill)
    set_variant(monkeypatch, variant)
    Hh, N, V, L = 2, 8, 8, 16
    assert -(-40 // mla_absorb.row_block(40, Hh)) == blocks
    lora = kv_b_lora(Hh, N, V, L, torch.float32, seed=4)
    g = torch.Generator().manual_seed(5)
    slots = torch.randint(-1, 4, (40,), generator=g).tolist()
    info = batch_info(slots)
    kv_b = kv_b_of(Hh, N, V, L, torch.float32)
    both_sides_match(torch.randn(40, Hh, N), torch.randn(40, Hh, L), kv_b, lora, info)


@pytest.mark.parametrize(
    "cols,variant",
    [(16, "apart"), (32, "fused"), (32, "apart, G by rows"), (mla_absorb.LORA_COLS, "apart")]
    + [(16, "default"), (mla_absorb.LORA_COLS, "fused")],
)
def test_more_adapters_than_a_pass_takes(monkeypatch, cols, variant):
    """10 slots (one disabled, one without kv_b_proj) over 40 tokens: a block's rows hold more
    adapters than a pass of LORA_COLS columns takes, so it walks K in several passes, each
    keeping its own slots' rows; the first of them as the variant schedules it."""
    monkeypatch.setattr(mla_absorb, "LORA_COLS", cols)
    set_variant(monkeypatch, variant)
    Hh, N, V, L, S = 2, 8, 8, 16, 10
    g = torch.Generator().manual_seed(7)
    ranks = torch.randint(1, MAX_RANK + 1, (S,), generator=g)
    ranks[4] = 0  # an adapter without kv_b_proj
    dense = lora_weights(S, (), 1, MAX_RANK, L, (Hh * (N + V),), ranks, torch.float32)
    lora = compact_weights(dense, ranks.tolist())[0]
    slots = torch.randint(-1, S, (40,), generator=g).tolist()
    enabled = torch.ones(S, dtype=torch.int32)
    enabled[7] = 0
    info = LoraBatchInfo(
        torch.tensor(slots, dtype=torch.int32),
        torch.full((S,), MAX_RANK, dtype=torch.int32),
        torch.rand(S, generator=g) + 0.5,
        enabled,
    )
    kv_b = kv_b_of(Hh, N, V, L, torch.float32)
    both_sides_match(torch.randn(40, Hh, N), torch.randn(40, Hh, L), kv_b, lora, info)


def test_new_slot_assignments_in_place():
    """A graph's replay: the same info buffers rewritten in place with slots 0 and 2 swapped and
    a base token given an adapter; each launch follows what the buffers hold."""
    Hh, N, V, L = 2, 8, 8, 16
    lora = kv_b_lora(Hh, N, V, L, torch.float32, seed=2)
    T, kv_b = len(SLOTS), kv_b_of(Hh, N, V, L, torch.float32)
    info = batch_info(SLOTS)
    q_nope = torch.randn(T, Hh, N)
    first = mla_absorb.absorb_q(q_nope, kv_b, lora=lora, info=info)
    swapped = [{0: 2, 2: 0}.get(s, s) for s in SLOTS]
    swapped[2] = 0
    info.slot_of_token[:T] = torch.tensor(swapped, dtype=torch.int32)
    got = mla_absorb.absorb_q(q_nope, kv_b, lora=lora, info=info)
    torch.testing.assert_close(
        got, mla.absorb_q(q_nope, kv_b, lora=lora, info=info), **TOL[torch.float32]
    )
    assert not torch.allclose(got[2], first[2]), "the base token's new adapter was not read"
    assert not torch.allclose(got[0], first[0]), "slot 0's factors equal slot 2's: a weak test"


def test_no_enabled_slot_changes_nothing():
    """Every slot disabled: both sides give the bits of the absorption without LoRA."""
    Hh, N, V, L = 2, 8, 8, 16
    lora = kv_b_lora(Hh, N, V, L, torch.float32, seed=3)
    T, kv_b = len(SLOTS), kv_b_of(Hh, N, V, L, torch.float32)
    info = batch_info(SLOTS)
    info.slot_enabled.zero_()
    q_nope, o_lat = torch.randn(T, Hh, N), torch.randn(T, Hh, L)
    got = mla_absorb.absorb_q(q_nope, kv_b, lora=lora, info=info)
    assert torch.equal(got, mla_absorb.absorb_q(q_nope, kv_b))
    got = mla_absorb.absorb_out(o_lat, kv_b, N, lora=lora, info=info)
    assert torch.equal(got, mla_absorb.absorb_out(o_lat, kv_b, N))


O_RANKS = [8, 4, 0, 4]  # o_proj's module ranks: slot 2's adapter has no o_proj


def o_lora_of(Hh: int, V: int, H: int, dtype: torch.dtype, seed: int) -> LoraWeights:
    """o_proj's factors over the 4 slots: A [1, r, Hh V], B [H, r], compact."""
    torch.manual_seed(seed)
    dense = lora_weights(4, (), 1, MAX_RANK, Hh * V, (H,), torch.tensor(O_RANKS), dtype)
    return compact_weights(dense, O_RANKS)[0]


@pytest.mark.parametrize("with_kv_b", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("Hh,N,V,L", [SHAPES[1], (2, 8, 80, 16)])  # V = 80: two column blocks
def test_o_shrink_rides_in_the_out_side(Hh, N, V, L, dtype, with_kv_b):
    """absorb_out_o_shrink: the output of absorb_out to the bit, and o_proj's LoRA shrink of
    it, its partials summed over KS, equal to reference.lora_shrink on the rows with an
    enabled slot that has o_proj's factors (slots 0 and 3; the others are not written)."""
    lora = kv_b_lora(Hh, N, V, L, dtype, seed=Hh + L) if with_kv_b else None
    o_lora = o_lora_of(Hh, V, 24, dtype, seed=Hh + V + 7)
    T, kv_b = len(SLOTS), kv_b_of(Hh, N, V, L, dtype)
    o_lat = torch.randn(T, Hh, L)
    info = batch_info(SLOTS)
    out, part = mla_absorb.absorb_out_o_shrink(
        o_lat, kv_b, N, dtype, lora=lora, info=info, o_lora=o_lora
    )
    assert torch.equal(out, mla_absorb.absorb_out(o_lat, kv_b, N, dtype, lora=lora, info=info))
    assert part.shape == (T, Hh * -(-V // 64), 1, MAX_RANK) and part.dtype == torch.float32
    rows = torch.tensor([s in (0, 3) for s in SLOTS])
    expected = reference.lora_shrink(out.reshape(T, -1), o_lora, info)
    got = part[rows].sum(dim=1)
    assert torch.isfinite(got).all(), "a NaN gap was read"
    torch.testing.assert_close(got, expected[rows], **TOL[dtype])
    assert got.abs().amax() > 0, "no shrink was written"
