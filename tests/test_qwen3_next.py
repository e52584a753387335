"""Qwen3-Next and Qwen3.5-MoE against transformers(+PEFT), fp32 on the CPU: greedy tokens equal,
logprobs within LOGPROB_TOL (models, adapters and why: qwen3_next_fixtures.py). Then what their
parts must keep: the delta-rule and conv references equal transformers' torch fallbacks with states
carried between calls by slot, chunked prefill carries the recurrent state (prompts longer than
a chunk, and than a 64-token delta-rule block), preemption recomputes the same tokens, every
state slot and page goes back, prefix caching keeps state snapshots (off without any), the GPU
kernel table refuses them, and the named shapes read."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING

import hf_fixtures as hf
import pytest
import qwen3_next_fixtures as qf
import torch
from family_fixtures import FamilyFixtures, assert_not_degenerate, assert_same, run_greedy
from test_vs_transformers import assert_matches, greedy_params

from moelora import LLM
from moelora.server.metrics import ServerMetrics

if TYPE_CHECKING:
    from conftest import FixtureBank

MAX_LORA_RANK = 8
MAX_NUM_SEQS = 4  # fewer state slots than the 5 requests of a batch: admission waits for one
# longer than a 64-token block of the chunked delta rule, and than every chunk size below
LONG_PROMPT = [(37 * i + 11) % 250 + 1 for i in range(90)]


@pytest.fixture(scope="module")
def fx(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> FamilyFixtures:
    return FamilyFixtures(
        tmp_path_factory.mktemp("qwen3_next"),
        qf,
        request.config.getoption("--moelora-device"),
        max_loras=2,
        max_lora_rank=MAX_LORA_RANK,
        max_num_seqs=MAX_NUM_SEQS,
    )


def _assert_same(got, want) -> None:
    # 1e-4: the CPU's matmuls round by row count, and the recurrent state carries that from
    # token to token (a chunked run moves a logprob by about 2e-5)
    assert_same(got, want, 1e-4)


def _assert_idle(llm: LLM) -> None:
    """Every state slot, page and adapter slot reference is back."""
    stats = llm.engine.stats()
    assert stats.state_slots_used == 0 and stats.state_slots_total == MAX_NUM_SEQS
    assert stats.kv_pages_used == 0 and stats.lora_slot_refs == 0


MIXED = ["a", None, "b", "a", None]


# ---------------------------------------------------------------------------------------------
# The engine against transformers(+PEFT)


@pytest.mark.parametrize("arch", qf.ARCHS)
def test_references_are_not_degenerate(bank: FixtureBank, fx: FamilyFixtures, arch: str) -> None:
    """Each adapter changes the greedy tokens; no near ties that would make greedy fragile."""
    assert_not_degenerate(bank, fx, arch)


@pytest.mark.parametrize(
    "loras", [[None] * 5, ["a"] * 5, ["b"] * 5, MIXED], ids=["base", "a", "b", "mixed"]
)
@pytest.mark.parametrize("arch", qf.ARCHS)
def test_equals_transformers(
    bank: FixtureBank, fx: FamilyFixtures, arch: str, loras: list[str | None]
) -> None:
    refs = fx.reference(bank, arch, loras)
    llm = fx.llm(arch)
    outs = run_greedy(llm, loras)
    assert_matches(bank, outs, refs, hf.PROMPTS, f"{arch} {loras}", qf.LOGPROB_TOL)
    _assert_idle(llm)


@pytest.mark.parametrize("arch", qf.ARCHS)
def test_the_adapters_cover_every_target(fx: FamilyFixtures, arch: str) -> None:
    """Between them the two adapters put a non-zero B on every slice of every target: the
    DeltaNet's input projections (each a slice of in_proj) and out_proj, the gated attention's
    q (its gate included), k, v, o, the shared experts, the dense MLP and the experts; a alone
    on every projection of both attentions."""

    targets = fx.llm(arch).engine.lora_targets
    kinds = {key.split(".", 2)[2] for key in targets}
    dense = {"mlp.gate_up", "mlp.down"} if arch == "qwen3_next" else set()
    attention = {"in_proj", "out_proj", "qkv", "o"}
    assert kinds == attention | {"shared.gate_up", "shared.down", "experts13", "experts2"} | dense
    in_proj = targets["layers.0.in_proj"].out_slices
    assert len(in_proj) == (2 if arch == "qwen3_next" else 4)
    assert targets["layers.3.qkv"].out_slices == (2 * 4 * 16, 2 * 16, 2 * 16)
    covered = fx.covered(arch, targets, MAX_LORA_RANK)
    assert covered["a"] | covered["b"] == set(targets)
    assert {k for k in targets if k.split(".", 2)[2] in attention} <= covered["a"]


@pytest.mark.parametrize("arch", qf.ARCHS)
def test_chunked_prefill_and_preemption(bank: FixtureBank, fx: FamilyFixtures, arch: str) -> None:
    """4-token prefill chunks (each chunk's conv window and delta-rule state carried from the
    one before), and a cache of 10 pages of 4 tokens that must preempt and recompute: the
    unchunked run's tokens and logprobs, and transformers'. Every state slot comes back."""
    refs = fx.reference(bank, arch, MIXED)
    whole = run_greedy(fx.llm(arch), MIXED)
    chunked_llm = fx.llm(arch, max_num_batched_tokens=4)
    chunked = run_greedy(chunked_llm, MIXED)
    _assert_same(chunked, whole)
    assert_matches(bank, chunked, refs, hf.PROMPTS, f"{arch} chunked", qf.LOGPROB_TOL)
    _assert_idle(chunked_llm)
    tight = fx.llm(arch, page_size=4, num_pages=10)
    preempted = run_greedy(tight, MIXED)
    _assert_same(preempted, whole)
    assert_matches(bank, preempted, refs, hf.PROMPTS, f"{arch} preempted", qf.LOGPROB_TOL)
    assert tight.engine.scheduler.num_preemptions > 0
    _assert_idle(tight)


@pytest.mark.parametrize("prefill", ["recurrent", "chunked"])
@pytest.mark.parametrize("arch", qf.ARCHS)
def test_a_long_prompt_in_chunks_of_48(
    bank: FixtureBank, fx: FamilyFixtures, arch: str, prefill: str
) -> None:
    """A 90-token prompt (two 64-token blocks of the chunked delta rule) beside a short one,
    prefilled whole and in chunks of 48 tokens (a state carried across a block's middle):
    the same tokens as transformers. linear_attention_prefill="chunked" takes the delta
    rule's block form on the GPU (the CPU's reference runs the token loop either way)."""
    prompts, loras = [LONG_PROMPT, hf.PROMPTS[1]], ["b", "a"]
    refs = fx.reference(bank, arch, loras, prompts=prompts)
    whole = run_greedy(fx.llm(arch, linear_attention_prefill=prefill), loras, prompts)
    assert_matches(bank, whole, refs, prompts, f"{arch} long prompt", qf.LOGPROB_TOL)
    llm = fx.llm(arch, linear_attention_prefill=prefill, max_num_batched_tokens=48)
    _assert_same(run_greedy(llm, loras, prompts), whole)


@pytest.mark.parametrize("arch", qf.ARCHS)
def test_prefix_caching_keeps_state_snapshots(
    fx: FamilyFixtures, arch: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A hybrid model's engine says how many state snapshots its prefix cache keeps, and the
    same prompt again is a hit (test_hybrid_prefix_cache.py tests hits in depth). With
    max_state_snapshots=0 it says prefix caching is off and caches no page."""
    with caplog.at_level("INFO", logger="moelora.engine.build"):
        llm = fx.llm(arch, page_size=4)
    assert "recurrent-state slots" in caplog.text
    assert f"keeps up to {MAX_NUM_SEQS} recurrent-state snapshots" in caplog.text
    prompts = [LONG_PROMPT[:40]] * 2
    first = run_greedy(llm, [None, "a"], prompts, max_tokens=2)
    again = run_greedy(llm, [None, "a"], prompts, max_tokens=2)
    assert [o.num_cached_tokens for o in again] == [36, 36]
    _assert_same(again, first)
    stats = llm.engine.stats()  # and /metrics says so
    lines = ServerMetrics().render(stats, num_loras=2).splitlines()
    assert stats.state_snapshots_cached > 0 and stats.state_slots_used == 0
    assert f"moelora_state_snapshots_cached {stats.state_snapshots_cached}" in lines
    assert f"moelora_state_slots_total {MAX_NUM_SEQS}" in lines
    assert "moelora_state_slots_used 0" in lines
    caplog.clear()
    with caplog.at_level("INFO", logger="moelora.engine.build"):
        off = fx.llm(arch, page_size=4, max_state_snapshots=0)
    assert "prefix caching is off: max_state_snapshots=0" in caplog.text
    run_greedy(off, [None], prompts[:1], max_tokens=2)
    again = run_greedy(off, [None], prompts[:1], max_tokens=2)
    assert again[0].num_cached_tokens == 0 and off.engine.stats().kv_pages_cached == 0
    _assert_same(again, first[:1])


def test_a_multimodal_checkpoint_serves_its_text_model(bank: FixtureBank, tmp_path: Path) -> None:
    """A Qwen3_5MoeForConditionalGeneration folder: its text_config read, its language model's
    weights loaded (the vision tower's skipped), and its greedy tokens transformers' (which
    builds the whole multimodal model) for text prompts."""
    model = qf.make_multimodal_model(tmp_path / "multimodal", seed=4)
    llm = LLM(str(model), device="cpu", dtype="float32", enable_lora=False)
    prompts = hf.PROMPTS[:3]
    got = llm.generate(prompts, greedy_params(6))
    refs = bank.reference(model, prompts, [None] * 3, max_tokens=6)
    assert_matches(bank, got, refs, prompts, "Qwen3_5MoeForConditionalGeneration", qf.LOGPROB_TOL)


# ---------------------------------------------------------------------------------------------
# The parts


def _attn(q_lens: list[int], kv_lens: list[int], slots: list[int]):
    from moelora.step.batch import AttentionMetadata

    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    T = int(cu[-1])
    return AttentionMetadata(
        cu,
        torch.tensor(kv_lens, dtype=torch.int32),
        torch.zeros(len(q_lens), 1, dtype=torch.int32),
        torch.zeros(T, dtype=torch.int64),
        max(q_lens),
        state_slots=torch.tensor(slots, dtype=torch.int32),
    )


def test_the_delta_rule_equals_transformers_with_states_by_slot() -> None:
    """Three sequences of 70, 5 and 1 tokens (q/k heads serving two value heads each), run
    by gated_delta_rule in pieces: a first prefill chunk, an extend from the slot's state, then
    two decode steps of all three at once. Each piece's output equals transformers' torch
    recurrent delta rule over the whole sequence, and the slots end holding its final state;
    a slot's stale values never leak into a sequence that starts at position 0."""
    from transformers.models.qwen3_next.modeling_qwen3_next import (
        torch_recurrent_gated_delta_rule,
    )

    from moelora.kernels.gated_delta import gated_delta_rule

    gen = torch.Generator().manual_seed(5)
    Hk, H, K, V, lens, slots = 2, 4, 8, 12, [70, 5, 1], [2, 0, 3]
    seqs = []
    for n in [L + 2 for L in lens]:  # two decode tokens after each prompt
        q, k = torch.randn(n, Hk, K, generator=gen), torch.randn(n, Hk, K, generator=gen)
        v = torch.randn(n, H, V, generator=gen)
        g = -torch.rand(n, H, generator=gen) * 0.3
        beta = torch.rand(n, H, generator=gen)
        seqs.append((q, k, v, g, beta))
    state = torch.randn(5, H, K, V, generator=gen)  # stale values in every slot
    pieces = [(0, [40, 5, 1]), (40, [30, 0, 0]), (None, [1, 1, 1]), (None, [1, 1, 1])]
    done = [0, 0, 0]
    for _, q_lens in pieces:
        rows = [b for b, n in enumerate(q_lens) if n]
        parts = [[t[done[b] : done[b] + q_lens[b]] for t in seqs[b]] for b in rows]
        args = [torch.cat([p[i] for p in parts]) for i in range(5)]
        kv_lens = [done[b] + q_lens[b] for b in rows]
        attn = _attn([q_lens[b] for b in rows], kv_lens, [slots[b] for b in rows])
        out = gated_delta_rule(*args, state, attn)
        row = 0
        for b in rows:
            want = _transformers_delta(
                torch_recurrent_gated_delta_rule, seqs[b], done[b] + q_lens[b]
            )
            n = q_lens[b]
            torch.testing.assert_close(out[row : row + n], want[0][done[b] :], rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(state[slots[b]], want[1], rtol=1e-4, atol=1e-5)
            row += n
            done[b] += n


def test_the_chunked_form_equals_the_token_loop() -> None:
    """chunked_delta_rule (the block form a prefill kernel takes) over 150 tokens from a
    random state: transformers' chunked rule's output and final state, and gated_delta_rule's
    token loop's, within float rounding."""
    from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule

    from moelora.kernels.gated_delta import _l2norm, chunked_delta_rule, gated_delta_rule

    gen = torch.Generator().manual_seed(7)
    L, H, K, V = 150, 2, 8, 12
    q, k = torch.randn(L, H, K, generator=gen), torch.randn(L, H, K, generator=gen)
    v, s0 = torch.randn(L, H, V, generator=gen), torch.randn(H, K, V, generator=gen)
    g, beta = -torch.rand(L, H, generator=gen) * 0.3, torch.rand(L, H, generator=gen)
    out, s = chunked_delta_rule(_l2norm(q) * K**-0.5, _l2norm(k), v, g, beta, s0)
    want, want_s = torch_chunk_gated_delta_rule(
        *(t[None] for t in (q, k, v, g, beta)),
        initial_state=s0[None],
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )
    torch.testing.assert_close(out, want[0], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(s, want_s[0], rtol=1e-4, atol=1e-5)
    state = torch.stack([torch.randn(H, K, V, generator=gen), s0])
    loop = gated_delta_rule(q, k, v, g, beta, state, _attn([L], [L + 1], [1]))  # from s0
    torch.testing.assert_close(loop, out, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(state[1], s, rtol=1e-4, atol=1e-5)


def _transformers_delta(fn, seq, n: int):
    """transformers' (out [n, H, V], final state [H, K, V]) of a sequence's first n tokens."""
    q, k, v, g, beta = (t[None, :n] for t in seq)
    groups = v.shape[2] // q.shape[2]
    q, k = (t.repeat_interleave(groups, dim=2) for t in (q, k))
    out, s = fn(q, k, v, g, beta, output_final_state=True, use_qk_l2norm_in_kernel=True)
    return out[0], s[0]


def test_the_conv_equals_transformers_with_windows_by_slot() -> None:
    """causal_conv1d over a 6-token prefill chunk, a 2-token extend and a decode step of two
    sequences at once (one of them starting at position 0 in a slot with stale values): the
    outputs of transformers' causal_conv1d_fn over each whole sequence."""
    from transformers.models.qwen3_next.modeling_qwen3_next import causal_conv1d_fn

    from moelora.kernels.gated_delta import causal_conv1d

    gen = torch.Generator().manual_seed(6)
    C, W = 10, 4
    weight = torch.randn(C, W, generator=gen)
    xs = [torch.randn(9, C, generator=gen), torch.randn(1, C, generator=gen)]
    conv_state = torch.randn(3, C, W - 1, generator=gen)
    want = [causal_conv1d_fn(x.T[None], weight, None, activation="silu")[0].T for x in xs]
    got = causal_conv1d(xs[0][:6], weight, conv_state, _attn([6], [6], [1]))
    torch.testing.assert_close(got, want[0][:6], rtol=1e-5, atol=1e-6)
    got = causal_conv1d(xs[0][6:8], weight, conv_state, _attn([2], [8], [1]))
    torch.testing.assert_close(got, want[0][6:8], rtol=1e-5, atol=1e-6)
    step = torch.cat([xs[0][8:9], xs[1]])
    got = causal_conv1d(step, weight, conv_state, _attn([1, 1], [9, 1], [1, 0]))
    torch.testing.assert_close(got, torch.cat([want[0][8:9], want[1]]), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(conv_state[1], xs[0][6:].T)


def test_the_gpu_kernel_table_takes_qwen3_5_and_several_ranks_refuse_them(
    fx: FamilyFixtures,
) -> None:
    from moelora.errors import ModelConfigError
    from moelora.kernels.ops import REFERENCE_OPS
    from moelora.models.model import check_kernels
    from moelora.models.registry import read_model_config
    from moelora.parallel import Shard

    for arch in qf.ARCHS:
        mc, _ = read_model_config(str(fx.model(arch)))
        check_kernels(mc, REFERENCE_OPS)
        check_kernels(mc, dataclasses.replace(REFERENCE_OPS, name="triton-x"))
        two = dataclasses.replace(REFERENCE_OPS, shard=Shard(rank=0, size=2))
        with pytest.raises(ModelConfigError, match=r"tensor_parallel_size=2 is not supported"):
            check_kernels(mc, two)


@pytest.mark.parametrize(
    "name,layers,linear,experts,top_k",
    [("qwen3.5-moe-35b-a3b", 40, 30, 256, 8), ("qwen3-next-80b-a3b", 48, 36, 512, 10)],
)
def test_the_named_shapes(tmp_path: Path, name, layers, linear, experts, top_k) -> None:
    """The named shapes read as the issue's configs; a state slot of the 35B's holds 30 layers'
    conv windows (bf16) and float32 delta-rule states: 30 x (8192 x 3 x 2 + 32 x 128 x 128 x 4)
    bytes, and a KV page only its 10 attention layers'."""
    from moelora.engine.kv_cache import page_bytes
    from moelora.models.registry import read_model_config
    from moelora.models.shapes import shape_config, write_config_folder

    mc, _ = read_model_config(str(write_config_folder(shape_config(name), tmp_path)))
    assert (mc.num_layers, sum(mc.linear_attention.layers), mc.num_experts, mc.top_k) == (
        layers,
        linear,
        experts,
        top_k,
    )
    assert mc.linear_attention.layers[:4] == (True, True, True, False)
    assert (mc.hidden_size, mc.rotary_dim, mc.shared_expert_intermediate_size) == (2048, 64, 512)
    per_layer = 8192 * 3 * 2 + 32 * 128 * 128 * 4
    assert mc.state_slot_bytes(torch.bfloat16) == linear * per_layer
    assert page_bytes(mc, 16, torch.bfloat16) == (layers - linear) * 16 * 2 * 2 * 256 * 2
