"""vLLM's penalties in the sampler: the math against a per-token loop, the engine's greedy
choices against its own raw logprobs, and the range checks."""

import pytest
import torch

from moelora.errors import InvalidRequestError
from moelora.runner.sampler import adjust_logits, sample
from moelora.sampling_params import MIN_TEMPERATURE, SamplingParams


def adjusted_by_loop(logits, p, prompt, generated):
    out = logits.clone()
    for v, bias in (p.logit_bias or {}).items():
        out[v] += bias
    for v in set(prompt) | set(generated):
        x = out[v].item()
        out[v] = x / p.repetition_penalty if x > 0 else x * p.repetition_penalty
    for v in set(generated):
        out[v] -= p.frequency_penalty * generated.count(v) + p.presence_penalty
    return out


def test_penalties_match_a_per_token_loop():
    V = 50
    logits = torch.randn(5, V) * 3
    params = [
        SamplingParams(repetition_penalty=1.7),
        SamplingParams(frequency_penalty=0.8, presence_penalty=-0.5),
        SamplingParams(),  # no penalty: the row stays as it is
        SamplingParams(repetition_penalty=0.6, frequency_penalty=-1.2, presence_penalty=2.0),
        SamplingParams(logit_bias={3: 5.0, 7: -100.0}, repetition_penalty=1.4),
    ]
    history = [
        (torch.randint(0, V, (7,)).tolist(), torch.randint(0, V, (n,)).tolist())
        for n in (5, 9, 3, 12, 4)
    ]
    out = adjust_logits(logits, params, history)
    for i, (p, (prompt, generated)) in enumerate(zip(params, history)):
        torch.testing.assert_close(out[i], adjusted_by_loop(logits[i], p, prompt, generated))
    assert torch.equal(out[2], logits[2])


def test_greedy_takes_the_penalized_argmax_and_logprobs_stay_raw():
    V = 40
    logits = torch.randn(2, V)
    prompt, generated = [1, 2, 3], [int(logits[0].argmax()), 7, 7]
    params = [SamplingParams(temperature=0, frequency_penalty=2.0, logprobs=0)] * 2
    out = sample(logits, params, [None, None], [(prompt, generated), ([], [])])
    tokens = out.token_ids()
    expect = adjusted_by_loop(logits[0], params[0], prompt, generated).argmax().item()
    assert tokens[0] == expect != logits[0].argmax().item()
    assert tokens[1] == logits[1].argmax().item()  # nothing generated yet
    raw = logits[0].log_softmax(-1)[expect].item()
    assert out.logprobs()[0] == pytest.approx({expect: raw})


@pytest.mark.parametrize(
    "kw, name",
    [
        (dict(presence_penalty=2.5), "presence_penalty"),
        (dict(frequency_penalty=-3), "frequency_penalty"),
        (dict(repetition_penalty=0), "repetition_penalty"),
        (dict(repetition_penalty=float("inf")), "repetition_penalty"),
        (dict(logit_bias={5: 100.5}), "logit_bias"),
        (dict(logit_bias={-1: 1.0}), "logit_bias token"),
    ],
)
def test_penalties_out_of_range_are_refused_with_the_value_named(kw, name):
    with pytest.raises(InvalidRequestError, match=name):
        SamplingParams(**kw)


def test_logit_bias_forces_and_forbids_tokens():
    logits = torch.randn(2, 30)
    top = int(logits[1].argmax())
    params = [
        SamplingParams(temperature=0, logit_bias={11: 100.0}),
        SamplingParams(temperature=0, logit_bias={top: -100.0}),
    ]
    tokens = sample(logits, params, [None, None], [([1], []), ([1], [])]).token_ids()
    assert tokens[0] == 11
    second = logits[1].clone()
    second[top] = float("-inf")
    assert tokens[1] == int(second.argmax())


def test_a_tiny_temperature_is_raised_to_the_floor_and_samples_finite_probabilities():
    """vLLM's rule: 0 < temperature < 0.01 becomes 0.01 (1e-40 would overflow the logits to
    inf and the softmax to NaN); 0 stays greedy."""
    params = SamplingParams(temperature=1e-40)
    assert params.temperature == MIN_TEMPERATURE and not params.greedy
    assert SamplingParams(temperature=0).greedy
    logits = torch.randn(2, 50)
    logits[:, 7] = logits.max() + 1  # a gap of 1 is 100 at 0.01: e^-100 for every other token
    out = sample(logits, [params, params], [torch.Generator().manual_seed(i) for i in range(2)])
    assert out.token_ids() == [7, 7]


@pytest.mark.parametrize("top_p", [5e-324, 1e-46, 1e-9])
def test_a_top_p_below_float32_keeps_the_most_likely_token(top_p):
    """5e-324 is a valid top_p (in (0, 1]) that rounds to 0 in float32: the top token must still
    be kept (schemathesis found it masking every token, the probabilities NaN, a 500)."""
    logits = torch.randn(3, 64)
    params = [SamplingParams(top_p=top_p, seed=i) for i in range(3)]
    gens = [torch.Generator().manual_seed(i) for i in range(3)]
    assert sample(logits, params, gens).token_ids() == logits.argmax(dim=-1).tolist()


@pytest.mark.parametrize("penalty", [5e-324, 1e-40, 1e308])
@pytest.mark.parametrize("temperature", [1.0, MIN_TEMPERATURE])
def test_extreme_repetition_penalties_sample_finite_probabilities(penalty, temperature):
    """Valid values (> 0) that overflow float32: schemathesis found 5e-324 giving NaN (a 500)."""
    logits = torch.randn(2, 40)
    logits[:, 3] = 0.0  # 0 * a penalty that rounds to inf is NaN
    params = [
        SamplingParams(temperature=temperature, repetition_penalty=penalty, seed=i)
        for i in range(2)
    ]
    history = [([3, 5, 9], [1]), ([2], [3, 4])]
    out = sample(
        logits, params, [torch.Generator().manual_seed(i) for i in range(2)], history
    ).token_ids()
    seen_positive = [
        [t for t in ids if logits[i, t] > 0] for i, ids in enumerate(p + g for p, g in history)
    ]
    for i, token in enumerate(out):
        assert 0 <= token < 40
        if penalty < 1 and seen_positive[i]:  # a tiny penalty makes seen positive logits huge
            assert token in seen_positive[i]


def test_a_top_k_past_the_vocabulary_keeps_every_token():
    """4883042256367895818142744576 is a valid top_k (>= -1) that overflowed int64: a 500
    schemathesis found. Past the vocabulary it means every token, as top_k=-1 does."""
    logits = torch.randn(2, 30)
    gens = [torch.Generator().manual_seed(i) for i in range(2)]
    huge = [SamplingParams(top_k=4883042256367895818142744576, seed=i) for i in range(2)]
    every = [SamplingParams(top_k=-1, seed=i) for i in range(2)]
    got = sample(logits, huge, gens).token_ids()
    gens = [torch.Generator().manual_seed(i) for i in range(2)]
    assert got == sample(logits, every, gens).token_ids()
