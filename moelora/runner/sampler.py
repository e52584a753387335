"""The sampler: logits -> each request's next token (greedy, temperature, top-k, top-p, seeds),
with vLLM's logit bias and penalties, and logprobs."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moelora.sampling_params import SamplingParams
from moelora.step.plan import StepOutput

# A repetition penalty as float32 sees it: 5e-324 rounds to 0 (a division by zero) and 1e308 to
# inf (0 * inf is NaN); inside this range every logit stays finite
PENALTY_RANGE = (1e-30, 1e30)


@dataclass(frozen=True)
class TokenMask:
    """The tokens a step's constrained rows may sample (their grammars'), from the host."""

    bitmask: torch.Tensor  # [n, ceil(V / 32)] int32: bit j of word w allows token 32 w + j
    rows: list[int]  # the step's sample row of each bitmask row


def apply_token_mask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    """Semantics: logits[rows[i], t] = -inf where bit t of bitmask[i] is 0, for every i at once.
    logits [N, V] float, in place; bitmask [n, W] int32 with 32 W >= V; rows [n] int64; all on
    logits' device. Other rows are not touched."""
    V = logits.shape[-1]
    bits = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    allowed = ((bitmask[:, :, None] >> bits) & 1).flatten(1)[:, :V].bool()  # [n, V]
    logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    history: list[tuple[list[int], list[int]]] | None = None,
    mask: TokenMask | None = None,
) -> StepOutput:
    """logits [N, V] float32, one row per request that emits a token this step; history:
    each row's (prompt, generated) token ids, needed when a request asks for penalties; mask:
    the grammars of the constrained rows (None: no row is constrained, and nothing is masked).
    Logprobs are the model's own (before penalties, grammars and temperature), as vLLM reports
    them. Launches only: the host does not wait for the GPU here."""
    num_top = tuple(p.logprobs for p in params)
    wants_logprobs = any(k is not None for k in num_top)
    logprobs_all = logits.log_softmax(dim=-1) if wants_logprobs else None
    if any(p.adjusts_logits for p in params):
        assert history is not None and len(history) == len(params)
        logits = adjust_logits(logits, params, history)
    if mask is not None:  # in place: the caller's logits are this step's own
        device = logits.device
        rows = torch.tensor(mask.rows, dtype=torch.int64).to(device, non_blocking=True)
        apply_token_mask(logits, mask.bitmask.to(device, non_blocking=True), rows)
    tokens = logits.argmax(dim=-1)
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if rows:
        index = torch.tensor(rows, device=logits.device)
        probs = _filtered_probs(logits[index], [params[i] for i in rows])
        for j, i in enumerate(rows):
            tokens[i] = torch.multinomial(probs[j], 1, generator=generators[i])[0]
    if not wants_logprobs:
        return StepOutput(tokens, None, None, None, num_top)
    chosen = logprobs_all.gather(1, tokens[:, None])[:, 0]
    best = logprobs_all.topk(max(k or 0 for k in num_top), dim=-1)
    return StepOutput(tokens, chosen, best.indices, best.values, num_top)


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
            penalty = min(max(p.repetition_penalty, PENALTY_RANGE[0]), PENALTY_RANGE[1])
            seen = torch.zeros(V, dtype=torch.bool, device=row.device)
            seen[torch.tensor(prompt + generated, dtype=torch.long, device=row.device)] = True
            row[seen] = torch.where(row[seen] > 0, row[seen] / penalty, row[seen] * penalty)
        if generated and (p.frequency_penalty or p.presence_penalty):
            counts = torch.bincount(
                torch.tensor(generated, dtype=torch.long, device=row.device), minlength=V
            )[:V].to(row.dtype)
            row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)
    return logits


def _filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Temperature, then top-k, then top-p (vLLM's order). [n, V] -> probabilities [n, V]."""
    temps = torch.tensor([p.temperature for p in params], device=logits.device)
    # a logit pushed to +inf (a tiny repetition penalty, then a low temperature) would turn the
    # softmax into NaN: the largest finite float keeps it the most likely token instead
    big = torch.finfo(logits.dtype).max
    logits = (logits / temps[:, None]).clamp(min=-big, max=big)
    vocab = logits.shape[-1]
    # a top_k past the vocabulary keeps every token (4.9e27, valid, overflowed int64 here)
    top_k = [min(p.top_k, vocab) if p.top_k > 0 else vocab for p in params]
    top_k = torch.tensor(top_k, device=logits.device)
    top_p = torch.tensor([p.top_p for p in params], device=logits.device)
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=logits.device)[None, :]
    sorted_logits.masked_fill_(ranks >= top_k.clamp(max=vocab)[:, None], float("-inf"))
    sorted_probs = sorted_logits.softmax(dim=-1)
    # keep the smallest prefix whose mass reaches top_p. The first token always stays, also
    # when top_p rounds to 0 in float32 (5e-324 did, and every probability became NaN)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    sorted_probs.masked_fill_((mass_before >= top_p[:, None]) & (ranks > 0), 0.0)
    probs = torch.zeros_like(sorted_probs).scatter_(1, order, sorted_probs)
    return probs / probs.sum(dim=-1, keepdim=True)
