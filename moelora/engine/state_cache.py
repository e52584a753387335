"""The recurrent-state cache of hybrid models (gated DeltaNet layers, ModelConfig.linear_attention),
the second kind of cache beside the paged KV of their full-attention layers.

A request holds one state slot from its admission until it finishes or is preempted (the
scheduler owns the slots, as it owns the pages: Scheduler._admit takes one, _release gives it
back, once no step in flight computes the request). The slot indexes, in every linear layer,
its conv window and its delta-rule state; a request's first chunk starts from zeros, so a
preempted request that recomputes from scratch needs nothing cleared, and its chunks carry the
state from one to the next. The tensors are allocated once, with one spare slot past the
last for the padded rows of a captured batch, and are never reallocated.

Prefix caching (StateSnapshots): a cached prefix must give back the linear layers' state after
its last token, not only its pages. Past the spare, the same tensors hold snapshots: copies of a
request's slot taken right after a step's forward, at the end of a chunk that ends a full page
whose hash is known when the chunk is planned (a prompt page; after a preemption, a generated
one), cached under that page's hash once the step is committed, as the pages are. The scheduler
ends a prompt's chunk at its last page boundary before its last token (the longest prefix an
identical prompt can take from the cache), so every cacheable prompt leaves a snapshot there
(unless every snapshot row is pending a commit); other chunk ends on a page boundary leave one
too. Decode steps take none (their page's hash is known only once the step is committed): a
conversation's next turn hits up to its previous prompt's last boundary, not into the answer.
A request admitted with a cached prefix has the snapshot copied into its slot before its first
chunk, which starts right after that page. Copies run on the device in step order (restores
before the forward, saves after it), so a snapshot one step restores may be taken over by a
later save. max_state_snapshots rows, each a slot's size, come out of the KV budget with the
slots (engine/build.py).
"""

from __future__ import annotations

import collections
from collections.abc import Hashable

import torch

from moelora.config import STATE_DTYPE, ModelConfig


class StateSlots:
    """Which state slots are free. Slots 0 .. num_slots - 1 are handed out; the spare
    (num_slots) never is."""

    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))  # pop() hands out low ids first

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_slots - len(self._free)

    def allocate(self) -> int:
        assert self._free, "callers check num_free first"
        return self._free.pop()

    def free(self, slot: int) -> None:
        assert 0 <= slot < self.num_slots and slot not in self._free, f"slot {slot} freed twice"
        self._free.append(slot)


class StateSnapshots:
    """Snapshot rows first .. first + num_snapshots - 1 of the state tensors, keyed by page hash.

    A row is free, pending (handed out by take() for a save in a step not yet committed: in
    no lookup, never evicted) or cached under one hash (cache()), least recently used first.

    Invariants:
    - a snapshot cached under hash h holds exactly the linear layers' state after the last token
      of the page whose hash is h: h names that page's tokens, every token before them and the
      namespace (adapter load or base, cache salt), so nothing else can change the state;
    - for a hybrid model a cached prefix of pages is a hit only up to a page with a snapshot:
      the scheduler takes the longest cached run of pages whose LAST page has one (longest()),
      and a run without one falls back to a shorter run, or to none;
    - snapshots are evicted by their own LRU, independently of the pages: one whose pages were
      evicted is unreachable (the page run breaks before it) until the same prefix is computed
      again, and a page run outliving its snapshot falls back as above.
    """

    def __init__(self, num_snapshots: int, first: int):
        self.num_snapshots, self.first = num_snapshots, first
        self._free = list(range(first + num_snapshots - 1, first - 1, -1))
        self._by_hash: collections.OrderedDict[bytes, int] = collections.OrderedDict()
        self._owner_of: dict[bytes, Hashable] = {}

    @property
    def num_cached(self) -> int:
        return len(self._by_hash)

    @property
    def num_pending(self) -> int:
        """Rows taken for a save whose step is not committed yet: 0 when nothing runs."""
        return self.num_snapshots - len(self._free) - len(self._by_hash)

    def has(self, page_hash: bytes) -> bool:
        return page_hash in self._by_hash

    def longest(self, hashes: list[bytes]) -> int:
        """The most pages of `hashes` (all cached) whose last page has a snapshot; 0: none."""
        return next((n for n in range(len(hashes), 0, -1) if hashes[n - 1] in self._by_hash), 0)

    def use(self, page_hash: bytes) -> int:
        """The row of the snapshot cached under page_hash, now its most recently used."""
        self._by_hash.move_to_end(page_hash)
        return self._by_hash[page_hash]

    def take(self) -> int | None:
        """A row for a save: a free one, else the least recently used cached one's (None: all
        are pending). A restore planned before from the row it takes still reads the old
        snapshot: the save is copied after that restore, in step order."""
        if self._free:
            return self._free.pop()
        if not self._by_hash:
            return None
        page_hash, row = self._by_hash.popitem(last=False)
        del self._owner_of[page_hash]
        return row

    def cache(self, row: int, page_hash: bytes, owner: Hashable) -> None:
        """A pending row, written by a committed step, cached under page_hash (free again if
        another row already is: two requests computed the same prefix at once)."""
        if page_hash in self._by_hash:
            self._free.append(row)
            return
        self._by_hash[page_hash] = row
        self._owner_of[page_hash] = owner

    def drop_owner(self, owner: Hashable) -> None:
        """Every snapshot cached for `owner` (an adapter's load) is free again."""
        for page_hash in [h for h, o in self._owner_of.items() if o == owner]:
            self._drop(page_hash)

    def reset(self) -> None:
        for page_hash in list(self._by_hash):
            self._drop(page_hash)

    def _drop(self, page_hash: bytes) -> None:
        self._free.append(self._by_hash.pop(page_hash))
        del self._owner_of[page_hash]


def layer_states(
    cfg: ModelConfig,
    num_slots: int,
    *,
    dtype: torch.dtype,
    device: torch.device,
    num_snapshots: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One linear layer's states: conv windows [S, C, W - 1] in dtype and delta-rule states
    [S, H, K, V] float32, S = num_slots + 1 + num_snapshots: the slots, the spare (num_slots),
    then the prefix cache's snapshots (StateSnapshots)."""
    la = cfg.linear_attention
    assert la is not None
    rows = num_slots + 1 + num_snapshots
    conv = torch.zeros(rows, la.conv_dim, la.conv_kernel - 1, dtype=dtype, device=device)
    shape = (rows, la.num_v_heads, la.head_k_dim, la.head_v_dim)
    return conv, torch.zeros(shape, dtype=STATE_DTYPE, device=device)
