"""The MoE align on the GPU against its torch statement, bit for bit, at decode and prefill sizes.

Qwen3-30B-A3B routing (E=128, K=8) for T in {1, 8, 64, 128, 256} (P up to 2048: the one-launch
path every CUDA-graph batch takes) and each block size, on random and skewed ids, with the
chunked path (pmax=0) checked too; then prefill sizes up to 16K tokens (P up to 128K pairs: the
chunked path at every chunk size) at BM 16..128, other expert counts, and a graph replay at a
prefill size. Output buffers start poisoned, so a row no program writes shows up.
"""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():  # before any kernel module is imported (see kernels/conftest)
    pytest.skip("needs a CUDA device", allow_module_level=True)
pytest.importorskip("triton")

from moelora.kernels.moe.align import (  # noqa: E402
    PMAX,
    align_plan,
    align_reference,
    moe_align,
    num_blocks,
)

DEV = "cuda"
E, K = 128, 8


@pytest.fixture
def poison_empty(monkeypatch):
    """torch.empty returns -7 for ints: a row or block the kernel leaves unwritten shows up."""
    empty = torch.empty

    def poisoned(*args, **kwargs):
        out = empty(*args, **kwargs)
        return out.fill_(float("nan") if out.is_floating_point() else -7)

    monkeypatch.setattr(torch, "empty", poisoned)


def routed_ids(T: int, spread: str, E: int = E, K: int = K) -> torch.Tensor:
    if spread == "skewed":  # every token the same K experts: K groups of T pairs
        return torch.arange(K, dtype=torch.int32, device=DEV).flip(0).repeat(T, 1)
    if spread == "hot":  # half the pairs on expert 3, the rest spread: one long group
        ids = routed_ids(T, "random", E, K)
        return torch.where(torch.rand(T, K, device=DEV) < 0.5, 3, ids).to(torch.int32)
    return torch.rand(T, E, device=DEV).argsort(dim=1)[:, :K].to(torch.int32)


def assert_aligned(ids: torch.Tensor, E: int, BM: int, pmax: int | None = None) -> None:
    expect = align_reference(ids, E, BM, num_blocks(ids.numel(), E, BM))
    got = moe_align(ids, E, BM, pmax=pmax)
    assert torch.equal(got[0], expect[0]), (ids.shape, E, BM, pmax, got[0], expect[0])
    assert torch.equal(got[1], expect[1]), (ids.shape, E, BM, pmax, got[1], expect[1])


@pytest.mark.parametrize("T", [1, 8, 64, 128, 256])
@pytest.mark.parametrize("BM", [16, 32, 64])
@pytest.mark.parametrize("spread", ["random", "skewed"])
def test_align_matches_reference(poison_empty, T, BM, spread):
    torch.manual_seed(T * BM)
    for _ in range(3):  # fresh ids each time
        ids = routed_ids(T, spread)
        expect = align_reference(ids, E, BM, num_blocks(T * K, E, BM))
        for pmax in (PMAX, 0):
            got = moe_align(ids, E, BM, pmax=pmax)
            assert torch.equal(got[0], expect[0]), (pmax, got[0], expect[0])
            assert torch.equal(got[1], expect[1]), (pmax, got[1], expect[1])


def test_align_replays_in_a_cuda_graph():
    """Captured once, replayed on other ids written in place: the grid never depends on them."""
    T, BM = 64, 16
    ids = routed_ids(T, "random")
    moe_align(ids, E, BM)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        sorted_pair, expert_of_block = moe_align(ids, E, BM)
    for spread in ("random", "skewed", "random"):
        ids.copy_(routed_ids(T, spread))
        graph.replay()
        expect = align_reference(ids, E, BM, num_blocks(T * K, E, BM))
        assert torch.equal(sorted_pair, expect[0]), spread
        assert torch.equal(expert_of_block, expect[1]), spread


@pytest.mark.parametrize("T", [512, 513, 1024, 4096, 8192, 16384])
@pytest.mark.parametrize("BM", [16, 32, 64, 128])
@pytest.mark.parametrize("spread", ["random", "skewed", "hot"])
def test_align_at_prefill_sizes(poison_empty, T, BM, spread):
    """P = T x 8 from PMAX (the one-launch path's last size) to 128K pairs: the chunked path in
    chunks of 256, 512 and 1024 pairs."""
    torch.manual_seed(T + BM)
    for _ in range(2):
        assert_aligned(routed_ids(T, spread), E, BM)


@pytest.mark.parametrize("E_,K_", [(8, 2), (60, 4), (256, 8)])
@pytest.mark.parametrize("T", [3000, 8192])
def test_align_at_prefill_sizes_other_experts(poison_empty, E_, K_, T):
    """Mixtral's 8 experts, 60 (not a power of two), 256 (a count table of 64 rows a load)."""
    torch.manual_seed(T)
    for BM in (16, 64):
        assert_aligned(routed_ids(T, "random", E_, K_), E_, BM)


def test_align_replays_in_a_cuda_graph_at_a_prefill_size():
    """Both launches of the chunked path in one graph: 4096 tokens x 8, new ids in place."""
    T, BM = 4096, 64
    assert align_plan(T * K, num_blocks(T * K, E, BM), E=E, BM=BM)[1]["CHUNKED"]
    ids = routed_ids(T, "random")
    moe_align(ids, E, BM)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        sorted_pair, expert_of_block = moe_align(ids, E, BM)
    for spread in ("random", "skewed", "hot", "random"):
        ids.copy_(routed_ids(T, spread))
        graph.replay()
        expect = align_reference(ids, E, BM, num_blocks(T * K, E, BM))
        assert torch.equal(sorted_pair, expect[0]), spread
        assert torch.equal(expert_of_block, expect[1]), spread
