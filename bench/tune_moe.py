"""Pick the fused MoE tiles per token-count bucket and write them to kernels/configs/ (JSON keyed
by shape and device). Times base-MoE CUDA-graph replays (L2 flushed), LoRA recorded with no slot
active, as the engine runs it; then checks the winner with one active adapter is not worse than
the runner-up by more than 5% (else takes the runner-up).

    PYTHONPATH=. python bench/tune_moe.py [--shapes qwen3-30b-a3b mixtral] [--ms 1 8 32 64 256]
"""

from __future__ import annotations

import argparse

import torch
from common import DEV, DT, MOE_SHAPES, batch_info, graph_ms, lora_pool

from moelora.kernels import reference
from moelora.kernels.fused_moe import fused_moe
from moelora.kernels.moe_config import MoeConfig, save_configs


def C(bm, bn, bk, bnd, bkd, warps=4, stages=3) -> MoeConfig:
    """A candidate: block_m, block_n, block_k; block_n_down, block_k_down; warps, stages."""
    return MoeConfig(bm, bn, bk, bnd, bkd, warps, stages)


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
# number of tokens in its step (BM and BN do not touch it).
PREFILL = [
    C(32, 64, 128, 64, 128),
    C(64, 64, 128, 64, 128),
    C(64, 64, 128, 128, 128, warps=8),
    C(64, 128, 128, 128, 128, warps=8, stages=2),
    C(128, 64, 128, 64, 128),
    C(128, 64, 128, 128, 128, warps=8),
    C(128, 128, 128, 128, 128, warps=8, stages=2),
]
CANDIDATES = {1: SMALL, 8: SMALL, 32: SMALL, 64: SMALL + LARGE[2:], 256: LARGE}
CANDIDATES |= {m: PREFILL for m in (512, 1024, 2048, 4096, 8192, 16384)}


def tune_shape(name: str, ms: list[int], layers: int) -> dict[int, MoeConfig]:
    E, H, I, K, _ = MOE_SHAPES[name]
    torch.manual_seed(0)
    w13 = [torch.randn(E, 2 * I, H, dtype=DT, device=DEV) * H**-0.5 for _ in range(layers)]
    w2 = [torch.randn(E, H, I, dtype=DT, device=DEV) * I**-0.5 for _ in range(layers)]
    pools = [lora_pool(E, H, I, 16, 16) for _ in range(layers)]
    best = {}
    for M in ms:
        x = torch.randn(M, H, dtype=DT, device=DEV)
        tw, ti = reference.route_topk(torch.randn(M, E, device=DEV), K, renormalize=True)

        def run(cfg, info, x=x, tw=tw, ti=ti):
            for i in range(layers):
                lora13, lora2 = pools[i]
                fused_moe(
                    x, w13[i], w2[i], tw, ti, lora13=lora13, lora2=lora2, info=info, config=cfg
                )

        none, one = batch_info(M, "none", 16), batch_info(M, "one", 16)
        timed = []
        for cfg in CANDIDATES[M]:
            try:
                timed.append((graph_ms(lambda cfg=cfg, i=none: run(cfg, i), layers), cfg))
            except Exception as e:  # a tile that does not fit (shared memory): skip it
                print(f"{name} M={M} {cfg}: {type(e).__name__}: {str(e)[:120]}", flush=True)
                continue
            print(f"{name} M={M} {1e3 * timed[-1][0]:8.1f} us  {cfg}", flush=True)
        timed.sort(key=lambda t: t[0])
        choice = timed[0][1]
        if len(timed) > 1:
            with_lora = [(graph_ms(lambda c=c, i=one: run(c, i), layers), c) for _, c in timed[:2]]
            if with_lora[0][0] > 1.05 * with_lora[1][0]:
                choice = with_lora[1][1]
        best[M] = choice
        print(f"{name} M={M} -> {choice}", flush=True)
    return best


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", nargs="+", choices=MOE_SHAPES, default=list(MOE_SHAPES))
    parser.add_argument("--ms", nargs="+", type=int, default=list(CANDIDATES), choices=CANDIDATES)
    parser.add_argument("--layers", type=int, default=2)
    args = parser.parse_args()
    for name in args.shapes:
        E, H, I, K, _ = MOE_SHAPES[name]
        best = tune_shape(name, args.ms, args.layers)
        torch.cuda.empty_cache()
        path = save_configs(torch.cuda.get_device_name(), E, H, I, K, best)
        print(f"wrote {path}", flush=True)


if __name__ == "__main__":
    main()
