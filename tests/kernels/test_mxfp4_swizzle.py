"""The fused MoE's GPU layout of MXFP4 codes (mxfp4_layout.SWIZZLE_SHIFTS): a bit permutation
within each group that undoes exactly, and from which the kernel's shifts and masks
(kernels/moe/mxfp4.e2m1_bf16_swizzled, PTX that runs on the GPU only) give every element's value.
The PTX's operations are modelled here in integer arithmetic, on every code."""

import pytest
import torch

from moelora.kernels.moe.mxfp4_layout import SCALE_ROW_GROUPS, SWIZZLE_SHIFTS, Mxfp4Weight
from moelora.kernels.reference import dense_experts, dequantize_mxfp4

MAGNITUDE, SIGN = 0x01C001C0, 0x80008000  # bits 6-8 and 15 of each bfloat16 half


def _weight(E: int, N: int, K: int, low: int = 100, high: int = 129) -> Mxfp4Weight:
    blocks = torch.randint(0, 256, (E, N, K // 2), dtype=torch.uint8)
    scales = torch.randint(low, high, (E, N, K // 32), dtype=torch.uint8)
    return Mxfp4Weight(blocks, scales).with_small_scales()


def _shift(w: torch.Tensor, d: int) -> torch.Tensor:
    """A 32-bit word shifted left by d, right by -d (zeros shifted in)."""
    return (w << d) & 0xFFFFFFFF if d >= 0 else w >> -d


def _decode(words: torch.Tensor) -> torch.Tensor:
    """[..., 4] words (int64 holding uint32) -> [..., 4 pairs, 2] float32 values times
    2^-126, as the PTX makes them: shift, mask, read each half as a bfloat16."""
    pairs = []
    for m, s in SWIZZLE_SHIFTS:
        out = (_shift(words, m) & MAGNITUDE) | (_shift(words, s) & SIGN)
        halves = torch.stack((out & 0xFFFF, out >> 16), dim=-1)  # bfloat16 bits
        pairs.append((halves << 16).to(torch.int32).view(torch.float32))
    return torch.stack(pairs, dim=-2)


@pytest.mark.parametrize("shape", [(2, 3, 64), (1, 5, 2880), (2, 2, 512)])
def test_swizzle_undoes_exactly(shape):
    w = _weight(*shape)
    release = w.blocks.clone()
    swizzled = w.swizzle_()
    assert swizzled.swizzled and swizzled.blocks is w.blocks  # rewritten in place
    assert not torch.equal(swizzled.blocks, release)
    assert torch.equal(swizzled.release_blocks(), release)
    # the scales: the same bytes, in rows padded with zeros to a multiple of 16 groups
    G = shape[2] // 32
    row = -(-G // SCALE_ROW_GROUPS) * SCALE_ROW_GROUPS
    assert swizzled.scales.stride() == (shape[1] * row, row, 1) and swizzled.is_contiguous()
    assert torch.equal(swizzled.scales, w.scales)
    padded = swizzled.scales.as_strided((shape[0], shape[1], row), (shape[1] * row, row, 1))
    assert not padded[..., G:].any()
    as_released = Mxfp4Weight(release, w.scales)
    want = dense_experts(as_released, torch.float32)
    assert torch.equal(dense_experts(swizzled, torch.float32), want)


def test_the_shifts_give_every_elements_value():
    """All 16 codes in every element position: the decoded pairs times 2^(s - 1) are
    dequantize_mxfp4's values, element (i, h) of word q being the group's element
    8q + 4 (i % 2) + i // 2 + 2h."""
    torch.manual_seed(0)
    G = 64
    codes = torch.randint(0, 16, (G, 32))
    codes[:16] = torch.arange(16)[:, None]  # each code everywhere
    blocks = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8).view(1, 1, G * 16)
    scales = torch.randint(100, 129, (1, 1, G), dtype=torch.uint8)
    w = Mxfp4Weight(blocks.clone(), scales).with_small_scales()
    want = dequantize_mxfp4(blocks.view(G, 16), scales.view(G), torch.float32).view(G, 32)
    words = w.swizzle_().blocks.view(G, 4, 4).to(torch.int64)
    words = (words << torch.tensor([0, 8, 16, 24])).sum(-1)  # little-endian
    got = _decode(words) * torch.exp2(scales.view(G, 1, 1, 1).float() - 1)  # [G, q, i, h]
    for q in range(4):
        for i in range(4):
            for h in range(2):
                k = 8 * q + 4 * (i % 2) + i // 2 + 2 * h
                assert torch.equal(got[:, q, i, h], want[:, k]), (q, i, h)


def test_swizzle_refuses_large_scales():
    w = _weight(1, 2, 64, low=120, high=140)
    assert not w.small_scales
    with pytest.raises(ValueError, match="at most 128"):
        w.swizzle_()
