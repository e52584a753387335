"""Paged KV cache: page allocation (host) and the per-layer cache tensors (device)."""

from __future__ import annotations

import torch

from moelora.config import ModelConfig


class PageAllocator:
    def __init__(self, num_pages: int):
        self.num_pages = num_pages
        self._free = list(range(num_pages - 1, -1, -1))  # pop() hands out low ids first

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self._free)

    def allocate(self, n: int) -> list[int]:
        assert n <= len(self._free), "callers check num_free first"
        return [self._free.pop() for _ in range(n)]

    def free(self, pages: list[int]) -> None:
        self._free.extend(reversed(pages))


def page_bytes(cfg: ModelConfig, page_size: int, dtype: torch.dtype) -> int:
    """K and V of one page across all layers."""
    elem = torch.tensor([], dtype=dtype).element_size()
    return 2 * cfg.num_layers * page_size * cfg.num_kv_heads * cfg.head_dim * elem


def allocate_kv_caches(
    cfg: ModelConfig,
    num_pages: int,
    page_size: int,
    *,
    dtype: torch.dtype,
    device: torch.device,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """[num_pages + 1, page_size, Hkv, D] per layer for K and V; the last page is the spare
    that padded rows of a graph batch point at (never handed out)."""
    shape = (num_pages + 1, page_size, cfg.num_kv_heads, cfg.head_dim)
    return [
        (
            torch.zeros(shape, dtype=dtype, device=device),
            torch.zeros(shape, dtype=dtype, device=device),
        )
        for _ in range(cfg.num_layers)
    ]
