"""Where a decode step's time goes: per-kernel GPU time of graph replays, per layer.

Builds the Qwen3-30B-A3B shape of bench/decode.py with few layers, then for each case prints
every kernel's share of one replay (torch.profiler over CUDA-graph replays). A diagnostic for
choosing what to fuse; bench/decode.py is the benchmark of record.

  PYTHONPATH=.:tests python3 bench/profile_step.py --layers 4
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from collections import defaultdict
from pathlib import Path

import torch
from decode import QWEN3_30B_A3B, decode_batch, make_engine, random_adapter
from torch.profiler import ProfilerActivity, profile

from moelora.runner.graph_runner import STREAM_IDX, padded_batch_size

REPLAYS = 20


def kernel_table(engine, batch, layers: int) -> list[tuple[str, float, float]]:
    """[(kernel, calls per layer, µs per layer)] of the batch's graph replay, largest first."""
    runner = engine.runner
    with torch.inference_mode():
        runner.graphs.run(batch)
        graph = runner.graphs.graphs[
            (padded_batch_size(batch.num_tokens, runner.graphs.sizes), STREAM_IDX)
        ]
        for _ in range(5):
            graph.replay()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(REPLAYS):
                graph.replay()
            torch.cuda.synchronize()
        if not any(ev.device_type == torch.autograd.DeviceType.CUDA for ev in prof.events()):
            # this profiler does not see inside graphs: time the eager forward instead
            device_batch = batch.to_device(runner.device, engine.slot_pool)
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(REPLAYS):
                    engine.model(device_batch, runner.kv_caches)
                torch.cuda.synchronize()
    total, calls = defaultdict(float), defaultdict(int)
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            total[ev.name[:60]] += ev.device_time
            calls[ev.name[:60]] += 1
    per = REPLAYS * layers
    return sorted(((n, calls[n] / per, total[n] / per) for n in total), key=lambda r: -r[2])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument(
        "--pdl",
        action="store_true",
        help="keep programmatic dependent launch on (its kernels start early and wait inside, "
        "so their times include the wait for the kernel before: off by default)",
    )
    args = parser.parse_args()
    if not args.pdl:
        os.environ["MOELORA_PDL"] = "0"  # read at the first launch (kernels/pdl.py)
    folder = tempfile.mkdtemp()
    Path(folder, "config.json").write_text(
        json.dumps({**QWEN3_30B_A3B, "num_hidden_layers": args.layers})
    )
    for lora in (False, True):
        engine = make_engine(folder, lora=lora, eager=False, max_bs=64)
        names = [f"a{i}" for i in range(8)]
        for i, n in enumerate(names if lora else []):
            engine.adapters[n] = random_adapter(engine, n, seed=i)
        cases = [("base", lambda B: [None] * B)]
        if lora:
            cases.append(("8 distinct", lambda B, names=names: [names[i % 8] for i in range(B)]))
        for case, loras in cases:
            for B in (1, 8, 64):
                plan, batch = decode_batch(engine, B, loras(B))
                rows = kernel_table(engine, batch, args.layers)
                tot = sum(r[2] for r in rows)
                print(f"\n## lora={lora} {case} B={B}: {tot:.1f} µs kernel time per layer")
                for name, c, us in rows[:16]:
                    print(f"  {us:7.2f} µs  x{c:4.2f}  {name}")
                for c in plan.chunks:
                    engine.abort_request(c.request.request_id)
        del engine
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
