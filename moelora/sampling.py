"""SamplingParams (what a request asks for) and the Sampler (logits -> next token)."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch

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


@dataclass(frozen=True)
class SampleResult:
    token_id: int
    logprobs: dict[int, float] | None


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    history: list[tuple[list[int], list[int]]] | None = None,
) -> list[SampleResult]:
    """logits [N, V] float32, one row per request that emits a token this step; history:
    each row's (prompt, generated) token ids, needed when a request asks for penalties.
    Logprobs are the model's own (before penalties and temperature), as vLLM reports them."""
    wants_logprobs = any(p.logprobs is not None for p in params)
    logprobs_all = logits.log_softmax(dim=-1) if wants_logprobs else None
    if any(p.adjusts_logits for p in params):
        assert history is not None and len(history) == len(params)
        logits = adjust_logits(logits, params, history)
    need_probs = [not p.greedy for p in params]
    tokens = logits.argmax(dim=-1)
    if any(need_probs):
        rows = torch.tensor([i for i, n in enumerate(need_probs) if n], device=logits.device)
        probs = _filtered_probs(logits[rows], [params[i] for i in rows.tolist()])
        for j, i in enumerate(rows.tolist()):
            tokens[i] = torch.multinomial(probs[j], 1, generator=generators[i])[0]
    results = []
    for i, (p, token) in enumerate(zip(params, tokens.tolist())):
        top = None
        if p.logprobs is not None:  # vLLM's meaning: the top-k, plus the chosen token
            top = token_logprobs(logprobs_all[i : i + 1], tokens[i : i + 1], p.logprobs)[0]
        results.append(SampleResult(token, top))
    return results


def token_logprobs(
    logprobs: torch.Tensor, tokens: torch.Tensor, top: int
) -> list[dict[int, float]]:
    """vLLM's logprobs entries: per row, the `top` best tokens plus the given one.
    logprobs [N, V] (log-softmax), tokens [N] -> N dicts."""
    chosen = logprobs.gather(1, tokens[:, None])[:, 0].tolist()
    best = logprobs.topk(top, dim=-1) if top else None
    entries = []
    for i, (token, value) in enumerate(zip(tokens.tolist(), chosen)):
        entry = dict(zip(best.indices[i].tolist(), best.values[i].tolist())) if top else {}
        entry[token] = value
        entries.append(entry)
    return entries


def adjust_logits(
    logits: torch.Tensor, params: list[SamplingParams], history: list[tuple[list[int], list[int]]]
) -> torch.Tensor:
    """vLLM's order: the logit bias, then repetition (prompt and generated tokens), then
    frequency and presence (generated tokens). Rows without any are returned unchanged.
    [N, V] -> [N, V]."""
    logits = logits.clone()
    V = logits.shape[-1]
    for i, (p, (prompt, generated)) in enumerate(zip(params, history)):
        if not p.adjusts_logits:
            continue
        row = logits[i]
        if p.logit_bias:
            ids = torch.tensor(list(p.logit_bias), dtype=torch.long, device=row.device)
            row[ids] += torch.tensor(list(p.logit_bias.values()), device=row.device)
        if p.repetition_penalty != 1.0:
            seen = torch.zeros(V, dtype=torch.bool, device=row.device)
            seen[torch.tensor(prompt + generated, dtype=torch.long, device=row.device)] = True
            row[seen] = torch.where(
                row[seen] > 0, row[seen] / p.repetition_penalty, row[seen] * p.repetition_penalty
            )
        if generated and (p.frequency_penalty or p.presence_penalty):
            counts = torch.bincount(
                torch.tensor(generated, dtype=torch.long, device=row.device), minlength=V
            )[:V].to(row.dtype)
            row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)
    return logits


def _filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Temperature, then top-k, then top-p (vLLM's order). [n, V] -> probabilities [n, V]."""
    temps = torch.tensor([p.temperature for p in params], device=logits.device)
    logits = logits / temps[:, None]
    vocab = logits.shape[-1]
    top_k = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params], device=logits.device)
    top_p = torch.tensor([p.top_p for p in params], device=logits.device)
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=logits.device)[None, :]
    sorted_logits.masked_fill_(ranks >= top_k.clamp(max=vocab)[:, None], float("-inf"))
    sorted_probs = sorted_logits.softmax(dim=-1)
    # keep the smallest prefix whose mass reaches top_p (the first token always stays)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    sorted_probs.masked_fill_(mass_before >= top_p[:, None], 0.0)
    probs = torch.zeros_like(sorted_probs).scatter_(1, order, sorted_probs)
    return probs / probs.sum(dim=-1, keepdim=True)
