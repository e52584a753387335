"""Projections of block-FP8 weights (e4m3 codes and a float32 scale a 128 x 128 block,
fp8_block.py): `fp8_linear`, on linear.py's batch-invariant kernel with its FP8 flag.

Each K tile of codes is multiplied by its rows' block scales in float32 and rounded once to
x's dtype, which are dequantize_fp8_block's values, before the same dot: the chain sees the
operands of the dequantized 16-bit weight in the same order, so its bits are dot_linear's on
that weight and as independent of the row count, at fp8_dot_config's warpgroup tiles (on the
GPU a tile of fewer than 64 rows or 4 warps sums a converted tile in another order). A tile
lies in one block of scales along K (BK divides 128). From FP8_DEQUANT_ROWS rows (prefill)
the weight is dequantized whole (`dequantize_fp8`, the same values) and cuBLAS takes the
product: past INVARIANT_ROWS, the chain's bits.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moelora.kernels import reference
from moelora.kernels.fp8_block import FP8_BLOCK, FP8_DTYPE, fp8_scale_shape
from moelora.kernels.linear import SCALE_K, SCALE_N, DotConfig, dot_config, launch_dot_linear
from moelora.kernels.pdl import pdl_kwargs, pdl_wait

# from here on (prefill) the weight is dequantized whole, then cuBLAS: at least INVARIANT_ROWS,
# where cuBLAS gives the chain's bits
FP8_DEQUANT_ROWS = 512


def fp8_dot_config(M: int, N: int) -> DotConfig:
    """Tiles of 64 rows at 4 warps or more: one warpgroup MMA, which reads the dequantized
    tile from shared memory, so each output's chain is the 16-bit weight's. A tile of fewer
    rows or warps takes the older MMA, which is fed the converted tile from registers and sums
    a 16-deep step in another order: a rounding apart, and a row's bits would then depend on
    the row count (tests/gpu/test_linear_fp8_gpu.py). K tiles at most 128 deep (one block of
    scales); a tile cut from 256 or 512 deep takes more stages, at most 8. Up to 16 rows:
    16-column slabs, so even a 2048-wide projection has 128 programs. Not yet swept."""
    if M <= 16:
        return DotConfig(64, 16, 128, 4, 8)
    config, depth = dot_config(M, N), FP8_BLOCK[1]
    block_k = min(config.block_k, depth)
    stages = min(8, config.num_stages * config.block_k // block_k)
    return DotConfig(64, config.block_n, block_k, max(4, config.num_warps), stages)


def _check_fp8_weight(codes: torch.Tensor, scale_inv: torch.Tensor) -> None:
    assert codes.dim() == 2 and codes.dtype == FP8_DTYPE and codes.stride(1) == 1, (
        f"codes must be [N, K] {FP8_DTYPE} with a unit last stride, got "
        f"{tuple(codes.shape)} {codes.dtype} strides {codes.stride()}"
    )
    scale_shape = fp8_scale_shape(codes.shape)
    assert tuple(scale_inv.shape) == scale_shape and scale_inv.dtype == torch.float32, (
        f"scale_inv must be {scale_shape} float32 for codes {tuple(codes.shape)}, "
        f"got {tuple(scale_inv.shape)} {scale_inv.dtype}"
    )
    assert scale_inv.is_contiguous(), f"scale_inv must be contiguous, got {scale_inv.stride()}"


def _check_fp8_operands(
    x: torch.Tensor, codes: torch.Tensor, scale_inv: torch.Tensor, bias: torch.Tensor | None
) -> None:
    _check_fp8_weight(codes, scale_inv)
    assert x.dim() == 2 and x.dtype in (torch.float16, torch.bfloat16) and x.stride(1) == 1, (
        f"x must be [M, K] float16/bfloat16 with a unit last stride, got "
        f"{tuple(x.shape)} {x.dtype} strides {x.stride()}"
    )
    N, K = codes.shape
    assert x.shape[1] == K, f"x {tuple(x.shape)} does not match codes {tuple(codes.shape)}"
    assert bias is None or (bias.shape == (N,) and bias.dtype == x.dtype), (
        f"bias must be [{N}] {x.dtype}, got {tuple(bias.shape)} {bias.dtype}"
    )


def fp8_linear(
    x: torch.Tensor,
    codes: torch.Tensor,
    scale_inv: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    config: DotConfig | None = None,
) -> torch.Tensor:
    """Semantics: y = x @ dequantize_fp8_block(codes, scale_inv, x.dtype).T (+ bias), to the
    bit dot_linear's on that weight (see the module docstring). From FP8_DEQUANT_ROWS rows
    the weight is dequantized whole (dequantize_fp8) and cuBLAS takes the product (config is
    then unused).

    x: [M, K] float16/bfloat16, unit last stride; codes: [N, K] float8_e4m3fn, unit last
    stride; scale_inv: [ceil(N / 128), ceil(K / 128)] float32, contiguous; bias: [N] in x's
    dtype or None; a float32 x (float32 models: no tensor-core rounding to match) takes the
    dequantized weight by cuBLAS at every row count. Returns y [M, N] in x's dtype."""
    if x.dtype == torch.float32:
        _check_fp8_weight(codes, scale_inv)
        return reference.linear(x, dequantize_fp8(codes, scale_inv, x.dtype), bias)
    _check_fp8_operands(x, codes, scale_inv, bias)
    M, K = x.shape
    N = codes.shape[0]
    if M == 0:
        return torch.empty(0, N, dtype=x.dtype, device=x.device)
    if M >= FP8_DEQUANT_ROWS:  # one pass over the weight is little beside a prefill's rows
        return reference.linear(x, dequantize_fp8(codes, scale_inv, x.dtype), bias)
    config = config or fp8_dot_config(M, N)
    depth = FP8_BLOCK[1]
    assert depth % config.block_k == 0, (
        f"block_k={config.block_k} must divide {depth}: a tile in one block of scales"
    )
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    launch_dot_linear(x, codes, scale_inv, bias, y, config)
    return y


@triton.jit
def _dequant_fp8_kernel(
    # Pointers.
    codes_ptr,  # [N, K] e4m3
    scale_ptr,  # [ceil(N / 128), ceil(K / 128)] float32
    out_ptr,  # [N, K]
    # Sizes and strides.
    N,
    K,
    stride_cn,
    stride_sn,  # scale_ptr's row stride (its last stride is 1)
    stride_on,
    PDL: tl.constexpr,
):
    """One program: the block of scales (program_id(0), program_id(1)), cut short at the
    edges."""
    # out may be memory the kernel before still reads (the allocator reuses it in stream
    # order): nothing is stored before the wait
    pdl_wait(PDL)
    bn, bk = tl.program_id(0), tl.program_id(1)
    offs_n = bn * SCALE_N + tl.arange(0, SCALE_N)
    offs_k = bk * SCALE_K + tl.arange(0, SCALE_K)
    ok = (offs_n < N)[:, None] & (offs_k < K)[None, :]
    rows = offs_n[:, None].to(tl.int64)
    codes = tl.load(codes_ptr + rows * stride_cn + offs_k[None, :], mask=ok, other=0.0)
    scale = tl.load(scale_ptr + bn * stride_sn + bk)
    # float32 product, one rounding: dequantize_fp8_block's operations
    out = codes.to(tl.float32) * scale
    tl.store(
        out_ptr + rows * stride_on + offs_k[None, :], out.to(out_ptr.dtype.element_ty), mask=ok
    )


def dequantize_fp8(
    codes: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """Semantics: dequantize_fp8_block(codes, scale_inv, dtype), to the bit.

    codes: [N, K] float8_e4m3fn, unit last stride; scale_inv: [ceil(N / 128), ceil(K / 128)]
    float32, contiguous. Returns [N, K] in dtype."""
    _check_fp8_weight(codes, scale_inv)
    N, K = codes.shape
    out = torch.empty(N, K, dtype=dtype, device=codes.device)
    if out.numel() == 0:
        return out
    _dequant_fp8_kernel[fp8_scale_shape(codes.shape)](
        codes_ptr=codes,
        scale_ptr=scale_inv,
        out_ptr=out,
        N=N,
        K=K,
        stride_cn=codes.stride(0),
        stride_sn=scale_inv.stride(0),
        stride_on=out.stride(0),
        num_warps=8,  # 64 elements of the 128 x 128 block a thread
        **pdl_kwargs(codes.device),
    )
    return out
