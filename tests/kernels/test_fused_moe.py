import dataclasses

import pytest
import torch
from lora_cases import (
    SPREADS,
    batch_info,
    compact_weights,
    lora_weights,
    mxfp4_weight,
    rel_err,
)

from moelora.kernels import reference
from moelora.kernels.moe.fused import MoeConfig, fused_moe
from moelora.step.lora import LoraBatchInfo

H, I = 64, 32
TOL = {torch.float32: 1e-5, torch.float16: 5e-3}
# Small tiles so that every loop runs more than once (H/BK, I/BK, columns/BN, slots).
GROUPED = MoeConfig(block_m=16, block_n=16, block_k=32, block_n_down=32, block_k_down=16)
# Larger tiles for 64 tokens: the interpreter's cost grows with programs x loop trips.
WIDE = MoeConfig(block_m=16, block_n=32, block_k=64, block_n_down=64, block_k_down=32)


def moe_case(T: int, E: int, K: int, spread: str, dtype: torch.dtype, R: int = 16):
    x = torch.randn(T, H, dtype=dtype)
    w13 = (torch.randn(E, 2 * I, H) / H**0.5).to(dtype)
    w2 = (torch.randn(E, H, I) / I**0.5).to(dtype)
    topk_weights, topk_ids = reference.route_topk(torch.randn(T, E), K, renormalize=True)
    info = batch_info(T, spread)
    ranks = info.rank_of_slot
    lora13 = lora_weights(info.num_slots, (E,), 2, R, H, (I, I), ranks, dtype)
    lora2 = lora_weights(info.num_slots, (E,), 1, R, I, (H,), ranks, dtype)
    return (x, w13, w2, topk_weights, topk_ids), dict(lora13=lora13, lora2=lora2, info=info)


# Every (E, K, spread, dtype) at 1 or 7 tokens: at 1 token fp16 takes the (E, K) where
# exactly one of "8 experts" and "top-2" holds, at 7 the others, so each token count still sees
# both dtypes on each E and each K. At 64 (the interpreter's slowest) each dtype with one E and
# one K, fp32 with 4 experts of top-1 and fp16 with 8 of top-2, and no "one" adapter (a block
# of one slot's rows, which "mixed" blocks hold too).
GRID = [
    (T, E, K, spread, dtype)
    for T in (1, 7, 64)
    for E in (4, 8)
    for K in (1, 2)
    for spread in SPREADS
    for dtype in (torch.float32, torch.float16)
    if (
        (dtype == torch.float16) == (((E == 8) != (K == 2)) == (T == 1))
        if T < 64
        else (E == 8) == (dtype == torch.float16) == (K == 2) and spread != "one"
    )
]


@pytest.mark.parametrize("T,E,K,spread,dtype", GRID)
def test_fused_moe_matches_reference(poison_empty, T, E, K, spread, dtype):
    args, lora = moe_case(T, E, K, spread, dtype)
    config = {1: GROUPED, 7: GROUPED, 64: WIDE}[T]
    out = fused_moe(*args, **lora, config=config)
    assert rel_err(out, reference.fused_moe(*args, **lora)) <= TOL[dtype]


# TMA: the weight tiles and down's block rows of h through descriptors (MoeConfig.tma); with
# poison_empty, h's padding rows read whole are NaN, and must stay out of every pair's row
TMA = dataclasses.replace(GROUPED, tma=True)


@pytest.mark.parametrize("config", [GROUPED, None, TMA], ids=["grouped", "default", "tma"])
@pytest.mark.parametrize("T", [1, 7])
@pytest.mark.parametrize("spread", ["none", "mixed"])
def test_fused_moe_paths_agree(poison_empty, config, T, spread):
    args, lora = moe_case(T, 8, 2, spread, torch.float32)
    out = fused_moe(*args, **lora, config=config)
    assert rel_err(out, reference.fused_moe(*args, **lora)) <= TOL[torch.float32]


def test_pair_shrink_jobs_give_the_same_bits_on_fewer_programs(poison_empty, monkeypatch):
    """The align launch's shrink programs walk PAIR_SPLITS jobs a pair; past
    MAX_SHRINK_PROGRAMS each program takes several. Which program runs a job must not change
    its sums: 5 programs for 7 x 2 x 8 jobs give the bits of one program a job."""
    from moelora.kernels.moe import fused as module

    args, lora = moe_case(7, 8, 2, "mixed", torch.float16)
    one_each = fused_moe(*args, **lora, config=GROUPED)
    monkeypatch.setattr(module, "MAX_SHRINK_PROGRAMS", 5)
    assert torch.equal(fused_moe(*args, **lora, config=GROUPED), one_each)
    assert rel_err(one_each, reference.fused_moe(*args, **lora)) <= TOL[torch.float16]


@pytest.mark.parametrize("R", [16, 64])
def test_pair_shrink_in_half_the_splits(poison_empty, monkeypatch, R):
    """From HALF_SPLITS_FROM pairs on, each shrink job does twice the rows of a pair (8 at rank
    16, 32 at rank 64: still within gate's or up's half): lowered to 1 here, at 7 tokens."""
    from moelora.kernels.moe import fused as module

    monkeypatch.setattr(module, "HALF_SPLITS_FROM", 1)
    args, lora = moe_case(7, 8, 2, "mixed", torch.float32, R=R)
    out = fused_moe(*args, **lora, config=GROUPED)
    assert rel_err(out, reference.fused_moe(*args, **lora)) <= TOL[torch.float32]


def test_packed_slot_walk_gives_the_bits_of_the_reductions(poison_empty, monkeypatch):
    """With at most 8 slots the epilogues read the block's slots and ranks off one int64
    (moe_lora.packed_walk); past that they walk by reductions. Both visit the same slots with
    the same ranks, so the bits agree: 24 tokens over 8 slots of ranks 0..16, with the packed
    walk and with it turned off; and 16 slots, past the packed walk, against the reference."""
    from moelora.kernels.moe import fused as module
    from moelora.kernels.moe.lora import packed_walk

    assert packed_walk(8, 64) and not packed_walk(9, 16) and not packed_walk(8, 128)
    args, lora = moe_case(24, 8, 2, "mixed", torch.float16)
    packed = fused_moe(*args, **lora, config=WIDE)
    monkeypatch.setattr(module, "packed_walk", lambda num_slots, max_rank: False)
    assert torch.equal(fused_moe(*args, **lora, config=WIDE), packed)
    assert rel_err(packed, reference.fused_moe(*args, **lora)) <= TOL[torch.float16]
    monkeypatch.undo()

    T, E = 20, 8  # distinct: every one of the 16 slots
    args, _ = moe_case(T, E, 2, "none", torch.float32)
    info = batch_info(T, "distinct", num_slots=16)
    lora = dict(
        lora13=lora_weights(16, (E,), 2, 16, H, (I, I), info.rank_of_slot, torch.float32),
        lora2=lora_weights(16, (E,), 1, 16, I, (H,), info.rank_of_slot, torch.float32),
        info=info,
    )
    out = fused_moe(*args, **lora, config=GROUPED)
    assert rel_err(out, reference.fused_moe(*args, **lora)) <= 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fused_moe_top_k_rows_sum_to_its_output(poison_empty, dtype):
    """sum_topk=False returns the K weighted rows [T, K, H], whose in-order sum
    (reference.sum_rows: what the next norm adds) is the summed output to the bit."""
    args, lora = moe_case(7, 8, 2, "mixed", dtype)
    out = fused_moe(*args, **lora, config=GROUPED)
    rows = fused_moe(*args, **lora, config=GROUPED, sum_topk=False)
    assert rows.shape == (7, 2, H)
    assert torch.equal(reference.sum_rows(rows), out)


def test_fused_moe_without_lora_and_with_one_half(poison_empty):
    args, lora = moe_case(7, 8, 2, "distinct", torch.float32)
    assert rel_err(fused_moe(*args, config=GROUPED), reference.fused_moe(*args)) <= 1e-5
    for half in ("lora13", "lora2"):
        only = dict(lora, **{half: None})
        out = fused_moe(*args, **only, config=GROUPED)
        assert rel_err(out, reference.fused_moe(*args, **only)) <= 1e-5


def test_fused_moe_grouped_path_reads_the_step_flag(poison_empty):
    """The grouped GEMMs skip their LoRA epilogue when the step's any_enabled flag is 0 (the
    runners write it with slot_enabled; LoraBatchInfo derives it when not given), and apply
    it when the flag is 1."""
    args, lora = moe_case(7, 8, 2, "distinct", torch.float32)
    info = lora["info"]
    assert info.any_enabled.tolist() == [1]
    off = dataclasses.replace(info, any_enabled=torch.zeros(1, dtype=torch.int32))
    base = reference.fused_moe(*args)
    assert rel_err(fused_moe(*args, **dict(lora, info=off), config=GROUPED), base) <= 1e-5
    out = fused_moe(*args, **lora, config=GROUPED)
    assert rel_err(out, reference.fused_moe(*args, **lora)) <= 1e-5
    assert rel_err(out, base) > 1e-2


def real_rank_case(T: int, enabled: tuple[int, ...] = (0, 1, 1, 1, 0, 1, 1, 0)):
    """A MoE over slots of ranks 0..64 in a rank-64 pool, those not `enabled` off (by default
    two of them), with NaN past each slot's real rank in A and B: (args, LoRA, the reference
    output from before the NaN)."""
    E, K, R = 4, 2, 64
    args, _ = moe_case(T, E, K, "none", torch.float32)
    info = batch_info(T, "distinct")
    info = LoraBatchInfo(
        info.slot_of_token,
        torch.tensor([0, 1, 8, 16, 0, 24, 40, 64], dtype=torch.int32),
        info.scaling_of_slot,
        torch.tensor(enabled, dtype=torch.int32),
    )
    lora = dict(
        lora13=lora_weights(8, (E,), 2, R, H, (I, I), info.rank_of_slot, torch.float32),
        lora2=lora_weights(8, (E,), 1, R, I, (H,), info.rank_of_slot, torch.float32),
        info=info,
    )
    expect = reference.fused_moe(*args, **lora)
    for w in (lora["lora13"], lora["lora2"]):
        for s, r in enumerate(info.rank_of_slot.tolist()):
            w.a[s, ..., r:, :] = float("nan")
            w.b[s, ..., r:] = float("nan")
    return args, lora, expect


def test_fused_moe_follows_real_rank_in_a_larger_pool(poison_empty):
    """Ranks 1..64 in a rank-64 pool: NaN past each slot's real rank must never be read."""
    args, lora, expect = real_rank_case(7)
    assert rel_err(fused_moe(*args, **lora, config=GROUPED), expect) <= 1e-5


def test_fused_moe_many_tokens_per_expert(poison_empty):
    """More pairs per expert than one block (BM = 16) and experts that get no pair at all."""
    args, lora = moe_case(64, 8, 2, "mixed", torch.float32)
    x, w13, w2, topk_weights, topk_ids = args
    topk_ids = torch.stack([torch.full((64,), 5), torch.arange(64) % 3], 1).to(torch.int32)
    args = (x, w13, w2, topk_weights, topk_ids)
    out = fused_moe(*args, **lora, config=GROUPED)
    assert rel_err(out, reference.fused_moe(*args, **lora)) <= 1e-5


def test_fused_moe_gives_the_same_bits_past_pmax(poison_empty, monkeypatch):
    """Past PMAX the align is two launches, the pair shrink riding the second: lowered to 16
    pairs, in chunks of 32, 24 tokens x 2 take that path, and since both paths align alike,
    the MoE with LoRA gives the bits of the one-launch path."""
    from moelora.kernels.moe import align as moe_align

    args, lora = moe_case(24, 8, 2, "mixed", torch.float32)
    one_launch = fused_moe(*args, **lora, config=GROUPED)
    monkeypatch.setattr(moe_align, "PMAX", 16)
    monkeypatch.setattr(moe_align, "CHUNK_MIN", 32)
    monkeypatch.setattr(moe_align, "CHUNK_MAX", 32)
    assert torch.equal(fused_moe(*args, **lora, config=GROUPED), one_launch)
    assert rel_err(one_launch, reference.fused_moe(*args, **lora)) <= TOL[torch.float32]


@pytest.mark.parametrize("T", [1, 7])
@pytest.mark.parametrize("spread", ["none", "mixed"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fused_moe_gpt_oss_biases_and_clamped_swiglu(poison_empty, T, spread, dtype):
    """GPT-OSS's experts: biases on gate|up and down, the clamped SwiGLU; gate|up at 4x scale so
    a share of the gates and ups pass the clamp at 7 (checked), with the LoRA epilogues."""
    args, lora = moe_case(T, 8, 2, spread, dtype)
    x, w13, w2, weights, ids = args
    w13 = (w13.float() * 4.0).to(dtype)
    E = w13.shape[0]
    b13 = (0.3 * torch.randn(E, 2 * I)).to(dtype)
    b2 = (0.3 * torch.randn(E, H)).to(dtype)
    clamped = (x.float() @ w13.float().transpose(1, 2)).abs() > reference.SWIGLU_OAI_LIMIT
    assert clamped.float().mean() > 0.01
    args = (x, w13, w2, weights, ids)
    oss = dict(b13=b13, b2=b2, activation="swiglu_oai")
    out = fused_moe(*args, **lora, config=GROUPED, **oss)
    want = reference.fused_moe(*args, **lora, **oss)
    assert rel_err(out, want) <= TOL[dtype]
    assert rel_err(reference.fused_moe(*args, **lora), want) > 0.1  # the options matter


@pytest.mark.parametrize("spread", ["mixed", "distinct", "one"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_block_shrink_at_prefill_sizes(poison_empty, monkeypatch, spread, dtype):
    """From BLOCK_SHRINK_FROM pairs gate_up's shrink runs block by block after the align, one
    product per slot a block holds (moe_lora.block_shrink_kernel): lowered to 1 pair here, its
    input chunk to 32 so that its loop runs twice."""
    from moelora.kernels.moe import fused as module

    monkeypatch.setattr(module, "BLOCK_SHRINK_FROM", 1)
    monkeypatch.setattr(module, "BLOCK_SHRINK_K", 32)
    args, lora = moe_case(24, 8, 2, spread, dtype)
    out = fused_moe(*args, **lora, config=GROUPED)
    assert rel_err(out, reference.fused_moe(*args, **lora)) <= TOL[dtype]


def test_block_shrinks_take_the_steps_rank_tile(poison_empty, monkeypatch):
    """Where the shrinks run block by block, a step whose enabled slots have ranks 1, 8 and 16
    in a rank-64 pool (LoraBatchInfo.rank_tile 16) runs 16-wide rank tiles, reads nothing past
    16 (NaN there) and gives the pool tile's output; the pair path keeps the pool's tile."""
    from moelora.kernels.moe import fused as module

    tiles, real = [], module._lora

    def spy(*args, **kwargs):
        lora = real(*args, **kwargs)
        tiles.append(lora.BR)
        return lora

    monkeypatch.setattr(module, "_lora", spy)
    args, lora, expect = real_rank_case(24, enabled=(0, 1, 1, 1, 0, 0, 0, 0))
    tiled = dict(lora, info=dataclasses.replace(lora["info"], rank_tile=16))
    by_pair = fused_moe(*args, **tiled, config=GROUPED)
    monkeypatch.setattr(module, "BLOCK_SHRINK_FROM", 1)
    pool = fused_moe(*args, **lora, config=GROUPED)
    out = fused_moe(*args, **tiled, config=GROUPED)
    assert tiles == [64, 64, 16]
    assert rel_err(out, expect) <= 1e-5
    # numpy (the interpreter) sums a 16-wide rank tile and a 64-wide one in different orders,
    # so they may differ by a few ulps; the GPU test checks the same bits
    assert torch.allclose(out, pool, rtol=1e-5, atol=1e-5)
    assert rel_err(by_pair, expect) <= 1e-5


def test_block_shrink_follows_real_rank_in_a_larger_pool(poison_empty, monkeypatch):
    """The block shrink reads no column of A13 past a slot's real rank (NaN there), and skips
    disabled slots and slots with rank 0."""
    from moelora.kernels.moe import fused as module

    monkeypatch.setattr(module, "BLOCK_SHRINK_FROM", 1)
    args, lora, expect = real_rank_case(24)
    assert rel_err(fused_moe(*args, **lora, config=GROUPED), expect) <= 1e-5


# MXFP4 experts kept packed. Scale bytes 120..126 (2^-7 .. 2^-1 times codes of up to 6) keep
# the fp16 sums in range at H = 64, I = 32; the GPT-OSS options (biases, the clamped SwiGLU)
# with the LoRA epilogues. BK must be a multiple of 32: GROUPED's down BK is 16.
MXFP4_SCALES = (120, 126)
MXFP4_TILES = dataclasses.replace(GROUPED, block_k_down=32)


def mxfp4_case(T: int, spread: str, dtype: torch.dtype):
    """moe_case's inputs with packed experts in place of the dense ones, and GPT-OSS's options."""
    (x, _, _, weights, ids), lora = moe_case(T, 8, 2, spread, dtype)
    E = 8
    w13 = mxfp4_weight(E, 2 * I, H, MXFP4_SCALES)
    w2 = mxfp4_weight(E, H, I, MXFP4_SCALES)
    oss = dict(
        b13=(0.3 * torch.randn(E, 2 * I)).to(dtype),
        b2=(0.3 * torch.randn(E, H)).to(dtype),
        activation="swiglu_oai",
    )
    return (x, w13, w2, weights, ids), lora, oss


@pytest.mark.parametrize(
    "T,spread,dtype,lora_too",
    [
        (7, "mixed", torch.float32, True),
        (7, "mixed", torch.float16, False),
        (1, "distinct", torch.float16, False),
    ],
)
def test_fused_moe_mxfp4_matches_reference(poison_empty, T, spread, dtype, lora_too):
    """Packed experts, expanded a tile at a time, against the reference on their dequantized
    weights: with the LoRA epilogues (and, lora_too, without), biases and the clamped SwiGLU
    (a share of the gates and ups past the clamp at 7, checked)."""
    args, lora, oss = mxfp4_case(T, spread, dtype)
    x, w13 = args[0], reference.dense_experts(args[1], dtype)
    clamped = (x.float() @ w13.float().transpose(1, 2)).abs() > reference.SWIGLU_OAI_LIMIT
    assert clamped.float().mean() > 0.01
    for with_lora in (lora, {}) if lora_too else (lora,):
        out = fused_moe(*args, **with_lora, config=MXFP4_TILES, **oss)
        assert rel_err(out, reference.fused_moe(*args, **with_lora, **oss)) <= TOL[dtype]


def test_fused_moe_mxfp4_gives_the_bits_of_its_dequantized_weights(poison_empty):
    """The expanded tiles are dequantize_mxfp4's values to the bit, so the packed MoE gives the
    bits of the dense kernel on the dequantized weights (same tiles, same sums): fp16, the plain
    SiLU without biases, 16 tokens, LoRA on a mixed spread, BK past H and I (masked groups)."""
    dtype = torch.float16
    args, lora, _ = mxfp4_case(16, "mixed", dtype)
    x, w13, w2, weights, ids = args
    dense = (x, reference.dense_experts(w13, dtype), reference.dense_experts(w2, dtype))
    tiles = dataclasses.replace(WIDE, block_k=128, block_k_down=64)
    out = fused_moe(*args, **lora, config=tiles)
    assert torch.equal(out, fused_moe(*dense, weights, ids, **lora, config=tiles))
    assert rel_err(out, reference.fused_moe(*args, **lora)) <= TOL[dtype]


@pytest.mark.parametrize("sub_k", [0, 32])
def test_fused_moe_mxfp4_sub_tiles(poison_empty, sub_k):
    """The expansion on sub-tiles (MoeConfig.mxfp4_sub_k) of 64-deep tiles, in gate_up (H 64:
    two sub-tiles) and in down (I 32: the second sub-tile wholly masked), against the
    reference, LoRA on."""
    args, lora, oss = mxfp4_case(7, "mixed", torch.float32)
    cfg = MoeConfig(
        block_m=16, block_n=16, block_k=64, block_n_down=32, block_k_down=64, mxfp4_sub_k=sub_k
    )
    out = fused_moe(*args, **lora, config=cfg, **oss)
    assert rel_err(out, reference.fused_moe(*args, **lora, **oss)) <= TOL[torch.float32]


@pytest.mark.parametrize("sub_k", [0, 32])
def test_fused_moe_mxfp4_tiles_past_k_and_n(poison_empty, sub_k):
    """Whole K tiles, then a last one past H (I), and column blocks past N: H 160 and I 96 in
    64-deep tiles (two whole tiles and 32 columns in gate_up, one and 32 in down), 64 columns a
    block (the last gate, up and down blocks half past N), against the reference with GPT-OSS's
    options."""
    E, K, T, H2, I2 = 8, 2, 7, 160, 96
    x = torch.randn(T, H2)
    w13 = mxfp4_weight(E, 2 * I2, H2, MXFP4_SCALES)
    w2 = mxfp4_weight(E, H2, I2, MXFP4_SCALES)
    weights, ids = reference.route_topk(torch.randn(T, E), K, renormalize=True)
    oss = dict(
        b13=0.3 * torch.randn(E, 2 * I2), b2=0.3 * torch.randn(E, H2), activation="swiglu_oai"
    )
    cfg = MoeConfig(
        block_m=16, block_n=64, block_k=64, block_n_down=64, block_k_down=64, mxfp4_sub_k=sub_k
    )
    out = fused_moe(x, w13, w2, weights, ids, config=cfg, **oss)
    expect = reference.fused_moe(x, w13, w2, weights, ids, **oss)
    assert rel_err(out, expect) <= TOL[torch.float32]


@pytest.mark.parametrize("block_k", [32, 96, 512])
def test_mxfp4_sub_tiles_out_of_range_are_refused(block_k):
    """A tile of other than 1, 2 or 4 sub-tiles is refused where the config is made."""
    with pytest.raises(ValueError, match=f"mxfp4_sub_k 64 with tiles {block_k} deep"):
        MoeConfig(block_k=block_k, block_k_down=128, mxfp4_sub_k=64)


@pytest.mark.parametrize("group_m", [1, 3])
def test_program_order_gives_the_same_bits(poison_empty, group_m):
    """Groups of blocks sweeping every column block (MoeConfig.group_m; 3 leaves a short last
    group) run the same tiles as the 2D grid: the same bits, LoRA on mixed slots (down's shrink
    sums two column blocks' partials by atomic adds, which commute)."""
    args, lora = moe_case(7, 8, 2, "mixed", torch.float32)
    grouped = dataclasses.replace(GROUPED, group_m=group_m)
    out = fused_moe(*args, **lora, config=grouped)
    assert torch.equal(out, fused_moe(*args, **lora, config=GROUPED))
    assert rel_err(out, reference.fused_moe(*args, **lora)) <= TOL[torch.float32]


# Each target's own rank a slot (PEFT's rank_pattern), at most the slot's (rank_of_slot: 0, 1,
# 8, 16 twice over): gate_up absent from slot 5's adapter, down from slot 7's, and ranks below
# the slot's elsewhere
RANKS13 = [0, 1, 8, 16, 0, 0, 4, 16]
RANKS2 = [0, 1, 3, 16, 0, 1, 8, 0]
SHARED = {"per-expert": ((), ()), "shared-outer": (("a",), ("b",)), "shared": (("a", "b"),) * 2}


def compact_moe_case(T: int, shared: str, dtype: torch.dtype = torch.float32):
    """moe_case's MoE with its LoRA in the compact arena (lora_cases.compact_weights: NaN
    between regions, regions out of slot order): (args, the compact LoRA, the same weights in
    the dense layout)."""
    args, lora = moe_case(T, 4, 2, "distinct", dtype)
    (c13, d13), (c2, d2) = (
        compact_weights(lora[key], ranks, share)
        for key, ranks, share in zip(("lora13", "lora2"), (RANKS13, RANKS2), SHARED[shared])
    )
    info = lora["info"]
    return args, dict(lora13=c13, lora2=c2, info=info), dict(lora13=d13, lora2=d2, info=info)


@pytest.mark.parametrize("shared", list(SHARED))
@pytest.mark.parametrize("path", ["pair", "block", "unpacked"])
def test_fused_moe_reads_the_compact_arena(poison_empty, monkeypatch, path, shared):
    """The MoE LoRA read through each target's table: gate_up and down at their own ranks, a
    module absent from a slot's adapter skipped, a factor shared by every expert stored once
    (expert stride 0), NaN everywhere else in the arena. The pair shrink (align launch) with
    gate_up's atomic down shrink, the block shrinks (lowered to 1 pair), and the walk by
    reductions instead of the packed int64 each equal the reference on the dense layout."""
    from moelora.kernels.moe import fused as module

    if path == "block":
        monkeypatch.setattr(module, "BLOCK_SHRINK_FROM", 1)
        monkeypatch.setattr(module, "BLOCK_SHRINK_K", 32)
    if path == "unpacked":
        monkeypatch.setattr(module, "packed_walk", lambda num_slots, max_rank: False)
    args, compact, dense = compact_moe_case(9, shared)
    expect = reference.fused_moe(*args, **dense)
    assert rel_err(reference.fused_moe(*args, **compact), expect) <= 1e-6
    out = fused_moe(*args, **compact, config=GROUPED)
    assert not out.isnan().any()
    assert rel_err(out, expect) <= TOL[torch.float32]


@pytest.mark.parametrize("half", ["lora13", "lora2"])
def test_fused_moe_compact_arena_with_one_half(poison_empty, half):
    """One target's LoRA alone, from the compact arena, fp16."""
    args, compact, dense = compact_moe_case(7, "shared-outer", torch.float16)
    compact[half] = dense[half] = None
    out = fused_moe(*args, **compact, config=GROUPED)
    assert not out.isnan().any()
    assert rel_err(out, reference.fused_moe(*args, **dense)) <= TOL[torch.float16]


def test_a_device_without_a_table_takes_its_chips_twin(tmp_path, monkeypatch):
    """An H100 runs the H200's tiles for a shape only the H200 has tuned, and its own where it
    has one; a device on no listed chip has no table."""
    from moelora.kernels.moe import config

    monkeypatch.setattr(config, "CONFIG_DIR", tmp_path)
    h200 = MoeConfig(block_m=32, block_n=128)
    h100 = MoeConfig(block_m=64, block_k=128)
    config.save_configs("NVIDIA H200", 8, 64, 32, 2, {16: h200})
    config.save_configs("NVIDIA H200", 8, 64, 32, 2, {16: h200}, fp8=True)
    config.save_configs("NVIDIA H100 80GB HBM3", 8, 64, 32, 2, {16: h100}, fp8=True)
    twin = config.tuned_table("NVIDIA H100 80GB HBM3", config.shape_key(8, 64, 32, 2))
    own = config.tuned_table("NVIDIA H100 80GB HBM3", config.shape_key(8, 64, 32, 2, fp8=True))
    assert MoeConfig(**twin["16"]) == h200
    assert MoeConfig(**own["16"]) == h100
    assert config.tuned_table("NVIDIA A100-SXM4-80GB", config.shape_key(8, 64, 32, 2)) == {}


def test_a_decode_table_is_not_extrapolated_to_a_prefill():
    """Past the largest tuned bucket, a table whose buckets average at most 16 pairs an expert
    gives way to the default where T averages more; a table tuned into that regime is
    extrapolated; inside its buckets, the smallest bucket >= T answers."""
    from moelora.kernels.moe.config import table_config

    E, K = 128, 8  # 16 pairs an expert at T = 256
    small = MoeConfig(block_m=16, block_n=32, block_k=128)
    wide = MoeConfig(block_m=128, block_n=64, block_k=128)
    decode = {"1": dataclasses.asdict(small), "256": dataclasses.asdict(small)}
    assert table_config(decode, 200, E, K) == small
    assert table_config(decode, 4096, E, K) == MoeConfig(block_m=64)
    prefill = {**decode, "1024": dataclasses.asdict(wide)}
    assert table_config(prefill, 512, E, K) == wide
    assert table_config(prefill, 16384, E, K) == wide
    assert table_config({}, 8, E, K) == MoeConfig(block_m=16)
    assert table_config({}, 4096, E, K) == MoeConfig(block_m=64)
    # a table that stops below 16 pairs, asked for T still below them, extrapolates
    assert table_config({"64": dataclasses.asdict(small)}, 200, E, K) == small
