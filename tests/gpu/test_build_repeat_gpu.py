"""What could crash a process while an engine is built, repeated: fresh processes each build an
engine on the GPU (Triton's first launches of every kernel in the capture's warm-up, then the
graph capture) and generate with adapters; one process builds and closes engines again and
again. A crash (a signal) fails the test with every thread's Python stack (faulthandler). A
fresh Triton cache in one of the processes makes it compile everything there, as a first start
on a machine does.

Skipped without CUDA; run on the device by scripts/gpu-check tests.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

ROOT = Path(__file__).resolve().parents[2]
BUILD = """
import sys
from moelora import LLM, SamplingParams
from moelora.demo import ensure_demo

demo = ensure_demo(sys.argv[1])
adapters = {name: str(path) for name, path in demo.adapters.items()}
params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
prompts = [[5, 9, 2, 77], [3, 14, 15, 92, 65], list(range(40, 70)), [250]]
first = None
for _ in range(int(sys.argv[2])):
    with LLM(str(demo.model), lora_modules=adapters, max_loras=2, max_lora_rank=16,
             max_num_seqs=64, num_pages=512) as llm:
        names = [None, *adapters][: len(prompts)]
        names += [None] * (len(prompts) - len(names))
        tokens = [o.token_ids for o in llm.generate(prompts, params, lora=names)]
    assert first is None or tokens == first, (tokens, first)
    first = tokens
print("built", sys.argv[2])
"""


def _build(tmp_path: Path, times: int, env: dict[str, str]) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-X", "faulthandler", "-c", BUILD, str(tmp_path / "demo"), str(times)]
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path, **env}
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)


def test_engines_build_in_fresh_processes_and_in_one(tmp_path: Path) -> None:
    runs = [_build(tmp_path, 1, {"TRITON_CACHE_DIR": str(tmp_path / "cold-triton")})]
    runs += [_build(tmp_path, 1, {}) for _ in range(4)]
    runs.append(_build(tmp_path, 5, {}))  # built and closed five times in one process
    for i, run in enumerate(runs):
        assert run.returncode == 0, f"run {i}: exit {run.returncode}\n{run.stderr[-6000:]}"
        assert "built" in run.stdout
