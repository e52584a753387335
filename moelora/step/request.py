"""A request's life inside the engine, and what the engine reports about it."""

from __future__ import annotations

import enum
import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np
import torch

from moelora.sampling_params import SamplingParams

T = TypeVar("T")


class Prefix(Sequence[T]):
    """The first n items of a list that never changes them, only what comes after: a request's
    output as one step reports it, read without a copy. Copying every token so far, every step,
    made the host's work grow with the length of the output."""

    __slots__ = ("_items", "_n")

    def __init__(self, items: list[T], n: int | None = None) -> None:
        self._items, self._n = items, len(items) if n is None else n

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            start, stop, step = i.indices(self._n)
            return self._items[start:stop:step]
        if not -self._n <= i < self._n:
            raise IndexError(f"index {i} is out of range for {self._n} items")
        return self._items[i % self._n]

    def __iter__(self) -> Iterator[T]:
        return itertools.islice(self._items, self._n)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Sequence) or isinstance(other, str):
            return NotImplemented
        return len(other) == self._n and all(a == b for a, b in zip(self, other))

    def __repr__(self) -> str:
        return repr(list(self))


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    lora: str | None
    arrival: int
    generator: torch.Generator | None = None  # set for seeded sampling
    # the sampled tokens, then one or two placeholders for tokens of steps still on the GPU
    # (async scheduling): -1 - j stands for row j of that step's samples (see num_placeholders)
    output_token_ids: list[int] = field(default_factory=list)
    num_placeholders: int = 0
    output_logprobs: list[dict[int, float]] = field(default_factory=list)
    # entry j is for prompt token j + 1 (the first prompt token has none), when asked for
    prompt_logprobs: list[dict[int, float]] = field(default_factory=list)
    text: str = ""
    detok_offsets: tuple[int, int] = (0, 0)  # see Tokenizer.decode_incremental
    pages: list[int] = field(default_factory=list)  # add_pages and clear_pages change it
    # the same ids, for each step's page table to copy whole (not id by id)
    page_array: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    num_computed_tokens: int = 0  # tokens whose KV is in the cache
    slot: int | None = None  # adapter slot held while running
    # hybrid models: the recurrent-state slot it holds from admission to its release
    # (engine/state_cache.py); None before, after, and for every other model
    state_slot: int | None = None
    status: Status = Status.WAITING
    finish_reason: str | None = None
    last_step: int = -1  # the newest step that computes some of its tokens
    # prefix caching: its namespace (None: caching is off), the hash of each full page whose
    # tokens are known (the prompt's at first, then generated ones), what the cache drops its
    # pages by (its adapter's load, None for base), how many of its pages are known to the
    # cache, and the prompt tokens found cached at its first admission
    cache_namespace: bytes | None = None
    page_hashes: list[bytes] = field(default_factory=list)
    cache_owner: int | None = None
    num_cached_pages: int = 0
    # its adapter's load number, taken when it is added: the key of its slot, so a request
    # added before a replace runs on the weights it was added under
    lora_load: int | None = None
    num_cached_tokens: int | None = None
    queued_at: int = 0  # the scheduler's step when it last entered the waiting queue
    error: str | None = None  # why the engine aborted it (its adapter's folder unreadable)
    # a constrained request's place in its grammar (engine.grammar.GrammarState), advanced by
    # each committed token; None: unconstrained
    grammar: Any = None

    @property
    def num_tokens(self) -> int:
        """Prompt and output, placeholders included: what the scheduler plans over."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_outputs(self) -> int:
        """Tokens sampled and known on the host."""
        return len(self.output_token_ids) - self.num_placeholders

    def add_placeholder(self, row: int) -> None:
        """The token a launched step samples in `row`, until it is known."""
        self.output_token_ids.append(-1 - row)
        self.num_placeholders += 1

    def commit(self, token_id: int) -> None:
        """The oldest placeholder becomes the token its step sampled."""
        assert self.num_placeholders > 0, self.request_id
        self.output_token_ids[self.num_outputs] = token_id
        self.num_placeholders -= 1

    def drop_placeholders(self) -> None:
        """Finished: the tokens still in flight are never emitted."""
        del self.output_token_ids[self.num_outputs :]
        self.num_placeholders = 0

    def add_pages(self, new: list[int]) -> None:
        n = len(self.pages)
        self.pages += new
        if len(self.pages) > len(self.page_array):  # grows by doubling: O(1) a page
            grown = np.zeros(max(2 * len(self.page_array), len(self.pages), 8), np.int32)
            grown[:n] = self.page_array[:n]
            self.page_array = grown
        self.page_array[n : len(self.pages)] = new

    def clear_pages(self) -> None:
        self.pages = []

    def token_slice(self, start: int, stop: int) -> list[int]:
        """Tokens start..stop of prompt + output, without copying the whole sequence."""
        prompt = len(self.prompt_token_ids)
        if stop <= prompt:
            return self.prompt_token_ids[start:stop]
        if start >= prompt:
            return self.output_token_ids[start - prompt : stop - prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[: stop - prompt]

    def to_output(self) -> RequestOutput:
        return RequestOutput(
            request_id=self.request_id,
            prompt_token_ids=self.prompt_token_ids,
            token_ids=Prefix(self.output_token_ids, self.num_outputs),
            text=self.text,
            finish_reason=self.finish_reason,
            logprobs=Prefix(self.output_logprobs) if self.params.logprobs is not None else None,
            lora=self.lora,
            num_cached_tokens=self.num_cached_tokens or 0,
            error=self.error,
            prompt_logprobs=(
                [None, *self.prompt_logprobs] if self.params.prompt_logprobs is not None else None
            ),
        )


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: Sequence[int]  # generated so far (a Prefix of the request's: no copy)
    text: str  # generated text so far, stop string cut off
    finish_reason: str | None  # None while running; "stop" | "length" | "abort"
    logprobs: Sequence[dict[int, float]] | None
    lora: str | None = None
    # vLLM's layout: None for the first prompt token, then one entry per prompt token
    prompt_logprobs: list[dict[int, float] | None] | None = None
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    error: str | None = None  # finish_reason "abort" by the engine: why

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
