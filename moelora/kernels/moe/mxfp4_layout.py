"""MXFP4 expert weights kept packed: what the loader fills, the bench's floor counts and the
fused MoE reads (its kernels expand each tile in their main loop; the torch reference
dequantizes the whole tensor first: kernels/reference.dense_experts)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

MXFP4_GROUP = 32  # elements along K that share one scale byte
# Scale bytes up to this let the fused MoE expand a tile by bit placement and one multiply by
# 2^(s - 1) (kernels/moe/mxfp4.e2m1_bf16_placed), a normal bfloat16 only up to s = 128: a group
# whose largest weight is up to 12. Past it the tiles take table lookups.
PLACED_SCALE_MAX = 128

# The fused MoE's own layout of the codes on the GPU (Mxfp4Weight.swizzle_): the same bytes of
# each row, but each 32-element group's 16 bytes are 4 little-endian words whose bits are
# placed for kernels/moe/mxfp4.e2m1_bf16_swizzled. Word q holds the group's elements 8q .. 8q + 7 as
# 4 pairs, each one register of two bfloat16 for the mma (whose dots take the even elements
# apart from the odd: kernels/moe/mxfp4.lut_tile_dot):
#   pair i = elements 8q + 4 (i % 2) + (i // 2) + (0, 2),
# the first element in the low half (h = 0), the second in the high half (h = 1). Code bit t < 3
# of element (i, h) is at bit 6 + t - m + 16 h and its sign at 15 - s + 16 h, (m, s) =
# SWIZZLE_SHIFTS[i]: shifting the word left by m (right by -m) puts the pair's magnitude bits
# where a bfloat16 keeps its low exponent and top mantissa bits (6, 7, 8 of each half), by s its
# signs at bits 15 and 31. A left shift runs as a multiply on the FMA pipe (IMAD.SHL), a right
# one as a multiply's high word (IMAD.HI): a word's 8 values take 6 masks on the integer pipe and
# 5 multiplies, where rotations (no multiply rotates) keep 11 instructions on the integer pipe.
# No placement by plain shifts has fewer masks: 4 translates of one pair's bits cannot tile the
# word, so two pairs take their signs from another shift.
SWIZZLE_SHIFTS = ((6, 6), (3, 3), (0, 4), (-7, 5))
# In the GPU layout each expert row's scale bytes are padded with zeros to a multiple of this
# many groups: rows start 16-byte aligned and a tile up to 512 deep (16 groups) never reads past
# its row, so the kernels load a tile's scales without a mask along K: from 128-deep tiles on,
# 4 to 8 bytes a thread through the pipeline's asynchronous copies (rows of 90 bytes, as
# released, are 2-byte aligned: their scales load a byte at a time, waited on each tile).
SCALE_ROW_GROUPS = 16


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
    swizzled: blocks are in the fused MoE's GPU layout (SWIZZLE_SHIFTS; swizzle_), which
    only its bfloat16 kernels on CUDA read; release_blocks() gives them back as released. The
    scales are then a view [E, N, K/32] of rows padded to SCALE_ROW_GROUPS.
    """

    blocks: torch.Tensor
    scales: torch.Tensor
    small_scales: bool = False
    swizzled: bool = False

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
        """Blocks contiguous, scale rows contiguous and evenly spaced (padded or not)."""
        s = self.scales
        rows = s.stride(2) == 1 and s.stride(0) == s.shape[1] * s.stride(1)
        return self.blocks.is_contiguous() and rows and s.stride(1) >= s.shape[2]

    def with_small_scales(self) -> Mxfp4Weight:
        """The same bytes, small_scales set from them (one reduction and a host sync: call
        once, after loading)."""
        small = bool(self.scales.max() <= PLACED_SCALE_MAX) if self.scales.numel() else True
        return dataclasses.replace(self, small_scales=small)

    def swizzle_(self) -> Mxfp4Weight:
        """The same weight with its blocks rewritten in place into the fused MoE's GPU layout
        (16 MB of them at a time, about 0.5 GB of scratch), its scales copied into padded rows
        (the caller drops the old ones). Only for small scales: the layout is read by the
        bit placement alone."""
        if not self.small_scales:
            raise ValueError(
                f"MXFP4 scale bytes up to {int(self.scales.max())}: the GPU layout needs every "
                f"one at most {PLACED_SCALE_MAX} (call with_small_scales first)"
            )
        if self.swizzled:
            return self
        _permute_rows_(self.blocks, _SWIZZLE_SOURCE)
        E, N, G = self.scales.shape
        padded = self.scales.new_zeros(E, N, -(-G // SCALE_ROW_GROUPS) * SCALE_ROW_GROUPS)
        padded[..., :G] = self.scales
        return dataclasses.replace(self, scales=padded[..., :G], swizzled=True)

    def release_blocks(self) -> torch.Tensor:
        """blocks in the release's layout: themselves, or a copy put back from the GPU's."""
        if not self.swizzled:
            return self.blocks
        out = self.blocks.clone()
        _permute_rows_(out, _UNSWIZZLE_SOURCE)
        return out


def mxfp4_bytes(n: int, k: int) -> int:
    """Bytes of an [n, k] weight in MXFP4: half a byte an element, one scale byte per 32."""
    return n * k // 2 + n * k // MXFP4_GROUP


def _swizzle_source() -> torch.Tensor:
    """[128]: for each bit of a group's 16 bytes in the GPU layout (8 * byte + bit), the bit of
    the release's group it comes from (element k's code bit t is release bit 4 k + t)."""
    source = [-1] * 128
    for q in range(4):
        for i, (m, s) in enumerate(SWIZZLE_SHIFTS):
            for h in range(2):
                k = 8 * q + 4 * (i % 2) + i // 2 + 2 * h
                for t, at in enumerate((6 - m, 7 - m, 8 - m, 15 - s)):
                    source[32 * q + at + 16 * h] = 4 * k + t
    assert sorted(source) == list(range(128)), source
    return torch.tensor(source)


_SWIZZLE_SOURCE = _swizzle_source()
_UNSWIZZLE_SOURCE = torch.argsort(_SWIZZLE_SOURCE)
_PERMUTE_CHUNK = 1 << 20  # groups a step of _permute_rows_ holds as bits (128 MB)


def _permute_rows_(blocks: torch.Tensor, source: torch.Tensor) -> None:
    """Each 16-byte group of blocks [..., K/2] gets bit j := its old bit source[j], in place."""
    groups = blocks.view(-1, MXFP4_GROUP // 2)
    source = source.to(blocks.device)
    shifts = torch.arange(8, device=blocks.device, dtype=torch.uint8)
    for start in range(0, groups.shape[0], _PERMUTE_CHUNK):
        chunk = groups[start : start + _PERMUTE_CHUNK]
        bits = ((chunk[:, :, None] >> shifts) & 1).flatten(1)  # [n, 128], bit 8 b + j
        bits = bits[:, source].view(-1, 16, 8)
        chunk.copy_((bits << shifts).sum(-1, dtype=torch.int32).to(torch.uint8))
