"""Decode step time of a Qwen3-30B-A3B-shaped model (or --shape NAME; random weights), next to
its floor.

Cases: LoRA disabled; LoRA enabled with a base-only batch; one adapter; 8 distinct rank-16
adapters on attention and experts; on MLA shapes, 8 others without kv_b_proj's LoRA (their
floor still counts kv_b's small factors). Graph replay and eager at B in {1, 8, 32, 64, 128}; each
timed step is the forward and the lm_head (logits), as the floor counts the lm_head's weight.
Floor = (weights touched + KV read + LoRA weights touched) / copy bandwidth of this run; the
experts touched are counted from the batch's real routing.

    PYTHONPATH=. python bench/decode.py [--shape gpt-oss-20b] [--layers 48] [--batches 1 8 64]
    PYTHONPATH=. python bench/decode.py --shape moonlight-16b-a3b --context 1024
    PYTHONPATH=. python bench/decode.py --shape gpt-oss-120b --mxfp4  # experts packed MXFP4
    PYTHONPATH=. python bench/decode.py --fp8  # experts block-FP8, where the kernels keep them

--fp8 writes the block-FP8 quantization_config into the shape's config (glm-4.5-air-fp8 has it
already). The title says how the engine holds the experts (common.built_experts): where its
kernels do not keep FP8 experts they are dequantized to bf16 at load, and the run says so.
"""

from __future__ import annotations

import argparse
import gc
import time

import torch
from common import (
    CONTEXT,
    DECODE_BATCHES,
    MAX_LORAS,
    RANK,
    adapters_of,
    add_random_adapters,
    built_experts,
    capture_seconds,
    copy_bandwidth,
    decode_batch,
    floor_bytes,
    held_experts,
    make_engine,
    model_folder,
    result_header,
    time_step,
    write_result,
)

from moelora.config import PROJECTIONS, graph_batch_sizes
from moelora.kernels.pdl import pdl_kwargs
from moelora.models.shapes import SHAPES

# "8 distinct, no kv_b": MLA shapes only, the same adapters without kv_b_proj's LoRA (what its
# correction in the latent space costs absorbed decode)
NO_KV_B = "8 distinct, no kv_b"
CASES = ("disabled", "base-only", "1 adapter", "8 distinct", NO_KV_B)
UNDERSCORED = {case.replace(" ", "_"): case for case in CASES}  # --cases 8_distinct
# the weights' dtypes, by how the engine holds the experts (experts_held)
DTYPES = {
    "bf16 experts": "bf16",
    "MXFP4 experts": "bf16, the experts MXFP4 (packed; the floor counts their bytes)",
    "FP8 experts (block 128x128)": "bf16, the experts block FP8 (e4m3 codes and a float32 scale "
    "per 128x128 block; the floor counts both)",
    "FP8 experts and attention projections (block 128x128)": "bf16, the experts and attention's "
    "q/k/v/o block FP8 (e4m3 codes and a float32 scale per 128x128 block; the floor counts both)",
}


def measure(engine, case: str, names: list[str], bw: float, rows: list, eager_too: bool, args):
    for B in args.batches:
        step = decode_batch(engine, B, adapters_of(case, names, B), args.context)
        model_bytes, lora_bytes = floor_bytes(engine, step)
        floor = (model_bytes + lora_bytes) / bw * 1e3
        g = time_step(step, eager=False)
        e = time_step(step, eager=True) if eager_too else None
        rows.append((case, B, g, e, floor, (model_bytes + lora_bytes) / (g * 1e-3) / 1e12))
        print(
            f"{case:>12} B={B:<4} graph {g:7.3f} ms  eager {e or 0:7.3f} ms  floor {floor:.3f}"
            f" ms  x{g / floor:.2f}",
            flush=True,
        )
        for request_id in step.request_ids:
            engine.abort_request(request_id)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=list(SHAPES), default="qwen3-30b-a3b")
    parser.add_argument("--layers", type=int, help="default: the shape's own")
    parser.add_argument("--out", help="result file (default: a dated one in bench/results)")
    parser.add_argument(
        "--cases",
        nargs="+",
        type=lambda case: UNDERSCORED.get(case, case),  # no quoting through a shell
        choices=CASES,
        default=list(CASES),
        help="cases to time; an underscore stands for a space (8_distinct)",
    )
    parser.add_argument("--batches", nargs="+", type=int, default=list(DECODE_BATCHES))
    parser.add_argument("--no-eager", action="store_true", help="graph replays only")
    parser.add_argument(
        "--context", type=int, default=CONTEXT, help=f"prompt tokens a sequence (default {CONTEXT})"
    )
    experts = parser.add_mutually_exclusive_group()
    experts.add_argument(
        "--mxfp4",
        action="store_true",
        help="the release's MXFP4 quantization_config in the shape's config (gpt-oss shapes): "
        "random experts made packed on the GPU, the floor counting their MXFP4 bytes",
    )
    experts.add_argument(
        "--fp8",
        action="store_true",
        help="the block-FP8 quantization_config in the shape's config: random experts made e4m3 "
        "codes with a float32 scale per 128x128 block where the kernels keep them FP8 (else "
        "dequantized to bf16, as the result says), the floor counting codes and scales",
    )
    parser.add_argument(
        "--projections",
        choices=PROJECTIONS,
        default="auto",
        help="EngineConfig.projections",
    )
    args = parser.parse_args(argv)
    gpt_oss = SHAPES[args.shape].get("model_type") == "gpt_oss"
    if args.mxfp4 and not gpt_oss:
        parser.error(f"--mxfp4 is for the gpt-oss shapes, not --shape {args.shape}")
    if args.fp8 and gpt_oss:
        parser.error("--fp8 is not for the gpt-oss shapes (their experts are MXFP4: --mxfp4)")
    return args


def main() -> None:
    args = parse_args()
    eager = not args.no_eager
    folder = model_folder(args.layers, args.shape, mxfp4=args.mxfp4, fp8=args.fp8)
    bw = copy_bandwidth()
    rows, capture, held = [], {}, set()
    # graphs up to the largest batch timed: a replay's time does not depend on how many others
    sized = dict(projections=args.projections, max_bs=max(args.batches))
    t0 = time.perf_counter()
    if "disabled" in args.cases:
        engine = make_engine(folder, lora=False, context=args.context, **sized)
        capture["disabled"] = capture_seconds(engine)
        held.add(built_experts(engine.model_config))
        measure(engine, "disabled", [], bw, rows, eager, args)
        del engine
        gc.collect()
        torch.cuda.empty_cache()
    lora_cases = [c for c in CASES[1:] if c in args.cases]
    if lora_cases:
        engine = make_engine(folder, lora=True, context=args.context, **sized)
        capture["lora"] = capture_seconds(engine)
        held.add(built_experts(engine.model_config))
        names = add_random_adapters(engine, MAX_LORAS)
        mla = any(key.endswith(".kv_b") for key in engine.lora_targets)
        for case in lora_cases:
            eager_too = eager and case == "base-only"
            if case == NO_KV_B:
                if not mla:
                    continue  # no kv_b_proj to leave out
                names = add_random_adapters(engine, MAX_LORAS, without="kv_b", prefix="n")
            measure(engine, case, names, bw, rows, eager_too, args)
    print(f"total {time.perf_counter() - t0:.0f} s")
    lines = report(args, bw, rows, capture, held)
    write_result("decode", lines, args.out)
    print("\n".join(lines))


def report(args, bw: float, rows: list, capture: dict, experts: set[str]) -> list[str]:
    held, weights = held_experts(experts)
    lines = result_header(f"Decode step, {args.shape} shape ({weights})", bw)
    pdl = pdl_kwargs(torch.device("cuda"))["PDL"]
    (off, off_warm), (on, on_warm) = capture.get("disabled", (0, 0)), capture.get("lora", (0, 0))
    max_bs = max(args.batches)
    lines += [
        f"- layers: {args.layers or 'all'} of {SHAPES[args.shape]['num_hidden_layers']}; "
        f"{DTYPES.get(held, f'bf16; {held}')}; "
        f"{args.context} context tokens per sequence; LoRA "
        f"rank {RANK}, max_loras {MAX_LORAS}, adapters on q/k/v/o and every expert's "
        "gate/up/down",
        f"- graph capture: {off:.1f} s (LoRA disabled; {off_warm:.1f} s of it the warm-up, where "
        f"kernels compile), {on:.1f} s (LoRA enabled; {on_warm:.1f} s), the "
        f"{len(graph_batch_sizes(max_bs))} batch sizes 1 .. {max_bs}; the first "
        "engine's capture includes compiling the kernels when the Triton cache is cold "
        "(bench/capture.py separates cold and warm)",
        "- time: median (do_bench) of a CUDA-graph replay of the forward, then the lm_head on the"
        " batch's rows (eager, as the runner does after a replay); no sampling",
        f"- programmatic dependent launch: {'on' if pdl else 'off'} (kernels/pdl.py)",
        f"- dense projections: {args.projections} (EngineConfig.projections, kernels/linear.py)",
        "",
        "| case | B | graph ms | eager ms | floor ms | × floor | TB/s |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for case, B, g, e, floor, tbs in rows:
        lines.append(
            f"| {case} | {B} | {g:.3f} | {'' if e is None else f'{e:.3f}'} | "
            f"{floor:.3f} | {g / floor:.2f} | {tbs:.2f} |"
        )
    return lines + ratio_table(rows, args.batches)


def ratio_table(rows: list, batches: list[int]) -> list[str]:
    """Each LoRA case's graph time over its reference's (LoRA disabled; on MLA shapes also 8
    distinct over the same without kv_b_proj's LoRA), per batch size."""
    graph = {(case, B): g for case, B, g, *_ in rows}
    pairs = [("base-only", "disabled"), ("8 distinct", "disabled")]
    pairs += [("8 distinct", NO_KV_B)] if any(case == NO_KV_B for case, *_ in rows) else []
    head = "".join(f" {c} / {d.removeprefix('8 distinct, ')} |" for c, d in pairs)
    lines = ["", "| B |" + head, "|---:|" + "---:|" * len(pairs)]
    for B in batches:
        ratios = [(graph.get((c, B)), graph.get((d, B))) for c, d in pairs]
        cells = [f"{r / d:.3f}" if r and d else "" for r, d in ratios]
        lines.append(f"| {B} | " + " | ".join(cells) + " |")
    return lines


if __name__ == "__main__":
    main()
