"""Prefill graphs' inputs on the CPU: a prefill or mixed step written into the static buffers of
a larger token count (rows and sequences past the step's padded) computes what the step computes
eagerly. The graphs themselves are captured and replayed on the GPU (tests/gpu)."""

import hf_fixtures as hf
import pytest
import torch

from moelora import LLM, SamplingParams
from moelora.config import prefill_graph_sizes
from moelora.runner.graph_runner import GraphBuffers, GraphRunner
from moelora.step.batch import HostBatch, forward_batch, pages_for
from moelora.step.lora import NO_SLOT


def test_prefill_graph_sizes():
    assert prefill_graph_sizes(0) == [] and prefill_graph_sizes(1) == []
    assert prefill_graph_sizes(2048) == [2048, 1536, 1024, 768, 512, 384, 256, 128, 64, 32, 16]
    assert prefill_graph_sizes(4096)[:3] == [4096, 3072, 2048]  # EngineConfig's default cap
    assert prefill_graph_sizes(600) == [600, 512, 384, 256, 128, 64, 32, 16]
    assert prefill_graph_sizes(10) == [10]


def test_copy_from_pads_rows_and_sequences_apart():
    """A prefill step has fewer sequences than rows: both are padded from their own end, and
    a graph of T rows takes min(T, max_seqs) sequences."""
    buffers = GraphBuffers.init(
        64, max_pages=6, max_loras=2, spare_page=77, device="cpu", max_seqs=8
    )
    g = torch.Generator().manual_seed(0)
    step = HostBatch(
        input_ids=torch.randint(0, 100, (20,), generator=g),
        positions=torch.arange(20),
        slot_mapping=torch.arange(20),
        cu_seqlens_q=torch.tensor([0, 12, 13, 20], dtype=torch.int32),
        seq_lens=torch.tensor([12, 40, 7], dtype=torch.int32),
        page_table=torch.randint(0, 30, (3, 3), generator=g, dtype=torch.int32),
        slot_of_token=torch.randint(-1, 2, (20,), generator=g, dtype=torch.int32),
        slot_enabled=torch.tensor([1, 1], dtype=torch.int32),
        max_query_len=12,
    )
    buffers.copy_from(step)
    fb = buffers.forward_batch(32, pool=None, prefill=True)
    assert fb.input_ids.shape == (32,) and fb.attn.max_query_len > 1 and fb.attn.chunks is None
    assert fb.attn.cu_seqlens_q.tolist() == [0, 12, 13, 20, 20, 20, 20, 20, 20]
    assert fb.attn.seq_lens.tolist() == [12, 40, 7, 0, 0, 0, 0, 0]
    assert torch.equal(fb.attn.page_table[:3, :3], step.page_table)
    assert (fb.attn.page_table[3:] == 77).all()
    assert torch.equal(fb.input_ids[:20], step.input_ids) and (fb.input_ids[20:] == 0).all()
    assert (fb.attn.slot_mapping[20:] == -1).all()
    views = buffers._views(buffers.i64, buffers.i32)
    assert (views["slot_of_token"][20:] == NO_SLOT).all()
    assert buffers.forward_batch(4, pool=None, prefill=True).attn.seq_lens.shape == (4,)


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    root = tmp_path_factory.mktemp("prefill-graph")
    model = hf.make_model("qwen3_moe", root / "model", seed=11)
    adapter = hf.make_per_expert_adapter(
        model,
        root / "a",
        seed=12,
        rank=4,
        alpha=8,
        arch="qwen3_moe",
        attention=("q_proj", "o_proj"),
    )
    llm = LLM(
        str(model),
        lora_modules={"a": str(adapter)},
        device="cpu",
        max_lora_rank=8,
        async_scheduling=False,
    )
    # "a" read from its folder and in a slot: the steps below plan it at once
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=1), lora="a")
    return llm


def uncaptured_graphs(engine, *, max_bs: int, max_seqs: int) -> GraphRunner:
    """The engine's runner's graphs with prefill sizes up to 64 tokens, never captured: what
    run(eager=True) computes on their static inputs is what a replay would."""
    return GraphRunner(
        engine.runner.forward,
        engine.runner.slot_pool,
        max_bs=max_bs,
        max_pages=pages_for(engine.max_model_len, engine.config.page_size),
        spare_page=engine.pages.num_pages,
        device=torch.device("cpu"),
        max_prefill_tokens=64,
        max_seqs=max_seqs,
    )


def test_a_mixed_step_padded_to_a_prefill_graph_computes_the_eager_step(llm):
    """Decodes of base and adapter requests (KV before their rows) beside prompt chunks, run
    eagerly and through the padded static inputs of a 64-row prefill graph."""
    engine = llm.engine
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    for i, (n, lora) in enumerate([(5, None), (9, "a"), (3, "a")]):
        engine.add_request(f"d{i}", list(range(10 + i, 10 + i + n)), greedy, lora)
    engine.step()  # their prompts
    engine.step()  # a decode, so their KV is there
    engine.add_request("p0", list(range(200, 221)), greedy, "a")
    engine.add_request("p1", list(range(50, 58)), greedy, None)
    plan = engine.schedule()
    host = engine.runner.host_batch(plan)
    assert host.max_query_len > 1 and len(plan.chunks) == 5, [c.num_tokens for c in plan.chunks]
    runner = engine.runner
    graphs = uncaptured_graphs(engine, max_bs=4, max_seqs=8)
    assert graphs.can_run(host)
    assert not uncaptured_graphs(engine, max_bs=2, max_seqs=4).can_run(host)  # 5 sequences
    with torch.inference_mode():
        eager = runner.forward(runner.device_batch(host))
        padded = graphs.run(host, eager=True)
    assert padded.shape == eager.shape == (host.num_tokens, eager.shape[1])
    torch.testing.assert_close(padded, eager, atol=1e-5, rtol=1e-5)
    for rid in ("d0", "d1", "d2", "p0", "p1"):
        engine.abort_request(rid)


def test_replay_picks_the_graph_of_the_step_kind_and_padded_size(llm):
    """Decode and prefill graphs of one size are told apart: a replay takes the graph keyed by
    (padded size, stream, prefill). The graphs are stand-ins here (capture needs CUDA)."""
    engine = llm.engine
    graphs = uncaptured_graphs(engine, max_bs=32, max_seqs=32)
    replayed = []

    class Graph:
        def __init__(self, name):
            self.name = name

        def replay(self):
            replayed.append(self.name)

    for size, stream, prefill in [(32, 0, False), (32, 0, True), (16, 0, True)]:
        graphs.graphs[(size, stream, prefill)] = Graph((size, prefill)), torch.zeros(size, 4)
    greedy = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    engine.add_request("r", list(range(30, 50)), greedy)  # 20 tokens: the 32-token prefill graph
    prefill = engine.runner.host_batch(engine.schedule())
    out = graphs.replay_fn(prefill)()
    assert replayed == [(32, True)] and out.shape == (32, 4)
    engine.abort_request("r")


def test_an_eager_step_carries_its_adapters_largest_rank(llm):
    """The step's LoraBatchInfo.rank_tile is the largest real rank among its slots (adapter "a"
    is rank 4 in a rank-8 pool), 0 for a base-only step; a graph's inputs keep 0 (the pool's
    tile, captured once)."""
    engine = llm.engine
    greedy = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    engine.add_request("base", list(range(30, 40)), greedy)
    host = engine.runner.host_batch(engine.schedule())
    assert host.rank_tile == 0
    engine.add_request("adapted", list(range(60, 75)), greedy, "a")
    host = engine.runner.host_batch(engine.schedule())
    assert host.rank_tile == 4
    assert engine.runner.device_batch(host).lora.rank_tile == 4
    graphs = uncaptured_graphs(engine, max_bs=32, max_seqs=32)
    graphs.buffers.copy_from(host)
    assert graphs.buffers.forward_batch(32, graphs.pool, prefill=True).lora.rank_tile == 0
    for rid in ("base", "adapted"):
        engine.abort_request(rid)


def test_an_eager_step_without_an_enabled_slot_runs_without_lora(llm):
    """The host knows a base-only step has no adapter to apply: its eager batch carries no
    LoraBatchInfo (no LoRA launches), and the model's output is the one with the info (every
    slot off) to the bit. A step with an adapter keeps its info."""
    engine, runner = llm.engine, llm.engine.runner
    greedy = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    engine.add_request("base", list(range(30, 40)), greedy)
    host = runner.host_batch(engine.schedule())
    batch = runner.device_batch(host)
    with_info = forward_batch(host.to(runner.device), runner.slot_pool)
    assert batch.lora is None and with_info.lora is not None
    with torch.inference_mode():
        assert torch.equal(runner.forward(batch), runner.forward(with_info))
    engine.add_request("adapted", list(range(60, 75)), greedy, "a")
    host = runner.host_batch(engine.schedule())
    assert runner.device_batch(host).lora is not None
    for rid in ("base", "adapted"):
        engine.abort_request(rid)
