"""Many adapters through few slots (issue 41), on the CPU in fp32 with a tiny qwen3_moe model and
random adapters of mixed ranks: the tokens equal an engine that holds every adapter at once;
and a fuzz of adds, aborts, unloads, replacements and preemptions over two slots never writes
a slot that a step in flight reads, gives every request the tokens of its own load's weights,
and leaves nothing behind."""

from __future__ import annotations

import dataclasses
import random

import hf_fixtures as hf
import pytest

from moelora import LLM, SamplingParams
from moelora.lora.adapter import random_adapter

GREEDY = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True, logprobs=0)
RANKS = (2, 8, 4, 8, 2, 4)


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return str(hf.make_model("qwen3_moe", tmp_path_factory.mktemp("slots") / "model", seed=5))


def _llm(model: str, **kw) -> LLM:
    return LLM(model, device="cpu", dtype="float32", max_lora_rank=8, **kw)


def _adapter(llm: LLM, name: str, seed: int):
    engine = llm.engine
    return random_adapter(
        name,
        engine.lora_targets,
        rank=RANKS[seed % len(RANKS)],
        seed=seed,
        dtype=engine.config.torch_dtype,
        device="cpu",
        scaling=4.0,  # deltas large enough to change greedy tokens
    )


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, 250) for _ in range(rng.randrange(2, 14))] for _ in range(n)]


def test_many_adapters_through_two_slots_equal_all_resident(model) -> None:
    names = [f"a{i}" for i in range(len(RANKS))]
    prompts = _prompts(24, seed=1)
    loras = [names[i % len(names)] if i % 5 else None for i in range(len(prompts))]
    answers = {}
    for slots in (len(names), 2):
        llm = _llm(model, max_loras=slots, max_num_seqs=6)
        for i, name in enumerate(names):
            llm.engine.add_adapter(_adapter(llm, name, seed=i))
        outs = llm.generate(prompts, GREEDY, lora=loras)
        answers[slots] = [
            (o.token_ids, [lp[t] for lp, t in zip(o.logprobs, o.token_ids)]) for o in outs
        ]
        stats = llm.engine.stats()
        assert stats.lora_slot_refs == 0 and stats.kv_pages_used == 0
        if slots == 2:
            assert stats.lora_fills > len(names)  # six adapters, two slots: refilled
    for got, want in zip(answers[2], answers[len(names)], strict=True):
        assert got[0] == want[0]
        assert got[1] == pytest.approx(want[1], abs=1e-4)
    # the adapters change the answers (a test of slots that a zero delta would pass)
    base = _llm(model, max_loras=1).generate(prompts, GREEDY)
    assert sum(b.token_ids != a[0] for b, a in zip(base, answers[2])) >= 10


class Churn:
    """Random adds, aborts, replacements, unloads and new adapters on an engine of two slots,
    stepping between them; records every slot write and each request's prompt and load."""

    def __init__(self, model: str, seed: int):
        self.rng = random.Random(seed)
        self.llm = _llm(model, max_loras=2, max_num_seqs=6, page_size=4, num_pages=10)
        self.engine = self.llm.engine
        self.writes: list[int] = []
        runner = self.engine.runner
        runner.fill_slot, runner.clear_slot = map(
            self._guarded, (runner.fill_slot, runner.clear_slot)
        )
        self.weights, self.current = {}, {}  # unique key -> adapter; name -> its key now
        self.prompts = _prompts(400, seed=100 + seed)
        self.added, self.aborted, self.results = {}, set(), {}
        for name in ("x", "y", "z", "u"):
            self.register(name)

    def _guarded(self, write):
        def checked(slot, *args, **kwargs):
            for flight in self.engine._flights:  # a slot a step in flight reads is never written
                assert all(c.request.slot != slot for c in flight.plan.chunks), slot
            self.writes.append(slot)
            return write(slot, *args, **kwargs)

        return checked

    def register(self, name: str, *, replace: bool = False) -> None:
        key = f"w{len(self.weights)}"
        self.weights[key] = _adapter(self.llm, name, seed=len(self.weights))
        self.engine.add_adapter(self.weights[key], replace=replace)
        self.current[name] = key

    def act(self, step: int) -> None:
        roll, rng, engine = self.rng.random(), self.rng, self.engine
        if roll < 0.45 and len(self.added) < len(self.prompts):
            i = len(self.added)
            lora = rng.choice([None, *self.current])
            engine.add_request(f"r{i}", self.prompts[i], GREEDY, lora)
            self.added[f"r{i}"] = (self.prompts[i], self.current[lora] if lora else None)
        elif roll < 0.55 and self.added:
            rid = rng.choice(list(self.added))
            if rid not in self.results and engine.abort_request(rid) is not None:
                self.aborted.add(rid)
        elif roll < 0.62 and self.current:
            self.register(rng.choice(list(self.current)), replace=True)
        elif roll < 0.66 and self.current:
            name = rng.choice(list(self.current))
            if not engine.scheduler.uses_adapter(name):
                engine.unload_lora(name)
                del self.current[name]
        elif roll < 0.70:
            self.register(f"n{step}")

    def step(self) -> None:
        for out in self.engine.step():
            if out.finished and out.request_id not in self.aborted:
                self.results[out.request_id] = out


@pytest.mark.parametrize("seed", [0, 1])
def test_a_fuzz_of_adapter_churn_reads_no_slot_being_written_and_leaks_nothing(model, seed) -> None:
    churn = Churn(model, seed)
    engine = churn.engine
    for step in range(160):
        churn.act(step)
        churn.step()
    while engine.has_unfinished_requests():
        churn.step()
    assert engine.scheduler.num_preemptions > 0 and len(set(churn.writes)) == 2

    # nothing leaked: queues, pages, slot references, retired loads
    stats = engine.stats()
    assert stats.num_running == stats.num_waiting == stats.kv_pages_used == 0
    assert stats.lora_slot_refs == 0 and engine.adapters.retired == []
    live = {engine.adapters.load_number(name) for name in churn.current}
    assert {n for n in engine.slot_table.names if n is not None} <= live

    # each request got its own load's weights: the same tokens as an engine holding them all
    finished = sorted(churn.results, key=lambda rid: int(rid[1:]))
    assert len(finished) > 40
    prompts = [churn.added[rid][0] for rid in finished]
    keys = [churn.added[rid][1] for rid in finished]
    used = sorted(set(keys) - {None})
    ref = _llm(model, max_loras=len(used), max_num_seqs=len(finished))
    for key in used:
        ref.engine.add_adapter(dataclasses.replace(churn.weights[key], name=key))
    for rid, want in zip(finished, ref.generate(prompts, GREEDY, lora=keys), strict=True):
        assert list(churn.results[rid].token_ids) == list(want.token_ids), rid


def test_adapters_parked_in_the_arena_take_a_slot_again_without_a_copy(model) -> None:
    """max_loras bounds the adapters one step holds; the arena how many stay on the GPU. With
    room for all six in two slots' engine, an adapter that leaves its slot keeps its region,
    and taking a slot again costs no copy: one fill an adapter, the tokens of all-resident."""
    names = [f"a{i}" for i in range(len(RANKS))]
    prompts = _prompts(24, seed=3)
    loras = [names[i % len(names)] if i % 5 else None for i in range(len(prompts))]
    answers, fills = {}, {}
    resident = _llm(model, max_loras=len(names), max_num_seqs=6)
    arena_gb = resident.engine.slot_pool.arena.nbytes / 2**30  # all six at max_lora_rank
    for slots in (len(names), 2):
        llm = resident if slots == len(names) else None
        llm = llm or _llm(model, max_loras=slots, max_num_seqs=6, max_gpu_lora_gb=arena_gb)
        for i, name in enumerate(names):
            llm.engine.add_adapter(_adapter(llm, name, seed=i))
        outs = llm.generate(prompts, GREEDY, lora=loras)
        answers[slots] = [o.token_ids for o in outs]
        stats = llm.engine.stats()
        fills[slots] = stats.lora_fills
        assert stats.lora_slot_refs == 0 and stats.kv_pages_used == 0
        assert {a.name: a.level for a in stats.adapters} == dict.fromkeys(names, "gpu")
    assert answers[2] == answers[len(names)]
    assert fills[2] == fills[len(names)] == len(names)  # each copied once, then pointed at


def test_folders_read_on_demand_through_one_host_place_equal_all_resident(model, tmp_path):
    folders = {
        f"f{i}": str(
            hf.make_per_expert_adapter(
                model, tmp_path / f"f{i}", seed=20 + i, rank=2 + 2 * i, alpha=16, arch="qwen3_moe"
            )
        )
        for i in range(3)
    }
    prompts = _prompts(12, seed=7)
    loras = [f"f{i % 3}" if i % 4 else None for i in range(len(prompts))]
    roomy = _llm(model, lora_modules=folders, max_loras=3)
    tight = _llm(model, lora_modules=folders, max_loras=1, max_cpu_loras=1, max_num_seqs=3)
    levels = {a.name: a.level for a in tight.engine.stats().adapters}
    assert levels == dict.fromkeys(folders, "disk")  # nothing read at start
    want = roomy.generate(prompts, GREEDY, lora=loras)
    got = tight.generate(prompts, GREEDY, lora=loras)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    levels = [a.level for a in tight.engine.stats().adapters]
    # one in the slot, others parked beside it in the arena ("gpu") or in the host tier of one
    assert levels.count("gpu") >= 1 and levels.count("cpu") <= 1, levels
    assert tight.engine.stats().lora_fills >= 3

    # a folder removed after registration: its requests end with the error, the others run
    fresh = _llm(model, lora_modules=folders, max_loras=1)
    (tmp_path / "f1" / "adapter_model.safetensors").unlink()
    outs = fresh.generate(prompts[:4], GREEDY, lora=["f1", None, "f0", "f1"])
    assert [o.finish_reason for o in outs] == ["abort", "length", "length", "abort"]
    assert "f1" in outs[0].error and "f1" in outs[3].error
    ref = roomy.generate(prompts[1:3], GREEDY, lora=[None, "f0"])
    assert [o.token_ids for o in outs[1:3]] == [o.token_ids for o in ref]


def test_a_parked_adapter_takes_its_slot_again_without_its_host_copy(
    model, tmp_path, monkeypatch
) -> None:
    """Folders through one slot and a host tier of one, with arena room for all three: each
    folder is read once for serving; an adapter parked in the arena takes the slot again from
    what its fill recorded, not from its host copy (which the tier of one has dropped: reading
    it again would read its folder). Tokens equal all-resident's."""
    import moelora.lora.store as store

    folders = {
        f"p{i}": str(
            hf.make_per_expert_adapter(
                model, tmp_path / f"p{i}", seed=40 + i, rank=2 + 2 * i, alpha=16, arch="qwen3_moe"
            )
        )
        for i in range(3)
    }
    prompts = _prompts(18, seed=11)
    loras = [f"p{i % 3}" for i in range(len(prompts))]
    roomy = _llm(model, lora_modules=folders, max_loras=3)
    want = [o.token_ids for o in roomy.generate(prompts, GREEDY, lora=loras)]
    arena_gb = roomy.engine.slot_pool.arena.nbytes / 2**30
    reads = []
    read = store.load_adapter
    monkeypatch.setattr(
        store, "load_adapter", lambda name, *a, **k: reads.append(name) or read(name, *a, **k)
    )
    tight = _llm(
        model,
        lora_modules=folders,
        max_loras=1,
        max_cpu_loras=1,
        max_num_seqs=2,
        max_gpu_lora_gb=arena_gb,
    )
    reads.clear()  # registration reads each folder once to check it
    got = [o.token_ids for o in tight.generate(prompts, GREEDY, lora=loras)]
    assert got == want
    assert sorted(reads) == sorted(folders), reads  # then once for its one fill
    stats = tight.engine.stats()
    assert stats.lora_fills == len(folders)  # copied once each, then pointed at
    assert {a.name: a.level for a in stats.adapters} == dict.fromkeys(folders, "gpu")


def test_a_refilled_slot_reads_exactly_its_adapter(model):
    """Fills of one slot by adapters of random ranks over random subsets of the targets, each
    into a region of the arena: after each, every target's table row reads that adapter's
    factors at their own rank (none where it has no such module), and the other slot's
    region is left as it was."""
    with _llm(model, max_loras=2) as llm:
        pool, rng = llm.engine.slot_pool, random.Random(7)
        other = _adapter(llm, "other", seed=99)
        pool.fill(1, other, 0)
        for i in range(12):
            adapter = _adapter(llm, f"x{i}", seed=rng.randrange(1000))
            keys = rng.sample(sorted(adapter.modules), k=rng.randint(1, len(adapter.modules)))
            adapter = dataclasses.replace(adapter, modules={k: adapter.modules[k] for k in keys})
            pool.fill(0, adapter, pool.region_size(other))
            for slot, want in ((0, adapter), (1, other)):
                for key, w in pool.weights.items():
                    module, got = want.modules.get(key), w.factors(slot)
                    if module is None:
                        assert got is None, (i, slot, key)
                    else:
                        assert got[0].equal(module.a) and got[1].equal(module.b), (i, slot, key)
