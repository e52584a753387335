"""SamplingParams: what a request asks of the sampler, validated once at construction."""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

from moelora.errors import InvalidRequestError

log = logging.getLogger(__name__)

# vLLM's floor: dividing logits by a smaller temperature overflows to inf (then NaN in the
# softmax), so a temperature in (0, MIN_TEMPERATURE) is raised to it, with a warning
MIN_TEMPERATURE = 1e-2


def _is_int(value: object) -> bool:
    """A Python int, not a bool. Not numpy's integers, unlike the engine's prompt token ids
    (which it converts): these values go to torch as they are (manual_seed refuses them)."""
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _are_token_ids(value: object) -> bool:
    return isinstance(value, (list, tuple)) and all(_is_int(t) and t >= 0 for t in value)


# The normal forms. A value the checks refuse stays as given, so the error names what was sent.
def _floored_temperature(value: Any) -> Any:
    if _is_number(value) and 0 < value < MIN_TEMPERATURE:
        log.warning(
            "temperature=%g is below %g, where the logits overflow: %g is used",
            value,
            MIN_TEMPERATURE,
            MIN_TEMPERATURE,
        )
        return MIN_TEMPERATURE
    return value


def _stop_list(value: Any) -> Any:
    return [value] if isinstance(value, str) else value


def _token_id_list(value: Any) -> Any:
    return list(value) if _are_token_ids(value) else value  # a copy of the caller's list


class _Normalised:
    """A field put in its normal form as __init__ sets it, so a SamplingParams holds one form
    from the start (what the engine, the sampler and dataclasses.replace read) and nothing
    rewrites the frozen instance afterwards. A dataclass field whose default is a descriptor:
    the class's default is __get__ without an instance, and the frozen class still refuses any
    later assignment."""

    def __init__(self, default: Any, normal_form: Callable[[Any], Any]) -> None:
        self._default, self._normal_form = default, normal_form

    def __set_name__(self, owner: type, name: str) -> None:
        self._key = f"_{name}"

    def __get__(self, obj: object, owner: type | None = None) -> Any:
        return self._default if obj is None else obj.__dict__[self._key]

    def __set__(self, obj: object, value: Any) -> None:
        obj.__dict__[self._key] = self._normal_form(value)


@dataclass(frozen=True)
class StructuredOutputsParams:
    """vLLM's structured outputs: exactly one constraint, which every sampled token keeps to.
    json: a JSON schema (a dict, or its text); json_object: any JSON object; regex: a regular
    expression the whole output matches; choice: one of these strings; grammar: an EBNF grammar
    (xgrammar's dialect, its start rule `root`). The engine compiles it once per distinct `key`
    (moelora.engine.grammar)."""

    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False

    def __post_init__(self) -> None:
        given = [f.name for f in fields(self) if getattr(self, f.name) not in (None, False)]
        _check(
            len(given) == 1,
            "structured_outputs",
            given,
            "exactly one of json, regex, choice, grammar, json_object",
        )
        _check(
            self.json is None or isinstance(self.json, (dict, str)),
            "structured_outputs.json",
            self.json,
            "a JSON schema (an object or its text)",
        )
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            _check(
                value is None or isinstance(value, str),
                f"structured_outputs.{name}",
                value,
                "a string",
            )
        _check(
            self.choice is None
            or (
                isinstance(self.choice, list)
                and self.choice
                and all(isinstance(c, str) for c in self.choice)
            ),
            "structured_outputs.choice",
            self.choice,
            "a non-empty list of strings",
        )

    @property
    def kind(self) -> str:
        return next(f.name for f in fields(self) if getattr(self, f.name) not in (None, False))

    @property
    def key(self) -> tuple[str, str]:
        """What a compiled grammar is cached by: the kind and its spec in one canonical text
        (a schema's keys sorted, so the same schema sent twice compiles once)."""
        value = getattr(self, self.kind)
        if self.kind == "json" and isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError:
                return self.kind, value  # refused when it is compiled, naming the error
        if not isinstance(value, str):
            value = json.dumps(value, sort_keys=True, ensure_ascii=False)
        return self.kind, value


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = _Normalised(1.0, _floored_temperature)  # 0 = greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 = all tokens
    seed: int | None = None
    stop: list[str] | str | None = _Normalised(None, _stop_list)  # one string: a list of one
    stop_token_ids: list[int] | None = _Normalised(None, _token_id_list)
    ignore_eos: bool = False
    logprobs: int | None = None  # top-k logprobs per generated token, plus the chosen one
    prompt_logprobs: int | None = None  # the same for each prompt token after the first
    # vLLM's penalties: presence and frequency count generated tokens only, repetition counts
    # the prompt too (logit / p where positive, * p where negative)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit, in [-100, 100]
    # vLLM's: a further prefix-cache namespace, inside the request's adapter (or base) one
    cache_salt: str | None = None
    structured_outputs: StructuredOutputsParams | None = None  # a grammar every token keeps to

    def __post_init__(self) -> None:
        for name, valid, expected in _CHECKS:
            value = getattr(self, name)
            _check(valid(value), name, value, expected)
        for token, bias in (self.logit_bias or {}).items():
            _check(_is_int(token) and token >= 0, "logit_bias token", token, "an id >= 0")
            _check(
                _is_number(bias) and -100 <= bias <= 100,
                f"logit_bias[{token}]",
                bias,
                "a number in [-100, 100]",
            )
        _check(
            all(isinstance(s, str) and s for s in self.stop or []),
            "stop",
            self.stop,
            "non-empty strings",
        )
        _check(
            self.structured_outputs is None
            or isinstance(self.structured_outputs, StructuredOutputsParams),
            "structured_outputs",
            self.structured_outputs,
            "None or a StructuredOutputsParams",
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

    @property
    def uses_history(self) -> bool:
        """A penalty: the sampler reads the request's tokens so far."""
        return bool(self.presence_penalty or self.frequency_penalty) or (
            self.repetition_penalty != 1.0
        )


def _none_or_count(value: Any) -> bool:
    return value is None or (_is_int(value) and value >= 0)


def _is_penalty(value: Any) -> bool:
    return _is_number(value) and -2 <= value <= 2


# SamplingParams' checks of one field each, (field, valid, expected), in the order they run:
# the first field that fails is the one the InvalidRequestError names
_CHECKS: tuple[tuple[str, Callable[[Any], bool], str], ...] = (
    ("max_tokens", lambda v: _is_int(v) and v >= 1, "an integer >= 1"),
    ("temperature", lambda v: _is_number(v) and 0 <= v < math.inf, "a finite number >= 0"),
    ("top_p", lambda v: _is_number(v) and 0 < v <= 1, "a number in (0, 1]"),
    ("top_k", lambda v: _is_int(v) and (v == -1 or v >= 1), "-1 or an integer >= 1"),
    ("logprobs", _none_or_count, "None or an integer >= 0"),
    ("prompt_logprobs", _none_or_count, "None or an integer >= 0"),
    (
        "seed",
        lambda v: v is None or (_is_int(v) and -(2**63) <= v < 2**64),
        "None or an integer in [-2**63, 2**64) (what torch generators take)",
    ),
    (
        "stop_token_ids",
        lambda v: v is None or _are_token_ids(v),
        "None or a list of token ids >= 0",
    ),
    ("presence_penalty", _is_penalty, "a number in [-2, 2]"),
    ("frequency_penalty", _is_penalty, "a number in [-2, 2]"),
    ("repetition_penalty", lambda v: _is_number(v) and 0 < v < math.inf, "a finite number > 0"),
    ("cache_salt", lambda v: v is None or isinstance(v, str), "None or a string"),
)


def _check(ok: bool, name: str, value: object, expected: str) -> None:
    if not ok:
        raise InvalidRequestError(f"{name}={value!r} is invalid: expected {expected}")
