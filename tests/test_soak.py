"""bench/soak.py against the demo server on the CPU for half a minute: its verdict passes, and
every kind of traffic it is meant to send actually happened (a soak that skipped one would pass
without testing it)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DURATION = 30  # s of timed load, after the server's start and a 10 s warm-up


@pytest.mark.slow
def test_soak_on_the_demo_passes_and_sends_every_kind(tmp_path: Path) -> None:
    summary = tmp_path / "soak.json"
    command = [sys.executable, "bench/soak.py", "--duration", str(DURATION)]
    command += ["--out", str(tmp_path / "soak.md"), "--json", str(summary)]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MOELORA_CACHE": str(tmp_path / "cache")}
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-6000:]
    figures = json.loads(summary.read_text())
    assert figures["pass"] and figures["reasons"] == []
    assert all(n > 0 for n in figures["sent"].values()), figures["sent"]
    assert figures["outcomes"]["bad"] == {"4xx expected": figures["sent"]["bad"]}
    events = figures["events"]
    for event in ("abort", "disconnect", "adapter requests", "structured answers checked"):
        assert events.get(event, 0) > 0, event
    for event in ("load", "unload", "reload"):
        assert events.get(event, 0) > 0, event
    assert figures["prefix_cache_hits"] > 0 and figures["server_aborts"] > 0
    idle = ("num_requests_running", "num_requests_waiting", "kv_pages_used", "lora_slot_refs")
    assert {figures["after"][f"moelora_{gauge}"] for gauge in idle} == {0}


def test_the_verdict_catches_leaks_errors_and_missing_traffic(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.syspath_prepend(str(ROOT / "bench"))  # as `python bench/soak.py` has it
    import soak
    from soak_traffic import KINDS, Tally

    idle = {name: 0.0 for name in soak.IDLE}
    before = {**idle, "process_resident_memory_bytes": 1000 * 2**20}
    before["moelora_gpu_memory_allocated_bytes"] = 50 * 2**30
    after = {**before, "moelora_kv_pages_used": 3.0, "moelora_lora_slot_refs": 1.0}
    after["process_resident_memory_bytes"] += 201 * 2**20  # the bound: max(200 MiB, 10%)
    after["moelora_gpu_memory_allocated_bytes"] += 65 * 2**20
    tally = Tally()
    for kind in KINDS[1:]:  # no completion sent
        tally.outcomes[kind, "2xx"] += 1
    tally.problem("chat: 500", "Internal Server Error")
    run = soak.Run(tally, Tally(), [], before, after, 30.0, idle=False, load_seconds=60.0)
    server = soak.Server("http://127.0.0.1:1", soak.API_KEY)
    reasons = soak.verdict(run, server)
    expected = [
        "chat: 500 (x1)",
        "not idle 30 s after the load: {'KV pages held by requests': 3.0, "
        "'adapter slot references': 1.0}",
        "GPU allocated grew by 65.0 MiB (bound 64.0 MiB)",
        "host RSS grew by 201.0 MiB (bound 200.0 MiB)",
        "no completion request was sent",
    ]
    assert reasons[: len(expected)] == expected
    assert "no abort happened" in reasons and "no prefix-cache hit during the load" in reasons
