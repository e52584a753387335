"""A step as the scheduler plans it (StepPlan, one Chunk per request), as it runs (LaunchedStep:
launched on the device, its tokens not yet committed) and what it gives back (StepOutput)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

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


@dataclass(frozen=True)
class Snapshot:
    """A hybrid model's recurrent state after a chunk that ends a full page: copied from the
    request's state slot into row `row` of the state tensors once the step's forward is done,
    cached under that page's hash once the step is committed (engine/state_cache.py)."""

    request: Request
    num_tokens: int  # the chunk's end, a page boundary: the state after these tokens
    row: int


@dataclass
class StepPlan:
    chunks: list[Chunk] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    # hybrid models' prefix caching: (snapshot row, state slot) copied before the forward, for
    # requests admitted with a cached prefix; and the snapshots taken after it
    state_restores: list[tuple[int, int]] = field(default_factory=list)
    snapshots: list[Snapshot] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)


@dataclass(frozen=True)
class StepOutput:
    """A step's samples, one row per chunk that samples, in chunk order: on the device as the
    sampler returns them (nothing has waited for the GPU), or on the host once `to` has copied
    them and the copy has arrived."""

    tokens: torch.Tensor  # [N] int64
    # [N] the chosen token's logprob and [N, K] the best K, when any row asks for logprobs
    chosen: torch.Tensor | None
    top_ids: torch.Tensor | None
    top_values: torch.Tensor | None
    num_top: tuple[int | None, ...]  # per row: how many of the best it reports (None: no logprobs)

    def to(self, device: torch.device, *, non_blocking: bool = False) -> StepOutput:
        """The same on `device`; to the CPU into pinned memory, so a non-blocking copy does not
        wait for the GPU."""

        def moved(t: torch.Tensor | None) -> torch.Tensor | None:
            if t is None or t.device == device:
                return t
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            return host.copy_(t, non_blocking=non_blocking)

        return StepOutput(
            moved(self.tokens),
            moved(self.chosen),
            moved(self.top_ids),
            moved(self.top_values),
            self.num_top,
        )

    def token_ids(self) -> list[int]:
        """Each row's token. Reads the tensors: on the host, once the copy has arrived."""
        return self.tokens.tolist()

    def logprobs(self) -> list[dict[int, float] | None]:
        """Each row's logprobs entry (vLLM's: the best k, plus the chosen token), None for a row
        that asks for none. Reads the tensors: on the host, once the copy has arrived."""
        if self.chosen is None:
            return [None] * len(self.num_top)
        tokens, chosen = self.tokens.tolist(), self.chosen.tolist()
        ids, values = self.top_ids.tolist(), self.top_values.tolist()
        entries: list[dict[int, float] | None] = []
        for i, (token, k) in enumerate(zip(tokens, self.num_top)):
            entry = None
            if k is not None:
                entry = dict(zip(ids[i][:k], values[i][:k]))
                entry[token] = chosen[i]
            entries.append(entry)
        return entries


@dataclass(eq=False)
class LaunchedStep:
    """One step in flight: ModelRunner.forward_step launches its forward and lm_head, then
    sample_step its sampling; the engine commits its tokens once their host copy has arrived.
    `tokens` stay on the device, where the next step's inputs read them."""

    plan: StepPlan
    requests: list[Request]  # the rows that sample: the requests of the plan's sampling chunks
    logits: torch.Tensor | None  # [N, V] of those rows until sampled (None: none samples)
    prompt_logprobs: dict[int, list[dict[int, float]]]  # chunk index -> its new entries, on host
    number: int = -1  # the engine's count of launched steps: Request.last_step
    tokens: torch.Tensor | None = None  # [N] int64, on the device once sampled
    release_after: list[Request] = field(default_factory=list)  # finished while it ran
    host: StepOutput | None = None  # the samples' copy to the host, arriving without a block
    copied: torch.cuda.Event | None = None  # recorded after that copy (None: nothing to wait on)

    def sampled(self, out: StepOutput) -> None:
        """`out` (on the device) is this step's samples: its logits are done with, and the copy
        to the host is launched without waiting for the GPU."""
        self.logits = None
        self.tokens = out.tokens
        on_cuda = out.tokens.is_cuda
        self.host = out.to(torch.device("cpu"), non_blocking=on_cuda)
        if on_cuda:
            self.copied = torch.cuda.Event()
            self.copied.record()

    def output(self) -> StepOutput | None:
        """The samples on the host, once their copy has arrived (None: no row samples)."""
        if self.copied is not None:
            self.copied.synchronize()
        return self.host
