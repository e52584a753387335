"""Scheduler and page allocator, without a model: admission, chunking, preemption, abort."""

from moelora.config import graph_batch_sizes
from moelora.engine.kv_cache import PageAllocator
from moelora.engine.scheduler import Scheduler, SchedulerConfig
from moelora.lora.slots import SlotTable
from moelora.runner.graph_runner import padded_batch_size
from moelora.sampling_params import SamplingParams
from moelora.step.batch import pages_for
from moelora.step.request import Request, Status


def make_scheduler(num_pages=16, page_size=4, budget=64, max_seqs=8, slots=2):
    pages = PageAllocator(num_pages)
    table = SlotTable(slots)
    return (
        Scheduler(
            SchedulerConfig(max_seqs, budget, page_size, max_model_len=1 << 20), pages, table
        ),
        pages,
        table,
    )


def make_request(i: int, prompt_len: int, lora: str | None = None) -> Request:
    req = Request(f"r{i}", list(range(1, prompt_len + 1)), SamplingParams(), lora, arrival=i)
    req.lora_load = lora  # the slots' key: here the name stands for its load
    return req


def run_step(sched: Scheduler) -> list:
    """Plan a step and pretend the model ran it: sampled chunks append one token."""
    plan = sched.schedule()
    for c in plan.chunks:
        c.request.num_computed_tokens += c.num_tokens
        if c.samples:
            c.request.output_token_ids.append(7)
    return plan


def test_page_allocator_hands_out_and_takes_back():
    alloc = PageAllocator(5)
    a = alloc.allocate(3)
    assert len(set(a)) == 3 and alloc.num_free == 2 and alloc.num_used == 3
    alloc.free(a)
    assert alloc.num_free == 5
    assert sorted(alloc.allocate(5)) == [0, 1, 2, 3, 4]
    assert pages_for(16, 16) == 1 and pages_for(17, 16) == 2 and pages_for(0, 16) == 0


def test_admission_is_limited_by_free_pages():
    sched, pages, _ = make_scheduler(num_pages=4, page_size=4)
    first, second = make_request(0, 10), make_request(1, 10)  # 3 pages each
    sched.add(first)
    sched.add(second)
    plan = run_step(sched)
    assert [c.request for c in plan.chunks] == [first]
    assert second.status is Status.WAITING and pages.num_free == 1
    sched.finish(first, "stop")
    plan = run_step(sched)
    assert [c.request for c in plan.chunks] == [second]


def test_admission_is_limited_by_adapter_slots_and_busy_slots_are_never_evicted():
    sched, _, table = make_scheduler(slots=1)
    a, b, base = make_request(0, 3, "a"), make_request(1, 3, "b"), make_request(2, 3)
    for r in (a, b, base):
        sched.add(r)
    plan = run_step(sched)
    assert {c.request.request_id for c in plan.chunks} == {"r0", "r2"}  # b waits, base passes
    assert plan.lora_loads == [(0, "a")]
    for _ in range(3):
        plan = run_step(sched)
        assert b.status is Status.WAITING and table.names == ["a"]
    sched.finish(a, "stop")
    plan = run_step(sched)
    assert b.status is Status.RUNNING and plan.lora_loads == [(0, "b")]


def test_admission_is_limited_by_max_num_seqs():
    sched, _, _ = make_scheduler(num_pages=64, max_seqs=2)
    reqs = [make_request(i, 3) for i in range(3)]
    for r in reqs:
        sched.add(r)
    run_step(sched)
    assert sched.running == reqs[:2] and list(sched.waiting) == reqs[2:]
    sched.finish(reqs[0], "stop")
    run_step(sched)
    assert sched.running == reqs[1:]


def test_second_request_of_a_loaded_adapter_needs_no_load():
    sched, _, _ = make_scheduler(slots=1)
    sched.add(make_request(0, 3, "a"))
    sched.add(make_request(1, 3, "a"))
    plan = run_step(sched)
    assert len(plan.chunks) == 2 and plan.lora_loads == [(0, "a")]


def test_chunked_prefill_respects_the_token_budget():
    sched, _, _ = make_scheduler(budget=4)
    req = make_request(0, 10)
    sched.add(req)
    sizes = []
    for _ in range(4):
        plan = run_step(sched)
        sizes.append([(c.num_tokens, c.samples) for c in plan.chunks])
    assert sizes == [[(4, False)], [(4, False)], [(2, True)], [(1, True)]]


def test_decode_and_prefill_share_a_step():
    sched, _, _ = make_scheduler(budget=8)
    old = make_request(0, 3)
    sched.add(old)
    run_step(sched)
    new = make_request(1, 20)
    sched.add(new)
    plan = run_step(sched)
    assert [(c.request, c.num_tokens) for c in plan.chunks] == [(old, 1), (new, 7)]


def test_a_steps_rows_are_grouped_by_adapter_slot_in_age_order():
    """The LoRA kernels' row tiles then mix few adapters; within an adapter, oldest first."""
    sched, _, table = make_scheduler(num_pages=64, slots=3)
    loras = ["b", None, "a", "b", None, "c", "a", "b"]
    reqs = [make_request(i, 2, lora) for i, lora in enumerate(loras)]
    for r in reqs:
        sched.add(r)
    for _ in range(2):  # the admitting prefill step, then a decode step
        plan = run_step(sched)
        keys = [(-1 if c.request.slot is None else c.request.slot) for c in plan.chunks]
        assert keys == sorted(keys)
        for s in set(keys):
            ages = [c.request.arrival for c, k in zip(plan.chunks, keys) if k == s]
            assert ages == sorted(ages)
    assert len(plan.chunks) == 8 and sorted(table.names) == ["a", "b", "c"]


def test_preemption_frees_the_newest_request_and_recomputes_it():
    sched, pages, table = make_scheduler(num_pages=4, page_size=2, slots=2)
    old, new = make_request(0, 4, "a"), make_request(1, 4, "b")
    sched.add(old)
    sched.add(new)
    run_step(sched)  # both prefilled: 2 pages each, none free
    assert pages.num_free == 0
    plan = run_step(sched)  # old needs a third page: new is preempted
    assert plan.preempted == [new]
    assert new.status is Status.WAITING and new.pages == [] and new.num_computed_tokens == 0
    assert new.slot is None and table.refs == [1, 0]
    assert [c.request for c in plan.chunks] == [old]
    sched.finish(old, "stop")
    plan = run_step(sched)
    # recompute covers the prompt and the token generated before preemption
    assert plan.chunks[0].request is new and plan.chunks[0].num_tokens == 5


def test_a_request_admitted_late_keeps_its_age_and_the_newest_is_preempted():
    """b arrives before c but waits for an adapter slot, so c is admitted first. When pages
    run out, c (the newest) goes, not b: the running list is in arrival order, not admission
    order (else a request that had to wait would be the first victim, again and again)."""
    sched, _, _ = make_scheduler(num_pages=4, page_size=2, slots=1)
    a, b, c = make_request(0, 2, "x"), make_request(1, 2, "y"), make_request(2, 2)
    for r in (a, b, c):
        sched.add(r)
    run_step(sched)
    assert sched.running == [a, c] and b.status is Status.WAITING  # y has no free slot
    sched.finish(a, "stop")
    run_step(sched)  # b admitted now that x's slot is idle
    assert sched.running == [b, c]
    while not (plan := run_step(sched)).preempted:
        pass
    assert plan.preempted == [c] and b.status is Status.RUNNING


def test_abort_frees_pages_and_slot_reference():
    sched, pages, table = make_scheduler()
    req = make_request(0, 9, "a")
    sched.add(req)
    run_step(sched)
    assert pages.num_used == 3 and table.refs[req.slot] == 1
    slot = req.slot
    sched.finish(req, "abort")
    assert pages.num_used == 0 and table.refs[slot] == 0
    assert not sched.has_unfinished() and req.finish_reason == "abort"


def test_lru_eviction_picks_the_least_recently_used_idle_slot():
    table = SlotTable(2)
    sa, _ = table.acquire("a")
    sb, _ = table.acquire("b")
    table.release(sa)
    table.release(sb)
    table.acquire("b")  # b used again: a is the LRU
    table.release(sb)
    slot, must_load = table.acquire("c")
    assert slot == sa and must_load and table.names[sb] == "b"


def test_graph_batch_sizes_and_padding():
    sizes = graph_batch_sizes(40)
    assert sizes == [40, 32, 24, 16, 8, 4, 2, 1]
    assert padded_batch_size(3, sizes) == 4
    assert padded_batch_size(17, sizes) == 24
    assert padded_batch_size(40, sizes) == 40
    assert padded_batch_size(41, sizes) is None
    assert graph_batch_sizes(256)[-6:] == [24, 16, 8, 4, 2, 1]
