"""Pick the fused MoE tiles per token-count bucket and write them to kernels/moe/configs/ (JSON
keyed by shape and device). Times base-MoE CUDA-graph replays (L2 flushed), LoRA recorded with no
slot active, as the engine runs it; then checks the winner with one active adapter is not worse
than the runner-up by more than 5% (else takes the runner-up).

    PYTHONPATH=. python bench/tune_moe.py [--shapes qwen3-30b-a3b mixtral] [--ms 1 8 32 64 256]
        [--fp8]

--fp8: the same shapes with block-FP8 experts (random weights quantized as the releases are:
kernels/fp8_block.py), keyed apart; only tiles at most 128 deep that divide 128 (one block of
scales along K: kernels/moe/fp8.py), with deeper pipelines and narrower columns for the small
buckets: a code tile is half a bf16 tile's bytes, so the same tiles keep half the bytes in
flight. From 512 tokens each fitting tile is also tried as W8A8 (MoeConfig.w8a8: FP8 tensor
cores, the activations quantized as they load), and the table keeps whichever is faster.

The GPT-OSS shapes' experts are MXFP4 (random codes with small scales, in the GPU layout the
engine rewrites them into for bf16: Mxfp4Weight.swizzle_; their tiles are keyed apart). The
winner is timed again on the same codes in the release's layout, by bit placement and by the
table lookups that scales past 128 take, and the table's tile from before the run on the
release layout (what the engine ran before the GPU layout): the A/B, in one run. Every line
shows the time beside the floor: the bytes of the experts the tokens touch over the copy
bandwidth measured in the same run.
"""

from __future__ import annotations

import argparse
import dataclasses

import torch
from common import DEV, DT, MOE_SHAPES, batch_info, copy_bandwidth, graph_ms, lora_pool

from moelora.kernels import reference
from moelora.kernels.fp8_block import Fp8Weight, fp8_block_bytes, quantize_fp8_block
from moelora.kernels.moe.config import MoeConfig, default_config, save_configs
from moelora.kernels.moe.fp8 import fp8_tiles_fit
from moelora.kernels.moe.fused import fused_moe
from moelora.kernels.moe.mxfp4_layout import MXFP4_GROUP, Mxfp4Weight, mxfp4_bytes

MXFP4_SHAPES = {"gpt-oss-20b": (32, 2880, 2880, 4, 4), "gpt-oss-120b": (128, 2880, 2880, 4, 4)}


def C(bm, bn, bk, bnd, bkd, warps=4, stages=3, regs=0) -> MoeConfig:
    """A candidate: block_m, block_n, block_k; block_n_down, block_k_down; warps, stages;
    registers a thread (0: the compiler's choice)."""
    return MoeConfig(bm, bn, bk, bnd, bkd, warps, stages, max_registers=regs)


SMALL = [
    C(16, 64, 128, 64, 128),
    C(16, 32, 128, 32, 128, stages=4),
    C(16, 64, 64, 64, 64, stages=4),
    C(16, 128, 64, 128, 64),
    C(16, 32, 256, 32, 256),
    # narrow columns: more programs when few experts are touched (one token: 8 blocks)
    C(16, 16, 256, 16, 256, stages=4),
    C(16, 16, 128, 32, 128, stages=4),
    C(16, 32, 256, 16, 256, stages=4),
]
LARGE = [
    C(64, 64, 64, 64, 64),
    C(64, 128, 64, 128, 64, warps=8),
    C(32, 64, 128, 64, 128),
    C(16, 64, 128, 64, 128),
]
# Prefill token counts: tensor-core tiles, 64 or 128 rows of one expert. BK stays 128, the K
# blocking of the decode buckets, so that a row's reduction order does not change with the
# number of tokens in its step (BM and BN do not touch it). Each in groups of one block sweeping
# the column blocks (group_m 1): every prefill winner at 6c9e530 ran 0.83-0.96x the blocks-first
# order, so the tiles are compared in the order they will run (tune_order tries the others).
PREFILL = [
    dataclasses.replace(c, group_m=1)
    for c in [
        C(32, 64, 128, 64, 128),
        C(64, 64, 128, 64, 128),
        C(64, 64, 128, 128, 128, warps=8),
        C(64, 128, 128, 128, 128, warps=8, stages=2),
        C(128, 64, 128, 64, 128),
        C(128, 64, 128, 128, 128, warps=8),
        C(128, 128, 128, 128, 128, warps=8, stages=2),
    ]
]
# the down GEMM's own (block_n_down, num_warps_down, num_stages_down), tried on each prefill
# bucket's winner (tune_down)
DOWN_SWEEP_FROM = 512
DOWN_TILES = [(64, w, s) for w in (4, 8) for s in (2, 3, 4)]  # 48 KB a stage at BK 128
DOWN_TILES += [(128, w, s) for w in (4, 8) for s in (2, 3)] + [(256, 8, 2)]
# program orders tried on each prefill bucket's winner (tune_order): groups of this many blocks
ORDERS = (0, 1, 4, 8, 16)
# the winner's tiles through TMA descriptors (MoeConfig.tma, tune_tma), as they are and with
# these changes: TMA stages a tile without registers, so other column widths and depths may win
TMA_TILES = [
    {},
    dict(block_n=128, num_stages=2),  # gate_up 96 KB a stage
    dict(block_n_down=64, num_warps_down=4, num_stages_down=4),  # down 48 KB a stage
    dict(block_n_down=128, num_warps_down=4, num_stages_down=3),  # 64 KB
    dict(block_n_down=128, num_warps_down=8, num_stages_down=3),
    dict(block_n_down=256, num_warps_down=8, num_stages_down=2),  # 96 KB
    # 64-row blocks (less padding), two programs a multiprocessor where they fit
    dict(block_m=64, num_stages=2),
    dict(block_m=64, num_warps=4, num_stages=2),
    dict(block_m=64, num_warps=4, num_warps_down=4, num_stages_down=3),
]
MXFP4_EXTRA = [
    C(16, 64, 64, 64, 64),
    C(16, 128, 128, 128, 128, warps=8),
    C(16, 64, 256, 64, 256, stages=2),
    C(16, 128, 256, 128, 256, warps=8, stages=2),
    # more warps and deeper pipelines: the expansion's latency to hide
    C(16, 64, 128, 64, 128, warps=8),
    C(16, 64, 128, 64, 128, stages=5),
    C(16, 32, 128, 32, 128, warps=2, stages=4),
    C(16, 128, 128, 128, 128, warps=8, stages=4),
    # registers capped: 4 programs a multiprocessor at 128 (the expansion's latency to hide)
    C(16, 128, 64, 128, 64, regs=128),
    C(16, 64, 128, 64, 128, regs=128),
    C(16, 64, 64, 64, 64, stages=4, regs=128),
    C(16, 64, 256, 64, 256, stages=2, regs=168),
    C(16, 64, 256, 64, 256, stages=2, regs=128),
    # the expansion on sub-tiles (fewer registers, more programs a multiprocessor: 103 a
    # thread for gate_up at BN 64, BK 256 in 64-deep ones, where the whole tile takes 194)
    dataclasses.replace(C(16, 64, 256, 64, 256, stages=2), mxfp4_sub_k=64),
    dataclasses.replace(C(16, 64, 256, 64, 256, stages=3), mxfp4_sub_k=64),
    dataclasses.replace(C(16, 64, 256, 64, 256, stages=2), mxfp4_sub_k=128),
    dataclasses.replace(C(16, 128, 256, 128, 256, stages=2), mxfp4_sub_k=64),
    dataclasses.replace(C(16, 128, 128, 128, 128, stages=3), mxfp4_sub_k=64),
    dataclasses.replace(C(16, 32, 256, 32, 256, stages=3), mxfp4_sub_k=64),
]
# block-FP8's small buckets beside SMALL's tiles that fit it: a code tile is half a bf16 tile's
# bytes, so more stages (and more programs, by narrower columns) to keep as many bytes in flight
FP8_SMALL = [
    C(16, bn, bk, bn, bk, warps=warps, stages=stages)
    for bn, bk, warps, stages in [
        (32, 128, 4, 5),
        (32, 128, 4, 6),
        (32, 64, 4, 6),
        (32, 64, 4, 8),
        (16, 128, 4, 6),
        (16, 128, 2, 6),
        (64, 128, 4, 5),
        (64, 128, 8, 5),
        (64, 64, 4, 6),
        (128, 128, 8, 4),
    ]
]
CANDIDATES = {1: SMALL, 8: SMALL, 32: SMALL, 64: SMALL + LARGE[2:], 256: LARGE}
CANDIDATES |= {m: PREFILL for m in (512, 1024, 2048, 4096, 8192, 16384)}


def random_mxfp4(E: int, N: int, K: int) -> Mxfp4Weight:
    """Random codes, scale bytes 118..122 (weights of about 1/sqrt(2880)): small scales, in
    the GPU layout, as the engine's are after loading such weights in bf16."""
    blocks = torch.randint(0, 256, (E, N, K // 2), dtype=torch.uint8, device=DEV)
    scales = torch.randint(118, 123, (E, N, K // MXFP4_GROUP), dtype=torch.uint8, device=DEV)
    return Mxfp4Weight(blocks, scales).with_small_scales().swizzle_()


def random_fp8(E: int, N: int, K: int) -> Fp8Weight:
    """Random weights of about 1/sqrt(K), quantized block by block as the releases are."""
    codes, scale_inv = quantize_fp8_block(torch.randn(E, N, K, device=DEV) * K**-0.5)
    return Fp8Weight(codes, scale_inv)


def experts(E: int, H: int, I: int, layers: int, kind: str) -> tuple[list, list]:
    """Each layer's (w13, w2): kind "mxfp4", "fp8" or "bf16"."""
    if kind == "mxfp4":
        return (
            [random_mxfp4(E, 2 * I, H) for _ in range(layers)],
            [random_mxfp4(E, H, I) for _ in range(layers)],
        )
    if kind == "fp8":
        return (
            [random_fp8(E, 2 * I, H) for _ in range(layers)],
            [random_fp8(E, H, I) for _ in range(layers)],
        )
    return (
        [torch.randn(E, 2 * I, H, dtype=DT, device=DEV) * H**-0.5 for _ in range(layers)],
        [torch.randn(E, H, I, dtype=DT, device=DEV) * I**-0.5 for _ in range(layers)],
    )


def expert_bytes(H: int, I: int, kind: str) -> int:
    """One expert's w13 and w2 bytes as the kernels read them."""
    if kind == "mxfp4":
        return mxfp4_bytes(2 * I, H) + mxfp4_bytes(H, I)
    if kind == "fp8":  # a byte a code, a float32 scale a block
        return fp8_block_bytes(2 * I, H) + fp8_block_bytes(H, I)
    return 2 * 3 * H * I  # bf16: 2 bytes an element


def floor_us(ti: torch.Tensor, H: int, I: int, kind: str, bandwidth: float) -> float:
    """One layer's floor: the touched experts' weight bytes read once, over the copy bandwidth
    (which counts the bytes read and written), as bench/decode.py's floor."""
    return 1e6 * ti.unique().numel() * expert_bytes(H, I, kind) / bandwidth


def gpt_oss_options(E: int, H: int, I: int) -> dict:
    """GPT-OSS's expert biases and clamped SwiGLU."""
    return dict(
        b13=torch.randn(E, 2 * I, dtype=DT, device=DEV),
        b2=torch.randn(E, H, dtype=DT, device=DEV),
        activation="swiglu_oai",
    )


def run_layers(w13: list, w2: list, pools: list, oss: list, x, tw, ti, cfg, info) -> None:
    """fused_moe on each layer's experts, LoRA pools and GPT-OSS options in turn."""
    for i, (lora13, lora2) in enumerate(pools):
        fused_moe(
            x, w13[i], w2[i], tw, ti, lora13=lora13, lora2=lora2, info=info, config=cfg, **oss[i]
        )


W8A8_FROM = 512  # the FP8 buckets whose candidates include W8A8's (prefill)
# W8A8's tiles (MoeConfig.w8a8): gate_up 128 deep (x's groups) and 128 wide on 64 rows, where
# 128 rows would spill its two accumulators and their slices' partials; or 64 wide (h's groups
# of 64, down 64 deep) on 128 rows; and 4 warps on 64 x 64 (gate and up together as wide as
# vLLM's H100 block-FP8 tiles at prefill sizes, 64 x 128 on 4 warps, one accumulator there)
W8A8_TILES = [
    dataclasses.replace(C(bm, bn, 128, bnd, bn, warps=w, stages=st), w8a8=True, tma=tma)
    for bm, bn, bnd, w, st in (
        (64, 128, 128, 8, 2),
        (64, 128, 128, 8, 3),
        (64, 128, 64, 8, 3),
        (64, 128, 64, 8, 4),
        (128, 64, 128, 8, 3),
        (128, 64, 64, 8, 3),
        (128, 64, 128, 8, 4),
        (64, 64, 128, 4, 3),
        (64, 64, 128, 4, 4),
        (64, 64, 64, 4, 3),
        (64, 64, 64, 4, 4),
    )
    for tma in (False, True)  # the weights' code tiles by pointers or through TMA
]


def candidates(M: int, kind: str) -> list[MoeConfig]:
    """The bucket's tiles; for MXFP4, with tiles for its H = I = 2880 (the GPU layout is read
    by its bit placement whatever MoeConfig.mxfp4_lut says: the arithmetic is not tried); for
    block FP8, those whose depths fit a block of scales, with FP8_SMALL's below 256 tokens and
    W8A8's from W8A8_FROM."""
    if kind == "mxfp4":
        return [dataclasses.replace(c, mxfp4_lut=True) for c in CANDIDATES[M] + MXFP4_EXTRA]
    if kind == "fp8":
        extra = FP8_SMALL if M < 256 else []
        fit = [c for c in CANDIDATES[M] + extra if fp8_tiles_fit(c.block_k)]
        fit = [c for c in fit if fp8_tiles_fit(c.block_k_down)]
        return fit + W8A8_TILES if M >= W8A8_FROM else fit
    return CANDIDATES[M]


def tune_shape(name: str, ms: list[int], layers: int, fp8: bool = False) -> dict[int, MoeConfig]:
    mxfp4 = name in MXFP4_SHAPES
    kind = "mxfp4" if mxfp4 else "fp8" if fp8 else "bf16"
    E, H, I, K, _ = (MXFP4_SHAPES if mxfp4 else MOE_SHAPES)[name]
    torch.manual_seed(0)
    w13, w2 = experts(E, H, I, layers, kind)
    pools = [lora_pool(E, H, I, 16, 16) for _ in range(layers)]
    oss = [gpt_oss_options(E, H, I) if mxfp4 else {} for _ in range(layers)]
    bandwidth = copy_bandwidth()
    best = {}
    for M in ms:
        x = torch.randn(M, H, dtype=DT, device=DEV)
        tw, ti = reference.route_topk(torch.randn(M, E, device=DEV), K, renormalize=True)
        floor = floor_us(ti, H, I, kind, bandwidth)

        def run(cfg, info, x=x, tw=tw, ti=ti):
            run_layers(w13, w2, pools, oss, x, tw, ti, cfg, info)

        none, one = batch_info(M, "none", 16), batch_info(M, "one", 16)
        previous = default_config(M, E, H, I, K, torch.device(DEV), mxfp4=mxfp4, fp8=fp8)
        timed = [(graph_ms(lambda cfg=previous, i=none: run(cfg, i), layers), previous)]
        print(f"{name} M={M} {1e3 * timed[0][0]:8.1f} us  the table's tile before: {previous}")
        for cfg in candidates(M, kind):
            try:
                timed.append((graph_ms(lambda cfg=cfg, i=none: run(cfg, i), layers), cfg))
            except Exception as e:  # a tile that does not fit (shared memory): skip it
                print(f"{name} M={M} {cfg}: {type(e).__name__}: {str(e)[:120]}", flush=True)
                continue
            us = 1e3 * timed[-1][0]
            print(f"{name} M={M} {us:8.1f} us  floor {floor:6.1f} us  x{us / floor:5.2f}  {cfg}")
        timed.sort(key=lambda t: t[0])
        choice = timed[0][1]
        if len(timed) > 1:
            with_lora = [(graph_ms(lambda c=c, i=one: run(c, i), layers), c) for _, c in timed[:2]]
            if with_lora[0][0] > 1.05 * with_lora[1][0]:
                choice = with_lora[1][1]
        if M >= DOWN_SWEEP_FROM and kind == "bf16":
            choice = tune_down(lambda c, i=none: run(c, i), choice, layers, floor, f"{name} M={M}")
            choice = tune_order(lambda c, i=none: run(c, i), choice, layers, floor, f"{name} M={M}")
            choice = tune_tma(run, choice, (none, one), layers, floor, f"{name} M={M}")
        best[M] = choice
        print(f"{name} M={M} -> {choice}", flush=True)
        if mxfp4:  # the A/B: the layouts and expansions, the tile from before
            times = layouts(lambda c, i=none: run(c, i), choice, previous, w13, w2)
            print_layouts(f"{name} M={M}", times, floor)
    return best


def print_layouts(label: str, times: dict, floor: float) -> None:
    gpu = times["its tile, GPU layout"]
    for what, ms in times.items():
        print(
            f"{label} {what}: {1e3 * ms:8.1f} us  x{ms / gpu:5.2f} of the GPU layout's, "
            f"x{1e3 * ms / floor:5.2f} of the floor ({floor:6.1f} us)",
            flush=True,
        )


def keep_faster(time, choice: MoeConfig, variants: list, label: str) -> MoeConfig:
    """choice, or the variant [(name, MoeConfig)] that beats the best before it by 2%: time(cfg)
    gives (ms, a note for the log) and may raise where a tile does not fit (skipped)."""
    best_ms, note = time(choice)
    best = choice
    print(f"{label} {choice}: {1e3 * best_ms:8.1f} us{note}", flush=True)
    for name, cfg in variants:
        try:
            ms, note = time(cfg)
        except Exception as e:  # past the shared memory: skip it
            print(f"{label} {name}: {type(e).__name__}: {str(e)[:120]}", flush=True)
            continue
        print(f"{label} {name}: {1e3 * ms:8.1f} us{note} (x{ms / best_ms:5.3f})", flush=True)
        if ms < 0.98 * best_ms:
            best_ms, best = ms, cfg
    return best


def tune_down(run, choice: MoeConfig, layers: int, floor: float, label: str) -> MoeConfig:
    """The winner with the down GEMM's own columns, warps and stages (block_k_down kept: the
    K blocking): its K is I, 6 tiles at Qwen3-30B-A3B's, so it may want two programs a
    multiprocessor where gate_up wants one."""
    variants = [
        (
            f"down BN {bn} warps {warps} stages {stages}",
            dataclasses.replace(
                choice, block_n_down=bn, num_warps_down=warps, num_stages_down=stages
            ),
        )
        for bn, warps, stages in DOWN_TILES
    ]
    return keep_faster(
        lambda c: (graph_ms(lambda: run(c), layers), f" (floor {floor:6.1f} us)"),
        choice,
        variants,
        label,
    )


def tune_order(run, choice: MoeConfig, layers: int, floor: float, label: str) -> MoeConfig:
    """The winner in each program order (MoeConfig.group_m, ORDERS): blocks fastest, or groups
    of blocks sweeping every column block."""
    variants = [
        (f"order {group}", dataclasses.replace(choice, group_m=group))
        for group in ORDERS
        if group != choice.group_m
    ]
    return keep_faster(
        lambda c: (graph_ms(lambda: run(c), layers), f" (floor {floor:6.1f} us)"),
        choice,
        variants,
        label,
    )


def tune_tma(run, choice: MoeConfig, infos: tuple, layers: int, floor: float, label: str):
    """The winner against its tiles through TMA descriptors (TMA_TILES), timed base-only (which
    decides) and with one adapter on every token (infos, for the log)."""
    none, one = infos

    def time(c: MoeConfig) -> tuple[float, str]:
        ms1 = graph_ms(lambda: run(c, one), layers)
        note = f", 1 adapter {1e3 * ms1:8.1f} us (floor {floor:6.1f} us)"
        return graph_ms(lambda: run(c, none), layers), note

    variants = [
        (f"TMA {change}", dataclasses.replace(choice, tma=True, **change)) for change in TMA_TILES
    ]
    return keep_faster(time, choice, variants, label)


def layouts(run, choice: MoeConfig, previous: MoeConfig, w13: list, w2: list) -> dict:
    """ms of run(config)'s graph: the chosen tile on the GPU layout (the experts as they are);
    on the same codes in the release layout by bit placement and by table lookups (as if a
    scale byte were past 128); the table's tile from before on the release layout. The lists
    are restored."""
    layers, originals = len(w13), (list(w13), list(w2))
    times = {"its tile, GPU layout": graph_ms(lambda: run(choice), layers)}
    for ws in (w13, w2):
        ws[:] = [dataclasses.replace(w, blocks=w.release_blocks(), swizzled=False) for w in ws]
    times["its tile, release layout"] = graph_ms(lambda: run(choice), layers)
    times["the tile before, release layout"] = graph_ms(lambda: run(previous), layers)
    for ws in (w13, w2):
        ws[:] = [dataclasses.replace(w, small_scales=False) for w in ws]
    times["its tile, release layout, table lookups"] = graph_ms(lambda: run(choice), layers)
    w13[:], w2[:] = originals
    return times


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--shapes", nargs="+", choices=[*MOE_SHAPES, *MXFP4_SHAPES], default=list(MOE_SHAPES)
    )
    parser.add_argument("--ms", nargs="+", type=int, default=list(CANDIDATES), choices=CANDIDATES)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--fp8", action="store_true", help="block-FP8 experts (not gpt-oss)")
    args = parser.parse_args()
    if args.fp8 and set(args.shapes) & set(MXFP4_SHAPES):
        parser.error("--fp8 is not for the gpt-oss shapes (their experts are MXFP4)")
    for name in args.shapes:
        mxfp4 = name in MXFP4_SHAPES
        E, H, I, K, _ = (MXFP4_SHAPES if mxfp4 else MOE_SHAPES)[name]
        for M in args.ms:  # each bucket written as it is tuned: a run cut short keeps them
            best = tune_shape(name, [M], args.layers, fp8=args.fp8)
            torch.cuda.empty_cache()
            path = save_configs(
                torch.cuda.get_device_name(), E, H, I, K, best, mxfp4=mxfp4, fp8=args.fp8
            )
            print(f"wrote {path} (M={M})", flush=True)


if __name__ == "__main__":
    main()
