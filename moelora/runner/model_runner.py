"""The runner executes a StepPlan: lays the batch out on the host, runs the model (a captured
graph for steps that fit one, eager otherwise), and samples, each step a LaunchedStep.
"""

from __future__ import annotations

import contextlib
import gc
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch

from moelora.errors import EngineDeadError
from moelora.lora.adapter import LoraAdapter
from moelora.lora.shard import shard_adapter
from moelora.lora.slots import SlotPool
from moelora.runner.graph_runner import GraphRunner
from moelora.runner.sampler import TokenMask, sample, token_logprobs
from moelora.runner.tp import ClearSlot, FillSlot, Forward, Workers, on_host
from moelora.step.batch import ForwardBatch, HostBatch, fill_placeholders
from moelora.step.lora import NO_SLOT
from moelora.step.plan import LaunchedStep, StepPlan

PROMPT_LOGITS_ROWS = 512  # prompt positions whose logits are computed at once


@dataclass(frozen=True)
class _Window:
    """Prompt positions of one chunk whose logits give prompt logprobs."""

    chunk: int  # index in the plan
    rows: torch.Tensor  # [n] int64, rows of the step's hidden states
    targets: torch.Tensor  # [n] int64, the prompt tokens they predict
    top: int  # the request's prompt_logprobs


class ModelRunner:
    # cuBLAS keeps a workspace per (handle, stream) for the whole process, outside any tensor an
    # engine holds, and empty_cache() does not free them: every stream an engine ran matmuls on
    # leaves its workspace behind it. A live engine's captured graphs hold those pointers, so
    # only the last runner on a device frees them.
    _live: ClassVar[weakref.WeakSet[ModelRunner]] = weakref.WeakSet()

    def __init__(
        self,
        model: torch.nn.Module,
        kv_caches: list,
        slot_pool: SlotPool | None,
        page_size: int,
        device: torch.device,
        workers: Workers | None = None,
    ):
        """workers: on rank 0 of a tensor-parallel engine, the other ranks (None elsewhere)."""
        self.model = model
        self.shard = model.shard
        self.workers = workers
        self.kv_caches = kv_caches
        self.slot_pool = slot_pool
        self.page_size = page_size
        self.device = device
        self.graphs: GraphRunner | None = None  # set by capture_graphs
        # slot fills run here, beside the steps: a filled slot has no references, so no step
        # in flight reads it (the scheduler frees a slot only once its last step is done);
        # each fill's event (by slot) orders it before the first step that reads the slot
        self.copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._fill_events: dict[int, torch.cuda.Event] = {}
        self.num_graph_replays = 0
        self.num_eager_steps = 0
        ModelRunner._live.add(self)

    def capture_graphs(
        self,
        *,
        max_bs: int,
        max_pages: int,
        spare_page: int,
        max_prefill_tokens: int = 0,
        max_seqs: int | None = None,
        dense_from: int = 0,
        concurrent_warmup: bool = False,
        spare_state: int | None = None,
    ) -> None:
        """Capture a decode graph per batch size up to max_bs, and a prefill graph per token
        count up to max_prefill_tokens (GraphRunner): from now on, steps that fit one replay
        it. max_pages: pages per sequence; spare_page: the page padded rows point at;
        spare_state: the state slot padded sequences name (a hybrid model's)."""
        self.graphs = GraphRunner(
            self.forward,
            self.slot_pool,
            max_bs=max_bs,
            max_pages=max_pages,
            spare_page=spare_page,
            device=self.device,
            max_prefill_tokens=max_prefill_tokens,
            max_seqs=max_seqs,
            dense_from=dense_from,
            spare_state=spare_state,
        )
        self.graphs.capture(concurrent_warmup=concurrent_warmup)
        # the lm_head runs after a replay, outside the graphs: its first call is made here, so
        # that a batch-invariant linear measures its shape now (that synchronizes), not in a step
        head = self.model.lm_head
        with torch.inference_mode():
            self.model.compute_logits(head.new_zeros(1, head.shape[1]))

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """The model's forward of `batch` over this rank's KV cache: its hidden states [T, H]."""
        return self.model(batch, self.kv_caches)

    @torch.inference_mode()
    def forward_step(self, plan: StepPlan, prev_tokens: torch.Tensor | None = None) -> LaunchedStep:
        """The step launched: one forward over every chunk and the lm_head of each chunk that
        reaches its last token, on the GPU without waiting for it (only prompt logprobs wait);
        nothing is sampled yet (sample_step), so the host may prepare the grammar masks meanwhile.
        prev_tokens: the tokens the step before sampled, still on the device, which the
        placeholders of this plan's inputs stand for (-1 - j: its row j)."""
        host = self.host_batch(plan)
        windows = self._prompt_windows(plan, host)
        sampling = [i for i, c in enumerate(plan.chunks) if c.samples]
        rows = [w.rows for w in windows]
        if sampling:
            rows.append(host.cu_seqlens_q[1:][sampling].long() - 1)
        _, logits = self.forward_rows(host, prev_tokens, rows)
        prompt_logprobs = self._prompt_logprobs(windows, logits[: len(windows)])
        if not sampling:
            return LaunchedStep(plan, [], None, prompt_logprobs)
        requests = [plan.chunks[i].request for i in sampling]
        return LaunchedStep(plan, requests, logits[-1], prompt_logprobs)

    @torch.inference_mode()
    def forward_rows(
        self, host: HostBatch, prev_tokens: torch.Tensor | None, rows: list[torch.Tensor]
    ) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
        """The forward of `host` (its hidden states), then the lm_head's logits [len(r), V] of
        each row set r in `rows` (host int64 indices), in order. With workers, rank 0 sends them
        the same first, and every rank runs this (a worker's logits are None: they went to
        rank 0)."""
        if self.workers is not None:
            self.workers.send(Forward(host, rows))
        self._wait_for_fills(host)
        self._copy_states(host.state_restores)
        with self._collectives():
            if self.graphs is not None and self.graphs.can_run(host):
                hidden = self.graphs.run(host, prev_tokens=prev_tokens)
                self.num_graph_replays += 1
            else:
                # before the fill, which on the CPU writes host.input_ids too (the same tensor)
                placeholders = self.shard.size > 1 and bool((host.input_ids < 0).any())
                batch = self.device_batch(host)
                if prev_tokens is not None:
                    fill_placeholders(batch.input_ids, prev_tokens)
                if placeholders:
                    self.shard.broadcast(batch.input_ids)  # rank 0 alone holds prev_tokens
                hidden = self.forward(batch)
                self.num_eager_steps += 1
            self._copy_states(host.state_saves)
            device_rows = [r.to(self.device, non_blocking=True) for r in rows]
            return hidden, [self.model.compute_logits(hidden[r]) for r in device_rows]

    def _copy_states(self, pairs: tuple[tuple[int, int], ...]) -> None:
        """Rows `from` copied into rows `to` of every linear layer's recurrent-state tensors
        (conv windows and delta-rule states), on the compute stream: in step order with the
        forwards that read and write them. The two sides never share a row."""
        if not pairs:
            return
        src, dst = (torch.tensor(side, device=self.device) for side in zip(*pairs))
        for i, tensors in enumerate(self.kv_caches):
            if self.model.cfg.is_linear(i):
                for t in tensors:
                    t[dst] = t[src]

    @contextlib.contextmanager
    def _collectives(self) -> Iterator[None]:
        """A collective that fails on rank 0 (a worker died in it, or timed out) makes the
        engine dead, with a clear error, rather than leaving the next step to hang."""
        try:
            yield
        except RuntimeError as e:
            if self.workers is None or isinstance(e, EngineDeadError):
                raise
            self.workers.fail(f"a collective failed ({e})")

    @torch.inference_mode()
    def fill_slot(
        self, slot: int, adapter: LoraAdapter | None, start: int = 0, *, copy: bool = True
    ) -> None:
        """The adapter copied into `slot` (its region at `start` in the compact layout), on
        every rank (each rank its part; several ranks keep the old layout, where regions are
        fixed). copy=False: the region holds it already (a parked load, one rank; adapter
        None): the slot is only pointed at it."""
        if self.workers is not None:
            assert copy, "several ranks keep the old layout: no region is ever parked"
            self.workers.send(FillSlot(slot, on_host(adapter)))
        part = shard_adapter(adapter, self.shard, self.model.cfg) if copy else None
        with self._on_copy_stream(slot):
            self.slot_pool.fill(slot, part, start, copy=copy)

    def fill_done(self, slot: int) -> bool:
        """Whether the slot's last fill has landed (on the CPU a fill is done on return)."""
        event = self._fill_events.get(slot)
        if event is not None and not event.query():
            return False
        self._fill_events.pop(slot, None)
        return True

    @torch.inference_mode()
    def clear_slot(self, slot: int) -> None:
        if self.workers is not None:
            self.workers.send(ClearSlot(slot))
        with self._on_copy_stream(slot):  # so a later fill of the slot cannot run before it
            self.slot_pool.clear(slot)

    @contextlib.contextmanager
    def _on_copy_stream(self, slot: int) -> Iterator[None]:
        """Writes of `slot` on the copy stream, its event recorded after them."""
        if self.copy_stream is None:
            yield
            return
        with torch.cuda.stream(self.copy_stream):
            yield
        event = torch.cuda.Event()
        event.record(self.copy_stream)
        self._fill_events[slot] = event

    def _wait_for_fills(self, host: HostBatch) -> None:
        """The compute stream waits for the fills of the slots this step reads (a fill still
        running only when the scheduler let its request run alone)."""
        if not self._fill_events or host.slot_enabled is None:
            return
        compute = torch.cuda.current_stream(self.device)
        for slot in [s for s in self._fill_events if host.slot_enabled[s]]:
            compute.wait_event(self._fill_events.pop(slot))

    def close(self) -> None:
        """Stop and join the workers (a no-op on one rank), then drop what this rank holds on
        the device: weights, KV cache, slots, graphs (their memory pool with them)."""
        try:
            if self.workers is not None:
                self.workers.close()
        finally:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)  # nothing may still read what goes
            release_device_memory(self.model, self.kv_caches, self.slot_pool, self.graphs)
            self.graphs = None
            self.kv_caches = []
            self.slot_pool = None
            self.model = None
            ModelRunner._live.discard(self)
            if self.device.type == "cuda" and self._last_on_device():
                torch._C._cuda_clearCublasWorkspaces()

    def _last_on_device(self) -> bool:
        """No other runner on this device is alive (one dropped but not yet collected, whose
        graphs hold reference cycles, is collected first)."""
        if any(r.device == self.device for r in ModelRunner._live):
            gc.collect()
        return not any(r.device == self.device for r in ModelRunner._live)

    @torch.inference_mode()
    def sample_step(self, step: LaunchedStep, mask: TokenMask | None = None) -> None:
        """Sample a token for each of the step's rows (mask: the constrained rows' grammars),
        launched on the GPU without waiting for it, and start their copy to the host."""
        reqs = step.requests
        if not reqs:
            return
        params = [r.params for r in reqs]
        # the tokens known so far: by now the requests hold this step's placeholders too
        history = (
            [(r.prompt_token_ids, r.output_token_ids[: r.num_outputs]) for r in reqs]
            if any(p.adjusts_logits for p in params)
            else None
        )
        generators = [r.generator for r in reqs]
        step.sampled(sample(step.logits, params, generators, history, mask))

    def device_batch(self, host: HostBatch) -> ForwardBatch:
        """The model's ForwardBatch of `host`, copied to the device (the eager path). A step in
        which no slot is enabled runs without its LoRA launches (lora None), as an engine
        without LoRA does: its host knows they have nothing to do, where a graph's kernels
        find it out on the device, and an eager step is bound by its host's launches."""
        slots = self.slot_pool
        if slots is not None and host.slot_enabled is not None and not host.slot_enabled.any():
            slots = None
        return host.to_device(self.device, slots)

    def _prompt_windows(self, plan: StepPlan, host: HostBatch) -> list[_Window]:
        """The rows whose logits give this step's prompt logprobs (row p of a sequence predicts
        token p + 1), for requests with prompt_logprobs set, PROMPT_LOGITS_ROWS rows at a time,
        so a long prompt does not hold [tokens, vocab] floats at once. Positions a preempted
        request already reported are skipped."""
        windows = []
        for i, c in enumerate(plan.chunks):
            req = c.request
            top = req.params.prompt_logprobs
            if top is None:
                continue
            first = max(c.start, len(req.prompt_logprobs))  # position predicting token first+1
            last = min(c.start + c.num_tokens, len(req.prompt_token_ids) - 1)
            row0 = int(host.cu_seqlens_q[i]) + first - c.start
            for r in range(0, last - first, PROMPT_LOGITS_ROWS):
                n = min(PROMPT_LOGITS_ROWS, last - first - r)
                targets = req.prompt_token_ids[first + r + 1 : first + r + 1 + n]
                rows = torch.arange(row0 + r, row0 + r + n)
                windows.append(_Window(i, rows, torch.tensor(targets), top))
        return windows

    def _prompt_logprobs(
        self, windows: list[_Window], logits: list[torch.Tensor]
    ) -> dict[int, list[dict[int, float]]]:
        """{chunk index: entries} of the windows' logits."""
        found: dict[int, list[dict[int, float]]] = {}
        for w, window_logits in zip(windows, logits):
            logprobs = window_logits.log_softmax(dim=-1)
            targets = w.targets.to(self.device)
            found.setdefault(w.chunk, []).extend(token_logprobs(logprobs, targets, w.top))
        return found

    def host_batch(self, plan: StepPlan) -> HostBatch:
        """The step's inputs on the host. Python touches each chunk once (its tokens, its row of
        pages, copied whole from Request.page_array); positions, KV slots and adapter slots per
        token are computed for all chunks at once. Nothing is O(tokens so far)."""
        ps, B = self.page_size, len(plan.chunks)
        q_lens = np.array([c.num_tokens for c in plan.chunks], np.int64)
        starts = np.array([c.start for c in plan.chunks], np.int64)
        seq_lens = starts + q_lens
        counts = -(-seq_lens // ps)
        table = np.zeros((B, int(counts.max())), np.int32)
        ids, chunk_slots, state_slots = [], [], []
        for b, c in enumerate(plan.chunks):
            req = c.request
            table[b, : counts[b]] = req.page_array[: counts[b]]
            ids += req.token_slice(c.start, c.start + c.num_tokens)
            chunk_slots.append(NO_SLOT if req.slot is None else req.slot)
            state_slots.append(req.state_slot)
        cu = np.zeros(B + 1, np.int64)
        np.cumsum(q_lens, out=cu[1:])
        row = np.repeat(np.arange(B), q_lens)  # the chunk of each token
        step_slots = set(chunk_slots)
        positions = np.arange(int(cu[-1])) - cu[row] + starts[row]
        slot_mapping = table[row, positions // ps].astype(np.int64) * ps + positions % ps
        return HostBatch(
            input_ids=torch.tensor(ids, dtype=torch.int64),
            positions=torch.from_numpy(positions),
            slot_mapping=torch.from_numpy(slot_mapping),
            cu_seqlens_q=torch.from_numpy(cu.astype(np.int32)),
            seq_lens=torch.from_numpy(seq_lens.astype(np.int32)),
            page_table=torch.from_numpy(table),
            slot_of_token=torch.from_numpy(np.repeat(np.array(chunk_slots, np.int32), q_lens)),
            slot_enabled=self._slot_enabled(step_slots),
            max_query_len=int(q_lens.max()),
            chunks=tuple(zip(starts.tolist(), q_lens.tolist())) if q_lens.max() > 1 else None,
            rank_tile=self._rank_tile(step_slots),
            # a hybrid model's requests each hold a state slot while they run; others none
            state_slots=None
            if state_slots[0] is None
            else torch.tensor(state_slots, dtype=torch.int32),
            state_restores=tuple(plan.state_restores),
            state_saves=tuple((s.request.state_slot, s.row) for s in plan.snapshots),
        )

    def _slot_enabled(self, slots: set[int]) -> torch.Tensor | None:
        pool = self.slot_pool
        if pool is None:
            return None
        enabled = torch.zeros(pool.max_loras, dtype=torch.int32)
        for s in slots - {NO_SLOT}:
            enabled[s] = int(pool.host_rank[s] > 0)  # an empty slot does no work
        return enabled

    def _rank_tile(self, slots: set[int]) -> int:
        """The largest real rank of the step's slots (LoraBatchInfo.rank_tile), 0 without any."""
        pool = self.slot_pool
        if pool is None:
            return 0
        return max((pool.host_rank[s] for s in slots - {NO_SLOT}), default=0)


def release_device_memory(*roots: object) -> None:
    """Free the memory of every tensor reachable from roots (through modules, moelora objects,
    dicts, lists and tuples) and drop every CUDA graph's: the memory goes back even where
    something still refers to a tensor (a closure, a traceback's frame), which would keep a
    whole KV cache alive after close(). A tensor freed here has no storage left: any later use
    fails loudly instead of reading another engine's memory."""
    seen: set[int] = set()
    stack = list(roots)
    with torch.inference_mode():
        while stack:
            obj = stack.pop()
            if obj is None or id(obj) in seen:
                continue
            seen.add(id(obj))
            if isinstance(obj, torch.Tensor):
                with contextlib.suppress(RuntimeError):  # a storage that cannot resize (a
                    obj.untyped_storage().resize_(0)  # file mapping) goes by its references
            elif isinstance(obj, torch.cuda.CUDAGraph):
                obj.reset()
            elif isinstance(obj, dict):
                stack += obj.values()
            elif isinstance(obj, (list, tuple, set)):
                stack += obj
            elif isinstance(obj, torch.nn.Module) or type(obj).__module__.startswith("moelora"):
                stack += vars(obj).values() if hasattr(obj, "__dict__") else []
