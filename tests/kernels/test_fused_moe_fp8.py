"""The fused MoE on block-FP8 experts (fp8_block.Fp8Weight, kernels/moe/fp8.py) against the torch
reference on their dequantized weights, in the interpreter.

Weights are quantized from random ones whose 128 x 128 blocks differ in magnitude by up to 2^6,
so a code tile scaled by another block's scale is far off (each case checks that the reference
on the scales shifted by one block, along N and along K, of either GEMM, is). Two shapes, each
with at least two blocks along N and along K in both GEMMs: H = I = 160, where every last block
is short and up's rows of W13 start inside a block (rows 160 .. 319 span blocks 1 and 2); and
H = I = 256, whole blocks only.
"""

import dataclasses

import pytest
import torch
from lora_cases import batch_info, fp8_weight, lora_weights, rel_err

from moelora.kernels import reference
from moelora.kernels.fp8_block import Fp8Weight
from moelora.kernels.moe.fused import MoeConfig, fused_moe

E, K, R = 4, 2, 16
OCTAVES = 6  # blocks' magnitudes 2^-3 .. 2^3 (lora_cases.fp8_weight)
SHAPES = {"ragged": (160, 160), "whole": (256, 256)}
TOL = {torch.float32: 1e-5, torch.float16: 5e-3}
# BK 32 and 64 sum several tiles into one block's partial (and past H, whole tiles masked);
# BN 32 puts a block edge inside gate_up's tiles of up
SMALL = MoeConfig(block_m=16, block_n=32, block_k=32, block_n_down=64, block_k_down=64)
# BK 128: one tile a block; down's BN 256 spans two blocks of rows (one short at H 160)
DEEP = MoeConfig(block_m=16, block_n=64, block_k=128, block_n_down=256, block_k_down=128)


def fp8_case(T: int, shape: str, spread: str, dtype: torch.dtype):
    """(x, w13, w2, topk_weights, topk_ids) with FP8 experts, and the LoRA on `spread`."""
    H, I = SHAPES[shape]
    x = torch.randn(T, H, dtype=dtype)
    w13, w2 = fp8_weight(E, 2 * I, H, OCTAVES), fp8_weight(E, H, I, OCTAVES)
    topk_weights, topk_ids = reference.route_topk(torch.randn(T, E), K, renormalize=True)
    info = batch_info(T, spread)
    ranks = info.rank_of_slot
    lora = dict(
        lora13=lora_weights(info.num_slots, (E,), 2, R, H, (I, I), ranks, dtype),
        lora2=lora_weights(info.num_slots, (E,), 1, R, I, (H,), ranks, dtype),
        info=info,
    )
    return (x, w13, w2, topk_weights, topk_ids), lora


def shifted(w: Fp8Weight, dim: int) -> Fp8Weight:
    """w with each block taking the scale of its neighbour along dim (1: N, 2: K)."""
    return Fp8Weight(w.codes, w.scale_inv.roll(1, dim))


@pytest.mark.parametrize("shape", list(SHAPES))
def test_the_cases_scale_blocks_matter(shape):
    """The reference on scales one block off, in either GEMM, along N or along K, is far from
    the right one: a kernel that reads a wrong block's scale fails the tests below."""
    args, lora = fp8_case(7, shape, "mixed", torch.float32)
    x, w13, w2, weights, ids = args
    want = reference.fused_moe(*args, **lora)
    for dim in (1, 2):
        for wrong in ((x, shifted(w13, dim), w2), (x, w13, shifted(w2, dim))):
            off = reference.fused_moe(*wrong, weights, ids, **lora)
            assert rel_err(off, want) > 0.05


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("config", [SMALL, DEEP], ids=["bk32", "bk128"])
def test_fused_moe_fp8_matches_reference(poison_empty, shape, dtype, config):
    """Mixed slots (some tokens on the base model), then the same batch without LoRA."""
    args, lora = fp8_case(7, shape, "mixed", dtype)
    want = reference.fused_moe(*args, **lora)
    assert rel_err(fused_moe(*args, **lora, config=config), want) <= TOL[dtype]
    assert rel_err(fused_moe(*args, config=config), reference.fused_moe(*args)) <= TOL[dtype]


@pytest.mark.parametrize("spread", ["distinct", "one"])
def test_fused_moe_fp8_default_and_deterministic_tiles(poison_empty, spread):
    """The default tiles (BK 64) at 1 token, and deterministic inference's (BK 128, 64-row
    blocks, the shrinks block by block) at 24 tokens, fp16, LoRA on."""
    args, lora = fp8_case(1, "ragged", spread, torch.float16)
    assert rel_err(fused_moe(*args, **lora), reference.fused_moe(*args, **lora)) <= 5e-3
    args, lora = fp8_case(24, "whole", spread, torch.float16)
    out = fused_moe(*args, **lora, config=SMALL, deterministic=True)
    assert rel_err(out, reference.fused_moe(*args, **lora)) <= 5e-3


def test_fused_moe_fp8_refuses_tiles_across_scale_blocks_and_mixed_experts():
    """BK must divide 128 (a tile within one block of scales), and w13 and w2 are both FP8."""
    args, _ = fp8_case(1, "ragged", "none", torch.float32)
    for bad in (dict(block_k=256), dict(block_k_down=96)):
        with pytest.raises(AssertionError):
            fused_moe(*args, config=dataclasses.replace(SMALL, **bad))
    x, w13, w2, weights, ids = args
    with pytest.raises(AssertionError):
        fused_moe(x, w13, w2.dequantize(torch.float32), weights, ids, config=SMALL)
