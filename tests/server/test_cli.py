"""`moelora demo` (what `make run` runs) and its --serve variant, as subprocesses."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from moelora import demo

from .conftest import _free_port


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("cli-cache")
    demo.ensure_demo(root / "demo")
    return root


def _run(cache: Path, *args: str) -> str:
    env = {**os.environ, "MOELORA_CACHE": str(cache)}
    cmd = [sys.executable, "-m", "moelora.cli", "demo", "--device", "cpu", *args]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_demo_prints_each_adapter(cache: Path) -> None:
    out = _run(cache)
    for name in ("sql", "chat", "base"):
        assert f"[{name:>5}]" in out


def test_demo_serve_queries_each_adapter_then_stops(cache: Path) -> None:
    port = _free_port()
    out = _run(cache, "--serve", "--once", "--port", str(port))
    for name in ("sql", "chat", "base"):
        assert f"[{name:>5}]" in out
    assert f"curl http://127.0.0.1:{port}/v1/completions" in out
    assert "OpenAI(base_url=" in out


def test_bench_reports_throughput_and_refuses_unknown_adapters(cache: Path) -> None:
    env = {**os.environ, "MOELORA_CACHE": str(cache)}
    cmd = [sys.executable, "-m", "moelora.cli", "bench", "demo", "--device", "cpu"]
    sizes = ["--num-prompts", "6", "--input-len", "12", "--output-len", "5"]
    done = subprocess.run(
        [*cmd, *sizes, "--lora", "sql", "--lora", "base"],
        env=env, capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert "6 x (12 in, 5 out)" in done.stdout and "['sql', 'base']" in done.stdout
    assert "output tokens/s" in done.stdout
    bad = subprocess.run(
        [*cmd, *sizes, "--lora", "nope"], env=env, capture_output=True, text=True, timeout=180
    )
    assert bad.returncode != 0 and "'nope'" in bad.stderr
