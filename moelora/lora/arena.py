"""The adapter arena: where resident adapters sit on the device, each in one region of one
preallocated buffer, every module at its own rank and a factor shared by every expert once.

A region holds the adapter's modules in target order, per target A [(E | 1,) n, r, in] then
B [(E | 1,) out, r] (1 where the factor is shared), each factor aligned to ALIGN elements.
`region_layout` says where each factor sits; `pack` writes an adapter into one host buffer of
exactly that layout, so a fill is one copy. `RegionAllocator` hands out regions first fit.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch

ALIGN = 64  # elements: every factor starts on a 128-byte boundary in bf16 (vector loads)


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


@dataclass(frozen=True)
class FactorPlace:
    """One module's factors in a region: offsets relative to the region's start, in
    elements, and the expert strides (0: one factor shared by every expert)."""

    a_off: int
    a_expert: int
    b_off: int
    b_expert: int
    rank: int


@dataclass(frozen=True)
class RegionLayout:
    places: dict[str, FactorPlace]  # target key -> where its factors sit
    size: int  # elements, aligned


def region_layout(
    modules: Mapping[str, object], shared: Iterable[tuple[str, str]], keys: Iterable[str]
) -> RegionLayout:
    """Where each of `modules` (target key -> ModuleLora: a [(E,) n, r, in], b [(E,) out, r])
    sits in a region, for the targets `keys` (the pool's, in its order); `shared` lists the
    (key, "a" | "b") factors equal for every expert (LoraAdapter.shared), stored once."""
    shared = set(shared)
    places, at = {}, 0
    for key in keys:
        m = modules.get(key)
        if m is None:
            continue
        a, b = m.a, m.b
        a_one, b_one = a[0].numel(), b[0].numel()  # one expert's factor (dense: a row set)
        experts = a.ndim == 4
        a_expert = 0 if not experts or (key, "a") in shared else a_one
        b_expert = 0 if not experts or (key, "b") in shared else b_one
        a_size = a.numel() if not experts or a_expert else a_one
        b_size = b.numel() if not experts or b_expert else b_one
        a_off, b_off = at, _aligned(at + a_size)
        places[key] = FactorPlace(a_off, a_expert, b_off, b_expert, a.shape[-2])
        at = _aligned(b_off + b_size)
    return RegionLayout(places, at)


def write_region(dst: torch.Tensor, modules: Mapping[str, object], layout: RegionLayout) -> None:
    """Copy each module's factors into dst (a region, [layout.size]) where layout places them
    (a shared factor: expert 0's copy). Asynchronous from page-locked host memory."""
    for key, p in layout.places.items():
        m = modules[key]
        a = m.a if p.a_expert or m.a.ndim == 3 else m.a[:1]
        b = m.b if p.b_expert or m.b.ndim == 2 else m.b[:1]
        dst[p.a_off : p.a_off + a.numel()].view(a.shape).copy_(a, non_blocking=True)
        dst[p.b_off : p.b_off + b.numel()].view(b.shape).copy_(b, non_blocking=True)


def pack(
    modules: Mapping[str, object], layout: RegionLayout, dtype: torch.dtype, *, pin: bool
) -> torch.Tensor:
    """A host buffer in exactly `layout` (page-locked where pin): what one fill copies."""
    buffer = torch.zeros(layout.size, dtype=dtype, pin_memory=pin)
    write_region(buffer, modules, layout)
    return buffer


class ArenaFullError(Exception):
    """No free region is large enough, even after evicting every idle adapter."""


class RegionAllocator:
    """First fit over [0, size) elements. Free regions are kept sorted by start; freeing one
    merges it with its free neighbours, so the free list is whole again once all is freed."""

    def __init__(self, size: int):
        self.size = size
        self.free_list: list[tuple[int, int]] = [(0, size)] if size else []  # (start, length)

    def allocate(self, length: int) -> int | None:
        """The start of a new region of `length` elements, or None where none fits."""
        for i, (start, free) in enumerate(self.free_list):
            if free >= length:
                if free == length:
                    del self.free_list[i]
                else:
                    self.free_list[i] = (start + length, free - length)
                return start
        return None

    def free(self, start: int, length: int) -> None:
        free = self.free_list
        i = next((j for j, (s, _) in enumerate(free) if s > start), len(free))
        assert i == 0 or free[i - 1][0] + free[i - 1][1] <= start, (start, free)
        assert i == len(free) or start + length <= free[i][0], (start, length, free)
        free.insert(i, (start, length))
        if i + 1 < len(free) and start + length == free[i + 1][0]:
            free[i] = (start, length + free.pop(i + 1)[1])
        if i > 0 and free[i - 1][0] + free[i - 1][1] == start:
            free[i - 1] = (free[i - 1][0], free[i - 1][1] + free.pop(i)[1])

    def fits_after(self, length: int, freed: Iterable[tuple[int, int]]) -> bool:
        """Whether a region of `length` would fit once the regions `freed` are freed."""
        trial = RegionAllocator(self.size)
        trial.free_list = list(self.free_list)
        for start, n in freed:
            trial.free(start, n)
        return trial.allocate(length) is not None

    @property
    def free_elements(self) -> int:
        return sum(n for _, n in self.free_list)
