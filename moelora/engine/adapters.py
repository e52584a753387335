"""The adapter registry: the adapters an engine serves, by name. Each registration is a load
with a number no other load ever gets: the prefix-cache namespace of its requests and the key
of its slot, so a page computed under one load is never read under another (a reload under
the same name included). A load replaced under its name (replace=True) stays, retired, while
requests added before the replace still use it. The tensors live in the AdapterStore
(lora/store.py): a folder's are checked from its header at registration and read when first
needed, in the background; the scheduler fills a slot from a host copy once it is there."""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping

import torch

from moelora.config import EngineConfig, ModelConfig
from moelora.errors import (
    AdapterError,
    AdapterExistsError,
    AdapterNotFoundError,
    InvalidRequestError,
)
from moelora.lora.adapter import LoraAdapter, adapter_from_tensors
from moelora.lora.shard import full_targets
from moelora.lora.slots import LoraTarget, SlotPool
from moelora.lora.store import AdapterStore, State
from moelora.parallel import Shard


class AdapterRegistry(Mapping[str, LoraAdapter]):
    """Name -> adapter (its layout: a folder's on meta tensors until read), in registration
    order. Slots are not its business: the scheduler fills them on demand, and the engine
    clears an unloaded adapter's."""

    def __init__(
        self, config: EngineConfig, model_config: ModelConfig, shard: Shard, pool: SlotPool | None
    ) -> None:
        """pool: the engine's adapter slots (None: LoRA is disabled, and nothing registers)."""
        self.config, self.model_config, self.shard, self.pool = config, model_config, shard, pool
        self._loads: dict[str, int] = {}  # each adapter's load number
        self._live: set[int] = set()  # every load still served or still used
        self._numbers = itertools.count()
        self.store: AdapterStore | None = None
        if pool is not None:
            gb = config.max_cpu_lora_gb
            self.store = AdapterStore(
                self.targets,
                max_rank=config.max_lora_rank,
                dtype=config.torch_dtype,
                pin=config.torch_device.type == "cuda",  # fills copy beside the step in flight
                max_cpu_loras=config.max_cpu_loras,
                max_cpu_bytes=None if gb is None else int(gb * 2**30),
            )

    def clear(self) -> None:
        """Forget every adapter and the slot pool, and stop the store's reader (the engine is
        closing)."""
        if self.store is not None:
            self.store.close()
        self._loads.clear()
        self._live.clear()
        self.pool = self.store = None

    def __getitem__(self, name: str) -> LoraAdapter:
        return self.store.layout(self._loads[name])

    def __iter__(self) -> Iterator[str]:
        return iter(self._loads)

    def __len__(self) -> int:
        return len(self._loads)

    @property
    def targets(self) -> dict[str, LoraTarget]:
        """The model's LoRA-capable projections (what an adapter may hold), by target key."""
        self.require_lora()
        return full_targets(self.pool.targets, self.shard, self.model_config)

    def require_lora(self) -> None:
        if self.pool is None:
            raise InvalidRequestError("LoRA is disabled in this engine (enable_lora=False)")

    def load(self, name: str, path: str, *, replace: bool = False) -> None:
        """Check the PEFT adapter folder `path` from its header and register it as `name`; its
        tensors are read when a request first needs them."""
        self._check_new(name, replace)
        load = next(self._numbers)
        self.store.add_folder(load, name, path)  # an AdapterError leaves nothing behind
        self._register(name, load)

    def load_tensors(
        self,
        name: str,
        tensors: dict[str, torch.Tensor],
        peft_config: dict,
        *,
        replace: bool = False,
    ) -> None:
        """load() for a PEFT state dict and its adapter_config as a dict (no folder)."""
        self._check_new(name, replace)
        adapter = adapter_from_tensors(
            name,
            tensors,
            peft_config,
            self.targets,
            max_rank=self.config.max_lora_rank,
            dtype=self.config.torch_dtype,
        )
        self.add(adapter, replace=replace)

    def add(self, adapter: LoraAdapter, *, replace: bool = False) -> None:
        """Register an adapter already in the slot layout (load_tensors parses a state dict
        into one; lora.adapter.random_adapter makes one for benchmarks) as a new load, resident
        in host memory for good. replace=True: an adapter served under the name is retired
        (its load stays until the engine forgets it, once nothing uses it)."""
        self._check_new(adapter.name, replace)
        if adapter.rank > self.config.max_lora_rank:
            raise AdapterError(
                f"adapter {adapter.name!r} has rank {adapter.rank}, expected at most "
                f"max_lora_rank={self.config.max_lora_rank}"
            )
        self.pool.check_fits(adapter)
        load = next(self._numbers)
        self.store.add_tensors(load, adapter)
        self._register(adapter.name, load)

    def _register(self, name: str, load: int) -> None:
        self._loads[name] = load
        self._live.add(load)

    def _check_new(self, name: str, replace: bool = False) -> None:
        self.require_lora()
        if name == self.config.model_name or (name in self._loads and not replace):
            raise AdapterExistsError(
                f"an adapter or model named {name!r} is already loaded (replace=True swaps an "
                "adapter's weights)"
            )

    def check_served(self, name: str | None) -> None:
        """A request's model: None (the base) or a registered adapter."""
        if name is not None and name not in self._loads:
            raise AdapterNotFoundError(
                f"model {name!r} is not served: expected the base model "
                f"{self.config.model_name!r} or one of the adapters {sorted(self._loads)}"
            )

    def check_loaded(self, name: str) -> None:
        if name not in self._loads:
            raise AdapterNotFoundError(f"adapter {name!r} is not loaded")

    def load_number(self, name: str) -> int:
        """The number of the adapter's current load: its new requests' slot key and
        prefix-cache owner."""
        return self._loads[name]

    def host_copy(self, load: int) -> LoraAdapter | None:
        """The load's tensors in host memory (served or retired); None while they are read
        from its folder (the read is then under way). AdapterError: the read failed (the
        folder changed or went since it was loaded); the next call reads again."""
        return self.store.get(load)

    def wait_for_reads(self, *, timeout: float) -> None:
        """Wait up to `timeout` seconds for a folder read to end (nothing else can run)."""
        if self.store is not None:
            self.store.completed(timeout)

    def level(self, name: str) -> State:
        """Where the adapter's tensors are outside the GPU: "host", "reading", "disk", or
        "failed" (its last read)."""
        return self.store.state(self._loads[name])

    @property
    def retired(self) -> list[int]:
        """Loads replaced under their name and not yet forgotten (asked every step: empty at
        once when there are none)."""
        if len(self._live) == len(self._loads):
            return []
        return sorted(self._live - set(self._loads.values()))

    def forget(self, load: int) -> None:
        """Drop a retired load (nothing uses it any more)."""
        assert load not in self._loads.values(), load
        self._live.remove(load)
        self.store.remove(load)

    def remove(self, name: str) -> int:
        """Unregister the adapter; returns its load number, whose cached pages are never read
        again."""
        load = self._loads.pop(name)
        self._live.remove(load)
        self.store.remove(load)
        return load
