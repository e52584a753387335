"""bench/determinism.py on the CPU (--smoke): both modes run every figure through the engine,
and the result file has a row a figure with both values and their ratio."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FIGURES = ["decode B=1", "decode B=4", "TTFT 16", "TTFT 48", "throughput base"]


def test_the_smoke_gives_every_figure_off_and_on(tmp_path: Path) -> None:
    out = tmp_path / "determinism.md"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "bench/determinism.py", "--smoke", "--out", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = {
        cells[0]: cells
        for cells in (
            [c.strip() for c in line.strip("|").split("|")]
            for line in out.read_text().splitlines()
            if line.startswith("| ") and not line.startswith("| figure")
        )
    }
    for name in [*FIGURES, "throughput 8 adapters"]:
        off, on, ratio = (float(rows[name][i]) for i in (1, 2, 3))
        assert off > 0 and on > 0, rows[name]
        expected = off / on if name.startswith("throughput") else on / off
        assert abs(ratio - expected) <= 5e-3 * max(1.0, expected), rows[name]
    assert float(rows["TTFT 48"][4]) > 0  # its compute floor
