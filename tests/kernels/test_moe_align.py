"""The MoE align (moe_align.py) bit for bit against align_reference, on both of its paths.

Up to PMAX pairs one launch aligns; past pmax (PMAX, or lower here: the interpreter pays per
program) a count launch comes first and each program sorts a chunk of CB pairs. Sorting in the
interpreter is slow, so most cases run with chunks of 32 (the `small_chunks` fixture lowers
CHUNK_MIN and CHUNK_MAX): many chunks, every edge between them; a few run at the real sizes.
"""

import pytest
import torch

from moelora.kernels.moe import align as module
from moelora.kernels.moe.align import PMAX, align_plan, align_reference, moe_align, num_blocks


@pytest.fixture
def small_chunks(monkeypatch):
    monkeypatch.setattr(module, "CHUNK_MIN", 32)
    monkeypatch.setattr(module, "CHUNK_MAX", 32)


def routed_ids(T: int, E: int, K: int, spread: str) -> torch.Tensor:
    """[T, K] int32, distinct experts per token: "random", or "skewed" (every token the same K)."""
    if spread == "skewed":
        return torch.arange(K, dtype=torch.int32).flip(0).repeat(T, 1)
    return torch.rand(T, E).argsort(dim=1)[:, :K].to(torch.int32)


def pair_ids(P: int, E: int, spread: str) -> torch.Tensor:
    """[P] int32 expert ids, repeats allowed: "random"; "few" (three experts get every pair,
    the others none); "first" / "last" (every pair on expert 0 / E - 1)."""
    if spread == "few":
        return torch.tensor([1, E // 2, E - 1], dtype=torch.int32)[torch.randint(0, 3, (P,))]
    if spread in ("first", "last"):
        return torch.full((P,), 0 if spread == "first" else E - 1, dtype=torch.int32)
    return torch.randint(0, E, (P,), dtype=torch.int32)


def assert_aligned(ids: torch.Tensor, E: int, BM: int, pmax: int | None) -> None:
    expect = align_reference(ids, E, BM, num_blocks(ids.numel(), E, BM))
    got = moe_align(ids, E, BM, pmax=pmax)
    assert torch.equal(got[0], expect[0]), (E, BM, pmax, got[0], expect[0])
    assert torch.equal(got[1], expect[1]), (E, BM, pmax, got[1], expect[1])


# Each E with each K and each BM (BM cycles); with T up to 300, P up to 1024.
ALIGN_SHAPES = [
    (E, K, (16, 32, 64)[i % 3])
    for i, (E, K) in enumerate((E, K) for E in (8, 60, 128) for K in (1, 2, 8))
]


@pytest.mark.parametrize("T", [1, 3, 64, 300])  # 64 x K 2: 128 pairs, both paths
@pytest.mark.parametrize("spread", ["random", "skewed"])
def test_moe_align_matches_reference(poison_empty, small_chunks, T, spread):
    """The one-launch path, and up to 128 pairs the chunked one (pmax=0), on routed ids."""
    for E, K, BM in ALIGN_SHAPES:
        if T * K > 1024:  # the interpreter pays per program; the GPU test covers larger P
            continue
        ids = routed_ids(T, E, K, spread)
        for pmax in (PMAX, 0) if T * K <= 128 else (PMAX,):
            assert_aligned(ids.view(-1), E, BM, pmax)


@pytest.mark.parametrize("P", [31, 33, 300])
@pytest.mark.parametrize("E,BM", [(128, 16), (60, 32), (5, 64), (16, 128)])
@pytest.mark.parametrize("spread", ["random", "few", "first", "last"])
def test_chunked_align_matches_reference(poison_empty, small_chunks, P, E, BM, spread):
    """Past pmax=16, in chunks of 32: one chunk, a full one, a partial last one, up to 32 of
    them; experts with no pair, E not a power of two, every pair on one expert."""
    torch.manual_seed(P * E + BM)
    assert_aligned(pair_ids(P, E, spread), E, BM, pmax=16)


@pytest.mark.parametrize("P,E,BM", [(300, 60, 32), (512, 8, 64), (600, 128, 128)])
def test_chunked_align_at_its_real_chunk_sizes(poison_empty, P, E, BM):
    """pmax=64, so P pairs take the chunked path in chunks of CHUNK_MIN = 256 pairs (as the GPU
    does up to 32K pairs at E = 128): a partial last chunk, two full ones."""
    torch.manual_seed(P)
    assert align_plan(P, num_blocks(P, E, BM), E=E, BM=BM, pmax=64)[1]["CB"] == 256
    assert_aligned(pair_ids(P, E, "random"), E, BM, pmax=64)


def test_chunked_plan_sizes_follow_p_e_bm_only():
    """The grid and the tiles: chunks of 256 pairs up to 128 chunks at E = 128, then wider up to
    1024, then more chunks; NA covers the chunks and the blocks."""
    E = 128
    for P, CB in [(4097, 256), (32768, 256), (32769, 512), (65536, 512), (131072, 1024)]:
        for BM in (16, 32, 64, 128):
            NB = num_blocks(P, E, BM)
            NA, meta = align_plan(P, NB, E=E, BM=BM)
            assert meta["CHUNKED"] and meta["CB"] == CB, (P, meta)
            assert NA * meta["CB"] >= P and NA * meta["RB"] >= NB, (P, BM, NA, meta)
    NA, meta = align_plan(262144, num_blocks(262144, E, 32), E=E, BM=32)
    assert meta["CB"] == 1024 and NA >= 256
    assert not align_plan(PMAX, num_blocks(PMAX, E, 16), E=E, BM=16)[1]["CHUNKED"]
