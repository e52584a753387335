"""The LoRA data contract (DESIGN.md): the per-step batch info and the slot weights kernels read,
and a projection's LoRA between the kernel that shrinks it and the one that expands it.

Buffers are static (sized from max_tokens and max_loras); a step writes them in place, so a
captured CUDA graph replays with the new batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

NO_SLOT = -1  # slot_of_token value for tokens without an adapter (and for padded rows)


@dataclass(frozen=True)
class LoraBatchInfo:
    """S = max_loras, T = tokens in this step (a prefix of the static buffers)."""

    slot_of_token: torch.Tensor  # [T] int32, NO_SLOT for base tokens
    rank_of_slot: torch.Tensor  # [S] int32, the adapter's real rank (0 = empty slot)
    scaling_of_slot: torch.Tensor  # [S] float32
    slot_enabled: torch.Tensor  # [S] int32, 1 iff some token of the step uses it and rank > 0
    # [1] int32, 1 iff any slot is enabled: the MoE GEMMs test this one scalar before their
    # LoRA epilogue instead of a per-block reduction. The graph runner passes a buffer it
    # writes with the step; when omitted it is computed from slot_enabled (one small op), once:
    # whoever rewrites slot_enabled in place (a graph's inputs) must rewrite this too.
    any_enabled: torch.Tensor | None = None
    # The largest real rank among the enabled slots, where the host knows it (0: the pool's
    # max_lora_rank). Prefill-sized kernels whose rank tile changes no reduction order (the
    # block-wise MoE shrinks, add_lora_'s prefill tiles) then work at this rank's tile, not
    # the pool's: a rank-8 adapter in a rank-64 pool costs what it does in a rank-8 pool.
    # Graphs are captured with 0 (the pool's tile): their kernels do not change per step.
    rank_tile: int = 0

    def __post_init__(self):
        if self.any_enabled is None:
            any_enabled = self.slot_enabled.amax().reshape(1).to(torch.int32)
            object.__setattr__(self, "any_enabled", any_enabled)

    @property
    def num_slots(self) -> int:
        return self.rank_of_slot.shape[0]


@dataclass(frozen=True)
class LoraWeights:
    """The slot buffers of one LoRA-adapted linear (or of all experts of one MoE linear).

    The linear's output is cut into slices (q|k|v, gate|up); slice i has its own A.
    n = number of slices, R = max_lora_rank, E = experts (absent for dense linears).
      a: [S, n, R, in]      or [S, E, n, R, in]
      b: [S, out, R]        or [S, E, out, R]     out = sum(out_slices)
    Rows of a and columns of b past a slot's real rank are zero. Per-module scaling that
    differs from the slot's scaling (alpha_pattern) is folded into b when the slot is filled.
    """

    a: torch.Tensor
    b: torch.Tensor
    out_slices: tuple[int, ...]

    @property
    def max_rank(self) -> int:
        return self.a.shape[-2]


@dataclass(frozen=True)
class FoldedLora:
    """A projection's LoRA split over the kernels around it: a kernel before the projection
    computed the shrink of its input, a kernel after it adds the expand to its output (see
    layers/attention_lora.py for which kernels those are).

    shrunk: scaling[s] * x[t] @ A[s, i].T in float32, [T, n, R], or [T, KS, n, R] partial sums
    over KS slices of the input that the reader adds (reference.lora_shrink_split). Rows whose
    token has no enabled slot are left unwritten: readers check the slot in `info` first.
    """

    shrunk: torch.Tensor
    weights: LoraWeights
    info: LoraBatchInfo
