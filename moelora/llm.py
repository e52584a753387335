"""LLM: the offline API. Adds every prompt to one engine and steps until all are done."""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from typing import Any

import torch

from moelora.config import EngineConfig
from moelora.engine.engine import Engine
from moelora.errors import AdapterError, InvalidRequestError
from moelora.lora.adapter import random_adapter
from moelora.sampling_params import SamplingParams
from moelora.step.request import RequestOutput


class LLM:
    def __init__(
        self,
        model: str,
        *,
        lora_modules: Mapping[str, str] | None = None,
        **engine_options: Any,
    ) -> None:
        """engine_options are EngineConfig's fields by name (max_loras, max_lora_rank, dtype,
        device, seed, ...), each with EngineConfig's default; an unknown name is a TypeError
        that names it."""
        config = EngineConfig(model=model, lora_modules=dict(lora_modules or {}), **engine_options)
        self.engine = Engine(config)
        self._ids = itertools.count()

    def generate(
        self,
        prompts: list[str] | list[list[int]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        *,
        lora: list[str | None] | str | None = None,
    ) -> list[RequestOutput]:
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        n = len(prompts)
        params = _per_prompt(sampling_params or SamplingParams(), n, "sampling_params")
        loras = _per_prompt(lora, n, "lora")
        token_ids = [self._encode(p) for p in prompts]
        ids = [f"offline-{next(self._ids)}" for _ in range(n)]
        finished: dict[str, RequestOutput] = {}
        try:
            for rid, toks, p, name in zip(ids, token_ids, params, loras):
                self.engine.add_request(rid, toks, p, name)
            while len(finished) < n:
                for out in self.engine.step():
                    if out.finished:
                        finished[out.request_id] = out
            # a request that stopped in step N was planned into step N+1 (async scheduling),
            # which may still be in flight holding its pages: the engine is left idle
            self.engine.commit_in_flight()
        except BaseException:  # a refused request, a failed step, Ctrl-C: nothing stays behind
            for rid in ids:
                if rid not in finished:
                    self.engine.abort_request(rid)  # a no-op for those never added
            raise
        return [finished[rid] for rid in ids]

    def close(self) -> None:
        """Stop the engine's other ranks (tensor_parallel_size > 1) and free what it holds on
        the device, so another LLM can be built in this process; this one cannot generate
        after it."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return self.engine.text_tokenizer("text prompts").encode(prompt)
        return list(prompt)

    def load_lora(self, name: str, path: str, *, replace: bool = False) -> None:
        """Serve the PEFT adapter folder `path` as `name`. replace=True swaps the weights of
        the adapter served under `name` without a restart: requests added from now on use the
        new weights, those added before finish on the old ones."""
        self.engine.load_lora(name, path, replace=replace)

    def load_lora_from_tensors(
        self,
        name: str,
        tensors: dict[str, torch.Tensor],
        peft_config: dict,
        *,
        replace: bool = False,
    ) -> None:
        """load_lora for an adapter in memory (a trainer's, say): a PEFT state dict (the keys
        get_peft_model_state_dict gives, or those of adapter_model.safetensors) and its
        adapter_config as a dict (LoraConfig.to_dict()). The tensors are copied."""
        self.engine.load_lora_from_tensors(name, tensors, peft_config, replace=replace)

    def add_random_lora(self, name: str, *, rank: int, seed: int = 0, scaling: float = 2.0) -> None:
        """Register an adapter of random weights under `name`, without a PEFT folder: rank
        `rank` (1 .. max_lora_rank) on every projection the model can adapt (attention q/k/v/o,
        each expert's gate/up/down, a shared expert or dense MLP where the model has one),
        A ~ N(0, 1/in) and B ~ N(0, 0.01^2), drawn from `seed` on the engine's device and kept
        in host memory, as a loaded adapter is (the KV cache was sized without it). Requests
        then name it like a loaded adapter (lora=name); for benchmarks and smoke runs, where
        what matters is the adapter's shape, not what it learned."""
        engine = self.engine
        targets = engine.lora_targets  # refuses an engine without LoRA first
        max_rank = engine.config.max_lora_rank
        if not 1 <= rank <= max_rank:  # before any weight is drawn: 48 layers take a while
            raise AdapterError(
                f"random adapter {name!r}: rank={rank} is invalid: expected 1 .. "
                f"max_lora_rank={max_rank}"
            )
        config = engine.config
        adapter = random_adapter(
            name,
            targets,
            rank=rank,
            seed=seed,
            dtype=config.torch_dtype,
            device=config.torch_device,
            scaling=scaling,
            store="cpu",
        )
        engine.add_adapter(adapter)

    def unload_lora(self, name: str) -> None:
        self.engine.unload_lora(name)

    def list_loras(self) -> list[str]:
        return self.engine.list_loras()

    def get_tokenizer(self):
        return self.engine.tokenizer


def _per_prompt(value, n: int, name: str) -> list:
    if isinstance(value, list):
        if len(value) != n:
            raise InvalidRequestError(
                f"{name} has {len(value)} entries, expected one per prompt ({n})"
            )
        return value
    return [value] * n
