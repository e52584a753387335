"""The batch-invariant projection on block-FP8 weights (linear_fp8.fp8_linear) on the GPU, bf16, at
Qwen3-30B-A3B's attention shapes (q|k|v 5120 x 2048, o 2048 x 4096) and a ragged one (576 + 1536
rows, 2048 columns: the last block of rows is short), decode to prefill sizes.

Its rows are to the bit dot_linear's on the dequantized weight below FP8_DEQUANT_ROWS, and
cuBLAS's on it from there; dequantize_fp8 is the torch dequantization to the bit; a row's bits
do not depend on the row count; a CUDA-graph replay gives the eager bits.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():  # before any kernel module is imported (see kernels/conftest)
    pytest.skip("needs a CUDA device", allow_module_level=True)
pytest.importorskip("triton")

sys.path.insert(0, str(Path(__file__).parents[1] / "kernels"))
from cuda_graphs import capture  # noqa: E402
from lora_cases import fp8_weight, rel_err  # noqa: E402

from moelora.kernels import reference  # noqa: E402
from moelora.kernels.fp8_block import dequantize_fp8_block  # noqa: E402
from moelora.kernels.linear import dot_linear  # noqa: E402
from moelora.kernels.linear_fp8 import FP8_DEQUANT_ROWS, dequantize_fp8, fp8_linear  # noqa: E402

DEV = "cuda"
BF16 = torch.bfloat16
SHAPES = {"qkv": (5120, 2048), "o": (2048, 4096), "ragged": (576 + 1536, 2048)}  # (N, K)
ROWS = (1, 3, 8, 16, 33, 64, 127, 256, 600)  # decode to prefill; FP8_DEQUANT_ROWS is 512
OCTAVES = 4  # blocks' magnitudes 2^-2 .. 2^2 (lora_cases.fp8_weight)


@pytest.fixture(scope="module", params=list(SHAPES))
def weight(request):
    """(codes, scale_inv, the bf16 dequantized weight, a bias) of one shape."""
    torch.manual_seed(0)
    N, K = SHAPES[request.param]
    w = fp8_weight(1, N, K, OCTAVES, DEV)
    codes, scale_inv = w.codes[0], w.scale_inv[0]
    bias = torch.randn(N, device=DEV).to(BF16)
    yield codes, scale_inv, dequantize_fp8_block(codes, scale_inv, BF16), bias
    torch.cuda.empty_cache()


@pytest.mark.parametrize("M", ROWS)
@pytest.mark.parametrize("bias", [False, True])
def test_fp8_linear_is_the_dequantized_weights_product(weight, M, bias):
    """The chain of the dequantized weight's operands (dot_linear at its own tiles, which are
    deeper in K), or cuBLAS on that weight from FP8_DEQUANT_ROWS rows; near the fp32 product."""
    codes, scale_inv, w, b = weight
    b = b if bias else None
    x = torch.randn(M, codes.shape[1], device=DEV).to(BF16)
    y = fp8_linear(x, codes, scale_inv, b)
    want = dot_linear(x, w, b) if M < FP8_DEQUANT_ROWS else reference.linear(x, w, b)
    assert torch.equal(y, want), f"M={M}: {(y != want).sum().item()} differ"
    ref = reference.linear(x.float(), w.float(), None if b is None else b.float())
    assert rel_err(y, ref) <= 1e-2


@pytest.mark.parametrize("dtype", [BF16, torch.float16, torch.float32])
def test_dequantize_fp8_is_the_torch_dequantization(weight, dtype):
    codes, scale_inv, _, _ = weight
    out = dequantize_fp8(codes, scale_inv, dtype)
    assert torch.equal(out, dequantize_fp8_block(codes, scale_inv, dtype))


@pytest.mark.parametrize("bias", [False, True])
def test_fp8_linear_rows_do_not_depend_on_the_row_count(weight, bias):
    """A row's bits at every row count: across fp8_dot_config's tiles and the switch to the
    dequantized weight and cuBLAS at FP8_DEQUANT_ROWS."""
    codes, scale_inv, _, b = weight
    b = b if bias else None
    x = torch.randn(max(ROWS), codes.shape[1], device=DEV).to(BF16)
    first = fp8_linear(x[:3], codes, scale_inv, b)
    for M in (*ROWS, FP8_DEQUANT_ROWS - 1, FP8_DEQUANT_ROWS):
        rows = fp8_linear(x[:M], codes, scale_inv, b)[:3]
        assert torch.equal(rows, first[:M]), f"M={M}: {(rows != first[:M]).sum().item()} differ"


@pytest.mark.parametrize("M", [1, 16, 64, 600])
def test_fp8_linear_in_a_graph(weight, M):
    """A replay with new rows written in place gives the eager bits (the kernel waits for the
    kernel before under PDL; at 600 rows the dequantized weight is the graph's own buffer)."""
    codes, scale_inv, _, b = weight
    x = torch.empty(M, codes.shape[1], device=DEV, dtype=BF16)
    graph, out = capture(lambda: fp8_linear(x, codes, scale_inv, b))
    for _ in range(3):
        x.copy_(torch.randn(x.shape, device=DEV))
        graph.replay()
        assert torch.equal(out, fp8_linear(x, codes, scale_inv, b))
