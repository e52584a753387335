"""The adapter registry: the adapters an engine serves, by name, each in the slot layout and in
host memory until a request needs it in a slot. Each registration is a load with a number no
other load ever gets: the prefix-cache namespace of its requests and the key of its slot, so a
page computed under one load is never read under another (a reload under the same name
included). A load replaced under its name (replace=True) stays, retired, while requests added
before the replace still use it."""

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
from moelora.lora.adapter import LoraAdapter, adapter_from_tensors, load_adapter
from moelora.lora.shard import full_targets
from moelora.lora.slots import LoraTarget, SlotPool
from moelora.parallel import Shard


class AdapterRegistry(Mapping[str, LoraAdapter]):
    """Name -> adapter, in registration order. Slots are not its business: the scheduler fills
    them on demand, and the engine clears an unloaded adapter's."""

    def __init__(
        self, config: EngineConfig, model_config: ModelConfig, shard: Shard, pool: SlotPool | None
    ) -> None:
        """pool: the engine's adapter slots (None: LoRA is disabled, and nothing registers)."""
        self.config, self.model_config, self.shard, self.pool = config, model_config, shard, pool
        self._adapters: dict[str, LoraAdapter] = {}
        self._loads: dict[str, int] = {}  # each adapter's load number
        self._by_load: dict[int, LoraAdapter] = {}  # every load still served or still used
        self._numbers = itertools.count()

    def clear(self) -> None:
        """Forget every adapter and the slot pool (the engine is closing)."""
        self._adapters.clear()
        self._loads.clear()
        self._by_load.clear()
        self.pool = None

    def __getitem__(self, name: str) -> LoraAdapter:
        return self._adapters[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._adapters)

    def __len__(self) -> int:
        return len(self._adapters)

    @property
    def targets(self) -> dict[str, LoraTarget]:
        """The model's LoRA-capable projections (what an adapter may hold), by target key."""
        self.require_lora()
        return full_targets(self.pool.targets, self.shard, self.model_config)

    def require_lora(self) -> None:
        if self.pool is None:
            raise InvalidRequestError("LoRA is disabled in this engine (enable_lora=False)")

    def load(self, name: str, path: str, *, replace: bool = False) -> None:
        """Parse and register the PEFT adapter folder `path` as `name`."""
        self._check_new(name, replace)
        adapter = load_adapter(
            name,
            path,
            self.targets,
            max_rank=self.config.max_lora_rank,
            dtype=self.config.torch_dtype,
        )
        self.add(adapter, replace=replace)

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
        """Register an adapter already in the slot layout (load parses a PEFT folder into one;
        lora.adapter.random_adapter makes one for benchmarks) as a new load. replace=True: an
        adapter served under the name is retired (by_load still gives it); the engine forgets
        it once nothing uses it."""
        self._check_new(adapter.name, replace)
        if adapter.rank > self.config.max_lora_rank:
            raise AdapterError(
                f"adapter {adapter.name!r} has rank {adapter.rank}, expected at most "
                f"max_lora_rank={self.config.max_lora_rank}"
            )
        if self.config.torch_device.type == "cuda":
            adapter = adapter.pinned()  # slot fills copy it beside the step in flight
        load = next(self._numbers)
        self._adapters[adapter.name] = adapter
        self._loads[adapter.name] = load
        self._by_load[load] = adapter

    def _check_new(self, name: str, replace: bool = False) -> None:
        self.require_lora()
        if name == self.config.model_name or (name in self._adapters and not replace):
            raise AdapterExistsError(
                f"an adapter or model named {name!r} is already loaded (replace=True swaps an "
                "adapter's weights)"
            )

    def check_served(self, name: str | None) -> None:
        """A request's model: None (the base) or a registered adapter."""
        if name is not None and name not in self._adapters:
            raise AdapterNotFoundError(
                f"model {name!r} is not served: expected the base model "
                f"{self.config.model_name!r} or one of the adapters {sorted(self._adapters)}"
            )

    def check_loaded(self, name: str) -> None:
        if name not in self._adapters:
            raise AdapterNotFoundError(f"adapter {name!r} is not loaded")

    def load_number(self, name: str) -> int:
        """The number of the adapter's current load: its new requests' slot key and
        prefix-cache owner."""
        return self._loads[name]

    def by_load(self, load: int) -> LoraAdapter:
        """The adapter of a load, served or retired (a slot is filled by load)."""
        return self._by_load[load]

    @property
    def retired(self) -> list[int]:
        """Loads replaced under their name and not yet forgotten (asked every step: empty at
        once when there are none)."""
        if len(self._by_load) == len(self._loads):
            return []
        current = set(self._loads.values())
        return [load for load in self._by_load if load not in current]

    def forget(self, load: int) -> None:
        """Drop a retired load (nothing uses it any more)."""
        assert load not in self._loads.values(), load
        del self._by_load[load]

    def remove(self, name: str) -> int:
        """Unregister the adapter; returns its load number, whose cached pages are never read
        again."""
        del self._adapters[name]
        load = self._loads.pop(name)
        del self._by_load[load]
        return load
