"""MXFP4 expert weights kept packed: what the loader fills, the bench's floor counts and the
fused MoE reads (its kernels expand each tile in their main loop; the torch reference
dequantizes the whole tensor first: kernels/reference.dense_experts)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

MXFP4_GROUP = 32  # elements along K that share one scale byte


@dataclass(frozen=True)
class Mxfp4Weight:
    """The experts of one MoE linear, [E, N, K] in moelora's layout (w13 [E, 2I, H], w2
    [E, H, I]), packed along K, the axis GPT-OSS's release packs (its input axis):

      blocks [E, N, K/2] uint8: element k of a row is byte k // 2's low nibble for even k, its
        high nibble for odd k; a nibble is an e2m1 code (reference.FP4_VALUES);
      scales [E, N, K/32] uint8 (E8M0): elements 32 g .. 32 g + 31 are scaled by
        2 ** (scales[..., g] - 127).
    """

    blocks: torch.Tensor
    scales: torch.Tensor

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


def mxfp4_bytes(n: int, k: int) -> int:
    """Bytes of an [n, k] weight in MXFP4: half a byte an element, one scale byte per 32."""
    return n * k // 2 + n * k // MXFP4_GROUP
