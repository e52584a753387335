"""Where the host's time goes in one Engine.step(): B decode requests at long contexts (default
B = 256, 2048-token prompts), the Qwen3-30B-A3B shape with random weights, async scheduling on
and off. cProfile over a window of steps; each step's wall time and its share spent waiting for
the GPU (the event waits of the commit and the graph buffers), then the host functions that took
the most of the rest.

    PYTHONPATH=. python bench/host_step.py [--batch 256] [--context 2048] [--layers N] [--smoke]

--smoke: the demo's tiny shape on the CPU, B = 8 at 64 tokens (shows that the script runs).
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import pstats
import time

import torch
from common import model_folder, result_header, write_result

from moelora import LLM, SamplingParams

WAIT = "synchronize"  # in a function's name: waiting for the device, not host work
TOP = 14


def build(args: argparse.Namespace, *, async_on: bool) -> LLM:
    device = "cpu" if args.smoke else "cuda"
    folder = model_folder(args.layers, "tiny-qwen3-moe" if args.smoke else "qwen3-30b-a3b")
    pages = args.batch * (-(-(args.context + args.steps * 4 + 64) // 16)) + 64
    return LLM(
        folder,
        load_format="dummy",
        device=device,
        enable_lora=False,
        max_num_seqs=args.batch,
        max_graph_bs=args.batch,
        max_num_batched_tokens=16384,
        num_pages=pages,
        async_scheduling=async_on,
    )


def profile(llm: LLM, args: argparse.Namespace) -> tuple[float, float, list[str]]:
    """ms per step, ms of it waiting for the device, and the host's top functions."""
    engine = llm.engine
    vocab = engine.model_config.vocab_size
    params = SamplingParams(max_tokens=args.steps * 4 + 16, temperature=0, ignore_eos=True)
    gen = torch.Generator().manual_seed(0)
    for i in range(args.batch):
        prompt = torch.randint(0, vocab, (args.context,), generator=gen).tolist()
        engine.add_request(f"h{i}", prompt, params, None)
    while engine.stats().num_waiting or engine.scheduler.running[-1].num_outputs == 0:
        engine.step()
    for _ in range(4):
        engine.step()
    prof = cProfile.Profile()
    start = time.perf_counter()
    prof.enable()
    for _ in range(args.steps):
        engine.step()
    prof.disable()
    step_ms = (time.perf_counter() - start) * 1e3 / args.steps
    for i in range(args.batch):
        engine.abort_request(f"h{i}")
    stats = pstats.Stats(prof)
    wait_s = sum(v[2] for k, v in stats.stats.items() if WAIT in k[2])
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(TOP)
    lines = [line for line in text.getvalue().splitlines() if line.strip()]
    start_at = next(i for i, line in enumerate(lines) if line.lstrip().startswith("ncalls"))
    return step_ms, wait_s * 1e3 / args.steps, lines[start_at:]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--only-async", action="store_true", help="skip async_scheduling=False")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if args.smoke:
        args.batch, args.context, args.steps = 8, 64, 5
    device = "cpu" if args.smoke else "cuda"
    lines = result_header("Host time per Engine.step() at long contexts", None, device=device)
    lines += [f"B = {args.batch}, {args.context}-token prompts, {args.steps} decode steps", ""]
    for async_on in (True,) if args.only_async else (True, False):
        llm = build(args, async_on=async_on)
        step_ms, wait_ms, top = profile(llm, args)
        del llm  # two 30B engines do not fit the GPU at once
        gc.collect()
        torch.cuda.empty_cache() if torch.cuda.is_available() else None
        head = f"async_scheduling={async_on}: {step_ms:.2f} ms a step under cProfile"
        head += f", {wait_ms:.2f} ms of it waiting for the GPU, {step_ms - wait_ms:.2f} ms host"
        print(head)
        lines += [f"## {head}", "", "```", *top, "```", ""]
        path = write_result("host-step", lines, args.out)  # each mode's, as soon as it is known
        args.out = str(path)


if __name__ == "__main__":
    main()
