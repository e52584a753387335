"""MLA's absorption in Triton (kernels/attention/mla_absorb.py) vs its torch references
(kernels/mla.absorb_q, absorb_out), in the interpreter (conftest sets it): float32 weights (ieee
dots), float16 ones (q side plain, out side split into two parts), on fresh random inputs whose
rows are strided views as the layer passes them, at sizes that leave partial tiles.

Legend: T = tokens, Hh = heads, N = no-rope head dim, R = rope head dim, V = value head dim,
L = latent size.
"""

from __future__ import annotations

import pytest
import torch

from moelora.kernels import mla
from moelora.kernels.attention import mla_absorb

Hh, N, R, V, L = 3, 24, 8, 20, 80


def _kv_b(dtype: torch.dtype) -> torch.Tensor:
    return (torch.randn(Hh * (N + V), L) / L**0.5).to(dtype)


@pytest.mark.parametrize("T", [1, 5, 40])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_absorb_q_matches_reference(poison_empty, T, dtype):
    q = torch.randn(T, Hh, N + R).to(dtype)
    q_nope = q[..., :N]  # the layer's split of q: rows strided by N + R
    kv_b = _kv_b(dtype)
    got = mla_absorb.absorb_q(q_nope, kv_b)
    assert got.dtype == torch.float32 and got.shape == (T, Hh, L)
    torch.testing.assert_close(got, mla.absorb_q(q_nope, kv_b), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("T", [1, 5, 40])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_absorb_out_matches_reference(poison_empty, T, dtype):
    o_lat = torch.randn(T, Hh, L)  # the attention's float32 output: not exact in float16
    kv_b = _kv_b(dtype)
    got = mla_absorb.absorb_out(o_lat, kv_b, N)
    assert got.dtype == torch.float32 and got.shape == (T, Hh, V)
    want = mla.absorb_out(o_lat, kv_b, N)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    if dtype == torch.float16:  # the split's second part counts: the high part alone is off
        high = mla.absorb_out(o_lat.half().float(), kv_b, N)
        assert (high - want).abs().max() > 1e-4


def test_absorb_out_rounds_once_to_the_dtype_asked(poison_empty):
    """Without kv_b's LoRA the output is rounded in the kernel: the reference's float32 sums
    rounded to float16, not a second launch."""
    o_lat, kv_b = torch.randn(5, Hh, L), _kv_b(torch.float16)
    got = mla_absorb.absorb_out(o_lat, kv_b, N, torch.float16)
    assert got.dtype == torch.float16
    want = mla.absorb_out(o_lat, kv_b, N, torch.float16)
    torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3)


def test_row_block_fills_the_gpu_without_empty_blocks():
    """The token block: the rows' own (16 / 32 / 64) where they make FILL programs; smaller
    blocks where they would not (a decode step's out side); never one the rows half-fill."""
    fill = mla_absorb.FILL
    assert mla_absorb.row_block(4096, 2) == 64  # prefill: blocks of 64 make plenty
    assert mla_absorb.row_block(64, fill) == 64  # the q side's 8 column blocks x 16 heads
    assert mla_absorb.row_block(64, fill // 4) == 16  # the out side's 2 x 16: 4 blocks of 16
    assert mla_absorb.row_block(64, fill // 2) == 32
    assert mla_absorb.row_block(8, 1) == 16  # never below 16 rows (tl.dot's least)
    assert mla_absorb.row_block(20, fill) == 32  # 20 rows fill more than half of 32
    assert mla_absorb.row_block(30, fill // 2) == 16


def test_absorb_rejects_a_latent_of_another_size():
    with pytest.raises(AssertionError):
        mla_absorb.absorb_out(torch.randn(2, Hh, L + 1), _kv_b(torch.float32), N)


def test_blocks_of_expanded_sequences_are_skipped(poison_empty, monkeypatch):
    """A prefill step's rows of sequences that attend expanded (all their keys expanded) are
    not computed where a token block of 16 holds nothing else; every other row (a latent
    extend, padding, a block shared with one) equals the absorption without the skip, bit for
    bit."""
    monkeypatch.setattr(mla_absorb, "row_block", lambda T, programs: 16)
    seq_lens = torch.tensor([20, 40, 30], dtype=torch.int32)  # q_lens 20, 5, 30
    cu_q = torch.tensor([0, 20, 25, 55], dtype=torch.int32)
    cu_k = torch.tensor([0, 20, 20, 50], dtype=torch.int32)  # 0 and 2 expanded; 1 extends
    skip = mla_absorb.SkipExpanded(cu_q, seq_lens, cu_k)
    T, kv_b = 64, _kv_b(torch.float32)  # rows 55.. padded
    computed = torch.zeros(T, dtype=torch.bool)
    computed[16:32] = computed[48:] = True  # the blocks holding a latent or a padded row
    for side in ("q", "out"):
        if side == "q":
            rows = torch.randn(T, Hh, N + R)[..., :N]
            full, got = (mla_absorb.absorb_q(rows, kv_b, skip=s) for s in (None, skip))
        else:
            rows = torch.randn(T, Hh, L)
            full, got = (mla_absorb.absorb_out(rows, kv_b, N, skip=s) for s in (None, skip))
        assert torch.equal(got[computed], full[computed]), side
        assert torch.isnan(got[~computed]).all(), f"{side}: a block of expanded rows was computed"
