"""A request's life inside the engine, and what the engine reports about it."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from moelora.sampling_params import SamplingParams


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
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[dict[int, float]] = field(default_factory=list)
    # entry j is for prompt token j + 1 (the first prompt token has none), when asked for
    prompt_logprobs: list[dict[int, float]] = field(default_factory=list)
    text: str = ""
    detok_offsets: tuple[int, int] = (0, 0)  # see Tokenizer.decode_incremental
    pages: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose KV is in the cache
    slot: int | None = None  # adapter slot held while running
    status: Status = Status.WAITING
    finish_reason: str | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

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
            token_ids=list(self.output_token_ids),
            text=self.text,
            finish_reason=self.finish_reason,
            logprobs=list(self.output_logprobs) if self.params.logprobs is not None else None,
            lora=self.lora,
            prompt_logprobs=(
                [None, *self.prompt_logprobs] if self.params.prompt_logprobs is not None else None
            ),
        )


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]  # generated so far
    text: str  # generated text so far, stop string cut off
    finish_reason: str | None  # None while running; "stop" | "length" | "abort"
    logprobs: list[dict[int, float]] | None
    lora: str | None = None
    # vLLM's layout: None for the first prompt token, then one entry per prompt token
    prompt_logprobs: list[dict[int, float] | None] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
