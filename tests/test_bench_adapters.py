"""bench/adapters.py on the CPU (--smoke): every workload runs through Engine.step() to its last
token, and the result file holds its row, one fill against its floor and the GPU bytes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORKLOADS = ("all16", "16of4", "zipf64", "zipf256", "ranks")
SMOKE_TOKENS = 6 * 3  # SMOKE: 6 requests x 3 output tokens


def cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip("|").split("|")]


def table_rows(text: str) -> dict[str, list[str]]:
    """Each table row's cells, by its first cell."""
    rows = [cells(line) for line in text.splitlines() if line.startswith("| ")]
    return {row[0]: row for row in rows}


def test_the_smoke_runs_every_workload_to_its_last_token(tmp_path: Path) -> None:
    out = tmp_path / "adapters.md"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "bench/adapters.py", "--smoke", "--out", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    text = out.read_text()
    rows = table_rows(text)
    for key in WORKLOADS:
        assert key in rows, f"no row for {key}"
        assert rows[key][5] == f"{SMOKE_TOKENS} / {SMOKE_TOKENS}", rows[key]  # output tokens
    assert rows["all16"][8] == "1.000"  # the reference's throughput over its own
    lines = text.splitlines()
    fill = cells(lines[next(i for i, x in enumerate(lines) if x.startswith("| adapter GiB")) + 2])
    assert fill[8] == "2 of 2", fill  # each timed step filled a slot
    at = next(i for i, x in enumerate(lines) if x.startswith("| batch | fills |"))
    beside = cells(lines[at + 2])
    assert beside[0] == "4" and int(beside[1]) >= 2, beside  # the lone requests' fills ran
    at = next(i for i, x in enumerate(lines) if x.startswith("| adapter | max_lora_rank |"))
    sizes = [cells(x) for x in lines[at + 2 : at + 6]]
    assert [(c[0], c[1]) for c in sizes] == [
        ("rank 8", "8"),
        ("rank 8", "64"),
        ("rank 16, per expert", "64"),
        ("rank 16, shared-outer", "64"),
    ], sizes
    low, high, per_expert, shared = (int(c[2]) for c in sizes)
    assert low == high > 0  # regions at the modules' own ranks: max_lora_rank takes nothing
    assert 0 < shared < per_expert  # the shared factors stored once
