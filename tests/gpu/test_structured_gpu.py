"""Structured outputs on the GPU: constrained requests keep to their grammars through graph
replays and the pinned, non-blocking bitmask copy, in a batch of mixed adapters, and the
unconstrained requests beside them sample what they sample alone (fp32, where the GPU
engine's bits do not depend on a step's make-up).

Skipped without CUDA; run on the device by scripts/gpu-check tests-structured (or tests).
"""

from __future__ import annotations

import json
import re

import pytest
import torch
from structured_cases import LORAS, PERSON, PROMPTS

from moelora import LLM, SamplingParams
from moelora.demo import ensure_demo
from moelora.sampling_params import StructuredOutputsParams as Structured

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_constrained_beside_free_requests_on_cuda(tmp_path, dtype):
    assets = ensure_demo(tmp_path / "demo")
    adapters = {name: str(path) for name, path in assets.adapters.items()}
    # a fixed KV cache: the other dtype's engine may still hold its memory
    llm = LLM(
        str(assets.model),
        lora_modules=adapters,
        max_loras=2,
        max_lora_rank=16,
        dtype=dtype,
        num_pages=512,
    )
    assert llm.engine.config.torch_device.type == "cuda"
    free = [SamplingParams(max_tokens=12, temperature=1.0, seed=s, ignore_eos=True) for s in (1, 2)]
    free += [SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)] * 2
    alone = llm.generate(PROMPTS, free, lora=LORAS)
    constrained = [
        SamplingParams(
            max_tokens=60, temperature=1.0, seed=s, structured_outputs=Structured(json=PERSON)
        )
        for s in range(4)
    ]
    constrained += [
        SamplingParams(max_tokens=20, temperature=1.0, seed=9, structured_outputs=spec)
        for spec in (Structured(regex=r"[a-c]{3}-[0-9]{2}"), Structured(choice=["yes", "no"]))
    ]
    mixed = llm.generate(
        PROMPTS * 2 + PROMPTS[:2], free + constrained, lora=LORAS + LORAS[::-1] + LORAS[:2]
    )
    if dtype == "float32":
        assert [list(o.token_ids) for o in mixed[:4]] == [list(o.token_ids) for o in alone]
    people = [json.loads(o.text) for o in mixed[4:8]]
    assert all(set(p) == {"name", "age", "pet"} for p in people)
    assert all(p["pet"] in ("cat", "dog") and 0 <= p["age"] <= 99 for p in people)
    assert re.fullmatch(r"[a-c]{3}-[0-9]{2}", mixed[8].text)
    assert mixed[9].text in ("yes", "no")
    assert llm.engine.stats().graph_replays > 0
