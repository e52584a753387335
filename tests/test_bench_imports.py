"""bench/ uses what docs/structure.md says it may: moelora's public names, the configs and named
shapes, `Engine` and the random adapters, the kernels it times with the step data types they
take; never the runner, the layers or the server, and never a private name of moelora's."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# a moelora module bench may import is one of these or inside one of them
BENCH_MAY_IMPORT = (
    "moelora",  # LLM, SamplingParams, RequestOutput
    "moelora.config",
    "moelora.sampling_params",
    "moelora.models.shapes",
    "moelora.lora.adapter",  # random_adapter: adapters of random weights
    "moelora.engine.engine",  # Engine and its public methods
    "moelora.kernels",  # the kernels a benchmark times, their references and tile tables
    "moelora.step",  # the data types those kernels take
)


def bench_imports(path: Path) -> list[tuple[int, str, list[str]]]:
    """(line, module, names) of each moelora import in `path`."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name, []) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module, [a.name for a in node.names]))
    return [f for f in found if f[1].split(".")[0] == "moelora"]


def misuses(path: Path) -> list[str]:
    wrong = []
    for line, module, names in bench_imports(path):
        allowed = module == "moelora" or any(
            module == m or module.startswith(m + ".") for m in BENCH_MAY_IMPORT[1:]
        )
        if not allowed:
            wrong.append(f"{path.name}:{line} imports {module}")
        wrong += [f"{path.name}:{line} imports private {module}.{n}" for n in names if _private(n)]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            if not ast.unparse(node.value).startswith("torch"):
                wrong.append(f"{path.name}:{node.lineno} reads private {ast.unparse(node)}")
    return wrong


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def test_bench_uses_only_what_structure_md_allows():
    assert [m for p in sorted((ROOT / "bench").glob("*.py")) for m in misuses(p)] == []


def test_the_check_catches_a_runner_import_and_a_private_name(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text(
        "from moelora.runner.graph_runner import graph_batch_sizes\n"
        "from moelora.kernels.moe.fused import _gate_up\n"
        "from moelora.kernels.moe.fused import fused_moe\n"
        "engine._commit_all()\n"
        "torch.ops.aten._scaled_dot_product_cudnn_attention\n"
    )
    assert misuses(bad) == [
        "bad.py:1 imports moelora.runner.graph_runner",
        "bad.py:2 imports private moelora.kernels.moe.fused._gate_up",
        "bad.py:4 reads private engine._commit_all",
    ]
