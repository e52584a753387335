"""Every code block in README.md and docs/*.md runs as written, against the demo.

The convention the pages follow (README.md's "Examples" line says it too):
- ```python and ```bash blocks run, in the order their page has them. The python blocks of one
  page share one namespace, as a reader's session would (a later block may use `client` or
  `llm` from an earlier one); each bash block runs on its own under `bash -euo pipefail`, with
  curl failing on an HTTP error status.
- ```text blocks are output or formats shown, never run.
- A block whose info string says `no-run` (```bash no-run) is not run: `make` itself, commands
  that start a server or need a GPU, several GPUs or minutes. Its page gives a twin that runs,
  where one can.
Any other block fails the test, so an example cannot silently stop being run.

The pages run with HOME in a fresh folder, so `ensure_demo()` and `~/.cache/moelora/demo` are one
demo written for the test, against one `moelora serve demo` (with the `--lora-root` that
docs/adapters.md starts it with) on a free port: `localhost:8000` in a block becomes its address.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest
from server.conftest import Server, _free_port, serve

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
RUN = frozenset({"python", "bash"})
SHOWN = frozenset({"text"})
NO_RUN = "no-run"
DOCS_URL = "localhost:8000"
# curl as the pages write it, but an HTTP error status fails the block
STRICT_CURL = 'curl() { command curl --silent --show-error --fail-with-body "$@"; }\n'
_FENCE = re.compile(r"^\s*```(.*)$")


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # of the opening fence, 1-based
    info: list[str]  # the info string's words: the language first
    code: str

    @property
    def language(self) -> str:
        return self.info[0] if self.info else ""

    @property
    def runs(self) -> bool:
        return self.language in RUN and NO_RUN not in self.info

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def blocks(page: Path) -> list[Block]:
    """The fenced blocks of a page, indented ones (in a list) too."""
    found, opened, lines = [], None, []
    for number, line in enumerate(page.read_text().splitlines(), 1):
        fence = _FENCE.match(line)
        if opened is None and fence:
            opened, lines = (number, fence.group(1).split()), []
        elif opened is not None and line.strip() == "```":
            code = textwrap.dedent("\n".join(lines) + "\n")
            found.append(Block(page, opened[0], opened[1], code))
            opened = None
        elif opened is not None:
            lines.append(line)
    assert opened is None, f"{page.name}:{opened[0]}: a code block is never closed"
    return found


def test_every_block_is_run_shown_or_marked() -> None:
    every = [b for page in PAGES for b in blocks(page)]
    bad = [b.where for b in every if b.language not in RUN | SHOWN]
    assert not bad, f"blocks that are neither python, bash nor text: {bad}"
    assert sum(b.runs for b in every) >= 10  # the pages' examples are found at all


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("home")


@pytest.fixture(scope="module")
def docs_server(home: Path):
    """`moelora serve demo` as docs/adapters.md starts it, the demo in HOME's cache."""
    from moelora import demo

    assets = demo.ensure_demo(home / ".cache" / "moelora" / "demo")
    port = _free_port()
    log = home / "server.log"
    cmd = [sys.executable, "-m", "moelora.cli", "serve", "demo", "--device", "cpu"]
    cmd += ["--lora-root", str(home / ".cache" / "moelora" / "demo" / "adapters")]
    cmd += ["--port", str(port), "--log-level", "warning"]
    env = _environment(home)
    with serve(cmd, port, log, home / ".cache", assets.adapters, env=env, cwd=ROOT) as srv:
        yield srv


def _environment(home: Path) -> dict[str, str]:
    """The environment a reader has after `make run`: the venv's commands first on PATH."""
    env = {k: v for k, v in os.environ.items() if k != "MOELORA_CACHE"}
    env["HOME"] = str(home)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_page_examples_run(
    page: Path, home: Path, docs_server: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("MOELORA_CACHE", raising=False)
    address = docs_server.url.removeprefix("http://")
    namespace: dict = {"__name__": "__main__"}
    for block in blocks(page):
        if not block.runs:
            continue
        code = block.code.replace(DOCS_URL, address)
        if block.language == "python":
            exec(compile(code, block.where, "exec"), namespace)
        else:
            _run_bash(block, code, home)


def _run_bash(block: Block, code: str, home: Path) -> None:
    result = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", STRICT_CURL + code],
        env=_environment(home),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    sys.stdout.write(result.stdout)
    assert result.returncode == 0, (
        f"{block.where} exited {result.returncode}:\n{code}\n"
        f"stdout:\n{result.stdout[-3000:]}\nstderr:\n{result.stderr[-3000:]}"
    )
