"""Triton gated DeltaNet kernels (kernels/linear_attention/) against their torch references
(kernels/gated_delta.py), in the interpreter.

Every state slot starts random, the slots of sequences that start at position 0 included (the
kernels must ignore what those hold), and the batch's sequences sit in permuted slots. Inputs
are the strided views the layer passes (layers/linear_attention.py): the conv's input a slice
of in_proj's output, q, k and v heads inside the conv's output, g and beta column slices.
Checked: the outputs' real rows; the slots the batch writes; every other slot bit for bit as it
was. A padded batch (as a captured step has it: more sequences with no rows, seq_len 0, the
spare slot, and rows past cu_seqlens_q[-1]) returns zeros in the padded rows and leaves the
spare slot as it was; its real rows are the unpadded batch's.
Legend: T = tokens, B = sequences, S = state slots, C = conv channels, W = conv taps,
Hk = q/k heads, H = value heads, K / V = key / value head dim, D = norm width.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest
import torch
from lora_cases import compact_weights, lora_weights

from moelora.kernels import gated_delta, reference
from moelora.kernels.linear_attention import conv, delta_chunked, delta_rule, gates
from moelora.kernels.linear_attention.conv import causal_conv1d
from moelora.kernels.linear_attention.delta_rule import gated_delta_rule
from moelora.kernels.linear_attention.gated_norm import rms_norm_gated, rms_norm_gated_o_shrink
from moelora.step.batch import AttentionMetadata
from moelora.step.lora import NO_SLOT, LoraBatchInfo

TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float16: dict(rtol=2e-3, atol=2e-3)}
STATE_TOL = dict(rtol=1e-5, atol=1e-5)  # float32 states, summed in another order
# (tokens, starts at position 0) of each sequence
CASES = {
    "decode": [(1, True), (1, False), (1, False), (1, True)],
    "prefill": [(5, True), (1, False), (2, False), (9, False), (1, True)],
    "mixed": [(1, False), (7, True), (1, True), (3, False)],
}
C, W = 300, 4  # channels over several blocks at either tile, not a multiple of one
Hk, K, V = 2, 12, 20  # K padded to its block, V over several blocks, the last partial


def _attn(q_lens: list[int], seq_lens: list[int], slots: list[int], rows: int):
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    return AttentionMetadata(
        cu,
        torch.tensor(seq_lens, dtype=torch.int32),
        torch.zeros(len(q_lens), 1, dtype=torch.int32),
        torch.zeros(rows, dtype=torch.int64),
        max(q_lens),
        state_slots=torch.tensor(slots, dtype=torch.int32),
    )


@dataclass(frozen=True)
class Batch:
    attn: AttentionMetadata  # what the kernel is given
    real: AttentionMetadata  # the same without padding: what the reference is given
    rows: int  # real rows; attn may have more
    slots: list[int]  # the real sequences' slots
    num_slots: int  # S: the slots, one outside the batch, the spare last


def make_batch(case: str, *, padded: bool, seed: int) -> Batch:
    gen = torch.Generator().manual_seed(seed)
    seqs = CASES[case]
    B, S = len(seqs), len(seqs) + 2
    slots = torch.randperm(S - 1, generator=gen)[:B].tolist()
    q_lens = [n for n, _ in seqs]
    before = torch.randint(1, 9, (B,), generator=gen).tolist()
    seq_lens = [n + (0 if fresh else m) for (n, fresh), m in zip(seqs, before)]
    rows = sum(q_lens)
    real = _attn(q_lens, seq_lens, slots, rows)
    if not padded:
        return Batch(real, real, rows, slots, S)
    # a decode graph has a row a sequence; a prefill graph more rows than sequences
    extra = 2 if case == "decode" else 5
    spare = [S - 1, S - 1]
    attn = _attn([*q_lens, 0, 0], [*seq_lens, 0, 0], [*slots, *spare], rows + extra)
    return Batch(attn, real, rows, slots, S)


def assert_slots(after: torch.Tensor, want: torch.Tensor, before: torch.Tensor, batch: Batch):
    """The batch's slots hold the reference's states; every other slot is as it was."""
    for s in range(batch.num_slots):
        if s in batch.slots:
            torch.testing.assert_close(after[s], want[s], **STATE_TOL)
        else:
            assert torch.equal(after[s], before[s]), f"slot {s} is not the batch's"


def assert_close(out: torch.Tensor, want: torch.Tensor):
    """Within TOL; in float16 also the same bits almost everywhere: the kernels round where the
    references do, so only another float32 summation order can flip a rounding (a rounding
    left out or added flips a quarter of them)."""
    torch.testing.assert_close(out, want, **TOL[out.dtype])
    if out.dtype == torch.float16:
        assert (out != want).sum() <= max(1, out.numel() // 100)


def assert_rows(out: torch.Tensor, want: torch.Tensor, batch: Batch):
    """The real rows are the reference's; the padded ones zeros (not the NaN torch.empty gave)."""
    assert_close(out[: batch.rows], want)
    assert torch.equal(out[batch.rows :], torch.zeros_like(out[batch.rows :]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("case", sorted(CASES))
def test_causal_conv1d_matches_reference(poison_empty, case, padded, dtype):
    _conv_case(case, padded, dtype)


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("case", ["prefill", "mixed"])
def test_causal_conv1d_splits_a_sequence_over_programs(poison_empty, monkeypatch, case, padded):
    """Rows split over programs 3 at a time (a 9-token sequence takes three, a 7-token one
    three, the last partial): the same rows, and the window written once, after its reads."""
    monkeypatch.setattr(conv, "CONV_SPAN", 3)
    monkeypatch.setattr(conv, "CONV_SPLITS", 64)
    _conv_case(case, padded, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_causal_conv1d_blocks_past_the_window_read_rows_only(poison_empty, monkeypatch, dtype):
    """At the prefill tile a block whose rows are all past the first W - 1 takes its taps from
    the chunk's rows alone (no window loads): sequences longer than a block, one continuing
    (its first block reads the window), one fresh, each ending inside a block."""
    monkeypatch.setitem(CASES, "long", [(37, False), (20, True), (1, False)])
    _conv_case("long", False, dtype)
    _conv_case("long", True, dtype)


def _conv_case(case: str, padded: bool, dtype: torch.dtype) -> None:
    batch = make_batch(case, padded=padded, seed=len(case))
    T = batch.attn.slot_mapping.shape[0]
    wide = torch.randn(T, C + 24, dtype=dtype)
    x = wide[:, 8 : 8 + C]  # a slice of in_proj's output: rows strided
    weight = torch.randn(C, W, dtype=dtype)
    before = torch.randn(batch.num_slots, C, W - 1, dtype=dtype)
    conv_state, want_state = before.clone(), before.clone()
    want = gated_delta.causal_conv1d(x[: batch.rows], weight, want_state, batch.real)
    out = causal_conv1d(x, weight, conv_state, batch.attn)
    assert out.shape == (T, C) and out.dtype == dtype and out.is_contiguous()
    assert_rows(out, want, batch)
    assert_slots(conv_state, want_state, before, batch)


def delta_inputs(T: int, H: int, dtype: torch.dtype, gen: torch.Generator):
    """q, k [T, Hk, K], v [T, H, V] inside one conv output row; g (float32), beta [T, H] as
    column slices."""
    width = 2 * Hk * K + H * V
    qkv = torch.randn(T, width, generator=gen).to(dtype)
    q, k, v = qkv.split([Hk * K, Hk * K, H * V], dim=-1)
    g = -torch.rand(T, 2 * H, generator=gen)[:, H:] * 0.5  # log decays <= 0
    beta = torch.rand(T, 2 * H, generator=gen).to(dtype)[:, :H]
    return q.reshape(T, Hk, K), k.reshape(T, Hk, K), v.reshape(T, H, V), g, beta


def run_delta(batch: Batch, groups: int, dtype: torch.dtype, seed: int, chunked: bool = False):
    """(kernel's out, reference's out, state after, reference's state, state before)."""
    gen = torch.Generator().manual_seed(seed)
    H = Hk * groups
    T = batch.attn.slot_mapping.shape[0]
    q, k, v, g, beta = delta_inputs(T, H, dtype, gen)
    before = torch.randn(batch.num_slots, H, K, V, generator=gen)
    state, want_state = before.clone(), before.clone()
    real = [t[: batch.rows] for t in (q, k, v, g, beta)]
    want = gated_delta.gated_delta_rule(*real, want_state, batch.real)
    out = gated_delta_rule(q, k, v, g, beta, state, batch.attn, chunked=chunked)
    assert out.shape == (T, H, V) and out.dtype == dtype and out.is_contiguous()
    return out, want, state, want_state, before


@pytest.mark.parametrize("groups", [1, 2])
@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("case", sorted(CASES))
def test_gated_delta_rule_matches_reference(poison_empty, case, padded, groups):
    batch = make_batch(case, padded=padded, seed=len(case) + groups)
    out, want, state, want_state, before = run_delta(batch, groups, torch.float32, seed=groups)
    assert_rows(out, want, batch)
    assert_slots(state, want_state, before, batch)


def test_gated_delta_rule_in_float16(poison_empty):
    """float16 q, k, v and beta (out in float16, the state in float32)."""
    batch = make_batch("mixed", padded=True, seed=3)
    out, want, state, want_state, before = run_delta(batch, 2, torch.float16, seed=3)
    assert_rows(out, want, batch)
    assert_slots(state, want_state, before, batch)


CHUNKED_TOL = dict(rtol=1e-4, atol=1e-4)  # the block form against the token loop, float32


@pytest.mark.parametrize("groups", [1, 2])
@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("case", ["prefill", "mixed"])
def test_chunked_gated_delta_rule_matches_reference(
    poison_empty, monkeypatch, case, padded, groups
):
    """chunked=True: a prefill step in blocks of 4 tokens (the interpreter's; the 9- and 7-token
    chunks take three and two, the last partial) equals the token loop up to float rounding,
    outputs and slots, padded rows zero, other slots untouched; the block kernels ran."""
    launched = []
    chunked = delta_chunked.chunked_gated_delta_rule

    def counted(*args, **kwargs):
        launched.append(1)
        return chunked(*args, **kwargs)

    monkeypatch.setattr(delta_rule, "chunked_gated_delta_rule", counted)
    batch = make_batch(case, padded=padded, seed=len(case) + groups)
    out, want, state, want_state, before = run_delta(
        batch, groups, torch.float32, seed=groups, chunked=True
    )
    assert launched
    torch.testing.assert_close(out[: batch.rows], want, **CHUNKED_TOL)
    assert torch.equal(out[batch.rows :], torch.zeros_like(out[batch.rows :]))
    for s in range(batch.num_slots):
        if s in batch.slots:
            torch.testing.assert_close(state[s], want_state[s], **CHUNKED_TOL)
        else:
            assert torch.equal(state[s], before[s]), f"slot {s} is not the batch's"


@pytest.mark.parametrize("prepared", [False, True])
@pytest.mark.parametrize("chunk", [8, 16])
def test_chunked_blocks_of_several_sub_blocks(poison_empty, monkeypatch, chunk, prepared):
    """Blocks of 8 and 16 tokens: sub-blocks of 2 and 4 rows, so the inverse's substitution
    steps and its block merges (_prepare_kernel) both run, on full and partial blocks (the
    9- and 7-token chunks) and a state carried between two blocks; q and k normed in the chain
    or prepared beside w and u (ChunkedConfig.prepared)."""
    config = replace(delta_chunked.INTERPRETER_CONFIG, chunk=chunk, prepared=prepared)
    monkeypatch.setattr(delta_chunked, "INTERPRETER_CONFIG", config)
    batch = make_batch("prefill", padded=True, seed=chunk)
    out, want, state, want_state, before = run_delta(
        batch, 2, torch.float32, seed=chunk, chunked=True
    )
    torch.testing.assert_close(out[: batch.rows], want, **CHUNKED_TOL)
    for s in batch.slots:
        torch.testing.assert_close(state[s], want_state[s], **CHUNKED_TOL)


# the dtype paired with the case, not crossed: which rows a batch holds does not change how
# the gates are computed in either dtype
@pytest.mark.parametrize("chunked", [False, True])
@pytest.mark.parametrize(
    "case,dtype", [("decode", torch.float16), ("mixed", torch.float32)], ids=["decode", "mixed"]
)
def test_gated_delta_rule_takes_its_gates_raw(poison_empty, case, chunked, dtype):
    """gates=DeltaGates(a, b, A_log, dt_bias) for g and beta (in_proj's a and b slices, rows
    strided): the same bits as delta_gates' launch and then the rule, token loop and block
    form; the reference likewise; g and beta given with the gates are refused."""
    from moelora.kernels.gated_delta import DeltaGates

    batch = make_batch(case, padded=True, seed=len(case) + chunked)
    gen = torch.Generator().manual_seed(7 + chunked)
    H = Hk * 2
    T = batch.attn.slot_mapping.shape[0]
    q, k, v, _, _ = delta_inputs(T, H, dtype, gen)
    y = torch.randn(T, 2 * H + 3, generator=gen)
    y[:, H : 2 * H] = 4 * y[:, H : 2 * H] - 2  # a + dt_bias over much of softplus's range
    b, a = y.to(dtype)[:, :H], y.to(dtype)[:, H : 2 * H]
    A_log, dt_bias = torch.randn(H, generator=gen).to(dtype), torch.randn(H, generator=gen)
    raw = DeltaGates(a, b, A_log, dt_bias.to(dtype))
    before = torch.randn(batch.num_slots, H, K, V, generator=gen)
    states = [before.clone() for _ in range(3)]
    g, beta = gates.delta_gates(*raw)
    want = gated_delta_rule(q, k, v, g, beta, states[0], batch.attn, chunked=chunked)
    out = gated_delta_rule(q, k, v, None, None, states[1], batch.attn, gates=raw, chunked=chunked)
    assert torch.equal(out, want) and torch.equal(states[1], states[0])
    real = [t[: batch.rows] for t in (q, k, v)]
    ref_gates = DeltaGates(a[: batch.rows], b[: batch.rows], *raw[2:])
    ref = gated_delta.gated_delta_rule(*real, None, None, states[2], batch.real, gates=ref_gates)
    tol = CHUNKED_TOL if chunked else TOL[dtype]
    torch.testing.assert_close(out[: batch.rows].float(), ref.float(), **tol)
    with pytest.raises(AssertionError, match="g and beta, or the gates"):
        gated_delta_rule(q, k, v, g, beta, states[1], batch.attn, gates=raw)


def test_chunked_gated_delta_rule_in_float16(poison_empty):
    batch = make_batch("prefill", padded=True, seed=5)
    out, want, state, want_state, _ = run_delta(batch, 2, torch.float16, seed=5, chunked=True)
    torch.testing.assert_close(out[: batch.rows], want, rtol=3e-3, atol=3e-3)
    for s in batch.slots:
        torch.testing.assert_close(state[s], want_state[s], **CHUNKED_TOL)


def test_chunked_form_reference_matches_the_token_loop():
    """gated_delta.chunked_delta_rule (the block kernels' reference, blocks of CHUNK) over a
    sequence of 150 tokens from a random state equals the token loop."""
    gen = torch.Generator().manual_seed(21)
    L, H = 150, 2
    q, k = (gated_delta._l2norm(torch.randn(L, H, K, generator=gen)) for _ in range(2))
    q = q * K**-0.5
    v = torch.randn(L, H, V, generator=gen)
    g, beta = -torch.rand(L, H, generator=gen) * 0.5, torch.rand(L, H, generator=gen)
    s0 = torch.randn(H, K, V, generator=gen)
    out, s = gated_delta.chunked_delta_rule(q, k, v, g, beta, s0)
    want_s, want = s0, []
    for t in range(L):
        want_s, o = gated_delta._delta_step(want_s, q[t], k[t], v[t], g[t], beta[t])
        want.append(o)
    torch.testing.assert_close(out, torch.stack(want), **CHUNKED_TOL)
    torch.testing.assert_close(s, want_s, **CHUNKED_TOL)


# a sequence of 11 tokens prefilled whole, or as a first chunk, an extend and a decode step
CHUNKINGS = [[11], [4, 6, 1]]


def run_in_chunks(chunks, x, weight, conv_state, delta_args, state) -> list[torch.Tensor]:
    """The conv and the delta rule over one sequence (in slot 1) a chunk at a time: their
    outputs, then the states they leave."""
    convs, deltas, done = [], [], 0
    for n in chunks:
        rows = slice(done, done + n)
        attn = _attn([n], [done + n], [1], n)
        convs.append(causal_conv1d(x[rows], weight, conv_state, attn))
        deltas.append(gated_delta_rule(*(t[rows] for t in delta_args), state, attn))
        done += n
    return [torch.cat(convs), torch.cat(deltas), conv_state, state]


def test_chunking_changes_no_bit():
    """The conv's and the delta rule's outputs and final states are the same bits whether the
    sequence comes whole or in chunks (the token loop; the same taps at either tile)."""
    gen = torch.Generator().manual_seed(11)
    x, weight = torch.randn(11, C, generator=gen), torch.randn(C, W, generator=gen)
    delta_args = delta_inputs(11, 2 * Hk, torch.float32, gen)
    conv0 = torch.randn(3, C, W - 1, generator=gen)
    state0 = torch.randn(3, 2 * Hk, K, V, generator=gen)
    whole, parts = (
        run_in_chunks(chunks, x, weight, conv0.clone(), delta_args, state0.clone())
        for chunks in CHUNKINGS
    )
    for name, a, b in zip(("conv", "delta", "conv_state", "state"), whole, parts):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("N", [1, 7, 33])
@pytest.mark.parametrize("D", [24, 64])
def test_rms_norm_gated_matches_reference(poison_empty, dtype, N, D):
    gen = torch.Generator().manual_seed(N * D)
    wide = torch.randn(N, D + 16, generator=gen).to(dtype)
    x = torch.randn(N, D, generator=gen).to(dtype)
    gate = wide[:, 16:]  # a slice of z's rows: strided
    weight = (1 + 0.5 * torch.randn(D, generator=gen)).to(dtype)
    out = rms_norm_gated(x, gate, weight, 1e-6)
    want = gated_delta.rms_norm_gated(x, gate, weight, 1e-6)
    assert out.shape == (N, D) and out.dtype == dtype and out.is_contiguous()
    assert_close(out, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_rms_norm_gated_takes_a_row_a_head(poison_empty, dtype):
    """The layer's call: the delta rule's [T, H, V] output and in_proj's z slice viewed
    [T, H, V] (its rows strided by in_proj's width), normed per head."""
    T, H, D = 5, 3, 20
    x = torch.randn(T, H, D).to(dtype)
    y = torch.randn(T, 7 + H * D + 9).to(dtype)
    z = y[:, 7 : 7 + H * D].view(T, H, D)
    weight = (1 + 0.5 * torch.randn(D)).to(dtype)
    out = rms_norm_gated(x, z, weight, 1e-6)
    assert out.shape == (T, H, D) and out.is_contiguous()
    assert_close(out, gated_delta.rms_norm_gated(x, z, weight, 1e-6))
    flat = rms_norm_gated(x.reshape(-1, D), z.reshape(-1, D), weight, 1e-6)
    assert torch.equal(out.view(-1, D), flat)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("T,H", [(8, 3), (3, 16)])  # 3 heads: a program's rows span tokens
def test_rms_norm_gated_o_shrink_matches_reference(poison_empty, dtype, T, H):
    """out_proj's LoRA shrunk in the gated norm's launch (compact factors, NaN between slots):
    out the plain kernel's bits, the partials summed over heads equal to reference.lora_shrink
    on the rows whose slot is enabled and has out_proj's factors (slots 0 and 2; slot 1 is
    disabled, slot 3's adapter has no out_proj), the other rows left unwritten."""
    D, HID = 20, 24
    slots = [0, 2, NO_SLOT, 1, 3, 0, 2, NO_SLOT][:T]
    info = LoraBatchInfo(
        torch.tensor(slots + [0] * 3, dtype=torch.int32),
        torch.tensor([4, 8, 8, 8], dtype=torch.int32),
        torch.tensor([0.5, 2.0, 1.5, 3.0]),
        torch.tensor([1, 0, 1, 1], dtype=torch.int32),
    )
    ranks = [4, 8, 8, 0]
    torch.manual_seed(T * H)
    dense = lora_weights(4, (), 1, 8, H * D, (HID,), torch.tensor(ranks), dtype)
    lora = compact_weights(dense, ranks)[0]
    x = torch.randn(T, H, D).to(dtype)
    z = torch.randn(T, 5 + H * D).to(dtype)[:, 5:].view(T, H, D)
    weight = (1 + 0.5 * torch.randn(D)).to(dtype)
    out, o = rms_norm_gated_o_shrink(x, z, weight, 1e-6, lora, info)
    assert torch.equal(out, rms_norm_gated(x, z, weight, 1e-6))
    assert o.weights is lora and o.shrunk.shape == (T, H, 1, 8)
    rows = torch.tensor([s in (0, 2) for s in slots])
    got = o.shrunk[rows].sum(dim=1)
    want = reference.lora_shrink(out.reshape(T, -1), lora, info)[rows]
    assert torch.isfinite(got).all(), "a NaN gap was read"
    tol = 1e-5 if dtype == torch.float32 else 1e-3
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    assert got.abs().amax() > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("T,H", [(1, 32), (37, 12)])
def test_delta_gates_matches_reference(poison_empty, dtype, T, H):
    """g and beta from in_proj's a and b slices (strided rows), with a + dt_bias across
    softplus's range: far below float32's epsilon of exp, ordinary, past the threshold 20."""
    y = torch.randn(T, 2 * H + 5)
    y[:, H : 2 * H] = torch.linspace(-40.0, 30.0, T * H).view(T, H)[:, torch.randperm(H)]
    b, a = y.to(dtype)[:, :H], y.to(dtype)[:, H : 2 * H]
    A_log = torch.randn(H).to(dtype)
    dt_bias = (0.5 * torch.randn(H)).to(dtype)
    g, beta = gates.delta_gates(a, b, A_log, dt_bias)
    ref_g, ref_beta = gated_delta.delta_gates(a, b, A_log, dt_bias)
    assert g.dtype == torch.float32 and beta.dtype == dtype
    torch.testing.assert_close(g, ref_g, rtol=1e-6, atol=1e-30)
    torch.testing.assert_close(beta, ref_beta, **TOL[dtype])
