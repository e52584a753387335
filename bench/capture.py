"""Graph capture time of bench/decode.py's engine (Qwen3-30B-A3B shape, random weights): cold
Triton cache and warm, with the kernels compiling concurrently (the default) and serially.

Each run is a process of its own with its own Triton cache directory, and builds the engine
twice, as bench/decode.py does: LoRA disabled, then LoRA enabled (whose LoRA kernels compile
then). Runs:
  cold          an empty cache
  warm          the same cache again (a server's second start)
  cold serial   an empty cache, the warm-up one batch size after another (as before)

  PYTHONPATH=.:bench python3 bench/capture.py [--layers 48]
"""

from __future__ import annotations

import argparse
import gc
import glob
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

RUNS = (("cold", "new", False), ("warm", "same", False), ("cold serial", "new", True))


def child(layers: int, serial: bool) -> dict:
    """Capture in this process; returns seconds per engine and the variants compiled."""
    import torch
    from decode import QWEN3_30B_A3B, make_engine

    from moelora.runner import graph_runner

    if serial:  # the A/B: the capture loop's own warm-up then compiles one size at a time
        graph_runner.warm_up_concurrently = lambda *args, **kwargs: False
    folder = tempfile.mkdtemp()
    Path(folder, "config.json").write_text(
        json.dumps({**QWEN3_30B_A3B, "num_hidden_layers": layers})
    )
    result = {}
    for lora in (False, True):
        engine = make_engine(folder, lora=lora, eager=False)
        graphs = engine.runner.graphs
        result["lora" if lora else "disabled"] = (graphs.capture_seconds, graphs.warm_up_seconds)
        del engine, graphs
        gc.collect()
        torch.cuda.empty_cache()
    cache = os.environ["TRITON_CACHE_DIR"]
    result["variants"] = sum(
        not os.path.basename(f).startswith("__grp") for f in glob.glob(f"{cache}/*/*.json")
    )
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=48)
    parser.add_argument("--out", default="bench/results/capture-h200.md")
    parser.add_argument("--child", choices=("concurrent", "serial"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.layers, args.child == "serial")))
        return
    from common import result_header
    from decode import BATCHES

    from moelora.runner.graph_runner import graph_batch_sizes

    rows, cache = [], None
    for name, which, serial in RUNS:
        if which == "new":
            cache = tempfile.mkdtemp(prefix="triton-cache-")
        cmd = [sys.executable, __file__, "--layers", str(args.layers)]
        cmd += ["--child", "serial" if serial else "concurrent"]
        env = {**os.environ, "TRITON_CACHE_DIR": cache}
        out = subprocess.run(cmd, env=env, check=True, stdout=subprocess.PIPE, text=True).stdout
        result = json.loads(out.strip().splitlines()[-1])
        rows.append((name, result))
        print(name, result, flush=True)
    lines = result_header("Graph capture, Qwen3-30B-A3B shape (random weights), H200", None)
    lines += [
        f"- layers: {args.layers} of 48; bf16; {len(graph_batch_sizes(max(BATCHES)))} batch "
        f"sizes 1 .. {max(BATCHES)}, as bench/decode.py; {os.cpu_count()} CPU cores",
        "- each run is its own process with its own Triton cache; it builds the LoRA-disabled "
        "engine, then the LoRA-enabled one (max_loras 8, rank 16)",
        "- warm-up: every batch size's first forward, where the kernels compile; concurrent "
        "(the default) or one size after another (serial, the A/B)",
        "",
        "| run | disabled: capture s | of it warm-up s | LoRA: capture s | of it warm-up s | "
        "variants in the cache |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, r in rows:
        (d, dw), (lo, lw) = r["disabled"], r["lora"]
        lines.append(f"| {name} | {d:.1f} | {dw:.1f} | {lo:.1f} | {lw:.1f} | {r['variants']} |")
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
