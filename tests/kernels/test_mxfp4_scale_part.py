"""kernels/moe/mxfp4._scale_part, which hands each sub-tile its rows of a tile's scale bytes loaded
at once: every part of every split, in the interpreter."""

import pytest
import torch
import triton
import triton.language as tl

from moelora.kernels.moe.mxfp4 import _scale_part


@triton.jit
def _parts_kernel(in_ptr, out_ptr, G: tl.constexpr, BN: tl.constexpr, NSUB: tl.constexpr):
    rows = tl.arange(0, NSUB * G)[:, None]
    cols = tl.arange(0, BN)[None, :]
    scales = tl.load(in_ptr + rows * BN + cols)
    part_rows = tl.arange(0, G)[:, None]
    for s in tl.static_range(NSUB):
        tl.store(out_ptr + (s * G + part_rows) * BN + cols, _scale_part(scales, s, NSUB))


@pytest.mark.parametrize("nsub", [1, 2, 4])
@pytest.mark.parametrize("G", [1, 2, 4])
def test_scale_part_gives_each_sub_tile_its_rows(nsub, G):
    BN = 16
    scales = torch.randint(0, 256, (nsub * G, BN), dtype=torch.int32)
    out = torch.full_like(scales, -1)
    _parts_kernel[(1,)](in_ptr=scales, out_ptr=out, G=G, BN=BN, NSUB=nsub)
    assert torch.equal(out, scales)  # part s of the split is rows s G .. s G + G - 1
