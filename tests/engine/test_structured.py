"""Structured outputs in the engine: each constrained request keeps to its grammar in a batch of
mixed adapters, the others sample exactly what they sample without it, the mask is applied as
its torch reference says, and the masks of step N+1 are filled while its forward runs."""

from __future__ import annotations

import json
import re

import pytest
import torch
import xgrammar as xgr
from structured_cases import LORAS, PERSON, PROMPTS

from moelora import LLM, SamplingParams
from moelora.demo import ensure_demo
from moelora.errors import InvalidRequestError
from moelora.runner.sampler import apply_token_mask
from moelora.sampling_params import StructuredOutputsParams as Structured


@pytest.fixture(scope="module")
def llm(tmp_path_factory) -> LLM:
    assets = ensure_demo(tmp_path_factory.mktemp("structured") / "demo")
    adapters = {name: str(path) for name, path in assets.adapters.items()}
    return LLM(str(assets.model), lora_modules=adapters, max_loras=2, max_lora_rank=16)


def _free(seed: int | None) -> SamplingParams:
    if seed is None:
        return SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    return SamplingParams(max_tokens=12, temperature=1.0, seed=seed, ignore_eos=True)


def test_unconstrained_requests_sample_the_same_beside_constrained_ones(llm):
    free = [_free(None), _free(3), _free(4), _free(None)]
    alone = llm.generate(PROMPTS, free, lora=LORAS)
    constrained = [
        SamplingParams(
            max_tokens=60, temperature=1.0, seed=s, structured_outputs=Structured(json=PERSON)
        )
        for s in range(4)
    ]
    mixed = llm.generate(PROMPTS * 2, free + constrained, lora=LORAS + LORAS[::-1])
    assert [list(o.token_ids) for o in mixed[:4]] == [list(o.token_ids) for o in alone]
    people = [json.loads(o.text) for o in mixed[4:]]
    assert all(p["pet"] in ("cat", "dog") and 0 <= p["age"] <= 99 for p in people)
    assert len({o.text for o in mixed[4:]}) > 1  # seeded differently, sampled differently


def test_regex_choice_and_grammar_hold_in_one_batch(llm):
    specs = [
        Structured(regex=r"[a-z]{2,5}-[0-9]{3}"),
        Structured(choice=["red", "green", "blue"]),
        Structured(grammar='root ::= "(" [0-9]+ ("+" [0-9]+)? ")"'),
        Structured(json_object=True),
    ]
    params = [
        SamplingParams(max_tokens=40, temperature=1.0, seed=i, structured_outputs=s)
        for i, s in enumerate(specs)
    ]
    regex, choice, grammar, obj = llm.generate(PROMPTS, params, lora=LORAS)
    assert re.fullmatch(r"[a-z]{2,5}-[0-9]{3}", regex.text), regex.text
    assert choice.text in ("red", "green", "blue")
    assert regex.finish_reason == choice.finish_reason == "stop"
    assert re.fullmatch(r"\([0-9]+(\+[0-9]+)?\)", grammar.text) or grammar.finish_reason == "length"
    assert obj.text.startswith("{") and not obj.text[1:2].isspace()  # no free whitespace


def test_greedy_constrained_is_the_best_allowed_token_at_each_step(llm):
    """A choice of two: greedy picks the alternative whose first token the model prefers."""
    params = SamplingParams(max_tokens=8, temperature=0, logprobs=20)
    free = llm.generate(["SELECT name"], params)[0]
    first = free.logprobs[0]
    tok = llm.get_tokenizer()
    a, b = sorted(first, key=first.get, reverse=True)[1:3]  # not the best: the mask must act
    choices = [tok.decode([a]), tok.decode([b])]
    structured = SamplingParams(
        max_tokens=8, temperature=0, structured_outputs=Structured(choice=choices)
    )
    out = llm.generate(["SELECT name"], structured)[0]
    assert out.text == choices[0]


def test_a_complete_grammar_stops_also_with_ignore_eos_and_penalties(llm):
    """What the grammar ends with is the output's end: nothing after it could keep to it."""
    spec = Structured(choice=["", "ab"])
    params = [
        SamplingParams(max_tokens=9, temperature=0, ignore_eos=True, structured_outputs=spec),
        SamplingParams(max_tokens=9, frequency_penalty=1.0, seed=1, structured_outputs=spec),
    ]
    outs = llm.generate(["SELECT", "hi"], params)
    assert [o.finish_reason for o in outs] == ["stop", "stop"]
    assert all(o.text in ("", "ab") for o in outs) and len(outs[0].token_ids) <= 3


def test_a_schema_compiles_once(llm):
    grammars = llm.engine.grammars
    schema = {"type": "object", "properties": {"k": {"enum": ["x"]}}, "required": ["k"]}
    before = grammars.num_cached
    same = [Structured(json=schema), Structured(json=json.dumps(schema, indent=2))]
    compiled = [grammars.compile(s) for s in same]
    assert compiled[0] is compiled[1] and grammars.num_cached == before + 1


@pytest.mark.parametrize(
    "spec, wrong",
    [
        (dict(json={"type": "nope"}), "JSON schema"),
        (dict(json="{not json"), "JSON schema"),
        (dict(regex="(["), "regular expression"),
        (dict(grammar="root ::= missing"), "EBNF grammar"),
    ],
)
def test_an_invalid_spec_is_refused_naming_it(llm, spec, wrong):
    params = SamplingParams(structured_outputs=Structured(**spec))
    with pytest.raises(InvalidRequestError, match=f"is not a valid {wrong}"):
        llm.generate(["hi"], params)


def test_structured_outputs_params_take_exactly_one_constraint():
    with pytest.raises(InvalidRequestError, match="exactly one"):
        Structured(regex="a", choice=["a"])
    with pytest.raises(InvalidRequestError, match="exactly one"):
        Structured()
    with pytest.raises(InvalidRequestError, match="non-empty list of strings"):
        Structured(choice=[])


def test_the_masks_of_a_step_are_filled_after_its_forward_is_launched(llm):
    """The order that keeps the overlap: forward of N+1, commit of N, then sampling of N+1."""
    engine, events = llm.engine, []
    while engine.has_unfinished_requests():  # what earlier tests left in flight
        engine.step()
    runner = engine.runner
    forward, sample, commit = runner.forward_step, runner.sample_step, engine._commit_oldest

    def recorded(name, fn):
        def call(*args, **kw):
            events.append(name)
            return fn(*args, **kw)

        return call

    runner.forward_step = recorded("forward", forward)
    runner.sample_step = recorded("sample", sample)
    engine._commit_oldest = recorded("commit", commit)
    try:
        params = SamplingParams(
            max_tokens=6, temperature=0, structured_outputs=Structured(regex="[a-z]{6}")
        )
        out = llm.generate(["hi"], params)[0]
    finally:
        del runner.forward_step, runner.sample_step, engine._commit_oldest
    assert re.fullmatch("[a-z]{6}", out.text)
    # the prefill has no step before it to commit; each decode step commits the one before it
    # between its forward and its sampling; the last step is committed at the end
    assert events == ["forward", "sample"] + ["forward", "commit", "sample"] * 5 + ["commit"]


def _reference_mask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> torch.Tensor:
    out = logits.clone()
    for i, row in enumerate(rows):
        for t in range(logits.shape[1]):
            if not (int(bitmask[i, t // 32]) >> (t % 32)) & 1:
                out[row, t] = float("-inf")
    return out


@pytest.mark.parametrize("n, vocab, rows", [(1, 31, [0]), (5, 100, [4, 1]), (8, 459, [0, 2, 3, 7])])
def test_the_mask_matches_its_reference_and_xgrammars(n, vocab, rows):
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(n, vocab, generator=gen)
    words = -(-vocab // 32)
    bitmask = torch.randint(-(2**31), 2**31, (len(rows), words), generator=gen, dtype=torch.int64)
    bitmask = bitmask.to(torch.int32)
    want = _reference_mask(logits, bitmask, rows)
    got = logits.clone()
    apply_token_mask(got, bitmask, torch.tensor(rows))
    assert torch.equal(got, want)
    assert 0 < int(torch.isinf(got).sum()) < len(rows) * vocab  # some masked, some kept
    theirs = logits.clone()
    full = torch.full((n, words), -1, dtype=torch.int32)
    full[rows] = bitmask
    xgr.apply_token_bitmask_inplace(theirs, full, backend="torch_native")
    assert torch.equal(theirs, want)
