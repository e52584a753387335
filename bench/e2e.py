"""End to end through the public API: time per output token (TPOT) and offline throughput of the
whole engine, async scheduling on and off, on a Qwen3-30B-A3B shape with random weights.

- TPOT at B = 1, 8, 64, 256: B requests of 128 random prompt tokens go to the engine of an `LLM`
  and are prefilled; then `Engine.step()` is called as a user's loop calls it, and the wall
  time of one step (the device synchronised at both ends of a window of steps; the median of
  the windows) is the TPOT. Beside it: the same batch's graph replay + lm_head
  (`plan_step(engine).logits_fn()`, bench/common.py, do_bench, as bench/decode.py times it) and
  its memory floor; host share = (step - replay) / step, what a step spends outside its
  forward: host work the GPU waits for, input copies, sampling.
- offline throughput: `LLM.generate` of 256 x (512 in, 128 out) and 1024 x (128 in, 512 out)
  random token prompts, greedy, ignore_eos.
- cases, as bench/decode.py's: LoRA disabled; enabled with base-only requests; 8 distinct
  rank-16 adapters (`LLM.add_random_lora`) on attention and every expert (throughput: LoRA
  disabled only, unless --throughput-cases says more).
- structured outputs (an engine of its own: its model folder has a tokenizer, random, of the
  shape's vocabulary, which the other cases' engines do without): TPOT as above, 8 distinct
  adapters, temperature 1, of B free requests; B requests constrained to a 10-field JSON schema;
  B free and B constrained in one batch; and 2B free. constrained / free > 1: what the grammar
  masks cost a step (the async design fills them while the step's forward runs).
Each LoRA setting's engine is built twice in this one process, async_scheduling on, then off
(graphs captured once per engine), and everything is measured on each.

    PYTHONPATH=. python bench/e2e.py [--quick | --smoke] [--layers N] [--fp8] [--out PATH]
        [--no-structured]

--quick: B = 1 and 64, one 64 x (512 in, 128 out) workload, LoRA disabled and 8 distinct.
--fp8: the shape's config with the block-FP8 quantization_config: the experts e4m3 codes and a
float32 scale per 128x128 block where the engine's kernels keep them FP8, else dequantized to
bf16 at load, as the result's title says (common.built_experts); the floor counts them as held.
--smoke: the tiny demo shape on the CPU, a few steps: shows that the script runs end to end;
its figures mean nothing (written to a temporary file unless --out).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from common import (
    MAX_LORAS,
    RANK,
    adapters_of,
    built_experts,
    capture_seconds,
    copy_bandwidth,
    floor_bytes,
    held_experts,
    model_folder,
    plan_step,
    random_weights_llm,
    result_header,
    sync,
    time_step,
    write_random_tokenizer,
    write_result,
)

from moelora import LLM, SamplingParams
from moelora.engine.engine import Engine
from moelora.sampling_params import StructuredOutputsParams
from moelora.step.batch import pages_for

CASES = ("disabled", "base-only", "8 distinct")
WARM_STEPS = 3  # decode steps after the prefill before any is timed (async: the pipeline fills)
PAGE_SIZE = 16
REPLAY = (  # how replay ms was timed: on the CPU, on CUDA
    "eager forward + lm_head, the median of 3 calls by the wall clock (no graphs on the CPU)",
    "CUDA-graph replay + lm_head (plan_step(engine).logits_fn(), do_bench median, L2 flushed)",
)


@dataclass(frozen=True)
class Workload:
    prompts: int
    input_len: int
    output_len: int

    def __str__(self) -> str:
        return f"{self.prompts} x ({self.input_len} in, {self.output_len} out)"


@dataclass(frozen=True)
class Setup:
    """What one run measures, and the sizes of the engines it builds for it."""

    shape: str  # moelora.models.shapes
    layers: int | None  # None: the shape's
    device: str
    dtype: str
    batches: tuple[int, ...]  # TPOT batch sizes
    prompt_len: int  # TPOT prompt tokens
    steps: int  # timed decode steps in one window
    windows: int  # windows per batch size; the TPOT is their median
    workloads: tuple[Workload, ...]
    cases: tuple[str, ...]
    throughput_cases: tuple[str, ...]
    rank: int
    max_num_seqs: int  # and max_graph_bs: every decode batch replays a graph
    max_num_batched_tokens: int  # vLLM's default for offline use on an H100/H200
    structured_B: int = 64  # constrained requests, beside as many free ones (0: not measured)

    @property
    def max_model_len(self) -> int:
        tpot = self.prompt_len + WARM_STEPS + self.steps * self.windows + 4
        return max(tpot, *(w.input_len + w.output_len for w in self.workloads))

    @property
    def num_pages(self) -> int:
        return self.max_num_seqs * pages_for(self.max_model_len, PAGE_SIZE) + 16


FULL = Setup(
    shape="qwen3-30b-a3b",
    layers=48,
    device="cuda",
    dtype="bfloat16",
    batches=(1, 8, 64, 256),
    prompt_len=128,
    steps=32,
    windows=3,
    workloads=(Workload(256, 512, 128), Workload(1024, 128, 512)),
    cases=CASES,
    throughput_cases=("disabled",),
    rank=RANK,
    max_num_seqs=256,
    max_num_batched_tokens=16384,
)
QUICK = dataclasses.replace(
    FULL,
    batches=(1, 64),
    windows=2,
    workloads=(Workload(64, 512, 128),),
    cases=("disabled", "8 distinct"),
    max_num_seqs=64,
)
SMOKE = Setup(
    shape="tiny-qwen3-moe",
    layers=None,
    device="cpu",
    dtype="float32",
    batches=(1, 4),
    prompt_len=16,
    steps=3,
    windows=1,
    workloads=(Workload(4, 16, 4), Workload(6, 8, 5)),
    cases=CASES,
    throughput_cases=("disabled", "8 distinct"),
    rank=4,
    max_num_seqs=8,
    max_num_batched_tokens=64,
    structured_B=4,
)
# ten fields of every kind; the lengths keep a request decoding through the timed windows
STRUCTURED_SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0},
        "name": {"type": "string", "minLength": 16, "maxLength": 32},
        "email": {"type": "string", "minLength": 16, "maxLength": 48},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "country": {"enum": ["FR", "DE", "IT", "ES", "PT"]},
        "active": {"type": "boolean"},
        "score": {"type": "number"},
        "tags": {
            "type": "array",
            "items": {"type": "string", "minLength": 8, "maxLength": 16},
            "minItems": 4,
            "maxItems": 8,
        },
        "address": {
            "type": "object",
            "properties": {
                "street": {"type": "string", "minLength": 16},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["street", "zip"],
        },
        "notes": {"type": "string", "minLength": 64, "maxLength": 128},
    },
    "required": [
        "id",
        "name",
        "email",
        "age",
        "country",
        "active",
        "score",
        "tags",
        "address",
        "notes",
    ],
}
STRUCTURED_MIXES = ("B free", "B constrained", "B free + B constrained", "2B free")


@dataclass(frozen=True)
class Tpot:
    case: str
    B: int
    async_on: bool
    step_ms: float  # Engine.step(), wall clock
    replay_ms: float  # graph replay + lm_head (eager on the CPU)
    floor_ms: float | None  # None without a measured bandwidth (the CPU) or with async off

    @property
    def host_share(self) -> float:
        return (self.step_ms - self.replay_ms) / self.step_ms


@dataclass(frozen=True)
class Throughput:
    case: str
    workload: Workload
    async_on: bool
    seconds: float
    output_tokens: int

    @property
    def total_tokens(self) -> int:
        return self.output_tokens + self.workload.prompts * self.workload.input_len


@dataclass(frozen=True)
class StructuredTpot:
    mix: str  # one of STRUCTURED_MIXES
    num_free: int
    num_constrained: int
    step_ms: float  # Engine.step(), wall clock


@dataclass(frozen=True)
class Build:
    lora: bool
    async_on: bool
    seconds: float  # LLM(...) and its random adapters
    capture: tuple[float, float]  # graph capture s, of it the warm-up s
    experts: str  # how the engine holds the experts (common.built_experts)


# ---- engines ----------------------------------------------------------------------------


def build(setup: Setup, folder: str, *, lora: bool, async_on: bool) -> tuple[LLM, list[str]]:
    """The LLM every figure goes through, and its random adapters' names (LoRA enabled)."""
    return random_weights_llm(
        folder,
        lora=lora,
        rank=setup.rank,
        max_num_seqs=setup.max_num_seqs,
        device=setup.device,
        dtype=setup.dtype,
        max_num_batched_tokens=setup.max_num_batched_tokens,
        max_model_len=setup.max_model_len,
        page_size=PAGE_SIZE,
        num_pages=setup.num_pages,
        async_scheduling=async_on,
    )


def random_prompts(vocab: int, count: int, length: int, *, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (count, length), generator=gen).tolist()


# ---- TPOT -------------------------------------------------------------------------------


def measure_tpot(
    llm: LLM, setup: Setup, case: str, B: int, names: list[str], bw: float | None
) -> Tpot:
    """B requests prefilled, then timed Engine.step() windows, then the same batch planned
    (plan_step) and its replay + lm_head timed; the requests are aborted at the end."""
    engine = llm.engine
    prompts = random_prompts(engine.model_config.vocab_size, B, setup.prompt_len, seed=B)
    params = SamplingParams(max_tokens=setup.max_model_len, temperature=0, ignore_eos=True)
    ids = [f"tpot-{case}-{B}-{i}" for i in range(B)]
    try:
        for rid, prompt, lora in zip(ids, prompts, adapters_of(case, names, B)):
            engine.add_request(rid, prompt, params, lora)
        start_decoding(engine, ids)
        windows = [decode_window_ms(engine, B, setup) for _ in range(setup.windows)]
        planned = plan_step(engine)
        assert sorted(planned.request_ids) == sorted(ids) and planned.inputs.num_tokens == B
        replay = time_step(planned, eager=setup.device == "cpu", device=setup.device)
        floor = None if bw is None else sum(floor_bytes(engine, planned)) / bw * 1e3
    finally:
        for rid in ids:
            engine.abort_request(rid)
    async_on = engine.config.async_scheduling
    return Tpot(case, B, async_on, statistics.median(windows), replay, floor)


def start_decoding(engine: Engine, ids: list[str]) -> None:
    """Step until every request has sampled its first token (its prefill is done), then
    WARM_STEPS more: every timed step is then a decode step of all the batch's rows."""
    waiting = set(ids)
    for _ in range(len(ids) * 4 + 16):  # far more steps than chunked prefill takes
        if not waiting:
            break
        waiting -= {out.request_id for out in engine.step()}
    assert not waiting, f"{len(waiting)} requests never sampled a token"
    for _ in range(WARM_STEPS):
        engine.step()


def decode_window_ms(engine: Engine, B: int, setup: Setup) -> float:
    """ms of one Engine.step() over setup.steps decode steps, the device synchronised before
    the first and after the last (with async scheduling a step() returns before its batch
    has run: only a window's ends say when the work is done)."""
    sync(setup.device)
    start = time.perf_counter()
    tokens = sum(len(engine.step()) for _ in range(setup.steps))
    sync(setup.device)
    ms = (time.perf_counter() - start) * 1e3 / setup.steps
    if tokens != B * setup.steps:
        raise RuntimeError(
            f"{setup.steps} decode steps of {B} requests gave {tokens} tokens, expected "
            f"{B * setup.steps}: a timed step was not a decode step of every request"
        )
    return ms


# ---- throughput -------------------------------------------------------------------------


def measure_throughput(
    llm: LLM, setup: Setup, case: str, workload: Workload, names: list[str]
) -> Throughput:
    """LLM.generate of the workload, after a warm-up on other prompts (a full prefill chunk and
    a few decode steps) so that the kernels it needs are compiled before the clock starts."""
    vocab = llm.engine.model_config.vocab_size
    n, length = workload.prompts, workload.input_len
    loras = adapters_of(case, names, n)
    warm = min(n, setup.max_num_batched_tokens // length + 1)
    warm_params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    llm.generate(random_prompts(vocab, warm, length, seed=2), warm_params, lora=loras[:warm])
    prompts = random_prompts(vocab, n, length, seed=1)
    params = SamplingParams(max_tokens=workload.output_len, temperature=0, ignore_eos=True)
    sync(setup.device)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, lora=loras)
    sync(setup.device)
    seconds = time.perf_counter() - start
    generated = sum(len(o.token_ids) for o in outs)
    assert generated == n * workload.output_len, generated
    return Throughput(case, workload, llm.engine.config.async_scheduling, seconds, generated)


# ---- structured outputs -----------------------------------------------------------------


def measure_structured(setup: Setup, folder: str) -> list[StructuredTpot]:
    """Each of STRUCTURED_MIXES on one engine (async on, 8 distinct adapters), whose folder has
    a random tokenizer of the shape's vocabulary: the grammar is compiled against it."""
    B = setup.structured_B
    config = json.loads((Path(folder) / "config.json").read_text())
    folder = tempfile.mkdtemp(prefix="moelora-structured-")
    (Path(folder) / "config.json").write_text(json.dumps(config))
    write_random_tokenizer(folder, config["vocab_size"])
    sized = dataclasses.replace(setup, max_num_seqs=max(setup.max_num_seqs, 2 * B))
    llm, names = build(sized, folder, lora=True, async_on=True)
    mixes = {"B free": (B, 0), "B constrained": (0, B), "B free + B constrained": (B, B)}
    mixes["2B free"] = (2 * B, 0)
    rows = []
    for mix, (free, constrained) in mixes.items():
        ms = structured_step_ms(llm, sized, names, free, constrained)
        rows.append(StructuredTpot(mix, free, constrained, ms))
        print(f"structured {mix:>24}: step {ms:8.3f} ms", flush=True)
    return rows


def structured_step_ms(
    llm: LLM, setup: Setup, names: list[str], free: int, constrained: int
) -> float:
    """TPOT of `free` + `constrained` requests in one batch, as measure_tpot times it."""
    engine, n = llm.engine, free + constrained
    prompts = random_prompts(engine.model_config.vocab_size, n, setup.prompt_len, seed=n)
    spec = StructuredOutputsParams(json=STRUCTURED_SCHEMA)
    max_tokens = setup.max_model_len - setup.prompt_len
    params = [
        SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0,
            seed=i,
            ignore_eos=i < free,
            structured_outputs=spec if i >= free else None,
        )
        for i in range(n)
    ]
    ids = [f"structured-{free}-{constrained}-{i}" for i in range(n)]
    try:
        for rid, prompt, p, lora in zip(ids, prompts, params, adapters_of("8 distinct", names, n)):
            engine.add_request(rid, prompt, p, lora)
        start_decoding(engine, ids)
        windows = [decode_window_ms(engine, n, setup) for _ in range(setup.windows)]
    finally:
        for rid in ids:
            engine.abort_request(rid)
    return statistics.median(windows)


def structured_table(rows: list[StructuredTpot]) -> list[str]:
    if not rows:
        return []
    ms = {r.mix: r.step_ms for r in rows}
    B = rows[0].num_free
    lines = [
        "",
        f"Structured outputs, B = {B}, 8 distinct adapters, temperature 1, async on:",
        "",
        "| batch | free | constrained | step ms | / free batch of the same size |",
        "|---|---:|---:|---:|---:|",
    ]
    same_size = {"B free": "B free", "B constrained": "B free"}
    same_size |= {"B free + B constrained": "2B free", "2B free": "2B free"}
    for r in rows:
        ratio = r.step_ms / ms[same_size[r.mix]]
        lines.append(
            f"| {r.mix} | {r.num_free} | {r.num_constrained} | {r.step_ms:.3f} | {ratio:.3f} |"
        )
    return lines


# ---- the run ----------------------------------------------------------------------------


def run(setup: Setup, folder: str, bw: float | None):
    """Every figure, engine by engine: LoRA disabled then enabled, each async on then off;
    then the structured outputs' engine."""
    tpots, throughputs, builds = [], [], []
    for lora in (False, True):
        cases = [c for c in setup.cases if (c != "disabled") == lora]
        t_cases = [c for c in setup.throughput_cases if (c != "disabled") == lora]
        if not cases and not t_cases:
            continue
        for async_on in (True, False):
            start = time.perf_counter()
            llm, names = build(setup, folder, lora=lora, async_on=async_on)
            seconds = time.perf_counter() - start
            experts = built_experts(llm.engine.model_config)
            builds.append(Build(lora, async_on, seconds, capture_seconds(llm.engine), experts))
            print(f"engine lora={lora} async={async_on}: built in {seconds:.1f} s", flush=True)
            for case in cases:
                for B in setup.batches:
                    row = measure_tpot(llm, setup, case, B, names, bw if async_on else None)
                    tpots.append(row)
                    print_tpot(row)
            for case in t_cases:
                for workload in setup.workloads:
                    row = measure_throughput(llm, setup, case, workload, names)
                    throughputs.append(row)
                    print_throughput(row)
            del llm
            gc.collect()
            if setup.device.startswith("cuda"):
                torch.cuda.empty_cache()
    structured = measure_structured(setup, folder) if setup.structured_B else []
    return tpots, throughputs, builds, structured


def print_tpot(row: Tpot) -> None:
    print(
        f"{row.case:>10} B={row.B:<4} async={'on ' if row.async_on else 'off'} step "
        f"{row.step_ms:8.3f} ms  replay+lm_head {row.replay_ms:8.3f} ms  host "
        f"{100 * row.host_share:5.1f}%",
        flush=True,
    )


def print_throughput(row: Throughput) -> None:
    print(
        f"{row.case:>10} {row.workload} async={'on ' if row.async_on else 'off'} "
        f"{row.total_tokens / row.seconds:9.1f} total tok/s  "
        f"{row.output_tokens / row.seconds:9.1f} output tok/s  ({row.seconds:.2f} s)",
        flush=True,
    )


# ---- the result file --------------------------------------------------------------------


def report(setup: Setup, bw: float | None, results, seconds: float) -> list[str]:
    tpots, throughputs, builds, structured = results
    title = "End to end: TPOT and offline throughput, async scheduling on and off"
    _, weights = held_experts({b.experts for b in builds})
    lines = result_header(f"{title}, {setup.shape} shape ({weights})", bw, device=setup.device)
    lines += [
        f"- shape: {setup.shape}, {setup.layers or 'all its'} layers, {setup.dtype}; engines "
        f"built with LLM(load_format='dummy'): max_num_seqs = max_graph_bs = "
        f"{setup.max_num_seqs}, max_num_batched_tokens {setup.max_num_batched_tokens}, "
        f"max_model_len {setup.max_model_len}, {setup.num_pages} KV pages of {PAGE_SIZE}",
        f"- LoRA: max_loras {MAX_LORAS}, rank {setup.rank}; 8 distinct = adapters a0 .. a7 of "
        "LLM.add_random_lora on every attention and expert projection, request i on a(i % 8)",
        f"- TPOT: {setup.prompt_len}-token random prompts, prefilled, {WARM_STEPS} decode steps, "
        f"then {setup.windows} window(s) of {setup.steps} Engine.step() calls, the device "
        "synchronised at both ends of each; step ms = the median window's ms per step; "
        "step off / on > 1: async scheduling makes the step shorter",
        f"- replay ms: the same batch's {REPLAY[setup.device != 'cpu']}; host % = (step - "
        "replay) / step; floor: bench/decode.py's (weights, KV and LoRA bytes touched / copy "
        "bandwidth)",
        "- throughput: LLM.generate of random token prompts, greedy, ignore_eos, after a "
        "warm-up on other prompts; total tok/s counts prompt and output tokens; on / off: "
        "throughput with async scheduling over throughput without",
        f"- whole run: {seconds:.0f} s",
    ]
    for b in builds:
        lines.append(
            f"- engine LoRA {'enabled' if b.lora else 'disabled'}, async "
            f"{'on' if b.async_on else 'off'}: built in {b.seconds:.1f} s (graph capture "
            f"{b.capture[0]:.1f} s, of it warm-up {b.capture[1]:.1f} s)"
        )
    return lines + tpot_table(tpots) + throughput_table(throughputs) + structured_table(structured)


def tpot_table(rows: list[Tpot]) -> list[str]:
    by_key = {(r.case, r.B, r.async_on): r for r in rows}
    lines = [
        "",
        "| case | B | floor ms | on: replay ms | on: step ms | on: host % | off: replay ms "
        "| off: step ms | off: host % | step off / on |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for case, B in dict.fromkeys((r.case, r.B) for r in rows):
        on, off = by_key.get((case, B, True)), by_key.get((case, B, False))
        floor = on.floor_ms if on else None
        cells = [f"{floor:.3f}" if floor is not None else ""]
        for r in (on, off):
            cells += [f"{r.replay_ms:.3f}", f"{r.step_ms:.3f}", f"{100 * r.host_share:.1f}"]
        ratio = f"{off.step_ms / on.step_ms:.3f}" if on and off else ""
        lines.append(f"| {case} | {B} | {' | '.join(cells)} | {ratio} |")
    return lines


def throughput_table(rows: list[Throughput]) -> list[str]:
    by_key = {(r.case, r.workload, r.async_on): r for r in rows}
    lines = [
        "",
        "| case | requests | on: total tok/s | on: output tok/s | on: s | off: total tok/s "
        "| off: output tok/s | off: s | on / off |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for case, workload in dict.fromkeys((r.case, r.workload) for r in rows):
        on, off = by_key[(case, workload, True)], by_key[(case, workload, False)]
        cells = []
        for r in (on, off):
            cells += [
                f"{r.total_tokens / r.seconds:.0f}",
                f"{r.output_tokens / r.seconds:.0f}",
                f"{r.seconds:.2f}",
            ]
        ratio = off.seconds / on.seconds  # the same tokens: the throughput ratio
        lines.append(f"| {case} | {workload} | {' | '.join(cells)} | {ratio:.3f} |")
    return lines


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sizes = parser.add_mutually_exclusive_group()
    sizes.add_argument("--quick", action="store_true", help="a smaller subset (see above)")
    sizes.add_argument("--smoke", action="store_true", help="the tiny shape on the CPU")
    parser.add_argument("--layers", type=int, help="layers of the shape (default: all)")
    parser.add_argument(
        "--throughput-cases", nargs="*", choices=CASES, help="default: disabled; none: skip"
    )
    parser.add_argument("--tpot-cases", nargs="*", choices=CASES, help="default: all; none: skip")
    parser.add_argument(
        "--workloads", nargs="+", metavar="NxINxOUT", help="e.g. 256x512x128 (default: both)"
    )
    parser.add_argument(
        "--fp8", action="store_true", help="block-FP8 experts where the kernels keep them"
    )
    parser.add_argument("--out", help="result file (default: a dated one in bench/results)")
    parser.add_argument(
        "--no-structured", action="store_true", help="skip the structured-outputs batches"
    )
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    setup = SMOKE if args.smoke else QUICK if args.quick else FULL
    if args.layers:
        setup = dataclasses.replace(setup, layers=args.layers)
    if args.throughput_cases is not None:
        setup = dataclasses.replace(setup, throughput_cases=tuple(args.throughput_cases))
    if args.tpot_cases is not None:
        setup = dataclasses.replace(setup, cases=tuple(args.tpot_cases))
    if args.no_structured:
        setup = dataclasses.replace(setup, structured_B=0)
    if args.workloads:
        workloads = tuple(Workload(*map(int, w.split("x"))) for w in args.workloads)
        setup = dataclasses.replace(setup, workloads=workloads)
    start = time.perf_counter()
    folder = model_folder(setup.layers, setup.shape, fp8=args.fp8)
    bw = copy_bandwidth() if setup.device.startswith("cuda") else None
    results = run(setup, folder, bw)
    seconds = time.perf_counter() - start
    print(f"total {seconds:.0f} s")
    lines = report(setup, bw, results, seconds)
    write_result("e2e", lines, args.out, smoke=args.smoke)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
