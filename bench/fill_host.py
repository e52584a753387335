"""Where the engine thread's time in a slot fill goes (issue 41): a fill's copies come from
page-locked host memory on a stream of their own, so the thread should return long before the
copy lands; bench/adapters.py measured it holding the thread for about the copy's own time.

On one engine of the Qwen3-30B-A3B shape (--layers, default 8; eager, two slots, rank 16):

- the adapter's tensors: page-locked, contiguous, of the slot's dtype (each a condition of an
  asynchronous copy_);
- ModelRunner.fill_slot: the thread's time against the time until its event completes;
- the same tensors copied by plain copy_ (non_blocking, a side stream) into device tensors of
  their own shapes, and one page-locked buffer of the same bytes copied once: the floor;
- one fill under torch.cuda.set_sync_debug_mode("warn") (a synchronising call warns, with its
  stack) and under torch.profiler (the host calls that took the time).

    PYTHONPATH=.:bench python bench/fill_host.py [--layers N] [--out PATH]
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
import warnings

import torch
from common import model_folder, write_result

from moelora.config import EngineConfig
from moelora.engine.engine import Engine
from moelora.lora.adapter import LoraAdapter, random_adapter

REPS = 5


def timed(fn, stream: torch.cuda.Stream) -> tuple[float, float]:
    """(ms the host spent in fn, ms until the stream's work of it completed)."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    host = time.perf_counter() - start
    stream.synchronize()
    return host * 1e3, (time.perf_counter() - start) * 1e3


def medians(pairs: list[tuple[float, float]]) -> str:
    host, done = statistics.median(p[0] for p in pairs), statistics.median(p[1] for p in pairs)
    return f"{host:.2f} | {done:.2f}"


def build(layers: int) -> Engine:
    return Engine(
        EngineConfig(
            model=model_folder(layers, "qwen3-30b-a3b"),
            load_format="dummy",
            max_loras=2,
            max_lora_rank=16,
            enforce_eager=True,
            max_num_seqs=4,
            max_model_len=256,
            num_pages=64,
        )
    )


def timings(runner, adapter: LoraAdapter) -> list[str]:
    """The fill, the plain copies of its tensors, one buffer of its bytes: host and done ms."""
    tensors = [t for m in adapter.modules.values() for t in (m.a, m.b)]
    stream, side = runner.copy_stream, torch.cuda.Stream()
    fills = [
        timed(functools.partial(runner.fill_slot, rep % 2, adapter), stream) for rep in range(REPS)
    ]
    dsts = [torch.empty_like(t, device="cuda") for t in tensors]

    def plain() -> None:
        with torch.cuda.stream(side):
            for d, t in zip(dsts, tensors):
                d.copy_(t, non_blocking=True)

    big = torch.empty(adapter.nbytes, dtype=torch.uint8, pin_memory=True)
    big_dst = torch.empty(adapter.nbytes, dtype=torch.uint8, device="cuda")

    def one() -> None:
        with torch.cuda.stream(side):
            big_dst.copy_(big, non_blocking=True)

    return [
        "| what | host ms | done ms |",
        "|---|---:|---:|",
        f"| ModelRunner.fill_slot | {medians(fills)} |",
        f"| plain copy_ of each tensor | {medians([timed(plain, side) for _ in range(REPS)])} |",
        f"| one buffer, one copy_ | {medians([timed(one, side) for _ in range(REPS)])} |",
    ]


def diagnosis(runner, adapter: LoraAdapter) -> list[str]:
    """Synchronising calls in one fill (their messages), and its host calls by self time."""
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        runner.fill_slot(0, adapter)
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    lines = ["", f"Synchronising calls in one fill: {len(caught)}", ""]
    lines += [f"- {w.message}" for w in caught[:5]]
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        runner.fill_slot(1, adapter)
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12)
    return lines + ["", "One fill under torch.profiler, by self CPU time:", "", "```", table, "```"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--out")
    args = parser.parse_args()
    engine = build(args.layers)
    adapter = random_adapter(
        "probe",
        engine.lora_targets,
        rank=16,
        seed=0,
        dtype=torch.bfloat16,
        device="cuda",
        store="cpu",
    ).pinned()
    tensors = [t for m in adapter.modules.values() for t in (m.a, m.b)]
    dtypes = sorted({str(t.dtype) for t in tensors})
    lines = [f"# Slot fill on the host, qwen3-30b-a3b shape, {args.layers} layers", ""]
    lines += [
        f"- tensors: {len(tensors)}, {adapter.nbytes / 2**30:.3f} GiB; pinned "
        f"{sum(t.is_pinned() for t in tensors)}, contiguous "
        f"{sum(t.is_contiguous() for t in tensors)}, dtypes {dtypes}",
        f"- copy stream: {engine.runner.copy_stream}",
        "",
    ]
    lines += timings(engine.runner, adapter) + diagnosis(engine.runner, adapter)
    engine.close()
    write_result("fill-host", lines, args.out)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
