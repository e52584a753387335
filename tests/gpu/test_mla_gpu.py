"""Triton latent attention (kernels/attention/mla.py) and kv_b_proj's absorption with its LoRA
inside (kernels/attention/mla_absorb.py) on the GPU at DeepSeek-V3's sizes, and under a CUDA graph.

bf16 caches against the fp32 torch reference (kernels/mla.py): relative error of the whole
output <= 1e-2. The latent and rope caches are views of one buffer, as the engine keeps them;
cache slots that no sequence may read are NaN, so an out-of-range read shows up.
Legend: B = sequences, T = tokens, Hh = heads, L = kv_lora_rank, R = qk_rope_head_dim,
N / V = qk_nope / v head dims.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():  # before any kernel module is imported (see kernels/conftest)
    pytest.skip("needs a CUDA device", allow_module_level=True)
pytest.importorskip("triton")

sys.path.insert(0, str(Path(__file__).parents[1]))
sys.path.insert(0, str(Path(__file__).parents[1] / "kernels"))
from cuda_graphs import capture  # noqa: E402
from lora_cases import compact_weights, lora_weights  # noqa: E402

from moelora.kernels import mla, reference  # noqa: E402
from moelora.kernels.attention import mla as mla_triton  # noqa: E402
from moelora.kernels.attention import mla_absorb, mla_expanded  # noqa: E402
from moelora.step.batch import AttentionMetadata  # noqa: E402
from moelora.step.lora import NO_SLOT, LoraBatchInfo, LoraWeights  # noqa: E402

L, R, N, V, PAGE = 512, 64, 128, 128, 16
SCALE = (N + R) ** -0.5
MAX_LEN = 1024


def make_cache(
    seq_lens: list[int], *, max_pages: int | None = None, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """(latent [P, PAGE, 1, L], rope [P, PAGE, 1, R] bf16 views of one buffer, page_table [B, P]
    over random pages, the spare page every unused entry names): random data in every
    sequence's slots, NaN elsewhere."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    pages_needed = [-(-s // PAGE) for s in seq_lens]
    max_pages = max_pages or max(pages_needed) + 1
    num_pages = sum(pages_needed) + 1
    perm = torch.randperm(num_pages, generator=g, device="cuda").to(torch.int32)
    spare = int(perm[-1])
    page_table = torch.full((len(seq_lens), max_pages), spare, dtype=torch.int32, device="cuda")
    valid = torch.zeros(num_pages * PAGE, dtype=torch.bool, device="cuda")
    used = 0
    for b, (n_pages, kv_len) in enumerate(zip(pages_needed, seq_lens, strict=True)):
        page_table[b, :n_pages] = perm[used : used + n_pages]
        valid[slots_of(page_table[b], kv_len)] = True
        used += n_pages
    cache = torch.randn(num_pages, PAGE, 1, L + R, generator=g, device="cuda", dtype=torch.bfloat16)
    cache.view(-1, L + R)[~valid] = float("nan")
    return cache[..., :L], cache[..., L:], page_table, spare


def slots_of(pages: torch.Tensor, kv_len: int) -> torch.Tensor:
    pos = torch.arange(kv_len, device=pages.device)
    return pages.long()[pos // PAGE] * PAGE + pos % PAGE


def metadata(q_lens: list[int], seq_lens: list[int], page_table, pad_rows: int = 0):
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


def queries(rows: int, heads: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """q_lat [T, Hh, L] and q_pe [T, Hh, R] float32, as mla_attention passes them."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    return tuple(torch.randn(rows, heads, d, generator=g, device="cuda") for d in (L, R))


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm().clamp(min=1e-6))


def assert_close_to_reference(out, q_lat, q_pe, latent, rope, attn) -> None:
    expected = mla.latent_attention(q_lat.float(), q_pe.float(), latent, rope, attn, SCALE)
    assert out.dtype == torch.float32 and torch.isfinite(out).all()
    assert rel_err(out, expected) <= 1e-2
    assert (out[int(attn.cu_seqlens_q[-1]) :] == 0).all(), "padded rows are not zero"


def run_case(q_lens, seq_lens, heads, *, pad_rows=0, q_dtype=torch.float32, seed=0) -> None:
    latent, rope, page_table, _ = make_cache(seq_lens, seed=seed)
    attn = metadata(q_lens, seq_lens, page_table, pad_rows)
    q_lat, q_pe = queries(attn.slot_mapping.shape[0], heads, seed)
    q_lat, q_pe = q_lat.to(q_dtype), q_pe.to(q_dtype)
    out = mla_triton.latent_attention(q_lat, q_pe, latent, rope, attn, SCALE)
    assert_close_to_reference(out, q_lat, q_pe, latent, rope, attn)


@pytest.mark.parametrize("heads", [16, 128])
@pytest.mark.parametrize("B", [1, 64])  # B = 1 splits the range (the combine), 64 does not
def test_decode(B, heads):
    seq_lens = torch.randint(1, MAX_LEN + 1, (B,), generator=torch.Generator().manual_seed(B))
    seq_lens[0] = MAX_LEN
    run_case([1] * B, seq_lens.tolist(), heads, pad_rows=1, seed=B)


def test_decode_queries_in_bf16():
    seq_lens = [MAX_LEN, 17, 300, 1]
    run_case([1] * 4, seq_lens, 128, pad_rows=1, q_dtype=torch.bfloat16)


@pytest.mark.parametrize("heads", [16, 128])
@pytest.mark.parametrize(
    "q_lens,seq_lens",
    [([2048], [2048]), ([1000, 1, 300, 0, 77], [1000, 1024, 1300, 0, 77])],
    ids=["prompt-2048", "chunked-mixed"],
)
def test_prefill(q_lens, seq_lens, heads):
    run_case(q_lens, seq_lens, heads, pad_rows=5)


@pytest.mark.parametrize("heads,graph_bs", [(16, 1), (128, 64)])  # split and not
def test_decode_cuda_graph_replay(heads, graph_bs):
    """Capture decode once, then replay with new lengths, page tables, queries and padding
    written in place into the captured buffers: every replay equals the eager call on the same
    inputs and is close to the reference."""
    max_pages = MAX_LEN // PAGE
    latent, rope, page_table, spare = make_cache([MAX_LEN] * graph_bs, max_pages=max_pages)
    attn = metadata([1] * graph_bs, [MAX_LEN] * graph_bs, page_table)
    q_lat, q_pe = queries(graph_bs, heads, seed=1)

    def step():
        return mla_triton.latent_attention(q_lat, q_pe, latent, rope, attn, SCALE)

    graph, out = capture(step)
    gen = torch.Generator().manual_seed(4)
    num_pages = latent.shape[0]
    for trial in range(4):
        num_real = max(1, graph_bs - 5 * trial) if graph_bs > 1 else 1
        lens = torch.randint(1, MAX_LEN + 1, (num_real,), generator=gen).tolist()
        lens += [0] * (graph_bs - num_real)
        # odd trials give padded sequences a q row, even ones none (rows past cu[-1])
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
        q_lat.normal_()
        q_pe.normal_()
        latent.normal_()  # every slot readable now: the table changes which ones are read
        rope.normal_()
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, step()), f"trial {trial}: the replay differs from eager"
        assert_close_to_reference(out, q_lat, q_pe, latent, rope, attn)
        assert (out[num_real:] == 0).all(), f"trial {trial}: padded rows are not zero"


def lora_inputs(slots: list[int], heads: int, rank: int = 16):
    """kv_b [Hh (N + V), L] bf16, its LoRA over 3 slots (slot 1 disabled) and the step's info."""
    g = torch.Generator(device="cuda").manual_seed(7)

    def randn(*shape):
        return torch.randn(*shape, generator=g, device="cuda")

    out = heads * (N + V)
    kv_b = (randn(out, L) / L**0.5).bfloat16()
    a, b = (randn(3, 1, rank, L) / L**0.5).bfloat16(), (randn(3, out, rank) * 0.3).bfloat16()
    info = LoraBatchInfo(
        torch.tensor(slots, dtype=torch.int32, device="cuda"),
        torch.tensor([rank] * 3, dtype=torch.int32, device="cuda"),
        torch.tensor([0.5, 2.0, 1.5], device="cuda"),
        torch.tensor([1, 0, 1], dtype=torch.int32, device="cuda"),
    )
    return kv_b, LoraWeights.dense(a, b, (out,)), info


@pytest.mark.parametrize("with_lora", [False, True])
def test_mla_attention_end_to_end(with_lora):
    """The Triton table's mla_attention against the reference's, both bf16 in and out: a decode
    row, an extend and a prompt, on two adapters, the base and a disabled slot."""
    heads, q_lens, seq_lens = 16, [1, 100, 513], [1000, 300, 513]
    latent, rope, page_table, _ = make_cache(seq_lens, seed=9)
    attn = metadata(q_lens, seq_lens, page_table, pad_rows=2)
    T = attn.slot_mapping.shape[0]
    seq_slots = [0, NO_SLOT, 2]
    slots = [s for s, n in zip(seq_slots, q_lens, strict=True) for _ in range(n)]
    kv_b, lora, info = lora_inputs(slots + [NO_SLOT] * (T - len(slots)), heads)
    g = torch.Generator(device="cuda").manual_seed(10)
    q_nope, q_pe = (
        torch.randn(T, heads, d, generator=g, device="cuda", dtype=torch.bfloat16) for d in (N, R)
    )
    options = dict(lora=lora, info=info) if with_lora else {}
    args = (q_nope, q_pe, latent, rope, attn, kv_b, SCALE)
    got = mla_triton.mla_attention(*args, **options)
    expected = mla.mla_attention(*args, **options)
    assert got.dtype == torch.bfloat16 and torch.isfinite(got).all()
    assert rel_err(got, expected) <= 1e-2
    assert (got[sum(q_lens) :] == 0).all()


@pytest.mark.parametrize("T", [1, 17, 64, 4096])
def test_absorption_in_bf16(T):
    """mla_absorb's kernels against the float32 references at DeepSeek's sizes (16 heads), bf16
    weight and queries: the q side's products are exact (its sums within float32's rounding),
    the out side's float32 rows are split in two bf16 parts (about 2^-16 of a row)."""
    heads = 16
    g = torch.Generator(device="cuda").manual_seed(T)
    kv_b = torch.randn(heads * (N + V), L, generator=g, device="cuda") / L**0.5
    kv_b = kv_b.to(torch.bfloat16)
    q = torch.randn(T, heads, N + R, generator=g, device="cuda").to(torch.bfloat16)
    o_lat = torch.randn(T, heads, L, generator=g, device="cuda")
    q_lat = mla_absorb.absorb_q(q[..., :N], kv_b)
    torch.testing.assert_close(q_lat, mla.absorb_q(q[..., :N], kv_b), rtol=1e-5, atol=1e-5)
    out = mla_absorb.absorb_out(o_lat, kv_b, N)
    torch.testing.assert_close(out, mla.absorb_out(o_lat, kv_b, N), rtol=1e-4, atol=1e-4)
    rounded = mla_absorb.absorb_out(o_lat, kv_b, N, torch.bfloat16)
    assert (rounded == out.to(torch.bfloat16)).float().mean() > 0.99
    graph, replayed = capture(lambda: mla_absorb.absorb_out(o_lat, kv_b, N))
    o_lat.copy_(torch.randn(T, heads, L, generator=g, device="cuda"))
    graph.replay()
    torch.testing.assert_close(replayed, mla_absorb.absorb_out(o_lat, kv_b, N), rtol=0, atol=0)


# kv_b_proj's LoRA inside the absorption's launches (mla_absorb.py): 4 slots of mixed ranks
# in a rank-16 pool, compact with NaN gaps between slots; slot 1 disabled.
LORA_RANKS = [16, 8, 16, 4]


def compact_kv_b_lora(heads: int) -> LoraWeights:
    torch.manual_seed(11)
    ranks = torch.tensor(LORA_RANKS)
    dense = lora_weights(4, (), 1, 16, L, (heads * (N + V),), ranks, torch.bfloat16, "cuda")
    return compact_weights(dense, LORA_RANKS)[0]


def slot_info(slots: list[int], enabled: list[int], spare_rows: int = 4) -> LoraBatchInfo:
    """The step's info over buffers spare_rows longer than it (holding slot 0: never read)."""
    return LoraBatchInfo(
        torch.tensor(slots + [0] * spare_rows, dtype=torch.int32, device="cuda"),
        torch.tensor(LORA_RANKS, dtype=torch.int32, device="cuda"),
        torch.tensor([0.5, 2.0, 1.5, 0.75], device="cuda"),
        torch.tensor(enabled, dtype=torch.int32, device="cuda"),
    )


# how the first pass of kv_b_proj's LoRA is scheduled (mla_absorb's module settings, for the
# side under test): apart, in the base's walk at every size; G by the rows; the module's own
VARIANTS = {
    "apart": lambda side: dict(FUSED_SIDES=(), G_BY_ROWS=False),
    "fused": lambda side: dict(FUSED_SIDES=(side,), FUSED_MAX_ROWS=1 << 30, G_BY_ROWS=False),
    "apart, G by rows": lambda side: dict(FUSED_SIDES=(), G_BY_ROWS=True),
    "default": lambda side: {},
}


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("T", [1, 8, 64, 200, 4096])
@pytest.mark.parametrize("side", ["q", "out"])
def test_absorption_with_lora_against_references(monkeypatch, side, T, variant):
    """Each side's absorption with kv_b_proj's LoRA inside against the float32 references
    (kernels/mla.absorb_q / absorb_out with lora_q_ / lora_out_) on the same bf16 weight and
    factors, at decode and prefill sizes: the corrections agree to about 2^-16 of their size
    (their float32 parts split in two bf16 parts), and rows without an enabled slot keep the
    bits of the absorption without LoRA; the first pass as each variant schedules it."""
    for name, value in VARIANTS[variant](side).items():
        monkeypatch.setattr(mla_absorb, name, value)
    heads = 16
    lora = compact_kv_b_lora(heads)
    g = torch.Generator().manual_seed(12 + T)
    slots = torch.randint(-1, 4, (T,), generator=g)
    slots[0] = 2
    if T > 3:
        slots[-3:] = NO_SLOT  # padded rows
    info = slot_info(slots.tolist(), [1, 0, 1, 1])
    g = torch.Generator(device="cuda").manual_seed(13)
    kv_b = (torch.randn(heads * (N + V), L, generator=g, device="cuda") / L**0.5).bfloat16()
    if side == "q":
        rows = torch.randn(T, heads, N + R, generator=g, device="cuda").bfloat16()[..., :N]
        run, ref = mla_absorb.absorb_q, mla.absorb_q
        args = (rows, kv_b)
    else:
        rows = torch.randn(T, heads, L, generator=g, device="cuda")
        run, ref = mla_absorb.absorb_out, mla.absorb_out
        args = (rows, kv_b, N)
    base = run(*args)
    got = run(*args, lora=lora, info=info)
    expected = ref(*args, lora=lora, info=info)
    assert torch.isfinite(got).all()
    assert rel_err(got - base, expected - ref(*args)) <= 1e-3
    with_slot = ((slots == 0) | (slots >= 2)).cuda()
    assert torch.equal(got[~with_slot], base[~with_slot])
    assert rel_err(got[with_slot], base[with_slot]) > 1e-3, "the LoRA added nothing"
    if side == "out":  # rounded once to the model's dtype, the correction inside
        rounded = run(*args, torch.bfloat16, lora=lora, info=info)
        assert (rounded == got.to(torch.bfloat16)).float().mean() > 0.99


O_RANKS = [16, 8, 0, 4]  # o_proj's: slot 2's adapter has none


def compact_o_lora(heads: int, hidden: int = 256) -> LoraWeights:
    torch.manual_seed(21)
    ranks = torch.tensor(O_RANKS)
    dense = lora_weights(4, (), 1, 16, heads * V, (hidden,), ranks, torch.bfloat16, "cuda")
    return compact_weights(dense, O_RANKS)[0]


@pytest.mark.parametrize("o_shrink", [False, True])
def test_mla_attention_with_lora_cuda_graph_replay(o_shrink):
    """Decode with kv_b_proj's LoRA (and o_proj's shrink: mla_attention_o_shrink) captured with
    every slot disabled (as the runner captures), then replayed with new slot assignments,
    flags, scalings, lengths and queries written in place: each replay equals the eager call
    and is close to the reference; the shrink's partials, summed, equal the reference's on the
    rows with o_proj's factors."""
    heads, graph_bs, max_pages = 16, 8, MAX_LEN // PAGE
    latent, rope, page_table, _ = make_cache([MAX_LEN] * graph_bs, max_pages=max_pages)
    attn = metadata([1] * graph_bs, [MAX_LEN] * graph_bs, page_table)
    lora, o_lora = compact_kv_b_lora(heads), compact_o_lora(heads)
    info = slot_info([NO_SLOT] * graph_bs, [0, 0, 0, 0])
    g = torch.Generator(device="cuda").manual_seed(14)
    kv_b = (torch.randn(heads * (N + V), L, generator=g, device="cuda") / L**0.5).bfloat16()
    q_nope = torch.randn(graph_bs, heads, N, device="cuda", dtype=torch.bfloat16)
    q_pe = torch.randn(graph_bs, heads, R, device="cuda", dtype=torch.bfloat16)
    args = (q_nope, q_pe, latent, rope, attn, kv_b, SCALE)

    def step():
        if o_shrink:
            out, o = mla_triton.mla_attention_o_shrink(*args, lora=lora, info=info, o_lora=o_lora)
            return out, o.shrunk
        return mla_triton.mla_attention(*args, lora=lora, info=info), None

    graph, (out, part) = capture(step)
    gen = torch.Generator().manual_seed(15)
    for trial in range(4):
        slots = torch.randint(-1, 4, (graph_bs,), generator=gen)
        slots[0] = trial % 4  # every slot in turn, the disabled and rank-4 ones included
        enabled = [int(s in slots.tolist() and s != 1) for s in range(4)]
        info.slot_of_token[:graph_bs].copy_(slots)
        info.slot_enabled.copy_(torch.tensor(enabled))
        info.scaling_of_slot.uniform_(0.5, 2.0)
        attn.seq_lens.copy_(torch.randint(1, MAX_LEN + 1, (graph_bs,), generator=gen))
        for t in (q_nope, q_pe, latent, rope):
            t.normal_()
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        eager, eager_part = step()
        assert torch.equal(out, eager), f"trial {trial}: the replay differs from eager"
        expected = mla.mla_attention(*args, lora=lora, info=info)
        assert rel_err(out, expected) <= 1e-2, f"trial {trial}"
        base = mla.mla_attention(*args)
        with_slot = ((slots == 0) | (slots >= 2)).cuda()
        if with_slot.any():
            assert rel_err(out[with_slot], base[with_slot]) > 1e-2, "the LoRA added nothing"
        o_rows = ((slots == 0) | (slots == 3)).cuda()
        if o_shrink and o_rows.any():
            got = part[o_rows].sum(dim=1)
            assert torch.equal(got, eager_part[o_rows].sum(dim=1)), f"trial {trial}"
            want = reference.lora_shrink(out.reshape(graph_bs, -1), o_lora, info)[o_rows]
            assert rel_err(got, want) <= 1e-3, f"trial {trial}"


# -- The expanded form (kernels/attention/mla_expanded.py): prompts' first chunks --------------


def expanded_inputs(T: int, heads: int, cu_seqlens_k: torch.Tensor, seed: int):
    """q_nope and q_pe (views of one [T, Hh, N + R] bf16 tensor, as the layer splits q) and
    ExpandedKv over cu_seqlens_k's rows (k_nope and v views of kv_b_proj's [K, Hh, N + V]
    output), at unit scale."""
    g = torch.Generator(device="cuda").manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=g, device="cuda", dtype=torch.bfloat16)

    K = int(cu_seqlens_k[-1])
    q, kv = randn(T, heads, N + R), randn(K, heads, N + V)
    expanded = mla.ExpandedKv(kv[..., :N], randn(K, R), kv[..., N:], cu_seqlens_k)
    return q[..., :N], q[..., N:], expanded


@pytest.mark.parametrize("heads", [16, 128])
@pytest.mark.parametrize(
    "q_lens,seq_lens,given",
    [
        ([4096], [4096], [True]),
        (
            [1000, 1, 300, 0, 77, 129, 2000],
            [1000, 1024, 300, 0, 90, 129, 4000],
            [True, False, True, False, False, True, True],
        ),
    ],
    ids=["prompt-4096", "mixed"],
)
def test_expanded_attention(q_lens, seq_lens, given, heads):
    """The kernel against the reference (fp32 math over the same bf16 inputs): the sequences
    given all their keys (prompts' first chunks, an extend of 2000 after 2000) within 1e-2
    relative error, every other row untouched."""
    attn = metadata(q_lens, seq_lens, torch.zeros(len(q_lens), 1, dtype=torch.int32), 3)
    T = attn.slot_mapping.shape[0]
    kv_lens = torch.tensor([s if on else 0 for s, on in zip(seq_lens, given, strict=True)])
    cu_k = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    cu_k[1:] = kv_lens.cumsum(0)
    q_nope, q_pe, expanded = expanded_inputs(T, heads, cu_k.cuda(), seed=len(q_lens))
    got = torch.full((T, heads, V), 7.0, dtype=torch.bfloat16, device="cuda")
    mla_expanded.expanded_attention_(got, q_nope, q_pe, expanded, attn, SCALE)
    want = torch.full((T, heads, V), 7.0, dtype=torch.float32, device="cuda")
    mla.expanded_attention_(want, q_nope, q_pe, expanded, attn, SCALE)
    first = torch.zeros(T, dtype=torch.bool, device="cuda")
    cu = attn.cu_seqlens_q.tolist()
    for b, (n, on) in enumerate(zip(q_lens, given, strict=True)):
        first[cu[b] : cu[b] + n] = on
    assert torch.isfinite(got).all()
    assert rel_err(got[first], want[first]) <= 1e-2
    assert (got[~first] == 7.0).all(), "a row of a sequence not given its keys was written"


def test_mla_attention_forms_agree():
    """A prefill step with a prompt's first chunk, an extend and a decode row, with kv_b_proj's
    LoRA: the Triton table given the expanded keys and values (kv_b_proj and its LoRA of each
    row's latent, as the layer computes them) is close to the reference's latent form."""
    heads, q_lens, seq_lens, seq_slots = 16, [513, 100, 1], [513, 300, 1000], [0, 2, NO_SLOT]
    latent, rope, page_table, _ = make_cache(seq_lens, seed=16)
    attn = metadata(q_lens, seq_lens, page_table, pad_rows=2)
    T = attn.slot_mapping.shape[0]
    slots = [s for s, n in zip(seq_slots, q_lens, strict=True) for _ in range(n)]
    kv_b, lora, info = lora_inputs(slots + [NO_SLOT] * (T - len(slots)), heads)
    rows = torch.cat(
        [slots_of(page_table[b], s)[s - n :] for b, (n, s) in enumerate(zip(q_lens, seq_lens))]
    )
    c = latent.reshape(-1, L)[rows].float()
    kv = c @ kv_b.float().T
    for s in (0, 2):
        mine = torch.tensor(slots, device="cuda") == s
        a, b = (f.float() for f in lora.factors(s))
        kv[mine] += info.scaling_of_slot[s] * (c[mine] @ a[0].T) @ b.T
    kv = torch.cat([kv, kv.new_zeros(2, kv.shape[1])]).bfloat16().view(T, heads, N + V)
    k_pe = torch.cat([rope.reshape(-1, R)[rows], rope.new_zeros(2, R)])
    expanded = mla.ExpandedKv(kv[..., :N], k_pe, kv[..., N:], attn.cu_seqlens_q)
    g = torch.Generator(device="cuda").manual_seed(17)
    q_nope, q_pe = (
        torch.randn(T, heads, d, generator=g, device="cuda", dtype=torch.bfloat16) for d in (N, R)
    )
    args = (q_nope, q_pe, latent, rope, attn, kv_b, SCALE)
    got = mla_triton.mla_attention(*args, lora=lora, info=info, expanded=expanded)
    expected = mla.mla_attention(*args, lora=lora, info=info)
    assert got.dtype == torch.bfloat16 and torch.isfinite(got).all()
    assert rel_err(got, expected) <= 2e-2
    assert (got[sum(q_lens) :] == 0).all()


def test_expanded_attention_cuda_graph_replay():
    """A prefill step captured once, then replayed with new chunk lengths (first chunks and
    extends, so the work table changes), new queries, keys and values written in place: each
    replay equals the eager call."""
    heads, T, B = 16, 1024, 4
    attn = metadata([256] * B, [256] * B, torch.zeros(B, 1, dtype=torch.int32))
    q_nope, q_pe, expanded = expanded_inputs(T, heads, attn.cu_seqlens_q, seed=18)
    out = torch.zeros(T, heads, V, dtype=torch.bfloat16, device="cuda")
    work = mla_triton.attention_work(attn.cu_seqlens_q, T, mla_expanded.CONFIG.block_q)
    attn = dataclasses.replace(attn, work=work, work_block_q=mla_expanded.CONFIG.block_q)

    def step():
        out.zero_()
        mla_expanded.expanded_attention_(out, q_nope, q_pe, expanded, attn, SCALE)
        return out

    graph, captured = capture(step)
    gen = torch.Generator().manual_seed(19)
    for trial in range(4):
        q_lens = torch.randint(1, T // B + 1, (B,), generator=gen)
        seq_lens = q_lens + (torch.arange(B) % 2) * trial  # odd sequences extend from trial > 0
        cu = torch.zeros(B + 1, dtype=torch.int32)
        cu[1:] = q_lens.cumsum(0)
        attn.cu_seqlens_q.copy_(cu)
        attn.seq_lens.copy_(seq_lens)
        attn.work.copy_(
            mla_triton.attention_work(attn.cu_seqlens_q, T, mla_expanded.CONFIG.block_q)
        )
        for t in (q_nope, q_pe, expanded.k_nope, expanded.k_pe, expanded.v):
            t.normal_()
        graph.replay()
        torch.cuda.synchronize()
        replayed = captured.clone()
        assert torch.equal(replayed, step()), f"trial {trial}: the replay differs from eager"
