"""Adapter memory by real rank (issue 41, item 1): the arena's region allocator, the GPU bytes
an adapter takes (its modules' own ranks, a shared expert factor once), and adapters of mixed
ranks and shared-outer layout through an arena of room for few of them equal to an engine
that holds them all. CPU, fp32."""

from __future__ import annotations

import dataclasses
import random

import hf_fixtures as hf
import pytest
import torch

from moelora import LLM, SamplingParams
from moelora.errors import AdapterError
from moelora.lora.adapter import ModuleLora, random_adapter
from moelora.lora.arena import ALIGN, RegionAllocator
from moelora.lora.slots import SlotTable

GREEDY = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True, logprobs=0)


def test_regions_fit_free_and_merge() -> None:
    arena = RegionAllocator(100)
    a, b, c = arena.allocate(30), arena.allocate(30), arena.allocate(30)
    assert (a, b, c) == (0, 30, 60) and arena.allocate(20) is None
    arena.free(b, 30)
    assert arena.allocate(40) is None and arena.fits_after(40, [(60, 30)])
    arena.free(a, 30)  # merges with b's
    assert arena.free_list == [(0, 60), (90, 10)]
    arena.free(c, 30)  # merges with both neighbours
    assert arena.free_list == [(0, 100)]


def test_a_fuzz_of_fills_and_evictions_leaves_the_free_list_whole() -> None:
    """Loads take slots, leave them parked (their regions kept) or evicted; a parked load
    taking a slot again reuses its region. Regions stay disjoint, and every element is free
    or held by a slot or a parked load."""
    rng = random.Random(3)
    table = SlotTable(4, RegionAllocator(1000))
    sizes = {name: rng.randrange(1, 250) for name in range(12)}  # an adapter's region size
    reused = 0
    for step in range(400):
        name = rng.randrange(12)
        slot = table.slot_of(name)
        if slot is not None:
            table.filled(slot)
            table.evict(name) if rng.random() < 0.5 else table.last_used.__setitem__(slot, step)
            continue
        size, idle = sizes[name], table.idle()
        if name not in table.parked:
            victims = table.room_for(size, idle[0])
            if victims is None:
                continue
            for v in victims:  # loads: parked, the slot's own, idle ones
                table.evict(v)
        table.assign(idle[0], name, size)
        reused += table.resident[idle[0]]
        table.filled(idle[0])
        regions = sorted([r for r in table.regions if r] + list(table.parked.values()))
        assert all(x[0] + x[1] <= y[0] for x, y in zip(regions, regions[1:]))  # disjoint
        held = sum(n for _, n in regions)
        assert held + table.arena.free_elements == 1000
    assert reused > 10, reused  # parked loads came back without a copy
    for name in [n for n in table.names if n is not None] + list(table.parked):
        table.evict(name)
    assert table.arena.free_list == [(0, 1000)] and not table.parked


def test_room_is_made_from_the_least_recently_used_idle_adapters() -> None:
    table = SlotTable(3, RegionAllocator(300))
    for slot, name in enumerate("abc"):
        table.assign(slot, name, 100)
        table.filled(slot)
    table.acquire("c")  # c runs: never evicted
    assert table.room_for(100, 1) == ["b"]  # b's own region is room enough
    # b's region and a's (idle, least recently used) are contiguous: room for 200
    assert table.room_for(200, 1) == ["b", "a"]
    assert table.room_for(300, 1) is None  # c's region is held


def test_room_is_not_made_from_an_adapter_filled_for_requests_that_have_not_run() -> None:
    """The scheduler's room eviction takes only what the new load may take: not a slot
    filled for waiting requests before they ran, nor one with more waiting requests."""
    sched, table = _arena_scheduler(slots=3, elements=300)
    for slot, load in enumerate((10, 11, 12)):
        table.assign(slot, load, 100)
        table.filled(slot)
    table.acquire(12)  # 12 has run (and still runs): 10 and 11 are fresh
    _wait(sched, [10, 13, 13])  # 13 has more waiting than 10, but 10 has not run yet
    assert sched.plan_fills(size_of=lambda load: 200) == []  # only 11's region may go
    assert sched.plan_fills(size_of=lambda load: 100) == [(1, 13)] and table.names[0] == 10


def _arena_scheduler(slots: int, elements: int):
    from moelora.engine.kv_cache import PageAllocator
    from moelora.engine.scheduler import Scheduler, SchedulerConfig

    table = SlotTable(slots, RegionAllocator(elements))
    cfg = SchedulerConfig(1, 64, 4, max_model_len=1 << 20)
    return Scheduler(cfg, PageAllocator(64), table), table


def _wait(sched, loads: list[int]) -> None:
    """A blocker holds the only sequence; then one waiting request a load."""
    from moelora.step.request import Request

    for i, load in enumerate([None, *loads]):
        req = Request(f"r{i}", [1, 2, 3], SamplingParams(), None, arrival=i)
        req.lora_load = load
        sched.add(req)
        if load is None:
            sched.schedule()


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return str(hf.make_model("qwen3_moe", tmp_path_factory.mktemp("arena") / "model", seed=5))


def _llm(model: str, **kw) -> LLM:
    return LLM(model, device="cpu", dtype="float32", **kw)


def _adapter(llm: LLM, name: str, rank: int, seed: int):
    return random_adapter(
        name,
        llm.engine.lora_targets,
        rank=rank,
        seed=seed,
        dtype=torch.float32,
        device="cpu",
        scaling=4.0,
    )


def _shared_outer(adapter):
    """The adapter with gate_up's A and down's B shared by every expert (shared-outer)."""
    modules, shared = dict(adapter.modules), set()
    for key, m in adapter.modules.items():
        if key.endswith("experts13"):
            modules[key] = ModuleLora(m.a[:1].expand_as(m.a).clone(), m.b)
            shared.add((key, "a"))
        elif key.endswith("experts2"):
            modules[key] = ModuleLora(m.a, m.b[:1].expand_as(m.b).clone())
            shared.add((key, "b"))
    return dataclasses.replace(adapter, modules=modules, shared=frozenset(shared))


def test_gpu_bytes_follow_the_adapters_own_ranks(model) -> None:
    sizes = {}
    for max_rank in (8, 64):
        with _llm(model, max_loras=2, max_lora_rank=max_rank) as llm:
            pool = llm.engine.slot_pool
            adapter = _adapter(llm, "r8", 8, seed=1)
            sizes[max_rank] = pool.region_size(adapter)
            shared = pool.region_size(_shared_outer(adapter))
            if max_rank == 64:
                assert pool.arena.numel() == 2 * pool.slot_elements  # default: today's memory
                # the adapter's own bytes, aligned per factor
                exact = sum(m.a.numel() + m.b.numel() for m in adapter.modules.values())
                assert exact <= sizes[64] <= exact + 2 * ALIGN * len(adapter.modules)
                assert sizes[64] <= pool.slot_elements / 7
                # the shared factors once: gate_up's A and down's B go from E copies to one
                assert shared < 0.75 * sizes[64]
    assert sizes[8] == sizes[64]


def test_an_adapter_larger_than_the_arena_is_refused_naming_the_sizes(model) -> None:
    with _llm(model, max_loras=2, max_lora_rank=8, max_gpu_lora_gb=1e-5) as llm:
        with pytest.raises(AdapterError, match=r"takes .* GiB .* more than the whole"):
            llm.engine.add_adapter(_adapter(llm, "big", 8, seed=1))


def test_mixed_ranks_and_shared_outer_through_little_memory_equal_all_resident(model) -> None:
    specs = [(2, False), (8, True), (4, False), (8, False), (1, True), (4, True)]
    prompts = [[random.Random(i).randrange(1, 250) for _ in range(2 + i % 9)] for i in range(18)]
    names = [f"m{i}" for i in range(len(specs))]
    loras = [names[i % len(names)] if i % 4 else None for i in range(len(prompts))]
    answers = {}
    for small in (False, True):
        kw = dict(max_loras=3, max_gpu_lora_gb=None) if small else dict(max_loras=6)
        llm = _llm(model, max_lora_rank=8, max_num_seqs=4, **kw)
        pool = llm.engine.slot_pool
        adapters = [_adapter(llm, n, r, seed=i) for i, (n, (r, _)) in enumerate(zip(names, specs))]
        adapters = [_shared_outer(a) if s else a for a, (_, s) in zip(adapters, specs)]
        if small:  # room for the two largest adapters at most: fills evict by memory
            gb = 2.2 * max(map(pool.region_size, adapters)) * 4 / 2**30
            llm = _llm(model, max_lora_rank=8, max_num_seqs=4, max_loras=3, max_gpu_lora_gb=gb)
        for a in adapters:
            llm.engine.add_adapter(a)
        outs = llm.generate(prompts, GREEDY, lora=loras)
        answers[small] = [
            (o.token_ids, [lp[t] for lp, t in zip(o.logprobs, o.token_ids)]) for o in outs
        ]
        stats = llm.engine.stats()
        assert stats.lora_slot_refs == 0
        if small:
            assert stats.lora_fills > len(names)
            table = llm.engine.slot_table
            for name in [n for n in table.names if n is not None]:
                table.evict(name)
            assert table.arena.free_list == [(0, table.arena.size)]
    for got, want in zip(answers[True], answers[False], strict=True):
        assert got[0] == want[0]
        assert got[1] == pytest.approx(want[1], abs=1e-4)
