"""The engine: the step loop, over what engine/build.py built once.

step(): the scheduler plans, adapters the plan needs are copied into slots, the runner runs
the batch, and each sampled token is appended and checked against the stop conditions.

With async scheduling (the default) a step is launched before the one before it is known: each
step() plans and launches step N+1, then waits for step N's tokens and commits them. Step N+1
reads those tokens on the device (placeholders stand for them on the host), so the GPU never
waits for Python. What that costs is one step late, and exact:
- a request that finishes in step N may already be in step N+1: its token there is dropped,
  and its pages and slot go back once step N+1 is done (a page it writes is never handed on);
- a step is planned without preemption; one that needs it waits until nothing is in flight;
- requests with penalties need their last token on the host to plan: while one runs, steps
  are run one at a time;
- a request constrained by a grammar needs its last token on the host for its mask, but only
  to sample: step N+1's forward is launched first, then step N is committed (each grammar
  advances), then the masks are filled and N+1's sampling is launched after its forward;
- aborting a request, or unloading an adapter, that the step in flight computes first waits
  for that step.
Greedy tokens are the same either way: only the order of host work changes.
"""

from __future__ import annotations

import collections
import contextlib
import gc
import itertools
import logging
import time
from dataclasses import dataclass
from typing import Any

import torch

from moelora.config import EngineConfig
from moelora.engine.adapters import AdapterRegistry
from moelora.engine.build import build_engine
from moelora.engine.checks import check_request
from moelora.engine.prefix_cache import namespace, page_hashes
from moelora.errors import AdapterBusyError, AdapterError, EngineDeadError, InvalidRequestError
from moelora.lora.adapter import LoraAdapter
from moelora.lora.slots import LoraTarget
from moelora.runner.sampler import TokenMask
from moelora.sampling_params import SamplingParams
from moelora.step.plan import LaunchedStep, StepPlan
from moelora.step.request import Request, RequestOutput, Status
from moelora.tokenizer import Tokenizer

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class AdapterStats:
    """Where an adapter lives, for a router placing its requests: "gpu" when its current load
    is in a slot or its region on the GPU, "cpu" when only in host memory, "disk" when only in
    its folder (or being read); and its requests in the queues."""

    name: str
    level: str
    num_running: int
    num_waiting: int


@dataclass(frozen=True)
class EngineStats:
    num_running: int
    num_waiting: int
    kv_pages_used: int  # held by requests (a cached page no request holds is not counted)
    kv_pages_total: int
    lora_slots_used: int
    lora_slots_total: int
    graph_replays: int
    eager_steps: int
    graph_capture_seconds: float  # 0 without graphs
    graph_warm_up_seconds: float  # of the capture: every size's first forward, at once
    kv_pages_cached: int = 0  # in the prefix cache, held or not (reset_prefix_cache empties it)
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache (vLLM's count)
    prefix_cache_hits: int = 0  # of them, tokens whose KV was found cached
    lora_slot_refs: int = 0  # one per request holding an adapter slot: 0 when idle
    gpu_memory_allocated: int = 0  # torch's allocated bytes on the engine's device (0 on CPU)
    adapters: tuple[AdapterStats, ...] = ()  # in registration order
    lora_fills: int = 0  # adapters copied into a slot
    lora_fill_bytes: int = 0  # the bytes of their host tensors
    lora_fill_seconds: float = 0.0  # the engine thread's time in those copies
    # hybrid models' recurrent-state slots: held by running requests (and by finished ones
    # until the step in flight is done); 0 of 0 for other models
    state_slots_used: int = 0
    state_slots_total: int = 0
    # their prefix cache's state snapshots at page boundaries: cached of max_state_snapshots
    state_snapshots_cached: int = 0
    state_snapshots_total: int = 0


class Engine:
    def __init__(self, config: EngineConfig):
        self.config = config.resolved()
        # the current CUDA device is per thread and graph capture, its memory pool and every
        # Triton launch follow it, not the tensors: on cuda:1 they must all run under it
        with self.on_device():
            parts = build_engine(self.config)
        self.model_config, self.max_model_len = parts.model_config, parts.max_model_len
        self.shard, self.workers, self.model = parts.shard, parts.workers, parts.model
        self.tokenizer, self.eos_token_ids = parts.tokenizer, parts.eos_token_ids
        self.grammars = parts.grammars
        self.slot_pool, self.slot_table = parts.slot_pool, parts.slot_table
        self.pages, self.scheduler, self.runner = parts.pages, parts.scheduler, parts.runner
        self.adapters: AdapterRegistry = parts.adapters
        # off for a hybrid model without state snapshots (max_state_snapshots=0; build.py)
        self.prefix_caching = parts.prefix_caching
        self._requests: dict[str, Request] = {}
        self._arrivals = itertools.count()
        self._steps = itertools.count()  # each launched step's number (Request.last_step)
        self._fills, self._fill_bytes, self._fill_seconds = 0, 0, 0.0
        # launched, their tokens not yet committed, oldest first: one between steps, two while
        # step() has launched the next and not yet committed the one before
        self._flights: collections.deque[LaunchedStep] = collections.deque()
        self._ready: list[RequestOutput] = []  # committed outside step(): its next answer
        self._seed_source = torch.Generator().manual_seed(self.config.seed)  # per-request seeds
        self._closed = False

    def on_device(self) -> contextlib.AbstractContextManager:
        """The engine's CUDA device made current (for this thread) while the block runs."""
        device = self.config.torch_device
        return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()

    @property
    def model_name(self) -> str:
        return self.config.model_name

    # ---- requests -------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        lora: str | None = None,
        *,
        grammar: Any = None,
    ) -> None:
        """grammar: params.structured_outputs compiled by self.grammars (the server compiles off
        the engine thread); None: compiled here, when the params ask for one."""
        self._check_open()
        if request_id in self._requests:
            raise InvalidRequestError(f"request_id={request_id!r} is already in use")
        if params.stop:
            self.text_tokenizer("stop strings")  # matched on the decoded text
        check_request(
            prompt_token_ids, params, vocab=self.model_config.vocab_size, max_len=self.max_model_len
        )
        self.adapters.check_served(lora)
        gen = None
        if params.temperature > 0:
            seed = params.seed
            if seed is None:
                seed = int(torch.randint(0, 2**62, (1,), generator=self._seed_source))
            gen = torch.Generator(device=self.config.torch_device).manual_seed(seed)
        state = None
        if params.structured_outputs is not None:
            self.text_tokenizer("structured outputs")  # a grammar is over the vocabulary
            state = self.grammars.matcher(
                grammar or self.grammars.compile(params.structured_outputs)
            )
        prompt = [int(t) for t in prompt_token_ids]
        req = Request(request_id, prompt, params, lora, next(self._arrivals), gen)
        req.lora_load = self.adapters.load_number(lora) if lora is not None else None
        if self.prefix_caching:
            req.cache_owner = req.lora_load
            req.cache_namespace = namespace(req.cache_owner, params.cache_salt)
            req.page_hashes = page_hashes(prompt, self.config.page_size, req.cache_namespace)
        req.grammar = state
        self._requests[request_id] = req
        self.scheduler.add(req)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Its pages and slot go back now: a step in flight that computes it is waited for
        first (an abort is rare; a later step() would wait for it anyway). Returns its last
        output, finish_reason "abort" (or the reason it finished with in that step), which no
        step() returns; None for a request the engine does not hold."""
        req = self._requests.get(request_id)
        if req is not None:
            if self._step_computing(req) is not None:
                self.commit_in_flight()
            if req.status is not Status.FINISHED:  # it may have finished in that step
                self._finish(req, "abort")
        # its answers committed outside step() (here, in another abort, or in an unload) and
        # not yet delivered are not delivered by step(): the last one is returned here
        undelivered = [out for out in self._ready if out.request_id == request_id]
        self._ready = [out for out in self._ready if out.request_id != request_id]
        if req is not None:
            return req.to_output()
        return undelivered[-1] if undelivered else None

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._flights) or bool(self._ready)

    def step(self) -> list[RequestOutput]:
        self._check_open()
        with self.on_device():
            return self._step()

    def commit_in_flight(self) -> None:
        """Wait for every step in flight and commit its tokens; their answers come with the
        next step(). Afterwards nothing runs on the device for this engine (what a benchmark
        that plans a step itself needs first)."""
        with self.on_device():
            self._ready += self._commit_all()

    def schedule(self, *, can_preempt: bool = True) -> StepPlan | None:
        """The next step's plan, not launched: fills started for the adapters waiting requests
        need (on the copy stream, beside the step in flight), then the scheduler's plan, whose
        requests' adapters are in their slots (a step waits on the device for a fill still
        running, which the scheduler allows only when nothing else runs). None: the plan needs
        a preemption that can_preempt=False forbids."""
        self._note_fills_landed()
        host: dict[int, LoraAdapter] = {}  # held here: the store may drop its own reference
        failed: list[tuple[int, AdapterError]] = []

        def can_fill(load: int) -> bool:  # its tensors in host memory (else being read)
            try:
                host[load] = self.adapters.host_copy(load)
                if host[load] is not None:
                    self.slot_pool.check_fits(host[load])
            except AdapterError as e:
                failed.append((load, e))
                return False
            return host[load] is not None

        def size_of(load: int) -> int:  # the arena elements of its region
            return self.slot_pool.region_size(host[load])

        for slot, load in self.scheduler.plan_fills(can_fill=can_fill, size_of=size_of):
            start = time.perf_counter()
            region = self.slot_table.regions[slot]
            copy = not self.slot_table.resident[slot]  # a parked region holds it already
            adapter = host[load] if copy else None  # a parked load's host copy is not read
            self.runner.fill_slot(slot, adapter, 0 if region is None else region[0], copy=copy)
            if copy:
                self._fills += 1
                self._fill_bytes += adapter.nbytes
                self._fill_seconds += time.perf_counter() - start
        for load, error in failed:
            self._fail_load(load, error)
        self._note_fills_landed()  # a fill just started may be done (on the CPU it always is)
        return self.scheduler.schedule(can_preempt=can_preempt)

    def _fail_load(self, load: int, error: AdapterError) -> None:
        """Its folder could not be read: its waiting requests end ("abort", with the error);
        others go on, and a later request of it reads the folder again."""
        log.warning("%s: its waiting requests are aborted", error)
        for req in [r for r in self.scheduler.waiting if r.lora_load == load]:
            req.error = str(error)
            self._finish(req, "abort")
            self._ready.append(req.to_output())

    def _note_fills_landed(self) -> None:
        if self.slot_table is None:
            return
        for slot, filling in enumerate(self.slot_table.filling):
            if filling and self.runner.fill_done(slot):
                self.slot_table.filled(slot)

    def _step(self) -> list[RequestOutput]:
        outputs, self._ready = self._ready, []
        overlap = self.config.async_scheduling and not self._penalties_running()
        if not overlap:
            outputs += self._commit_all()
        plan = self.schedule(can_preempt=not self._flights)
        if plan is None:  # a preemption: its pages may be the ones the step in flight writes
            outputs += self._commit_all()
            plan = self.schedule()
        if plan.chunks:
            outputs += self._launch(plan)
        # the step just launched stays in flight; with nothing launched, nothing may wait
        while len(self._flights) > (1 if overlap and plan.chunks else 0):
            outputs += self._commit_oldest()
        if self.adapters.retired:  # the last request of a replaced load may have just gone
            self._forget_retired()
        if not plan.chunks and not self._flights and self.scheduler.waiting:
            self.adapters.wait_for_reads(timeout=0.01)  # adapters being read: do not spin
        return outputs

    def _step_computing(self, req: Request) -> LaunchedStep | None:
        """The step in flight that computes some of req's tokens (its newest: req.last_step)."""
        return next((f for f in self._flights if f.number == req.last_step), None)

    def _penalties_running(self) -> bool:
        """Penalties read every token so far on the host: the last one must be known."""
        reqs = itertools.chain(self.scheduler.running, self.scheduler.waiting)
        return any(r.params.uses_history for r in reqs)

    def _launch(self, plan: StepPlan) -> list[RequestOutput]:
        """Launch the plan's forward, then its sampling. With constrained requests in it, the
        step before is committed in between, while the forward runs: their masks follow every
        token before this step's. Returns the outputs of what was committed."""
        prev = self._flights[-1].tokens if self._flights else None
        step = self.runner.forward_step(plan, prev_tokens=prev)
        step.number = next(self._steps)
        row = 0
        for chunk in plan.chunks:
            req = chunk.request
            req.num_computed_tokens += chunk.num_tokens
            req.last_step = step.number
            if chunk.samples:
                req.add_placeholder(row)
                row += 1
        self._flights.append(step)  # in flight from here: a request finishing now waits for it
        outputs, mask = [], None
        if any(r.grammar is not None for r in step.requests):
            while len(self._flights) > 1:
                outputs += self._commit_oldest()
            mask = self._token_mask(step.requests)
        self.runner.sample_step(step, mask)
        return outputs

    def _token_mask(self, requests: list[Request]) -> TokenMask | None:
        """The bitmask of the rows whose requests are constrained and still running (a row of
        a request that ended in the step just committed samples a token that is dropped)."""
        rows = [
            i
            for i, r in enumerate(requests)
            if r.grammar is not None and r.status is not Status.FINISHED
        ]
        if not rows:
            return None
        return self.grammars.token_mask(rows, [requests[i].grammar for i in rows])

    def _commit_all(self) -> list[RequestOutput]:
        outputs = []
        while self._flights:
            outputs += self._commit_oldest()
        return outputs

    def _commit_oldest(self) -> list[RequestOutput]:
        """Wait for the oldest step in flight and commit its tokens: append, check stops,
        finish."""
        step = self._flights.popleft()
        sampled = step.output()
        outputs = []
        # their pages are written: now they may be shared (before a finish frees them)
        for chunk in step.plan.chunks:
            if chunk.request.cache_namespace is not None:
                self.scheduler.register(chunk.request, chunk.start + chunk.num_tokens)
        self.scheduler.register_snapshots(step.plan.snapshots)  # after their pages
        for i, chunk in enumerate(step.plan.chunks):
            if chunk.request.status is not Status.FINISHED:
                chunk.request.prompt_logprobs += step.prompt_logprobs.get(i, [])
        if sampled is not None:
            tokens, entries = sampled.token_ids(), sampled.logprobs()
            for req, token, entry in zip(step.requests, tokens, entries):
                if req.status is Status.FINISHED:
                    continue  # finished or aborted while this step ran: its token is dropped
                req.commit(token)
                if req.grammar is not None:
                    req.grammar.accept(token)
                if entry is not None:
                    req.output_logprobs.append(entry)
                reason = self._finish_reason(req, token)
                if reason is not None:
                    self._finish(req, reason)
                outputs.append(req.to_output())
        for req in step.release_after:
            self.scheduler.release(req)
        return outputs

    def _finish(self, req: Request, reason: str) -> None:
        """Finished: out of the queues now; its pages and slot once no step in flight uses
        them."""
        step = self._step_computing(req)
        self.scheduler.finish(req, reason, release=step is None)
        if step is not None:
            step.release_after.append(req)
        req.drop_placeholders()
        self._requests.pop(req.request_id, None)

    def text_tokenizer(self, needed_for: str) -> Tokenizer:
        """The tokenizer, or an InvalidRequestError saying the model folder has none."""
        if self.tokenizer is None:
            raise InvalidRequestError(
                f"{needed_for} need a tokenizer and this model folder has none: give prompts "
                "as token id lists and stops as stop_token_ids"
            )
        return self.tokenizer

    def _finish_reason(self, req: Request, token: int) -> str | None:
        """After `token` is committed: why the request ends there, if it does."""
        p = req.params
        seen = len(req.text)
        if self.tokenizer is not None:
            delta, req.detok_offsets = self.tokenizer.decode_incremental(
                req.output_token_ids, req.detok_offsets, end=req.num_outputs
            )
            req.text += delta
            for stop in p.stop or []:  # only where the new text can complete a match
                cut = req.text.find(stop, max(0, seen - len(stop) + 1))
                if cut >= 0:
                    req.text = req.text[:cut]
                    return "stop"
        stop_ids = p.stop_token_ids or []
        stop_token = token in self.eos_token_ids or token in stop_ids
        ends = (not p.ignore_eos and token in self.eos_token_ids) or token in stop_ids
        # ignore_eos too: a terminated grammar is complete
        if ends or (req.grammar is not None and req.grammar.terminated):
            if stop_token:  # as vLLM: a stop token's text is not output, special or not
                req.text = req.text[:seen]
            return "stop"
        known = len(req.prompt_token_ids) + req.num_outputs
        if req.num_outputs >= p.max_tokens or known >= self.max_model_len:
            return "length"
        return None

    # ---- adapters: the registry's, and their slots ----------------------------------------

    @property
    def lora_targets(self) -> dict[str, LoraTarget]:
        """The model's LoRA-capable projections (what an adapter may hold), by target key."""
        return self.adapters.targets

    def load_lora(self, name: str, path: str, *, replace: bool = False) -> None:
        """Register the PEFT folder `path` as `name`. replace=True swaps the weights of an
        adapter served under `name` (or loads it if none is): requests added from now on use
        the new weights, those added before finish on the old, and the prefix cache does not
        share pages between the two."""
        self.adapters.load(name, path, replace=replace)
        self._forget_retired()

    def load_lora_from_tensors(
        self,
        name: str,
        tensors: dict[str, torch.Tensor],
        peft_config: dict,
        *,
        replace: bool = False,
    ) -> None:
        """load_lora for a PEFT state dict and its adapter_config as a dict (no folder)."""
        self.adapters.load_tensors(name, tensors, peft_config, replace=replace)
        self._forget_retired()

    def add_adapter(self, adapter: LoraAdapter, *, replace: bool = False) -> None:
        """Register an adapter already in the slot layout (load_lora parses a PEFT folder into
        one; lora.adapter.random_adapter makes one for benchmarks). Its slot is filled on
        demand, when a request needs it."""
        self.adapters.add(adapter, replace=replace)
        self._forget_retired()

    def _forget_retired(self) -> None:
        """Loads replaced under their name that no request uses any more: out of their slot
        (none held, no step in flight reads it), their cached pages dropped, forgotten."""
        for load in self.adapters.retired:
            in_flight = any(
                c.request.lora_load == load for f in self._flights for c in f.plan.chunks
            )
            slot = self.slot_table.slot_of(load)
            if (
                in_flight
                or self.scheduler.uses_load(load)
                or (slot is not None and self.slot_table.refs[slot] > 0)
            ):
                continue
            if slot is not None:
                self.slot_table.evict(load)
                self.runner.clear_slot(slot)
            self.scheduler.drop_cached(load)
            self.adapters.forget(load)

    def unload_lora(self, name: str) -> None:
        self.adapters.check_loaded(name)
        if any(c.request.lora == name for f in self._flights for c in f.plan.chunks):
            # the step in flight reads its slot, and its requests may still finish there
            self.commit_in_flight()
        if self.scheduler.uses_adapter(name):
            raise AdapterBusyError(
                f"adapter {name!r} has requests in flight: unload it once they finish"
            )
        load = self.adapters.remove(name)
        slot = self.slot_table.evict(load)
        if slot is not None:
            self.runner.clear_slot(slot)
        self.scheduler.drop_cached(load)  # its KV and states are never read again

    def list_loras(self) -> list[str]:
        return list(self.adapters)

    def reset_prefix_cache(self) -> bool:
        """vLLM's: every cached page (and a hybrid model's every state snapshot) leaves the
        prefix cache (pages no request holds are free again); later requests compute their
        prompts anew. True: done."""
        self.scheduler.drop_cached(everything=True)
        return True

    def close(self) -> None:
        """Stop and join the other ranks of a tensor-parallel engine, and let go of what the
        engine holds on the device (weights, KV cache, adapter slots and adapters, graphs), so
        that another engine can be built in this process at once; the engine cannot step after
        it (EngineDeadError). Closing again does nothing."""
        if self._closed:
            return
        self._closed = True
        with self.on_device():
            try:
                self.runner.close()
            finally:
                self._release()

    def _release(self) -> None:
        with self.on_device():
            self._flights.clear()
            self._ready.clear()
            self._requests.clear()
            self.adapters.clear()
            self.model = self.slot_pool = None
            if self.config.torch_device.type == "cuda":
                torch.cuda.synchronize()
                gc.collect()  # the graphs' and kernels' closures refer to one another
                torch.cuda.empty_cache()

    def _check_open(self) -> None:
        if self._closed:
            raise EngineDeadError("the engine is closed: build another to go on")

    def stats(self) -> EngineStats:
        graphs, states = self.runner.graphs, self.scheduler.states
        snapshots = self.scheduler.snapshots
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            kv_pages_used=self.pages.num_used,
            kv_pages_total=self.pages.num_pages,
            lora_slots_used=self.slot_table.num_used if self.slot_table else 0,
            lora_slots_total=self.config.max_loras if self.slot_table else 0,
            graph_replays=self.runner.num_graph_replays,
            eager_steps=self.runner.num_eager_steps,
            graph_capture_seconds=graphs.capture_seconds if graphs else 0.0,
            graph_warm_up_seconds=graphs.warm_up_seconds if graphs else 0.0,
            kv_pages_cached=self.pages.num_cached,
            prefix_cache_queries=self.scheduler.prefix_cache_queries,
            prefix_cache_hits=self.scheduler.prefix_cache_hits,
            lora_slot_refs=self.slot_table.num_refs if self.slot_table else 0,
            gpu_memory_allocated=self._gpu_memory_allocated(),
            adapters=self._adapter_stats(),
            lora_fills=self._fills,
            lora_fill_bytes=self._fill_bytes,
            lora_fill_seconds=self._fill_seconds,
            state_slots_used=states.num_used if states else 0,
            state_slots_total=states.num_slots if states else 0,
            state_snapshots_cached=snapshots.num_cached if snapshots else 0,
            state_snapshots_total=snapshots.num_snapshots if snapshots else 0,
        )

    def _adapter_stats(self) -> tuple[AdapterStats, ...]:
        running = collections.Counter(r.lora for r in self.scheduler.running)
        waiting = collections.Counter(r.lora for r in self.scheduler.waiting)
        return tuple(
            AdapterStats(name, self._level(name), running[name], waiting[name])
            for name in self.adapters
        )

    def _level(self, name: str) -> str:
        if self.slot_table.on_gpu(self.adapters.load_number(name)):
            return "gpu"
        return "cpu" if self.adapters.level(name) == "host" else "disk"

    def _gpu_memory_allocated(self) -> int:
        """Bytes torch has allocated on this engine's device (rank 0's, with several ranks)."""
        device = self.config.torch_device
        return torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
