"""The MoE align (kernels/moe/align.py) against its bytes floor, at decode and prefill sizes.

Qwen3-30B-A3B routing (E = 128, top-8): P = T x 8 pairs for T = 64, 512, 4096, 8192, 16384 (P =
512 .. 128K: the one-launch path up to PMAX pairs, the chunked one past it), BM the MoE's tuned
block_m at T tokens (moe_config.default_config), or each of --bms. Cases:
  - align: moe_align alone;
  - shrink none: fused_moe's align launch with the MoE LoRA recorded, no slot active;
  - shrink distinct: the same with every token on one of 8 rank-16 adapters.
REPS aligns are captured in one CUDA graph and replayed (triton's do_bench, median, L2 flushed
before each replay); the figure is one align's share. The floor is the bytes an align must move
(ids read, sorted_pair and expert_of_block written; with active adapters also x rows and the
touched A13 rows read and xa13 written) over the D2D copy bandwidth measured in the same run.

    PYTHONPATH=.:bench python bench/align.py [--tokens 64 4096] [--bms 16 64] [--out PATH]
    PYTHONPATH=.:bench python bench/align.py --smoke   # CPU, Triton interpreter: does it run
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from collections.abc import Callable
from functools import partial

import torch
from common import DEV, batch_info, copy_bandwidth, graph_ms, lora_pool, result_header, write_result

from moelora.kernels import reference
from moelora.kernels.moe.align import align_plan, align_reference, moe_align, num_blocks
from moelora.kernels.moe.config import default_config
from moelora.kernels.moe.fused import fused_moe_align
from moelora.step.lora import LoraBatchInfo

E, H, I, K = 128, 2048, 768, 8
TOKENS = (64, 512, 4096, 8192, 16384)
RANK = 16
REPS = 20  # aligns a graph replay runs
TARGET_US = {65536: 30.0}  # issue 19: the align at 8192 tokens x top-8


def align_bytes(P: int, NB: int, BM: int) -> int:
    """ids read, sorted_pair and expert_of_block written (int32 each)."""
    return 4 * (P + NB * BM + NB)


def shrink_bytes(ids: torch.Tensor, info: LoraBatchInfo, hidden: int) -> int:
    """x rows of tokens with an enabled slot and the (slot, expert) A13 rows they touch, read;
    their pairs' xa13 (2 x RANK fp32) and zeroed xa2 (RANK fp32) written."""
    slot = info.slot_of_token.long()
    on = (slot >= 0) & (info.slot_enabled.long()[slot.clamp(min=0)] > 0)
    pairs_on = ids[on].long()
    combos = torch.unique(slot[on][:, None] * 100_000 + pairs_on).numel()
    reads = int(on.sum()) * hidden * 2 + combos * 2 * RANK * hidden * 2
    return reads + pairs_on.numel() * 3 * RANK * 4


def cases(T: int, BM: int, device: str, hidden: int, inter: int) -> list[tuple[str, Callable, int]]:
    """(case, one align, bytes beyond the align's own) for T tokens at block BM."""
    torch.manual_seed(T)
    x = torch.randn(T, hidden, dtype=torch.bfloat16, device=device)
    weights, ids = reference.route_topk(torch.randn(T, E, device=device), K, renormalize=True)
    lora13, lora2 = lora_pool(E, hidden, inter, RANK, RANK, device=device)
    out = [("align", lambda: moe_align(ids, E, BM), 0)]
    for spread in ("none", "distinct"):
        info = batch_info(T, spread, RANK, device=device)
        kw = dict(E=E, BM=BM, lora13=lora13, lora2=lora2, info=info)
        extra = 0 if spread == "none" else shrink_bytes(ids, info, hidden)
        out.append((f"shrink {spread}", partial(fused_moe_align, x, weights, ids, **kw), extra))
    return out


def path(P: int, BM: int) -> str:
    NA, meta = align_plan(P, num_blocks(P, E, BM), E=E, BM=BM)
    kind = f"chunked CB={meta['CB']}" if meta["CHUNKED"] else "one launch"
    return f"{kind}, {NA} programs"


def bench(tokens: list[int], bms: list[int] | None, bw: float) -> list[dict]:
    rows = []
    for T in tokens:
        P = T * K
        for BM in bms or [default_config(T, E, H, I, K, torch.device(DEV)).block_m]:
            floor = align_bytes(P, num_blocks(P, E, BM), BM)
            for case, fn, extra in cases(T, BM, DEV, H, I):
                ms = graph_ms(lambda fn=fn: [fn() for _ in range(REPS)], REPS)
                row = dict(P=P, T=T, BM=BM, path=path(P, BM), case=case, us=ms * 1e3)
                row.update(floor_us=1e6 * (floor + extra) / bw)
                rows.append(row)
                print(row, flush=True)
            torch.cuda.empty_cache()
    return rows


def table(rows: list[dict]) -> list[str]:
    out = [
        "| P | T | BM | path | case | µs | floor µs | % of floor |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        out.append(
            f"| {r['P']} | {r['T']} | {r['BM']} | {r['path']} | {r['case']} | {r['us']:.1f} | "
            f"{r['floor_us']:.2f} | {100 * r['floor_us'] / r['us']:.0f}% |"
        )
    return out


def targets(rows: list[dict]) -> list[str]:
    out = []
    for r in rows:
        if r["case"] == "align" and r["P"] in TARGET_US:
            limit = TARGET_US[r["P"]]
            ok = "ok" if r["us"] <= limit else "MISSED"
            out.append(f"- align at P={r['P']}, BM={r['BM']}: {r['us']:.1f} µs (<= {limit}: {ok})")
    return out


def smoke() -> None:
    """On the CPU, in the interpreter: both paths (pmax lowered) and the shrink case run, and the
    align matches align_reference. Times are the interpreter's, not the kernel's."""
    assert os.environ.get("TRITON_INTERPRET") == "1"
    for T, pmax in ((4, None), (40, 64)):
        P, BM = T * K, 16
        ids = torch.randint(0, E, (T, K), dtype=torch.int32)
        start = time.perf_counter()
        got = moe_align(ids, E, BM, pmax=pmax)
        expect = align_reference(ids, E, BM, num_blocks(P, E, BM))
        assert torch.equal(got[0], expect[0]) and torch.equal(got[1], expect[1]), (T, pmax)
        print(f"align P={P} pmax={pmax}: ok, {time.perf_counter() - start:.1f} s interpreted")
    for case, fn, _ in cases(4, 16, "cpu", 64, 32)[1:]:
        start = time.perf_counter()
        fn()
        print(f"{case} P={4 * K}: ran, {time.perf_counter() - start:.1f} s interpreted")
    print("smoke ok")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", nargs="+", type=int, default=list(TOKENS))
    parser.add_argument("--bms", nargs="+", type=int, help="block sizes (default: the tuned one)")
    parser.add_argument("--out", help="result file (default: a dated one in bench/results)")
    parser.add_argument("--smoke", action="store_true", help="CPU, interpreter, tiny sizes")
    args = parser.parse_args()
    if args.smoke:
        if os.environ.get("TRITON_INTERPRET") != "1":  # kernels read it when decorated: rerun
            env = {**os.environ, "TRITON_INTERPRET": "1"}
            sys.exit(subprocess.call([sys.executable, *sys.argv], env=env))
        return smoke()
    bw = copy_bandwidth()
    rows = bench(args.tokens, args.bms, bw)
    lines = result_header(f"MoE align, E={E}, top-{K}, {REPS} a graph", bw)
    lines += ["", "## All cases", "", *table(rows), "", "## Targets", "", *targets(rows)]
    write_result("align", lines, args.out)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
