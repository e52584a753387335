"""Which shard of the model this process holds (tensor / expert parallel), and the collectives
the layers call on it. A model built without a group is the whole model: every collective is the
identity, so the single-process path runs exactly the unsharded computation.

Legend: N = ranks, r = this rank, V = vocabulary, E = experts, H = hidden.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


def divide(n: int, parts: int) -> int:
    assert n % parts == 0, (n, parts)
    return n // parts


@dataclass(frozen=True)
class Shard:
    rank: int = 0
    size: int = 1
    expert_parallel: bool = False  # experts split by expert, not by intermediate dimension
    group: Any = None  # the torch.distributed ProcessGroup of the N ranks (None: one rank)

    # ---- sizes of this rank's part -----------------------------------------------------------

    def heads(self, n: int) -> int:
        """Query heads of this rank."""
        return divide(n, self.size)

    def kv_heads(self, n: int) -> int:
        """KV heads of this rank: their share, or one replicated head when fewer than N."""
        return divide(n, self.size) if n >= self.size else 1

    def first_kv_head(self, n: int) -> int:
        """The first KV head this rank holds (the one its query heads read when replicated)."""
        return self.rank * self.kv_heads(n) if n >= self.size else self.rank * n // self.size

    def kv_replicas(self, n: int) -> int:
        """How many ranks hold each KV head."""
        return 1 if n >= self.size else self.size // n

    def intermediate(self, n: int) -> int:
        return divide(n, self.size)

    def experts(self, n: int) -> int:
        """Experts held here: all of them (TP splits each) or E/N of them (EP)."""
        return divide(n, self.size) if self.expert_parallel else n

    def expert_intermediate(self, n: int) -> int:
        return n if self.expert_parallel else divide(n, self.size)

    def vocab(self, n: int) -> int:
        """Vocabulary rows held here: ceil(V / N), the last rank's tail padded with zero rows."""
        return -(-n // self.size)

    # ---- collectives ----------------------------------------------------------------------

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over ranks of x (in place); x itself on one rank."""
        if self.size > 1:
            self.group.allreduce([x]).wait()
        return x

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's x on every rank (in place)."""
        if self.size > 1:
            self.group.broadcast(x, 0).wait()
        return x

    def embed(self, ids: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Vocab-parallel lookup: each rank its rows (zeros for ids held elsewhere), summed.
        ids [T] int64, rows [V/N, H] -> [T, H]. The sum adds zeros to one value: exact."""
        if self.size == 1:
            return torch.nn.functional.embedding(ids, rows)
        local = ids - self.rank * rows.shape[0]
        held = (local >= 0) & (local < rows.shape[0])
        x = torch.nn.functional.embedding(local.clamp(0, rows.shape[0] - 1), rows)
        return self.all_reduce(torch.where(held[:, None], x, torch.zeros_like(x)))

    def gather_vocab(self, logits: torch.Tensor, vocab: int) -> torch.Tensor | None:
        """Each rank's logits [M, V/N] -> the whole [M, V] on rank 0 (None elsewhere)."""
        if self.size == 1:
            return logits
        logits = logits.contiguous()
        parts = [torch.empty_like(logits) for _ in range(self.size)]
        if logits.is_cuda:  # NCCL gathers by an all-gather; the other ranks drop theirs
            self.group.allgather([parts], [logits]).wait()
        else:
            from torch.distributed import GatherOptions

            opts = GatherOptions()
            opts.rootRank = 0
            self.group.gather([parts] if self.rank == 0 else [], [logits], opts).wait()
        if self.rank != 0:
            return None
        return torch.cat(parts, dim=-1)[:, :vocab]

    def localize_experts(
        self, weights: torch.Tensor, ids: torch.Tensor, num_local: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """EP: the top-k choices as this rank's experts see them. A choice of an expert held
        elsewhere gets weight 0 (and a local id, so the kernels index in bounds): it adds
        exactly 0 here, and its expert's rank adds it. weights [T, K] float32, ids [T, K]."""
        if not self.expert_parallel or self.size == 1:
            return weights, ids
        local = ids - self.rank * num_local
        held = (local >= 0) & (local < num_local)
        return torch.where(held, weights, 0.0), torch.where(held, local, 0).to(ids.dtype)


SINGLE = Shard()
