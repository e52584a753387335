"""What deterministic inference costs (issue 42): EngineConfig.enable_deterministic_inference
off against on, in one run, on the Qwen3-30B-A3B shape with random weights and 8 random rank-16
adapters, one engine a mode (graphs to 256, 16384 tokens a step, prefix caching off: every
prompt is computed):

- decode: the step of B = 1, 8 and 64 requests of CONTEXT-token contexts, each on one of 8
  distinct adapters, as a graph replay with its logits (common.time_step), beside its floor:
  the bytes it must read (common.floor_bytes) over the copy bandwidth;
- TTFT: one base prompt of 512, 4096 and 16384 tokens, wall time from add_request to its token
  through Engine.step(), beside its compute floor: its FLOPs over matmul throughput;
- throughput: 256 x (512 in, 128 out) random prompts through LLM.generate, base and on the 8
  adapters (request i on adapter i % 8), output tokens over the wall time.

Every figure's ratio on / off is set against the issue's bound, 1.05.

    PYTHONPATH=. python bench/determinism.py [--layers N] [--out PATH] [--smoke]

--smoke: the tiny demo shape on the CPU, small sizes (there the mode changes nothing; the run
shows that the script works end to end, its figures mean nothing).
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from dataclasses import dataclass

import torch
from common import (
    CONTEXT,
    MAX_LORAS,
    RANK,
    PlannedStep,
    copy_bandwidth,
    floor_bytes,
    matmul_flops_per_s,
    model_folder,
    plan_step,
    prefill_flops,
    random_weights_llm,
    result_header,
    sync,
    time_step,
    write_result,
)

from moelora import LLM, SamplingParams
from moelora.engine.engine import Engine

BOUND = 1.05  # the issue's: mode on over off, every figure
TTFT_REPS = 6  # timed prompts a TTFT length (after one untimed), the best taken


@dataclass(frozen=True)
class Setup:
    shape: str
    layers: int | None
    device: str
    dtype: str
    decode_batches: tuple[int, ...]
    ttft_lengths: tuple[int, ...]
    requests: int
    input_len: int
    output_len: int

    @property
    def max_model_len(self) -> int:
        return max(max(self.ttft_lengths), CONTEXT, self.input_len + self.output_len) + 64


FULL = Setup("qwen3-30b-a3b", 48, "cuda", "bfloat16", (1, 8, 64), (512, 4096, 16384), 256, 512, 128)
SMOKE = Setup("tiny-qwen3-moe", None, "cpu", "float32", (1, 4), (16, 48), 8, 16, 4)


@dataclass(frozen=True)
class Figures:
    """One mode's figures, by name (ms, or tok/s for throughput), and their floors (ms)."""

    values: dict[str, float]
    floors: dict[str, float]


def build(setup: Setup, folder: str, deterministic: bool) -> tuple[LLM, list[str]]:
    pages = setup.requests * (setup.input_len + setup.output_len) // 16 + setup.max_model_len
    return random_weights_llm(
        folder,
        lora=True,
        rank=RANK,
        max_num_seqs=256 if setup.device == "cuda" else 8,
        device=setup.device,
        dtype=setup.dtype,
        max_model_len=setup.max_model_len,
        max_num_batched_tokens=max(setup.ttft_lengths),
        num_pages=pages // 16 * 16 + 64,
        enable_prefix_caching=False,
        enable_deterministic_inference=deterministic,
    )


def decode_step(engine: Engine, B: int, loras: list[str | None]) -> PlannedStep:
    """B requests of CONTEXT random tokens, stepped until each has its first token (prefill
    chunks and adapter fills take what steps they take), then their decode step planned."""
    gen = torch.Generator().manual_seed(B)
    vocab = engine.model_config.vocab_size
    params = SamplingParams(max_tokens=10_000, temperature=0, ignore_eos=True)
    ids = [f"decode-{B}-{i}" for i in range(B)]
    for rid, lora in zip(ids, loras):
        engine.add_request(
            rid, torch.randint(0, vocab, (CONTEXT,), generator=gen).tolist(), params, lora
        )
    waiting = set(ids)
    while waiting:
        waiting -= {o.request_id for o in engine.step() if o.token_ids}
    step = plan_step(engine)
    assert sorted(step.request_ids) == sorted(ids) and step.inputs.num_tokens == B
    return step


def decode_figures(llm: LLM, names: list[str], setup: Setup, bw: float | None) -> Figures:
    engine, values, floors = llm.engine, {}, {}
    for B in setup.decode_batches:
        step = decode_step(engine, B, [names[i % len(names)] for i in range(B)])
        eager = setup.device != "cuda"
        values[f"decode B={B}"] = time_step(step, eager=eager, device=setup.device)
        if bw:
            model, lora = floor_bytes(engine, step)
            floors[f"decode B={B}"] = (model + lora) / bw * 1e3
        for rid in step.request_ids:
            engine.abort_request(rid)
        while engine.has_unfinished_requests():
            engine.step()
    return Figures(values, floors)


def ttft_figures(llm: LLM, setup: Setup, flops_per_s: float) -> Figures:
    engine, values, floors = llm.engine, {}, {}
    gen = torch.Generator().manual_seed(5)
    vocab, cfg = engine.model_config.vocab_size, engine.model_config
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    for n, L in enumerate(setup.ttft_lengths):
        times = []
        # the first compiles what this length meets: not counted; the best of TTFT_REPS after
        # it, so that one slow prompt (the host, the clocks) does not make a mode's figure
        for rep in range(1 + TTFT_REPS):
            prompt = torch.randint(0, vocab, (L,), generator=gen).tolist()
            sync(setup.device)
            start = time.perf_counter()
            engine.add_request(f"ttft-{n}-{rep}", prompt, params, None)
            while engine.has_unfinished_requests():
                engine.step()
            sync(setup.device)
            times.append((time.perf_counter() - start) * 1e3)
        values[f"TTFT {L}"] = min(times[1:])
        floors[f"TTFT {L}"] = prefill_flops(cfg, [L]) / flops_per_s * 1e3
    return Figures(values, floors)


def throughput_figures(llm: LLM, names: list[str], setup: Setup) -> Figures:
    vocab = llm.engine.model_config.vocab_size
    gen = torch.Generator().manual_seed(7)
    prompts = torch.randint(0, vocab, (setup.requests, setup.input_len), generator=gen).tolist()
    params = SamplingParams(max_tokens=setup.output_len, temperature=0, ignore_eos=True)
    values = {}
    for case, loras in (
        ("throughput base", [None] * setup.requests),
        (f"throughput {len(names)} adapters", [names[i % len(names)] for i in range(len(prompts))]),
    ):
        # untimed, what this case meets compiles: every prompt for two tokens (eight prompts
        # left the full run's prefill steps of 32 prompts to compile in the timed pass)
        llm.generate(prompts, dataclasses.replace(params, max_tokens=2), lora=loras)
        sync(setup.device)
        start = time.perf_counter()
        outs = llm.generate(prompts, params, lora=loras)
        sync(setup.device)
        values[case] = sum(len(o.token_ids) for o in outs) / (time.perf_counter() - start)
    return Figures(values, {})


def measure(setup: Setup, folder: str, deterministic: bool, bw, flops) -> Figures:
    start = time.perf_counter()
    llm, names = build(setup, folder, deterministic)
    print(f"deterministic={deterministic}: built in {time.perf_counter() - start:.1f} s")
    with llm:
        parts = [
            decode_figures(llm, names, setup, bw),
            ttft_figures(llm, setup, flops),
            throughput_figures(llm, names, setup),
        ]
    values = {k: v for p in parts for k, v in p.values.items()}
    floors = {k: v for p in parts for k, v in p.floors.items()}
    return Figures(values, floors)


def report(setup: Setup, off: Figures, on: Figures, bw, flops, seconds: float) -> list[str]:
    lines = result_header(
        f"Deterministic inference, off against on, {setup.shape} shape (random weights)",
        bw,
        device=setup.device,
    )
    lines += [
        f"- engine: {setup.layers or 'all'} layers, {setup.dtype}, {MAX_LORAS} random rank-{RANK} "
        f"adapters, graphs to 256, {max(setup.ttft_lengths)} tokens a step, prefix caching off; "
        "one engine a mode",
        f"- decode: contexts of {CONTEXT} tokens, request i on adapter i % {MAX_LORAS}, graph "
        "replay with logits (median); floor: bytes it must read / copy bandwidth",
        "- TTFT: one base prompt, add_request to its token through Engine.step() (the best of "
        f"{TTFT_REPS} after one untimed); floor: FLOPs / matmul throughput "
        f"({flops / 1e12:.3g} TFLOP/s measured)",
        f"- throughput: {setup.requests} x ({setup.input_len} in, {setup.output_len} out), "
        "output tok/s",
        f"- whole run: {seconds:.0f} s",
        "",
        "| figure | off | on | on / off | floor ms | bound |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for name, before in off.values.items():
        after = on.values[name]
        # a cost ratio: times grow, throughputs shrink
        ratio = before / after if name.startswith("throughput") else after / before
        floor = off.floors.get(name)
        floor_cell = f"{floor:.3f}" if floor is not None else ""
        lines.append(
            f"| {name} | {before:.3f} | {after:.3f} | {ratio:.3f} | {floor_cell} | <= {BOUND} |"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, help="layers of the shape (default: all)")
    parser.add_argument("--smoke", action="store_true", help="the tiny shape on the CPU")
    parser.add_argument("--out", help="result file (default: a dated one in bench/results)")
    args = parser.parse_args()
    setup = SMOKE if args.smoke else FULL
    if args.layers:
        setup = dataclasses.replace(setup, layers=args.layers)
    start = time.perf_counter()
    folder = model_folder(setup.layers, setup.shape)
    bw = copy_bandwidth() if setup.device == "cuda" else None
    flops = matmul_flops_per_s(setup.device)
    off = measure(setup, folder, False, bw, flops)
    on = measure(setup, folder, True, bw, flops)
    lines = report(setup, off, on, bw, flops, time.perf_counter() - start)
    write_result("determinism", lines, args.out, smoke=args.smoke)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
