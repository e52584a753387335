"""The fused MoE's kernels under Nsight Compute: one layer of a shape at M tokens, run with no
adapter active, then with every token on one of MAX_LORAS rank-16 adapters (a diagnostic: where
the LoRA epilogues' time goes, stall reasons and occupancy; bench/kernels.py is the benchmark).

    ncu --clock-control none --kernel-name regex:'gate_up|down_kernel|align' \\
        --section LaunchStats --section Occupancy --section WarpStateStats \\
        python3 bench/ncu_moe.py [--shape qwen3-30b-a3b | gpt-oss-120b] [--m 64]

Each case runs twice, so the second launch of each kernel is the one to read (the first may
pay for cold caches).
"""

from __future__ import annotations

import argparse

import torch
from common import DEV, DT, MOE_SHAPES, batch_info, lora_pool
from tune_moe import MXFP4_SHAPES, experts, gpt_oss_options

from moelora.kernels import reference
from moelora.kernels.moe.fused import fused_moe


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="qwen3-30b-a3b", choices=[*MOE_SHAPES, *MXFP4_SHAPES])
    parser.add_argument("--m", type=int, default=64)
    args = parser.parse_args()
    mxfp4 = args.shape in MXFP4_SHAPES
    E, H, I, K, _ = (MXFP4_SHAPES if mxfp4 else MOE_SHAPES)[args.shape]
    torch.manual_seed(0)
    (w13,), (w2,) = experts(E, H, I, 1, mxfp4)  # MXFP4: in the GPU layout, as the engine's
    oss = gpt_oss_options(E, H, I) if mxfp4 else {}
    lora13, lora2 = lora_pool(E, H, I, 16, 16)
    x = torch.randn(args.m, H, dtype=DT, device=DEV)
    tw, ti = reference.route_topk(torch.randn(args.m, E, device=DEV), K, renormalize=True)
    for case in ("none", "distinct"):
        info = batch_info(args.m, case, 16)
        for _ in range(2):
            fused_moe(
                x, w13, w2, tw, ti, lora13=lora13, lora2=lora2, info=info, sum_topk=False, **oss
            )
        torch.cuda.synchronize()
        print(f"ran {case}", flush=True)


if __name__ == "__main__":
    main()
