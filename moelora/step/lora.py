"""The LoRA data contract (DESIGN.md): the per-step batch info and the slot weights kernels read,
and a projection's LoRA between the kernel that shrinks it and the one that expands it.

Buffers are static (sized from max_tokens and max_loras); a step writes them in place, so a
captured CUDA graph replays with the new batch.
"""

from __future__ import annotations

from collections.abc import Iterable
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


# The columns of LoraWeights.table: where one slot's factors of one target sit in the arena,
# in elements. A row of A is always `in` long and B's rank columns are contiguous, so these
# and the rank are all a reader needs.
A_OFF, A_EXPERT, A_SLICE, B_OFF, B_EXPERT, B_ROW, RANK = range(7)
TABLE_WIDTH = 8  # one 64-byte row a slot
MAX_ALIGN = 8  # elements: one 16-byte vector load of bf16


def alignment(values: Iterable[int]) -> int:
    """The largest power of two up to MAX_ALIGN that divides every value (0 divides by all)."""
    align = MAX_ALIGN
    for v in values:
        while v % align:
            align //= 2
    return align


@dataclass(frozen=True)
class LoraWeights:
    """One LoRA-adapted linear's factors (or all experts' of one MoE linear), for every slot.

    The linear's output is cut into slices (q|k|v, gate|up); slice i has its own A.
    n = number of slices, r = the slot's rank for this linear, E = experts (absent for dense
    linears), S = slots. Slot s's factors are read through row s of `table`, in `arena`:
      A[s][e, i, j, k] = arena[A_OFF + e * A_EXPERT + i * A_SLICE + j * in + k]
      B[s][e, o, j]    = arena[B_OFF + e * B_EXPERT + o * B_ROW + j]
    for j < RANK. RANK 0: the adapter in the slot has no such module (readers skip it).
    A_EXPERT / B_EXPERT 0: one factor shared by every expert, stored once.
    Per-module scaling that differs from the slot's scaling (alpha_pattern) is folded into B.

    a, b: the same factors as dense views [S, (E,) n, R, in] and [S, (E,) out, R] (R =
    max_rank, zeros past a slot's rank), where the pool keeps that layout (kernels not yet
    converted to the table read these); None in the compact layout.

    a_align: every A_OFF, A_EXPERT and A_SLICE the table holds, now or after any fill, is a
    multiple of it (elements; a power of two up to MAX_ALIGN), and so is `in`. Kernels pass it
    to the compiler (kernels/lora.aligned): an offset loaded from the table says nothing of
    its alignment, and without the hint A's loads are one element each and not pipelined.
    """

    arena: torch.Tensor  # [N] the pool's one buffer, the model's dtype
    table: torch.Tensor  # [S, TABLE_WIDTH] int64
    out_slices: tuple[int, ...]
    in_features: int
    max_rank: int  # R: the largest rank a slot may hold (the rank tile of the kernels)
    num_experts: int = 0
    a: torch.Tensor | None = None
    b: torch.Tensor | None = None
    a_align: int = 1

    @classmethod
    def dense(
        cls,
        a: torch.Tensor,
        b: torch.Tensor,
        out_slices: tuple[int, ...],
        ranks: list[int] | None = None,
    ) -> LoraWeights:
        """Weights over dense a [S, (E,) n, R, in] and b [S, (E,) out, R] (copied into one
        arena; a and b become views of it). ranks: each slot's rank (default R)."""
        S, R, K = a.shape[0], a.shape[-2], a.shape[-1]
        experts = a.shape[1] if a.ndim == 5 else 0
        arena = torch.cat([a.reshape(-1), b.reshape(-1)])
        a = arena[: a.numel()].view(a.shape)
        b = arena[a.numel() :].view(b.shape)
        table = torch.zeros(S, TABLE_WIDTH, dtype=torch.int64)
        for s in range(S):
            row = table[s]
            row[A_OFF], row[A_SLICE] = s * a.stride(0), a.stride(-3)
            row[B_OFF], row[B_ROW] = a.numel() + s * b.stride(0), R
            row[A_EXPERT] = a.stride(1) if experts else 0
            row[B_EXPERT] = b.stride(1) if experts else 0
            row[RANK] = R if ranks is None else min(ranks[s], R)
        align = alignment([K, *table[:, [A_OFF, A_EXPERT, A_SLICE]].flatten().tolist()])
        return cls(arena, table.to(a.device), out_slices, K, R, experts, a, b, align)

    def dense_views(self, reader: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(a, b) in the old dense layout, for a kernel not yet converted to the table."""
        assert self.a is not None and self.b is not None, (
            f"{reader} reads LoRA factors in the dense slot layout, not through the arena's "
            "tables: its Ops must say reads_lora_tables=False, so the pool keeps that layout"
        )
        return self.a, self.b

    @property
    def out_features(self) -> int:
        return sum(self.out_slices)

    @property
    def num_slots(self) -> int:
        return self.table.shape[0]

    def factors(self, slot: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Slot `slot`'s (A [(E,) n, r, in], B [(E,) out, r]) as views of the arena (a shared
        factor's expert stride is 0), or None where the slot has no such module. Reads the
        table on the host: the torch references' way, not a kernel's."""
        row = self.table[slot].tolist()
        r = row[RANK]
        if r == 0:
            return None
        n, K, out = len(self.out_slices), self.in_features, self.out_features
        lead = (self.num_experts,) if self.num_experts else ()
        a_strides = ((row[A_EXPERT],) if lead else ()) + (row[A_SLICE], K, 1)
        b_strides = ((row[B_EXPERT],) if lead else ()) + (row[B_ROW], 1)
        base = self.arena.storage_offset()
        a = self.arena.as_strided((*lead, n, r, K), a_strides, base + row[A_OFF])
        b = self.arena.as_strided((*lead, out, r), b_strides, base + row[B_OFF])
        return a, b


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
