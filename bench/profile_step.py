"""Where a decode step's time goes: per-kernel GPU time of graph replays, per layer.

Builds one of bench/decode.py's shapes (Qwen3-30B-A3B unless --shape) with few layers, then
for each case prints every kernel's share of one replay (torch.profiler over bench/common.py's
PlannedStep.forward_fn, CUDA-graph replays of the forward alone). A diagnostic for choosing
what to fuse; bench/decode.py is the benchmark of record.

    PYTHONPATH=. python bench/profile_step.py --layers 4 [--shape moonlight-16b-a3b] [--fp8]
        [--trace REGEX] [--deterministic] [--batches 1 8 64]

--deterministic: the engines with --enable-deterministic-inference (where its cost goes).
--trace: also each launch of the kernels whose name matches REGEX in one replay, in launch
order with its time (which module a slow launch is, by its place in the layer).
"""

from __future__ import annotations

import argparse
import os
import re
from collections import defaultdict

import torch
from common import (
    MAX_LORAS,
    PlannedStep,
    add_random_adapters,
    decode_batch,
    make_engine,
    model_folder,
)
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from moelora.models.shapes import SHAPES

REPLAYS = 20


def kernel_events(step: PlannedStep) -> list:
    """The CUDA kernel events of REPLAYS replays of the batch's graph, in launch order."""
    assert step.uses_graph, "the batch has no graph"
    with torch.inference_mode():
        prof = _profile(step.forward_fn())
        if not any(ev.device_type == DeviceType.CUDA for ev in prof.events()):
            # this profiler does not see inside graphs: the eager forward of the same inputs
            prof = _profile(step.forward_fn(eager=True))
    events = [ev for ev in prof.events() if ev.device_type == DeviceType.CUDA]
    return sorted(events, key=lambda ev: ev.time_range.start)


def kernel_table(events: list, layers: int) -> list[tuple[str, float, float]]:
    """[(kernel, calls per layer, µs per layer)] of the events, largest first."""
    total, calls = defaultdict(float), defaultdict(int)
    for ev in events:
        total[ev.name[:60]] += ev.device_time
        calls[ev.name[:60]] += 1
    per = REPLAYS * layers
    return sorted(((n, calls[n] / per, total[n] / per) for n in total), key=lambda r: -r[2])


def print_trace(events: list, pattern: str) -> None:
    """Each launch of one replay whose kernel matches the pattern, in order, with its µs."""
    matched = [ev for ev in events if re.search(pattern, ev.name)]
    for i, ev in enumerate(matched[: len(matched) // REPLAYS]):
        print(f"    {i:3d}  {ev.device_time:8.2f} µs  {ev.name[:60]}")


def _profile(forward):
    for _ in range(5):
        forward()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(REPLAYS):
            forward()
        torch.cuda.synchronize()
    return prof


def print_table(step: PlannedStep, layers: int, title: str, trace: str | None) -> None:
    events = kernel_events(step)
    rows = kernel_table(events, layers)
    tot = sum(r[2] for r in rows)
    print(f"\n## {title}: {tot:.1f} µs kernel time per layer")
    for name, c, us in rows[:16]:
        print(f"  {us:7.2f} µs  x{c:4.2f}  {name}")
    if trace:
        print(f"  launches matching {trace!r}, one replay:")
        print_trace(events, trace)


def cycled(names: list[str]):
    """B requests' adapters: names in turn."""
    return lambda B: [names[i % len(names)] for i in range(B)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--shape", choices=list(SHAPES), default="qwen3-30b-a3b")
    parser.add_argument(
        "--pdl",
        action="store_true",
        help="keep programmatic dependent launch on (its kernels start early and wait inside, "
        "so their times include the wait for the kernel before: off by default)",
    )
    parser.add_argument("--trace", metavar="REGEX", help="each launch of these kernels, in order")
    parser.add_argument(
        "--deterministic", action="store_true", help="--enable-deterministic-inference's engines"
    )
    parser.add_argument("--fp8", action="store_true", help="block-FP8 weights (bench/decode.py's)")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    args = parser.parse_args()
    if not args.pdl:
        os.environ["MOELORA_PDL"] = "0"  # read at the first launch (kernels/pdl.py)
    folder = model_folder(args.layers, args.shape, fp8=args.fp8)
    for lora in (False, True):
        engine = make_engine(folder, lora=lora, max_bs=64, deterministic=args.deterministic)
        cases = [("base", lambda B: [None] * B)]
        if lora:
            cases.append(("8 distinct", cycled(add_random_adapters(engine, MAX_LORAS))))
            if any(key.endswith(".kv_b") for key in engine.lora_targets):
                # MLA: the same adapters without kv_b_proj's (what its correction costs)
                plain = add_random_adapters(engine, MAX_LORAS, without="kv_b", prefix="n")
                cases.append(("8 distinct, no kv_b", cycled(plain)))
        for case, loras in cases:
            for B in args.batches:
                step = decode_batch(engine, B, loras(B))
                print_table(step, args.layers, f"lora={lora} {case} B={B}", args.trace)
                for request_id in step.request_ids:
                    engine.abort_request(request_id)
        del engine
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
