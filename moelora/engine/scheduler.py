"""The scheduler decides each step: which requests run, how many tokens each computes, which
adapters must be copied into slots first. It owns the waiting/running queues, the pages and
the slot references; the engine carries the plan out.

- Running requests go first (decode or the next chunk of a prefill), oldest first (by
  arrival: the running list is kept in that order, also for requests a preemption sent back);
  the step's rows are then grouped by adapter slot.
- Waiting requests are admitted while the token budget, free pages and max_num_seqs allow,
  and a LoRA request only once its adapter is in a slot: ready, or still filling when nothing
  runs (then no stream waits for the copy). Others may pass a request whose adapter is not.
- Adapter slots (plan_fills, before each schedule): the adapters of waiting requests that hold
  no slot, oldest waiting request first, take idle slots, whose fills the engine starts on the
  copy stream while the running requests go on. A free slot or one whose adapter no request
  waits for goes first; one whose adapter has waiting requests goes only to an adapter with
  more of them (no thrashing), or to one whose request has waited max_lora_wait_steps (no
  starvation: until it has a slot, later LoRA requests are not admitted, so slots drain).
  A slot filled for waiting requests is theirs until one of them runs: it is never taken
  from them, and they are admitted even past a starving request.
- When pages run out, the newest running request (by arrival) is preempted by recompute: its
  pages and its slot reference are freed and it goes back to the front of the waiting queue.
  Readmitted, an old request takes its place among the running by age again, so it is not
  the next victim (appended at the end, it would be, and could starve).
- With async scheduling a step is planned while the one before is still on the GPU: a running
  request then ends in a placeholder for its token in flight, and is planned past it. One whose
  known length already reaches max_tokens or max_model_len is not planned again. Preemption
  waits until no step is in flight (schedule(can_preempt=False) gives None instead): the
  pages it frees could be the ones that step writes.
- Recurrent states (hybrid models, states not None): a request takes a state slot when it is
  admitted, after its pages, and holds it while it runs; the slot goes back with its pages
  (_release: preempted, or finished once no step in flight computes it). Admission also waits
  for a free state slot: a finished request's slot may still be held for the step in flight.
- Prefix caching: a request admitted with nothing computed first takes the cached pages of
  the longest prefix of its full pages (its page_hashes: the prompt's, and after a
  preemption the generated tokens' it had) and starts computing after them. Its last token
  is always computed (there must be a logit to sample), so at most (num_tokens - 1) //
  page_size pages come from the cache. A request asking for prompt
  logprobs takes none: they need every prompt position's logits. register() caches a
  request's full pages, prompt and generated, once the step that wrote them is committed,
  never before: a page in the cache is never written again.
- Prefix caching of hybrid models (snapshots not None; engine/state_cache.py says how states
  are snapshotted): a cached run of pages is a hit only up to its longest part whose last page
  has a state snapshot, which is copied into the request's state slot before its first chunk.
  A chunk that ends a page whose hash is known takes a snapshot row (copied after its
  forward), and a prompt's chunk that would cross its last page boundary before its last
  token ends there (_chunk_tokens): its tail, less than a page, then costs one more step.
"""

from __future__ import annotations

import bisect
from collections import Counter, deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass

from moelora.engine.kv_cache import PageAllocator
from moelora.engine.prefix_cache import extend_hashes
from moelora.engine.state_cache import StateSlots, StateSnapshots
from moelora.lora.slots import SlotTable
from moelora.step.batch import pages_for
from moelora.step.plan import Chunk, Snapshot, StepPlan
from moelora.step.request import Request, Status


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    page_size: int
    max_model_len: int
    # steps a LoRA request may wait for its adapter's slot before the scheduler makes room
    max_lora_wait_steps: int = 256


class Scheduler:
    def __init__(
        self,
        cfg: SchedulerConfig,
        pages: PageAllocator,
        slots: SlotTable | None,
        states: StateSlots | None = None,
        snapshots: StateSnapshots | None = None,
    ):
        """states: a hybrid model's recurrent-state slots (None: the model keeps pages only);
        snapshots: their prefix cache's (None: pages only, or prefix caching is off)."""
        self.cfg = cfg
        self.pages = pages
        self.slots = slots
        self.states = states
        self.snapshots = snapshots
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.prefix_cache_queries = 0  # prompt tokens looked up at admission (vLLM's count)
        self.prefix_cache_hits = 0  # of them, tokens found cached
        self.num_steps = 0  # schedule() calls: the clock of a request's wait

    def add(self, req: Request) -> None:
        req.queued_at = self.num_steps
        self.waiting.append(req)

    # ---- adapter slots --------------------------------------------------------------------

    def plan_fills(
        self,
        *,
        can_fill: Callable[[Hashable], bool] = lambda load: True,
        size_of: Callable[[Hashable], int] = lambda load: 0,
    ) -> list[tuple[int, Hashable]]:
        """(slot, load) for each adapter a waiting request needs that takes an idle slot now;
        the slots are assigned (filling) and the caller starts their copies. can_fill(load):
        its host copy is there (one still read from disk waits, and takes no slot); asked
        only of loads that are not parked. size_of(load): the arena elements its region takes
        (asked after can_fill); parked adapters, then those of the slots it may take
        (_takeable), are evicted in that order until it fits, or it waits. A parked load takes
        its slot with its region as it is: nothing is evicted or read for it."""
        if self.slots is None:
            return []
        demand = Counter(r.lora_load for r in self.waiting if r.lora_load is not None)
        fills = []
        # a window as wide as the slots: asking for more would read adapters from disk (and
        # drop others from host memory) long before a slot could take them
        for load in self._loads_without_slot()[: len(self.slots.names)]:
            if load not in self.slots.parked and not can_fill(load):
                continue
            takeable = self._takeable(load, demand)
            if not takeable:
                continue
            slot, size = takeable[0], 0
            victims: list[Hashable] | None = []  # parked: its region holds it, no room to make
            if load not in self.slots.parked:
                size = size_of(load)
                victims = self.slots.room_for(size, slot, takeable[1:])
            if victims is None:
                continue
            for victim in victims:  # idle or parked: no request holds them, no step reads them
                self.slots.evict(victim)
            self.slots.assign(slot, load, size)
            fills.append((slot, load))
        return fills

    def _loads_without_slot(self) -> list[Hashable]:
        """Loads of waiting requests that hold no slot, by their oldest request's wait."""
        first: dict[Hashable, Request] = {}
        for req in self.waiting:
            load = req.lora_load
            if load is not None and self.slots.slot_of(load) is None:
                if load not in first or self._waited(req) > self._waited(first[load]):
                    first[load] = req
        return sorted(first, key=lambda load: -self._waited(first[load]))

    def _takeable(self, load: Hashable, demand: Counter) -> list[int]:
        """The idle slots `load` may take, or evict for room, in that order: free ones, then
        by fewest waiting requests, least recently used first. One whose adapter has waiting
        requests goes only to an adapter with more of them, or to a starving one; one filled
        for waiting requests that have not run yet never does (taken then, its fill would be
        wasted and its requests would starve in turn: a starving adapter would take it the
        moment its fill lands)."""
        table, starving = self.slots, None
        takeable = []
        for s in table.idle():  # free first, then least recently used
            held = table.names[s]
            if held is not None and demand[held]:
                if table.unused[s]:
                    continue
                if demand[held] >= demand[load]:
                    starving = self._starving(load) if starving is None else starving
                    if not starving:
                        continue
            takeable.append(s)
        # stable: least recently used first among equals
        return sorted(
            takeable, key=lambda s: -1 if table.names[s] is None else demand[table.names[s]]
        )

    def _waited(self, req: Request) -> int:
        return self.num_steps - req.queued_at

    def _starving(self, load: Hashable) -> bool:
        return any(
            r.lora_load == load and self._waited(r) >= self.cfg.max_lora_wait_steps
            for r in self.waiting
        )

    def _starving_since(self) -> int | None:
        """The arrival of the oldest waiting request that has waited max_lora_wait_steps for
        a slot not yet ready: LoRA requests that arrived after it wait for it."""
        starving = [
            r.arrival
            for r in self.waiting
            if self._waited(r) >= self.cfg.max_lora_wait_steps
            and r.lora_load is not None
            and not self.slots.is_ready(r.lora_load)
        ]
        return min(starving, default=None)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self, *, can_preempt: bool = True) -> StepPlan | None:
        """The next step; None when it needs a preemption that can_preempt=False forbids (only
        page reservations are kept: the requests need them anyway)."""
        self.num_steps += 1
        plan = StepPlan()
        budget = self.cfg.max_num_batched_tokens
        for req in list(self.running):
            if req.status is not Status.RUNNING or budget == 0 or self._at_its_end(req):
                continue  # preempted earlier in this loop, no budget left, or nothing to add
            n = self._chunk_tokens(req, budget)
            while not self._reserve_pages(req, n):
                if not can_preempt:
                    return None
                victim = self.running[-1]
                self._preempt(victim)
                plan.preempted.append(victim)
                if victim is req:
                    break
            if req.status is Status.RUNNING:
                self._plan_chunk(plan, req, n)
                budget -= n
        if not plan.preempted:
            self._admit(plan, budget)
        # Rows of one adapter side by side: a LoRA kernel's 16-row tile then mixes one or two
        # adapters, not up to max_loras, and reads that many A and B. Stable, so each
        # adapter's requests keep their age order; no result depends on a row's place.
        plan.chunks.sort(key=lambda c: -1 if c.request.slot is None else c.request.slot)
        return plan

    def _at_its_end(self, req: Request) -> bool:
        """Its tokens in flight take it to max_tokens or max_model_len: it finishes when they
        are known, and a token planned now would be dropped."""
        if not req.num_placeholders:
            return False
        full = req.num_tokens >= self.cfg.max_model_len
        return full or len(req.output_token_ids) >= req.params.max_tokens

    def _admit(self, plan: StepPlan, budget: int) -> None:
        nothing_runs = not self.running  # a step may then wait for a fill: no one else waits
        starving_since = self._starving_since() if self.slots is not None else None
        # loads whose slot was filled for requests that have not run: they run even past a
        # starving request (the slot is kept for them, so it drains only once they have)
        fresh = set() if self.slots is None else self.slots.unused_loads()
        for req in list(self.waiting):
            if budget == 0 or len(self.running) >= self.cfg.max_num_seqs:
                return
            if self.states is not None and self.states.num_free == 0:
                return  # every state slot is held (some by requests the step in flight ends)
            if req.lora_load is not None and not self._adapter_can_run(
                req, nothing_runs=nothing_runs, starving_since=starving_since, fresh=fresh
            ):
                continue  # its adapter is not in a slot yet; later requests may still run
            cached, snapshot = self._take_cached_prefix(req)
            n = self._chunk_tokens(req, budget)
            if not self._reserve_pages(req, n):
                self._give_back_cached_prefix(req)
                return  # first come, first served on pages
            self._count_cache_query(req, cached)
            if req.lora_load is not None:
                req.slot = self.slots.acquire(req.lora_load)
            if self.states is not None:
                req.state_slot = self.states.allocate()
                if snapshot is not None:  # the state after its cached prefix, before its chunk
                    plan.state_restores.append((snapshot, req.state_slot))
            self.waiting.remove(req)
            bisect.insort(self.running, req, key=lambda r: r.arrival)
            req.status = Status.RUNNING
            self._plan_chunk(plan, req, n)
            budget -= n

    def _adapter_can_run(
        self, req: Request, *, nothing_runs: bool, starving_since: int | None, fresh: set
    ) -> bool:
        if starving_since is not None and req.arrival > starving_since:
            if req.lora_load not in fresh:
                return False
        if self.slots.is_ready(req.lora_load):
            return True
        return nothing_runs and self.slots.slot_of(req.lora_load) is not None

    def _take_cached_prefix(self, req: Request) -> tuple[int, int | None]:
        """The request starts with the cached pages of its prompt's longest cached prefix: how
        many tokens they hold, and for a hybrid model the snapshot row of the state after them
        (None: no pages, or not a hybrid model)."""
        if req.num_computed_tokens or req.params.prompt_logprobs is not None:
            return 0, None
        most = (req.num_tokens - 1) // self.cfg.page_size
        hashes = req.page_hashes[:most]
        n = self.pages.num_cached_run(hashes)
        if self.snapshots is not None:  # a hit must end on a page whose state was snapshotted
            n = self.snapshots.longest(hashes[:n])
        pages = self.pages.cached_prefix(hashes[:n])
        req.add_pages(pages)
        req.num_cached_pages = len(pages)
        req.num_computed_tokens = len(pages) * self.cfg.page_size
        if self.snapshots is None or not pages:
            return req.num_computed_tokens, None
        return req.num_computed_tokens, self.snapshots.use(hashes[n - 1])

    def _chunk_tokens(self, req: Request, budget: int) -> int:
        """Its next chunk's tokens: what is left, within the budget. With snapshots, a chunk
        that would cross its snapshot boundary (the last page boundary before its last token
        whose page hash is known: the longest prefix an identical prompt can take) ends there,
        so that a snapshot holds the state after exactly that token."""
        start = req.num_computed_tokens
        n = min(req.num_tokens - start, budget)
        if self.snapshots is not None and req.cache_namespace is not None:
            size = self.cfg.page_size
            boundary = min(len(req.page_hashes), (req.num_tokens - 1) // size) * size
            if start < boundary < start + n:
                n = boundary - start
        return n

    def _plan_chunk(self, plan: StepPlan, req: Request, n: int) -> None:
        """Its next n tokens in the plan, with a snapshot row for the state after them if they
        end a page whose hash is known and has no snapshot yet (no row when every row is
        pending: that page gets none)."""
        chunk = Chunk.next_of(req, n)
        plan.chunks.append(chunk)
        end, size = chunk.start + n, self.cfg.page_size
        if self.snapshots is None or req.cache_namespace is None or end % size:
            return
        pages = end // size  # the chunk ends the last of these pages
        if pages > len(req.page_hashes) or self.snapshots.has(req.page_hashes[pages - 1]):
            return
        row = self.snapshots.take()
        if row is not None:
            plan.snapshots.append(Snapshot(req, end, row))

    def _give_back_cached_prefix(self, req: Request) -> None:
        """Not admitted after all: back to waiting, holding nothing."""
        self.pages.free(req.pages)
        req.clear_pages()
        req.num_cached_pages = req.num_computed_tokens = 0

    def _count_cache_query(self, req: Request, cached: int) -> None:
        if req.cache_namespace is None:
            return
        self.prefix_cache_queries += req.num_tokens
        self.prefix_cache_hits += cached
        if req.num_cached_tokens is None:  # what its outputs report: its first admission
            req.num_cached_tokens = cached

    def register(self, req: Request, num_computed: int) -> None:
        """The request's first num_computed tokens are in the cache, written by committed
        steps: its full pages among them become cached pages. Their tokens are all known: the
        newest, the input of the committed step, was sampled by a step committed before it."""
        size = self.cfg.page_size
        full = min(num_computed // size, len(req.pages))
        if len(req.page_hashes) < full:  # pages of generated tokens: hashed once known
            tokens = req.token_slice(len(req.page_hashes) * size, full * size)
            extend_hashes(req.page_hashes, tokens, size, req.cache_namespace)
        for i in range(req.num_cached_pages, full):
            self.pages.register(req.pages[i], req.page_hashes[i], req.cache_owner)
        req.num_cached_pages = max(req.num_cached_pages, full)

    def register_snapshots(self, snapshots: list[Snapshot]) -> None:
        """The snapshots a committed step took, each cached under the hash of the page it ends
        (whose pages register() has cached first)."""
        for snap in snapshots:
            page_hash = snap.request.page_hashes[snap.num_tokens // self.cfg.page_size - 1]
            self.snapshots.cache(snap.row, page_hash, snap.request.cache_owner)

    def drop_cached(self, owner: Hashable | None = None, *, everything: bool = False) -> None:
        """The cached pages and snapshots of `owner` (an adapter's load) leave the prefix
        cache; everything=True: all of them (reset_prefix_cache)."""
        if everything:
            self.pages.reset_cache()
        else:
            self.pages.drop_owner(owner)
        if self.snapshots is not None and everything:
            self.snapshots.reset()
        elif self.snapshots is not None:
            self.snapshots.drop_owner(owner)

    def _reserve_pages(self, req: Request, n: int) -> bool:
        need = pages_for(req.num_computed_tokens + n, self.cfg.page_size) - len(req.pages)
        if need > self.pages.num_free:
            return False
        if need > 0:
            req.add_pages(self.pages.allocate(need))
        return True

    def _preempt(self, req: Request) -> None:
        self.num_preemptions += 1
        self._release(req)
        self.running.remove(req)
        req.num_computed_tokens = 0
        req.status = Status.WAITING
        req.queued_at = self.num_steps
        self.waiting.appendleft(req)

    def _release(self, req: Request) -> None:
        self.pages.free(req.pages)
        req.clear_pages()
        req.num_cached_pages = 0
        if req.slot is not None:
            self.slots.release(req.slot)
            req.slot = None
        if req.state_slot is not None:  # a preempted request recomputes from position 0
            self.states.free(req.state_slot)
            req.state_slot = None

    def finish(self, req: Request, reason: str, *, release: bool = True) -> None:
        """Finished or aborted: everything the request held goes back, now or (release=False,
        while a step in flight still uses its pages and slot) at release()."""
        if req.status is Status.RUNNING:
            self.running.remove(req)
        elif req.status is Status.WAITING:
            self.waiting.remove(req)
        if release:
            self._release(req)
        req.status = Status.FINISHED
        req.finish_reason = reason

    def release(self, req: Request) -> None:
        """A finished request's pages and slot, once no step in flight uses them."""
        assert req.status is Status.FINISHED, req.request_id
        self._release(req)

    def uses_adapter(self, name: str) -> bool:
        return any(r.lora == name for r in (*self.running, *self.waiting))

    def uses_load(self, load: int) -> bool:
        return any(r.lora_load == load for r in (*self.running, *self.waiting))
