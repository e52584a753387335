"""Graph capture time of bench/decode.py's engine (Qwen3-30B-A3B shape, random weights), with a
cold Triton cache and a warm one.

Each run is a process of its own with its own Triton cache directory, and builds the engine
twice, as bench/decode.py does: LoRA disabled, then LoRA enabled (whose LoRA kernels compile
then). Runs:
  cold          an empty cache
  warm          the same cache again (a server's second start)

    PYTHONPATH=. python bench/capture.py [--layers 48] [--out PATH]
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

RUNS = (("cold", "new"), ("warm", "same"))


def child(layers: int) -> dict:
    """Capture in this process; returns seconds per engine and the variants compiled."""
    import torch
    from common import capture_seconds, make_engine, model_folder

    folder = model_folder(layers)
    result = {}
    for lora in (False, True):
        engine = make_engine(folder, lora=lora)
        result["lora" if lora else "disabled"] = capture_seconds(engine)
        del engine
        gc.collect()
        torch.cuda.empty_cache()
    cache = os.environ["TRITON_CACHE_DIR"]
    result["variants"] = sum(
        not os.path.basename(f).startswith("__grp") for f in glob.glob(f"{cache}/*/*.json")
    )
    return result


def run_children(layers: int) -> list[tuple[str, dict]]:
    """Each run in a child process; a "new" run starts from an empty Triton cache."""
    rows, cache = [], None
    for name, which in RUNS:
        if which == "new":
            cache = tempfile.mkdtemp(prefix="triton-cache-")
        cmd = [sys.executable, __file__, "--layers", str(layers), "--child"]
        env = {**os.environ, "TRITON_CACHE_DIR": cache}
        out = subprocess.run(cmd, env=env, check=True, stdout=subprocess.PIPE, text=True).stdout
        result = json.loads(out.strip().splitlines()[-1])
        rows.append((name, result))
        print(name, result, flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=48)
    parser.add_argument("--out", help="result file (default: a dated one in bench/results)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.layers)))
        return
    from common import DECODE_BATCHES, MAX_LORAS, RANK, result_header, write_result

    from moelora.config import EngineConfig, graph_batch_sizes, prefill_graph_sizes

    rows = run_children(args.layers)
    max_bs = max(DECODE_BATCHES)
    prefill = prefill_graph_sizes(EngineConfig.max_prefill_graph_tokens)  # the default's
    lines = result_header("Graph capture, Qwen3-30B-A3B shape (random weights)", None)
    lines += [
        f"- layers: {args.layers} of 48; bf16; {len(graph_batch_sizes(max_bs))} batch "
        f"sizes 1 .. {max_bs}, as bench/decode.py, and {len(prefill)} prefill token counts "
        f"{prefill[-1]} .. {prefill[0]}; {os.cpu_count()} CPU cores",
        "- each run is its own process with its own Triton cache; it builds the LoRA-disabled "
        f"engine, then the LoRA-enabled one (max_loras {MAX_LORAS}, rank {RANK})",
        "- warm-up: every graph's first forward, where the kernels compile; all sizes at "
        "once where Triton has AsyncCompileMode (runner/graph_runner.py)",
        "",
        "| run | disabled: capture s | of it warm-up s | LoRA: capture s | of it warm-up s | "
        "variants in the cache |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, r in rows:
        (d, dw), (lo, lw) = r["disabled"], r["lora"]
        lines.append(f"| {name} | {d:.1f} | {dw:.1f} | {lo:.1f} | {lw:.1f} | {r['variants']} |")
    write_result("capture", lines, args.out)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
