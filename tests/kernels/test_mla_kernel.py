"""Triton latent attention (kernels/attention/mla.py) vs the torch reference (kernels/mla.py), in
the interpreter (conftest sets it), float32 and float16 on small shapes.

Every case builds fresh random latent and rope caches as the engine lays them out (views of one
buffer, side by side), behind random non-contiguous page tables wider than needed; cache slots
that no sequence may read are NaN, and so are padded query rows, so a read out of range shows
up. poison_empty makes every torch.empty NaN: a row or partial left unwritten shows up too.
Legend: B = sequences, T = tokens, Hh = heads, L = latent size, R = rope size.
"""

from __future__ import annotations

import dataclasses
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton decorates the kernels

import pytest  # noqa: E402
import torch  # noqa: E402

from moelora.kernels import mla  # noqa: E402
from moelora.kernels.attention import mla as mla_triton  # noqa: E402
from moelora.kernels.attention import mla_expanded  # noqa: E402
from moelora.kernels.attention.paged import attention_work  # noqa: E402
from moelora.step.batch import AttentionMetadata  # noqa: E402
from moelora.step.lora import NO_SLOT, LoraBatchInfo, LoraWeights  # noqa: E402

L, R = 64, 16
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=3e-3, rtol=3e-3)}


@dataclasses.dataclass
class Step:
    q_lat: torch.Tensor  # [T, Hh, L]
    q_pe: torch.Tensor  # [T, Hh, R]
    latent_cache: torch.Tensor  # [P, page_size, 1, L]
    rope_cache: torch.Tensor  # [P, page_size, 1, R]
    attn: AttentionMetadata
    scale: float = 0.15


def make_step(
    q_lens: list[int],
    seq_lens: list[int],
    *,
    heads: int = 4,
    page_size: int = 4,
    dtype: torch.dtype = torch.float32,
    pad_rows: int = 2,
    seed: int = 0,
) -> Step:
    """Sequences own random pages of a shared pool (the table's tail: a spare page); every cache
    slot past a sequence's length is NaN, as are the query rows of padding."""
    g = torch.Generator().manual_seed(seed)
    pages_needed = [-(-s // page_size) for s in seq_lens]
    max_pages = max(max(pages_needed), 1) + 1
    num_pages = sum(pages_needed) + 3
    perm = torch.randperm(num_pages, generator=g)
    page_table = torch.full((len(q_lens), max_pages), int(perm[-1]), dtype=torch.int32)
    cache = torch.full((num_pages, page_size, 1, L + R), float("nan"), dtype=dtype)
    used = 0
    for b, (n_pages, kv_len) in enumerate(zip(pages_needed, seq_lens, strict=True)):
        pages = perm[used : used + n_pages]
        used += n_pages
        page_table[b, :n_pages] = pages.to(torch.int32)
        pos = torch.arange(kv_len)
        slots = pages.long()[pos // page_size] * page_size + pos % page_size
        cache.view(-1, L + R)[slots] = torch.randn(kv_len, L + R, generator=g).to(dtype)
    cu = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(q_lens).cumsum(0)
    T = int(cu[-1])
    q_lat, q_pe = (torch.randn(T + pad_rows, heads, d, generator=g) for d in (L, R))
    q_lat[T:], q_pe[T:] = float("nan"), float("nan")
    attn = AttentionMetadata(
        cu_seqlens_q=cu,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        page_table=page_table,
        slot_mapping=torch.full((T + pad_rows,), -1, dtype=torch.int64),
        max_query_len=max(q_lens),
    )
    return Step(q_lat, q_pe, cache[..., :L], cache[..., L:], attn)


def check(step: Step, dtype: torch.dtype = torch.float32, **options) -> torch.Tensor:
    """The kernel's output (q in `dtype`) against the reference's (q rounded to it, in float32);
    padded rows exactly zero. options: latent_attention's config and num_splits."""
    q_lat, q_pe = step.q_lat.to(dtype), step.q_pe.to(dtype)
    caches = (step.latent_cache, step.rope_cache)
    expected = mla.latent_attention(q_lat.float(), q_pe.float(), *caches, step.attn, step.scale)
    got = mla_triton.latent_attention(q_lat, q_pe, *caches, step.attn, step.scale, **options)
    assert got.shape == expected.shape and got.dtype == torch.float32
    assert torch.isfinite(got).all(), "a row was left unwritten or read NaN past seq_len"
    torch.testing.assert_close(got, expected, **TOL[step.latent_cache.dtype])
    assert (got[int(step.attn.cu_seqlens_q[-1]) :] == 0).all(), "padded rows are not zero"
    return got


@pytest.mark.parametrize("num_splits", [None, 1, 3])
@pytest.mark.parametrize("heads,page_size", [(4, 4), (20, 16)])  # (20: two head blocks, masked)
def test_decode(poison_empty, num_splits, heads, page_size):
    seq_lens = [1, 4, 5, 17, 33, 2]
    step = make_step([1] * 6, seq_lens, heads=heads, page_size=page_size, seed=heads)
    check(step, num_splits=num_splits)


def test_decode_default_plan_splits():
    """The interpreter's default decode plan splits few sequences (decode_splits), and keeps
    one program per (sequence, head block) for many."""
    config = mla_triton.INTERPRETER_CONFIG
    assert mla_triton.decode_splits(2, 1, 64, config, torch.device("cpu")) > 1
    assert mla_triton.decode_splits(8, 1, 64, config, torch.device("cpu")) == 1


def test_decode_with_padded_sequences(poison_empty):
    """A captured batch's shape: sequences without a token (q_len 0, seq_len 0) after the real
    ones, and rows past cu_seqlens_q[-1]."""
    step = make_step([1, 1, 0, 0], [9, 3, 0, 0], pad_rows=3, seed=1)
    check(step, num_splits=2)


def test_decode_float16(poison_empty):
    step = make_step([1] * 3, [7, 21, 12], dtype=torch.float16, seed=2)
    check(step, num_splits=2)
    check(step, torch.float16, num_splits=2)  # q in the caches' dtype too


@pytest.mark.parametrize("planned", [False, True])
@pytest.mark.parametrize("page_size", [4, 16])
def test_prefill(poison_empty, page_size, planned):
    """Prompts and chunks of different lengths, 1 included, some after a cached prefix
    (seq_len > q_len); planned: the step's work table given, at the kernel's query blocks
    (else each launch builds its own, as with a table planned for other tiles)."""
    q_lens, seq_lens = [5, 1, 17, 9, 2], [5, 1, 30, 16, 2]
    step = make_step(q_lens, seq_lens, page_size=page_size, seed=page_size)
    if planned:
        block_q = mla_triton.INTERPRETER_CONFIG.block_m // 2  # 4 heads in blocks of 2
        work = attention_work(step.attn.cu_seqlens_q, step.q_lat.shape[0], block_q)
        step.attn = dataclasses.replace(step.attn, work=work, work_block_q=block_q)
    check(step)


def test_prefill_skips_expanded(poison_empty):
    """skip_expanded (ExpandedKv.cu_seqlens_k): the sequences it gives all their keys (a
    prompt's first chunk, an extend, a one-token prompt) come back zero from both tables, the
    one it gives none (an extend) as without it."""
    q_lens, seq_lens = [5, 3, 1, 17], [5, 9, 1, 30]
    step = make_step(q_lens, seq_lens, page_size=4, seed=13)
    caches = (step.latent_cache, step.rope_cache)
    whole = mla.latent_attention(step.q_lat, step.q_pe, *caches, step.attn, step.scale)
    cu_k = torch.tensor([0, 5, 14, 15, 15], dtype=torch.int32)
    kept = torch.ones(whole.shape[0], dtype=torch.bool)
    kept[:9] = False
    for table in (mla, mla_triton):
        got = table.latent_attention(
            step.q_lat, step.q_pe, *caches, step.attn, step.scale, skip_expanded=cu_k
        )
        assert (got[~kept] == 0).all()
        torch.testing.assert_close(got[kept], whole[kept], **TOL[torch.float32])


def test_prefill_float16(poison_empty):
    step = make_step([6, 11], [6, 19], dtype=torch.float16, page_size=16, seed=3)
    check(step, torch.float16)


def test_mixed(poison_empty):
    """Decode rows and prefill chunks in one step, with a sequence without tokens between."""
    step = make_step([1, 6, 1, 0, 3], [20, 6, 9, 0, 11], pad_rows=1, seed=4)
    check(step)


def lora_inputs(slots: list[int], Hh: int, N: int, V: int, ranks: list[int], seed: int):
    """kv_b [Hh (N + V), L], its LoRA over 3 slots of these ranks (slot 1 disabled) in a pool of
    the largest, and the step's info; values past a slot's rank are random, never read."""
    g = torch.Generator().manual_seed(seed)
    r = max(ranks)
    kv_b = torch.randn(Hh * (N + V), L, generator=g) / L**0.5
    a = torch.randn(3, 1, r, L, generator=g) / L**0.5
    b = torch.randn(3, Hh * (N + V), r, generator=g) * 0.3
    lora = LoraWeights.dense(a, b, (Hh * (N + V),), ranks)
    info = LoraBatchInfo(
        torch.tensor(slots, dtype=torch.int32),
        torch.tensor(ranks, dtype=torch.int32),
        torch.tensor([0.5, 2.0, 1.5]),
        torch.tensor([1, 0, 1], dtype=torch.int32),
    )
    return kv_b, lora, info


@pytest.mark.parametrize("expanded", [None, "own", "whole"])
@pytest.mark.parametrize("ranks", [None, [4, 4, 4], [4, 8, 2]], ids=["base", "rank-4", "mixed"])
def test_mla_attention_end_to_end(poison_empty, ranks, expanded):
    """The Triton table's mla_attention (the absorption in torch, the latent attention and
    kv_b_proj's LoRA by kernels) against the reference's, on an extend, a decode and a prompt
    with two adapters, a base row and a disabled slot, and padded rows. expanded: keys and
    values in the expanded form (expanded_kv), "own" the step's rows (the prompt attends
    expanded), "whole" the extend's and the prompt's whole KV (both do); in both tables, and
    the result is the latent form's too."""
    Hh, N, V = 4, 16, 12
    q_lens, seq_lens, seq_slots = [3, 1, 7], [9, 5, 7], [0, NO_SLOT, 2]
    step = make_step(q_lens, seq_lens, heads=Hh, seed=6)
    T = step.q_lat.shape[0]
    slots = [s for s, n in zip(seq_slots, q_lens, strict=True) for _ in range(n)]
    kv_b, lora, info = lora_inputs(
        slots + [NO_SLOT] * (T - len(slots)), Hh, N, V, ranks or [4, 4, 4], seed=7
    )
    options = dict(lora=lora, info=info) if ranks else {}
    g = torch.Generator().manual_seed(8)
    q_nope = torch.randn(T, Hh, N, generator=g)
    args = (q_nope, step.q_pe, step.latent_cache, step.rope_cache, step.attn, kv_b, step.scale)
    latent_form = mla.mla_attention(*args, **options)
    if expanded:
        given = None if expanded == "own" else [True, False, True]
        kv = expanded_kv(step, kv_b, lora if ranks else None, info, V, given)
        if expanded == "own":
            for t in (kv.k_nope, kv.v):
                t[:4] = float("nan")  # the extend's and the decode's rows: the latent form's
        options["expanded"] = kv
    expected = mla.mla_attention(*args, **options)
    got = mla_triton.mla_attention(*args, **options)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(expected, latent_form, atol=1e-5, rtol=1e-5)
    assert (got[sum(q_lens) :] == 0).all()
    if ranks:
        base = mla.mla_attention(*args)
        assert not torch.allclose(got[:3], base[:3]), "slot 0's LoRA changed nothing"
        assert not torch.allclose(got[4:11], base[4:11]), "slot 2's LoRA changed nothing"
        torch.testing.assert_close(got[3], base[3], atol=1e-5, rtol=1e-5)  # the base row


@pytest.mark.parametrize("expanded", [None, "own"])
def test_mla_attention_o_shrink(poison_empty, expanded):
    """The Triton table's mla_attention_o_shrink against the reference's: the attention's
    output, and o_proj's LoRA shrink of it summed over its partials on the rows whose slot is
    enabled and has o_proj's factors (slot 0; slot 2's adapter has none, slot 1 is off). In
    the latent form the shrink rides in the absorption's launch, with expanded keys
    lora_shrink_split reads the finished rows."""
    Hh, N, V, H = 4, 16, 12, 20
    q_lens, seq_lens, seq_slots = [3, 1, 7], [9, 5, 7], [0, NO_SLOT, 2]
    step = make_step(q_lens, seq_lens, heads=Hh, seed=16)
    T = step.q_lat.shape[0]
    slots = [s for s, n in zip(seq_slots, q_lens, strict=True) for _ in range(n)]
    kv_b, lora, info = lora_inputs(slots + [NO_SLOT] * (T - len(slots)), Hh, N, V, [4, 8, 2], 17)
    g = torch.Generator().manual_seed(18)
    o_a = torch.randn(3, 1, 8, Hh * V, generator=g) / (Hh * V) ** 0.5
    o_lora = LoraWeights.dense(o_a, torch.randn(3, H, 8, generator=g), (H,), [8, 8, 0])
    q_nope = torch.randn(T, Hh, N, generator=g)
    args = (q_nope, step.q_pe, step.latent_cache, step.rope_cache, step.attn, kv_b, step.scale)
    options = dict(lora=lora, info=info, o_lora=o_lora)
    if expanded:
        options["expanded"] = expanded_kv(step, kv_b, lora, info, V, None)
    out, o = mla_triton.mla_attention_o_shrink(*args, **options)
    want, o_want = mla.mla_attention_o_shrink(*args, **options)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    assert o.weights is o_lora and o.info is info
    rows = torch.tensor([s == 0 for s in slots] + [False] * (T - len(slots)))
    got = o.shrunk[rows].sum(dim=1)
    torch.testing.assert_close(got, o_want.shrunk[rows].sum(dim=1), atol=1e-5, rtol=1e-5)
    assert got.abs().amax() > 0


@pytest.mark.parametrize("every", [False, True])
def test_mla_attention_every_sequence_expanded(poison_empty, every):
    """A step whose every sequence attends expanded (two prompts' first chunks, an extend
    given its whole KV): with ExpandedKv.every the latent form is skipped whole, else its
    kernel skips each; either way both tables give the latent form's result, and padded rows
    are zero."""
    Hh, N, V = 4, 16, 12
    step = make_step([4, 7, 5], [4, 7, 12], heads=Hh, seed=9)
    T = step.q_lat.shape[0]
    slots = [2] * 4 + [0] * 7 + [NO_SLOT] * 5
    kv_b, lora, info = lora_inputs(slots + [NO_SLOT] * (T - 16), Hh, N, V, [4, 4, 4], 10)
    q_nope = torch.randn(T, Hh, N, generator=torch.Generator().manual_seed(12))
    args = (q_nope, step.q_pe, step.latent_cache, step.rope_cache, step.attn, kv_b, step.scale)
    kv = expanded_kv(step, kv_b, lora, info, V, [True, True, True])
    options = dict(lora=lora, info=info, expanded=kv._replace(every=every))
    latent_form = mla.mla_attention(*args, lora=lora, info=info)
    for table in (mla, mla_triton):
        got = table.mla_attention(*args, **options)
        torch.testing.assert_close(got, latent_form, atol=1e-5, rtol=1e-5)
        assert (got[16:] == 0).all()


# -- The expanded form: a prompt's first chunk attends to its own expanded keys and values ------


def expanded_inputs(T: int, K: int, Hh: int, N: int, V: int, dtype: torch.dtype, seed: int):
    """q_nope, q_pe for T rows and k_nope, k_pe, v for K key rows as the layer lays them out:
    q_nope and q_pe views of one [T, Hh, N + R] tensor (q_pe's own tensor in the layer),
    k_nope and v views of kv_b_proj's [K, Hh, N + V] output."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(T, Hh, N + R, generator=g).to(dtype)
    kv = torch.randn(K, Hh, N + V, generator=g).to(dtype)
    k_pe = torch.randn(K, R, generator=g).to(dtype)
    q_nope, q_pe = q.split([N, R], dim=-1)
    k_nope, v = kv.split([N, V], dim=-1)
    return q_nope, q_pe, k_nope, k_pe, v


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("planned", [False, True])
def test_expanded_attention(poison_empty, dtype, planned):
    """Sequences given all their keys (prompts of 1, 5, 17 and 40 rows: several query blocks
    and both kinds of key tile; an extend of 3 after 6 and one of 20 after 13, whose blocks
    start off the key tiles; a decode row) beside an extend and a decode row given none and an
    empty sequence: the kernel writes the given ones' rows as the reference does and leaves
    every other row as it was. The query rows it may not read are NaN."""
    q_lens, seq_lens = [5, 3, 1, 17, 0, 1, 40, 2, 20, 1], [5, 9, 1, 17, 0, 6, 40, 8, 33, 4]
    given = [True, True, True, True, False, False, True, False, True, True]
    Hh, N, V, pad = 3, 16, 12, 2
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    kv_lens = [s if on else 0 for s, on in zip(seq_lens, given, strict=True)]
    cu_k = torch.tensor([0, *torch.tensor(kv_lens).cumsum(0).tolist()], dtype=torch.int32)
    T = int(cu[-1])
    q_nope, q_pe, *keys = expanded_inputs(T + pad, int(cu_k[-1]), Hh, N, V, dtype, seed=11)
    kv = mla.ExpandedKv(*keys, cu_k)
    rows = torch.zeros(T + pad, dtype=torch.bool)
    for b, on in enumerate(given):
        rows[int(cu[b]) : int(cu[b + 1])] = on
    for t in (q_nope, q_pe):
        t[~rows] = float("nan")
    attn = AttentionMetadata(
        cu_seqlens_q=cu,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        page_table=torch.zeros(len(q_lens), 1, dtype=torch.int32),  # the form reads no cache
        slot_mapping=torch.full((T + pad,), -1, dtype=torch.int64),
        max_query_len=max(q_lens),
    )
    block_q = mla_expanded.INTERPRETER_CONFIG.block_q
    if planned:
        work = attention_work(cu, T + pad, block_q)
        attn = dataclasses.replace(attn, work=work, work_block_q=block_q)
    expected = torch.full((T + pad, Hh, V), 7.0, dtype=dtype)
    mla.expanded_attention_(expected, q_nope, q_pe, kv, attn, 0.2)
    got = torch.full((T + pad, Hh, V), 7.0, dtype=dtype)
    mla_expanded.expanded_attention_(got, q_nope, q_pe, kv, attn, 0.2)
    assert torch.isfinite(got[rows]).all()
    assert (got[~rows] == 7.0).all(), "a row of a sequence not given its keys was written"
    torch.testing.assert_close(got, expected, **TOL[dtype])


def expanded_kv(step: Step, kv_b, lora, info, V: int, given: list[bool] | None) -> mla.ExpandedKv:
    """What the layer hands the attention: kv_b_proj with its LoRA applied to latents read back
    from the cache, and their rotated keys. given None: the step's own rows (cu_seqlens_k =
    cu_seqlens_q); else the whole KV of each sequence given (positions 0 .. seq_len - 1, the
    LoRA slot its rows'), none for the others."""
    cu, lens = step.attn.cu_seqlens_q.tolist(), step.attn.seq_lens.tolist()
    page_size, Hh = step.latent_cache.shape[1], step.q_lat.shape[1]
    positions, slots, kv_lens = [], [], [0]
    for b, kv_len in enumerate(lens):
        n = cu[b + 1] - cu[b]
        if given is None:
            positions += [(b, p) for p in range(kv_len - n, kv_len)]
            slots += info.slot_of_token[cu[b] : cu[b + 1]].tolist()
        elif given[b]:
            positions += [(b, p) for p in range(kv_len)]
            slots += [int(info.slot_of_token[cu[b]])] * kv_len
        kv_lens.append(kv_lens[-1] + (n if given is None else kv_len if given[b] else 0))
    if given is None:  # padded rows: keys nobody reads
        positions += [(0, 0)] * (step.q_lat.shape[0] - cu[-1])
        slots += [NO_SLOT] * (step.q_lat.shape[0] - cu[-1])
    c, k_pe = torch.zeros(len(positions), L), torch.zeros(len(positions), R)
    for row, (b, pos) in enumerate(positions):
        page = int(step.attn.page_table[b, pos // page_size])
        c[row] = step.latent_cache[page, pos % page_size, 0]
        k_pe[row] = step.rope_cache[page, pos % page_size, 0]
    kv = c @ kv_b.T
    for row, s in enumerate(slots):
        if lora is not None and s != NO_SLOT and info.slot_enabled[s]:
            a, b = lora.factors(s)
            kv[row] += info.scaling_of_slot[s] * (b @ (a[0] @ c[row]))
    k_nope, v = kv.view(len(positions), Hh, -1).split([kv.shape[1] // Hh - V, V], dim=-1)
    cu_k = torch.tensor(kv_lens, dtype=torch.int32)
    return mla.ExpandedKv(k_nope.clone(), k_pe, v.clone(), cu_k)
