"""Adapter slots: preallocated GPU buffers per LoRA target (SlotPool) and who holds which slot
(SlotTable: names, references from running requests, least-recently-used eviction).

Nothing is reallocated after start-up, so captured graphs stay valid while adapters come and go.
"""

from __future__ import annotations

import itertools
from collections.abc import Hashable
from dataclasses import dataclass

import torch
from torch import nn

from moelora.layers.linear import LoraLinear
from moelora.step.lora import LoraWeights


@dataclass(frozen=True)
class LoraTarget:
    """One LoRA-capable projection of the model (all experts of one MoE projection together)."""

    key: str  # "layers.3.qkv", "layers.3.experts13", ...
    in_features: int
    out_slices: tuple[int, ...]
    num_experts: int  # 0 for a dense projection
    owner: nn.Module
    attr: str  # attribute of owner that holds the LoraWeights
    # PEFT target_parameters on this checkpoint's fused gate_up alternate gate and up in
    # lora_B's rows (GPT-OSS), where the slot holds gate rows, then up rows
    gate_up_interleaved: bool = False

    @property
    def out_features(self) -> int:
        return sum(self.out_slices)


def lora_targets(model: nn.Module) -> dict[str, LoraTarget]:
    targets = {}
    for i, layer in enumerate(model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        linears = attn.lora_linears()  # GQA: qkv, o; MLA: qkv, q_b, kv_b, o
        if hasattr(mlp, "w13"):
            E, I, H = mlp.w13.shape[0], mlp.w2.shape[2], mlp.w2.shape[1]
            interleaved = mlp.cfg.experts_layout == "interleaved_in_out"
            targets[f"layers.{i}.experts13"] = LoraTarget(
                f"layers.{i}.experts13", H, (I, I), E, mlp, "lora13", interleaved
            )
            targets[f"layers.{i}.experts2"] = LoraTarget(
                f"layers.{i}.experts2", I, (H,), E, mlp, "lora2"
            )
            if mlp.shared_expert is not None:
                linears["shared.gate_up"] = mlp.shared_expert.gate_up_proj
                linears["shared.down"] = mlp.shared_expert.down_proj
        else:
            linears["mlp.gate_up"] = mlp.gate_up_proj
            linears["mlp.down"] = mlp.down_proj
        for name, lin in linears.items():
            assert isinstance(lin, LoraLinear)
            key = f"layers.{i}.{name}"
            targets[key] = LoraTarget(key, lin.in_features, lin.out_slices, 0, lin, "lora")
    return targets


class SlotPool:
    """Per-target buffers a [S, (E,) n, R, in] and b [S, (E,) out, R], plus rank/scaling."""

    def __init__(
        self,
        model: nn.Module,
        max_loras: int,
        max_rank: int,
        *,
        dtype: torch.dtype,
        device: torch.device,
    ):
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.targets = lora_targets(model)
        self.weights: dict[str, LoraWeights] = {}
        for key, t in self.targets.items():
            experts = (t.num_experts,) if t.num_experts else ()
            n = len(t.out_slices)
            a = torch.zeros(
                max_loras, *experts, n, max_rank, t.in_features, dtype=dtype, device=device
            )
            b = torch.zeros(
                max_loras, *experts, t.out_features, max_rank, dtype=dtype, device=device
            )
            self.weights[key] = LoraWeights(a, b, t.out_slices)
            setattr(t.owner, t.attr, self.weights[key])
        self.rank_of_slot = torch.zeros(max_loras, dtype=torch.int32, device=device)
        self.scaling_of_slot = torch.zeros(max_loras, dtype=torch.float32, device=device)
        self.host_rank = [0] * max_loras  # host copy: the runner reads it without a device sync
        # per slot, the rank each target's buffers hold nonzeros to (fill zeroes the rest)
        self._written: list[dict[str, int]] = [{} for _ in range(max_loras)]
        # per slot, each target's (a, b) views of it, made once
        self._views = [
            {key: (w.a[s], w.b[s]) for key, w in self.weights.items()} for s in range(max_loras)
        ]

    def fill(self, slot: int, adapter) -> None:
        """Copy a parsed adapter (moelora.lora.adapter.LoraAdapter) into a slot, on the current
        stream, without waiting for the copies (from page-locked host tensors they run
        asynchronously; the caching host allocator keeps them alive until the copies end).

        Invariant: outside the adapter's modules and ranks a slot holds zeros. Only what the
        last occupant wrote and this adapter does not overwrite is zeroed (each launch costs
        the engine thread time, hundreds of them a fill on a large MoE)."""
        written = self._written[slot]
        for key, (a, b) in self._views[slot].items():
            module = adapter.modules.get(key)
            r = 0 if module is None else module.a.shape[-2]
            if r < written.get(key, 0):  # the last occupant's ranks beyond r
                a[..., r:, :].zero_()
                b[..., r:].zero_()
            if r == self.max_rank:  # the whole slot: no slicing views to make
                a.copy_(module.a, non_blocking=True)
                b.copy_(module.b, non_blocking=True)
            elif module is not None:
                a[..., :r, :].copy_(module.a, non_blocking=True)
                b[..., :r].copy_(module.b, non_blocking=True)
        self._written[slot] = {
            key: m.a.shape[-2] for key, m in adapter.modules.items() if key in self.weights
        }
        # fill_, not item assignment: `t[i] = x` copies x from pageable host memory, which
        # synchronises the stream, so the thread would wait for every copy above
        self.rank_of_slot[slot].fill_(adapter.rank)
        self.scaling_of_slot[slot].fill_(adapter.scaling)
        self.host_rank[slot] = adapter.rank

    def clear(self, slot: int) -> None:
        self.rank_of_slot[slot].fill_(0)
        self.host_rank[slot] = 0


class SlotTable:
    """Which adapter load is in which slot, and whether its fill has landed. A slot's key is
    the load's number (the engine's; any hashable here): an adapter replaced under its name is
    a new load, and requests of the old one keep reading the old load's slot.

    A slot is free (no name), filling (named, its copy maybe still running on the copy
    stream), or ready. References come from running requests; a slot with references, or one
    filling, is never handed to another load (the step in flight may read it, or a request
    waits for it). The scheduler picks which idle slot a load takes (it knows the queues)."""

    def __init__(self, num_slots: int):
        self.names: list[Hashable | None] = [None] * num_slots
        self.refs = [0] * num_slots
        self.filling = [False] * num_slots
        # assigned, and no request has taken a reference since: the scheduler keeps such a
        # slot for the requests it was filled for (evicted before they ran, it was wasted)
        self.unused = [False] * num_slots
        self.last_used = [0] * num_slots
        self._clock = itertools.count(1)

    def slot_of(self, name: Hashable) -> int | None:
        return self.names.index(name) if name in self.names else None

    def is_ready(self, name: Hashable) -> bool:
        slot = self.slot_of(name)
        return slot is not None and not self.filling[slot]

    def idle(self) -> list[int]:
        """Slots a load may take: free, or ready with no reference (least recently used
        first, free ones before all)."""
        idle = [s for s in range(len(self.names)) if self.refs[s] == 0 and not self.filling[s]]
        return sorted(idle, key=lambda s: (self.names[s] is not None, self.last_used[s]))

    def assign(self, slot: int, name: Hashable) -> Hashable | None:
        """`name` takes the idle `slot` and is filling; returns the load it held."""
        assert self.refs[slot] == 0 and not self.filling[slot] and name not in self.names
        evicted, self.names[slot] = self.names[slot], name
        self.filling[slot] = self.unused[slot] = True
        self.last_used[slot] = next(self._clock)
        return evicted

    def filled(self, slot: int) -> None:
        """The slot's copy has landed: its requests may run beside others."""
        self.filling[slot] = False

    def acquire(self, name: Hashable) -> int:
        """A new reference to the slot that holds `name` (assigned before)."""
        slot = self.names.index(name)
        self.refs[slot] += 1
        self.unused[slot] = False
        self.last_used[slot] = next(self._clock)
        return slot

    def release(self, slot: int) -> None:
        assert self.refs[slot] > 0
        self.refs[slot] -= 1

    def evict(self, name: Hashable) -> int | None:
        slot = self.slot_of(name)
        if slot is not None:
            assert self.refs[slot] == 0
            self.names[slot] = None
            self.filling[slot] = self.unused[slot] = False
        return slot

    def unused_loads(self) -> set[Hashable]:
        """Loads in slots that no request has taken a reference to since their fill."""
        return {n for n, unused in zip(self.names, self.unused) if unused}

    @property
    def num_used(self) -> int:
        return sum(n is not None for n in self.names)

    @property
    def num_refs(self) -> int:
        """References held: one per request that holds a slot (0 when nothing runs)."""
        return sum(self.refs)
