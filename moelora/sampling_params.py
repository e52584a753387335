"""SamplingParams: what a request asks of the sampler, validated once at construction."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

from moelora.errors import InvalidRequestError

log = logging.getLogger(__name__)

# vLLM's floor: dividing logits by a smaller temperature overflows to inf (then NaN in the
# softmax), so a temperature in (0, MIN_TEMPERATURE) is raised to it, with a warning
MIN_TEMPERATURE = 1e-2


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 = all tokens
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None  # top-k logprobs per generated token, plus the chosen one
    prompt_logprobs: int | None = None  # the same for each prompt token after the first
    # vLLM's penalties: presence and frequency count generated tokens only, repetition counts
    # the prompt too (logit / p where positive, * p where negative)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit, in [-100, 100]

    def __post_init__(self) -> None:
        _check(
            _is_int(self.max_tokens) and self.max_tokens >= 1,
            "max_tokens",
            self.max_tokens,
            "an integer >= 1",
        )
        _check(
            _is_number(self.temperature) and 0 <= self.temperature < math.inf,
            "temperature",
            self.temperature,
            "a finite number >= 0",
        )
        if 0 < self.temperature < MIN_TEMPERATURE:
            log.warning(
                "temperature=%g is below %g, where the logits overflow: %g is used",
                self.temperature,
                MIN_TEMPERATURE,
                MIN_TEMPERATURE,
            )
            object.__setattr__(self, "temperature", MIN_TEMPERATURE)
        _check(
            _is_number(self.top_p) and 0 < self.top_p <= 1,
            "top_p",
            self.top_p,
            "a number in (0, 1]",
        )
        _check(
            _is_int(self.top_k) and (self.top_k == -1 or self.top_k >= 1),
            "top_k",
            self.top_k,
            "-1 or an integer >= 1",
        )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            _check(
                value is None or (_is_int(value) and value >= 0),
                name,
                value,
                "None or an integer >= 0",
            )
        _check(
            self.seed is None or (_is_int(self.seed) and -(2**63) <= self.seed < 2**64),
            "seed",
            self.seed,
            "None or an integer in [-2**63, 2**64) (what torch generators take)",
        )
        _check(
            self.stop_token_ids is None
            or (
                isinstance(self.stop_token_ids, (list, tuple))
                and all(_is_int(t) and t >= 0 for t in self.stop_token_ids)
            ),
            "stop_token_ids",
            self.stop_token_ids,
            "None or a list of token ids >= 0",
        )
        if self.stop_token_ids is not None:
            object.__setattr__(self, "stop_token_ids", list(self.stop_token_ids))
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(_is_number(value) and -2 <= value <= 2, name, value, "a number in [-2, 2]")
        _check(
            _is_number(self.repetition_penalty) and 0 < self.repetition_penalty < math.inf,
            "repetition_penalty",
            self.repetition_penalty,
            "a finite number > 0",
        )
        for token, bias in (self.logit_bias or {}).items():
            _check(_is_int(token) and token >= 0, "logit_bias token", token, "an id >= 0")
            _check(
                _is_number(bias) and -100 <= bias <= 100,
                f"logit_bias[{token}]",
                bias,
                "a number in [-100, 100]",
            )
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", [self.stop])  # normalised once, at construction
        _check(
            all(isinstance(s, str) and s for s in self.stop or []),
            "stop",
            self.stop,
            "non-empty strings",
        )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def adjusts_logits(self) -> bool:
        """Anything that changes the logits before sampling: a bias or a penalty."""
        return bool(self.presence_penalty or self.frequency_penalty or self.logit_bias) or (
            self.repetition_penalty != 1.0
        )


def _check(ok: bool, name: str, value: object, expected: str) -> None:
    if not ok:
        raise InvalidRequestError(f"{name}={value!r} is invalid: expected {expected}")


def _is_int(value: object) -> bool:
    """A Python int, not a bool. Not numpy's integers, unlike the engine's prompt token ids
    (which it converts): these values go to torch as they are (manual_seed refuses them)."""
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
