"""Adapter slots: preallocated GPU buffers per LoRA target (SlotPool) and who holds which slot
(SlotTable: names, references from running requests, least-recently-used eviction).

Nothing is reallocated after start-up, so captured graphs stay valid while adapters come and go.
"""

from __future__ import annotations

import itertools
import math
from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass

import torch
from torch import nn

from moelora.errors import AdapterError
from moelora.layers.linear import LoraLinear
from moelora.lora.arena import ALIGN, RegionAllocator, RegionLayout, region_layout, write_region
from moelora.step.lora import (
    A_EXPERT,
    A_OFF,
    A_SLICE,
    B_EXPERT,
    B_OFF,
    B_ROW,
    RANK,
    TABLE_WIDTH,
    LoraWeights,
    alignment,
)


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


def dense_slot_elements(targets: dict[str, LoraTarget], max_rank: int) -> int:
    """The elements one adapter with every module at max_rank takes (the old slot's size, and
    the arena's default share per slot)."""
    total = 0
    for t in targets.values():
        experts = max(t.num_experts, 1)
        total += experts * max_rank * (len(t.out_slices) * t.in_features + t.out_features)
    return total


@dataclass(frozen=True)
class _Held:
    """What a fill wrote a slot besides the factors: the table rows (compact layout; pinned
    on CUDA), the rank and the scaling. A slot pointed at the same region again takes these."""

    rows: torch.Tensor | None
    rank: int
    scaling: float


class SlotPool:
    """The device memory LoRA kernels read: one arena holding every resident adapter, and per
    target a table of where each slot's factors sit in it (step/lora.LoraWeights).

    compact (the default): each adapter takes one region at its modules' own ranks, shared
    expert factors once (lora/arena.py); the SlotTable's allocator places the regions, of
    `arena_elements` in all (default max_loras adapters at max_rank: the old slots' memory).
    Not compact: slot s holds every target at max_rank in a fixed part of the arena (the old
    layout, which LoraWeights.a / .b view): for kernels not yet converted to the tables."""

    def __init__(
        self,
        model: nn.Module,
        max_loras: int,
        max_rank: int,
        *,
        dtype: torch.dtype,
        device: torch.device,
        compact: bool = True,
        arena_elements: int | None = None,
    ):
        self.max_loras, self.max_rank, self.compact = max_loras, max_rank, compact
        self.targets = lora_targets(model)
        self.slot_elements = dense_slot_elements(self.targets, max_rank)
        if not compact or arena_elements is None:
            arena_elements = max_loras * self.slot_elements
        self.arena = torch.zeros(arena_elements, dtype=dtype, device=device)
        # [targets, S, TABLE_WIDTH]: a fill writes a slot's rows of every target in one copy
        self.tables = torch.zeros(
            len(self.targets), max_loras, TABLE_WIDTH, dtype=torch.int64, device=device
        )
        self.weights: dict[str, LoraWeights] = {}
        dense_at = 0
        for i, (key, t) in enumerate(self.targets.items()):
            a = b = None
            if not compact:
                a, b, dense_at = self._dense_views(t, dense_at)
            places = (self.arena, self.tables[i])
            shape = (t.out_slices, t.in_features, max_rank, t.num_experts)
            align = self._a_align(t, a)
            self.weights[key] = LoraWeights(*places, *shape, a, b, align)
            setattr(t.owner, t.attr, self.weights[key])
        if not compact:
            self._dense_tables()
        self.rank_of_slot = torch.zeros(max_loras, dtype=torch.int32, device=device)
        self.scaling_of_slot = torch.zeros(max_loras, dtype=torch.float32, device=device)
        self.host_rank = [0] * max_loras  # host copy: the runner reads it without a device sync
        # per slot, the rank each target's buffers hold nonzeros to (a dense fill zeroes the rest)
        self._written: list[dict[str, int]] = [{} for _ in range(max_loras)]
        # by region start: what the last fill there wrote the slot (a parked region's re-take)
        self._held: dict[int, _Held] = {}

    def _a_align(self, t: LoraTarget, a: torch.Tensor | None) -> int:
        """LoraWeights.a_align of target t. Compact: a region starts, and its A factors sit, on
        ALIGN; A_SLICE and A_EXPERT are multiples of `in` (r * in, n * r * in). The old
        layout: the dense view's places and strides."""
        if a is None:
            return alignment([t.in_features, ALIGN])
        base = self.arena.storage_offset()
        places = [a[s].storage_offset() - base for s in range(self.max_loras)]
        strides = [a.stride(-3), a.stride(1) if t.num_experts else 0]
        return alignment([t.in_features, *places, *strides])

    def _dense_views(self, t: LoraTarget, at: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        """The old layout's a [S, (E,) n, R, in] and b [S, (E,) out, R] of target t in the
        arena from `at`, and where the next target's begin."""
        S, R, experts = self.max_loras, self.max_rank, (t.num_experts,) if t.num_experts else ()
        a_shape = (S, *experts, len(t.out_slices), R, t.in_features)
        b_shape = (S, *experts, t.out_features, R)
        a_n, b_n = math.prod(a_shape), math.prod(b_shape)
        a = self.arena[at : at + a_n].view(a_shape)
        b = self.arena[at + a_n : at + a_n + b_n].view(b_shape)
        return a, b, at + a_n + b_n

    def _dense_tables(self) -> None:
        """The old layout's tables: fixed places, every rank R (fills set the real ranks)."""
        rows = torch.zeros_like(self.tables, device="cpu")
        base = self.arena.storage_offset()
        for i, w in enumerate(self.weights.values()):
            for s in range(self.max_loras):
                row = rows[i, s]
                row[A_OFF] = w.a[s].storage_offset() - base
                row[B_OFF] = w.b[s].storage_offset() - base
                row[A_SLICE], row[B_ROW] = w.a.stride(-3), self.max_rank
                if w.num_experts:
                    row[A_EXPERT], row[B_EXPERT] = w.a.stride(1), w.b.stride(1)
        self.tables.copy_(rows)

    def region_size(self, adapter) -> int:
        """The arena elements the adapter's region takes (0 in the old layout: slots are
        fixed)."""
        if not self.compact:
            return 0
        return max(self._layout(adapter).size, ALIGN)

    def check_fits(self, adapter) -> None:
        """AdapterError where the adapter could never be resident: larger than the arena."""
        size = self.region_size(adapter)
        if size > self.arena.numel():
            elem = self.arena.element_size()
            raise AdapterError(
                f"adapter {adapter.name!r} takes {size * elem / 2**30:.3f} GiB on the GPU, "
                f"more than the whole adapter memory ({self.arena.numel() * elem / 2**30:.3f} "
                "GiB, max_gpu_lora_gb): expected an adapter that fits it"
            )

    def _layout(self, adapter) -> RegionLayout:
        keys = [key for key in adapter.modules if key in self.weights]
        return region_layout(adapter.modules, adapter.shared, keys)

    def fill(self, slot: int, adapter, start: int = 0, *, copy: bool = True) -> None:
        """Copy a parsed adapter (moelora.lora.adapter.LoraAdapter) into a slot (compact: into
        its region at `start`, which the SlotTable allocated), on the current stream, without
        waiting for the copies (from page-locked host memory they run asynchronously; the
        caching host allocator keeps the source alive until the copies end). copy=False: the
        region at `start` holds an adapter already (a parked load; `adapter` may be None):
        the slot is pointed at it with what its own fill recorded, so no host copy is read."""
        assert copy or self.compact, "the old layout's slots are fixed: nothing is parked"
        if not self.compact:
            self._fill_dense(slot, adapter)
            held = _Held(None, adapter.rank, adapter.scaling)
        elif copy:
            held = self._fill_region(slot, adapter, start)
            self._held[start] = held
        else:
            held = self._held[start]
            self.tables[:, slot].copy_(held.rows, non_blocking=True)
        # fill_, not item assignment: `t[i] = x` copies x from pageable host memory, which
        # synchronises the stream, so the thread would wait for every copy above
        self.rank_of_slot[slot].fill_(held.rank)
        self.scaling_of_slot[slot].fill_(held.scaling)
        self.host_rank[slot] = held.rank

    def _fill_region(self, slot: int, adapter, start: int) -> _Held:
        """One copy where the adapter comes packed in its region's layout (an adapter in
        page-locked memory does), one a factor otherwise; then the slot's table rows. Returns
        what a slot pointed at the region later needs."""
        layout = self._layout(adapter)
        assert start + layout.size <= self.arena.numel(), (start, layout.size)
        region = self.arena[start : start + layout.size]
        packed = adapter.packed
        if packed is not None and packed.numel() == layout.size:
            region.copy_(packed, non_blocking=True)
        else:
            write_region(region, adapter.modules, layout)
        rows = torch.zeros(len(self.weights), TABLE_WIDTH, dtype=torch.int64)
        for i, (key, w) in enumerate(self.weights.items()):
            p = layout.places.get(key)
            if p is None:
                continue  # rank 0: the kernels skip the module
            K, R_n = w.in_features, p.rank
            rows[i, A_OFF], rows[i, B_OFF] = start + p.a_off, start + p.b_off
            rows[i, A_EXPERT], rows[i, B_EXPERT] = p.a_expert, p.b_expert
            rows[i, A_SLICE], rows[i, B_ROW], rows[i, RANK] = R_n * K, R_n, R_n
            # the kernels' alignment hint holds (LoraWeights.a_align)
            assert not (start + p.a_off) % w.a_align and not p.a_expert % w.a_align, key
        # pin: a pageable source would make this copy synchronous (and a pinned one must not
        # change while it runs: the rows are never written again)
        rows = rows.pin_memory() if self.tables.is_cuda else rows
        self.tables[:, slot].copy_(rows, non_blocking=True)
        return _Held(rows, adapter.rank, adapter.scaling)

    def _fill_dense(self, slot: int, adapter) -> None:
        """The old layout. Invariant: outside the adapter's modules and ranks a slot holds
        zeros. Only what the last occupant wrote and this adapter does not overwrite is
        zeroed (each launch costs the engine thread time, hundreds of them a fill)."""
        written = self._written[slot]
        ranks = torch.zeros(len(self.weights), dtype=torch.int64)
        for i, (key, w) in enumerate(self.weights.items()):
            a, b = w.a[slot], w.b[slot]
            module = adapter.modules.get(key)
            r = 0 if module is None else module.a.shape[-2]
            ranks[i] = r
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
        ranks = ranks.pin_memory() if self.tables.is_cuda else ranks  # as _fill_region's
        self.tables[:, slot, RANK].copy_(ranks, non_blocking=True)

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
    waits for it). The scheduler picks which idle slot a load takes (it knows the queues).

    With an arena, a load that leaves its slot keeps its region (parked) until room is needed:
    max_loras bounds the adapters one step holds, the arena how many stay on the GPU. A parked
    load that takes a slot again is pointed at its region, with no copy (`resident`)."""

    def __init__(self, num_slots: int, arena: RegionAllocator | None = None):
        """arena: where the pool's regions go (None: the old layout, a fixed part a slot)."""
        self.names: list[Hashable | None] = [None] * num_slots
        self.refs = [0] * num_slots
        self.filling = [False] * num_slots
        # assigned, and no request has taken a reference since: the scheduler keeps such a
        # slot for the requests it was filled for (evicted before they ran, it was wasted)
        self.unused = [False] * num_slots
        self.last_used = [0] * num_slots
        self.arena = arena
        self.regions: list[tuple[int, int] | None] = [None] * num_slots  # (start, elements)
        # loads in no slot whose regions still hold them, least recently parked first
        self.parked: OrderedDict[Hashable, tuple[int, int]] = OrderedDict()
        # assigned a load that was parked: its region holds it, the fill copies nothing
        self.resident = [False] * num_slots
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

    def assign(self, slot: int, name: Hashable, size: int = 0) -> Hashable | None:
        """`name` takes the idle `slot` and is filling: in its parked region (resident), or in
        a new one of `size` arena elements (which room_for made room for). The load the slot
        held is parked with its region; returns it."""
        assert self.refs[slot] == 0 and not self.filling[slot] and name not in self.names
        region = self.parked.pop(name, None)
        self.resident[slot] = region is not None
        if self.names[slot] is not None and self.regions[slot] is not None:
            self.parked[self.names[slot]] = self.regions[slot]
        self.regions[slot] = None
        if self.arena is not None and region is None:
            start = self.arena.allocate(size)
            assert start is not None, (size, self.arena.free_list)
            region = (start, size)
        self.regions[slot] = region
        evicted, self.names[slot] = self.names[slot], name
        self.filling[slot] = self.unused[slot] = True
        self.last_used[slot] = next(self._clock)
        return evicted

    def room_for(
        self, size: int, slot: int, candidates: list[int] | None = None
    ) -> list[Hashable] | None:
        """The loads to evict, in this order, so that a region of `size` fits for the load
        that takes `slot`: parked ones (least recently parked first), then the one `slot`
        holds, then those of `candidates` (default: every idle slot, least recently used
        first). None where even evicting all of them would not make room (the fill waits)."""
        if self.arena is None:
            return []
        candidates = self.idle() if candidates is None else candidates
        holders = list(self.parked.items()) + [
            (self.names[s], self.regions[s])
            for s in [slot, *(c for c in candidates if c != slot)]
            if self.names[s] is not None and self.regions[s] is not None
        ]
        if not self.arena.fits_after(size, [region for _, region in holders]):
            return None
        victims, freed = [], []
        for name, region in holders:
            if self.arena.fits_after(size, freed):
                break
            victims.append(name)
            freed.append(region)
        return victims

    def _free_region(self, slot: int) -> None:
        if self.regions[slot] is not None:
            self.arena.free(*self.regions[slot])
            self.regions[slot] = None

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
        """`name` out of the GPU: out of its slot (returned; None if it held none) or of the
        parked regions, its region freed."""
        if name in self.parked:
            self.arena.free(*self.parked.pop(name))
        slot = self.slot_of(name)
        if slot is not None:
            assert self.refs[slot] == 0
            self.names[slot] = None
            self.filling[slot] = self.unused[slot] = self.resident[slot] = False
            self._free_region(slot)
        return slot

    def on_gpu(self, name: Hashable) -> bool:
        """In a slot, or parked with its region."""
        return name in self.names or name in self.parked

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
