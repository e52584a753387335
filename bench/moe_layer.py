"""One fused MoE layer at the tile table's tiles, beside its memory floor: the A/B of a kernel
change between two trees, or of one MoeConfig field, in one device call (bench/tune_moe.py
picks the tiles; this times the ones the engine would take, and nothing else).

    PYTHONPATH=.:bench python bench/moe_layer.py [--shape gpt-oss-120b] [--ms 1 8 64]
        [--set max_registers=168 ...] [--label A]

Run it once per tree (PYTHONPATH=TREE:bench, the other tree's moelora first on the path) and
once per --set, alternating, and compare the lines' ratios. As tune_moe: --layers layers of
random experts (MXFP4 shapes: small scales, in the GPU layout), LoRA pools recorded with no slot
active as the engine's graphs run a base-only step, CUDA-graph replays with L2 flushed; the
floor is the touched experts' bytes over the copy bandwidth measured in the same run.
"""

from __future__ import annotations

import argparse
import dataclasses

import torch
from common import DEV, DT, MOE_SHAPES, batch_info, copy_bandwidth, graph_ms, lora_pool
from tune_moe import MXFP4_SHAPES, experts, floor_us, gpt_oss_options, run_layers

from moelora.kernels import reference
from moelora.kernels.moe.config import MoeConfig, default_config


def field(text: str) -> tuple[str, int]:
    """NAME=INT, a MoeConfig field and its value."""
    name, _, value = text.partition("=")
    if (
        name not in {f.name for f in dataclasses.fields(MoeConfig)}
        or not value.lstrip("-").isdigit()
    ):
        raise argparse.ArgumentTypeError(f"{text!r}: expected a MoeConfig field NAME=INT")
    return name, int(value)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="gpt-oss-120b", choices=[*MOE_SHAPES, *MXFP4_SHAPES])
    parser.add_argument("--ms", nargs="+", type=int, default=[1, 8, 64])
    parser.add_argument("--set", nargs="*", type=field, default=[], help="MoeConfig NAME=INT")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--label", default="", help="printed on each line (the tree)")
    args = parser.parse_args()
    mxfp4 = args.shape in MXFP4_SHAPES
    E, H, I, K, _ = (MXFP4_SHAPES if mxfp4 else MOE_SHAPES)[args.shape]
    torch.manual_seed(0)
    w13, w2 = experts(E, H, I, args.layers, mxfp4)
    pools = [lora_pool(E, H, I, 16, 16) for _ in range(args.layers)]
    oss = [gpt_oss_options(E, H, I) if mxfp4 else {} for _ in range(args.layers)]
    bandwidth = copy_bandwidth()
    for M in args.ms:
        x = torch.randn(M, H, dtype=DT, device=DEV)
        tw, ti = reference.route_topk(torch.randn(M, E, device=DEV), K, renormalize=True)
        cfg = default_config(M, E, H, I, K, torch.device(DEV), mxfp4=mxfp4)
        cfg = dataclasses.replace(cfg, **dict(args.set))
        info = batch_info(M, "none", 16)

        def run(x=x, tw=tw, ti=ti, cfg=cfg, info=info):
            run_layers(w13, w2, pools, oss, x, tw, ti, cfg, info)

        us = 1e3 * graph_ms(run, args.layers)
        floor = floor_us(ti, H, I, mxfp4, bandwidth)
        print(
            f"{args.label} {args.shape} M={M} {us:8.1f} us  floor {floor:6.1f} us  "
            f"x{us / floor:5.2f}  {cfg}",
            flush=True,
        )


if __name__ == "__main__":
    main()
