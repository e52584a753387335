"""Decode projections of block-FP8 weights (kernels/linear_fp8.fp8_linear) against the bf16
batch-invariant kernel on the dequantized weight, vs the FP8 floor, tile by tile, and whether
each tile keeps a row's bits those of the dequantized weight's 2048-row cuBLAS product.

Timing as bench/linear.py: LAYERS projections with their own weights back to back in one CUDA
graph, L2 flushed, the replay median over LAYERS. The floor is a weight's bytes (a code a byte,
a float32 scale a 128 x 128 block) over the copy bandwidth measured in the same run.

Bits: rows 0-3 of an M-row product against the same rows of cuBLAS on the dequantized weight
at 2048 rows (the batch-invariant chain's bits), in mismatched elements: 0 is a tile that
keeps batch invariance with FP8 weights.

    PYTHONPATH=. python bench/linear_fp8.py [--shapes NAME ...] [--ms 1 8 64] [--out PATH]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from common import copy_bandwidth, graph_ms, result_header, write_result
from linear import MORE_SHAPES, SHAPES, us

from moelora.kernels.fp8_block import dequantize_fp8_block, quantize_fp8_block
from moelora.kernels.linear import DotConfig, dot_linear
from moelora.kernels.linear_fp8 import fp8_dot_config, fp8_linear
from moelora.kernels.sizes import next_power_of_2

LAYERS = 16
MS = (1, 4, 8, 16, 32, 64)
# (block_m, or 0 for the row count's power of 2 up to 64, block_n, block_k, warps, stages):
# block_k divides 128; a 64-row tile at 4 warps or more is one warpgroup's MMA, fewer rows or
# warps the older MMA
CANDIDATES = (
    (0, 16, 128, 2, 8),
    (0, 8, 128, 1, 8),
    (0, 32, 128, 4, 8),
    (0, 64, 128, 4, 4),
    (64, 16, 128, 4, 8),
    # a 64-row x tile is 16 KB a stage at 128 deep, one real row or 64: fewer stages let more
    # programs share a multiprocessor (the default's 8 stages hold one)
    (64, 16, 128, 4, 3),
    (64, 16, 64, 4, 4),
    (64, 32, 128, 4, 3),
    (64, 32, 128, 4, 8),
    (64, 32, 64, 4, 8),
    (64, 64, 128, 4, 4),
    (64, 64, 64, 4, 8),
    (64, 128, 128, 4, 3),
    (64, 64, 128, 8, 4),
)


def mismatches(y: torch.Tensor, ref: torch.Tensor) -> int:
    r = min(y.shape[0], 4)
    return int((y[:r] != ref[:r]).sum().item())


def bench_shape(name: str, N: int, K: int, bw: float, ms: list[int]) -> list[str]:
    weights = [quantize_fp8_block(torch.randn(N, K, device="cuda") / K**0.5) for _ in range(LAYERS)]
    deq = [dequantize_fp8_block(c, s, torch.bfloat16) for c, s in weights]
    codes, scale = weights[0]
    floor = (codes.numel() + scale.numel() * 4) / bw * 1e3
    x_all = torch.randn(2048, K, device="cuda", dtype=torch.bfloat16)
    ref = F.linear(x_all, deq[0])[:4]
    rows = []
    for M in ms:
        x = x_all[:M].contiguous()
        bf16 = graph_ms(lambda x=x: [dot_linear(x, w) for w in deq], LAYERS)
        small = min(64, next_power_of_2(M))
        configs = dict.fromkeys([fp8_dot_config(M, N)], " (default)")
        for bm, bn, bk, warps, stages in CANDIDATES:
            configs.setdefault(DotConfig(bm or small, bn, bk, warps, stages), "")
        for c, label in configs.items():
            try:
                t = graph_ms(
                    lambda x=x, c=c: [fp8_linear(x, q, s, config=c) for q, s in weights], LAYERS
                )
                bits = mismatches(fp8_linear(x, codes, scale, config=c), ref)
            except Exception as e:  # a tile past the shared memory: say so, go on
                print(f"{name} M={M} {tuple(c)}: {type(e).__name__}", flush=True)
                continue
            line = (
                f"| {name} | {M} | {tuple(c)}{label} | {us(floor)} "
                f"| {us(t)} ({t / floor:.2f}x) | {us(bf16)} | {t / bf16:.3f} | {bits} |"
            )
            rows.append(line)
            print(line, flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    shapes = SHAPES | MORE_SHAPES
    parser.add_argument(
        "--shapes",
        nargs="+",
        choices=list(shapes),
        default=["qwen3-30b-a3b q|k|v", "qwen3-30b-a3b o"],
    )
    parser.add_argument("--ms", nargs="+", type=int, default=list(MS))
    parser.add_argument("--out", help="result file (default: a dated one in bench/results)")
    args = parser.parse_args()
    bw = copy_bandwidth()
    torch.manual_seed(0)
    rows = [
        "| shape | M | config (bm, bn, bk, warps, stages) | FP8 floor µs | fp8_linear µs (x floor)"
        " | bf16 dot_linear µs | FP8 / bf16 | rows 0-3 off the chain's bits |",
        "|---|---:|---|---:|---:|---:|---:|---:|",
    ]
    for name in args.shapes:
        rows += bench_shape(name, *shapes[name], bw, args.ms)
    lines = result_header("Block-FP8 decode projections, tile by tile", bw)
    lines += [f"- {LAYERS} projections with their own weights per CUDA graph, L2 flushed", ""]
    write_result("linear-fp8", lines + rows, args.out)


if __name__ == "__main__":
    main()
