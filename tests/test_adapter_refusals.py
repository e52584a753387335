"""Adapters the engine cannot serve are refused with an AdapterError that names the adapter, the
key and what was expected / found; a refusal leaves a live engine exactly as it was."""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import hf_fixtures as hf
import pytest
import torch

if TYPE_CHECKING:
    from conftest import FixtureBank

ARCH = "qwen3_moe"  # 3 layers, hidden 64, q 64, kv 32, 8 experts, moe intermediate 40
MAX_LORA_RANK = 16
PREFIX = hf.PEFT_PREFIX + "model.layers"


def _peft(bank: FixtureBank, dst: Path, **kwargs) -> Path:
    kwargs = {"targets": ["q_proj", "v_proj"], "seed": 21, "rank": 4, "alpha": 8, **kwargs}
    return hf.make_peft_adapter(bank.model(ARCH), dst, **kwargs)


def _edit(src: Path, dst: Path, edit: Callable[[dict, dict[str, torch.Tensor]], None]) -> Path:
    """Copy adapter src to dst, letting `edit` change its config and tensors in place."""
    config, tensors = hf.read_adapter(src)
    edit(config, tensors)
    return hf.write_adapter(dst, config, tensors)


def _add_pair(module: str, a_shape: tuple[int, int], b_shape: tuple[int, int]):
    def edit(config: dict, tensors: dict[str, torch.Tensor]) -> None:
        gen = torch.Generator().manual_seed(0)
        tensors[f"{PREFIX}.{module}.lora_A.weight"] = torch.randn(a_shape, generator=gen)
        tensors[f"{PREFIX}.{module}.lora_B.weight"] = torch.randn(b_shape, generator=gen)

    return edit


def _set(**options):
    def edit(config: dict, tensors: dict[str, torch.Tensor]) -> None:
        config.update(options)

    return edit


@dataclass(frozen=True)
class Case:
    name: str
    build: Callable[[FixtureBank, Path], Path]
    mentions: tuple[str, ...]  # regexes the message must match, besides the adapter's name


def _base(bank: FixtureBank) -> Path:
    return bank.peft_adapter(ARCH)  # rank 8, attention + experts (target_parameters)


CASES = [
    Case(
        "rank-above-max",
        lambda bank, p: _peft(bank, p, rank=32, alpha=32, target_parameters=hf.EXPERT_PARAMS),
        (r"\b32\b", r"\b16\b"),
    ),
    Case(
        "rank-pattern-above-max",
        lambda bank, p: _peft(bank, p, rank=8, rank_pattern={"v_proj": 24}),
        (r"\b24\b", r"\b16\b", r"v_proj"),
    ),
    Case(
        "key-matches-no-module",
        lambda bank, p: _edit(_base(bank), p, _add_pair("0.self_attn.qkv_proj", (8, 64), (128, 8))),
        (r"layers\.0\.self_attn\.qkv_proj",),
    ),
    Case(
        "layer-out-of-range",
        lambda bank, p: _edit(_base(bank), p, _add_pair("7.self_attn.q_proj", (8, 64), (64, 8))),
        (r"layers\.7\.self_attn\.q_proj",),
    ),
    Case(
        "expert-out-of-range",
        lambda bank, p: _edit(
            bank.per_expert_adapter(ARCH), p, _add_pair("1.mlp.experts.8.up_proj", (4, 64), (40, 4))
        ),
        (r"layers\.1\.mlp\.experts\.8\.up_proj",),
    ),
    Case(
        "attention-shape",
        lambda bank, p: _edit(_base(bank), p, _add_pair("1.self_attn.q_proj", (8, 64), (72, 8))),
        (r"layers\.1\.self_attn\.q_proj", r"\b72\b", r"\b64\b"),
    ),
    Case(
        "a-and-b-ranks-differ",
        lambda bank, p: _edit(_base(bank), p, _add_pair("2.self_attn.v_proj", (8, 64), (32, 4))),
        (r"layers\.2\.self_attn\.v_proj",),
    ),
    Case(
        "per-expert-shape",
        lambda bank, p: _edit(
            bank.per_expert_adapter(ARCH),
            p,
            _add_pair("2.mlp.experts.5.down_proj", (4, 40), (56, 4)),
        ),
        (r"layers\.2\.mlp\.experts\.5\.down_proj", r"\b56\b", r"\b64\b"),
    ),
    Case(
        "target-parameters-rows-not-per-expert",
        lambda bank, p: _edit(
            _base(bank), p, _add_pair("1.mlp.experts.base_layer", (66, 64), (80, 66))
        ),
        (r"layers\.1\.mlp\.experts", r"\b66\b"),
    ),
    Case(
        "dora",
        lambda bank, p: _peft(bank, p, use_dora=True),
        (r"use_dora|dora|magnitude",),
    ),
    Case(
        "dora-in-config-only",
        lambda bank, p: _edit(_base(bank), p, _set(use_dora=True)),
        (r"use_dora",),
    ),
    Case(
        "bias-option",
        lambda bank, p: _edit(_base(bank), p, _set(bias="lora_only")),
        (r"\bbias\b", r"lora_only"),
    ),
    Case(
        "lora-bias-keys",
        lambda bank, p: _peft(bank, p, lora_bias=True),
        (r"lora_B\.bias|lora_bias",),
    ),
    Case(
        "modules-to-save",
        lambda bank, p: _peft(bank, p, modules_to_save=["lm_head"]),
        (r"modules_to_save|lm_head",),
    ),
    Case(
        "embedding-target",
        lambda bank, p: _peft(bank, p, targets=["embed_tokens", "q_proj"]),
        (r"embed_tokens",),
    ),
    Case(
        "lm-head-target",
        lambda bank, p: _peft(bank, p, targets=["lm_head", "v_proj"]),
        (r"lm_head",),
    ),
    Case(
        "missing-folder",
        lambda bank, p: p / "does-not-exist",
        (r"does-not-exist",),
    ),
    Case(
        "missing-weights",
        lambda bank, p: _without(_base(bank), p, "adapter_model.safetensors"),
        (r"adapter_model",),
    ),
    Case(
        "missing-config",
        lambda bank, p: _without(_base(bank), p, "adapter_config.json"),
        (r"adapter_config\.json",),
    ),
]


def _without(src: Path, dst: Path, file: str) -> Path:
    shutil.copytree(src, dst)
    (dst / file).unlink()
    return dst


@pytest.fixture(scope="module")
def bad(bank: FixtureBank) -> Callable[[Case], Path]:
    def build(case: Case) -> Path:
        return bank.adapter(f"refused-{case.name}", lambda p: case.build(bank, p))

    return build


def assert_refusal(err: pytest.ExceptionInfo, name: str, case: Case) -> None:
    from moelora.errors import AdapterError

    assert err.type is AdapterError or issubclass(err.type, AdapterError), err.type
    assert isinstance(err.value, ValueError)
    message = str(err.value)
    assert name in message, f"{case.name}: adapter name {name!r} not in {message!r}"
    for pattern in case.mentions:
        assert re.search(pattern, message), f"{case.name}: {pattern!r} not in {message!r}"


def test_cases_are_really_broken(bank: FixtureBank, bad: Callable[[Case], Path]) -> None:
    """The PEFT-built cases do carry what they are about (PEFT's own files, not our guesses)."""
    want_keys = {
        "dora": "lora_magnitude_vector",
        "lora-bias-keys": "lora_B.bias",
        "modules-to-save": "lm_head",
        "embedding-target": "lora_embedding_A",
        "lm-head-target": "lm_head.lora_A",
    }
    for case in CASES:
        if case.name in want_keys:
            _, tensors = hf.read_adapter(bad(case))
            assert any(want_keys[case.name] in k for k in tensors), (case.name, sorted(tensors))
    config = json.loads((bad(CASES[0]) / "adapter_config.json").read_text())
    assert config["r"] == 32


GREEDY_MAX_TOKENS = 6


def snapshot(llm) -> list[tuple[list[int], list[float]]]:
    from moelora import SamplingParams

    params = SamplingParams(
        max_tokens=GREEDY_MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=0
    )
    outs = llm.generate(hf.PROMPTS[:3], params, lora=["good", None, "good2"])
    return [(list(o.token_ids), [lp[t] for lp, t in zip(o.logprobs, o.token_ids)]) for o in outs]


class LiveEngine:
    def __init__(self, bank: FixtureBank) -> None:
        from moelora import LLM

        self.good = {"good": bank.peft_adapter(ARCH), "good2": bank.per_expert_adapter(ARCH)}
        self.llm = LLM(
            str(bank.model(ARCH)),
            lora_modules={n: str(p) for n, p in self.good.items()},
            max_loras=2,
            max_lora_rank=MAX_LORA_RANK,
            dtype="float32",
            device=bank.device,
            **({"num_pages": 64} if bank.device != "cpu" else {}),
        )
        # the first call waits for the adapters' reads from their folders, so its requests
        # are batched differently (fp32 on the CPU: logprobs 1e-6 apart); the snapshot is of
        # the engine once they are in host memory, as after any refusal
        snapshot(self.llm)
        self.before = snapshot(self.llm)


@pytest.fixture(scope="module")
def live(bank: FixtureBank) -> LiveEngine:
    return LiveEngine(bank)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_refused_at_construction(bank: FixtureBank, bad, case: Case) -> None:
    from moelora import LLM
    from moelora.errors import AdapterError

    name = f"ctor-{case.name}"
    with pytest.raises(AdapterError) as err:
        LLM(
            str(bank.model(ARCH)),
            lora_modules={"good": str(bank.peft_adapter(ARCH)), name: str(bad(case))},
            max_lora_rank=MAX_LORA_RANK,
            dtype="float32",
            device=bank.device,
            **({"num_pages": 64} if bank.device != "cpu" else {}),
        )
    assert_refusal(err, name, case)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_refused_on_a_live_engine(live: LiveEngine, bad, case: Case) -> None:
    from moelora.errors import AdapterError

    name = f"live-{case.name}"
    loras = sorted(live.llm.list_loras())
    with pytest.raises(AdapterError) as err:
        live.llm.load_lora(name, str(bad(case)))
    assert_refusal(err, name, case)
    assert sorted(live.llm.list_loras()) == loras
    assert snapshot(live.llm) == live.before, f"{case.name}: outputs changed after the refusal"
    # nothing of the refused adapter stays behind under its name
    live.llm.load_lora(name, str(live.good["good"]))
    assert name in live.llm.list_loras()
    live.llm.unload_lora(name)
    assert sorted(live.llm.list_loras()) == loras
