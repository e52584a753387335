"""What a request may ask of this model, checked when it is added: a refused request raises an
InvalidRequestError naming the value and what was expected, before it takes any resource."""

from __future__ import annotations

import numbers

from moelora.errors import InvalidRequestError
from moelora.sampling_params import SamplingParams


def check_request(
    prompt_token_ids: list[int], params: SamplingParams, *, vocab: int, max_len: int
) -> None:
    check_prompt(prompt_token_ids, vocab=vocab, max_len=max_len)
    for name, ids in (("logit_bias", params.logit_bias), ("stop_token_ids", params.stop_token_ids)):
        bad = [t for t in ids or () if t >= vocab]
        if bad:
            raise InvalidRequestError(
                f"{name} token id {bad[0]} is invalid: expected 0 <= id < {vocab}"
            )
    for name in ("prompt_logprobs", "logprobs"):
        value = getattr(params, name)
        if value is not None and value > vocab:
            raise InvalidRequestError(
                f"{name}={value} is invalid: expected at most the vocabulary size {vocab}"
            )


def check_prompt(prompt_token_ids: list[int], *, vocab: int, max_len: int) -> None:
    n = len(prompt_token_ids)
    if n == 0:
        raise InvalidRequestError("the prompt is empty: expected at least one token")
    if n > max_len:
        raise InvalidRequestError(
            f"the prompt has {n} tokens, expected at most max_model_len={max_len}"
        )
    # the common case at C speed: plain ints in range, by the set of their types, min and max (a
    # Python loop of is_token over a long prompt is a real share of its time to first token)
    ids = prompt_token_ids
    if set(map(type, ids)) == {int} and 0 <= min(ids) and max(ids) < vocab:
        return
    bad = [t for t in prompt_token_ids if not (is_token(t) and 0 <= t < vocab)]
    if bad:
        raise InvalidRequestError(
            f"prompt token id {bad[0]!r} is invalid: expected an integer in [0, {vocab})"
        )


def is_token(t: object) -> bool:
    """A token id: an integer (numpy's integers too), not a bool."""
    return isinstance(t, numbers.Integral) and not isinstance(t, bool)
