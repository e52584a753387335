import pytest
import torch
from lora_cases import SPREADS, batch_info, compact_weights, lora_weights, rel_err

from moelora.kernels import reference
from moelora.kernels.lora import add_lora_, lora_shrink_split

TOL = {torch.float32: 1e-5, torch.float16: 5e-3}
# o / gate|up / q|k|v (GQA: small k, v) / Qwen3.5's in_proj (qkv|z|b|a: two launches)
# up to 4 slices take one launch (Qwen3.5's in_proj); 5: two launches, the second at slice 4
SLICES = {1: (48,), 2: (40, 40), 3: (64, 16, 16), 4: (80, 48, 4, 4), 5: (80, 48, 4, 4, 24)}


@pytest.mark.parametrize("T", [1, 7, 64])
@pytest.mark.parametrize("n", [1, 2, 3, 4])
@pytest.mark.parametrize("spread", SPREADS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_add_lora_matches_reference(T, n, spread, dtype):
    H, R = 48, 16
    info = batch_info(T, spread)
    lora = lora_weights(info.num_slots, (), n, R, H, SLICES[n], info.rank_of_slot, dtype)
    x = torch.randn(T, H, dtype=dtype)
    y = torch.randn(T, sum(SLICES[n]), dtype=dtype)
    ref = reference.add_lora_(y.clone(), x, lora, info)
    y_out = y.clone()
    returned = add_lora_(y_out, x, lora, info)
    assert returned is y_out
    if spread == "none":
        assert torch.equal(y_out, y)
    else:
        assert rel_err(y_out - y, ref - y) <= TOL[dtype]
    untouched = (info.slot_of_token < 0) | (info.slot_enabled[info.slot_of_token.clamp(min=0)] == 0)
    assert torch.equal(y_out[untouched], y[untouched])


@pytest.mark.parametrize("spread", ["mixed", "distinct"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_add_lora_prefill_tiles(monkeypatch, spread, dtype):
    """Past PREFILL_ROWS rows (lowered to 8 here) the programs take 64 rows and 512 columns
    (1024 where the grid is large: tested on the GPU), 128 deep: 70 rows give a partial row
    tile, 160 inputs a partial input tile, and a slice is wider than one column group."""
    from moelora.kernels import lora as module

    monkeypatch.setattr(module, "PREFILL_ROWS", 8)
    T, H, R, slices = 70, 160, 16, (1100, 64, 64)
    info = batch_info(T, spread)
    lora = lora_weights(info.num_slots, (), 3, R, H, slices, info.rank_of_slot, dtype)
    x = torch.randn(T, H, dtype=dtype)
    y = torch.randn(T, sum(slices), dtype=dtype)
    ref = reference.add_lora_(y.clone(), x, lora, info)
    out = add_lora_(y.clone(), x, lora, info)
    assert rel_err(out - y, ref - y) <= TOL[dtype]


def test_add_lora_tiles_replace_the_defaults_launch_options(monkeypatch):
    """On a device whose grid fills its multiprocessors the prefill tile caps registers and
    stages; a benchmark's candidate tile runs with its own launch options, not those."""
    from moelora.kernels import lora as module

    launches = []

    class Recorder:
        def __getitem__(self, grid):
            return lambda **kwargs: launches.append(kwargs)

    monkeypatch.setattr(module, "_add_lora_kernel", Recorder())
    monkeypatch.setattr(module, "multiprocessors", lambda device: 1)
    monkeypatch.setattr(module, "PREFILL_ROWS", 8)
    T, H, slices = 70, 64, (64, 16, 16)
    info = batch_info(T, "mixed")
    lora = lora_weights(info.num_slots, (), 3, 16, H, slices, info.rank_of_slot, torch.float32)
    x, y = torch.randn(T, H), torch.randn(T, sum(slices))
    add_lora_(y, x, lora, info)
    add_lora_(y, x, lora, info, tiles=dict(BT=64, CW=512, BK=128))
    add_lora_(y, x, lora, info, tiles=dict(BT=64, CW=1024, BK=128, num_stages=3))
    assert (launches[0]["maxnreg"], launches[0]["num_stages"]) == (168, 2)
    assert "maxnreg" not in launches[1] and "num_stages" not in launches[1]
    assert "maxnreg" not in launches[2] and launches[2]["num_stages"] == 3


def test_add_lora_prefill_tiles_take_the_steps_rank_tile(monkeypatch):
    """Prefill tiles (PREFILL_ROWS lowered to 8) take the step's rank tile
    (LoraBatchInfo.rank_tile 16 in a rank-64 pool): the pool tile's output, nothing read past
    rank 16 (NaN there); below PREFILL_ROWS rows the pool's tile stays."""
    import dataclasses

    from moelora.kernels import lora as module

    T, H, R, slices = 40, 96, 64, (64, 16, 16)
    info = batch_info(T, "mixed")  # slot ranks at most 16
    assert int(info.rank_of_slot.max()) <= 16
    lora = lora_weights(info.num_slots, (), 3, R, H, slices, info.rank_of_slot, torch.float32)
    x, y = torch.randn(T, H), torch.randn(T, sum(slices))
    expect = reference.add_lora_(y.clone(), x, lora, info)
    tiles, real = [], module.add_lora_tiles

    def spy(T, S, R, sizes, sms=0):
        tiles.append(R)
        return real(T, S, R, sizes, sms)

    monkeypatch.setattr(module, "add_lora_tiles", spy)
    tiled = dataclasses.replace(info, rank_tile=16)
    assert rel_err(add_lora_(y.clone(), x, lora, tiled), expect) <= 1e-5
    monkeypatch.setattr(module, "PREFILL_ROWS", 8)
    pool = add_lora_(y.clone(), x, lora, info)
    lora.a[:, :, 16:] = float("nan")
    lora.b[:, :, 16:] = float("nan")
    out = add_lora_(y.clone(), x, lora, tiled)
    assert tiles == [64, 64, 16]
    assert rel_err(out, expect) <= 1e-5
    # numpy (the interpreter) sums a 16-wide rank tile and a 64-wide one in different orders,
    # so they may differ by a few ulps; the GPU test checks the same bits
    assert torch.allclose(out, pool, rtol=1e-5, atol=1e-5)


def test_add_lora_rank_beyond_real_rank_is_ignored():
    """Garbage past a slot's real rank must not be read: the kernel follows rank_of_slot."""
    T, H = 8, 32
    info = batch_info(T, "distinct")
    lora = lora_weights(info.num_slots, (), 1, 16, H, (32,), info.rank_of_slot, torch.float32)
    ranks = info.rank_of_slot.tolist()
    garbage = type(lora).dense(lora.a.clone(), lora.b.clone(), lora.out_slices, ranks)
    for s, r in enumerate(info.rank_of_slot.tolist()):
        garbage.a[s, :, r:] = float("nan")
        garbage.b[s, :, r:] = float("nan")
    x, y = torch.randn(T, H), torch.randn(T, 32)
    expect = reference.add_lora_(y.clone(), x, lora, info)
    out = add_lora_(y.clone(), x, garbage, info)
    assert rel_err(out, expect) <= 1e-5


@pytest.mark.parametrize("R", [32, 64])
def test_add_lora_big_pool_rank_and_wide_slices(R):
    """Rank tiles of 32/64 take the slots a few at a time, and a slice wider than one program's
    column group (512) is split over several programs: both paths against the reference."""
    T, H, slices = 19, 40, (1100, 64, 72)
    info = batch_info(T, "mixed")
    lora = lora_weights(info.num_slots, (), 3, R, H, slices, info.rank_of_slot, torch.float32)
    x, y = torch.randn(T, H), torch.randn(T, sum(slices))
    expect = reference.add_lora_(y.clone(), x, lora, info)
    out = add_lora_(y.clone(), x, lora, info)
    assert rel_err(out - y, expect - y) <= 1e-5


@pytest.mark.parametrize("T,spread", [(1, "one"), (7, "mixed"), (9, "distinct"), (4, "none")])
@pytest.mark.parametrize("R,K_in", [(16, 96), (64, 1000)])
def test_lora_shrink_split_sums_to_the_shrink(T, spread, R, K_in):
    """The split shrink (o_proj's LoRA when folded): its KS partial sums add up to the
    reference shrink on rows with an enabled slot, whole rows (zeros past the rank); R=64 over
    1000 inputs takes 8 slices, the last one partial."""
    info = batch_info(T, spread)
    lora = lora_weights(info.num_slots, (), 1, R, K_in, (32,), info.rank_of_slot, torch.float32)
    x = torch.randn(T, K_in)
    part = lora_shrink_split(x, lora, info)
    assert part.shape[0] == T and part.shape[2:] == (1, R) and part.dtype == torch.float32
    assert part.shape[1] == (1 if K_in <= 128 else 8)
    on = (info.slot_of_token >= 0) & (info.slot_enabled[info.slot_of_token.clamp(min=0)] != 0)
    expect = reference.lora_shrink_split(x, lora, info).sum(dim=1)
    if on.any():
        assert rel_err(part[on].sum(dim=1), expect[on]) <= 1e-5


@pytest.mark.parametrize("T,spread", [(7, "mixed"), (9, "distinct"), (300, "mixed")])
@pytest.mark.parametrize("n", [1, 3, 4, 5])
def test_add_lora_reads_the_compact_arena(T, n, spread):
    """Slots at their own ranks (mixed, one slot without the module) in one arena, regions out
    of slot order with NaN between them: the kernel (decode and prefill tiles) and the
    reference, both through the table, equal the dense layout's reference."""
    H, R = 40, 16
    info = batch_info(T, spread)
    ranks = info.rank_of_slot.tolist()
    dense = lora_weights(info.num_slots, (), n, R, H, SLICES[n], info.rank_of_slot, torch.float32)
    ranks[1] = 0  # slot 1's adapter has no such module: it reads nothing
    compact, dense = compact_weights(dense, ranks)
    x, y = torch.randn(T, H), torch.randn(T, sum(SLICES[n]))
    expect = reference.add_lora_(y.clone(), x, dense, info)
    # (the same sums over fewer zero columns: equal up to the order of the einsum's adds)
    assert rel_err(reference.add_lora_(y.clone(), x, compact, info) - y, expect - y) <= 1e-6
    out = add_lora_(y.clone(), x, compact, info)
    assert not out.isnan().any()
    assert rel_err(out - y, expect - y) <= 1e-5


@pytest.mark.parametrize("T,spread", [(7, "mixed"), (9, "distinct")])
def test_lora_shrink_split_reads_the_compact_arena(T, spread):
    info = batch_info(T, spread)
    ranks = info.rank_of_slot.tolist()
    K_in = 200
    dense = lora_weights(info.num_slots, (), 1, 16, K_in, (32,), info.rank_of_slot, torch.float32)
    ranks[1] = 0
    compact, dense = compact_weights(dense, ranks)
    x = torch.randn(T, K_in)
    part = lora_shrink_split(x, compact, info)
    on = (info.slot_of_token >= 0) & (info.slot_enabled[info.slot_of_token.clamp(min=0)] != 0)
    expect = reference.lora_shrink_split(x, dense, info).sum(dim=1)
    if on.any():
        assert rel_err(part[on].sum(dim=1), expect[on]) <= 1e-5
