"""LLM.add_random_lora on the tiny shape with dummy weights, on the CPU: an adapter without a
PEFT folder, served like a loaded one, refused at the boundary like one."""

from __future__ import annotations

from pathlib import Path

import pytest

from moelora import LLM, SamplingParams
from moelora.errors import AdapterError, AdapterExistsError, InvalidRequestError
from moelora.models.shapes import shape_config, write_config_folder

PROMPT = [5, 6, 7, 8, 9, 10]
PARAMS = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, logprobs=0)


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_config_folder(shape_config("tiny-qwen3-moe"), tmp_path_factory.mktemp("tiny"))


def _llm(folder: Path, **options) -> LLM:
    return LLM(
        str(folder), load_format="dummy", device="cpu", max_model_len=64, num_pages=16, **options
    )


def test_a_random_lora_is_served_like_a_loaded_one(folder: Path) -> None:
    llm = _llm(folder, max_loras=2, max_lora_rank=8)
    llm.add_random_lora("r1", rank=4, seed=1)
    llm.add_random_lora("r1-again", rank=4, seed=1)
    llm.add_random_lora("r2", rank=8, seed=2)  # three adapters, two slots: one waits on the host
    assert llm.list_loras() == ["r1", "r1-again", "r2"]
    outs = llm.generate([PROMPT] * 4, PARAMS, lora=[None, "r1", "r1-again", "r2"])
    base, r1, r1_again, r2 = (out.logprobs for out in outs)
    assert outs[1].token_ids == outs[2].token_ids
    assert r1 != base and r2 != r1  # they change what the model computes
    # the seed fixes the weights: the same bits in the same batch (each alone here; which
    # requests share a step depends on which adapters are resident, and the CPU's matmuls
    # round by the batch's size)
    alone = [llm.generate([PROMPT], PARAMS, lora=name)[0].logprobs for name in ("r1", "r1-again")]
    assert alone[0] == alone[1]
    llm.unload_lora("r1-again")
    assert llm.list_loras() == ["r1", "r2"]


def test_a_random_lora_is_refused_at_the_boundary(folder: Path) -> None:
    llm = _llm(folder, max_lora_rank=8)
    for rank in (0, 9):
        with pytest.raises(AdapterError, match=rf"'r': rank={rank} is invalid: .*max_lora_rank=8"):
            llm.add_random_lora("r", rank=rank)
    llm.add_random_lora("r", rank=2)
    with pytest.raises(AdapterExistsError, match="'r' is already loaded"):
        llm.add_random_lora("r", rank=2)
    with pytest.raises(AdapterExistsError, match="already loaded"):
        llm.add_random_lora(str(folder), rank=2)  # the base model's name
    without_lora = _llm(folder, enable_lora=False)
    with pytest.raises(InvalidRequestError, match="LoRA is disabled"):
        without_lora.add_random_lora("r", rank=2)


def test_residency_queues_and_fills_are_reported(folder: Path) -> None:
    llm = _llm(folder, max_loras=1, max_lora_rank=8)
    llm.add_random_lora("a", rank=4, seed=1)
    llm.add_random_lora("b", rank=8, seed=2)
    levels = {s.name: s.level for s in llm.engine.stats().adapters}
    assert levels == {"a": "cpu", "b": "cpu"} and llm.engine.stats().lora_fills == 0
    llm.generate([PROMPT], PARAMS, lora="a")
    stats = llm.engine.stats()
    assert [(s.name, s.level) for s in stats.adapters] == [("a", "gpu"), ("b", "cpu")]
    size_a = llm.engine.adapters["a"].nbytes
    assert stats.lora_fills == 1 and stats.lora_fill_bytes == size_a > 0
    assert stats.lora_fill_seconds > 0
    engine = llm.engine  # one slot: b's request waits while a's runs
    engine.add_request("x", PROMPT, PARAMS, "a")
    engine.add_request("y", PROMPT, PARAMS, "b")
    engine.step()
    queues = {s.name: (s.num_running, s.num_waiting) for s in engine.stats().adapters}
    assert queues == {"a": (1, 0), "b": (0, 1)}
    while engine.has_unfinished_requests():
        engine.step()
    stats = engine.stats()
    assert [(s.name, s.level) for s in stats.adapters] == [("a", "cpu"), ("b", "gpu")]
    assert stats.lora_fills == 2
    assert stats.lora_fill_bytes == size_a + llm.engine.adapters["b"].nbytes
