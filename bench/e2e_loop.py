"""The end-to-end workload again and again, each run a fresh process: does any run crash?

One run builds an engine with LoRA disabled and runs 256 x (512 in, 128 out) random-token
prompts through `LLM.generate` (greedy, ignore_eos), closes it, then builds one with 8 random
rank-16 adapters on every attention and expert projection and runs the same workload with
request i on adapter i % 8; both engines capture decode graphs up to 256 and take 8192 tokens a
step, their KV cache what gpu_memory_utilization leaves (the path a user's engine takes). A run
passes when its process exits 0 with every token generated; a signal (a segfault in a kernel
launch) or an error fails it. `--cycles K` builds and closes the two engines K times in each
run's one process. `--cold-cache` gives each run a Triton cache of its own, empty, so each
engine build compiles every kernel in its warm-up (both crashes seen so far came in builds);
`--concurrent-warmup` warms every graph size at once, a thread each (EngineConfig), for an A/B
against the default, one size after another.

    PYTHONPATH=. python bench/e2e_loop.py [--runs N] [--cycles K] [--layers L] [--cold-cache]
        [--concurrent-warmup] [--smoke]

The figure is a count (runs that passed); each run's build and generate times and its tokens
per second are printed beside it, with no floor: this is a reliability check, bench/e2e.py
measures speed. --smoke: the tiny shape on the CPU, a few prompts (figures mean nothing).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import torch
from common import (
    MAX_LORAS,
    RANK,
    model_folder,
    random_weights_llm,
    result_header,
    sync,
    write_result,
)

from moelora import SamplingParams


@dataclass(frozen=True)
class Setup:
    shape: str
    layers: int | None
    device: str
    dtype: str
    prompts: int
    input_len: int
    output_len: int
    max_num_seqs: int  # and max_graph_bs
    max_num_batched_tokens: int
    rank: int
    enforce_eager: bool = False
    gpu_memory_utilization: float = 0.9
    concurrent_warmup: bool = False  # EngineConfig.concurrent_warmup


FULL = Setup("qwen3-30b-a3b", 48, "cuda", "bfloat16", 256, 512, 128, 256, 8192, RANK)
SMOKE = Setup("tiny-qwen3-moe", None, "cpu", "float32", 6, 16, 4, 8, 64, 4)


# ---- one run (a child process) ------------------------------------------------------------


def one_engine(setup: Setup, folder: str, *, lora: bool) -> dict:
    """Build, warm, run the workload, close; what it took."""
    start = time.perf_counter()
    llm, names = random_weights_llm(
        folder,
        lora=lora,
        rank=setup.rank,
        max_num_seqs=setup.max_num_seqs,
        device=setup.device,
        dtype=setup.dtype,
        max_num_batched_tokens=setup.max_num_batched_tokens,
        max_model_len=setup.input_len + setup.output_len,
        enforce_eager=setup.enforce_eager,
        gpu_memory_utilization=setup.gpu_memory_utilization,
        concurrent_warmup=setup.concurrent_warmup,
    )
    with llm:
        built = time.perf_counter() - start
        vocab = llm.engine.model_config.vocab_size
        gen = torch.Generator().manual_seed(1)
        prompts = torch.randint(0, vocab, (setup.prompts, setup.input_len), generator=gen).tolist()
        loras = [names[i % len(names)] if names else None for i in range(setup.prompts)]
        params = SamplingParams(max_tokens=setup.output_len, temperature=0, ignore_eos=True)
        start = time.perf_counter()
        outs = llm.generate(prompts, params, lora=loras)
        sync(setup.device)
        seconds = time.perf_counter() - start
    tokens = sum(len(o.token_ids) for o in outs)
    if tokens != setup.prompts * setup.output_len:
        raise AssertionError(f"{tokens} tokens, expected {setup.prompts * setup.output_len}")
    return {"lora": lora, "build_s": built, "generate_s": seconds, "tokens": tokens}


def child(setup: Setup, cycles: int) -> None:
    folder = model_folder(setup.layers, setup.shape)
    for cycle in range(cycles):
        for lora in (False, True):
            record = one_engine(setup, folder, lora=lora)
            print("RESULT " + json.dumps({"cycle": cycle, **record}), flush=True)


# ---- the loop -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Run:
    index: int
    returncode: int
    seconds: float
    records: list[dict]
    tail: str

    @property
    def passed(self) -> bool:
        return self.returncode == 0

    def verdict(self) -> str:
        if self.returncode < 0:
            return f"killed by {signal.Signals(-self.returncode).name}"
        return "passed" if self.passed else f"exit {self.returncode}"


def run_child(index: int, args: argparse.Namespace) -> Run:
    # faulthandler: a crash prints every thread's Python stack, which says what was launching
    cmd = [sys.executable, "-X", "faulthandler", __file__, "--child", *args.setup_argv]
    env = os.environ.copy()
    if args.cold_cache:  # every kernel compiles again: the build's warm-up at its busiest
        env["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix=f"moelora-loop-{index}-triton-")
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if args.cold_cache:
        shutil.rmtree(env["TRITON_CACHE_DIR"], ignore_errors=True)
    seconds = time.perf_counter() - start
    out = proc.stdout + proc.stderr
    records = [json.loads(x[7:]) for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    run = Run(index, proc.returncode, seconds, records, "\n".join(out.splitlines()[-15:]))
    print(f"run {index}: {run.verdict()} in {seconds:.0f} s", flush=True)
    if not run.passed:
        print(run.tail, flush=True)
    return run


def report(setup: Setup, args: argparse.Namespace, runs: list[Run]) -> list[str]:
    passed = sum(r.passed for r in runs)
    lines = result_header(
        f"End-to-end loop: {passed} of {len(runs)} runs passed, {setup.shape} shape "
        "(random weights), each run a fresh process",
        None,
        device=setup.device,
    )
    lines += [
        f"- a run: {args.cycles} x (an engine with LoRA disabled, then one with {MAX_LORAS} "
        f"random rank-{setup.rank} adapters), each running {setup.prompts} x "
        f"({setup.input_len} in, {setup.output_len} out) by LLM.generate, then closed",
        f"- engines: {setup.layers or 'all'} layers, {setup.dtype}, max_num_seqs = "
        f"max_graph_bs = {setup.max_num_seqs}, max_num_batched_tokens "
        f"{setup.max_num_batched_tokens}, KV pages by gpu_memory_utilization "
        f"{setup.gpu_memory_utilization}{', eager (no graphs)' if setup.enforce_eager else ''}"
        f"{', graph sizes warmed all at once' if setup.concurrent_warmup else ''}",
        f"- Triton's cache: {'a fresh one each run' if args.cold_cache else 'the machine one'}",
        "- build s: LLM() and its adapters; tok/s: output tokens over LLM.generate's seconds",
        "",
        "| run | verdict | s | cycle | LoRA | build s | generate s | output tok/s |",
        "|---:|---|---:|---:|---|---:|---:|---:|",
    ]
    for run in runs:
        for r in run.records or [None]:
            cells = ["", "", "", "", ""]
            if r is not None:
                cells = [
                    str(r["cycle"]),
                    "8 adapters" if r["lora"] else "disabled",
                    f"{r['build_s']:.1f}",
                    f"{r['generate_s']:.2f}",
                    f"{r['tokens'] / r['generate_s']:.0f}",
                ]
            lines.append(
                f"| {run.index} | {run.verdict()} | {run.seconds:.0f} | {' | '.join(cells)} |"
            )
    for run in runs:
        if not run.passed:
            lines += ["", f"run {run.index}'s last lines:", "", "```", run.tail, "```"]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=10, help="fresh processes, one after another")
    parser.add_argument("--cycles", type=int, default=1, help="engine pairs in each process")
    parser.add_argument("--layers", type=int, help="layers of the shape (default: all)")
    parser.add_argument("--prompts", type=int, help="requests of the workload (default 256)")
    parser.add_argument("--input-len", type=int, help="prompt tokens (default 512)")
    parser.add_argument("--output-len", type=int, help="output tokens (default 128)")
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    parser.add_argument(
        "--concurrent-warmup", action="store_true", help="graph sizes warmed all at once"
    )
    parser.add_argument(
        "--cold-cache", action="store_true", help="each run a fresh TRITON_CACHE_DIR"
    )
    parser.add_argument("--gpu-memory-utilization", type=float, help="default 0.9")
    parser.add_argument("--smoke", action="store_true", help="the tiny shape on the CPU")
    parser.add_argument("--out", help="result file (default: a dated one in bench/results)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    setup = SMOKE if args.smoke else FULL
    given = {
        name: getattr(args, name)
        for name in ("layers", "prompts", "input_len", "output_len", "gpu_memory_utilization")
        if getattr(args, name)
    }
    setup = dataclasses.replace(
        setup,
        enforce_eager=args.enforce_eager,
        concurrent_warmup=args.concurrent_warmup,
        **given,
    )
    # a child gets the same setup: each given field, the mode flags, its cycles
    args.setup_argv = ["--cycles", str(args.cycles)]
    for name, value in given.items():
        args.setup_argv += ["--" + name.replace("_", "-"), str(value)]
    args.setup_argv += [
        f
        for f in ("--enforce-eager", "--concurrent-warmup", "--smoke")
        if getattr(args, f[2:].replace("-", "_"))
    ]
    if args.child:
        child(setup, args.cycles)
        return
    runs = [run_child(i, args) for i in range(args.runs)]
    lines = report(setup, args, runs)
    write_result("e2e-loop", lines, args.out, smoke=args.smoke)
    print("\n".join(lines))
    sys.exit(0 if all(r.passed for r in runs) else 1)


if __name__ == "__main__":
    main()
