"""The adapter store: every load's host tensors, in host memory (page-locked) while they are
used and on disk otherwise: the host tier between the PEFT folders and the GPU slots.

A folder is checked when it is added, from its config and its weights file's header alone (no
tensor data is read), so a bad adapter is refused then, with load_adapter's own error. Its
tensors are read when first asked for, by one worker thread, and stay in host memory until a
least-recently-used eviction drops them: resident folder adapters are bounded by count
(max_cpu_loras, vLLM's flag) and by bytes. An adapter added as tensors (in memory, random) has
no folder to read back: it stays resident, counts towards both bounds, and is never evicted.

The engine thread calls every method; the worker only completes reads. One lock guards all
state, and nothing waits on the worker while holding it.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from moelora.errors import AdapterError
from moelora.lora.adapter import LoraAdapter, load_adapter
from moelora.lora.slots import LoraTarget

State = Literal["disk", "reading", "host", "failed"]

# what load_adapter reads of a folder; a change to any of them after registration refuses the read
_FILES = ("adapter_config.json", "adapter_model.safetensors", "adapter_model.bin")


@dataclass(eq=False)
class _Entry:
    layout: LoraAdapter  # the header-only parse (meta tensors); an in-memory adapter itself
    path: str | None  # None: added as tensors, nothing to read back
    stamp: dict[str, tuple[int, int]]  # each file's (size, mtime_ns) when it was added
    adapter: LoraAdapter | None = None  # the host copy, while resident
    read: Future | None = None  # the read in flight
    error: AdapterError | None = None  # the last read's failure, until get raises it
    holds: int = 0


class AdapterStore:
    """Load number -> the adapter's host tensors, read from its folder on demand."""

    def __init__(
        self,
        targets: dict[str, LoraTarget],
        *,
        max_rank: int,
        dtype: torch.dtype,
        pin: bool,
        max_cpu_loras: int | None = None,
        max_cpu_bytes: int | None = None,
    ) -> None:
        """pin: keep host copies page-locked (slot fills copy them asynchronously); the bounds
        (None: none) apply to the resident adapters, in-memory ones included."""
        assert max_cpu_loras is None or max_cpu_loras >= 0, max_cpu_loras
        assert max_cpu_bytes is None or max_cpu_bytes >= 0, max_cpu_bytes
        self.targets, self.max_rank, self.dtype, self.pin = targets, max_rank, dtype, pin
        self.max_cpu_loras, self.max_cpu_bytes = max_cpu_loras, max_cpu_bytes
        self._entries: dict[int, _Entry] = {}
        self._lru: OrderedDict[int, None] = OrderedDict()  # resident folder loads, oldest use first
        self._done: list[int] = []  # loads whose reads ended since completed() last returned
        self._lock = threading.Condition()
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="moelora-adapter-read")

    # ---- registration ---------------------------------------------------------------------

    def add_folder(self, load: int, name: str, path: str) -> None:
        """Check the PEFT folder `path` from its header (AdapterError as load_adapter raises
        it) and register it under `load`, on disk until first asked for."""
        stamp = _stamp(path)  # before the header: a change while it is read shows later
        layout = load_adapter(
            name, path, self.targets, max_rank=self.max_rank, dtype=self.dtype, meta=True
        )
        with self._lock:
            assert load not in self._entries, load
            self._entries[load] = _Entry(layout, path, stamp)

    def add_tensors(self, load: int, adapter: LoraAdapter) -> None:
        """Register an adapter already in the slot layout: resident for good."""
        adapter = adapter.pinned() if self.pin else adapter
        with self._lock:
            assert load not in self._entries, load
            self._entries[load] = _Entry(adapter, None, {}, adapter)
            self._evict()

    def remove(self, load: int) -> None:
        """Forget the load (unloaded or retired); a read in flight for it is discarded."""
        with self._lock:
            entry = self._entries.pop(load)
            self._lru.pop(load, None)
            self._done = [done for done in self._done if done != load]
            if entry.read is not None:
                entry.read.cancel()  # a read already running ends unseen (_complete)

    def close(self) -> None:
        """Forget every load and join the worker (a read in flight ends first)."""
        with self._lock:
            self._entries.clear()
            self._lru.clear()
            self._done.clear()
        self._worker.shutdown(wait=True, cancel_futures=True)

    # ---- what a load is -------------------------------------------------------------------

    def layout(self, load: int) -> LoraAdapter:
        """The adapter's layout: rank, scaling and module shapes (a folder's on meta tensors)."""
        return self._entries[load].layout

    def rank(self, load: int) -> int:
        return self._entries[load].layout.rank

    def nbytes(self, load: int) -> int:
        """The bytes its host copy takes (what a slot fill copies)."""
        return self._entries[load].layout.nbytes

    def state(self, load: int) -> State:
        with self._lock:
            entry = self._entries[load]
            if entry.adapter is not None:
                return "host"
            if entry.error is not None:
                return "failed"
            return "disk" if entry.read is None else "reading"

    # ---- host copies ----------------------------------------------------------------------

    def get(self, load: int) -> LoraAdapter | None:
        """The host copy, marked most recently used; None while it is not resident (a read is
        then under way). A failed read raises its AdapterError once; the next get reads again."""
        with self._lock:
            entry = self._entries[load]
            if entry.adapter is not None:
                if entry.path is not None:
                    self._lru.move_to_end(load)
                return entry.adapter
            if entry.error is not None:
                error, entry.error = entry.error, None
                raise error
            self._start(load, entry)
            return None

    def prefetch(self, load: int) -> None:
        """Start reading the load if it is on disk; unlike get, no use is recorded."""
        with self._lock:
            entry = self._entries[load]
            if entry.adapter is None and entry.error is None:
                self._start(load, entry)

    def hold(self, load: int) -> None:
        """Keep the load resident once it is (its fill is scheduled or its requests wait)."""
        with self._lock:
            self._entries[load].holds += 1

    def release(self, load: int) -> None:
        with self._lock:
            entry = self._entries[load]
            assert entry.holds > 0, load
            entry.holds -= 1
            self._evict()

    def completed(self, timeout: float = 0.0) -> list[int]:
        """The loads whose reads ended (resident or failed) since the last call, waiting up to
        `timeout` seconds for one when there is none yet."""
        with self._lock:
            self._lock.wait_for(lambda: self._done, timeout)
            done, self._done = self._done, []
            return done

    # ---- reads, on the worker -------------------------------------------------------------

    def _start(self, load: int, entry: _Entry) -> None:
        assert entry.path is not None, load  # an in-memory adapter is always resident
        if entry.read is None:
            entry.read = self._worker.submit(self._read, load, entry)

    def _read(self, load: int, entry: _Entry) -> None:
        name = entry.layout.name
        try:
            result: LoraAdapter | AdapterError = load_adapter(
                name, entry.path, self.targets, max_rank=self.max_rank, dtype=self.dtype
            )
            if _stamp(entry.path) != entry.stamp:
                raise AdapterError(
                    f"adapter {name!r}: {entry.path} changed since it was loaded, expected the "
                    "files it was loaded from (load it again to serve the new ones)"
                )
            assert _shapes(result) == _shapes(entry.layout), name
            result = result.pinned() if self.pin else result
        # kept without their tracebacks, whose frames would keep the tensors read so far alive
        except AdapterError as e:
            result = e.with_traceback(None)
        except Exception as e:  # an unreadable file: only this adapter's requests fail
            result = AdapterError(f"adapter {name!r}: reading {entry.path} failed: {e!r}")
            result.__cause__ = e.with_traceback(None)
        self._complete(load, entry, result)

    def _complete(self, load: int, entry: _Entry, result: LoraAdapter | AdapterError) -> None:
        with self._lock:
            entry.read = None
            if self._entries.get(load) is not entry:
                return  # removed while it was read
            if isinstance(result, AdapterError):
                entry.error = result
            else:
                entry.adapter = result
                self._lru[load] = None
                self._evict(keep=load)
            self._done.append(load)
            self._lock.notify_all()

    def _evict(self, keep: int | None = None) -> None:
        """Drop least-recently-used folder adapters, none held and not `keep` (just read),
        while the resident ones exceed a bound; when none can go, stay over it. Only references
        are dropped: the pinned host allocator keeps memory an async copy still reads."""
        resident = [e for e in self._entries.values() if e.adapter is not None]
        count, nbytes = len(resident), sum(e.layout.nbytes for e in resident)
        for load in list(self._lru):
            if not self._over(count, nbytes):
                return
            entry = self._entries[load]
            if entry.holds or load == keep:
                continue
            entry.adapter = None
            del self._lru[load]
            count, nbytes = count - 1, nbytes - entry.layout.nbytes

    def _over(self, count: int, nbytes: int) -> bool:
        return (self.max_cpu_loras is not None and count > self.max_cpu_loras) or (
            self.max_cpu_bytes is not None and nbytes > self.max_cpu_bytes
        )


def _stamp(path: str) -> dict[str, tuple[int, int]]:
    """(size, mtime_ns) of each file of the folder that load_adapter may read."""
    stamp = {}
    for file in _FILES:
        try:
            stat = (Path(path) / file).stat()
        except OSError:  # absent (or no folder): load_adapter says what is missing
            continue
        stamp[file] = (stat.st_size, stat.st_mtime_ns)
    return stamp


def _shapes(adapter: LoraAdapter) -> tuple:
    modules = sorted(adapter.modules.items())
    return adapter.rank, adapter.scaling, [(k, m.a.shape, m.b.shape) for k, m in modules]
