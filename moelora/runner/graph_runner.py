"""CUDA graphs for decode: one graph per batch size, keyed by (batch_size, stream_idx).

The LoRA path is always recorded: at capture every slot is disabled, and the LoRA kernels read
slot_enabled / slot_of_token from static buffers when they run, so one graph serves base-only,
single-adapter and mixed batches alike. Before replay the step's tokens, positions, page table
and LoRA batch info are written into the static buffers in place; padded rows map to the
no-adapter sentinel, to KV slot -1 (nothing stored) and to the spare page.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from moelora.lora.batch_info import NO_SLOT, LoraBatchInfo
from moelora.lora.slots import SlotPool
from moelora.runner.batch import AttentionMetadata, ForwardBatch

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


@dataclass
class GraphBuffers:
    """Static inputs of every captured graph, sized for the largest batch."""

    input_ids: torch.Tensor  # [max_bs] int64
    positions: torch.Tensor  # [max_bs] int64
    slot_mapping: torch.Tensor  # [max_bs] int64
    cu_seqlens_q: torch.Tensor  # [max_bs + 1] int32
    seq_lens: torch.Tensor  # [max_bs] int32
    page_table: torch.Tensor  # [max_bs, max_pages] int32
    slot_of_token: torch.Tensor  # [max_bs] int32
    slot_enabled: torch.Tensor  # [max_loras] int32

    @classmethod
    def init(cls, max_bs: int, max_pages: int, max_loras: int, spare_page: int, device):
        def full(shape, value, dtype):
            return torch.full(shape, value, dtype=dtype, device=device)

        return cls(
            input_ids=full((max_bs,), 0, torch.int64),
            positions=full((max_bs,), 0, torch.int64),
            slot_mapping=full((max_bs,), -1, torch.int64),
            cu_seqlens_q=torch.arange(max_bs + 1, dtype=torch.int32, device=device),
            seq_lens=full((max_bs,), 0, torch.int32),
            page_table=full((max_bs, max_pages), spare_page, torch.int32),
            slot_of_token=full((max_bs,), NO_SLOT, torch.int32),
            slot_enabled=full((max_loras,), 0, torch.int32),
        )

    def forward_batch(self, bs: int, pool: SlotPool | None) -> ForwardBatch:
        """Views of the first bs rows: what a graph of batch size bs is captured with."""
        attn = AttentionMetadata(
            cu_seqlens_q=self.cu_seqlens_q[: bs + 1],
            seq_lens=self.seq_lens[:bs],
            page_table=self.page_table[:bs],
            slot_mapping=self.slot_mapping[:bs],
            max_query_len=1,
        )
        lora = None
        if pool is not None:
            lora = LoraBatchInfo(
                self.slot_of_token[:bs],
                pool.rank_of_slot,
                pool.scaling_of_slot,
                self.slot_enabled,
            )
        return ForwardBatch(self.input_ids[:bs], self.positions[:bs], attn, lora)

    def copy_from(self, batch: ForwardBatch, bs: int, spare_page: int) -> None:
        """Write a decode batch of T <= bs rows in place; rows T..bs become padding."""
        T = batch.input_ids.shape[0]
        self.input_ids[:T].copy_(batch.input_ids)
        self.positions[:T].copy_(batch.positions)
        self.slot_mapping[:T].copy_(batch.attn.slot_mapping)
        self.slot_mapping[T:bs].fill_(-1)
        self.cu_seqlens_q[: T + 1].copy_(batch.attn.cu_seqlens_q)
        self.cu_seqlens_q[T + 1 : bs + 1].fill_(T)  # padded sequences have no query rows
        self.seq_lens[:T].copy_(batch.attn.seq_lens)
        self.seq_lens[T:bs].fill_(0)
        width = batch.attn.page_table.shape[1]
        self.page_table[:T, :width].copy_(batch.attn.page_table)
        self.page_table[T:bs].fill_(spare_page)
        if batch.lora is not None:
            self.slot_of_token[:T].copy_(batch.lora.slot_of_token)
            self.slot_of_token[T:bs].fill_(NO_SLOT)
            self.slot_enabled.copy_(batch.lora.slot_enabled)


class GraphRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        kv_caches: list,
        pool: SlotPool | None,
        *,
        max_bs: int,
        max_pages: int,
        spare_page: int,
        device: torch.device,
    ):
        self.model = model
        self.kv_caches = kv_caches
        self.pool = pool
        self.spare_page = spare_page
        self.sizes = graph_batch_sizes(max_bs)
        self.buffers = GraphBuffers.init(
            max_bs, max_pages, pool.max_loras if pool else 1, spare_page, device
        )
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[int, int], torch.Tensor] = {}
        self.capture_seconds = 0.0

    @torch.inference_mode()
    def capture(self) -> None:
        from tqdm import tqdm

        start, mem_before = time.perf_counter(), torch.cuda.memory_allocated()
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        for bs in tqdm(self.sizes, desc="capturing CUDA graphs", unit="graph"):
            batch = self.buffers.forward_batch(bs, self.pool)
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                self.model(batch, self.kv_caches)  # warm-up: Triton compiles outside capture
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=stream):
                out = self.model(batch, self.kv_caches)
            self.graphs[(bs, STREAM_IDX)] = graph
            self.outputs[(bs, STREAM_IDX)] = out
        torch.cuda.synchronize()
        log.info(
            "captured %d CUDA graphs in %.1f s using %.0f MiB",
            len(self.sizes),
            time.perf_counter() - start,
            (torch.cuda.memory_allocated() - mem_before) / 2**20,
        )

    def can_run(self, batch: ForwardBatch) -> bool:
        return batch.attn.max_query_len == 1 and batch.input_ids.shape[0] <= self.sizes[0]

    def run(self, batch: ForwardBatch, *, eager: bool = False) -> torch.Tensor:
        """Replay the graph of the padded batch size. eager=True runs the same padded inputs
        without the graph: the reference the GPU tests hold replays to, bit for bit."""
        T = batch.input_ids.shape[0]
        bs = padded_batch_size(T, self.sizes)
        self.buffers.copy_from(batch, bs, self.spare_page)
        key = (bs, STREAM_IDX)
        if eager:
            return self.model(self.buffers.forward_batch(bs, self.pool), self.kv_caches)[:T]
        self.graphs[key].replay()
        return self.outputs[key][:T]
