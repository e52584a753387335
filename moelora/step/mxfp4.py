"""MXFP4 expert weights kept packed: what the loader fills, the bench's floor counts and the
fused MoE reads (its kernels expand each tile in their main loop; the torch reference
dequantizes the whole tensor first: kernels/reference.dense_experts)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

MXFP4_GROUP = 32  # elements along K that share one scale byte
# Scale bytes up to this let the fused MoE expand a tile by bit placement and one multiply by
# 2^(s - 1) (kernels/mxfp4.e2m1_bf16_placed), a normal bfloat16 only up to s = 128: a group
# whose largest weight is up to 12. Past it the tiles take table lookups.
PLACED_SCALE_MAX = 128


@dataclass(frozen=True)
class Mxfp4Weight:
    """The experts of one MoE linear, [E, N, K] in moelora's layout (w13 [E, 2I, H], w2
    [E, H, I]), packed along K, the axis GPT-OSS's release packs (its input axis):

      blocks [E, N, K/2] uint8: element k of a row is byte k // 2's low nibble for even k, its
        high nibble for odd k; a nibble is an e2m1 code (reference.FP4_VALUES);
      scales [E, N, K/32] uint8 (E8M0): elements 32 g .. 32 g + 31 are scaled by
        2 ** (scales[..., g] - 127).

    small_scales: every scale byte is at most PLACED_SCALE_MAX, as with_small_scales found
    once the bytes were loaded (False until then: the tiles take the lookups, exact for any).
    """

    blocks: torch.Tensor
    scales: torch.Tensor
    small_scales: bool = False

    def __post_init__(self) -> None:
        E, N, half = self.blocks.shape
        assert self.blocks.dtype == self.scales.dtype == torch.uint8, self.blocks.dtype
        assert half % (MXFP4_GROUP // 2) == 0, self.blocks.shape
        assert self.scales.shape == (E, N, 2 * half // MXFP4_GROUP), self.scales.shape

    @property
    def shape(self) -> tuple[int, int, int]:
        """[E, N, K]: the shape of the weight it stands for."""
        E, N, half = self.blocks.shape
        return E, N, 2 * half

    def is_contiguous(self) -> bool:
        return self.blocks.is_contiguous() and self.scales.is_contiguous()

    def with_small_scales(self) -> Mxfp4Weight:
        """The same bytes, small_scales set from them (one reduction and a host sync: call
        once, after loading)."""
        small = bool(self.scales.max() <= PLACED_SCALE_MAX) if self.scales.numel() else True
        return dataclasses.replace(self, small_scales=small)


def mxfp4_bytes(n: int, k: int) -> int:
    """Bytes of an [n, k] weight in MXFP4: half a byte an element, one scale byte per 32."""
    return n * k // 2 + n * k // MXFP4_GROUP
