"""Block-FP8 weights as Qwen3-*-FP8 and DeepSeek-V3 store them: float8_e4m3fn codes and one
float32 `weight_scale_inv` per 128 x 128 block of each [out, in] matrix (the last two axes; a
block at a ragged edge is cut short, so the scale grid is [ceil(N / 128), ceil(K / 128)]).

The torch quantize and dequantize here are the CPU path (weights dequantized once at load), the
online quantization's recipe and the tests' oracle; FP8 kernels are to read the same codes and
scales: Fp8Weight holds them for the fused MoE (kernels/moe/fp8.py). Legend: N = rows (out),
K = columns (in), BN x BK = the block (128 x 128).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite e4m3fn value
FP8_BLOCK = (128, 128)


def fp8_scale_shape(shape: tuple[int, ...] | torch.Size, block=FP8_BLOCK) -> tuple[int, ...]:
    """[..., N, K] -> [..., ceil(N / BN), ceil(K / BK)]: one scale per block, ragged edges too."""
    *lead, n, k = shape
    return (*lead, -(-n // block[0]), -(-k // block[1]))


def fp8_block_bytes(n: int, k: int) -> int:
    """Bytes of an [n, k] weight in block FP8: a byte a code, a float32 scale per block."""
    rows, cols = fp8_scale_shape((n, k))
    return n * k + 4 * rows * cols


def _per_element(scale: torch.Tensor, n: int, k: int, block) -> torch.Tensor:
    """[..., ceil(N / BN), ceil(K / BK)] -> [..., N, K]: each block's scale on its elements."""
    rows = scale.repeat_interleave(block[0], dim=-2)[..., :n, :]
    return rows.repeat_interleave(block[1], dim=-1)[..., :k]


def dequantize_fp8_block(
    codes: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype, block=FP8_BLOCK
) -> torch.Tensor:
    """Semantics: out[..., n, k] = f32(codes[..., n, k]) * f32(scale_inv[..., n // BN, k // BK]),
    rounded once to dtype: transformers' Fp8Dequantize (integrations/finegrained_fp8.py) in the
    same operations, so the values are its to the bit wherever it reads the same blocks (each
    dimension a multiple of 128, or within one block; across a ragged edge of several blocks it
    splits the dimension evenly by the grid, which is not what the releases mean).

    codes [..., N, K] float8_e4m3fn; scale_inv [..., ceil(N / BN), ceil(K / BK)] float.
    Returns [..., N, K] in dtype.
    """
    assert tuple(scale_inv.shape) == fp8_scale_shape(codes.shape, block), (
        codes.shape,
        scale_inv.shape,
    )
    if codes.dim() > 2:  # one matrix at a time: the float32 temporaries stay one expert's size
        out = torch.empty(codes.shape, dtype=dtype, device=codes.device)
        for i in range(codes.shape[0]):
            out[i] = dequantize_fp8_block(codes[i], scale_inv[i], dtype, block)
        return out
    n, k = codes.shape
    scale = _per_element(scale_inv.to(torch.float32), n, k, block)
    return (codes.to(torch.float32) * scale).to(dtype)


def quantize_fp8_block(w: torch.Tensor, block=FP8_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """Semantics: scale_inv[b] = amax(|w[b]|) / 448 for each block b (1 for a block of zeros),
    codes = e4m3(w / scale_inv[b]) rounded to nearest, all in float32: the block-FP8 releases'
    recipe, so dequantize_fp8_block(*quantize_fp8_block(w)) is w's block-quantized twin.

    w [..., N, K] any float dtype. Returns codes [..., N, K] float8_e4m3fn and scale_inv
    [..., ceil(N / BN), ceil(K / BK)] float32.
    """
    n, k = w.shape[-2:]
    *lead, rows, cols = fp8_scale_shape(w.shape, block)
    x = w.to(torch.float32)
    # zeros pad the ragged edge: they leave every block's amax as it is
    padded = F.pad(x, (0, cols * block[1] - k, 0, rows * block[0] - n))
    amax = padded.reshape(*lead, rows, block[0], cols, block[1]).abs().amax(dim=(-3, -1))
    scale_inv = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    scaled = x / _per_element(scale_inv, n, k, block)
    # a rounding of w / (amax / 448) may pass 448, and e4m3fn has no infinity: saturate
    return scaled.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale_inv


@dataclass(frozen=True)
class Fp8Weight:
    """The experts of one MoE linear, [E, N, K] in moelora's layout (w13 [E, 2I, H], w2
    [E, H, I]), kept in block FP8 for the fused MoE (kernels/moe/fp8.py reads the tiles):

      codes [E, N, K] float8_e4m3fn;
      scale_inv [E, ceil(N / 128), ceil(K / 128)] float32: expert e's element (n, k) is
        codes[e, n, k] * scale_inv[e, n // 128, k // 128].
    """

    codes: torch.Tensor
    scale_inv: torch.Tensor

    def __post_init__(self) -> None:
        assert self.codes.dim() == 3 and self.codes.dtype == FP8_DTYPE, self.codes.dtype
        assert self.scale_inv.dtype == torch.float32, self.scale_inv.dtype
        shape = fp8_scale_shape(self.codes.shape)
        assert tuple(self.scale_inv.shape) == shape, (self.codes.shape, self.scale_inv.shape)

    @property
    def shape(self) -> tuple[int, int, int]:
        """[E, N, K]: the shape of the weight it stands for."""
        return tuple(self.codes.shape)

    def is_contiguous(self) -> bool:
        return self.codes.is_contiguous() and self.scale_inv.is_contiguous()

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """[E, N, K] in dtype (dequantize_fp8_block)."""
        return dequantize_fp8_block(self.codes, self.scale_inv, dtype)
