"""CUDA graphs for decode: one graph per batch size, keyed by (batch_size, stream_idx).

The LoRA path is always recorded: at capture every slot is disabled, and the LoRA kernels read
slot_enabled / slot_of_token from static buffers when they run, so one graph serves base-only,
single-adapter and mixed batches alike. Before replay the step's tokens, positions, page table
and LoRA batch info are written into the static buffers in place; padded rows map to the
no-adapter sentinel, to KV slot -1 (nothing stored) and to the spare page.
"""

from __future__ import annotations

import contextvars
import logging
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from moelora.lora.slots import SlotPool
from moelora.step.batch import ForwardBatch, HostBatch, fill_placeholders, forward_batch
from moelora.step.lora import NO_SLOT

log = logging.getLogger(__name__)
STREAM_IDX = 0  # one decode stream today; the key keeps room for more


def graph_batch_sizes(max_bs: int) -> list[int]:
    """[1, 2, 4, 8, 16, 24, 32, ..., max_bs], the largest first (capture order)."""
    sizes = [s for s in (1, 2, 4) if s < max_bs] + list(range(8, max_bs, 8)) + [max_bs]
    return sorted(set(sizes), reverse=True)


def padded_batch_size(num_tokens: int, sizes: list[int]) -> int | None:
    """The smallest captured size that holds the batch (None: too large for any graph)."""
    fitting = [s for s in sizes if s >= num_tokens]
    return min(fitting) if fitting else None


def warm_up_concurrently(
    forward: Callable[[int], object], sizes: list[int], *, compile_threads: int
) -> bool:
    """Run forward(bs) for every size at once, one thread each, while Triton compiles the
    kernels they launch in a pool of compile_threads. Returns False (and runs nothing) where
    this Triton has no AsyncCompileMode.

    Why: a cold capture is mostly compiling, about 80 kernel variants, and warm capture takes
    a few seconds. A compile spends most of its time in MLIR, LLVM and ptxas, outside the GIL.
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
    """Static inputs of every captured graph, sized for the largest batch.

    The int64 and int32 inputs each live in one device buffer with a pinned host twin, so
    writing a step's batch costs two host-to-device copies, whatever its size. There are two
    twins, used in turn: with async scheduling the host writes step N+1's inputs while the copy
    of step N's may still be queued behind step N-1 on the GPU.
    """

    i64: torch.Tensor  # device [3, max_bs]: input_ids, positions, slot_mapping
    # device: cu_seqlens_q | seq_lens | slot_of_token | slot_enabled | any_enabled | pages
    i32: torch.Tensor
    host_i64: torch.Tensor  # pinned twins of the above: [2, ...], one per turn
    host_i32: torch.Tensor
    copied: list  # per twin: the event after its last copy to the device (None: never used)
    max_bs: int
    max_pages: int
    max_loras: int
    spare_page: int
    turn: int = 0  # the twin the last copy used

    @classmethod
    def init(cls, max_bs: int, max_pages: int, max_loras: int, spare_page: int, device):
        n32 = (max_bs + 1) + 2 * max_bs + max_loras + 1 + max_bs * max_pages
        pin = torch.cuda.is_available()
        self = cls(
            i64=torch.zeros(3, max_bs, dtype=torch.int64, device=device),
            i32=torch.zeros(n32, dtype=torch.int32, device=device),
            host_i64=torch.zeros(2, 3, max_bs, dtype=torch.int64, pin_memory=pin),
            host_i32=torch.zeros(2, n32, dtype=torch.int32, pin_memory=pin),
            copied=[None, None],
            max_bs=max_bs,
            max_pages=max_pages,
            max_loras=max_loras,
            spare_page=spare_page,
        )
        self._pad(self.host_i64[0], self.host_i32[0], 0)
        self.i64.copy_(self.host_i64[0])
        self.i32.copy_(self.host_i32[0])
        return self

    def _views(self, i64: torch.Tensor, i32: torch.Tensor) -> dict[str, torch.Tensor]:
        bs, pages, loras = self.max_bs, self.max_pages, self.max_loras
        cu, seq, slot, enabled, any_on, table = i32.split([bs + 1, bs, bs, loras, 1, bs * pages])
        return dict(
            input_ids=i64[0],
            positions=i64[1],
            slot_mapping=i64[2],
            cu_seqlens_q=cu,
            seq_lens=seq,
            slot_of_token=slot,
            slot_enabled=enabled,
            any_enabled=any_on,
            page_table=table.view(bs, pages),
        )

    def forward_batch(self, bs: int, pool: SlotPool | None) -> ForwardBatch:
        """Views of the first bs rows: what a graph of batch size bs is captured with."""
        v = self._views(self.i64, self.i32)
        rows = HostBatch(
            input_ids=v["input_ids"][:bs],
            positions=v["positions"][:bs],
            slot_mapping=v["slot_mapping"][:bs],
            cu_seqlens_q=v["cu_seqlens_q"][: bs + 1],
            seq_lens=v["seq_lens"][:bs],
            page_table=v["page_table"][:bs],
            slot_of_token=v["slot_of_token"][:bs],
            slot_enabled=v["slot_enabled"],
            max_query_len=1,
            any_enabled=v["any_enabled"],
        )
        return forward_batch(rows, pool)

    def copy_from(self, batch: HostBatch, prev_tokens: torch.Tensor | None = None) -> None:
        """Write a decode batch of T rows; every row past T becomes padding. prev_tokens: what
        the batch's placeholder ids stand for (ModelRunner.fill_placeholders)."""
        self.turn = turn = 1 - self.turn
        if self.copied[turn] is not None:
            self.copied[turn].synchronize()  # done long ago, in practice: two steps back
        host_i64, host_i32 = self.host_i64[turn], self.host_i32[turn]
        v = self._views(host_i64, host_i32)
        T = batch.num_tokens
        self._pad(host_i64, host_i32, T)
        v["input_ids"][:T] = batch.input_ids
        v["positions"][:T] = batch.positions
        v["slot_mapping"][:T] = batch.slot_mapping
        v["cu_seqlens_q"][: T + 1] = batch.cu_seqlens_q
        v["seq_lens"][:T] = batch.seq_lens
        v["slot_of_token"][:T] = batch.slot_of_token
        if batch.slot_enabled is not None:
            v["slot_enabled"][:] = batch.slot_enabled
            v["any_enabled"][0] = int(batch.slot_enabled.any())
        width = batch.page_table.shape[1]
        v["page_table"][:T, :width] = batch.page_table
        self.i64.copy_(host_i64, non_blocking=True)
        self.i32.copy_(host_i32, non_blocking=True)
        if prev_tokens is not None:
            fill_placeholders(self.i64[0, :T], prev_tokens)
        if self.i64.is_cuda:
            self.copied[turn] = torch.cuda.Event()
            self.copied[turn].record()

    def _pad(self, i64: torch.Tensor, i32: torch.Tensor, T: int) -> None:
        """Rows from T on: no KV stored, no query rows, no adapter, the spare page."""
        v = self._views(i64, i32)
        v["input_ids"][T:] = 0
        v["positions"][T:] = 0
        v["slot_mapping"][T:] = -1
        v["cu_seqlens_q"][T:] = T
        v["seq_lens"][T:] = 0
        v["slot_of_token"][T:] = NO_SLOT
        v["slot_enabled"][:] = 0
        v["any_enabled"][:] = 0
        v["page_table"][T:] = self.spare_page


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
    ):
        self.forward, self.pool, self.device = forward, pool, device
        self.sizes = graph_batch_sizes(max_bs)
        self.buffers = GraphBuffers.init(
            max_bs, max_pages, pool.max_loras if pool else 1, spare_page, device
        )
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[int, int], torch.Tensor] = {}
        self.capture_seconds = 0.0
        self.warm_up_seconds = 0.0  # of capture_seconds: every size's first forward, at once

    @torch.inference_mode()
    def capture(self) -> None:
        from tqdm import tqdm

        start, mem_before = time.perf_counter(), torch.cuda.memory_allocated()
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        self._warm_up(stream)
        self.warm_up_seconds = time.perf_counter() - start
        for bs in tqdm(self.sizes, desc="capturing CUDA graphs", unit="graph"):
            batch = self.buffers.forward_batch(bs, self.pool)
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                self.forward(batch)  # nothing left to compile: lazy inits only
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=stream):
                out = self.forward(batch)
            self.graphs[(bs, STREAM_IDX)] = graph
            self.outputs[(bs, STREAM_IDX)] = out
        torch.cuda.synchronize()
        self.capture_seconds = time.perf_counter() - start
        log.info(
            "captured %d CUDA graphs in %.1f s (%.1f s of it the warm-up, where kernels compile) "
            "using %.0f MiB",
            len(self.sizes),
            self.capture_seconds,
            self.warm_up_seconds,
            (torch.cuda.memory_allocated() - mem_before) / 2**20,
        )

    def _warm_up(self, stream: torch.cuda.Stream) -> None:
        """Every size's first forward at once, so the kernels compile in parallel. Padded
        inputs: no KV is stored, every row is base, so the forwards can share the stream."""

        def forward(bs: int) -> None:
            # device, stream and inference mode are per thread in torch
            with torch.cuda.device(self.device), torch.cuda.stream(stream), torch.inference_mode():
                self.forward(self.buffers.forward_batch(bs, self.pool))

        threads = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 4
        warm_up_concurrently(forward, self.sizes, compile_threads=threads)
        torch.cuda.synchronize(self.device)

    def can_run(self, batch: HostBatch) -> bool:
        return batch.max_query_len == 1 and batch.num_tokens <= self.sizes[0]

    def run(
        self,
        batch: HostBatch,
        *,
        eager: bool = False,
        prev_tokens: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Replay the graph of the padded batch size. eager=True runs the same padded inputs
        without the graph: the reference the GPU tests hold replays to, bit for bit."""
        T = batch.num_tokens
        if eager:
            bs = padded_batch_size(T, self.sizes)
            self.buffers.copy_from(batch, prev_tokens)
            return self.forward(self.buffers.forward_batch(bs, self.pool))[:T]
        return self.replay_fn(batch, prev_tokens)()[:T]

    def replay_fn(
        self, batch: HostBatch, prev_tokens: torch.Tensor | None = None
    ) -> Callable[[], torch.Tensor]:
        """The batch written into the static inputs, and a function that replays its graph and
        returns the padded output [bs, H] (each call replays again: what benchmarks time)."""
        key = (padded_batch_size(batch.num_tokens, self.sizes), STREAM_IDX)
        self.buffers.copy_from(batch, prev_tokens)
        graph, out = self.graphs[key], self.outputs[key]

        def replay() -> torch.Tensor:
            graph.replay()
            return out

        return replay
