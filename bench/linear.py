"""The decode projections (kernels/linear.py) against cuBLAS at decode row counts, vs the floor,
and whether each keeps a row's bits independent of the row count.

Timing: for each shape and row count M, LAYERS projections (each with its own weight, so
nothing is read from L2) run back to back in one CUDA graph, replayed with the L2 cache flushed
(triton's do_bench); the figure is the replay median over LAYERS. The chain is what a decode
step launches: with programmatic dependent launch each kernel's weights start streaming while
the launch before it drains. The floor is a weight's bytes over the copy bandwidth measured in
the same run. `--sweep` also times each candidate config of the batch-invariant kernel.

Invariance: rows 0-3 of an M-row product against the same rows of a 2048-row cuBLAS product
(where cuBLAS does not split K), counted in mismatched elements; 0 everywhere is batch
invariance.

    PYTHONPATH=. python bench/linear.py [--sweep] [--out PATH]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from common import copy_bandwidth, graph_ms, result_header, write_result

from moelora.kernels.linear import (
    DOT_ROWS,
    INVARIANT_ROWS,
    MAX_ROWS,
    BatchInvariantLinear,
    DotConfig,
    dot_config,
    dot_linear,
    fits,
    skinny_linear,
)

SHAPES = {  # name: (N, K)
    "qwen3-30b-a3b q|k|v": (5120, 2048),
    "qwen3-30b-a3b o": (2048, 4096),
    "qwen3-30b-a3b router": (128, 2048),
    "mixtral q|k|v": (6144, 4096),
    "mixtral o": (4096, 4096),
}
# the hybrid and MLA families' decode projections (--shapes); Qwen3.5's in_proj is q|k|v|z|b|a,
# its router one product with the shared expert's gate|up and gate (padded to a multiple of 8)
MORE_SHAPES = {
    "qwen3.5 in_proj": (12352, 2048),
    "qwen3.5 out_proj": (2048, 4096),
    "qwen3.5 router|shared": (1288, 2048),
    "qwen3.5 shared down": (2048, 512),
    "qwen3.5 q|gate|k|v": (9216, 2048),
    "moonlight q|kv_a": (3648, 2048),
    "moonlight o": (2048, 2048),
}
MS = (1, 2, 4, 8, 16, 32, 64)
LAYERS = 16
CANDIDATES = (  # (block_n, block_k, warps, stages); block_m follows M
    (8, 512, 1, 4),
    (8, 256, 1, 8),
    (16, 256, 1, 8),
    (16, 512, 1, 4),
    (16, 256, 2, 8),
    (16, 128, 2, 8),
    (16, 128, 4, 8),
    (32, 128, 4, 8),
    (32, 256, 4, 8),
    (32, 64, 4, 8),
    (32, 128, 2, 8),
    (64, 128, 4, 4),
    (64, 64, 4, 6),
    (64, 128, 8, 4),
)
CHECK_MS = (1, 2, 3, 8, 13, 16, 24, 32, 64, 80, 100, 127, 128, 200, 256, 512)


def us(ms: float) -> str:
    return f"{ms * 1e3:.2f}"


def bench_shape(name: str, N: int, K: int, bw: float, sweep: bool) -> list[str]:
    ws = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(LAYERS)]
    floor = N * K * 2 / bw * 1e3
    rows = []
    for M in MS:
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        cublas = graph_ms(lambda x=x: [F.linear(x, w) for w in ws], LAYERS)
        ours = graph_ms(lambda x=x: [dot_linear(x, w) for w in ws], LAYERS)
        gemv = ""
        if M <= MAX_ROWS:
            t = graph_ms(lambda x=x: [skinny_linear(x, w) for w in ws], LAYERS)
            gemv = f"{us(t)}{' (taken)' if fits(x, ws[0]) else ''}"
        line = (
            f"| {name} | {M} | {us(floor)} | {us(cublas)} | {us(ours)} ({ours / floor:.2f}x) "
            f"| {tuple(dot_config(M, N))} | {gemv} |"
        )
        if sweep:
            tried = {}
            for bn, bk, warps, stages in CANDIDATES:
                c = DotConfig(dot_config(M, N).block_m, bn, bk, warps, stages)
                try:
                    run = lambda x=x, c=c: [dot_linear(x, w, config=c) for w in ws]  # noqa: E731
                    tried[c] = graph_ms(run, LAYERS)
                except Exception as e:  # a config past the shared memory: say so, go on
                    print(f"{name} M={M} {tuple(c)}: {type(e).__name__}", flush=True)
            best = min(tried, key=tried.get)
            line += f" {us(tried[best])} at {tuple(best)} |"
        rows.append(line)
        print(line, flush=True)
    return rows


def check_shape(name: str, N: int, K: int, bias: bool) -> list[str]:
    """Mismatched elements of rows 0-3, against the 2048-row cuBLAS product."""
    w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 0.02
    b = torch.randn(N, device="cuda", dtype=torch.bfloat16) if bias else None
    x = torch.randn(2048, K, device="cuda", dtype=torch.bfloat16)
    ref = F.linear(x, w, b)[:4]
    batch_invariant = BatchInvariantLinear()
    kinds = {
        "batch-invariant": lambda x: batch_invariant(x, w, b),
        "cuBLAS": lambda x: F.linear(x, w, b),
        "skinny GEMV": lambda x: skinny_linear(x, w, b) if x.shape[0] <= MAX_ROWS else None,
    }
    rows = []
    for kind, fn in kinds.items():
        cells = []
        for M in CHECK_MS:
            y = fn(x[:M])
            r = min(M, 4)
            cells.append("" if y is None else str((y[:r] != ref[:r]).sum().item()))
        rows.append(f"| {name}{' + bias' if bias else ''} | {kind} | " + " | ".join(cells) + " |")
    print("\n".join(rows), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument(
        "--shapes",
        nargs="+",
        choices=[*SHAPES, *MORE_SHAPES],
        default=list(SHAPES),
        help="projections to time (default: the Qwen3-30B-A3B and Mixtral ones)",
    )
    parser.add_argument("--out", help="result file (default: a dated one in bench/results)")
    args = parser.parse_args()
    bw = copy_bandwidth()
    torch.manual_seed(0)
    head = (
        "| shape | M | floor µs | cuBLAS µs | batch-invariant µs (x floor)"
        " | config (bm, bn, bk, warps, stages) | skinny GEMV µs |"
    )
    rule = "|---|---:|---:|---:|---:|---|---:|"
    if args.sweep:
        head, rule = head + " best of sweep µs |", rule + "---|"
    rows = [head, rule]
    shapes = {name: (SHAPES | MORE_SHAPES)[name] for name in args.shapes}
    for name, (N, K) in shapes.items():
        rows += bench_shape(name, N, K, bw, args.sweep)
    check = [
        "| shape | kernel | " + " | ".join(f"M={M}" for M in CHECK_MS) + " |",
        "|---|---|" + "---:|" * len(CHECK_MS),
    ]
    for name, (N, K) in shapes.items():
        check += check_shape(name, N, K, bias=False)
    check += check_shape("qwen2-moe-like q|k|v", 2048 * 3, 2048, bias=True)
    lines = result_header("Decode projections vs cuBLAS, decode row counts", bw)
    lines += [f"- {LAYERS} projections with their own weights per CUDA graph, L2 flushed", ""]
    lines += rows + ["", "## Batch invariance", ""]
    lines += [
        "Mismatched elements of rows 0-3 of an M-row product against the same rows of a "
        f"2048-row cuBLAS product (bf16, random inputs). `BatchInvariantLinear` takes the "
        f"tensor-core kernel up to {DOT_ROWS} rows, cuBLAS from {INVARIANT_ROWS}, and in between"
        " cuBLAS where it measured cuBLAS to give the kernel's bits; 0 in every column is batch"
        " invariance.",
        "",
        *check,
    ]
    write_result("linear", lines, args.out)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
