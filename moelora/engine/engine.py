"""The engine: builds model, caches, adapter slots and scheduler once; then steps.

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
import itertools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from moelora.config import EngineConfig
from moelora.engine.checks import check_request
from moelora.engine.grammar import Grammars
from moelora.engine.kv_cache import PageAllocator, allocate_kv_caches, page_bytes
from moelora.engine.prefix_cache import namespace, page_hashes
from moelora.engine.ranks import kv_config, load_model, make_rank_ops, start_workers
from moelora.engine.scheduler import Scheduler, SchedulerConfig
from moelora.errors import (
    AdapterBusyError,
    AdapterError,
    AdapterExistsError,
    AdapterNotFoundError,
    InvalidRequestError,
    ModelConfigError,
)
from moelora.kernels.ops import Ops
from moelora.lora.adapter import LoraAdapter, load_adapter
from moelora.lora.shard import full_targets
from moelora.lora.slots import LoraTarget, SlotPool, SlotTable
from moelora.models.registry import read_model_config
from moelora.models.shard import check_divides
from moelora.parallel import SINGLE
from moelora.runner.model_runner import LaunchedStep, ModelRunner
from moelora.runner.sampler import TokenMask
from moelora.sampling_params import SamplingParams
from moelora.step.batch import HostBatch, pages_for
from moelora.step.plan import StepPlan
from moelora.step.request import Request, RequestOutput, Status
from moelora.tokenizer import Tokenizer, eos_ids_from_folder

log = logging.getLogger(__name__)

_CPU_KV_BUDGET = 256 << 20  # bytes of KV cache on CPU when num_pages is not given
_GPU_RESERVE = 2 << 30  # bytes kept free on the GPU for activations and graphs


@dataclass(frozen=True)
class EngineStats:
    num_running: int
    num_waiting: int
    kv_pages_used: int  # held by requests
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


@dataclass
class InFlight:
    """A launched step whose tokens the engine has not committed yet."""

    number: int
    plan: StepPlan
    step: LaunchedStep | None  # None only inside _launch: forward launched, sampling not yet
    release_after: list[Request] = field(default_factory=list)  # finished while it ran


@dataclass(frozen=True)
class PlannedStep:
    """The next step, planned but not run (Engine.plan_step), for benchmarks and profilers."""

    inputs: HostBatch  # the step's inputs as the runner laid them out
    request_ids: list[str]  # the requests of its chunks, in row order
    uses_graph: bool  # whether step() would replay a CUDA graph for it
    _runner: ModelRunner

    def forward_fn(self, *, eager: bool = False) -> Callable[[], torch.Tensor]:
        """ModelRunner.forward_fn: the step's forward (a graph replay or eager), to call again
        and again."""
        return self._runner.forward_fn(self.inputs, eager=eager)

    def logits_fn(self, *, eager: bool = False) -> Callable[[], torch.Tensor]:
        """ModelRunner.logits_fn: the step's forward and lm_head, to call again and again."""
        return self._runner.logits_fn(self.inputs, eager=eager)

    def routed_experts(self) -> list[torch.Tensor]:
        """Each MoE layer's top-k expert ids [T, K] for the step, from one eager forward."""
        return self._runner.routed_experts(self.inputs)


class Engine:
    def __init__(self, config: EngineConfig):
        cfg = config.resolved()
        self.config = cfg
        # the current CUDA device is per thread and graph capture, its memory pool and every
        # Triton launch follow it, not the tensors: on cuda:1 they must all run under it
        self.workers = None
        with self.on_device():
            try:
                self._build(cfg)
            except BaseException:
                if self.workers is not None:  # started before the failure: stop them now
                    self.workers.close()
                raise

    def _build(self, cfg: EngineConfig) -> None:
        self.model_config, hf = read_model_config(cfg.model)
        max_len = self._requested_max_len()
        self.shard, self.workers = SINGLE, None
        ops = make_rank_ops(cfg, self.shard, cfg.torch_device)
        if self.model_config.experts_mxfp4 and not ops.keeps_mxfp4:
            # resolved before the model is built: these kernels get the experts dequantized
            self.model_config = replace(self.model_config, experts_mxfp4=False)
        if cfg.tensor_parallel_size > 1:
            check_divides(
                self.model_config,
                cfg.tensor_parallel_size,
                expert_parallel=cfg.enable_expert_parallel,
            )
            self.shard, self.workers = start_workers(cfg, self.model_config, hf, max_len)
            ops = make_rank_ops(cfg, self.shard, cfg.torch_device)
        self.model = load_model(cfg, self.model_config, hf, max_len, ops, cfg.torch_device)
        self.tokenizer, self.eos_token_ids = self._load_tokenizer()
        self.grammars = None  # structured outputs need the tokenizer's vocabulary
        if self.tokenizer is not None:
            vocab = self.model_config.vocab_size
            self.grammars = Grammars(self.tokenizer, vocab, self.eos_token_ids)
        self.slot_pool = self.slot_table = None
        if cfg.enable_lora:
            self.slot_pool = SlotPool(
                self.model,
                cfg.max_loras,
                cfg.max_lora_rank,
                dtype=cfg.torch_dtype,
                device=cfg.torch_device,
            )
            self.slot_table = SlotTable(cfg.max_loras)
        num_pages = cfg.num_pages or self._auto_num_pages(max_len)
        self._build_runner(num_pages, max_len, ops)
        self.adapters: dict[str, LoraAdapter] = {}
        # each adapter's load, a number no other load ever gets: its prefix-cache namespace
        self._adapter_loads: dict[str, int] = {}
        self._loads = itertools.count()
        self._requests: dict[str, Request] = {}
        self._arrivals = itertools.count()
        self._steps = itertools.count()  # each launched step's number (Request.last_step)
        # launched, their tokens not yet committed, oldest first: one between steps, two while
        # step() has launched the next and not yet committed the one before
        self._flights: collections.deque[InFlight] = collections.deque()
        self._ready: list[RequestOutput] = []  # committed outside step(): its next answer
        self._seed_source = torch.Generator().manual_seed(cfg.seed)  # per-request seeds
        for name, path in cfg.lora_modules.items():
            self.load_lora(name, path)
        log.info(
            "engine ready: %s on %s (%s), %d KV pages of %d tokens",
            self.model_config.arch,
            cfg.torch_device,
            cfg.dtype,
            num_pages,
            cfg.page_size,
        )

    def _requested_max_len(self) -> int:
        cfg, mc = self.config, self.model_config
        if cfg.max_model_len is not None and cfg.max_model_len > mc.max_position_embeddings:
            raise ModelConfigError(
                f"max_model_len={cfg.max_model_len} is invalid: expected at most the model's "
                f"max_position_embeddings={mc.max_position_embeddings}"
            )
        return cfg.max_model_len or mc.max_position_embeddings

    def _load_tokenizer(self) -> tuple[Tokenizer | None, frozenset[int]]:
        path = self.config.model
        eos = eos_ids_from_folder(path, list(self.model_config.eos_token_ids))
        if not Tokenizer.exists(path):
            return None, frozenset(eos)
        tokenizer = Tokenizer(path, eos)
        return tokenizer, frozenset(tokenizer.eos_token_ids)

    def _build_runner(self, num_pages: int, max_len: int, ops: Ops) -> None:
        """The KV cache, the scheduler and the runner (its CUDA graphs captured)."""
        cfg = self.config
        self.max_model_len = min(max_len, num_pages * cfg.page_size)
        if self.max_model_len < max_len:  # said once here, not first at a refused prompt
            log.warning(
                "max_model_len is %d, not %d: the KV cache holds %d pages of %d tokens",
                self.max_model_len,
                max_len,
                num_pages,
                cfg.page_size,
            )
        if self.workers is not None:
            self.workers.send(num_pages)  # what each worker's KV cache holds too
        kv = allocate_kv_caches(
            kv_config(self.model_config, self.shard),
            num_pages,
            cfg.page_size,
            dtype=cfg.torch_dtype,
            device=cfg.torch_device,
        )
        self.pages = PageAllocator(num_pages)
        self.scheduler = Scheduler(
            SchedulerConfig(
                cfg.max_num_seqs,
                cfg.max_num_batched_tokens,
                cfg.page_size,
                max_model_len=self.max_model_len,
            ),
            self.pages,
            self.slot_table,
        )
        self.runner = ModelRunner(
            self.model, kv, self.slot_pool, cfg.page_size, cfg.torch_device, self.workers
        )
        # graphs would have to capture the collectives on every rank: not yet, so eager
        one_rank = self.workers is None
        if not one_rank and cfg.torch_device.type == "cuda" and not cfg.enforce_eager:
            log.warning(
                "tensor_parallel_size=%d runs every step eagerly: CUDA graphs that capture the "
                "collectives are not implemented yet",
                cfg.tensor_parallel_size,
            )
        if (
            one_rank
            and cfg.torch_device.type == "cuda"
            and not cfg.enforce_eager
            and ops.name != "torch"
        ):
            from moelora.kernels.attention.paged import DENSE_FROM  # Triton: CUDA only

            self.runner.capture_graphs(
                max_bs=min(cfg.max_graph_bs, cfg.max_num_seqs),
                max_pages=pages_for(self.max_model_len, cfg.page_size),
                spare_page=num_pages,
                max_prefill_tokens=min(cfg.max_prefill_graph_tokens, cfg.max_num_batched_tokens),
                max_seqs=cfg.max_num_seqs,
                dense_from=DENSE_FROM if cfg.prefill_attention_backend == "cudnn" else 0,
            )

    def on_device(self) -> contextlib.AbstractContextManager:
        """The engine's CUDA device made current (for this thread) while the block runs."""
        device = self.config.torch_device
        return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()

    @property
    def model_name(self) -> str:
        return self.config.model_name

    def _auto_num_pages(self, max_len: int) -> int:
        cfg = self.config
        per_page = page_bytes(
            kv_config(self.model_config, self.shard), cfg.page_size, cfg.torch_dtype
        )
        per_seq = pages_for(max_len, cfg.page_size)
        if cfg.torch_device.type == "cuda":
            free, total = torch.cuda.mem_get_info(cfg.torch_device)
            budget = int(total * cfg.gpu_memory_utilization) - (total - free) - _GPU_RESERVE
            if budget < per_page * per_seq:
                raise ModelConfigError(
                    f"gpu_memory_utilization={cfg.gpu_memory_utilization} leaves "
                    f"{budget >> 20} MiB for the KV cache, expected at least "
                    f"{(per_page * per_seq) >> 20} MiB (one sequence of max_model_len)"
                )
            return budget // per_page
        fit = max(_CPU_KV_BUDGET // per_page, 4 * per_seq)
        return min(fit, per_seq * cfg.max_num_seqs)

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
        if request_id in self._requests:
            raise InvalidRequestError(f"request_id={request_id!r} is already in use")
        if params.stop:
            self.text_tokenizer("stop strings")  # matched on the decoded text
        check_request(
            prompt_token_ids, params, vocab=self.model_config.vocab_size, max_len=self.max_model_len
        )
        if lora is not None and lora not in self.adapters:
            raise AdapterNotFoundError(
                f"model {lora!r} is not served: expected the base model {self.model_name!r} "
                f"or one of the adapters {sorted(self.adapters)}"
            )
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
        if self.config.enable_prefix_caching:
            req.cache_owner = self._adapter_loads[lora] if lora is not None else None
            req.cache_namespace = namespace(req.cache_owner, params.cache_salt)
            req.page_hashes = page_hashes(prompt, self.config.page_size, req.cache_namespace)
        req.grammar = state
        self._requests[request_id] = req
        self.scheduler.add(req)

    def abort_request(self, request_id: str) -> None:
        """Its pages and slot go back now: a step in flight that computes it is waited for
        first (an abort is rare; a later step() would wait for it anyway)."""
        req = self._requests.get(request_id)
        if req is not None:
            if self._step_computing(req) is not None:
                with self.on_device():
                    self._ready += self._commit_all()
            if req.status is not Status.FINISHED:  # it may have finished in that step
                self._finish(req, "abort")
        # its answers committed outside step() (here, in another abort, or in an unload) and
        # not yet delivered are dropped: the caller gave up on them
        self._ready = [out for out in self._ready if out.request_id != request_id]

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._flights) or bool(self._ready)

    def step(self) -> list[RequestOutput]:
        with self.on_device():
            return self._step()

    def _schedule(self, *, can_preempt: bool = True) -> StepPlan | None:
        """The scheduler's plan, with the adapters it needs copied into their slots (after
        every step in flight, in stream order)."""
        plan = self.scheduler.schedule(can_preempt=can_preempt)
        for slot, name in plan.lora_loads if plan is not None else ():
            self.runner.fill_slot(slot, self.adapters[name])
        return plan

    def _step(self) -> list[RequestOutput]:
        outputs, self._ready = self._ready, []
        overlap = self.config.async_scheduling and not self._penalties_running()
        if not overlap:
            outputs += self._commit_all()
        plan = self._schedule(can_preempt=not self._flights)
        if plan is None:  # a preemption: its pages may be the ones the step in flight writes
            outputs += self._commit_all()
            plan = self._schedule()
        if plan.chunks:
            outputs += self._launch(plan)
        # the step just launched stays in flight; with nothing launched, nothing may wait
        while len(self._flights) > (1 if overlap and plan.chunks else 0):
            outputs += self._commit_oldest()
        return outputs

    @property
    def _in_flight(self) -> InFlight | None:
        """The step launched last and not yet committed."""
        return self._flights[-1] if self._flights else None

    def _step_computing(self, req: Request) -> InFlight | None:
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
        prev = self._flights[-1].step.tokens if self._flights else None
        forwarded = self.runner.forward_step(plan, prev_tokens=prev)
        flight = InFlight(next(self._steps), plan, None)
        row = 0
        for chunk in plan.chunks:
            req = chunk.request
            req.num_computed_tokens += chunk.num_tokens
            req.last_step = flight.number
            if chunk.samples:
                req.add_placeholder(row)
                row += 1
        self._flights.append(flight)  # in flight from here: a request finishing now waits for it
        outputs, mask = [], None
        if any(r.grammar is not None for r in forwarded.requests):
            while len(self._flights) > 1:
                outputs += self._commit_oldest()
            mask = self._token_mask(forwarded.requests)
        flight.step = self.runner.sample_step(forwarded, mask)
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
        flight = self._flights.popleft()
        result = flight.step.output()
        outputs = []
        # their pages are written: now they may be shared (before a finish frees them)
        for chunk in flight.plan.chunks:
            if chunk.request.cache_namespace is not None:
                self.scheduler.register(chunk.request, chunk.start + chunk.num_tokens)
        for i, chunk in enumerate(flight.plan.chunks):
            if chunk.request.status is not Status.FINISHED:
                chunk.request.prompt_logprobs += result.prompt_logprobs.get(i, [])
        for chunk, sample in zip((c for c in flight.plan.chunks if c.samples), result.samples):
            req = chunk.request
            if req.status is Status.FINISHED:
                continue  # finished or aborted while this step ran: its token is dropped
            req.commit(sample.token_id)
            if req.grammar is not None:
                req.grammar.accept(sample.token_id)
            if sample.logprobs is not None:
                req.output_logprobs.append(sample.logprobs)
            reason = self._finish_reason(req, sample.token_id)
            if reason is not None:
                self._finish(req, reason)
            outputs.append(req.to_output())
        for req in flight.release_after:
            self.scheduler.release(req)
        return outputs

    def _finish(self, req: Request, reason: str) -> None:
        """Finished: out of the queues now; its pages and slot once no step in flight uses
        them."""
        flight = self._step_computing(req)
        self.scheduler.finish(req, reason, release=flight is None)
        if flight is not None:
            flight.release_after.append(req)
        req.drop_placeholders()
        self._requests.pop(req.request_id, None)

    def plan_step(self) -> PlannedStep:
        """For benchmarks and profilers: the next step as step() would run it, planned (its
        adapters in their slots) but not run. Time its `logits_fn()`; nothing is sampled or
        committed, so the requests stay as they are: abort them when done."""
        with self.on_device():
            self._ready += self._commit_all()
            plan = self._schedule()
            inputs = self.runner.host_batch(plan)
            graphs = self.runner.graphs
            return PlannedStep(
                inputs=inputs,
                request_ids=[c.request.request_id for c in plan.chunks],
                uses_graph=graphs is not None and graphs.can_run(inputs),
                _runner=self.runner,
            )

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
        if self.tokenizer is not None:
            seen = len(req.text)
            delta, req.detok_offsets = self.tokenizer.decode_incremental(
                req.output_token_ids, req.detok_offsets, end=req.num_outputs
            )
            req.text += delta
            for stop in p.stop or []:  # only where the new text can complete a match
                cut = req.text.find(stop, max(0, seen - len(stop) + 1))
                if cut >= 0:
                    req.text = req.text[:cut]
                    return "stop"
        if (not p.ignore_eos and token in self.eos_token_ids) or token in (p.stop_token_ids or []):
            return "stop"
        if req.grammar is not None and req.grammar.terminated:  # ignore_eos too: it is complete
            return "stop"
        known = len(req.prompt_token_ids) + req.num_outputs
        if req.num_outputs >= p.max_tokens or known >= self.max_model_len:
            return "length"
        return None

    # ---- adapters -------------------------------------------------------------------------

    @property
    def lora_targets(self) -> dict[str, LoraTarget]:
        """The model's LoRA-capable projections (what an adapter may hold), by target key."""
        self._require_lora()
        return full_targets(self.slot_pool.targets, self.shard, self.model_config)

    def _require_lora(self) -> None:
        if self.slot_pool is None:
            raise InvalidRequestError("LoRA is disabled in this engine (enable_lora=False)")

    def load_lora(self, name: str, path: str) -> None:
        self._check_new_adapter(name)
        adapter = load_adapter(
            name,
            path,
            self.lora_targets,
            max_rank=self.config.max_lora_rank,
            dtype=self.config.torch_dtype,
        )
        self.add_adapter(adapter)

    def add_adapter(self, adapter: LoraAdapter) -> None:
        """Register an adapter already in the slot layout (load_lora parses a PEFT folder into
        one; lora.adapter.random_adapter makes one for benchmarks). Its slot is filled on
        demand, when a request needs it."""
        self._check_new_adapter(adapter.name)
        if adapter.rank > self.config.max_lora_rank:
            raise AdapterError(
                f"adapter {adapter.name!r} has rank {adapter.rank}, expected at most "
                f"max_lora_rank={self.config.max_lora_rank}"
            )
        self.adapters[adapter.name] = adapter
        self._adapter_loads[adapter.name] = next(self._loads)

    def _check_new_adapter(self, name: str) -> None:
        self._require_lora()
        if name in self.adapters or name == self.model_name:
            raise AdapterExistsError(f"an adapter or model named {name!r} is already loaded")

    def unload_lora(self, name: str) -> None:
        if name not in self.adapters:
            raise AdapterNotFoundError(f"adapter {name!r} is not loaded")
        if any(c.request.lora == name for f in self._flights for c in f.plan.chunks):
            # the step in flight reads its slot, and its requests may still finish there
            with self.on_device():
                self._ready += self._commit_all()
        if self.scheduler.uses_adapter(name):
            raise AdapterBusyError(
                f"adapter {name!r} has requests in flight: unload it once they finish"
            )
        slot = self.slot_table.evict(name)
        if slot is not None:
            self.runner.clear_slot(slot)
        del self.adapters[name]
        self.pages.drop_owner(self._adapter_loads.pop(name))  # its KV is never read again

    def reset_prefix_cache(self) -> bool:
        """vLLM's: every cached page leaves the prefix cache (those no request holds are free
        again); later requests compute their prompts anew. True: done."""
        self.pages.reset_cache()
        return True

    def close(self) -> None:
        """Stop and join the other ranks of a tensor-parallel engine (a no-op on one rank);
        the engine cannot step after it."""
        self.runner.close()

    def list_loras(self) -> list[str]:
        return list(self.adapters)

    def stats(self) -> EngineStats:
        graphs = self.runner.graphs
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
        )
