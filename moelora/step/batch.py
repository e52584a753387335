"""What one forward reads: the step's inputs as the runner lays them out (HostBatch), and the
ForwardBatch every layer is handed, built from them by `forward_batch` alone.

Legend: T = tokens, B = sequences, P = pages per sequence, S = adapter slots.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Protocol

import torch

from moelora.step.lora import LoraBatchInfo


def pages_for(num_tokens: int, page_size: int) -> int:
    return -(-num_tokens // page_size)


def fill_placeholders(input_ids: torch.Tensor, prev_tokens: torch.Tensor) -> None:
    """Input ids -1 - j become prev_tokens[j], on the device: the tokens the step before sampled
    reach this step without a trip through the host. [T] int64 in place; prev_tokens [N]."""
    index = (-1 - input_ids).clamp(min=0)
    input_ids.copy_(torch.where(input_ids < 0, prev_tokens[index], input_ids))


def dense_runs(
    chunks: tuple[tuple[int, int], ...] | None, dense_from: int
) -> list[tuple[int, int]]:
    """(first row, tokens) of each sequence whose chunk starts at position 0 (its whole KV is
    the step's own) with at least dense_from tokens. The choice is each sequence's own, never
    its batch-mates': the paged attention kernel skips the same sequences on the device
    (seq_len == q_len >= dense_from), and a step with any stays out of the prefill graphs."""
    runs, row = [], 0
    for start, n in chunks or ():
        if start == 0 and n >= dense_from:
            runs.append((row, n))
        row += n
    return runs


@dataclass(frozen=True)
class AttentionMetadata:
    """Token j of sequence b (j < q_len_b) sits at position seq_len_b - q_len_b + j and attends to
    KV positions 0..that position. Padded rows have slot_mapping -1 (their KV is not stored).
    """

    cu_seqlens_q: torch.Tensor  # [B + 1] int32, token offsets of each sequence's new tokens
    seq_lens: torch.Tensor  # [B] int32, KV length of each sequence after this step
    page_table: torch.Tensor  # [B, P] int32, page ids of each sequence
    slot_mapping: torch.Tensor  # [T] int64, page * page_size + offset where new KV goes
    max_query_len: int  # host-side: 1 means a pure decode step
    # host-side, steps with a prefill only: (start, new tokens) of each sequence's chunk, so a
    # launch can pick kernels per sequence without reading the device (a chunk from 0 has no
    # KV before it: dense_runs)
    chunks: tuple[tuple[int, int], ...] | None = None
    # prefill steps: which sequence and query block each attention program takes, built once a
    # step for every layer (kernels/attention/paged.attention_work), for query blocks of
    # work_block_q tokens; None: each launch builds its own (or a decode step needs none)
    work: torch.Tensor | None = None
    work_block_q: int = 0
    # hybrid models (gated DeltaNet layers): [B] int32, the recurrent-state slot of each
    # sequence (kernels/gated_delta.py); None for every other model
    state_slots: torch.Tensor | None = None


@dataclass(frozen=True)
class ForwardBatch:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    attn: AttentionMetadata
    lora: LoraBatchInfo | None  # None when the engine runs with LoRA disabled
    # When a list, every MoE layer appends its top-k expert ids [T, K] to it, in layer order
    # (what a benchmark counts as the experts a step reads). Never set inside a CUDA graph.
    routing_trace: list[torch.Tensor] | None = None


@dataclass(frozen=True)
class HostBatch:
    """One step's inputs: host tensors as the runner builds them, `to(device)` their copy, and
    the graph runner's static buffers are views of the same fields."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64
    cu_seqlens_q: torch.Tensor  # [B + 1] int32
    seq_lens: torch.Tensor  # [B] int32
    page_table: torch.Tensor  # [B, P] int32
    slot_of_token: torch.Tensor  # [T] int32
    slot_enabled: torch.Tensor | None  # [S] int32; None when LoRA is disabled
    max_query_len: int
    any_enabled: torch.Tensor | None = None  # [1] int32; None: computed from slot_enabled
    chunks: tuple[tuple[int, int], ...] | None = None  # AttentionMetadata.chunks
    rank_tile: int = 0  # LoraBatchInfo.rank_tile (0: the pool's, as graphs are captured)
    state_slots: torch.Tensor | None = None  # [B] int32, AttentionMetadata.state_slots
    # hybrid models' prefix caching: (from, to) rows of every linear layer's state tensors
    # copied before the forward (snapshot into slot) and after it (slot into snapshot)
    state_restores: tuple[tuple[int, int], ...] = ()
    state_saves: tuple[tuple[int, int], ...] = ()

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]

    def to(self, device: torch.device) -> HostBatch:
        def moved(value):
            if isinstance(value, torch.Tensor):
                return value.to(device, non_blocking=True)
            return value

        return HostBatch(**{f.name: moved(getattr(self, f.name)) for f in fields(self)})

    def to_device(self, device: torch.device, slots: SlotParams | None) -> ForwardBatch:
        return forward_batch(self.to(device), slots)


class SlotParams(Protocol):
    """What a step's LoRA batch info takes from the adapter slots (the SlotPool)."""

    rank_of_slot: torch.Tensor  # [S] int32
    scaling_of_slot: torch.Tensor  # [S] float32


def forward_batch(inputs: HostBatch, slots: SlotParams | None) -> ForwardBatch:
    """The model's view of `inputs` (tensors on the model's device); slots None: LoRA disabled."""
    i = inputs
    attn = AttentionMetadata(
        i.cu_seqlens_q,
        i.seq_lens,
        i.page_table,
        i.slot_mapping,
        i.max_query_len,
        i.chunks,
        state_slots=i.state_slots,
    )
    lora = None
    if slots is not None:
        rank, scaling = slots.rank_of_slot, slots.scaling_of_slot
        lora = LoraBatchInfo(
            i.slot_of_token, rank, scaling, i.slot_enabled, i.any_enabled, i.rank_tile
        )
    return ForwardBatch(i.input_ids, i.positions, attn, lora)
