"""add_lora_ (the row-tiled multi-LoRA of q|k|v and o) at prefill row counts: the tiles the
kernel picks (add_lora_tiles) against other row tiles (BT), column groups (CW) and shrink
depths (BK), and the prefill tile with capped registers and fewer stages; rank-16 adapters of
the Qwen3-30B-A3B shape, one adapter and 8 distinct ones (rows of one adapter side by side, as
the scheduler sorts them). Each figure is do_bench's median of
the launch alone, beside its bytes floor (x, y read and y written once, at the copy bandwidth
measured in the same run). On the H200 its figures below 4096 rows did not repeat (one tile read
26-68 us within a run, with MOELORA_PDL=0 too: bench/results/NOTES.md); read them with that.

    PYTHONPATH=. python bench/lora_tiles.py [--rows 512 1024 2048 4096] [--out PATH]
"""

from __future__ import annotations

import argparse
import itertools

import torch
from common import copy_bandwidth, result_header, write_result
from triton.testing import do_bench

from moelora.kernels.lora import PREFILL_ROWS, add_lora_, add_lora_tiles, multiprocessors
from moelora.step.lora import LoraBatchInfo, LoraWeights

DTYPE, RANK, SLOTS = torch.bfloat16, 16, 8
# (name, in, out slices): Qwen3-30B-A3B's q|k|v and o
SHAPES = (("q|k|v", 2048, (4096, 512, 512)), ("o", 4096, (2048,)))
SPREADS = ("1 adapter", "8 distinct")
CANDIDATES = [
    dict(BT=bt, CW=cw, BK=bk)
    for bt, cw, bk in itertools.product((16, 32, 64), (128, 256, 512, 1024), (128, 256))
    if bk == 128 or (bt == 16 and cw <= 256)  # the decode tiles' depth on their own shapes
]
# the prefill tile compiles to 235 registers a thread (sm_90 SASS on the CPU: the per-row slot
# masks in several layouts), 2 programs of 4 warps a multiprocessor, for a chain of dependent
# loads: capped registers (ptxas spills) and fewer stages for more programs a multiprocessor
CANDIDATES += [
    dict(BT=64, CW=cw, BK=128, maxnreg=regs, num_stages=stages)
    for cw, regs, stages in itertools.product((512, 1024), (128, 168), (2, 3))
]


def weights(k_in: int, slices: tuple[int, ...]) -> LoraWeights:
    """A [S, n, R, in], B [S, out, R] of random values, each slot at the full rank."""
    a = torch.randn(SLOTS, len(slices), RANK, k_in, device="cuda") / k_in**0.5
    b = torch.randn(SLOTS, sum(slices), RANK, device="cuda") * 0.01
    return LoraWeights.dense(a.to(DTYPE), b.to(DTYPE), slices)


def info_of(T: int, spread: str) -> LoraBatchInfo:
    count = 1 if spread == "1 adapter" else SLOTS
    slots = torch.arange(T) * count // T  # each adapter's rows side by side
    enabled = torch.zeros(SLOTS, dtype=torch.int32)
    enabled[:count] = 1
    return LoraBatchInfo(
        slots.to("cuda", torch.int32),
        torch.full((SLOTS,), RANK, dtype=torch.int32, device="cuda"),
        (torch.rand(SLOTS) + 0.5).cuda(),
        enabled.cuda(),
    )


def compile_all(T: int) -> None:
    """Every candidate's kernel variant launched once, at each shape."""
    for _, k_in, slices in SHAPES:
        lora, info = weights(k_in, slices), info_of(T, "1 adapter")
        x = torch.randn(T, k_in, device="cuda", dtype=DTYPE)
        y = torch.randn(T, sum(slices), device="cuda", dtype=DTYPE)
        for tiles in [None, *CANDIDATES]:
            try:
                add_lora_(y, x, lora, info, tiles=tiles)
            except Exception as e:  # a tile that does not compile (shared memory, registers)
                print(f"   {tiles}: {type(e).__name__}", flush=True)
    torch.cuda.synchronize()


def key(tiles: dict[str, int]) -> tuple:
    """(BT, CW, BK) and any launch options (maxnreg, num_stages) a candidate sets."""
    extra = tuple(f"{k} {v}" for k, v in tiles.items() if k not in ("BT", "CW", "BK"))
    return (tiles["BT"], tiles["CW"], tiles["BK"], *extra)


def today_options(meta: dict) -> dict:
    """add_lora_tiles' choice as a candidate: its tile and launch options."""
    return {k: meta[k] for k in ("BT", "CW", "BK", "maxnreg", "num_stages") if k in meta}


def launch_ms(y, x, lora, info, tiles: dict[str, int] | None) -> float:
    return do_bench(lambda: add_lora_(y, x, lora, info, tiles=tiles), warmup=25, rep=100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[512, 1024, 4096])
    parser.add_argument("--out", help="result file (default: a dated one in bench/results)")
    args = parser.parse_args()
    compile_all(args.rows[0])  # first, so no compile (and no clock drop) falls in a timing
    bandwidth = copy_bandwidth()
    lines = result_header("add_lora_ tiles at prefill rows, Qwen3-30B-A3B shape", bandwidth)
    lines += [
        f"- rank {RANK}, {SLOTS} slots, bf16; rows > PREFILL_ROWS={PREFILL_ROWS} take prefill "
        "tiles today",
        "",
        "| rows | proj | spread | today (BT, CW, BK, options) | today us "
        "| best (BT, CW, BK, options) | best us | today / best | floor us |",
        "|---:|---|---|---|---:|---|---:|---:|---:|",
    ]
    for T, (name, k_in, slices), spread in itertools.product(args.rows, SHAPES, SPREADS):
        lora = weights(k_in, slices)
        x = torch.randn(T, k_in, device="cuda", dtype=DTYPE)
        y = torch.randn(T, sum(slices), device="cuda", dtype=DTYPE)
        info = info_of(T, spread)
        today = add_lora_tiles(T, SLOTS, RANK, slices, multiprocessors(x.device))
        now = launch_ms(y, x, lora, info, None)
        times = {}
        for tiles in CANDIDATES:
            try:
                times[key(tiles)] = launch_ms(y, x, lora, info, tiles)
            except Exception as e:  # a tile that does not compile (shared memory, registers)
                print(f"   {tiles}: {type(e).__name__}", flush=True)
        best = min(times, key=times.get)
        floor = (x.numel() + 2 * y.numel()) * 2 / bandwidth * 1e6
        row = (
            f"| {T} | {name} | {spread} | {', '.join(map(str, key(today_options(today))))} | "
            f"{1e3 * now:.1f} | {', '.join(map(str, best))} | {1e3 * times[best]:.1f} | "
            f"{now / times[best]:.2f} | {floor:.1f} |"
        )
        lines.append(row)
        print(row, flush=True)
        ranked = sorted(times, key=times.get)[:5]
        print("   top:", [(k, round(1e3 * times[k], 1)) for k in ranked], flush=True)
    write_result("lora-tiles", lines, args.out)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
