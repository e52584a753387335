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


def run_step(sched: Scheduler, fills: list | None = None):
    """Start the adapter fills the engine would (each lands at once, as on the CPU; appended
    to `fills`), plan a step and pretend the model ran it: sampled chunks append one token."""
    started = sched.plan_fills()
    for slot, _ in started:
        sched.slots.filled(slot)
    if fills is not None:
        fills += started
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
    fills = []
    plan = run_step(sched, fills)
    assert {c.request.request_id for c in plan.chunks} == {"r0", "r2"}  # b waits, base passes
    assert fills == [(0, "a")]
    for _ in range(3):
        plan = run_step(sched, fills)
        assert b.status is Status.WAITING and table.names == ["a"] and len(fills) == 1
    sched.finish(a, "stop")
    plan = run_step(sched, fills)
    assert b.status is Status.RUNNING and fills == [(0, "a"), (0, "b")]


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
    fills = []
    plan = run_step(sched, fills)
    assert len(plan.chunks) == 2 and fills == [(0, "a")]


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
    table = SlotTable(3)
    sa, sb = table.idle()[:2]
    for slot, name in ((sa, "a"), (sb, "b")):
        table.assign(slot, name)
        table.filled(slot)
    assert table.idle()[0] not in (sa, sb)  # the free slot first
    table.assign(table.idle()[0], "x")  # filling: never idle
    assert table.idle() == [sa, sb]
    table.release(table.acquire("a"))  # a used again: b is the LRU
    assert table.idle() == [sb, sa]
    held = table.acquire("b")
    assert table.idle() == [sa]  # a slot with a reference is never idle
    table.release(held)
    assert table.assign(sb, "c") == "b" and table.names[sa] == "a" and not table.is_ready("c")


def test_graph_batch_sizes_and_padding():
    sizes = graph_batch_sizes(40)
    assert sizes == [40, 32, 24, 16, 8, 4, 2, 1]
    assert padded_batch_size(3, sizes) == 4
    assert padded_batch_size(17, sizes) == 24
    assert padded_batch_size(40, sizes) == 40
    assert padded_batch_size(41, sizes) is None
    assert graph_batch_sizes(256)[-6:] == [24, 16, 8, 4, 2, 1]


def test_a_request_waits_for_its_fill_while_others_run_and_not_when_nothing_runs():
    sched, _, table = make_scheduler(num_pages=64, slots=2)
    first = make_request(0, 3, "a")
    sched.add(first)
    assert sched.plan_fills() == [(0, "a")] and table.filling == [True, False]
    plan = sched.schedule()  # nothing runs: the step itself waits for the copy on the device
    assert [c.request for c in plan.chunks] == [first]
    later = make_request(1, 3, "b")
    sched.add(later)
    assert sched.plan_fills() == [(1, "b")]  # started while a runs, a look-ahead
    plan = sched.schedule()
    assert later.status is Status.WAITING and [c.request for c in plan.chunks] == [first]
    table.filled(1)
    plan = sched.schedule()
    assert later.status is Status.RUNNING and later.slot == 1


def test_an_adapter_with_waiting_requests_is_not_evicted_for_one_with_fewer():
    # max_num_seqs 1: requests wait for room, not for a slot
    sched, _, table = make_scheduler(num_pages=64, max_seqs=1, slots=1)
    reqs = [make_request(i, 3, lora) for i, lora in enumerate(["a", "b", "a", "a"])]
    for r in reqs:
        sched.add(r)
    finished = []
    for _ in range(20):
        run_step(sched)
        running = sched.running[0]
        if running.num_computed_tokens >= 5:
            sched.finish(running, "stop")
            finished.append(running.lora)
        if any(r.lora == "a" for r in sched.waiting):
            assert table.names == ["a"]  # b (one request) never takes a's slot (more waiting)
        if not sched.has_unfinished():
            break
    assert finished == ["a", "a", "a", "b"]


def test_a_starving_adapter_gets_a_slot_within_max_lora_wait_steps():
    pages = PageAllocator(256)
    table = SlotTable(1)
    cfg = SchedulerConfig(2, 64, 4, max_model_len=1 << 20, max_lora_wait_steps=5)
    sched = Scheduler(cfg, pages, table)
    arrivals = iter(range(1000))
    hot = [make_request(next(arrivals), 2, "hot") for _ in range(2)]
    cold = make_request(next(arrivals), 2, "cold")
    for r in (*hot, cold):
        sched.add(r)
    steps = 0
    while cold.status is Status.WAITING and steps < 40:
        steps += 1
        run_step(sched)
        for r in list(sched.running):  # each runs three steps, and a hot one replaces it
            if len(r.output_token_ids) >= 3:
                sched.finish(r, "stop")
                if r.lora == "hot":
                    sched.add(make_request(next(arrivals), 2, "hot"))
    # 5 steps of waiting, then the hot requests running drain (3 steps) and cold's fill
    assert cold.status is not Status.WAITING and steps <= 5 + 3 + 1, steps
    assert table.names == ["cold"]


def test_a_landed_fill_is_not_evicted_before_its_requests_ran_even_under_starvation():
    """Fills land a call after they start (as on the GPU, where the copy runs beside the step):
    between the landing and the admission of its requests a slot is idle, and a starving
    adapter must not take it then (each would evict the last, and every fill would be wasted).
    Every fill serves a request before its slot is taken again, and the run ends."""
    pages = PageAllocator(512)
    table = SlotTable(2)
    cfg = SchedulerConfig(4, 64, 4, max_model_len=1 << 20, max_lora_wait_steps=3)
    sched = Scheduler(cfg, pages, table)
    loras = [f"a{i % 6}" for i in range(24)]
    for i, lora in enumerate(loras):
        sched.add(make_request(i, 3, lora))
    landing, fills, steps = [], 0, 0
    while sched.has_unfinished() and steps < 500:
        steps += 1
        for slot in landing:
            table.filled(slot)
        started = sched.plan_fills()
        fills += len(started)
        landing = [slot for slot, _ in started]
        plan = sched.schedule()
        for c in plan.chunks:
            c.request.num_computed_tokens += c.num_tokens
            if c.samples:
                c.request.output_token_ids.append(7)
        for r in list(sched.running):
            if len(r.output_token_ids) >= 4:
                sched.finish(r, "stop")
    assert not sched.has_unfinished(), (steps, fills)
    assert fills <= len(loras), fills  # at least one request a fill


def test_an_adapter_numbered_0_is_not_taken_for_a_free_slot():
    """Slots are keyed by load numbers, 0 among them: the slot of load 0, whose requests
    wait, is kept, and the idle slot whose adapter nobody waits for is the one taken."""
    sched, _, table = make_scheduler(num_pages=64, max_seqs=1, slots=2)
    for slot, load in enumerate((0, 1)):
        table.assign(slot, load)
        table.filled(slot)
        table.acquire(load)  # ran once: no longer kept for its first requests
        table.release(slot)
    blocker = make_request(0, 3)  # max_num_seqs 1: it holds the step, so load 0's wait
    sched.add(blocker)
    sched.schedule()
    for i, load in enumerate((0, 0, 2), start=1):
        req = make_request(i, 3)
        req.lora_load = load
        sched.add(req)
    assert sched.plan_fills() == [(1, 2)] and table.names == [0, 2]
