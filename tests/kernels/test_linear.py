import pytest
import torch

from moelora.kernels import linear as skinny
from moelora.kernels import reference


def _inputs(M, N, K, dtype, *, row_stride=None, bias=False):
    x = torch.randn(M, row_stride or K, dtype=dtype)[:, :K]  # a row stride past K: a view
    w = (torch.randn(N, K) / K**0.5).to(dtype)
    b = torch.randn(N, dtype=dtype) if bias else None
    return x, w, b


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("M", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("N,K,config", [
    (40, 96, None), (7, 64, skinny.SkinnyConfig(4, 1, 4)), (33, 200, skinny.SkinnyConfig(1, 5, 4)),
    (128, 256, skinny.SkinnyConfig(16, 3, 4)), (64, 128, skinny.SkinnyConfig(8, 8, 4)),
])  # fmt: skip
@pytest.mark.parametrize("bias", [False, True])
def test_skinny_linear_matches_reference(poison_empty, dtype, M, N, K, config, bias):
    x, w, b = _inputs(M, N, K, dtype, row_stride=K + 24 if M % 2 else None, bias=bias)
    y = skinny.skinny_linear(x, w, b, config=config)
    ref = reference.linear(x.float(), w.float(), None if b is None else b.float())
    assert y.dtype == dtype and y.shape == (M, N)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-3, atol=2e-3)
    torch.testing.assert_close(y.float(), ref, **tol)


def test_linear_takes_cublas_past_the_skinny_limits():
    for M, N, K in ((skinny.MAX_ROWS + 1, 24, 64), (2, 24, skinny.MAX_K + 16), (2, 5120, 32)):
        x, w, _ = _inputs(M, N, K, torch.float32)
        assert not skinny.fits(x, w)
        torch.testing.assert_close(skinny.linear(x, w), reference.linear(x, w))
    x, w, _ = _inputs(4, 24, 64, torch.float32)
    assert skinny.fits(x, w) and not skinny.fits(x.t().contiguous().t(), w)
    assert not skinny.fits(x.half(), w)


@pytest.mark.parametrize("N,K,config", [
    (5120, 2048, (4, 528, 8)), (2048, 4096, (4, 264, 8)), (6144, 4096, (4, 264, 8)),
    (128, 2048, (1, 128, 4)), (1, 2048, (1, 1, 4)), (4096, 8192, (2, 264, 8)),
])  # fmt: skip
def test_skinny_config(N, K, config):
    """Qwen3-30B-A3B's q|k|v, o and router, Mixtral's q|k|v, a gate, a K = 8192 down, on an
    H200's 132 SMs: 64K weights in flight an SM, and slabs narrow enough for every program."""
    assert skinny.skinny_config(N, K, 132) == config


@pytest.mark.parametrize("N,rows", [(5120, 1), (6144, 1), (4096, 2), (2048, 2), (128, 8), (1, 8)])
def test_max_rows(N, rows):
    """q|k|v at one token only, o up to 2 rows, a router or a gate up to MAX_ROWS."""
    assert skinny.max_rows(N) == rows


def test_the_engine_takes_the_skinny_kernel_only_when_asked():
    """cuBLAS by default: the skinny kernel's sums differ from cuBLAS's by a bf16 rounding, so
    a request's logits would depend on its batch size (EngineConfig.skinny_projections)."""
    from moelora.kernels import triton_ops
    from moelora.kernels.ops import make_ops

    cuda = torch.device("cuda")  # make_ops only reads the type: no GPU is touched
    assert make_ops(cuda) is triton_ops.TRITON_OPS
    assert make_ops(cuda, skinny_projections=True) is triton_ops.SKINNY_OPS
    assert triton_ops.TRITON_OPS.linear is reference.linear
    assert triton_ops.SKINNY_OPS.linear is skinny.linear
