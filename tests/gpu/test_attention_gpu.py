"""Triton paged attention on the GPU at Qwen3-30B-A3B attention sizes, and under a CUDA graph.

bf16 kernels against the fp32 torch reference (relative error of the whole output <= 1e-2).
Cache slots that no sequence may read are NaN, so an out-of-range read shows up.
Legend: B = sequences, T = tokens, P = pages per sequence, Hq / Hkv = heads, D = head dim.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
pytest.importorskip("triton")

import sys  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).parents[1] / "kernels"))
from cuda_graphs import capture  # noqa: E402
from lora_cases import batch_info, lora_weights, rel_err  # noqa: E402

from moelora.kernels import reference  # noqa: E402
from moelora.kernels.attention.paged import (  # noqa: E402
    paged_attention,
    paged_attention_o_shrink,
)
from moelora.step.batch import AttentionMetadata  # noqa: E402
from moelora.step.lora import NO_SLOT, LoraWeights  # noqa: E402

HQ, HKV, D = 32, 4, 128
SCALE = D**-0.5


def make_cache(
    seq_lens: list[int],
    page_size: int,
    *,
    max_pages: int | None = None,
    seed: int = 0,
    kv_heads: int = HKV,
    head_dim: int = D,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """bf16 caches with random data in every sequence's slots and NaN elsewhere.

    Returns k_cache, v_cache, page_table [B, P] (random pages; unused entries: the spare page)
    and the spare page's id.
    """
    g = torch.Generator(device="cuda").manual_seed(seed)
    pages_needed = [-(-s // page_size) for s in seq_lens]
    max_pages = max_pages or max(pages_needed) + 1
    num_pages = sum(pages_needed) + 1
    perm = torch.randperm(num_pages, generator=g, device="cuda").to(torch.int32)
    spare = perm[-1]
    page_table = spare.repeat(len(seq_lens), max_pages)
    valid = torch.zeros(num_pages * page_size, dtype=torch.bool, device="cuda")
    used = 0
    for b, (n_pages, kv_len) in enumerate(zip(pages_needed, seq_lens)):
        page_table[b, :n_pages] = perm[used : used + n_pages]
        valid[slots_of(page_table[b], kv_len, page_size)] = True
        used += n_pages
    shape = (num_pages, page_size, kv_heads, head_dim)
    caches = []
    for _ in range(2):
        cache = torch.randn(shape, generator=g, device="cuda", dtype=torch.bfloat16)
        cache.view(-1, kv_heads, head_dim)[~valid] = float("nan")
        caches.append(cache)
    return caches[0], caches[1], page_table, int(spare)


def slots_of(pages: torch.Tensor, kv_len: int, page_size: int) -> torch.Tensor:
    pos = torch.arange(kv_len, device=pages.device)
    return pages.long()[pos // page_size] * page_size + pos % page_size


def metadata(q_lens: list[int], seq_lens: list[int], page_table: torch.Tensor, pad_rows: int = 0):
    cu = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(q_lens).cumsum(0)
    num_rows = int(cu[-1]) + pad_rows
    return AttentionMetadata(
        cu_seqlens_q=cu.cuda(),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device="cuda"),
        page_table=page_table,
        slot_mapping=torch.full((num_rows,), -1, dtype=torch.int64, device="cuda"),
        max_query_len=max(q_lens),
    )


def assert_close_to_reference(out, q, k_cache, v_cache, attn, **options) -> None:
    """options: paged_attention's window and sinks."""
    scale = q.shape[-1] ** -0.5
    expected = reference.paged_attention(
        q.float(),
        k_cache.nan_to_num().float(),
        v_cache.nan_to_num().float(),
        attn,
        scale,
        **options,
    )
    assert torch.isfinite(out).all()
    rel = (out.float() - expected).norm() / expected.norm().clamp(min=1e-6)
    assert rel <= 1e-2, f"relative error {rel:.2e}"


def run_case(q_lens, seq_lens, page_size, *, pad_rows=0, seed=0) -> None:
    k_cache, v_cache, page_table, _ = make_cache(seq_lens, page_size, seed=seed)
    attn = metadata(q_lens, seq_lens, page_table, pad_rows)
    q = torch.randn(attn.slot_mapping.shape[0], HQ, D, device="cuda", dtype=torch.bfloat16)
    out = paged_attention(q, k_cache, v_cache, attn, SCALE)
    assert_close_to_reference(out, q, k_cache, v_cache, attn)
    assert (out[int(attn.cu_seqlens_q[-1]) :] == 0).all()


@pytest.mark.parametrize("window", [0, 128])
def test_a_prefill_row_does_not_depend_on_where_its_chunk_starts(window):
    """A prompt's last rows prefilled in one chunk or as a later chunk (its query blocks start
    elsewhere, so other key tiles are masked): the same bits, at the engine's prefill tiles."""
    T = 1500
    k_cache, v_cache, page_table, _ = make_cache([T], 16, seed=window)
    q = torch.randn(T, HQ, D, device="cuda", dtype=torch.bfloat16)
    whole = paged_attention(
        q, k_cache, v_cache, metadata([T], [T], page_table), SCALE, window=window
    )
    assert_close_to_reference(
        whole, q, k_cache, v_cache, metadata([T], [T], page_table), window=window
    )
    for start in (1, 37, 600, 1023):
        attn = metadata([T - start], [T], page_table)
        part = paged_attention(q[start:], k_cache, v_cache, attn, SCALE, window=window)
        assert torch.equal(part, whole[start:]), f"chunk from {start}"


@pytest.mark.parametrize(
    "seq_lens",
    [[8192], [1, 15, 16, 17, 1000, 4096, 8191, 8192], list(range(64, 8192, 64))],
    ids=["B1-8k", "B8-mixed", "B127-to-8k"],
)
@pytest.mark.parametrize("page_size", [16, 32])
def test_decode(seq_lens, page_size):
    run_case([1] * len(seq_lens), seq_lens, page_size, pad_rows=1)


@pytest.mark.parametrize(
    "q_lens,seq_lens",
    [([1] * 3, [1, 300, 4096]), ([1] * 64, list(range(64, 4097, 64))), ([512, 1, 0], [2048, 9, 0])],
    ids=["decode-split", "decode-B64", "prefill"],
)
def test_head_dim_256(q_lens, seq_lens):
    """Qwen3.5's and Qwen3-Next's gated attention (16 q heads, 2 KV heads of 256): the default
    tiles, fitted to the head (kernels/attention/paged.fit_head_dim), compile and agree."""
    k_cache, v_cache, page_table, _ = make_cache(seq_lens, 16, kv_heads=2, head_dim=256)
    attn = metadata(q_lens, seq_lens, page_table, 2)
    q = torch.randn(attn.slot_mapping.shape[0], 16, 256, device="cuda", dtype=torch.bfloat16)
    out = paged_attention(q, k_cache, v_cache, attn, 256**-0.5)
    assert_close_to_reference(out, q, k_cache, v_cache, attn)


def test_decode_batch_128():
    seq_lens = torch.randint(1, 8193, (128,), generator=torch.Generator().manual_seed(3))
    run_case([1] * 128, seq_lens.tolist(), 16)


@pytest.mark.parametrize("B", [1, 8, 40])  # split (the combine shrinks) up to 32, then not
@pytest.mark.parametrize("spread", ["one", "mixed"])
@pytest.mark.parametrize("rank", [16, 64])
def test_decode_o_lora_shrink_bf16(B, spread, rank):
    """paged_attention_o_shrink: the o LoRA's shrink partials of the output sum to the fp32
    shrink of that output, on rows with an enabled slot; a padded row has no slot."""
    gen = torch.Generator().manual_seed(B + rank)
    seq_lens = torch.randint(1, 4097, (B,), generator=gen).tolist()
    k_cache, v_cache, page_table, _ = make_cache(seq_lens, 16, seed=B)
    attn = metadata([1] * B, seq_lens, page_table, pad_rows=1)
    T = B + 1
    q = torch.randn(T, HQ, D, device="cuda", dtype=torch.bfloat16)
    info = batch_info(T, spread, "cuda")
    info.slot_of_token[B:] = NO_SLOT
    ranks = info.rank_of_slot.cpu()
    lora = lora_weights(info.num_slots, (), 1, rank, HQ * D, (2048,), ranks, torch.bfloat16, "cuda")
    out, folded = paged_attention_o_shrink(q, k_cache, v_cache, attn, SCALE, lora, info)
    assert folded.weights is lora and folded.info is info
    part = folded.shrunk
    assert_close_to_reference(out, q, k_cache, v_cache, attn)
    assert part.shape[0] == T and part.shape[2:] == (1, rank)
    if B <= 8:
        assert part.shape[1] == HQ  # computed in the combine
    f32 = LoraWeights.dense(lora.a.float(), lora.b.float(), lora.out_slices)
    expect = reference.lora_shrink(out.float().reshape(T, -1), f32, info)
    slots = info.slot_of_token
    on = (slots >= 0) & (info.slot_enabled[slots.clamp(min=0)] != 0)
    assert on.any() or spread == "mixed"
    if on.any():
        assert rel_err(part[on].sum(dim=1), expect[on]) <= 1e-2


@pytest.mark.parametrize(
    "q_lens,seq_lens",
    [([1000, 1, 2048], [1000, 1, 2048]), ([512, 256, 1, 0, 77], [4096, 8192, 3000, 0, 77])],
    ids=["prompts", "chunked-mixed"],
)
def test_prefill(q_lens, seq_lens):
    run_case(q_lens, seq_lens, 16, pad_rows=5)


def test_decode_cuda_graph_replay():
    """Capture decode once at B=16, then replay with new lengths, page tables, q and padding
    written in place into the captured buffers; every replay must match the reference."""
    graph_bs, page_size, max_len = 16, 16, 4096
    max_pages = max_len // page_size
    k_cache, v_cache, page_table, spare = make_cache(
        [max_len] * graph_bs, page_size, max_pages=max_pages
    )
    attn = metadata([1] * graph_bs, [max_len] * graph_bs, page_table)
    q = torch.randn(graph_bs, HQ, D, device="cuda", dtype=torch.bfloat16)

    graph, out = capture(lambda: paged_attention(q, k_cache, v_cache, attn, SCALE))

    gen = torch.Generator().manual_seed(4)
    num_pages = k_cache.shape[0]
    for trial, num_real in enumerate([16, 5, 1, 11]):
        lens = torch.randint(1, max_len + 1, (num_real,), generator=gen).tolist()
        lens += [0] * (graph_bs - num_real)
        # Odd trials give padded sequences a q row, even ones none (rows past cu[-1]).
        q_lens = [1] * graph_bs if trial % 2 else [1] * num_real + [0] * (graph_bs - num_real)
        table = torch.full((graph_bs, max_pages), spare, dtype=torch.int32)
        pages = torch.randperm(num_pages, generator=gen)
        pages = pages[pages != spare][: num_real * max_pages].view(num_real, max_pages)
        table[:num_real] = pages.to(torch.int32)
        cu = torch.zeros(graph_bs + 1, dtype=torch.int32)
        cu[1:] = torch.tensor(q_lens).cumsum(0)

        attn.seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
        attn.page_table.copy_(table)
        attn.cu_seqlens_q.copy_(cu)
        q.copy_(torch.randn(q.shape, generator=gen).to(q))
        k_cache.normal_()  # every slot readable now: the table changes which ones are read
        v_cache.normal_()
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert_close_to_reference(out, q, k_cache, v_cache, attn)
        assert (out[num_real:] == 0).all(), f"trial {trial}: padded rows are not zero"


# GPT-OSS's attention: 64 query heads and 8 KV heads of 64, a 128-token window on every other
# layer, and a sink logit per query head.
OSS_HQ, OSS_HKV, OSS_D, OSS_WINDOW = 64, 8, 64, 128


def run_oss_case(q_lens, seq_lens, *, window: int, pad_rows: int = 1, seed: int = 0) -> None:
    k_cache, v_cache, page_table, _ = make_cache(
        seq_lens, 16, seed=seed, kv_heads=OSS_HKV, head_dim=OSS_D
    )
    attn = metadata(q_lens, seq_lens, page_table, pad_rows)
    rows = attn.slot_mapping.shape[0]
    q = torch.randn(rows, OSS_HQ, OSS_D, device="cuda", dtype=torch.bfloat16)
    sinks = 2.0 * torch.randn(OSS_HQ, device="cuda", dtype=torch.float32)
    out = paged_attention(q, k_cache, v_cache, attn, OSS_D**-0.5, window=window, sinks=sinks)
    assert_close_to_reference(out, q, k_cache, v_cache, attn, window=window, sinks=sinks)
    assert (out[int(attn.cu_seqlens_q[-1]) :] == 0).all()


@pytest.mark.parametrize("window", [OSS_WINDOW, 0])
@pytest.mark.parametrize(
    "seq_lens", [[8192], [1, 15, 127, 128, 129, 1000, 4096, 8192]], ids=["B1-8k", "B8-mixed"]
)
def test_decode_gpt_oss_window_and_sinks(window, seq_lens):
    """Split decodes (B=1) and unsplit ones, the window shorter and longer than sequences."""
    run_oss_case([1] * len(seq_lens), seq_lens, window=window)


@pytest.mark.parametrize("window", [OSS_WINDOW, 0])
def test_prefill_gpt_oss_window_and_sinks(window):
    run_oss_case([1000, 1, 300, 0, 77], [1000, 4096, 3000, 0, 77], window=window, pad_rows=5)


def test_decode_gpt_oss_cuda_graph_replay():
    """Window and sinks are captured like every other argument: replays with new lengths."""
    graph_bs, max_len = 8, 2048
    max_pages = max_len // 16
    k_cache, v_cache, page_table, _ = make_cache(
        [max_len] * graph_bs, 16, max_pages=max_pages, kv_heads=OSS_HKV, head_dim=OSS_D
    )
    attn = metadata([1] * graph_bs, [max_len] * graph_bs, page_table)
    q = torch.randn(graph_bs, OSS_HQ, OSS_D, device="cuda", dtype=torch.bfloat16)
    sinks = 2.0 * torch.randn(OSS_HQ, device="cuda", dtype=torch.float32)
    options = dict(window=OSS_WINDOW, sinks=sinks)
    graph, out = capture(lambda: paged_attention(q, k_cache, v_cache, attn, OSS_D**-0.5, **options))
    gen = torch.Generator().manual_seed(5)
    for _ in range(3):
        lens = torch.randint(1, max_len + 1, (graph_bs,), generator=gen)
        attn.seq_lens.copy_(lens.to(torch.int32))
        q.copy_(torch.randn(q.shape, generator=gen).to(q))
        sinks.copy_(2.0 * torch.randn(OSS_HQ, generator=gen))
        k_cache.normal_()
        v_cache.normal_()
        graph.replay()
        torch.cuda.synchronize()
        assert_close_to_reference(out, q, k_cache, v_cache, attn, **options)


def chunked_metadata(starts: list[int], q_lens: list[int], page_table, page_size: int):
    """metadata() of chunks (start, new tokens), with their KV slots and host-side chunks (the
    dense attention gathers a run's keys by its rows' slots)."""
    seq_lens = [s + n for s, n in zip(starts, q_lens, strict=True)]
    attn = metadata(q_lens, seq_lens, page_table)
    slots = [
        slots_of(page_table[b], seq_lens[b], page_size)[starts[b] :] for b in range(len(q_lens))
    ]
    return replace(
        attn, slot_mapping=torch.cat(slots), chunks=tuple(zip(starts, q_lens, strict=True))
    )


@pytest.mark.parametrize(
    "starts,q_lens",
    [
        ([0], [4096]),  # one sequence holds every row: cuDNN's output is returned as it is
        ([0, 0], [1500, 2100]),  # both padded (dense_length)
        ([0, 500, 0, 0, 0], [3000, 100, 2048, 50, 1100]),  # with the Triton kernel
    ],
    ids=["one-4096", "two-padded", "mixed"],
)
def test_long_first_chunks_by_cudnn(starts, q_lens):
    from moelora.kernels.attention.paged import cudnn_attention_runs

    if not cudnn_attention_runs(torch.empty(1, HQ, D, device="cuda", dtype=torch.bfloat16)):
        pytest.skip("torch's cuDNN attention does not run here")
    seq_lens = [s + n for s, n in zip(starts, q_lens, strict=True)]
    k_cache, v_cache, page_table, _ = make_cache(seq_lens, 16, seed=len(q_lens))
    attn = chunked_metadata(starts, q_lens, page_table, 16)
    q = torch.randn(sum(q_lens), HQ, D, device="cuda", dtype=torch.bfloat16)
    out = paged_attention(q, k_cache, v_cache, attn, SCALE, dense_from=1024)
    assert_close_to_reference(out, q, k_cache, v_cache, attn)
    triton = paged_attention(q, k_cache, v_cache, attn, SCALE)  # the paged kernel throughout
    assert not torch.equal(out, triton)  # cuDNN did attend (other bits)
    assert rel_err(out, triton) <= 1e-2


def test_a_dense_sequence_gets_the_same_bits_however_it_is_padded(monkeypatch):
    """A long first chunk's length is padded up (dense_length: one cuDNN plan per padded
    length): the padded queries come last, so the real rows are computed as without them."""
    from moelora.kernels.attention import paged as pa

    if not pa.cudnn_attention_runs(torch.empty(1, HQ, D, device="cuda", dtype=torch.bfloat16)):
        pytest.skip("torch's cuDNN attention does not run here")
    L = 1500
    k_cache, v_cache, page_table, _ = make_cache([L], 16, seed=7)
    q = torch.randn(L, HQ, D, device="cuda", dtype=torch.bfloat16)
    attn = chunked_metadata([0], [L], page_table, 16)
    outs = []
    assert pa.dense_length(L) == 1536 and pa.dense_length(4097) == 4352
    for pad in (1, 256, 512, 2048):
        monkeypatch.setattr(pa, "dense_length", lambda n, pad=pad: -(-n // pad) * pad)
        outs.append(paged_attention(q, k_cache, v_cache, attn, SCALE, dense_from=1024))
    assert all(torch.equal(o, outs[0]) for o in outs[1:])
