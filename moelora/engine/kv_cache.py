"""Paged KV cache: page allocation with a prefix cache (host) and the per-layer cache tensors
(device).

A page is reference-counted: each request that holds it counts once. A full page of prompt
tokens may be registered under its hash (prefix_cache.page_hashes: the chain of its parent's
hash, its tokens and the request's namespace) once the step that wrote it is committed; later
requests whose prompts begin with the same pages take them instead of computing them again.
A cached page nobody holds stays cached, evictable: allocate() hands out free pages first,
then evicts cached ones, least recently released first.
"""

from __future__ import annotations

import collections

import torch

from moelora.config import ModelConfig
from moelora.engine.state_cache import layer_states


class PageAllocator:
    def __init__(self, num_pages: int):
        self.num_pages = num_pages
        self._free = list(range(num_pages - 1, -1, -1))  # pop() hands out low ids first
        self._refs = [0] * num_pages
        self._page_of: dict[bytes, int] = {}  # page hash -> the cached page
        self._hash_of: dict[int, bytes] = {}  # cached page -> its hash
        self._owner_of: dict[int, object] = {}  # cached page -> what drop_owner drops it by
        # cached pages no request holds, least recently released first
        self._evictable: collections.OrderedDict[int, None] = collections.OrderedDict()

    @property
    def num_free(self) -> int:
        """Pages allocate() can hand out: free, or cached and held by no request."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used(self) -> int:
        """Pages some request holds (vLLM's usage: a cached page nobody holds is free)."""
        return self.num_pages - self.num_free

    @property
    def num_cached(self) -> int:
        """Pages in the prefix cache, held or not (reset_cache() empties it)."""
        return len(self._hash_of)

    def allocate(self, n: int) -> list[int]:
        assert n <= self.num_free, "callers check num_free first"
        pages = []
        for _ in range(n):
            if self._free:
                page = self._free.pop()
            else:
                page, _ = self._evictable.popitem(last=False)
                self._uncache(page)
            assert self._refs[page] == 0, page
            self._refs[page] = 1
            pages.append(page)
        return pages

    def free(self, pages: list[int]) -> None:
        """One reference to each page fewer: at none, a cached page stays cached (evictable),
        any other goes back to the free list."""
        for page in reversed(pages):  # a request's last pages are evicted first
            assert self._refs[page] > 0, f"page {page} freed twice"
            self._refs[page] -= 1
            if self._refs[page] == 0:
                if page in self._hash_of:
                    self._evictable[page] = None
                else:
                    self._free.append(page)

    def num_cached_run(self, hashes: list[bytes]) -> int:
        """How many of `hashes`, from the first, are cached (nothing is held)."""
        return next((i for i, h in enumerate(hashes) if h not in self._page_of), len(hashes))

    def cached_prefix(self, hashes: list[bytes]) -> list[int]:
        """The cached pages of the longest prefix of `hashes`, each now held once more."""
        pages = [self._page_of[h] for h in hashes[: self.num_cached_run(hashes)]]
        for page in pages:
            self._evictable.pop(page, None)
            self._refs[page] += 1
        return pages

    def register(self, page: int, page_hash: bytes, owner: object) -> None:
        """`page`, held and fully written by a committed step, is cached under page_hash. When
        another page already holds that hash (two requests computed the same prefix at once),
        this one stays its request's own."""
        assert self._refs[page] > 0, page
        if page_hash in self._page_of or page in self._hash_of:
            return
        self._page_of[page_hash] = page
        self._hash_of[page] = page_hash
        self._owner_of[page] = owner

    def drop_owner(self, owner: object) -> None:
        """Every page cached for `owner` (an adapter's load) leaves the cache."""
        for page in [p for p, o in self._owner_of.items() if o == owner]:
            self._drop(page)

    def reset_cache(self) -> None:
        """Every cached page leaves the cache; those no request holds are free again."""
        for page in list(self._hash_of):
            self._drop(page)

    def _drop(self, page: int) -> None:
        self._uncache(page)
        if page in self._evictable:
            del self._evictable[page]
            self._free.append(page)

    def _uncache(self, page: int) -> None:
        del self._page_of[self._hash_of.pop(page)]
        del self._owner_of[page]


def page_bytes(cfg: ModelConfig, page_size: int, dtype: torch.dtype) -> int:
    """K and V of one page across all layers that keep pages (MLA: the latent and the rotary
    key; a hybrid model's linear layers keep recurrent states instead, engine/state_cache.py)."""
    elem = torch.tensor([], dtype=dtype).element_size()
    per_token = 2 * cfg.num_kv_heads * cfg.head_dim
    if cfg.mla is not None:
        per_token = cfg.mla.cache_size
    return cfg.num_paged_layers * page_size * per_token * elem


def allocate_kv_caches(
    cfg: ModelConfig,
    num_pages: int,
    page_size: int,
    *,
    dtype: torch.dtype,
    device: torch.device,
    num_state_slots: int = 0,
    num_snapshots: int = 0,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """[num_pages + 1, page_size, Hkv, D] per layer for K and V; the last page is the spare
    that padded rows of a graph batch point at (never handed out). MLA (ModelConfig.mla) keeps
    no K and V: per layer the latent [.., 1, kv_lora_rank] and the rotary key [.., 1,
    qk_rope_head_dim], views of one tensor whose tokens hold the two side by side. A hybrid
    model's linear layers keep num_state_slots recurrent states and num_snapshots snapshots of
    them (state_cache.layer_states)."""
    kw = dict(dtype=dtype, device=device)
    if cfg.mla is not None:
        return [_latent_cache(cfg, num_pages, page_size, **kw) for _ in range(cfg.num_layers)]
    shape = (num_pages + 1, page_size, cfg.num_kv_heads, cfg.head_dim)
    return [
        layer_states(cfg, num_state_slots, num_snapshots=num_snapshots, **kw)
        if cfg.is_linear(i)
        else (torch.zeros(shape, **kw), torch.zeros(shape, **kw))
        for i in range(cfg.num_layers)
    ]


def _latent_cache(
    cfg: ModelConfig, num_pages: int, page_size: int, *, dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """One MLA layer's cache: (latent, rotary key), views of [num_pages + 1, page_size, 1,
    kv_lora_rank + qk_rope_head_dim]."""
    assert cfg.mla is not None
    shape = (num_pages + 1, page_size, 1, cfg.mla.cache_size)
    whole = torch.zeros(shape, dtype=dtype, device=device)
    return whole[..., : cfg.mla.kv_lora_rank], whole[..., cfg.mla.kv_lora_rank :]
