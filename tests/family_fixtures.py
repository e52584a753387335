"""What the tests of a newly added model family share (test_deepseek_glm.py, test_qwen3_next.py):
its tiny models and two adapters per architecture, built on first use from the family's fixtures
module (mla_fixtures.py, qwen3_next_fixtures.py); one engine per architecture; transformers'
references through the session's FixtureBank; greedy runs and their comparison."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

import hf_fixtures as hf
import torch
from test_vs_transformers import greedy_params

from moelora import LLM
from moelora.lora.adapter import load_adapter

if TYPE_CHECKING:
    from conftest import FixtureBank


class FamilyFixtures:
    """Each arch's model (fixtures.make_model) and its two adapters: a, PEFT rank 8
    (fixtures.peft_adapter, experts by target_parameters); b, per-expert keys of rank 4
    (fixtures.per_expert_adapter). options: every engine's (fp32 on `device` besides: the
    session's --moelora-device)."""

    def __init__(
        self, root: Path, fixtures: ModuleType, device: str = "cpu", **options: object
    ) -> None:
        self.root, self.fixtures, self.options = root, fixtures, options
        self.device = device
        self._paths: dict[str, Path] = {}
        self._llms: dict[str, LLM] = {}

    def _once(self, name: str, build) -> Path:
        if name not in self._paths:
            self._paths[name] = build(self.root / name)
        return self._paths[name]

    def model(self, arch: str) -> Path:
        return self._once(f"model-{arch}", lambda p: self.fixtures.make_model(arch, p, seed=3))

    def adapters(self, arch: str) -> dict[str, Path]:
        model, fx = self.model(arch), self.fixtures
        a = self._once(f"a-{arch}", lambda p: fx.peft_adapter(model, p, arch, seed=11))
        b = self._once(f"b-{arch}", lambda p: fx.per_expert_adapter(model, p, arch, seed=12))
        return {"a": a, "b": b}

    def llm(self, arch: str, **kwargs) -> LLM:
        """The arch's engine with both adapters (kwargs: a new one, not kept)."""
        if arch in self._llms and not kwargs:
            return self._llms[arch]
        loras = {name: str(path) for name, path in self.adapters(arch).items()}
        # several engines live at once on a GPU: no sizing from free memory
        sized = {"num_pages": 64} if self.device != "cpu" else {}
        options = {**sized, **self.options, **kwargs}
        llm = LLM(
            str(self.model(arch)),
            lora_modules=loras,
            device=self.device,
            dtype="float32",
            **options,
        )
        if not kwargs:
            self._llms[arch] = llm
        return llm

    def covered(self, arch: str, targets: dict, max_rank: int) -> dict[str, set[str]]:
        """Per adapter, the targets (Engine.lora_targets) on every output slice of which its
        lora_B is nonzero."""
        covered = {}
        for name, path in self.adapters(arch).items():
            loaded = load_adapter(name, str(path), targets, max_rank=max_rank, dtype=torch.float32)
            covered[name] = {
                key
                for key, module in loaded.modules.items()
                if all(b.abs().amax() > 0 for b in module.b.split(targets[key].out_slices, dim=-2))
            }
        return covered

    def reference(
        self,
        bank: FixtureBank,
        arch: str,
        loras: list[str | None],
        prompts=None,
        max_tokens: int = hf.MAX_TOKENS,
    ):
        paths = {**self.adapters(arch), None: None}
        prompts = prompts or hf.PROMPTS[: len(loras)]
        return bank.reference(self.model(arch), prompts, [paths[n] for n in loras], max_tokens)


def run_greedy(llm: LLM, loras: list[str | None], prompts=None, max_tokens: int = hf.MAX_TOKENS):
    prompts = prompts or hf.PROMPTS[: len(loras)]
    return llm.generate(prompts, greedy_params(max_tokens), lora=loras)


def assert_same(got, want, tol: float) -> None:
    """Two runs of the same requests: the same tokens, chosen-token logprobs within tol."""
    for g, w in zip(got, want, strict=True):
        assert list(g.token_ids) == list(w.token_ids)
        for step, token in enumerate(g.token_ids):
            assert abs(g.logprobs[step][token] - w.logprobs[step][token]) <= tol


def assert_not_degenerate(bank: FixtureBank, fx: FamilyFixtures, arch: str) -> None:
    """Each adapter changes the greedy tokens; no near ties that would make greedy fragile."""
    outs = {n: fx.reference(bank, arch, [n] * 5) for n in (None, "a", "b")}
    tokens = {n: [o.tokens for o in refs] for n, refs in outs.items()}
    assert tokens[None] != tokens["a"] and tokens[None] != tokens["b"]
    for refs in outs.values():
        assert len({t for o in refs for t in o.tokens}) > 10
        assert min(m for o in refs for m in o.margins) > 1e-3
