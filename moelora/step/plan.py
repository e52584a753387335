"""A step as the scheduler plans it (StepPlan, one Chunk per request) and what running it gives
back (StepOutput)."""

from __future__ import annotations

from dataclasses import dataclass, field

from moelora.step.request import Request


@dataclass(frozen=True)
class Chunk:
    request: Request
    start: int  # first token computed this step (== num_computed_tokens at planning)
    num_tokens: int
    samples: bool  # the chunk reaches the last known token: the step emits the next token

    @classmethod
    def next_of(cls, req: Request, num_tokens: int) -> Chunk:
        """The request's next num_tokens uncomputed tokens."""
        start = req.num_computed_tokens
        return cls(req, start, num_tokens, start + num_tokens == req.num_tokens)


@dataclass
class StepPlan:
    chunks: list[Chunk] = field(default_factory=list)
    lora_loads: list[tuple[int, str]] = field(default_factory=list)  # (slot, adapter name)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)


@dataclass(frozen=True)
class SampleResult:
    token_id: int
    logprobs: dict[int, float] | None


@dataclass(frozen=True)
class StepOutput:
    samples: list[SampleResult]  # one per chunk that samples, in chunk order
    prompt_logprobs: dict[int, list[dict[int, float]]]  # chunk index -> its new entries
