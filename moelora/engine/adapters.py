"""The adapter registry: the adapters an engine serves, by name, each in the slot layout and in
host memory until a request needs it in a slot. Each registration is a load with a number no
other load ever gets: the prefix-cache namespace of its requests, so a page computed under one
load is never read under another (a reload under the same name included)."""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping

from moelora.config import EngineConfig, ModelConfig
from moelora.errors import (
    AdapterError,
    AdapterExistsError,
    AdapterNotFoundError,
    InvalidRequestError,
)
from moelora.lora.adapter import LoraAdapter, load_adapter
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
        self._numbers = itertools.count()

    def clear(self) -> None:
        """Forget every adapter and the slot pool (the engine is closing)."""
        self._adapters.clear()
        self._loads.clear()
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

    def load(self, name: str, path: str) -> None:
        """Parse and register the PEFT adapter folder `path` as `name`."""
        self._check_new(name)
        adapter = load_adapter(
            name,
            path,
            self.targets,
            max_rank=self.config.max_lora_rank,
            dtype=self.config.torch_dtype,
        )
        self.add(adapter)

    def add(self, adapter: LoraAdapter) -> None:
        """Register an adapter already in the slot layout (load parses a PEFT folder into one;
        lora.adapter.random_adapter makes one for benchmarks)."""
        self._check_new(adapter.name)
        if adapter.rank > self.config.max_lora_rank:
            raise AdapterError(
                f"adapter {adapter.name!r} has rank {adapter.rank}, expected at most "
                f"max_lora_rank={self.config.max_lora_rank}"
            )
        self._adapters[adapter.name] = adapter
        self._loads[adapter.name] = next(self._numbers)

    def _check_new(self, name: str) -> None:
        self.require_lora()
        if name in self._adapters or name == self.config.model_name:
            raise AdapterExistsError(f"an adapter or model named {name!r} is already loaded")

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
        """The number of the adapter's load: its requests' prefix-cache owner."""
        return self._loads[name]

    def remove(self, name: str) -> int:
        """Unregister the adapter; returns its load number, whose cached pages are never read
        again."""
        del self._adapters[name]
        return self._loads.pop(name)
