"""Adapters in memory and swapped under their name, for RL (issue 41, item 6), on the CPU in
fp32 with the transformers-made qwen3_moe fixture and two different random PEFT adapters:
load_lora_from_tensors equals loading the same adapter from its folder; replace=True gives
requests added after it the new weights while those added before finish on the old; the old
load is forgotten once nothing uses it."""

from __future__ import annotations

import hf_fixtures as hf
import pytest

from moelora import LLM, SamplingParams
from moelora.errors import AdapterError, AdapterExistsError

ARCH = "qwen3_moe"
PROMPT = hf.PROMPTS[0]
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=0)


def _llm(bank, **adapters) -> LLM:
    return LLM(
        str(bank.model(ARCH)),
        lora_modules={name: str(path) for name, path in adapters.items()},
        max_loras=2,
        max_lora_rank=16,
        dtype="float32",
        device=bank.device,
    )


def _answer(out) -> tuple[list[int], list[float]]:
    return list(out.token_ids), [lp[t] for lp, t in zip(out.logprobs, out.token_ids)]


def _close(got, want) -> None:
    assert got[0] == want[0]
    assert got[1] == pytest.approx(want[1], abs=1e-4)


@pytest.fixture(scope="module")
def adapters(bank) -> dict:
    """Two adapters of different weights and layouts: old (PEFT's own) and new (per expert)."""
    return {"old": bank.peft_adapter(ARCH), "new": bank.per_expert_adapter(ARCH)}


@pytest.fixture(scope="module")
def expected(bank, adapters) -> dict:
    """Each adapter's answer to PROMPT, from an engine serving both from their folders."""
    llm = _llm(bank, **adapters)
    outs = llm.generate([PROMPT] * 3, GREEDY, lora=[None, "old", "new"])
    assert outs[1].token_ids != outs[2].token_ids or outs[1].logprobs != outs[2].logprobs
    return {name: _answer(o) for name, o in zip(("base", "old", "new"), outs, strict=True)}


def test_tensors_equal_the_folder_and_are_copied(bank, adapters, expected) -> None:
    config, tensors = hf.read_adapter(adapters["new"])
    llm = _llm(bank)
    llm.load_lora_from_tensors("mem", tensors, config)
    _close(_answer(llm.generate([PROMPT], GREEDY, lora="mem")[0]), expected["new"])
    for t in tensors.values():  # the trainer goes on changing its own tensors
        t.mul_(3.0)
    _close(_answer(llm.generate([PROMPT], GREEDY, lora="mem")[0]), expected["new"])


def test_tensors_are_refused_at_the_boundary(bank, adapters) -> None:
    config, tensors = hf.read_adapter(adapters["old"])
    llm = _llm(bank)
    with pytest.raises(AdapterError, match="peft_config is a str, expected a dict"):
        llm.load_lora_from_tensors("x", tensors, "adapter_config.json")
    with pytest.raises(AdapterError, match="key 'bad' is not a tensor"):
        llm.load_lora_from_tensors("x", {**tensors, "bad": [1.0]}, config)
    with pytest.raises(AdapterError, match="use_dora"):
        llm.load_lora_from_tensors("x", tensors, {**config, "use_dora": True})
    key = next(iter(tensors))
    with pytest.raises(AdapterError, match="lacks its lora_A or lora_B"):
        llm.load_lora_from_tensors("x", {k: t for k, t in tensors.items() if k != key}, config)
    assert llm.list_loras() == []  # nothing half-registered
    llm.load_lora_from_tensors("x", tensors, config)
    with pytest.raises(AdapterExistsError, match="replace=True"):
        llm.load_lora_from_tensors("x", tensors, config)


def test_replace_serves_new_requests_the_new_weights_and_running_ones_the_old(
    bank, adapters, expected
) -> None:
    llm = _llm(bank, x=adapters["old"])
    engine = llm.engine
    engine.add_request("before", PROMPT, GREEDY, "x")
    outputs = {}
    for _ in range(2):  # running, two tokens in, its prompt's pages in the prefix cache
        outputs.update({o.request_id: o for o in engine.step()})
    assert "before" not in outputs or not outputs["before"].finished
    llm.load_lora("x", str(adapters["new"]), replace=True)
    engine.add_request("after", PROMPT, GREEDY, "x")  # the same prompt: no page is shared
    while engine.has_unfinished_requests():
        outputs.update({o.request_id: o for o in engine.step()})
    _close(_answer(outputs["before"]), expected["old"])
    _close(_answer(outputs["after"]), expected["new"])
    assert engine.adapters.retired == []  # the old load is gone once nothing used it
    assert engine.slot_table.num_refs == 0 and engine.stats().kv_pages_used == 0
    _close(_answer(llm.generate([PROMPT], GREEDY, lora="x")[0]), expected["new"])
    assert llm.list_loras() == ["x"]


def test_replace_under_a_new_name_loads_and_a_busy_swap_can_be_undone(
    bank, adapters, expected
) -> None:
    llm = _llm(bank)
    llm.load_lora("y", str(adapters["new"]), replace=True)  # nothing to replace: a load
    _close(_answer(llm.generate([PROMPT], GREEDY, lora="y")[0]), expected["new"])
    engine = llm.engine
    engine.add_request("a", PROMPT, GREEDY, "y")
    engine.step()
    for path in (adapters["old"], adapters["new"], adapters["old"]):  # swapped back and forth
        llm.load_lora("y", str(path), replace=True)
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.adapters.retired == []
    _close(_answer(llm.generate([PROMPT], GREEDY, lora="y")[0]), expected["old"])
    llm.unload_lora("y")
    assert llm.list_loras() == [] and engine.slot_table.num_used == 0
