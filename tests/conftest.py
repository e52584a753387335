"""Session-wide fixtures: tiny HF models, adapters and reference outputs, each built once."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    # triton.jit picks the interpreter when a kernel is decorated, so this must be set before
    # any test module imports a kernel module (tests/gpu ones do so at collection).
    os.environ["TRITON_INTERPRET"] = "1"

# The reference runs on the CPU; transformers takes flash-linear-attention's Triton kernels for
# Qwen3-Next/Qwen3.5 whenever fla imports (decided when its modeling module loads), and those
# reject CPU tensors. Hiding fla keeps the reference on transformers' torch path.
sys.modules.setdefault("fla", None)  # type: ignore[arg-type]
sys.path.insert(0, str(Path(__file__).parent))

import hf_fixtures as hf  # noqa: E402
import interpreter_speed  # noqa: E402

if os.environ.get("TRITON_INTERPRET") == "1":
    interpreter_speed.install()


class FixtureBank:
    """Builds each model/adapter on first use under one session temp dir; memoizes references."""

    def __init__(self, root: Path, device: str, logprob_tol: float) -> None:
        self.root = root
        self.device = device  # where moelora runs; the reference always runs on the CPU
        self.logprob_tol = logprob_tol
        self._paths: dict[str, Path] = {}
        self._refs: dict[tuple, hf.RefOutput] = {}

    def _once(self, name: str, build) -> Path:
        if name not in self._paths:
            self._paths[name] = build(self.root / name)
        return self._paths[name]

    def model(self, arch: str) -> Path:
        # olmoe is the tied-embeddings case; qwen3_moe's config is written the pre-5.0 way
        # (rope_scaling linear, rope_theta, num_experts) and the others the transformers 5 way.
        return self._once(
            f"model-{arch}",
            lambda p: hf.make_model(
                arch, p, tie_word_embeddings=arch == "olmoe", legacy_config=arch == "qwen3_moe"
            ),
        )

    def model_variant(self, name: str, arch: str, **kwargs) -> Path:
        return self._once(f"model-{arch}-{name}", lambda p: hf.make_model(arch, p, **kwargs))

    def layout(self, arch: str, layout: str, shards: int) -> Path:
        src = self.model(arch)
        return self._once(
            f"model-{arch}-{layout}-{shards}",
            lambda p: hf.write_checkpoint(src, p, layout=layout, shards=shards),
        )

    def peft_adapter(self, arch: str) -> Path:
        """Rank 8: attention (+ shared expert / dense MLP) and all experts (target_parameters)."""
        return self._once(
            f"peft-{arch}",
            lambda p: hf.make_peft_adapter(
                self.model(arch),
                p,
                targets=hf.peft_targets(arch),
                target_parameters=hf.EXPERT_PARAMS,
                seed=1,
                rank=8,
                alpha=16,
            ),
        )

    def per_expert_adapter(self, arch: str) -> Path:
        """Rank 4, hand-written per-expert keys (+ q/v/o, shared expert, dense MLP)."""
        return self._once(
            f"per-expert-{arch}",
            lambda p: hf.make_per_expert_adapter(
                self.model(arch), p, seed=2, rank=4, alpha=8, arch=arch
            ),
        )

    def adapter(self, name: str, build) -> Path:
        return self._once(f"adapter-{name}", build)

    def reference(
        self,
        model: Path,
        prompts: list[list[int]],
        adapters: list[Path | None],
        max_tokens: int = hf.MAX_TOKENS,
    ) -> list[hf.RefOutput]:
        keys = [(str(model), tuple(p), str(a), max_tokens) for p, a in zip(prompts, adapters)]
        todo = [i for i, k in enumerate(keys) if k not in self._refs]
        if todo:
            outs = hf.reference_generate(
                model, [prompts[i] for i in todo], [adapters[i] for i in todo], max_tokens
            )
            for i, out in zip(todo, outs):
                self._refs[keys[i]] = out
        return [self._refs[k] for k in keys]


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--moelora-device",
        default="cpu",
        help="device for moelora in the tests against transformers (default cpu)",
    )
    parser.addoption(
        "--moelora-logprob-tol",
        type=float,
        default=1e-4,
        help="logprob tolerance against transformers (default 1e-4; looser only to diagnose)",
    )
    parser.addoption(
        "--first-and-last-params",
        action="store_true",
        help="run only the first and the last parametrization of each test (a slow tool such "
        "as compute-sanitizer still sees every test and both ends of its cases)",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not config.getoption("--first-and-last-params"):
        return
    by_test: dict[str, list[pytest.Item]] = {}
    for item in items:
        by_test.setdefault(item.nodeid.split("[")[0], []).append(item)
    keep = {id(group[0]) for group in by_test.values()}
    keep |= {id(group[-1]) for group in by_test.values()}
    dropped = [item for item in items if id(item) not in keep]
    items[:] = [item for item in items if id(item) in keep]
    config.hook.pytest_deselected(items=dropped)


@pytest.fixture(scope="session")
def bank(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> FixtureBank:
    import transformers

    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    options = request.config.getoption
    return FixtureBank(
        tmp_path_factory.mktemp("hf"),
        options("--moelora-device"),
        options("--moelora-logprob-tol"),
    )
