"""bench/e2e_loop.py on the CPU: a run is a fresh process that builds, runs and closes both
engines (twice here); a run killed by a signal is a failure that names the signal."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_smoke_loop_passes_and_reports_each_engine(tmp_path: Path) -> None:
    """With the crash hunt's options: a Triton cache of its own, graph sizes warmed all at once
    (on the CPU they change nothing but what the child is told and the report says)."""
    out = tmp_path / "loop.md"
    cmd = [sys.executable, "bench/e2e_loop.py", "--smoke", "--runs", "1", "--cycles", "2"]
    cmd += ["--cold-cache", "--concurrent-warmup"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [*cmd, "--out", str(out)], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    text = out.read_text()
    assert "1 of 1 runs passed" in text
    rows = [line for line in text.splitlines() if line.startswith("| 0 | passed |")]
    assert len(rows) == 4  # 2 cycles x (disabled, 8 adapters)
    assert "graph sizes warmed all at once" in text and "a fresh one each run" in text


def test_a_run_killed_by_a_signal_fails_and_names_it() -> None:
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        from e2e_loop import Run
    finally:
        sys.path.remove(str(ROOT / "bench"))
    crashed = Run(3, -signal.SIGSEGV, 12.0, [], "Segmentation fault")
    assert not crashed.passed and crashed.verdict() == "killed by SIGSEGV"
    assert Run(4, 1, 1.0, [], "").verdict() == "exit 1"
    assert Run(5, 0, 1.0, [], "").passed
