"""Decode step time of a Qwen3-30B-A3B-shaped model (random weights), next to its floor.

Cases: LoRA disabled; LoRA enabled with a base-only batch; one adapter; 8 distinct rank-16
adapters on attention and experts. Graph replay and eager at B in {1, 8, 32, 64, 128}; each
timed step is the forward and the lm_head (logits), as the floor counts the lm_head's weight.
Floor = (weights touched + KV read + LoRA weights touched) / copy bandwidth of this run; the
experts touched are counted from the batch's real routing.
"""

from __future__ import annotations

import argparse
import gc
import json
import tempfile
import time
from pathlib import Path

import torch
from common import copy_bandwidth, result_header
from triton.testing import do_bench

from moelora.config import PROJECTIONS, EngineConfig
from moelora.engine.engine import Engine
from moelora.kernels.pdl import pdl_kwargs
from moelora.lora.adapter import LoraAdapter, ModuleLora
from moelora.runner.graph_runner import STREAM_IDX, graph_batch_sizes, padded_batch_size
from moelora.sampling_params import SamplingParams

QWEN3_30B_A3B = dict(
    architectures=["Qwen3MoeForCausalLM"],
    model_type="qwen3_moe",
    vocab_size=151936,
    hidden_size=2048,
    intermediate_size=6144,
    moe_intermediate_size=768,
    num_hidden_layers=48,
    num_attention_heads=32,
    num_key_value_heads=4,
    head_dim=128,
    num_experts=128,
    num_experts_per_tok=8,
    norm_topk_prob=True,
    rms_norm_eps=1e-6,
    max_position_embeddings=4096,
    rope_theta=1e6,
    tie_word_embeddings=False,
    hidden_act="silu",
    eos_token_id=151645,
)
BATCHES = (1, 8, 32, 64, 128)
CASES = ("disabled", "base-only", "1 adapter", "8 distinct")
CONTEXT = 256  # prompt tokens per sequence before the timed decode step
RANK = 16


def make_engine(
    folder: str,
    *,
    lora: bool,
    eager: bool,
    max_bs: int = max(BATCHES),
    projections: str = "batch-invariant",
) -> Engine:
    cfg = EngineConfig(
        model=folder,
        load_format="dummy",
        dtype="bfloat16",
        enable_lora=lora,
        max_loras=8,
        max_lora_rank=RANK if lora else 1,
        max_graph_bs=max_bs,
        max_num_seqs=max_bs,
        max_num_batched_tokens=max_bs * CONTEXT,
        max_model_len=CONTEXT + 64,
        num_pages=max_bs * (CONTEXT + 64) // 16 + 16,
        enforce_eager=eager,
        projections=projections,
    )
    return Engine(cfg)


def random_adapter(engine: Engine, name: str, seed: int) -> LoraAdapter:
    """Rank-16 weights on every attention and expert projection, made on the GPU."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    modules = {}
    for key, t in engine.slot_pool.targets.items():
        experts = (t.num_experts,) if t.num_experts else ()
        a = (
            torch.randn(
                *experts, len(t.out_slices), RANK, t.in_features, generator=gen, device="cuda"
            )
            / t.in_features**0.5
        )
        b = torch.randn(*experts, t.out_features, RANK, generator=gen, device="cuda") * 0.01
        modules[key] = ModuleLora(a.to(torch.bfloat16), b.to(torch.bfloat16))
    return LoraAdapter(name, "<random>", RANK, 2.0, modules)


def decode_batch(engine: Engine, B: int, loras: list[str | None]):
    """Prefill B random prompts, then plan the decode step that follows and build its batch."""
    gen = torch.Generator().manual_seed(B)
    vocab = engine.model_config.vocab_size
    params = SamplingParams(max_tokens=1000, temperature=0, ignore_eos=True)
    for i in range(B):
        prompt = torch.randint(0, vocab, (CONTEXT,), generator=gen).tolist()
        engine.add_request(f"b{B}-{i}", prompt, params, loras[i])
    engine.step()
    plan = engine.scheduler.schedule()
    assert len(plan.chunks) == B and plan.num_tokens == B
    return plan, engine.runner.host_batch(plan)


def routed_ids(engine: Engine, batch) -> list[torch.Tensor]:
    """Each MoE layer's topk_ids [T, K] for this batch, from one eager forward."""
    seen: list[torch.Tensor] = []
    spies = []
    for layer in engine.model.layers:
        spies.append((layer.mlp, layer.mlp.ops))
        layer.mlp.ops = _RouteSpy(layer.mlp.ops, seen)
    with torch.inference_mode():
        engine.model(
            batch.to_device(engine.runner.device, engine.slot_pool), engine.runner.kv_caches
        )
    for mlp, ops in spies:
        mlp.ops = ops
    return seen


class _RouteSpy:
    """Stands in for a layer's Ops table and records the routing it computes."""

    def __init__(self, ops, seen: list):
        self._ops, self._seen = ops, seen

    def route_topk(self, logits, k, **kw):
        weights, ids = self._ops.route_topk(logits, k, **kw)
        self._seen.append(ids.clone())
        return weights, ids

    def __getattr__(self, name):
        return getattr(self._ops, name)


def floor_bytes(engine: Engine, batch) -> tuple[int, int]:
    """(model + KV bytes, LoRA bytes) that one decode step must read at least once.

    Experts: each distinct expert a layer routes to, once. LoRA: per active slot the attention
    A/B at the real rank, and per distinct (slot, expert) pair that expert's A/B.
    """
    mc, elem, r = engine.model_config, 2, RANK
    H, I, E = mc.hidden_size, mc.moe_intermediate_size, mc.num_experts
    qkv = mc.q_size + 2 * mc.kv_size
    slots = batch.slot_of_token.long().cuda() if engine.slot_pool is not None else None
    attn = (H * qkv + mc.q_size * H) * elem
    model, lora = mc.vocab_size * H * elem, 0  # the lm_head (the embedding reads B rows only)
    for ids in routed_ids(engine, batch):
        model += attn + E * H * elem + int(ids.unique().numel()) * 3 * H * I * elem
        if slots is None:
            continue
        active = slots >= 0
        pairs = (slots[:, None] * E + ids.long())[active].unique().numel()
        lora += pairs * (2 * r * H + 2 * I * r + r * I + H * r) * elem
        n_slots = int(slots[active].unique().numel())
        lora += n_slots * (3 * r * H + qkv * r + r * mc.q_size + H * r) * elem
    kv_tokens = int(batch.seq_lens.sum())
    model += kv_tokens * 2 * mc.num_kv_heads * mc.head_dim * elem * mc.num_layers
    return model, lora


def graphs_size(graphs, batch) -> int:
    from moelora.runner.graph_runner import padded_batch_size

    return padded_batch_size(batch.num_tokens, graphs.sizes)


def time_step(engine: Engine, batch, *, eager: bool) -> float:
    """Median ms of one decode forward and its logits: the eager model, or the replay of the
    batch's graph (its static inputs written once beforehand), then the lm_head on the batch's
    rows as the runner does it after a replay. The floor counts the lm_head's weight, so the
    timed part must run it too."""
    runner, model = engine.runner, engine.model
    T = batch.num_tokens
    with torch.inference_mode():
        if eager:
            device_batch = batch.to_device(runner.device, engine.slot_pool)
            return do_bench(
                lambda: model.compute_logits(model(device_batch, runner.kv_caches)),
                warmup=25,
                rep=200,
                return_mode="median",
            )
        runner.graphs.run(batch)
        key = (padded_batch_size(T, runner.graphs.sizes), STREAM_IDX)
        graph, hidden = runner.graphs.graphs[key], runner.graphs.outputs[key][:T]

        def step():
            graph.replay()
            model.compute_logits(hidden)

        return do_bench(step, warmup=25, rep=200, return_mode="median")


def measure(engine, case: str, names: list[str], bw: float, rows: list, eager_too: bool, batches):
    for B in batches:
        if case == "base-only" or case == "disabled":
            loras = [None] * B
        elif case == "1 adapter":
            loras = [names[0]] * B
        else:
            loras = [names[i % len(names)] for i in range(B)]
        plan, batch = decode_batch(engine, B, loras)
        model_bytes, lora_bytes = floor_bytes(engine, batch)
        floor = (model_bytes + lora_bytes) / bw * 1e3
        g = time_step(engine, batch, eager=False)
        e = time_step(engine, batch, eager=True) if eager_too else None
        rows.append((case, B, g, e, floor, (model_bytes + lora_bytes) / (g * 1e-3) / 1e12))
        print(
            f"{case:>12} B={B:<4} graph {g:7.3f} ms  eager {e or 0:7.3f} ms  floor {floor:.3f}"
            f" ms  x{g / floor:.2f}",
            flush=True,
        )
        for c in plan.chunks:
            engine.abort_request(c.request.request_id)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=48)
    parser.add_argument("--out", default="bench/results/decode-h200.md")
    parser.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES))
    parser.add_argument("--batches", nargs="+", type=int, default=list(BATCHES))
    parser.add_argument("--no-eager", action="store_true", help="graph replays only")
    parser.add_argument(
        "--projections", choices=PROJECTIONS, default="batch-invariant",
        help="EngineConfig.projections",
    )  # fmt: skip
    args = parser.parse_args()
    eager = not args.no_eager
    folder = tempfile.mkdtemp()
    Path(folder, "config.json").write_text(
        json.dumps({**QWEN3_30B_A3B, "num_hidden_layers": args.layers})
    )
    bw = copy_bandwidth()
    rows, capture = [], {}
    t0 = time.perf_counter()
    if "disabled" in args.cases:
        engine = make_engine(folder, lora=False, eager=False, projections=args.projections)
        graphs = engine.runner.graphs
        capture["disabled"] = (graphs.capture_seconds, graphs.warm_up_seconds)
        del graphs
        measure(engine, "disabled", [], bw, rows, eager, args.batches)
        del engine
        gc.collect()
        torch.cuda.empty_cache()
    lora_cases = [c for c in CASES[1:] if c in args.cases]
    if lora_cases:
        engine = make_engine(folder, lora=True, eager=False, projections=args.projections)
        graphs = engine.runner.graphs
        capture["lora"] = (graphs.capture_seconds, graphs.warm_up_seconds)
        del graphs
        names = [f"a{i}" for i in range(8)]
        for i, n in enumerate(names):
            engine.adapters[n] = random_adapter(engine, n, seed=i)
        for case in lora_cases:
            eager_too = eager and case == "base-only"
            measure(engine, case, names, bw, rows, eager_too, args.batches)
    print(f"total {time.perf_counter() - t0:.0f} s")
    write(args, bw, rows, capture)


def write(args, bw: float, rows: list, capture: dict) -> None:
    lines = result_header("Decode step, Qwen3-30B-A3B shape (random weights), H200", bw)
    pdl = pdl_kwargs(torch.device("cuda"))["PDL"]
    (off, off_warm), (on, on_warm) = capture.get("disabled", (0, 0)), capture.get("lora", (0, 0))
    lines += [
        f"- layers: {args.layers} of 48; bf16; {CONTEXT} context tokens per sequence; LoRA "
        f"rank {RANK}, max_loras 8, adapters on q/k/v/o and every expert's gate/up/down",
        f"- graph capture: {off:.1f} s (LoRA disabled; {off_warm:.1f} s of it the warm-up, where "
        f"kernels compile), {on:.1f} s (LoRA enabled; {on_warm:.1f} s), the "
        f"{len(graph_batch_sizes(max(BATCHES)))} batch sizes 1 .. {max(BATCHES)}; the first "
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
    graph = {(case, B): g for case, B, g, *_ in rows}
    lines += ["", "| B | base-only / disabled | 8 distinct / disabled |", "|---:|---:|---:|"]
    for B in args.batches:
        base = graph.get(("disabled", B))
        ratios = [graph.get((c, B)) for c in ("base-only", "8 distinct")]
        cells = [f"{r / base:.3f}" if r and base else "" for r in ratios]
        lines.append(f"| {B} | {cells[0]} | {cells[1]} |")
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
