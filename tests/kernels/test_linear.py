import pytest
import torch

from moelora.kernels import linear as skinny
from moelora.kernels import reference


def _inputs(M, N, K, dtype, *, row_stride=None, bias=False):
    x = torch.randn(M, row_stride or K, dtype=dtype)[:, :K]  # a row stride past K: a view
    w = (torch.randn(N, K) / K**0.5).to(dtype)
    b = torch.randn(N, dtype=dtype) if bias else None
    return x, w, b


SKINNY_CASES = [  # (N, K, config)
    (40, 96, None),
    (7, 64, skinny.SkinnyConfig(4, 1, 4)),
    (33, 200, skinny.SkinnyConfig(1, 5, 4)),
    (128, 256, skinny.SkinnyConfig(16, 3, 4)),
    (64, 128, skinny.SkinnyConfig(8, 8, 4)),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("M", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("N,K,config", SKINNY_CASES)
@pytest.mark.parametrize("bias", [False, True])
def test_skinny_linear_matches_reference(poison_empty, dtype, M, N, K, config, bias):
    x, w, b = _inputs(M, N, K, dtype, row_stride=K + 24 if M % 2 else None, bias=bias)
    y = skinny.skinny_linear(x, w, b, config=config)
    ref = reference.linear(x.float(), w.float(), None if b is None else b.float())
    assert y.dtype == dtype and y.shape == (M, N)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-3, atol=2e-3)
    torch.testing.assert_close(y.float(), ref, **tol)


def test_the_gemv_fits_only_within_its_limits():
    gemv_first = skinny.BatchInvariantLinear(skinny=True)
    for M, N, K in ((skinny.MAX_ROWS + 1, 24, 64), (2, 24, skinny.MAX_K + 16), (2, 5120, 32)):
        x, w, _ = _inputs(M, N, K, torch.float32)
        assert not skinny.fits(x, w)
        torch.testing.assert_close(gemv_first(x, w), reference.linear(x, w))
    x, w, _ = _inputs(4, 24, 64, torch.float32)
    assert skinny.fits(x, w) and not skinny.fits(x.t().contiguous().t(), w)
    assert not skinny.fits(x.half(), w)


SKINNY_CONFIGS = [  # (N, K, (block_n, programs, num_warps))
    (5120, 2048, (4, 528, 8)),
    (2048, 4096, (4, 264, 8)),
    (6144, 4096, (4, 264, 8)),
    (128, 2048, (1, 128, 4)),
    (1, 2048, (1, 1, 4)),
    (4096, 8192, (2, 264, 8)),
]


@pytest.mark.parametrize("N,K,config", SKINNY_CONFIGS)
def test_skinny_config(N, K, config):
    """Qwen3-30B-A3B's q|k|v, o and router, Mixtral's q|k|v, a gate, a K = 8192 down, on an
    H200's 132 SMs: 64K weights in flight an SM, and slabs narrow enough for every program."""
    assert skinny.skinny_config(N, K, 132) == config


@pytest.mark.parametrize("N,rows", [(5120, 1), (6144, 1), (4096, 2), (2048, 2), (128, 8), (1, 8)])
def test_max_rows(N, rows):
    """q|k|v at one token only, o up to 2 rows, a router or a gate up to MAX_ROWS."""
    assert skinny.max_rows(N) == rows


def test_the_engine_takes_the_gemv_for_16_bit_weights_unless_deterministic():
    """ "auto" (the default) takes the GEMV for bf16 and fp16 weights at the sizes it fits, and
    the batch-invariant kernels alone under deterministic inference, where a request's logits
    must not depend on its batch size (the GEMV's sums differ from the MMA chain's by a
    rounding). Each table is new: what a BatchInvariantLinear measures belongs to its engine."""
    from moelora.kernels.ops import REFERENCE_OPS, SKINNY_AUTO_DTYPES, make_ops

    cuda = torch.device("cuda")  # make_ops only reads the type: no GPU is touched
    default, again = make_ops(cuda).linear, make_ops(cuda).linear
    assert isinstance(default, skinny.BatchInvariantLinear) and default.skinny
    assert default.skinny_dtypes == SKINNY_AUTO_DTYPES == (torch.bfloat16, torch.float16)
    assert again is not default
    deterministic = make_ops(cuda, deterministic=True).linear
    assert isinstance(deterministic, skinny.BatchInvariantLinear) and not deterministic.skinny
    invariant = make_ops(cuda, projections="batch-invariant").linear
    assert isinstance(invariant, skinny.BatchInvariantLinear) and not invariant.skinny
    forced = make_ops(cuda, projections="skinny").linear
    assert forced.skinny and forced.skinny_dtypes is None
    assert make_ops(cuda, projections="cublas").linear is reference.linear
    assert make_ops(torch.device("cpu"), projections="skinny") is REFERENCE_OPS
    with pytest.raises(ValueError, match="projections='gemv' is invalid: expected one of"):
        make_ops(cuda, projections="gemv")


def test_auto_takes_the_gemv_for_16_bit_weights_only(monkeypatch):
    """ "auto"'s GEMV is for 16-bit weights: a float32 product of one row goes where the
    batch-invariant table sends it, a bf16 one to the GEMV (both kernels replaced by spies, so
    no GPU is needed)."""
    from moelora.kernels.ops import SKINNY_AUTO_DTYPES

    calls = []
    monkeypatch.setattr(skinny, "skinny_linear", lambda x, w, b: calls.append("gemv") or x)
    monkeypatch.setattr(skinny, "dot_linear", lambda x, w, b: calls.append("dot") or x)
    monkeypatch.setattr(skinny, "_dot_fits", lambda x, w: True)
    linear = skinny.BatchInvariantLinear(skinny=True, skinny_dtypes=SKINNY_AUTO_DTYPES)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        x, w = torch.randn(1, 64).to(dtype), torch.randn(32, 64).to(dtype)
        linear(x, w)
    assert calls == ["dot", "gemv", "gemv"]


@pytest.mark.parametrize("M", [1, 2, 3, 9, 17, 40, 70])
@pytest.mark.parametrize("N,K", [(40, 96), (7, 64), (33, 200)])
@pytest.mark.parametrize("bias", [False, True])
def test_dot_linear_matches_reference(poison_empty, M, N, K, bias):
    """The tensor-core kernel in fp16 (the interpreter computes bf16 wrongly): row counts
    across the config buckets, odd N and K (masked tails), a row-strided x."""
    x, w, b = _inputs(M, N, K, torch.float16, row_stride=K + 24 if M % 2 else None, bias=bias)
    ref = reference.linear(x.float(), w.float(), None if b is None else b.float())
    # the engine's config, and a small one that runs several programs both ways (70 rows:
    # five row blocks of 16) and several blocks of K
    for config in (None, skinny.DotConfig(16, 16, 32, 1, 2)):
        y = skinny.dot_linear(x, w, b, config=config)
        assert y.dtype == torch.float16 and y.shape == (M, N)
        torch.testing.assert_close(y.float(), ref, rtol=2e-3, atol=2e-3)


DOT_CONFIGS = [  # (M, N, (block_m, block_n, block_k, num_warps, num_stages))
    (1, 5120, (1, 16, 128, 2, 8)),
    (8, 6144, (8, 16, 128, 2, 8)),
    (24, 5120, (32, 64, 128, 8, 4)),
    (64, 5120, (64, 64, 128, 4, 4)),
    (2, 2048, (2, 8, 512, 1, 4)),
    (1, 128, (1, 8, 512, 1, 4)),
    (4, 2048, (4, 8, 256, 1, 8)),
    (13, 2048, (16, 16, 256, 2, 8)),
    (100, 2048, (64, 16, 128, 4, 8)),
    (1, 4096, (1, 8, 512, 1, 4)),
    (2, 4096, (2, 16, 128, 2, 8)),
    (32, 4096, (32, 32, 256, 4, 8)),
    (64, 4096, (64, 32, 128, 4, 8)),
]


@pytest.mark.parametrize("M,N,config", DOT_CONFIGS)
def test_dot_config(M, N, config):
    """Narrow one- and two-warp programs at few rows (more programs: each streams its slab
    alone), wider tiles as the rows grow; rows tile by 64 past 64."""
    assert skinny.dot_config(M, N) == config


def test_batch_invariant_linear_chooses_by_rows_and_by_what_it_measured(monkeypatch):
    """The kernel up to DOT_ROWS, cuBLAS from INVARIANT_ROWS and for fp32 or strided
    operands, and in between cuBLAS only at the row counts measured to match the kernel,
    measured once per projection shape (and bias or not)."""
    taken, measured = [], []
    monkeypatch.setattr(skinny, "dot_linear", lambda x, w, b: taken.append(x.shape[0]) or x @ w.T)
    monkeypatch.setattr(
        skinny, "measure_cublas_rows", lambda w, b: measured.append(w.shape) or frozenset({40})
    )
    linear = skinny.BatchInvariantLinear()
    w = torch.randn(24, 64, dtype=torch.float16)
    for M in (1, 16, 17, 40, 41, 127, 128, 300):
        linear(torch.randn(M, 64, dtype=torch.float16), w)
    linear(torch.randn(4, 64), w.float())  # fp32: cuBLAS
    linear(torch.randn(64, 4, dtype=torch.float16).t(), w)  # strided
    assert taken == [1, 16, 17, 41, 127]
    assert measured == [(24, 64)]  # once for this weight shape
    linear(torch.randn(20, 64, dtype=torch.float16), w, torch.randn(24, dtype=torch.float16))
    assert measured == [(24, 64)] * 2  # with a bias cuBLAS may take another kernel
    # the skinny table: the GEMV where it fits, else the rule above
    gemv = skinny.BatchInvariantLinear(skinny=True)
    y = gemv(torch.randn(2, 64, dtype=torch.float16), w)
    assert taken[-1] == 20 and y.shape == (2, 24)
    gemv(torch.randn(9, 64, dtype=torch.float16), w)
    assert taken[-1] == 9


def test_measure_cublas_rows_keeps_the_counts_where_the_bits_agree(monkeypatch):
    """A kernel that differs from cuBLAS at odd row counts: only the even ones are kept."""
    monkeypatch.setattr(
        skinny, "dot_linear", lambda x, w, b: reference.linear(x, w, b) + x.shape[0] % 2
    )
    w = torch.randn(8, 32, dtype=torch.float16)
    rows = skinny.measure_cublas_rows(w, None)
    expected = range(skinny.DOT_ROWS + 2, skinny.INVARIANT_ROWS, 2)
    assert rows == frozenset(expected)
    state = torch.random.get_rng_state()
    skinny.measure_cublas_rows(w, None)
    assert torch.equal(torch.random.get_rng_state(), state)  # sampling's RNG is left alone


def test_measure_cublas_rows_needs_every_draw_to_agree(monkeypatch):
    """A kernel equal to cuBLAS on the first random draw but not on the others at row counts
    past 64 (as a product that rounds otherwise can look on one draw): only the counts up to
    64 are kept."""
    first = []

    def dot(x, w, b):
        if not first:
            first.append(float(x[0, 0]))
        y = reference.linear(x, w, b)
        return y + 1 if x.shape[0] > 64 and float(x[0, 0]) != first[0] else y

    monkeypatch.setattr(skinny, "dot_linear", dot)
    rows = skinny.measure_cublas_rows(torch.randn(8, 32, dtype=torch.float16), None)
    assert rows == frozenset(range(skinny.DOT_ROWS + 1, 65))
