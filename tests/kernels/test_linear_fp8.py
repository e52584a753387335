"""The batch-invariant projection on block-FP8 weights (linear_fp8.fp8_linear, dequantize_fp8)
against the torch reference, in the interpreter, in float16 (it computes bfloat16 wrongly).

Weights are quantized from random ones whose 128 x 128 blocks differ in magnitude by up to 2^6
(lora_cases.fp8_weight), so a tile scaled by another block's scale is far off. Two shapes:
N = 200, K = 300, every last block short (along N and K); N = K = 256, whole blocks only.
Beyond the reference's tolerance, the kernel's output is dot_linear's on the dequantized
weight to the bit, at the same tiles: the same chain over K of the same operands.
"""

import pytest
import torch
from lora_cases import fp8_weight, rel_err

from moelora.kernels import linear, linear_fp8, reference
from moelora.kernels.fp8_block import dequantize_fp8_block
from moelora.kernels.linear import DotConfig
from moelora.kernels.linear_fp8 import dequantize_fp8, fp8_dot_config, fp8_linear

OCTAVES = 6  # blocks' magnitudes 2^-3 .. 2^3
SHAPES = {"ragged": (200, 300), "whole": (256, 256)}
TOL = 5e-3  # float16 outputs against the float16 reference (tests/kernels/test_fused_moe_fp8.py)
CONFIGS = {  # (block_m, block_n, block_k, num_warps, num_stages); None: fp8_dot_config's
    "default": None,
    # several blocks of K in one block of scales, and BN 32 across the N = 200 edge
    "bk64": DotConfig(16, 32, 64, 1, 2),
    # one tile a block of scales, 16 rows of 17 in a second row block
    "bk128": DotConfig(16, 16, 128, 2, 2),
}


def fp8_case(M: int, shape: str, *, bias: bool):
    """(x, codes, scale_inv, bias) in float16."""
    N, K = SHAPES[shape]
    w = fp8_weight(1, N, K, OCTAVES)
    x = torch.randn(M, K, dtype=torch.float16)
    b = torch.randn(N, dtype=torch.float16) if bias else None
    return x, w.codes[0], w.scale_inv[0], b


@pytest.mark.parametrize("shape", list(SHAPES))
def test_the_cases_scale_blocks_matter(shape):
    """The reference on scales one block off, along N or along K, is far from the right one:
    a kernel that reads a wrong block's scale fails the tests below."""
    x, codes, scale_inv, _ = fp8_case(5, shape, bias=False)
    want = reference.linear_fp8(x.float(), codes, scale_inv)
    for dim in (0, 1):
        off = reference.linear_fp8(x.float(), codes, scale_inv.roll(1, dim))
        assert rel_err(off, want) > 0.05


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("M", [1, 5, 17])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_fp8_linear_matches_reference(poison_empty, shape, M, bias, config):
    x, codes, scale_inv, b = fp8_case(M, shape, bias=bias)
    tiles = CONFIGS[config] or fp8_dot_config(M, codes.shape[0])
    y = fp8_linear(x, codes, scale_inv, b, config=CONFIGS[config])
    assert y.dtype == torch.float16 and y.shape == (M, codes.shape[0])
    assert rel_err(y, reference.linear_fp8(x, codes, scale_inv, b)) <= TOL
    w = dequantize_fp8_block(codes, scale_inv, torch.float16)
    assert torch.equal(y, linear.dot_linear(x, w, b, config=tiles))


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("N,K", [(200, 300), (128, 256), (1, 5), (129, 257)])
def test_dequantize_fp8_is_the_torch_dequantization(poison_empty, N, K, dtype):
    """Every element, the short blocks at the edges included, to the bit."""
    w = fp8_weight(1, N, K, OCTAVES)
    codes, scale_inv = w.codes[0], w.scale_inv[0]
    out = dequantize_fp8(codes, scale_inv, dtype)
    assert torch.equal(out, dequantize_fp8_block(codes, scale_inv, dtype))


@pytest.mark.parametrize("bias", [False, True])
def test_prefill_rows_take_the_whole_dequantized_weight(monkeypatch, bias):
    """From FP8_DEQUANT_ROWS rows the weight is dequantized by dequantize_fp8, once, and the
    product is reference.linear's on it; below, the kernel reads the codes."""
    monkeypatch.setattr(linear_fp8, "FP8_DEQUANT_ROWS", 4)
    calls = []
    spy = lambda *args: calls.append(args[0].shape) or dequantize_fp8(*args)  # noqa: E731
    monkeypatch.setattr(linear_fp8, "dequantize_fp8", spy)
    x, codes, scale_inv, b = fp8_case(5, "ragged", bias=bias)
    y = fp8_linear(x, codes, scale_inv, b)
    w = dequantize_fp8_block(codes, scale_inv, torch.float16)
    assert calls == [codes.shape]
    assert torch.equal(y, reference.linear(x, w, b))
    fp8_linear(x[:3], codes, scale_inv, b)
    assert calls == [codes.shape]


def test_no_rows_give_an_empty_product():
    x, codes, scale_inv, _ = fp8_case(0, "ragged", bias=False)
    assert fp8_linear(x, codes, scale_inv).shape == (0, codes.shape[0])


def test_fp8_linear_refuses_mismatched_operands():
    """A scale grid of another shape, codes that are not e4m3, a tile across blocks of scales,
    x of another width: each named in the message."""
    x, codes, scale_inv, _ = fp8_case(3, "ragged", bias=False)
    with pytest.raises(AssertionError, match=r"scale_inv must be \(2, 3\) float32"):
        fp8_linear(x, codes, scale_inv[:, :2].contiguous())
    with pytest.raises(AssertionError, match="scale_inv must be contiguous"):
        fp8_linear(x, codes, scale_inv.t().contiguous().t())
    with pytest.raises(AssertionError, match="codes must be \\[N, K\\] torch.float8_e4m3fn"):
        fp8_linear(x, codes.to(torch.float16), scale_inv)
    with pytest.raises(AssertionError, match="block_k=256 must divide 128"):
        fp8_linear(x, codes, scale_inv, config=DotConfig(16, 16, 256, 1, 2))
    with pytest.raises(AssertionError, match=r"x \(3, 299\) does not match codes \(200, 300\)"):
        fp8_linear(x[:, :299], codes, scale_inv)
    with pytest.raises(AssertionError, match="codes must be"):
        dequantize_fp8(codes.to(torch.float16), scale_inv, torch.float16)


FP8_CONFIGS = [  # (M, N, (block_m, block_n, block_k, num_warps, num_stages))
    (1, 5120, (64, 16, 128, 4, 8)),  # up to 16 rows: one tile for every width
    (16, 2048, (64, 16, 128, 4, 8)),
    (64, 5120, (64, 64, 128, 4, 4)),  # dot_config's, 128 deep already
    (17, 2048, (64, 16, 128, 4, 8)),  # dot_config's 32 rows and 4 warps: 64 rows
    (24, 5120, (64, 64, 128, 8, 4)),  # 8 warps kept
    (32, 4096, (64, 32, 128, 4, 8)),  # 256 deep, 8 stages: 16, capped
]


@pytest.mark.parametrize("M,N,config", FP8_CONFIGS)
def test_fp8_dot_config(M, N, config):
    """64-row tiles at 4 warps or more (one warpgroup MMA), at most 128 deep, with more stages
    (at most 8) where cut."""
    assert fp8_dot_config(M, N) == config


def test_a_float32_x_takes_the_dequantized_weight():
    """float32 models (the GPU's comparisons with transformers): the dequantized weight by the
    torch product, no tensor-core rounding."""
    x, codes, scale_inv, b = fp8_case(5, "ragged", bias=True)
    x, b = x.float(), b.float()
    y = fp8_linear(x, codes, scale_inv, b)
    assert y.dtype == torch.float32
    assert torch.allclose(y, reference.linear_fp8(x, codes, scale_inv, b), rtol=1e-5, atol=1e-5)
