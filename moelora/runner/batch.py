"""What one forward step needs, passed explicitly from the runner down to every layer."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moelora.lora.batch_info import LoraBatchInfo


@dataclass(frozen=True)
class AttentionMetadata:
    """B = sequences in the step, T = tokens, P = pages per sequence (max).

    Token j of sequence b (j < q_len_b) sits at position seq_len_b - q_len_b + j and attends to
    KV positions 0..that position. Padded rows have slot_mapping -1 (their KV is not stored).
    """

    cu_seqlens_q: torch.Tensor  # [B + 1] int32, token offsets of each sequence's new tokens
    seq_lens: torch.Tensor  # [B] int32, KV length of each sequence after this step
    page_table: torch.Tensor  # [B, P] int32, page ids of each sequence
    slot_mapping: torch.Tensor  # [T] int64, page * page_size + offset where new KV goes
    max_query_len: int  # host-side: 1 means a pure decode step


@dataclass(frozen=True)
class ForwardBatch:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    attn: AttentionMetadata
    lora: LoraBatchInfo | None  # None when the engine runs with LoRA disabled
