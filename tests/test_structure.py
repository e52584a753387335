"""The tree keeps the shape docs/structure.md draws: imports flow one way, down the request path,
with no circles, and host-side functions stay short. The imports are read with `ast` (those under
`if TYPE_CHECKING:` and inside functions count too). Comments and docstrings in moelora/ quote no
measurements."""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "moelora"

# Lowest first. A unit (a subpackage or a top-level module of moelora) may import its own modules
# and the units of lower layers; never a unit of its own layer or of a higher one.
LAYERS: tuple[frozenset[str], ...] = tuple(
    frozenset(names.split())
    for names in (
        "errors",
        "config sampling_params tokenizer parallel",
        "step",
        "kernels",
        "layers",
        "models",
        "lora",
        "runner",
        "engine",
        "llm server demo",
        "__init__",
        "cli",
    )
)
MAX_FUNCTION_LINES = 60


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported_modules(path: Path, root: Path) -> set[str]:
    """Every moelora module `path` imports: `from moelora.x import y` names moelora.x.y when y is
    a module of its own, else moelora.x."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [f"{node.module}.{alias.name}" for alias in node.names]
            names = [n if _is_module(n, root) else node.module for n in names]
        else:
            continue
        found |= {n for n in names if n.split(".")[0] == root.name}
    return found


def _is_module(name: str, root: Path) -> bool:
    relative = Path(*name.split(".")[1:])
    return (root / relative).with_suffix(".py").exists() or (root / relative).is_dir()


def unit_of(module: str) -> str:
    """moelora.kernels.moe.fused -> kernels; moelora.config -> config; moelora -> __init__."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def layer_of(unit: str) -> int:
    for i, names in enumerate(LAYERS):
        if unit in names:
            return i
    raise AssertionError(f"unit {unit!r} has no layer: add it to LAYERS in {Path(__file__).name}")


def import_graph(root: Path) -> dict[str, set[str]]:
    return {module_name(p, root): imported_modules(p, root) for p in sorted(root.rglob("*.py"))}


def wrong_directions(graph: dict[str, set[str]]) -> list[str]:
    wrong = []
    for module, imports in graph.items():
        unit = unit_of(module)
        for target in sorted(imports):
            other = unit_of(target)
            if other != unit and layer_of(other) >= layer_of(unit):
                wrong.append(f"{module} imports {target} ({unit} may not import {other})")
    return wrong


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Each import cycle between modules, found by a depth-first walk."""
    found, done, path = [], set(), []

    def walk(module: str) -> None:
        if module in path:
            found.append(path[path.index(module) :] + [module])
            return
        if module in done:
            return
        path.append(module)
        for target in sorted(graph.get(module, ())):
            walk(target)
        path.pop()
        done.add(module)

    for module in sorted(graph):
        walk(module)
    return found


def test_imports_flow_down_the_request_path():
    assert wrong_directions(import_graph(PACKAGE)) == []


def test_no_import_circles():
    assert circles(import_graph(PACKAGE)) == []


def test_the_checks_catch_a_wrong_import_and_a_circle(tmp_path):
    """The two checks above on a small tree that breaks both rules."""
    pkg = tmp_path / "moelora"
    for name, text in {
        "__init__.py": "",
        "kernels/__init__.py": "",
        "kernels/a.py": "from moelora.kernels import b\n",
        "kernels/b.py": "import moelora.kernels.a\n",
        "runner/__init__.py": "",
        "runner/batch.py": "",
        "step/__init__.py": "",
        "step/x.py": "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from moelora.runner.batch import Y\n",
    }.items():
        (pkg / name).parent.mkdir(parents=True, exist_ok=True)
        (pkg / name).write_text(text)
    graph = import_graph(pkg)
    assert wrong_directions(graph) == [
        "moelora.step.x imports moelora.runner.batch (step may not import runner)"
    ]
    assert circles(graph) == [["moelora.kernels.a", "moelora.kernels.b", "moelora.kernels.a"]]


def long_functions(paths: list[Path]) -> list[str]:
    """Functions over MAX_FUNCTION_LINES lines, Triton kernels (@triton.jit) exempt."""
    found = []
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            if any("triton.jit" in ast.unparse(d) for d in node.decorator_list):
                continue
            lines = node.end_lineno - node.lineno + 1
            if lines > MAX_FUNCTION_LINES:
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({lines} lines)")
    return found


def python_files() -> list[Path]:
    return sorted(p for d in ("moelora", "bench", "tests") for p in (ROOT / d).rglob("*.py"))


def test_host_functions_are_short():
    assert long_functions(python_files()) == []


def jit_functions(paths: list[Path]) -> set[str]:
    """Names of the functions decorated with @triton.jit (or @triton.jit(...))."""
    return {
        node.name
        for path in paths
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.FunctionDef)
        and any("triton.jit" in ast.unparse(d) for d in node.decorator_list)
    }


def positional_launches(paths: list[Path]) -> list[str]:
    """Triton launches, `kernel[grid](...)` of a @triton.jit kernel, that pass an argument by
    position."""
    kernels, found = jit_functions(paths), []
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Subscript)):
                continue
            launched = node.func.value
            name = launched.attr if isinstance(launched, ast.Attribute) else ast.unparse(launched)
            if name in kernels and node.args:
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} {name}")
    return found


def test_kernel_launches_pass_arguments_by_keyword():
    assert positional_launches(python_files()) == []


@pytest.mark.parametrize("folder", ["moelora", "bench", "tests"])
def test_no_format_skips(folder):
    marker = "fmt: " + "skip"  # split so that this file does not match itself
    hits = [
        f"{p.relative_to(ROOT)}:{i}"
        for p in sorted((ROOT / folder).rglob("*.py"))
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if marker in line
    ]
    assert hits == []


# Comments and docstrings in moelora/ state invariants and reasons; what was measured goes to
# bench/results (STYLE.md rule 13). Each pattern is one kind of figure a comment must not quote.
MEASUREMENTS: dict[str, str] = {
    "a time": r"(?<![\w.])\d+(?:\.\d+)?\s?(?:ns|us|µs|μs|ms|s)\b",
    "a percentage": r"(?<![\w.])\d+(?:\.\d+)?%",  # no space: `H % BK` is a modulo
    "a speedup": r"\bx\d+\.\d+\b|\b\d+(?:\.\d+)?x\b",  # 1.66x, 8x, x1.31; not 4x4 or \x97
    "a bandwidth or throughput": r"\b[KMGT]B/s\b|\b[GT]FLOP/s\b",
    "a results path": r"bench/results",
}


def comments(path: Path) -> list[tuple[int, str]]:
    """(line, text) of every # comment (tokenize) and every bare string statement, docstrings
    included (ast)."""
    source = path.read_text()
    found = [
        (token.start[0], token.string)
        for token in tokenize.generate_tokens(io.StringIO(source).readline)
        if token.type == tokenize.COMMENT
    ]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            if isinstance(node.value.value, str):
                found.append((node.lineno, node.value.value))
    return found


def quoted_measurements(paths: list[Path], root: Path = ROOT) -> list[str]:
    """`path:line kind: 'text'` for each figure a comment or docstring quotes."""
    found = []
    for path in paths:
        for line, text in comments(path):
            for kind, pattern in MEASUREMENTS.items():
                for match in re.finditer(pattern, text):
                    at = line + text.count("\n", 0, match.start())
                    found.append(f"{path.relative_to(root)}:{at} {kind}: {match.group()!r}")
    return sorted(found)


def test_comments_quote_no_measurements():
    assert quoted_measurements(sorted(PACKAGE.rglob("*.py"))) == []


def test_the_check_catches_a_quoted_measurement(tmp_path):
    """Each pattern planted in a comment, a docstring or a bare string; a clean file passes."""
    planted = tmp_path / "planted.py"
    planted.write_text(
        '"""Module: took 73.9 us."""\n'
        "x = 1  # lost 12% at 4096 tokens\n"
        "def f():\n"
        '    """1.66x its base-only TTFT, 8x slower; the layer moved x1.31."""\n'
        "    # 4.27 TB/s, 522 TFLOP/s, see bench/results/NOTES.md\n"
        '    "a bare string as a comment: 2.4 ms, 44-68 ms, 3 s"\n'
    )
    clean = tmp_path / "clean.py"
    clean.write_text(
        '"""[T, H] rows; 2^(s - 1) exact; 16-byte rows; 100 columns; 16 stages; 4x4; \\\\x97."""\n'
        "y = 2  # H % BK == 0; a 168-register cap lets two programs share a multiprocessor\n"
        'message = "took 3 s"  # a string that is not a statement is not a comment\n'
    )
    assert quoted_measurements([clean], tmp_path) == []
    assert quoted_measurements([planted], tmp_path) == [
        "planted.py:1 a time: '73.9 us'",
        "planted.py:2 a percentage: '12%'",
        "planted.py:4 a speedup: '1.66x'",
        "planted.py:4 a speedup: '8x'",
        "planted.py:4 a speedup: 'x1.31'",
        "planted.py:5 a bandwidth or throughput: 'TB/s'",
        "planted.py:5 a bandwidth or throughput: 'TFLOP/s'",
        "planted.py:5 a results path: 'bench/results'",
        "planted.py:6 a time: '2.4 ms'",
        "planted.py:6 a time: '3 s'",
        "planted.py:6 a time: '68 ms'",
    ]
