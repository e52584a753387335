"""CUDA graphs: one graph per decode batch size, keyed by (batch_size, stream_idx, False), and
one per prefill token count, keyed by (tokens, stream_idx, True).

The LoRA path is always recorded: at capture every slot is disabled, and the LoRA kernels read
slot_enabled / slot_of_token from static buffers when they run, so one graph serves base-only,
single-adapter and mixed batches alike. Before replay the step's tokens, positions, page table
and LoRA batch info are written into the static buffers in place; padded rows map to the
no-adapter sentinel, to KV slot -1 (nothing stored) and to the spare page.

A prefill graph holds any step of at most its token count with a prompt chunk in it (mixed with
decodes or not): its attention takes min(tokens, max_num_seqs) sequences, the padded ones with
no tokens, and its programs find their sequence in the step's work table, which the graph
builds from cu_seqlens_q (kernels/attention/paged.attention_work). Why: an eager prefill step
of a many-layer model launches hundreds of kernels, and up to a few thousand tokens their
launches on the host take longer than the kernels on the device; a replay is one launch.
"""

from __future__ import annotations

import contextvars
import gc
import logging
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from moelora.config import graph_batch_sizes, prefill_graph_sizes
from moelora.lora.slots import SlotPool
from moelora.step.batch import (
    ForwardBatch,
    HostBatch,
    dense_runs,
    fill_placeholders,
    forward_batch,
)
from moelora.step.lora import NO_SLOT

log = logging.getLogger(__name__)
STREAM_IDX = 0  # one decode stream today; the key keeps room for more


def padded_batch_size(num_tokens: int, sizes: list[int]) -> int | None:
    """The smallest captured size that holds the batch (None: too large for any graph)."""
    fitting = [s for s in sizes if s >= num_tokens]
    return min(fitting) if fitting else None


def warm_up_concurrently(
    forward: Callable[[Any], object], sizes: list, *, compile_threads: int
) -> bool:
    """Run forward(size) for every size at once, one thread each, while Triton compiles the
    kernels they launch in a pool of compile_threads. Returns False (and runs nothing) where
    this Triton has no AsyncCompileMode.

    Why: a cold capture is mostly compiling the kernels' variants, and a compile spends most
    of its time in MLIR, LLVM and ptxas, outside the GIL.
    One size after another, each compile waits for the one before. All sizes at once, the
    variants of different sizes compile side by side. Threads that need the same variant share
    one compile through Triton's AsyncCompileMode.
    A launch under the mode still blocks its own thread until its kernel is compiled, so each
    forward runs for real, in order, on valid inputs."""
    try:  # a private module (Triton >= 3.4): without it the capture loop compiles serially
        from triton.runtime._async_compile import AsyncCompileMode
    except ImportError:
        return False
    with ThreadPoolExecutor(compile_threads) as compiles, ThreadPoolExecutor(len(sizes)) as pool:
        with AsyncCompileMode(compiles):
            # Triton finds the mode in a context variable: each thread gets a copy of this one
            runs = [pool.submit(contextvars.copy_context().run, forward, bs) for bs in sizes]
            for run in runs:
                run.result()
    return True


@dataclass
class GraphBuffers:
    """Static inputs of every captured graph, sized for the largest step: max_tokens rows (the
    largest decode batch or prefill step) and max_seqs sequences.

    The int64 and int32 inputs each live in one device buffer with a pinned host twin, so
    writing a step's batch costs two host-to-device copies, whatever its size. There are two
    twins, used in turn: with async scheduling the host writes step N+1's inputs while the copy
    of step N's may still be queued behind step N-1 on the GPU.
    """

    i64: torch.Tensor  # device [3, max_tokens]: input_ids, positions, slot_mapping
    # device: cu_seqlens_q | seq_lens | slot_of_token | slot_enabled | any_enabled | pages
    i32: torch.Tensor
    host_i64: torch.Tensor  # pinned twins of the above: [2, ...], one per turn
    host_i32: torch.Tensor
    copied: list  # per twin: the event after its last copy to the device (None: never used)
    max_tokens: int
    max_seqs: int
    max_pages: int
    max_loras: int
    spare_page: int
    # a hybrid model's: the state slot padded sequences name (None: no state slots); the
    # kernels touch no state of a sequence without rows, so it is never read or written
    spare_state: int | None = None
    turn: int = 0  # the twin the last copy used

    @classmethod
    def init(
        cls,
        max_tokens: int,
        max_pages: int,
        max_loras: int,
        spare_page: int,
        device,
        *,
        max_seqs: int | None = None,
        spare_state: int | None = None,
    ):
        """max_seqs: sequences a step may have (default max_tokens: decode steps only);
        spare_state: a hybrid model's spare state slot (its steps carry state slots)."""
        max_seqs = max_tokens if max_seqs is None else max_seqs
        n32 = (max_seqs + 1) + max_seqs + max_tokens + max_loras + 1 + max_seqs * max_pages
        n32 += max_seqs if spare_state is not None else 0
        pin = torch.cuda.is_available()
        self = cls(
            i64=torch.zeros(3, max_tokens, dtype=torch.int64, device=device),
            i32=torch.zeros(n32, dtype=torch.int32, device=device),
            host_i64=torch.zeros(2, 3, max_tokens, dtype=torch.int64, pin_memory=pin),
            host_i32=torch.zeros(2, n32, dtype=torch.int32, pin_memory=pin),
            copied=[None, None],
            max_tokens=max_tokens,
            max_seqs=max_seqs,
            max_pages=max_pages,
            max_loras=max_loras,
            spare_page=spare_page,
            spare_state=spare_state,
        )
        self._pad(self.host_i64[0], self.host_i32[0], 0, 0)
        self.i64.copy_(self.host_i64[0])
        self.i32.copy_(self.host_i32[0])
        return self

    def _views(self, i64: torch.Tensor, i32: torch.Tensor) -> dict[str, torch.Tensor]:
        T, B, pages, loras = self.max_tokens, self.max_seqs, self.max_pages, self.max_loras
        states = B if self.spare_state is not None else 0
        parts = i32.split([B + 1, B, T, loras, 1, B * pages, states])
        cu, seq, slot, enabled, any_on, table, state_slots = parts
        return dict(
            input_ids=i64[0],
            positions=i64[1],
            slot_mapping=i64[2],
            cu_seqlens_q=cu,
            seq_lens=seq,
            slot_of_token=slot,
            slot_enabled=enabled,
            any_enabled=any_on,
            page_table=table.view(B, pages),
            state_slots=state_slots if states else None,
        )

    def forward_batch(
        self, tokens: int, pool: SlotPool | None, *, prefill: bool = False
    ) -> ForwardBatch:
        """Views of the first rows: what a graph is captured with. Decode: `tokens` sequences
        of one token each; prefill: `tokens` rows over prefill_seqs(tokens) sequences."""
        v = self._views(self.i64, self.i32)
        seqs = self.prefill_seqs(tokens) if prefill else tokens
        rows = HostBatch(
            input_ids=v["input_ids"][:tokens],
            positions=v["positions"][:tokens],
            slot_mapping=v["slot_mapping"][:tokens],
            cu_seqlens_q=v["cu_seqlens_q"][: seqs + 1],
            seq_lens=v["seq_lens"][:seqs],
            page_table=v["page_table"][:seqs],
            slot_of_token=v["slot_of_token"][:tokens],
            slot_enabled=v["slot_enabled"],
            max_query_len=tokens if prefill else 1,
            any_enabled=v["any_enabled"],
            state_slots=None if v["state_slots"] is None else v["state_slots"][:seqs],
        )
        return forward_batch(rows, pool)

    def prefill_seqs(self, tokens: int) -> int:
        """The sequences a prefill graph of `tokens` rows takes: every step of that many rows
        has at most that many."""
        return min(self.max_seqs, tokens)

    def copy_from(self, batch: HostBatch, prev_tokens: torch.Tensor | None = None) -> None:
        """Write a batch of T rows and B sequences; every row past T and sequence past B becomes
        padding. prev_tokens: what the batch's placeholder ids stand for
        (ModelRunner.fill_placeholders)."""
        self.turn = turn = 1 - self.turn
        if self.copied[turn] is not None:
            self.copied[turn].synchronize()  # done long ago, in practice: two steps back
        host_i64, host_i32 = self.host_i64[turn], self.host_i32[turn]
        v = self._views(host_i64, host_i32)
        T, B = batch.num_tokens, batch.seq_lens.shape[0]
        self._pad(host_i64, host_i32, T, B)
        v["input_ids"][:T] = batch.input_ids
        v["positions"][:T] = batch.positions
        v["slot_mapping"][:T] = batch.slot_mapping
        v["cu_seqlens_q"][: B + 1] = batch.cu_seqlens_q
        v["seq_lens"][:B] = batch.seq_lens
        v["slot_of_token"][:T] = batch.slot_of_token
        if batch.slot_enabled is not None:
            v["slot_enabled"][:] = batch.slot_enabled
            v["any_enabled"][0] = int(batch.slot_enabled.any())
        width = batch.page_table.shape[1]
        v["page_table"][:B, :width] = batch.page_table
        assert (batch.state_slots is None) == (v["state_slots"] is None), "hybrid: state slots"
        if batch.state_slots is not None:
            v["state_slots"][:B] = batch.state_slots
        self.i64.copy_(host_i64, non_blocking=True)
        self.i32.copy_(host_i32, non_blocking=True)
        if prev_tokens is not None:
            fill_placeholders(self.i64[0, :T], prev_tokens)
        if self.i64.is_cuda:
            self.copied[turn] = torch.cuda.Event()
            self.copied[turn].record()

    def _pad(self, i64: torch.Tensor, i32: torch.Tensor, T: int, B: int) -> None:
        """Rows from T on: no KV stored, no adapter; sequences from B on: no query rows, no KV,
        the spare page (and the spare state slot)."""
        v = self._views(i64, i32)
        v["input_ids"][T:] = 0
        v["positions"][T:] = 0
        v["slot_mapping"][T:] = -1
        v["slot_of_token"][T:] = NO_SLOT
        v["cu_seqlens_q"][B:] = T
        v["seq_lens"][B:] = 0
        v["slot_enabled"][:] = 0
        v["any_enabled"][:] = 0
        v["page_table"][B:] = self.spare_page
        if v["state_slots"] is not None:
            v["state_slots"][B:] = self.spare_state


class GraphRunner:
    """forward(batch) runs the model over the KV cache: what each graph records."""

    def __init__(
        self,
        forward: Callable[[ForwardBatch], torch.Tensor],
        pool: SlotPool | None,
        *,
        max_bs: int,
        max_pages: int,
        spare_page: int,
        device: torch.device,
        max_prefill_tokens: int = 0,
        max_seqs: int | None = None,
        dense_from: int = 0,
        spare_state: int | None = None,
    ):
        """max_prefill_tokens: the largest prefill step captured (0: prefill steps run eager);
        max_seqs: the most sequences a step has (default max_bs); dense_from > 0: prefill steps
        with a first chunk of that many tokens stay eager (their attention is cuDNN's, which
        reads the chunk lengths on the host: dense_runs); spare_state: a hybrid model's spare
        state slot (GraphBuffers)."""
        self.forward, self.pool, self.device = forward, pool, device
        self.sizes = graph_batch_sizes(max_bs)
        self.prefill_sizes = prefill_graph_sizes(max_prefill_tokens)
        self.dense_from = dense_from
        self.buffers = GraphBuffers.init(
            max([max_bs, *self.prefill_sizes[:1]]),
            max_pages,
            pool.max_loras if pool else 1,
            spare_page,
            device,
            max_seqs=max(max_bs, max_seqs or max_bs),
            spare_state=spare_state,
        )
        # (size, STREAM_IDX, prefill) -> the graph and its output: decode graphs by batch
        # size, prefill graphs by tokens
        self.graphs: dict[tuple[int, int, bool], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.capture_seconds = 0.0
        self.warm_up_seconds = 0.0  # of capture_seconds: every size's first forward, at once

    def _shapes(self) -> list[tuple[int, bool]]:
        """(size, prefill) of every graph, the largest steps first (capture order: the ones
        after reuse the pool's memory)."""
        return [(T, True) for T in self.prefill_sizes] + [(bs, False) for bs in self.sizes]

    @torch.inference_mode()
    def capture(self, *, concurrent_warmup: bool = False) -> None:
        """Every graph, after a warm-up forward of each size (concurrent_warmup: all at once,
        a thread each, their kernels compiling side by side; else one after another)."""
        from tqdm import tqdm

        start, mem_before = time.perf_counter(), torch.cuda.memory_allocated()
        gc.collect()  # an engine dropped unclosed is finalized now, not inside a capture
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        self._warm_up(stream, concurrent=concurrent_warmup)
        self.warm_up_seconds = time.perf_counter() - start
        for size, prefill in tqdm(self._shapes(), desc="capturing CUDA graphs", unit="graph"):
            batch = self.buffers.forward_batch(size, self.pool, prefill=prefill)
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                self.forward(batch)  # nothing left to compile: lazy inits only
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            # thread_local: what other threads do meanwhile (the adapter store's reader pins
            # host memory) does not invalidate this thread's capture
            with torch.cuda.graph(
                graph, pool=pool, stream=stream, capture_error_mode="thread_local"
            ):
                out = self.forward(batch)
            self.graphs[(size, STREAM_IDX, prefill)] = graph, out
        torch.cuda.synchronize()
        self.capture_seconds = time.perf_counter() - start
        log.info(
            "captured %d CUDA graphs (%d decode, %d prefill) in %.1f s (%.1f s of it the "
            "warm-up, where kernels compile) using %.0f MiB",
            len(self.sizes) + len(self.prefill_sizes),
            len(self.sizes),
            len(self.prefill_sizes),
            self.capture_seconds,
            self.warm_up_seconds,
            (torch.cuda.memory_allocated() - mem_before) / 2**20,
        )

    def _warm_up(self, stream: torch.cuda.Stream, *, concurrent: bool) -> None:
        """Every graph's first forward at once, so the kernels compile in parallel (not
        concurrent: nothing here). Padded inputs: no KV is stored, every row is base, so the
        forwards can share the stream."""

        def forward(shape: tuple[int, bool]) -> None:
            size, prefill = shape
            # device, stream and inference mode are per thread in torch
            with torch.cuda.device(self.device), torch.cuda.stream(stream), torch.inference_mode():
                self.forward(self.buffers.forward_batch(size, self.pool, prefill=prefill))

        if not concurrent:  # the capture loop's own first forward of each size compiles
            return
        threads = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 4
        warm_up_concurrently(forward, self._shapes(), compile_threads=threads)
        torch.cuda.synchronize(self.device)

    def can_run(self, batch: HostBatch) -> bool:
        if batch.max_query_len == 1:
            return batch.num_tokens <= self.sizes[0]
        if not self.prefill_sizes or batch.num_tokens > self.prefill_sizes[0]:
            return False
        size, _, _ = self._key(batch)
        if batch.seq_lens.shape[0] > self.buffers.prefill_seqs(size):
            return False  # more sequences than the engine said a step has (max_seqs)
        return not (self.dense_from and dense_runs(batch.chunks, self.dense_from))

    def _key(self, batch: HostBatch) -> tuple[int, int, bool]:
        """(padded size, STREAM_IDX, prefill): the key of the batch's graph."""
        prefill = batch.max_query_len > 1
        sizes = self.prefill_sizes if prefill else self.sizes
        return padded_batch_size(batch.num_tokens, sizes), STREAM_IDX, prefill

    def run(
        self,
        batch: HostBatch,
        *,
        eager: bool = False,
        prev_tokens: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Replay the graph of the padded batch size (prefill: token count). eager=True runs the
        same padded inputs without the graph: the reference the GPU tests hold replays to, bit
        for bit."""
        T = batch.num_tokens
        if eager:
            size, _, prefill = self._key(batch)
            self.buffers.copy_from(batch, prev_tokens)
            return self.forward(self.buffers.forward_batch(size, self.pool, prefill=prefill))[:T]
        return self.replay_fn(batch, prev_tokens)()[:T]

    def replay_fn(
        self, batch: HostBatch, prev_tokens: torch.Tensor | None = None
    ) -> Callable[[], torch.Tensor]:
        """The batch written into the static inputs, and a function that replays its graph and
        returns the padded output [size, H] (each call replays again: what benchmarks time)."""
        graph, out = self.graphs[self._key(batch)]
        self.buffers.copy_from(batch, prev_tokens)

        def replay() -> torch.Tensor:
            graph.replay()
            return out

        return replay
