"""Tensor and expert parallelism on the CPU (gloo, two ranks): the same greedy tokens as one rank
in fp32, for every architecture, with mixed batches of base requests and adapters of different
ranks (target_parameters and per-expert), a live load_lora / unload_lora and an abort; bad
sizes refused with the numbers named; a dead worker failing the engine at once.

Engines are shared per module: one rank-1 engine and one TP=2 and one EP=2 engine per
architecture. A worker starts in well under a second once the first engine has started the fork
server; the whole module takes ~25 s beside the fixtures on two cores.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import pickle
import signal
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import hf_fixtures as hf
import pytest
import test_gpt_oss as gpt_oss
import torch

from moelora import LLM, SamplingParams
from moelora.config import EngineConfig
from moelora.errors import ConfigError, EngineDeadError
from moelora.models.registry import read_model_config
from moelora.models.shard import check_divides
from moelora.runner.tp import ClearSlot

if TYPE_CHECKING:
    from conftest import FixtureBank

MAX_TOKENS = 5
MODES = {
    "tp1": {},
    "tp2": {"tensor_parallel_size": 2},
    "ep2": {"tensor_parallel_size": 2, "enable_expert_parallel": True},
}
# base, the rank-8 target_parameters adapter and the rank-4 per-expert adapter, mixed
LORAS = [None, "a", "b", None, "a"]
BENCH_COMMON = Path(__file__).resolve().parents[1] / "bench" / "common.py"


def greedy(max_tokens: int = MAX_TOKENS) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


class Engines:
    """An LLM per (arch, mode), built on first use, all closed at the module's end."""

    def __init__(self, bank: FixtureBank) -> None:
        self.bank = bank
        self.llms: dict[tuple[str, str], LLM] = {}

    def get(self, arch: str, mode: str) -> LLM:
        if (arch, mode) not in self.llms:
            bank = self.bank
            if arch == "gpt_oss":  # test_gpt_oss's model and adapters (built once a session)
                path, loras = gpt_oss.model(bank), gpt_oss.adapters(bank)
            else:
                path = bank.model(arch)
                loras = {"a": bank.peft_adapter(arch), "b": bank.per_expert_adapter(arch)}
            self.llms[arch, mode] = LLM(
                str(path),
                lora_modules={k: str(v) for k, v in loras.items()},
                dtype="float32",
                device="cpu",
                max_loras=2,  # three adapters below: slots are evicted and filled again
                max_lora_rank=8,
                num_pages=64,
                **MODES[mode],
            )
        return self.llms[arch, mode]

    def close(self) -> None:
        for llm in self.llms.values():
            llm.engine.close()


@pytest.fixture(scope="module")
def engines(bank: FixtureBank):
    found = Engines(bank)
    yield found
    found.close()


def tokens(llm: LLM, prompts, loras) -> list[list[int]]:
    return [list(o.token_ids) for o in llm.generate(prompts, greedy(), lora=loras)]


@pytest.mark.parametrize("mode", ["tp2", "ep2"])
@pytest.mark.parametrize("arch", [*hf.ARCHS, "gpt_oss"])
def test_mixed_batch_matches_one_rank(engines: Engines, arch: str, mode: str) -> None:
    want = tokens(engines.get(arch, "tp1"), hf.PROMPTS, LORAS)
    assert tokens(engines.get(arch, mode), hf.PROMPTS, LORAS) == want


@pytest.mark.parametrize("mode", ["tp2", "ep2"])
def test_logprobs_and_prompt_logprobs_match_one_rank(engines: Engines, mode: str) -> None:
    """The gathered logits themselves, not only their argmax: prompt windows and sampled rows."""
    params = SamplingParams(max_tokens=3, temperature=0.0, logprobs=2, prompt_logprobs=2)
    loras = [None, "b", "a"]
    want = engines.get("qwen2_moe", "tp1").generate(hf.PROMPTS[:3], params, lora=loras)
    got = engines.get("qwen2_moe", mode).generate(hf.PROMPTS[:3], params, lora=loras)
    for w, g in zip(want, got):
        assert list(g.token_ids) == list(w.token_ids)
        assert len(g.prompt_logprobs) == len(w.prompt_logprobs) > 1
        for mine, theirs in [
            *zip(g.logprobs, w.logprobs),
            *zip(g.prompt_logprobs, w.prompt_logprobs),
        ]:
            assert (mine is None) == (theirs is None)
            if mine is not None:
                assert mine.keys() == theirs.keys()
                assert all(abs(mine[t] - theirs[t]) < 1e-5 for t in mine)


@pytest.mark.parametrize(
    "arch,layout,shards", [("mixtral", "fused", 2), ("qwen3_moe", "per_expert", 3)]
)
def test_checkpoint_layouts_load_sharded(
    bank: FixtureBank, engines: Engines, arch: str, layout: str, shards: int
) -> None:
    """Fused 3D experts, per-expert tensors, a parameter's tensors spread over files: each rank
    streams the checkpoint into its part (models/shard.load_shard) and gives one rank's tokens."""
    want = tokens(engines.get(arch, "tp1"), hf.PROMPTS, [None] * len(hf.PROMPTS))
    path = bank.layout(arch, layout, shards)
    llm = LLM(
        str(path),
        dtype="float32",
        device="cpu",
        num_pages=64,
        enable_lora=False,
        tensor_parallel_size=2,
    )
    try:
        assert tokens(llm, hf.PROMPTS, [None] * len(hf.PROMPTS)) == want
    finally:
        llm.close()


@pytest.mark.parametrize("mode", ["tp2", "ep2"])
def test_benchmark_hooks_run_on_every_rank(engines: Engines, mode: str) -> None:
    """bench/common.py's PlannedStep.logits_fn (what bench/ times) on several ranks: the same
    logits as one rank."""
    spec = importlib.util.spec_from_file_location("bench_common", BENCH_COMMON)
    bench = sys.modules.setdefault("bench_common", importlib.util.module_from_spec(spec))
    spec.loader.exec_module(bench)
    found = []
    for llm in (engines.get("mixtral", "tp1"), engines.get("mixtral", mode)):
        engine = llm.engine
        for i, (prompt, lora) in enumerate(zip(hf.PROMPTS[:3], [None, "a", "b"])):
            engine.add_request(f"hook-{i}", prompt, greedy(), lora)
        step = bench.plan_step(engine)
        found.append((step.logits_fn(eager=True)(), step.forward_fn(eager=True)()))
        for request_id in step.request_ids:
            engine.abort_request(request_id)
    (want, want_hidden), (got, got_hidden) = found
    assert got.shape == want.shape and got_hidden.shape == want_hidden.shape
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)
    torch.testing.assert_close(got_hidden, want_hidden, rtol=0, atol=1e-4)


def _lifecycle(llm: LLM, bank: FixtureBank, arch: str) -> list[list[int]]:
    """Generations around a live load and unload (a third adapter, a third rank) and an abort
    of a running request; every token the engine gave, in order."""
    engine = llm.engine
    extra = bank.adapter(
        f"tp-rank2-{arch}",
        lambda p: hf.make_per_expert_adapter(
            bank.model(arch), p, seed=5, rank=2, alpha=4, arch=arch, attention=("k_proj", "o_proj")
        ),
    )
    got = tokens(llm, hf.PROMPTS[:3], ["a", None, "b"])
    llm.engine.load_lora("c", str(extra))
    got += tokens(llm, hf.PROMPTS[:4], ["c", "a", "b", "c"])
    for i, (prompt, lora) in enumerate(zip(hf.PROMPTS[:3], ["c", "b", None])):
        engine.add_request(f"abort-{i}", prompt, greedy(8), lora)
    outs: dict[str, list[int]] = {}
    for step in range(12):
        if step == 3:
            engine.abort_request("abort-1")
        for out in engine.step():
            outs[out.request_id] = list(out.token_ids)
        if not engine.has_unfinished_requests():
            break
    got += [outs[f"abort-{i}"] for i in (0, 2)]
    engine.unload_lora("c")
    got += tokens(llm, hf.PROMPTS[2:], ["b", None, "a"])
    return got


@pytest.mark.parametrize("mode", ["tp2", "ep2"])
def test_load_unload_and_abort_match_one_rank(
    bank: FixtureBank, engines: Engines, mode: str
) -> None:
    want = _lifecycle(engines.get("qwen3_moe", "tp1"), bank, "qwen3_moe")
    got = _lifecycle(engines.get("qwen3_moe", mode), bank, "qwen3_moe")
    assert got == want


def test_a_killed_worker_fails_the_next_step_at_once(engines: Engines) -> None:
    """It kills the mixtral EP engine's worker: no test after it uses that engine (nor the
    qwen2_moe and olmoe EP engines after the two tests below, which end theirs)."""
    llm = engines.get("mixtral", "ep2")
    (worker,) = llm.engine.workers.processes
    os.kill(worker.pid, signal.SIGKILL)
    worker.join(10)
    start = time.monotonic()
    with pytest.raises(EngineDeadError, match=rf"rank 1 \(pid {worker.pid}\) exited with code -9"):
        tokens(llm, hf.PROMPTS[:2], [None, "a"])
    with pytest.raises(EngineDeadError):  # and it stays dead
        tokens(llm, hf.PROMPTS[:1], [None])
    assert time.monotonic() - start < 10


def test_a_worker_that_fails_in_a_step_fails_the_engine(engines: Engines) -> None:
    """A command the worker cannot run (a slot that does not exist) ends it while rank 0 goes
    on into the step: caught before the step's collectives or inside them, never a hang."""
    llm = engines.get("qwen2_moe", "ep2")
    llm.engine.workers.pipes[0].send_bytes(pickle.dumps(ClearSlot(slot=10_000)))
    start = time.monotonic()
    with pytest.raises(EngineDeadError, match=r"rank 1 \(pid \d+\) exited with code 1"):
        tokens(llm, hf.PROMPTS[:2], [None, "b"])
    assert time.monotonic() - start < 10


def test_workers_end_when_rank0_goes_away(engines: Engines) -> None:
    """Rank 0's pipe closing (its process gone) ends the worker; the engine is then dead."""
    llm = engines.get("olmoe", "ep2")
    (worker,) = llm.engine.workers.processes
    llm.engine.workers.pipes[0].close()
    worker.join(10)
    assert worker.exitcode == 0
    with pytest.raises(EngineDeadError, match="exited with code 0"):
        tokens(llm, hf.PROMPTS[:1], [None])


@pytest.mark.parametrize(
    "arch,options,message",
    [
        ("qwen3_moe", {"tensor_parallel_size": 3}, "query heads: num_attention_heads=4"),
        (
            "qwen2_moe",
            {"tensor_parallel_size": 4, "enable_expert_parallel": True},
            r"experts \(enable_expert_parallel\): num_experts=6",
        ),
    ],
)
def test_sizes_that_do_not_divide_are_refused(
    bank: FixtureBank, arch: str, options: dict, message: str
) -> None:
    """Before any process is started."""
    size = options["tensor_parallel_size"]
    with pytest.raises(
        ConfigError, match=f"tensor_parallel_size={size} does not divide .*{message}"
    ):
        LLM(str(bank.model(arch)), device="cpu", **options)


@pytest.mark.parametrize(
    "changes,message",
    [
        ({"moe_intermediate_size": 42}, "experts' intermediate size: moe_intermediate_size=42"),
        ({"num_kv_heads": 3, "num_heads": 12}, "KV heads: num_key_value_heads=3, expected"),
        ({"intermediate_size": 90}, "dense layers' intermediate size: intermediate_size=90"),
        (
            {"shared_expert_intermediate_size": 6},
            "shared expert's size: shared_expert_intermediate_size=6",
        ),
    ],
)
def test_each_split_size_is_checked(bank: FixtureBank, changes: dict, message: str) -> None:
    mc, _ = read_model_config(str(bank.model("qwen2_moe")))
    with pytest.raises(ConfigError, match=message):
        check_divides(dataclasses.replace(mc, **changes), 4, expert_parallel=False)


def test_more_ranks_than_gpus_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    config = EngineConfig(model="m", device="cuda", tensor_parallel_size=2)
    with pytest.raises(
        ConfigError, match=r"tensor_parallel_size=2 .* cuda:0 \.\. cuda:1, but this machine has 1"
    ):
        config.resolved()
