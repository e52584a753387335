"""The skinny projection (kernels/linear.py) against cuBLAS at decode row counts, vs the floor.

For each shape and row count M, LAYERS projections (each with its own weight, so nothing is
read from L2) run back to back in one CUDA graph, replayed with the L2 cache flushed (triton's
do_bench); the figure is the replay median over LAYERS. The chain is what a decode step
launches: with programmatic dependent launch each skinny program loads its weights while the
launch before it drains. `--sweep` also times other numbers of weights in flight an SM at M = 1
and 8. The floor is a weight's bytes over the copy bandwidth measured in the same run.

    PYTHONPATH=. python bench/linear.py [--sweep] [--out PATH]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from common import copy_bandwidth, graph_ms, result_header  # noqa: E402

from moelora.kernels.linear import MAX_ROWS, max_rows, skinny_config, skinny_linear  # noqa: E402

SHAPES = {  # name: (N, K)
    "qwen3-30b-a3b q|k|v": (5120, 2048),
    "qwen3-30b-a3b o": (2048, 4096),
    "qwen3-30b-a3b router": (128, 2048),
    "mixtral q|k|v": (6144, 4096),
    "mixtral o": (4096, 4096),
}
MS = (1, 2, 4, 8, 16)
LAYERS = 16
SWEEP = (16384, 32768, 65536, 131072)  # weights in flight an SM
SWEEP_MS = (1, 8)


def bench_shape(name: str, N: int, K: int, bw: float, sweep: bool) -> list[str]:
    ws = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) for _ in range(LAYERS)]
    floor = N * K * 2 / bw * 1e3
    rows = []
    for M in MS:
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        cublas = graph_ms(lambda x=x: [F.linear(x, w) for w in ws], LAYERS)
        line = f"| {name} | {M} | {floor * 1e3:.2f} | {cublas * 1e3:.2f} |"
        if M > MAX_ROWS:
            rows.append(line + " | | |" + (" |" if sweep else ""))
            continue
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        config = skinny_config(N, K, sms)
        ours = graph_ms(lambda x=x: [skinny_linear(x, w) for w in ws], LAYERS)
        taken = "yes" if M <= max_rows(N) else "no"
        line += f" {ours * 1e3:.2f} ({ours / floor:.2f}x) | {tuple(config)} | {taken} |"
        if sweep and M in SWEEP_MS:
            tried = {}
            for in_flight in SWEEP:
                c = skinny_config(N, K, sms, in_flight=in_flight)
                if c not in tried:
                    run = lambda x=x, c=c: [skinny_linear(x, w, config=c) for w in ws]  # noqa: E731
                    tried[c] = graph_ms(run, LAYERS)
            best = min(tried, key=tried.get)
            line += f" {tried[best] * 1e3:.2f} at {tuple(best)} |"
        rows.append(line)
        print(line, flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--out", default="bench/results/linear-h200.md")
    args = parser.parse_args()
    bw = copy_bandwidth()
    head = (
        "| shape | M | floor µs | cuBLAS µs | skinny µs (x floor) | (block_n, programs, warps)"
        " | taken by `linear` |"
    )
    rule = "|---|---:|---:|---:|---:|---|---|"
    if args.sweep:
        head, rule = head + " best of sweep µs |", rule + "---|"
    rows = [head, rule]
    for name, (N, K) in SHAPES.items():
        rows += bench_shape(name, N, K, bw, args.sweep)
    lines = result_header("Skinny projection vs cuBLAS, decode row counts (H200)", bw)
    lines += [f"- {LAYERS} projections with their own weights per CUDA graph, L2 flushed", ""]
    lines += rows + [""]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
