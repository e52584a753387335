"""Triton paged attention vs the torch reference, in the interpreter (conftest sets it).

Every case builds fresh random caches behind random, non-contiguous page tables; cache slots that
no sequence may read are NaN, and outputs are NaN before the kernel runs, so a read out of range
or a row left unwritten shows up. Legend: B = sequences, T = tokens, P = pages per sequence.
"""

from __future__ import annotations

import dataclasses
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton decorates the kernels

import pytest  # noqa: E402
import torch  # noqa: E402
from lora_cases import SPREADS, batch_info, compact_weights, lora_weights, rel_err  # noqa: E402

from moelora.kernels import reference  # noqa: E402
from moelora.kernels.attention.paged import (  # noqa: E402
    attention_work,
    launch_paged_attention,
    paged_attention,
    paged_attention_o_shrink,
    plan_attention,
)
from moelora.step.batch import AttentionMetadata  # noqa: E402
from moelora.step.lora import NO_SLOT, LoraWeights  # noqa: E402

TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=2e-3, rtol=2e-3)}


def make_step(
    q_lens: list[int],
    seq_lens: list[int],
    *,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    page_size: int,
    dtype: torch.dtype,
    pad_rows: int = 0,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]:
    """q [T, Hq, D], caches [num_pages, page_size, Hkv, D] and the step's metadata.

    Sequences own random pages of a shared pool (one spare page for padded sequences); every
    cache slot past a sequence's length is NaN, as are the q rows of padding.
    """
    g = torch.Generator().manual_seed(seed)
    num_seqs = len(q_lens)
    pages_needed = [-(-s // page_size) for s in seq_lens]
    max_pages = max(max(pages_needed), 1) + 1  # table wider than needed: its tail is garbage
    num_pages = sum(pages_needed) + 3
    perm = torch.randperm(num_pages, generator=g)
    spare = int(perm[-1])
    page_table = torch.full((num_seqs, max_pages), spare, dtype=torch.int32)
    k_cache = torch.full((num_pages, page_size, num_kv_heads, head_dim), float("nan"), dtype=dtype)
    v_cache = k_cache.clone()
    used = 0
    for b, (n_pages, kv_len) in enumerate(zip(pages_needed, seq_lens)):
        pages = perm[used : used + n_pages]
        used += n_pages
        page_table[b, :n_pages] = pages.to(torch.int32)
        for cache in (k_cache, v_cache):
            rows = torch.randn(kv_len, num_kv_heads, head_dim, generator=g).to(dtype)
            cache.view(-1, num_kv_heads, head_dim)[_slots(pages, kv_len, page_size)] = rows

    cu_seqlens_q = torch.zeros(num_seqs + 1, dtype=torch.int32)
    cu_seqlens_q[1:] = torch.tensor(q_lens).cumsum(0)
    num_tokens = int(cu_seqlens_q[-1])
    q = torch.randn(num_tokens + pad_rows, num_q_heads, head_dim, generator=g).to(dtype)
    q[num_tokens:] = float("nan")
    attn = AttentionMetadata(
        cu_seqlens_q=cu_seqlens_q,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        page_table=page_table,
        slot_mapping=torch.full((num_tokens + pad_rows,), -1, dtype=torch.int64),
        max_query_len=max(q_lens),
    )
    return q, k_cache, v_cache, attn


def _slots(pages: torch.Tensor, kv_len: int, page_size: int) -> torch.Tensor:
    pos = torch.arange(kv_len)
    return pages.long()[pos // page_size] * page_size + pos % page_size


def check_attention(
    q,
    k_cache,
    v_cache,
    attn,
    *,
    num_splits: int | None = None,
    window: int = 0,
    sinks: torch.Tensor | None = None,
) -> None:
    scale = q.shape[-1] ** -0.5
    options = dict(window=window, sinks=sinks)
    expected = reference.paged_attention(
        q, k_cache.nan_to_num(), v_cache.nan_to_num(), attn, scale, **options
    )
    out = torch.full_like(q, float("nan"))
    got, _ = launch_paged_attention(
        q, k_cache, v_cache, attn, scale, num_splits=num_splits, out=out, **options
    )
    assert got.data_ptr() == out.data_ptr()
    assert torch.isfinite(got).all(), "a row was left unwritten or read NaN past seq_len"
    torch.testing.assert_close(got.float(), expected.float(), **TOL[q.dtype])


DTYPES = [torch.float32, torch.float16]
HEADS = [(2, 2), (4, 2), (8, 1)]  # (Hq, Hkv): GQA ratios 1, 2 and 8


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("page_size,head_dim", [(16, 16), (32, 32), (16, 64)])
def test_decode(dtype, heads, page_size, head_dim):
    seq_lens = [1, 37, 70, 16]
    q, k_cache, v_cache, attn = make_step(
        [1] * len(seq_lens),
        seq_lens,
        num_q_heads=heads[0],
        num_kv_heads=heads[1],
        head_dim=head_dim,
        page_size=page_size,
        dtype=dtype,
        seed=page_size + head_dim,
    )
    check_attention(q, k_cache, v_cache, attn)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_splits", [1, 2, 5])
def test_decode_splits(dtype, num_splits):
    """Forced split counts, including more splits than a short sequence has tiles."""
    q, k_cache, v_cache, attn = make_step(
        [1, 1, 1],
        [100, 3, 33],
        num_q_heads=4,
        num_kv_heads=2,
        head_dim=32,
        page_size=16,
        dtype=dtype,
        seed=num_splits,
    )
    check_attention(q, k_cache, v_cache, attn, num_splits=num_splits)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_splits", [None, 1, 3])
def test_decode_padded_graph_batch(dtype, num_splits):
    """A graph batch: padded sequences (seq_len 0, the spare page) with and without a q row,
    and q rows past cu_seqlens_q[-1]; all of them must come out as zeros."""
    q, k_cache, v_cache, attn = make_step(
        [1, 1, 0, 1, 0],
        [45, 0, 0, 9, 0],
        num_q_heads=4,
        num_kv_heads=2,
        head_dim=16,
        page_size=16,
        dtype=dtype,
        pad_rows=3,
    )
    check_attention(q, k_cache, v_cache, attn, num_splits=num_splits)
    out = launch_paged_attention(q, k_cache, v_cache, attn, 0.25, num_splits=num_splits)[0]
    assert (out[1] == 0).all() and (out[3:] == 0).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("spread", SPREADS)
@pytest.mark.parametrize("num_splits,R", [(None, 16), (3, 8), (1, 16)])
def test_decode_o_lora_shrink(dtype, spread, num_splits, R):
    """paged_attention_o_shrink: the output, and the o LoRA's shrink of it summed over its partials
    (from the combine of a split decode, KS = Hq; from lora_shrink_split without splits) on the
    rows with an enabled slot. A graph batch: a padded sequence and padded rows (no slot). A's
    rows past each slot's rank are NaN, so reading them would show."""
    Hq, Hkv, D = 4, 1, 16
    q, k_cache, v_cache, attn = make_step(
        [1, 1, 0, 1],
        [45, 70, 0, 9],
        num_q_heads=Hq,
        num_kv_heads=Hkv,
        head_dim=D,
        page_size=16,
        dtype=dtype,
        pad_rows=2,
        seed=R,
    )
    T, tokens = q.shape[0], int(attn.cu_seqlens_q[-1])
    info = batch_info(T, spread)
    info.slot_of_token[tokens:] = NO_SLOT
    clean = lora_weights(info.num_slots, (), 1, R, Hq * D, (24,), info.rank_of_slot, dtype)
    lora = LoraWeights.dense(clean.a.clone(), clean.b, clean.out_slices, info.rank_of_slot.tolist())
    for s, r in enumerate(info.rank_of_slot.tolist()):
        lora.a[s, :, r:] = float("nan")
    scale = D**-0.5
    expect_out = reference.paged_attention(
        q, k_cache.nan_to_num(), v_cache.nan_to_num(), attn, scale
    )
    expect = reference.lora_shrink(expect_out.reshape(T, -1), clean, info)
    if num_splits is None:  # the plan splits: 4 sequences x 1 KV head fill no 8 "SMs"
        out, folded = paged_attention_o_shrink(q, k_cache, v_cache, attn, scale, lora, info)
        assert folded.weights is lora and folded.info is info
        part = folded.shrunk
        assert part.shape == (T, Hq, 1, R)
    else:
        out, part = launch_paged_attention(
            q, k_cache, v_cache, attn, scale, num_splits=num_splits, shrink=lora, info=info
        )
        assert (part is None) == (num_splits == 1)
        if part is None:  # what paged_attention_o_shrink does then
            part = paged_attention_o_shrink(q, k_cache, v_cache, attn, scale, lora, info)[1].shrunk
    torch.testing.assert_close(out.float(), expect_out.float(), **TOL[dtype])
    on = (info.slot_of_token >= 0) & (info.slot_enabled[info.slot_of_token.clamp(min=0)] != 0)
    assert part.dtype == torch.float32 and part.shape[0] == T and part.shape[2:] == (1, R)
    if on.any():
        got = part[on].sum(dim=1)[:, 0]
        assert torch.isfinite(got).all()
        assert rel_err(got, expect[on][:, 0]) <= (1e-5 if dtype == torch.float32 else 5e-3)


@pytest.mark.parametrize("spread", ["mixed", "distinct"])
def test_decode_o_lora_shrink_reads_the_compact_arena(spread):
    """The split decode's combine reads o's A through its table from a compact arena (slots at
    their modules' own ranks: slot 1's adapter without an o module, slot 3's at rank 5 below its
    adapter's 16; regions out of slot order, NaN between them): its partials sum to the dense
    layout's shrink, zeros on an enabled row whose adapter lacks the module. Five decode rows:
    "distinct" gives them slots 0 to 4 (rank 0, no module, 8, 5 of 16, rank 0)."""
    torch.manual_seed(7)
    Hq, Hkv, D, R = 4, 1, 16, 16
    q, k_cache, v_cache, attn = make_step(
        [1, 1, 0, 1, 1, 1],
        [45, 70, 0, 9, 30, 17],
        num_q_heads=Hq,
        num_kv_heads=Hkv,
        head_dim=D,
        page_size=16,
        dtype=torch.float32,
        pad_rows=2,
        seed=len(spread),
    )
    T, tokens = q.shape[0], int(attn.cu_seqlens_q[-1])
    info = batch_info(T, spread)
    info.slot_of_token[tokens:] = NO_SLOT
    ranks = info.rank_of_slot.tolist()
    ranks[1], ranks[3] = 0, 5
    dense = lora_weights(info.num_slots, (), 1, R, Hq * D, (24,), info.rank_of_slot, q.dtype)
    compact, dense = compact_weights(dense, ranks)
    out, part = launch_paged_attention(
        q, k_cache, v_cache, attn, D**-0.5, num_splits=3, shrink=compact, info=info
    )
    expect = reference.lora_shrink(out.reshape(T, -1), dense, info)
    on = (info.slot_of_token >= 0) & (info.slot_enabled[info.slot_of_token.clamp(min=0)] != 0)
    assert on.any()
    got = part[on].sum(dim=1)[:, 0]
    assert torch.isfinite(got).all()
    assert rel_err(got, expect[on][:, 0]) <= 1e-5


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("page_size", [16, 32])
def test_prefill(dtype, heads, page_size):
    """Whole prompts, no cached prefix."""
    q_lens = [1, 23, 40]
    q, k_cache, v_cache, attn = make_step(
        q_lens,
        q_lens,
        num_q_heads=heads[0],
        num_kv_heads=heads[1],
        head_dim=32,
        page_size=page_size,
        dtype=dtype,
        seed=page_size,
    )
    check_attention(q, k_cache, v_cache, attn)


@pytest.mark.parametrize("q_lens", [[1000, 3, 1, 17], [5, 1, 700], [0, 64, 0]])
def test_attention_work_of_a_long_prompt_spans_many_programs(q_lens):
    """A prompt of hundreds of blocks beside short chunks and decodes: its rounds fall to many
    of attention_work's programs (WORK_ROUNDS each), and the table is the reference's."""
    cu = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(q_lens).cumsum(0)
    for block_q in (1, 4):
        num_rows = int(cu[-1]) + 7
        got = attention_work(cu, num_rows, block_q)
        assert torch.equal(got, reference.attention_work(cu, num_rows, block_q))


@pytest.mark.parametrize("block_q", [1, 2, 3, 8])
@pytest.mark.parametrize("seed", range(4))
def test_attention_work_lists_every_block_once_last_blocks_first(block_q, seed):
    """The work table against its reference, bit for bit, on random steps (empty sequences
    and rows past the step's, as a graph's padding has), and the reference against its
    meaning: every (sequence, block) once, all sequences' last blocks first, -1 after them."""
    g = torch.Generator().manual_seed(seed)
    num_seqs = int(torch.randint(1, 40, (1,), generator=g))
    q_lens = torch.randint(0, 30, (num_seqs,), generator=g)
    q_lens[torch.rand(num_seqs, generator=g) < 0.3] = 1  # decodes beside the prompt chunks
    cu = torch.zeros(num_seqs + 1, dtype=torch.int32)
    cu[1:] = q_lens.cumsum(0)
    num_rows = int(cu[-1]) + int(torch.randint(0, 50, (1,), generator=g))
    got = attention_work(cu, num_rows, block_q)
    expected = reference.attention_work(cu, num_rows, block_q)
    assert torch.equal(got, expected)
    blocks = [-(-int(n) // block_q) for n in q_lens]
    listed = [(int(e) // reference.WORK_SEQ, int(e) % reference.WORK_SEQ) for e in got if e >= 0]
    assert sorted(listed) == sorted((b, r) for b, n in enumerate(blocks) for r in range(n))
    assert [r for _, r in listed] == sorted(r for _, r in listed)
    assert (got[len(listed) :] == -1).all() and got.shape == (-(-num_rows // block_q) + num_seqs,)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", HEADS)
def test_prefill_planned_for_a_larger_step(dtype, heads):
    """As a prefill graph runs a smaller step: the work table planned once for more rows and
    sequences than the step has (padded sequences with no tokens and no KV, padded rows), and
    read by the attention; the rows are the reference's and the padded ones zero."""
    q, k_cache, v_cache, attn = make_step(
        [17, 1, 30, 5, 0, 0, 0],
        [50, 66, 30, 21, 0, 0, 0],
        num_q_heads=heads[0],
        num_kv_heads=heads[1],
        head_dim=16,
        page_size=16,
        dtype=dtype,
        pad_rows=11,
    )
    planned = plan_attention(attn, q.shape[0], heads[0], heads[1], q.shape[-1])
    assert planned.work is not None and planned.work_block_q > 0
    check_attention(q, k_cache, v_cache, planned)
    out = paged_attention(q, k_cache, v_cache, planned, q.shape[-1] ** -0.5)
    assert (out[53:] == 0).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", HEADS)
def test_chunked_extend_mixed(dtype, heads):
    """Chunks after cached prefixes, decodes, an empty sequence and padded rows in one step."""
    q, k_cache, v_cache, attn = make_step(
        [17, 1, 0, 30, 5],
        [50, 66, 0, 30, 21],
        num_q_heads=heads[0],
        num_kv_heads=heads[1],
        head_dim=16,
        page_size=16,
        dtype=dtype,
        pad_rows=4,
    )
    check_attention(q, k_cache, v_cache, attn)


@pytest.mark.parametrize("dtype", DTYPES)
def test_store_then_attend_chunked_prefill(dtype):
    """A prompt in two chunks, each stored then attended, equals one reference pass (the
    engine's rotary stores k and v: tests/kernels/test_norm_rope.py checks that store)."""
    num_q_heads, num_kv_heads, head_dim, page_size, prompt = 4, 2, 16, 16, 45
    g = torch.Generator().manual_seed(2)
    pages = torch.tensor([[4, 1, 6, 0]], dtype=torch.int32)
    k_cache = torch.full((8, page_size, num_kv_heads, head_dim), float("nan"), dtype=dtype)
    v_cache = k_cache.clone()
    q = torch.randn(prompt, num_q_heads, head_dim, generator=g).to(dtype)
    k = torch.randn(prompt, num_kv_heads, head_dim, generator=g).to(dtype)
    v = torch.randn(prompt, num_kv_heads, head_dim, generator=g).to(dtype)
    slots = _slots(pages[0], prompt, page_size)
    outs = []
    for start, end in [(0, 20), (20, prompt)]:
        attn = AttentionMetadata(
            cu_seqlens_q=torch.tensor([0, end - start], dtype=torch.int32),
            seq_lens=torch.tensor([end], dtype=torch.int32),
            page_table=pages,
            slot_mapping=slots[start:end],
            max_query_len=end - start,
        )
        reference.store_kv(k[start:end], v[start:end], k_cache, v_cache, attn.slot_mapping)
        outs.append(paged_attention(q[start:end], k_cache, v_cache, attn, 0.25))

    whole = AttentionMetadata(
        cu_seqlens_q=torch.tensor([0, prompt], dtype=torch.int32),
        seq_lens=torch.tensor([prompt], dtype=torch.int32),
        page_table=pages,
        slot_mapping=slots,
        max_query_len=prompt,
    )
    expected = reference.paged_attention(q, k_cache, v_cache, whole, 0.25)
    torch.testing.assert_close(torch.cat(outs).float(), expected.float(), **TOL[dtype])


def random_sinks(num_q_heads: int, seed: int) -> torch.Tensor:
    """Per-head sink logits about the size of the scores (some above them, some below)."""
    return 2.0 * torch.randn(num_q_heads, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("window,sinks", [(1, False), (7, True), (40, False), (0, True)])
def test_decode_window_and_sinks(dtype, num_splits, window, sinks):
    """GPT-OSS's sliding window (shorter and longer than the sequences) and sinks, split or
    not: the combine must count the sink once and agree on the window's split range."""
    q, k_cache, v_cache, attn = make_step(
        [1, 1, 0, 1],
        [45, 70, 0, 5],
        num_q_heads=4,
        num_kv_heads=2,
        head_dim=16,
        page_size=16,
        dtype=dtype,
        pad_rows=2,
        seed=window,
    )
    s = random_sinks(4, window) if sinks else None
    check_attention(q, k_cache, v_cache, attn, num_splits=num_splits, window=window, sinks=s)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", [(4, 2), (8, 1)])
@pytest.mark.parametrize("window,sinks", [(7, True), (20, False)])
def test_extend_window_and_sinks(dtype, heads, window, sinks):
    """Chunks after cached prefixes, whole prompts, a decode and padded rows, with a window
    shorter than a query block (a block's rows start their windows at different keys)."""
    q, k_cache, v_cache, attn = make_step(
        [17, 1, 0, 30, 5],
        [50, 66, 0, 30, 21],
        num_q_heads=heads[0],
        num_kv_heads=heads[1],
        head_dim=16,
        page_size=16,
        dtype=dtype,
        pad_rows=3,
        seed=window + heads[0],
    )
    s = random_sinks(heads[0], window) if sinks else None
    check_attention(q, k_cache, v_cache, attn, window=window, sinks=s)


@pytest.mark.parametrize("num_splits", [None, 3])
def test_decode_o_lora_shrink_window_and_sinks(num_splits):
    """The folded o shrink reads the output that the window and the sinks made."""
    Hq, D, window = 4, 16, 9
    q, k_cache, v_cache, attn = make_step(
        [1, 1, 1],
        [45, 70, 9],
        num_q_heads=Hq,
        num_kv_heads=2,
        head_dim=D,
        page_size=16,
        dtype=torch.float32,
    )
    T = q.shape[0]
    info = batch_info(T, "distinct")
    lora = lora_weights(info.num_slots, (), 1, 8, Hq * D, (24,), info.rank_of_slot, q.dtype)
    sinks, scale = random_sinks(Hq, 3), D**-0.5
    options = dict(window=window, sinks=sinks)
    expect_out, expect = reference.paged_attention_o_shrink(
        q, k_cache, v_cache, attn, scale, lora, info, **options
    )
    if num_splits is None:
        out, folded = paged_attention_o_shrink(
            q, k_cache, v_cache, attn, scale, lora, info, **options
        )
        part = folded.shrunk
    else:
        out, part = launch_paged_attention(
            q,
            k_cache,
            v_cache,
            attn,
            scale,
            num_splits=num_splits,
            shrink=lora,
            info=info,
            **options,
        )
    torch.testing.assert_close(out, expect_out, **TOL[torch.float32])
    on = (info.slot_of_token >= 0) & (info.slot_enabled[info.slot_of_token.clamp(min=0)] != 0)
    assert on.any()
    got = part[on].sum(dim=1)[:, 0]
    assert rel_err(got, expect.shrunk[on].sum(dim=1)[:, 0]) <= 1e-5


def test_long_first_chunks_are_left_to_the_dense_attention(monkeypatch):
    """With dense_from, the kernel skips each sequence whose chunk starts at position 0 with at
    least dense_from tokens (cuDNN attends to those on the GPU: tests/gpu) and writes every
    other row. A stand-in for the
    dense attention checks that its rows were left alone and fills them from the reference."""
    from moelora.kernels.attention import paged as pa

    q_lens, seq_lens = [40, 10, 33, 33, 5, 33], [40, 50, 33, 33, 5, 33]
    shape = dict(num_q_heads=4, num_kv_heads=2, head_dim=16, page_size=16)
    q, k_cache, v_cache, attn = make_step(q_lens, seq_lens, **shape, dtype=torch.float32, seed=3)
    chunks = tuple((s - n, n) for n, s in zip(q_lens, seq_lens, strict=True))
    attn = dataclasses.replace(attn, chunks=chunks)
    scale = 16**-0.5
    expected = reference.paged_attention(q, k_cache, v_cache, attn, scale)
    runs = []

    def dense(q, k_cache, v_cache, attn, scale, dense_runs, out):
        for row, length in dense_runs:
            rows = slice(row, row + length)
            assert (out[rows] == 0).all(), "the kernel wrote a dense run's rows"
            out[rows] = expected[rows]
        runs.extend(dense_runs)
        return out

    monkeypatch.setattr(pa, "cudnn_attention_runs", lambda q: True)
    monkeypatch.setattr(pa, "_dense_attention", dense)
    out = pa.paged_attention(q, k_cache, v_cache, attn, scale, dense_from=33)
    assert runs == [(0, 40), (50, 33), (83, 33), (121, 33)]
    torch.testing.assert_close(out, expected, **TOL[torch.float32])
    assert pa.dense_runs(chunks, 41) == [] and pa.dense_runs(None, 33) == []


def test_the_engine_sends_long_first_chunks_to_cudnn_unless_asked():
    from moelora.kernels.attention.paged import DENSE_FROM
    from moelora.kernels.ops import make_ops

    cuda = torch.device("cuda")  # make_ops only reads the type: no GPU is touched
    triton = make_ops(cuda, prefill_attention_backend="triton")
    for ops, dense_from in ((make_ops(cuda), DENSE_FROM), (triton, 0)):
        assert ops.paged_attention.keywords == {"dense_from": dense_from}
        assert ops.paged_attention_o_shrink.keywords == {"dense_from": dense_from}
    with pytest.raises(ValueError, match="prefill_attention_backend='flash' is invalid"):
        make_ops(cuda, prefill_attention_backend="flash")


def test_tiles_fit_a_head_of_256():
    """Past head_dim 128 the prefill tiles' KV tile and rows are cut in proportion (their
    bytes as tuned; 256 rows of a 256-wide accumulator spilled for sm_90), and the step's plan
    takes the same query blocks as the launch, so every layer reuses its work table."""
    from moelora.kernels.attention import paged

    config = paged.PREFILL_CONFIG
    assert paged.fit_head_dim(config, 128) is config
    fitted = paged.fit_head_dim(config, 256)
    assert (fitted.block_m, fitted.block_n) == (config.block_m // 2, config.block_n // 2)
    cuda = torch.device("cuda")  # prefill_block_q reads the type only
    assert paged.prefill_block_q(16, 2, 256, cuda) == fitted.block_m // 8
    assert paged.prefill_block_q(32, 4, 128, cuda) == config.block_m // 8
    decode = paged.DECODE_CONFIG
    assert paged.fit_head_dim(decode, 256).block_m == decode.block_m  # 16 rows at least
