"""Absorbed MLA decode's two launches of kv_b_proj (kernels/attention/mla_absorb.py: absorb_q,
then absorb_out_o_shrink), with and without kv_b_proj's LoRA inside, against their floor.

Timing: LAYERS layers, each with its own kv_b and its own LoRA factors (so nothing is read from
L2 that a step would not find there), each layer's two launches back to back, in one CUDA
graph replayed with the L2 flushed (triton's do_bench); the figure is the replay median over
LAYERS, in µs a layer. Cases (token t on slot t % 8 where it has one):
  base-only  every token on the base model (the LoRA compiled in, no slot: the early exits);
  no kv_b    adapters with o_proj's factors but none of kv_b_proj's (its module rank 0);
  kv_b       adapters with both (rank 16);
and `kv_b / no kv_b`, what kv_b_proj's LoRA costs (issue 44 asks at most 5% of a decode step).
Floor: a layer's kv_b bytes, the rows in and out and, with kv_b's LoRA, the factors of the
slots the step uses, over the copy bandwidth measured in the same run.

--sweep times every variant of how the first LoRA pass is scheduled (the module's settings:
FUSED_SIDES, FUSED_MAX_ROWS, G_BY_ROWS) beside the module's defaults, in one process.

    PYTHONPATH=.:bench python bench/absorb.py [--shape moonlight-16b-a3b] [--tokens 1 8 64]
        [--sweep] [--out PATH]
    PYTHONPATH=.:bench python bench/absorb.py --once kv_b 1   # one eager layer (ncu)
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Iterator

import torch
from common import copy_bandwidth, graph_ms, result_header, write_result

from moelora.kernels.attention import mla_absorb
from moelora.step.lora import NO_SLOT, LoraBatchInfo, LoraWeights

# name: (heads, qk_nope_head_dim, v_head_dim, kv_lora_rank, qk_rope_head_dim, hidden)
SHAPES = {
    "moonlight-16b-a3b": (16, 128, 128, 512, 64, 2048),
    "deepseek-v3": (128, 128, 128, 512, 64, 7168),
}
CASES = ("base-only", "no kv_b", "kv_b")
SLOTS, RANK, LAYERS = 8, 16, 16
# the first LoRA pass's schedules --sweep compares (mla_absorb's settings); "default" keeps
# the module's own
VARIANTS = {
    "default": {},
    "apart": dict(FUSED_SIDES=(), G_BY_ROWS=False),
    "fused": dict(FUSED_SIDES=("q", "out"), FUSED_MAX_ROWS=1 << 30, G_BY_ROWS=False),
    "apart, G by rows": dict(FUSED_SIDES=(), G_BY_ROWS=True),
    "fused, G by rows": dict(FUSED_SIDES=("q", "out"), FUSED_MAX_ROWS=1 << 30, G_BY_ROWS=True),
    "fused at one row, G by rows": dict(FUSED_SIDES=("q", "out"), FUSED_MAX_ROWS=1, G_BY_ROWS=True),
}


@contextlib.contextmanager
def variant(settings: dict) -> Iterator[None]:
    """mla_absorb's module settings changed inside the block, restored after."""
    saved = {name: getattr(mla_absorb, name) for name in settings}
    try:
        for name, value in settings.items():
            setattr(mla_absorb, name, value)
        yield
    finally:
        for name, value in saved.items():
            setattr(mla_absorb, name, value)


def pool(rows: int, cols: int, ranks: list[int], seed: int) -> LoraWeights:
    """SLOTS slots of a linear [rows, cols]: A [1, RANK, cols], B [rows, RANK], random, each
    slot's module rank as given (0: the adapter has no such module)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    a = torch.randn(SLOTS, 1, RANK, cols, generator=g, device="cuda") / cols**0.5
    b = torch.randn(SLOTS, rows, RANK, generator=g, device="cuda") * 0.1
    return LoraWeights.dense(a.bfloat16(), b.bfloat16(), (rows,), ranks)


def step_info(T: int, case: str) -> LoraBatchInfo:
    slots = torch.full((T,), NO_SLOT) if case == "base-only" else torch.arange(T) % SLOTS
    enabled = torch.zeros(SLOTS, dtype=torch.int32)
    enabled[slots[slots >= 0].unique()] = 1
    return LoraBatchInfo(
        slots.to("cuda", torch.int32),
        torch.full((SLOTS,), RANK, dtype=torch.int32, device="cuda"),
        torch.rand(SLOTS, device="cuda") + 0.5,
        enabled.cuda(),
    )


def make_layers(shape: str, case: str) -> list[tuple]:
    """Each layer's (kv_b, kv_b_proj's pool, o_proj's pool)."""
    Hh, N, V, L, _, hidden = SHAPES[shape]
    ranks = [0 if case == "no kv_b" else RANK] * SLOTS
    layers = []
    for i in range(LAYERS):
        g = torch.Generator(device="cuda").manual_seed(100 + i)
        kv_b = (torch.randn(Hh * (N + V), L, generator=g, device="cuda") / L**0.5).bfloat16()
        kv_lora = pool(Hh * (N + V), L, ranks, seed=200 + i)
        o_lora = pool(hidden, Hh * V, [RANK] * SLOTS, seed=300 + i)
        layers.append((kv_b, kv_lora, o_lora))
    return layers


def layer_fn(shape: str, T: int, case: str):
    """The function of no arguments that runs every layer's two launches."""
    Hh, N, V, L, R, _ = SHAPES[shape]
    g = torch.Generator(device="cuda").manual_seed(T)
    q = torch.randn(T, Hh, N + R, generator=g, device="cuda").bfloat16()
    q_nope = q[..., :N]  # as the layer passes it: a slice of q's heads
    o_lat = torch.randn(T, Hh, L, generator=g, device="cuda")
    info, layers = step_info(T, case), make_layers(shape, case)

    def run() -> None:
        for kv_b, kv_lora, o_lora in layers:
            mla_absorb.absorb_q(q_nope, kv_b, lora=kv_lora, info=info)
            mla_absorb.absorb_out_o_shrink(
                o_lat, kv_b, N, torch.bfloat16, lora=kv_lora, info=info, o_lora=o_lora
            )

    return run


def floor_us(shape: str, T: int, case: str, bandwidth: float) -> float:
    """A layer's bytes, read and written, over the copy bandwidth (which counts both)."""
    Hh, N, V, L, _, hidden = SHAPES[shape]
    used = 0 if case == "base-only" else min(T, SLOTS)
    rows = T * Hh * (N * 2 + L * 4 + L * 4 + V * 2)  # q_nope in, q_lat out, o_lat in, out
    kv_b = Hh * (N + V) * L * 2
    lora = used * RANK * (L + Hh * (N + V)) * 2 if case == "kv_b" else 0
    o_lora = used * RANK * Hh * V * 2
    return (rows + kv_b + lora + o_lora) / bandwidth * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="moonlight-16b-a3b", choices=sorted(SHAPES))
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--sweep", action="store_true", help="every variant (VARIANTS)")
    parser.add_argument("--once", nargs=2, metavar=("CASE", "T"), help="one eager layer, no timing")
    parser.add_argument("--out")
    args = parser.parse_args()
    if args.once:
        names = {c.replace(" ", "_"): c for c in CASES}  # a case's name, spaces as underscores
        case, T = names.get(args.once[0]), int(args.once[1])
        assert case is not None, f"--once CASE: one of {list(names)}, not {args.once[0]!r}"
        run = layer_fn(args.shape, T, case)
        run()
        torch.cuda.synchronize()
        return
    bandwidth = copy_bandwidth()
    names = list(VARIANTS) if args.sweep else ["default"]
    lines = result_header(f"Absorbed MLA decode's kv_b_proj launches, {args.shape}", bandwidth)
    knobs = ("FUSED_SIDES", "FUSED_MAX_ROWS", "G_BY_ROWS")
    defaults = {k: getattr(mla_absorb, k) for k in knobs}
    lines += [
        f"- module defaults: {defaults}",
        f"- {LAYERS} layers a graph, each its own kv_b and factors; {SLOTS} slots of rank {RANK}"
        "; token t on slot t % 8",
        "- time: µs a layer (absorb_q + absorb_out_o_shrink), graph replay median, L2 flushed",
        "",
        "| variant | T | case | µs | floor µs | x floor | kv_b / no kv_b |",
        "|---|---:|---|---:|---:|---:|---:|",
    ]
    for name in names:
        with variant(VARIANTS[name]):
            for T in args.tokens:
                us = {}
                for case in CASES:
                    us[case] = graph_ms(layer_fn(args.shape, T, case), LAYERS) * 1e3
                    floor = floor_us(args.shape, T, case, bandwidth)
                    ratio = f"{us['kv_b'] / us['no kv_b']:.3f}" if case == "kv_b" else ""
                    row = f"| {name} | {T} | {case} | {us[case]:.2f} | {floor:.2f} | "
                    lines.append(row + f"{us[case] / floor:.2f} | {ratio} |")
                    print(lines[-1], flush=True)
    write_result("absorb", lines, args.out)


if __name__ == "__main__":
    main()
