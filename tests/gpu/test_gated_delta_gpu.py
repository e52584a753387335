"""Triton gated DeltaNet kernels (kernels/linear_attention/) on the GPU at Qwen3-Next's
sizes, against the torch references on the GPU, and a decode step under a CUDA graph.

bf16 activations; conv windows in bf16, delta-rule states in float32. The conv and the gated
norm round where the references do, so only another float32 summation order can flip a
rounding: <= 1% of elements differ, the relative error of the whole output <= 1e-2, and the
conv windows written back (copies of inputs) are bit equal. The delta rule's bf16 output:
relative error <= 1e-2; its float32 states within rtol = atol = 1e-3 (another order of the K
sums, and Triton's exp, over up to a few thousand tokens). A fresh sequence's slot holds NaN
(were it read, it would show); the slots outside the batch keep their bits.
Legend: T = tokens, B = sequences, S = state slots, C = conv channels, W = conv taps, Hk = q/k
heads, H = value heads, K / V = key / value head dim.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():  # before any kernel module is imported (see kernels/conftest)
    pytest.skip("needs a CUDA device", allow_module_level=True)
pytest.importorskip("triton")

sys.path.insert(0, str(Path(__file__).parents[1] / "kernels"))
from cuda_graphs import capture  # noqa: E402
from lora_cases import rel_err  # noqa: E402

from moelora.kernels import gated_delta  # noqa: E402
from moelora.kernels.linear_attention import delta_chunked, gates  # noqa: E402
from moelora.kernels.linear_attention.conv import causal_conv1d  # noqa: E402
from moelora.kernels.linear_attention.delta_rule import gated_delta_rule  # noqa: E402
from moelora.kernels.linear_attention.gated_norm import rms_norm_gated  # noqa: E402
from moelora.step.batch import AttentionMetadata  # noqa: E402

DEV = "cuda"
Hk, H, K, V, W = 16, 32, 128, 128, 4  # Qwen3-Next
C = 2 * Hk * K + H * V
EPS = 1e-6
BF16 = torch.bfloat16
CASES = {  # (tokens, starts at position 0) of each sequence
    "decode-1": [(1, False)],
    "decode-1-fresh": [(1, True)],
    "decode-64": [(1, b % 4 == 0) for b in range(64)],
    "prefill-4096": [(1, True), (3, False), (700, True), (3392, False)],
}


def make_attn(q_lens: list[int], seq_lens: list[int], slots: list[int]) -> AttentionMetadata:
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    return AttentionMetadata(
        cu.to(DEV),
        torch.tensor(seq_lens, dtype=torch.int32, device=DEV),
        torch.zeros(len(q_lens), 1, dtype=torch.int32, device=DEV),
        torch.zeros(int(cu[-1]), dtype=torch.int64, device=DEV),
        max(q_lens),
        state_slots=torch.tensor(slots, dtype=torch.int32, device=DEV),
    )


@dataclass(frozen=True)
class Step:
    attn: AttentionMetadata
    rows: int
    slots: list[int]  # of the batch's sequences, permuted
    fresh_slots: list[int]  # of those starting at position 0
    num_slots: int  # S: the batch's, one outside it and the spare


def make_step(case: str, seed: int) -> Step:
    seqs = CASES[case]
    B, S = len(seqs), len(seqs) + 2
    gen = torch.Generator().manual_seed(seed)
    slots = torch.randperm(S - 1, generator=gen)[:B].tolist()
    before = torch.randint(1, 1000, (B,), generator=gen).tolist()
    seq_lens = [n if fresh else n + m for (n, fresh), m in zip(seqs, before)]
    attn = make_attn([n for n, _ in seqs], seq_lens, slots)
    fresh_slots = [s for s, (_, fresh) in zip(slots, seqs) if fresh]
    return Step(attn, sum(n for n, _ in seqs), slots, fresh_slots, S)


def random_states(step: Step, shape: tuple[int, ...], dtype: torch.dtype, gen) -> torch.Tensor:
    states = torch.randn(step.num_slots, *shape, generator=gen, device=DEV).to(dtype)
    states[step.fresh_slots] = float("nan")
    return states


def assert_others_kept(after: torch.Tensor, before: torch.Tensor, step: Step) -> None:
    others = [s for s in range(step.num_slots) if s not in step.slots]
    assert torch.equal(after[others], before[others])


def assert_rounds_alike(out: torch.Tensor, ref: torch.Tensor) -> None:
    assert out.dtype == ref.dtype and out.shape == ref.shape
    differ = (out != ref).float().mean().item()
    assert differ <= 1e-2, f"{differ:.2%} of elements differ"
    assert rel_err(out, ref) <= 1e-2


@pytest.mark.parametrize("case", sorted(CASES))
def test_causal_conv1d_matches_reference(case):
    step = make_step(case, seed=1)
    gen = torch.Generator(device=DEV).manual_seed(1)
    rows = torch.randn(step.rows, C + H * V, generator=gen, device=DEV).to(BF16)
    x = rows[:, :C]  # q|k|v of in_proj's rows, z beside them
    weight = torch.randn(C, W, generator=gen, device=DEV).to(BF16)
    before = random_states(step, (C, W - 1), BF16, gen)
    conv_state, want_state = before.clone(), before.clone()
    out = causal_conv1d(x, weight, conv_state, step.attn)
    want = gated_delta.causal_conv1d(x, weight, want_state, step.attn)
    assert_rounds_alike(out, want)
    assert torch.equal(conv_state[step.slots], want_state[step.slots])
    assert_others_kept(conv_state, before, step)


def delta_inputs(T: int, gen: torch.Generator):
    """q, k [T, Hk, K], v [T, H, V] inside the conv's output rows, g (float32), beta [T, H]."""
    qkv = torch.randn(T, C, generator=gen, device=DEV).to(BF16)
    q, k, v = qkv.split([Hk * K, Hk * K, H * V], dim=-1)
    g = -torch.rand(T, H, generator=gen, device=DEV) * 0.3  # long memories drift the most
    beta = torch.randn(T, 2 * H, generator=gen, device=DEV).to(BF16)[:, :H].sigmoid()
    return q.reshape(T, Hk, K), k.reshape(T, Hk, K), v.reshape(T, H, V), g, beta


@pytest.mark.parametrize("case", sorted(CASES))
def test_gated_delta_rule_matches_reference(case):
    step = make_step(case, seed=2)
    gen = torch.Generator(device=DEV).manual_seed(2)
    args = delta_inputs(step.rows, gen)
    before = random_states(step, (H, K, V), torch.float32, gen)
    state, want_state = before.clone(), before.clone()
    out = gated_delta_rule(*args, state, step.attn)
    want = gated_delta.gated_delta_rule(*args, want_state, step.attn)
    assert out.shape == want.shape and out.dtype == BF16
    assert rel_err(out, want) <= 1e-2
    torch.testing.assert_close(state[step.slots], want_state[step.slots], rtol=1e-3, atol=1e-3)
    assert_others_kept(state, before, step)


@pytest.mark.parametrize("case", sorted(CASES))
def test_gated_delta_rule_computes_its_gates(case):
    """gates=DeltaGates(a, b, A_log, dt_bias), bf16 slices of in_proj's output: the token loop
    gives delta_gates' launch then the rule's bits exactly (the kernels share the arithmetic)."""
    from moelora.kernels.gated_delta import DeltaGates

    step = make_step(case, seed=4)
    gen = torch.Generator(device=DEV).manual_seed(4)
    q, k, v, _, _ = delta_inputs(step.rows, gen)
    y = torch.randn(step.rows, 2 * H + 8, generator=gen, device=DEV).to(BF16)
    A_log, dt_bias = (torch.randn(H, generator=gen, device=DEV).to(BF16) for _ in range(2))
    raw = DeltaGates(y[:, H : 2 * H], y[:, :H], A_log, dt_bias)
    before = random_states(step, (H, K, V), torch.float32, gen)
    state, want_state = before.clone(), before.clone()
    out = gated_delta_rule(q, k, v, None, None, state, step.attn, gates=raw)
    want = gated_delta_rule(q, k, v, *gates.delta_gates(*raw), want_state, step.attn)
    assert torch.equal(out, want) and torch.equal(state, want_state)


@pytest.mark.parametrize(
    "variant",
    [
        {},
        {"prepared": False, "scratch": "float32"},
        {"prepared": True, "scratch": "float32", "num_stages": 1},
    ],
    ids=str,
)
@pytest.mark.parametrize("case", ["prefill-4096"])
def test_chunked_gated_delta_rule_matches_reference(monkeypatch, case, variant):
    """The block form (chunked=True: blocks of 64, tf32 dots) against the token loop: the
    output and the states within 1e-2 relative error; fresh slots' NaN never read. As configured
    (q and k prepared beside w and u, in bf16 rows), with float32 rows unprepared, and prepared
    float32 rows (one stage: ChunkedConfig)."""
    config = replace(delta_chunked.CONFIG, **variant)
    monkeypatch.setattr(delta_chunked, "CONFIG", config)
    step = make_step(case, seed=3)
    gen = torch.Generator(device=DEV).manual_seed(3)
    args = delta_inputs(step.rows, gen)
    before = random_states(step, (H, K, V), torch.float32, gen)
    state, want_state = before.clone(), before.clone()
    out = gated_delta_rule(*args, state, step.attn, chunked=True)
    want = gated_delta.gated_delta_rule(*args, want_state, step.attn)
    assert out.shape == want.shape and out.dtype == BF16 and torch.isfinite(out).all()
    assert rel_err(out, want) <= 1e-2
    assert rel_err(state[step.slots], want_state[step.slots]) <= 1e-2
    assert_others_kept(state, before, step)


def test_chunked_prefill_replays_in_a_cuda_graph():
    """A prefill step of the block form captured once, then replayed with new chunk lengths,
    slots and inputs written in place: each replay equals the eager call."""
    T, B = 1024, 4
    attn = make_attn([T // B] * B, [T // B] * B, [0, 1, 2, 3])
    gen = torch.Generator(device=DEV).manual_seed(4)
    args = delta_inputs(T, gen)
    state = torch.randn(6, H, K, V, generator=gen, device=DEV)

    def step():
        return gated_delta_rule(*args, state, attn, chunked=True)

    graph, out = capture(step)
    cpu = torch.Generator().manual_seed(5)
    for trial in range(3):
        q_lens = torch.randint(1, T // B + 1, (B,), generator=cpu)
        cu = torch.zeros(B + 1, dtype=torch.int32)
        cu[1:] = q_lens.cumsum(0)
        attn.cu_seqlens_q.copy_(cu)
        attn.seq_lens.copy_(q_lens + (torch.arange(B) % 2) * 7)  # odd ones continue a state
        attn.state_slots.copy_(torch.randperm(5, generator=cpu)[:B])
        for t in args:
            t.copy_(torch.randn(t.shape, generator=cpu).to(t.dtype).to(DEV))
        args[3].copy_(-args[3].abs() * 0.3)  # log decays <= 0
        args[4].copy_(args[4].float().sigmoid())  # beta in (0, 1)
        before = torch.randn(state.shape, generator=cpu).to(DEV)
        state.copy_(before)
        graph.replay()
        torch.cuda.synchronize()
        replayed, after = out.clone(), state.clone()
        state.copy_(before)
        assert torch.equal(replayed, step()), f"trial {trial}: the replay differs from eager"
        assert torch.equal(after, state), f"trial {trial}: the states differ"


@pytest.mark.parametrize("T", [1, 64, 4096])
def test_rms_norm_gated_matches_reference(T):
    gen = torch.Generator(device=DEV).manual_seed(T)
    x = torch.randn(T * H, V, generator=gen, device=DEV).to(BF16)
    gate = torch.randn(T * H, 2 * V, generator=gen, device=DEV).to(BF16)[:, V:]  # rows strided
    weight = (1 + 0.5 * torch.randn(V, generator=gen, device=DEV)).to(BF16)
    out = rms_norm_gated(x, gate, weight, EPS)
    assert_rounds_alike(out, gated_delta.rms_norm_gated(x, gate, weight, EPS))


@pytest.mark.parametrize("T", [1, 64, 4096])
def test_gates_and_head_rows_match_reference(T):
    """delta_gates from in_proj's a and b slices, and the gated norm over [T, H, V] rows with
    z viewed in place, in bf16 against the references."""
    gen = torch.Generator(device=DEV).manual_seed(T + 1)
    y = torch.randn(T, 2 * H + H * V, generator=gen, device=DEV).to(BF16)
    b, a, z = y[:, :H], y[:, H : 2 * H], y[:, 2 * H :].view(T, H, V)
    A_log = torch.randn(H, generator=gen, device=DEV).to(BF16)
    dt_bias = torch.randn(H, generator=gen, device=DEV).to(BF16)
    g, beta = gates.delta_gates(a, b, A_log, dt_bias)
    ref_g, ref_beta = gated_delta.delta_gates(a, b, A_log, dt_bias)
    torch.testing.assert_close(g, ref_g, rtol=1e-5, atol=1e-6)
    assert_rounds_alike(beta, ref_beta)
    x = torch.randn(T, H, V, generator=gen, device=DEV).to(BF16)
    weight = (1 + 0.5 * torch.randn(V, generator=gen, device=DEV)).to(BF16)
    out = rms_norm_gated(x, z, weight, EPS)
    assert_rounds_alike(out, gated_delta.rms_norm_gated(x, z, weight, EPS))


@dataclass(frozen=True)
class DecodeBuffers:
    """A captured decode step's inputs at B sequences, written in place before each replay."""

    attn: AttentionMetadata
    x: torch.Tensor  # [B, C]
    weight: torch.Tensor  # [C, W]
    g: torch.Tensor  # [B, H] float32
    beta: torch.Tensor  # [B, H]
    z: torch.Tensor  # [B H, V]
    norm_weight: torch.Tensor  # [V]
    conv_state: torch.Tensor  # [S, C, W - 1]
    state: torch.Tensor  # [S, H, K, V] float32

    def step(self) -> tuple[torch.Tensor, ...]:
        """The layer's three kernels: conv, delta rule over the conv's q|k|v, gated norm."""
        B = self.x.shape[0]
        y = causal_conv1d(self.x, self.weight, self.conv_state, self.attn)
        q, k, v = y.split([Hk * K, Hk * K, H * V], dim=-1)
        qkv = q.reshape(B, Hk, K), k.reshape(B, Hk, K), v.reshape(B, H, V)
        o = gated_delta_rule(*qkv, self.g, self.beta, self.state, self.attn)
        return y, o, rms_norm_gated(o.reshape(B * H, V), self.z, self.norm_weight, EPS)


def decode_buffers(B: int, S: int, seed: int) -> DecodeBuffers:
    gen = torch.Generator(device=DEV).manual_seed(seed)
    seqs = torch.arange(B, dtype=torch.int32)
    attn = make_attn([1] * B, [5] * B, seqs.tolist())

    def randn(*shape, dtype=BF16):
        return torch.randn(*shape, generator=gen, device=DEV).to(dtype)

    return DecodeBuffers(
        attn=attn,
        x=randn(B, C),
        weight=randn(C, W),
        g=-torch.rand(B, H, generator=gen, device=DEV),
        beta=randn(B, H).sigmoid(),
        z=randn(B * H, V),
        norm_weight=randn(V),
        conv_state=randn(S, C, W - 1),
        state=randn(S, H, K, V, dtype=torch.float32),
    )


def test_decode_step_replays_in_a_cuda_graph():
    """The decode step captured at B = 64, replayed with new slots (permuted), lengths (some
    sequences fresh), inputs and states, and a padded tail as the graph runner writes it (4
    sequences with no rows, seq_len 0, the spare slot): the eager call's bits, zeros in the
    padded rows, the spare slot untouched."""
    B, real, S = 64, 60, 64 + 2
    spare = S - 1
    buf = decode_buffers(B, S, seed=1)
    graph, outs = capture(buf.step)
    gen = torch.Generator().manual_seed(3)
    cu = torch.arange(B + 1, dtype=torch.int32).clamp(max=real)
    seq_lens = torch.randint(1, 1000, (B,), generator=gen, dtype=torch.int32)
    seq_lens[::5], seq_lens[real:] = 1, 0
    slots = torch.cat([torch.randperm(spare, generator=gen)[:real], torch.full((B - real,), spare)])
    buf.attn.cu_seqlens_q.copy_(cu)
    buf.attn.seq_lens.copy_(seq_lens)
    buf.attn.state_slots.copy_(slots)
    new = decode_buffers(B, S, seed=2)  # other values, the same shapes
    for name in ("x", "g", "beta", "z", "conv_state", "state"):
        getattr(buf, name).copy_(getattr(new, name))
    graph.replay()
    got = [t.clone() for t in (*outs, buf.conv_state, buf.state)]
    buf.conv_state.copy_(new.conv_state)
    buf.state.copy_(new.state)
    want = [*buf.step(), buf.conv_state, buf.state]
    for name, a, b in zip(("conv", "delta", "norm", "conv_state", "state"), got, want):
        assert torch.equal(a, b), name
    assert not got[0][real:].any() and not got[1][real:].any()
    assert torch.equal(got[3][spare], new.conv_state[spare])
    assert torch.equal(got[4][spare], new.state[spare])


@pytest.mark.parametrize("spread", ["none", "mixed", "distinct"])
@pytest.mark.parametrize("T", [1, 64, 256])
def test_rms_norm_gated_o_shrink_gpu(T, spread):
    """out_proj's LoRA shrunk in the gated norm's launch, bf16 at Qwen3.5's sizes (32 value
    heads of 128, hidden 2048, 8 slots of ranks 0-16): out the plain kernel's bits, the
    partials summed over heads within float32 summation order of reference.lora_shrink on
    the rows with out_proj's factors; under a CUDA graph replayed with new slots, eager's."""
    from lora_cases import batch_info, lora_weights

    from moelora.kernels import reference
    from moelora.kernels.linear_attention.gated_norm import rms_norm_gated_o_shrink

    H, V, HID = 32, 128, 2048
    info = batch_info(T, spread, "cuda")
    lora = lora_weights(8, (), 1, 16, H * V, (HID,), info.rank_of_slot, torch.bfloat16, "cuda")
    g = torch.Generator(device="cuda").manual_seed(T)
    x = torch.randn(T, H, V, generator=g, device="cuda", dtype=torch.bfloat16)
    z = torch.randn(T, H, V, generator=g, device="cuda", dtype=torch.bfloat16)
    weight = (1 + 0.5 * torch.randn(V, generator=g, device="cuda")).bfloat16()

    def step():
        out, o = rms_norm_gated_o_shrink(x, z, weight, EPS, lora, info)
        return out, o.shrunk

    out, part = step()
    assert torch.equal(out, rms_norm_gated(x, z, weight, EPS))
    want = reference.lora_shrink(out.reshape(T, -1), lora, info)
    rows = want.abs().sum(dim=(1, 2)) > 0
    if rows.any():
        assert rel_err(part[rows].sum(dim=1), want[rows]) <= 1e-4
    graph, (out_g, part_g) = capture(step)
    info.slot_of_token.copy_(info.slot_of_token.flip(0))
    x.normal_()
    graph.replay()
    out_e, part_e = step()
    assert torch.equal(out_g, out_e)
    rows = reference.lora_shrink(out_e.reshape(T, -1), lora, info).abs().sum(dim=(1, 2)) > 0
    assert torch.equal(part_g[rows], part_e[rows])
