"""Prefill through the engine's own step loop: time to first token (TTFT) of one long prompt and
prefill throughput of many, each beside its compute floor, on a Qwen3-30B-A3B shape with
random weights.

- TTFT: one prompt of N random tokens (N = 512 .. 16384), max_tokens=1, added to an idle
  engine; the wall time from add_request until Engine.step() returns its token (the device
  synchronised at the end). The median of REPS such prompts, after one untimed prompt of the
  same length (kernels compiled).
- Prefill throughput: 32 prompts x 2048 tokens, max_tokens=1, added at once: prompt tokens over
  the wall time until the last one's token.
- Floor: the FLOPs a prefill must do, over the bf16 matmul throughput measured in this run (an
  8192^3 torch.mm): 2 x the active non-embedding parameters (attention projections, router,
  top-k experts, shared expert) x tokens, plus causal attention, 2 x 2 x heads x head_dim x
  T(T+1)/2 x layers per prompt of T tokens (QK^T and PV); the lm_head of the sampled tokens
  only. LoRA's FLOPs are not counted (rank 16: < 1%).
- Cases: LoRA disabled; enabled with base-only requests; 1 adapter; 8 distinct rank-16 adapters
  (LLM.add_random_lora, attention and every expert) over the throughput prompts, request i on
  a(i % 8) (TTFT: one prompt has one adapter, so "8 distinct" is a throughput case only).
Prefix caching is off: every prompt is computed whole.

    PYTHONPATH=.:bench python bench/prefill.py [--shape NAME] [--lengths N ...] [--layers N]
        [--profile] [--pdl] [--fp8] [--smoke] [--out PATH]

--profile: also the per-kernel GPU time of one 4096-token prefill, per layer (torch.profiler).
  It turns programmatic dependent launch off for the whole run unless --pdl is given: with it
  on, a kernel that starts early is charged its wait for the one before.
--fp8: the shape's config with the block-FP8 quantization_config: the experts e4m3 codes and a
  float32 scale per 128x128 block where the engine's kernels keep them FP8, else dequantized to
  bf16 at load, as the result's title says (common.built_experts). The floor stays the bf16
  matmul's.
--smoke: the tiny demo shape on the CPU: shows that the script runs; its figures mean nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import statistics
import time
from collections import defaultdict
from dataclasses import dataclass

import torch
from common import (
    MAX_LORAS,
    RANK,
    adapters_of,
    built_experts,
    held_experts,
    matmul_flops_per_s,
    model_folder,
    prefill_flops,
    result_header,
    sync,
    write_result,
)

from moelora import LLM, SamplingParams
from moelora.config import (
    LINEAR_ATTENTION_PREFILLS,
    MLA_PREFILL_FORMS,
    PREFILL_ATTENTION_BACKENDS,
    EngineConfig,
)
from moelora.engine.engine import Engine
from moelora.models.shapes import SHAPES
from moelora.step.batch import pages_for

PAGE_SIZE = 16
CASES = ("disabled", "base-only", "1 adapter", "8 distinct")
TTFT_CASES = CASES[:3]
REPS = 3


@dataclass(frozen=True)
class Setup:
    shape: str
    layers: int | None
    device: str
    dtype: str
    lengths: tuple[int, ...]
    batch: tuple[int, int]  # throughput: prompts, tokens each
    max_num_batched_tokens: int
    prefill_attention_backend: str = "cudnn"  # EngineConfig's
    mla_prefill: str = EngineConfig.mla_prefill  # EngineConfig's: MLA shapes only
    linear_attention_prefill: str = EngineConfig.linear_attention_prefill  # hybrid shapes only
    max_prefill_graph_tokens: int = EngineConfig.max_prefill_graph_tokens  # 0: all eager
    profile_tokens: int = 4096  # --profile: the prefill whose kernels are timed

    @property
    def max_model_len(self) -> int:
        return max(*self.lengths, self.batch[1]) + 16


FULL = Setup(
    shape="qwen3-30b-a3b",
    layers=48,
    device="cuda",
    dtype="bfloat16",
    lengths=(512, 2048, 4096, 8192, 16384),
    batch=(32, 2048),
    max_num_batched_tokens=16384,
)
SMOKE = Setup(
    shape="tiny-qwen3-moe",
    layers=None,
    device="cpu",
    dtype="float32",
    lengths=(16, 64),
    batch=(4, 32),
    max_num_batched_tokens=128,
)


@dataclass(frozen=True)
class Row:
    case: str
    what: str  # "TTFT N" or "P x N"
    tokens: int
    seconds: float
    floor_seconds: float


def build(setup: Setup, folder: str, *, lora: bool) -> tuple[LLM, list[str]]:
    llm = LLM(
        model=folder,
        load_format="dummy",
        device=setup.device,
        dtype=setup.dtype,
        enable_lora=lora,
        max_loras=MAX_LORAS,
        max_lora_rank=RANK if lora else 1,
        max_num_seqs=max(setup.batch[0], 8),
        max_graph_bs=max(setup.batch[0], 8),
        max_num_batched_tokens=setup.max_num_batched_tokens,
        max_model_len=setup.max_model_len,
        # every prompt of the throughput batch at once, or the longest TTFT prompt: the rest
        # of the GPU stays free for the activations of 16384-token steps (an engine sizing its
        # KV cache to the free memory left too little of it for the LoRA engine)
        num_pages=setup.batch[0] * pages_for(setup.max_model_len, PAGE_SIZE) + 16,
        page_size=PAGE_SIZE,
        enable_prefix_caching=False,
        prefill_attention_backend=setup.prefill_attention_backend,
        mla_prefill=setup.mla_prefill,
        linear_attention_prefill=setup.linear_attention_prefill,
        max_prefill_graph_tokens=setup.max_prefill_graph_tokens,
    )
    names = [f"a{i}" for i in range(MAX_LORAS)] if lora else []
    for seed, name in enumerate(names):
        llm.add_random_lora(name, rank=RANK, seed=seed)
    return llm, names


def prefill_seconds(engine: Engine, prompts: list[list[int]], loras, device: str) -> float:
    """Wall seconds from adding the prompts to an idle engine until each has its token."""
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    tag = time.perf_counter_ns()
    ids = [f"p{tag}-{i}" for i in range(len(prompts))]
    sync(device)
    start = time.perf_counter()
    for rid, prompt, lora in zip(ids, prompts, loras):
        engine.add_request(rid, prompt, params, lora)
    pending = set(ids)
    while pending:
        pending -= {out.request_id for out in engine.step() if out.finished}
    sync(device)
    return time.perf_counter() - start


def random_prompts(gen: torch.Generator, vocab: int, count: int, length: int) -> list[list[int]]:
    return torch.randint(0, vocab, (count, length), generator=gen).tolist()


def measure(setup: Setup, folder: str, flops_per_s: float, *, profile: bool):
    """(rows, kernel tables, how the engines held the experts: common.built_experts)."""
    rows, tables, held = [], [], set()
    gen = torch.Generator().manual_seed(0)
    for lora in (False, True):
        llm, names = build(setup, folder, lora=lora)
        engine, cfg = llm.engine, llm.engine.model_config
        held.add(built_experts(cfg))
        vocab = cfg.vocab_size
        cases = [c for c in CASES if (c != "disabled") == lora]
        rows += ttft_rows(
            engine, setup, [c for c in cases if c in TTFT_CASES], names, gen, flops_per_s
        )
        for case in cases:
            count, n = setup.batch
            loras = adapters_of(case, names, count)
            prefill_seconds(engine, random_prompts(gen, vocab, count, n), loras, setup.device)
            seconds = prefill_seconds(
                engine, random_prompts(gen, vocab, count, n), loras, setup.device
            )
            floor = prefill_flops(cfg, [n] * count) / flops_per_s
            rows.append(Row(case, f"{count} x {n}", count * n, seconds, floor))
            print_row(rows[-1])
            if profile:
                tables.append(kernel_table(engine, setup, case, names, gen))
        del llm, engine
        gc.collect()
        if setup.device.startswith("cuda"):
            torch.cuda.empty_cache()
    return rows, tables, held


def ttft_rows(engine: Engine, setup: Setup, cases, names, gen, flops_per_s) -> list[Row]:
    """TTFT of each length for the cases of one engine, the cases alternated within each
    repetition (after one untimed prompt of each). Measured one case after the other, the
    first one on a fresh engine (base-only) read 67-71 ms at 512 tokens, where alternated
    with 1 adapter both read 50-61 ms."""
    rows, cfg, vocab = [], engine.model_config, engine.model_config.vocab_size
    for n in setup.lengths:
        times = {case: [] for case in cases}
        for rep in range(REPS + 1):
            for case in cases:
                prompt = random_prompts(gen, vocab, 1, n)
                seconds = prefill_seconds(engine, prompt, adapters_of(case, names, 1), setup.device)
                if rep:
                    times[case].append(seconds)
        floor = prefill_flops(cfg, [n]) / flops_per_s
        for case in cases:
            rows.append(Row(case, f"TTFT {n}", n, statistics.median(times[case]), floor))
            print_row(rows[-1])
    return rows


def kernel_table(engine: Engine, setup: Setup, case: str, names, gen) -> list[str]:
    """Per-layer GPU time of each kernel in one prefill of setup.profile_tokens (8 prompts of
    an eighth of it for 8 distinct, so that the adapters are mixed)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    count = 8 if case == "8 distinct" else 1
    length = setup.profile_tokens // count
    loras = adapters_of(case, names, count)
    vocab = engine.model_config.vocab_size
    prefill_seconds(engine, random_prompts(gen, vocab, count, length), loras, setup.device)
    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        prefill_seconds(engine, random_prompts(gen, vocab, count, length), loras, setup.device)
    total, calls = defaultdict(float), defaultdict(int)
    for ev in prof.events():
        if ev.device_type == DeviceType.CUDA:
            total[ev.name[:70]] += ev.device_time
            calls[ev.name[:70]] += 1
    layers = engine.model_config.num_layers
    lines = [
        "",
        f"### Kernels of one {setup.profile_tokens}-token prefill, {case} ({count} x {length}): "
        f"{sum(total.values()) / layers / 1e3:.3f} ms kernel time per layer",
        "",
        "| kernel | calls per layer | ms per layer |",
        "|---|---:|---:|",
    ]
    for name in sorted(total, key=lambda k: -total[k])[:14]:
        cell = f"{calls[name] / layers:.2f} | {total[name] / layers / 1e3:.3f}"
        lines.append(f"| `{name}` | {cell} |")
    print("\n".join(lines), flush=True)
    return lines


def print_row(row: Row) -> None:
    print(
        f"{row.case:>10} {row.what:>12}: {1e3 * row.seconds:9.2f} ms  floor "
        f"{1e3 * row.floor_seconds:8.2f} ms  x{row.seconds / row.floor_seconds:5.2f}  "
        f"{row.tokens / row.seconds:9.0f} tok/s",
        flush=True,
    )


def pdl_state() -> str:
    if os.environ.get("MOELORA_PDL", "1") == "0":
        return "off (MOELORA_PDL=0: --profile without --pdl), for TTFT and profile alike"
    return "on (kernels/pdl.py)"


def report(setup: Setup, results, flops_per_s: float, seconds: float):
    rows, tables, experts = results
    title = f"Prefill: TTFT and prefill throughput beside the compute floor, {setup.shape} shape"
    _, weights = held_experts(experts)
    lines = result_header(f"{title} ({weights})", None, device=setup.device)
    lines += [
        f"- shape: {setup.shape}, {setup.layers or 'all its'} layers, {setup.dtype}; LLM("
        f"load_format='dummy', max_num_batched_tokens {setup.max_num_batched_tokens}, "
        f"max_model_len {setup.max_model_len}, enable_prefix_caching=False, "
        f"prefill_attention_backend={setup.prefill_attention_backend!r}, "
        f"mla_prefill={setup.mla_prefill!r}, "
        f"linear_attention_prefill={setup.linear_attention_prefill!r}, "
        f"max_prefill_graph_tokens={setup.max_prefill_graph_tokens}); LoRA: max_loras "
        f"{MAX_LORAS}, rank {RANK}, on attention and every expert",
        f"- matmul throughput (8192^3 bf16 torch.mm, do_bench median): "
        f"{flops_per_s / 1e12:.0f} TFLOP/s; floor = FLOPs / it (see bench/prefill.py)",
        f"- TTFT: the median of {REPS} prompts of fresh random tokens, each added alone to an "
        "idle engine, until Engine.step() returns its token (an engine's cases alternated); "
        "throughput: "
        f"{setup.batch[0]} x {setup.batch[1]} tokens added at once, until the last token",
        f"- programmatic dependent launch: {pdl_state()}",
        f"- whole run: {seconds:.0f} s",
        "",
        "| case | what | tokens | ms | floor ms | x floor | tok/s | / disabled |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    base = {r.what: r for r in rows if r.case == "disabled"}
    for r in sorted(rows, key=lambda r: CASES.index(r.case)):  # stable: lengths in order
        rel = f"{base[r.what].seconds / r.seconds:.3f}" if r.what in base else ""
        lines.append(
            f"| {r.case} | {r.what} | {r.tokens} | {1e3 * r.seconds:.2f} | "
            f"{1e3 * r.floor_seconds:.2f} | {r.seconds / r.floor_seconds:.2f} | "
            f"{r.tokens / r.seconds:.0f} | {rel} |"
        )
    for table in tables:
        lines += table
    return lines


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="the tiny shape on the CPU")
    parser.add_argument("--layers", type=int, help="layers of the shape (default: all)")
    parser.add_argument(
        "--shape", choices=list(SHAPES), default=FULL.shape, help=f"default {FULL.shape}"
    )
    parser.add_argument("--lengths", type=int, nargs="+", help="TTFT prompt lengths")
    parser.add_argument("--profile", action="store_true", help="per-kernel times (CUDA)")
    parser.add_argument(
        "--pdl",
        action="store_true",
        help="with --profile: keep programmatic dependent launch on (a kernel launched early "
        "is charged its wait for the one before: a norm after a LoRA kernel showed +90%%)",
    )
    parser.add_argument(
        "--prefill-attention-backend",
        choices=PREFILL_ATTENTION_BACKENDS,
        default="cudnn",
        help="EngineConfig.prefill_attention_backend (default: cudnn)",
    )
    parser.add_argument(
        "--mla-prefill",
        choices=MLA_PREFILL_FORMS,
        default=EngineConfig.mla_prefill,
        help=f"EngineConfig.mla_prefill, on MLA shapes (default: {EngineConfig.mla_prefill})",
    )
    parser.add_argument(
        "--linear-attention-prefill",
        choices=LINEAR_ATTENTION_PREFILLS,
        default=EngineConfig.linear_attention_prefill,
        help="EngineConfig.linear_attention_prefill, on hybrid shapes (default: "
        f"{EngineConfig.linear_attention_prefill})",
    )
    parser.add_argument(
        "--max-prefill-graph-tokens",
        type=int,
        default=EngineConfig.max_prefill_graph_tokens,
        help="EngineConfig.max_prefill_graph_tokens: prefill steps of up to this many tokens "
        f"replay a CUDA graph (default {EngineConfig.max_prefill_graph_tokens}; 0: eager)",
    )
    parser.add_argument(
        "--profile-tokens", type=int, default=4096, help="tokens of --profile's prefill"
    )
    parser.add_argument(
        "--fp8", action="store_true", help="block-FP8 experts where the kernels keep them"
    )
    parser.add_argument("--out", help="result file (default: a dated one in bench/results)")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    if args.profile and not args.pdl:
        # read at the first launch (kernels/pdl.py): the whole run's figures are PDL-off ones
        os.environ["MOELORA_PDL"] = "0"
    setup = SMOKE if args.smoke else FULL
    if not args.smoke and args.shape != setup.shape:
        setup = dataclasses.replace(setup, shape=args.shape, layers=None)  # all its layers
    if args.layers:
        setup = dataclasses.replace(setup, layers=args.layers)
    if args.lengths:
        setup = dataclasses.replace(setup, lengths=tuple(args.lengths))
    setup = dataclasses.replace(
        setup,
        prefill_attention_backend=args.prefill_attention_backend,
        mla_prefill=args.mla_prefill,
        linear_attention_prefill=args.linear_attention_prefill,
        max_prefill_graph_tokens=args.max_prefill_graph_tokens,
        profile_tokens=args.profile_tokens,
    )
    start = time.perf_counter()
    flops_per_s = matmul_flops_per_s(setup.device)
    folder = model_folder(setup.layers, setup.shape, fp8=args.fp8)
    profile = args.profile and setup.device.startswith("cuda")
    results = measure(setup, folder, flops_per_s, profile=profile)
    lines = report(setup, results, flops_per_s, time.perf_counter() - start)
    write_result("prefill", lines, args.out, smoke=args.smoke)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
