"""One server process for the whole package, on the demo model, queried over real HTTP.

The server runs with `--max-loras 2` and three adapters registered (sql, chat, extra), so slots
are filled and evicted on demand while the tests run. Offline references come from `LLM` on the
same folders, in this process.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from moelora import demo

API_KEY = "test-key"
MAX_MODEL_LEN = 256
MAX_LORAS = 2
MAX_LORA_RANK = 16
BASE = "demo"


@dataclass
class Server:
    url: str
    log: Path
    cache: Path  # MOELORA_CACHE: the demo lives in cache/demo
    adapters: dict[str, Path]  # every adapter written for the tests, loaded or not
    process: subprocess.Popen = field(repr=False)

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {API_KEY}"}

    def client(self, **kw):
        from openai import OpenAI

        return OpenAI(base_url=f"{self.url}/v1", api_key=API_KEY, max_retries=0, **kw)

    def async_client(self, **kw):
        from openai import AsyncOpenAI

        return AsyncOpenAI(base_url=f"{self.url}/v1", api_key=API_KEY, max_retries=0, **kw)

    def metrics(self) -> dict[str, float]:
        """Samples of /metrics by their full name with labels, e.g. 'x{model="sql"}'."""
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        samples = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                samples[name] = float(value)
        return samples


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _write_adapters(root: Path) -> dict[str, Path]:
    shape = demo.DEMO_SHAPE
    paths = {name: root / name for name in ("extra", "hot", "big", "misshapen")}
    demo.write_per_expert_adapter(paths["extra"], shape, rank=16, seed=11)
    demo.write_target_parameters_adapter(paths["hot"], shape, rank=2, seed=12)
    demo.write_per_expert_adapter(paths["big"], shape, rank=MAX_LORA_RANK * 2, seed=13)
    wrong = demo.ModelShape(**{**shape.__dict__, "expert_intermediate": 24})
    demo.write_per_expert_adapter(paths["misshapen"], wrong, rank=4, seed=14)
    return paths


@pytest.fixture(scope="package")
def server(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("server")
    assets = demo.ensure_demo(root / "cache" / "demo")
    adapters = {**assets.adapters, **_write_adapters(root / "adapters")}
    port = _free_port()
    log = root / "server.log"
    cmd = [
        sys.executable,
        "-m",
        "moelora.cli",
        "serve",
        "demo",
        "--lora-modules",
        f"extra={adapters['extra']}",
        "--max-loras",
        str(MAX_LORAS),
        "--max-lora-rank",
        str(MAX_LORA_RANK),
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--device",
        "cpu",
        "--port",
        str(port),
        "--api-key",
        API_KEY,
        "--log-level",
        "warning",
    ]
    env = {**os.environ, "MOELORA_CACHE": str(root / "cache")}
    with serve(cmd, port, log, root / "cache", adapters, env=env) as srv:
        yield srv


@contextlib.contextmanager
def serve(
    cmd: list[str],
    port: int,
    log: Path,
    cache: Path,
    adapters: dict[str, Path],
    *,
    env: dict[str, str],
    cwd: Path | None = None,
) -> Iterator[Server]:
    """The server `cmd` starts on `port`, its output in `log`, once /health answers; stopped
    (SIGINT, then killed) when the block ends."""
    with open(log, "wb") as out:
        process = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=cwd)
    srv = Server(f"http://127.0.0.1:{port}", log, cache, adapters, process)
    try:
        _wait_healthy(srv)
        yield srv
    finally:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _wait_healthy(srv: Server, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if srv.process.poll() is not None:
            pytest.fail(f"server exited with {srv.process.returncode}:\n{srv.log.read_text()}")
        try:
            if httpx.get(f"{srv.url}/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    pytest.fail(f"server not healthy after {timeout}s:\n{srv.log.read_text()}")


def _children(pid: int) -> list[int]:
    children = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        children += [int(c) for c in (task / "children").read_text().split()]
    return children


def _worker_pids(pid: int) -> list[int]:
    """The processes that run a rank under the server `pid`: the fork server's children (rank
    workers fork from it, engine/ranks.py), not its resource tracker."""
    servers = [
        c for c in _children(pid) if b"forkserver" in Path(f"/proc/{c}/cmdline").read_bytes()
    ]
    return [w for server in servers for w in _children(server)]


class Offline:
    """Greedy references from LLM.generate on the same folders, memoized."""

    def __init__(self, server: Server) -> None:
        from moelora import LLM

        names = ("sql", "chat", "extra", "hot")
        self.llm = LLM(
            str(server.cache / "demo" / "model"),
            lora_modules={n: str(server.adapters[n]) for n in names},
            max_loras=len(names),
            max_lora_rank=MAX_LORA_RANK,
            device="cpu",
        )
        self.tokenizer = self.llm.get_tokenizer()
        self._memo: dict[tuple, object] = {}

    def generate(self, requests: list[tuple[str, str | list[int], int]]) -> list:
        """(model, prompt text or ids, max_tokens) -> RequestOutputs, all in one batch."""
        from moelora import SamplingParams

        todo = [r for r in dict.fromkeys(self._key(r) for r in requests) if r not in self._memo]
        if todo:
            outs = self.llm.generate(
                [list(p) for _, p, _ in todo],
                [SamplingParams(max_tokens=n, temperature=0.0) for _, _, n in todo],
                lora=[None if m == BASE else m for m, _, _ in todo],
            )
            self._memo.update(zip(todo, outs))
        return [self._memo[self._key(r)] for r in requests]

    def text(self, model: str, prompt: str | list[int], max_tokens: int) -> str:
        return self.generate([(model, prompt, max_tokens)])[0].text

    def chat_ids(self, messages: list[dict]) -> list[int]:
        return self.tokenizer.apply_chat_template(messages)

    def _key(self, request: tuple) -> tuple:
        model, prompt, n = request
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
        return model, tuple(ids), n


@pytest.fixture(scope="package")
def offline(server: Server) -> Offline:
    return Offline(server)
