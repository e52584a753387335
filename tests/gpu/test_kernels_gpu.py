"""Triton MoE, MoE-LoRA, dense multi-LoRA and routing on the GPU, at real model sizes, in bf16.

Each kernel against the fp32 torch reference: relative error of the whole output <= 1e-2.
Shapes: Qwen3-30B-A3B experts (H=2048, I=768, E=128, K=8), Mixtral (H=4096, I=14336, E=8, K=2)
and a small-E shape for the E {4, 8} x K {1, 2} grid. The last test captures the kernels in a
CUDA graph with every slot disabled and replays it with other batch infos written in place.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():  # before any kernel module is imported (see kernels/conftest)
    pytest.skip("needs a CUDA device", allow_module_level=True)
pytest.importorskip("triton")

sys.path.insert(0, str(Path(__file__).parents[1] / "kernels"))
from cuda_graphs import capture  # noqa: E402
from lora_cases import SPREADS, batch_info, lora_weights, mxfp4_weight, rel_err  # noqa: E402

from moelora.config import GroupedRouting  # noqa: E402
from moelora.kernels import mlp, reference  # noqa: E402
from moelora.kernels.attention.output_gate import output_gate  # noqa: E402
from moelora.kernels.linear import (  # noqa: E402
    INVARIANT_ROWS,
    BatchInvariantLinear,
    dot_linear,
    skinny_linear,
)
from moelora.kernels.lora import add_lora_, lora_shrink_split  # noqa: E402
from moelora.kernels.moe.fused import MoeConfig, fused_moe  # noqa: E402
from moelora.kernels.moe.routing import route_topk  # noqa: E402
from moelora.step.lora import FoldedLora, LoraBatchInfo, LoraWeights  # noqa: E402

DEV = "cuda"
SHAPES = {  # name: (E, H, I, K)
    "qwen3-30b-a3b": (128, 2048, 768, 8),
    "mixtral": (8, 4096, 14336, 2),
    "small-e4k1": (4, 1024, 512, 1),
    "small-e8k2": (8, 1024, 512, 2),
}
R = 16  # pool rank; slots have ranks {0, 1, 8, 16}


@pytest.fixture(scope="module", params=list(SHAPES))
def moe_weights(request):
    E, H, I, K = SHAPES[request.param]
    torch.manual_seed(0)
    w13 = (torch.randn(E, 2 * I, H, device=DEV) / H**0.5).to(torch.bfloat16)
    w2 = (torch.randn(E, H, I, device=DEV) / I**0.5).to(torch.bfloat16)
    info = batch_info(1, "none", DEV)
    lora13 = lora_weights(
        info.num_slots, (E,), 2, R, H, (I, I), info.rank_of_slot.cpu(), torch.bfloat16, DEV
    )
    lora2 = lora_weights(
        info.num_slots, (E,), 1, R, I, (H,), info.rank_of_slot.cpu(), torch.bfloat16, DEV
    )
    yield request.param, (E, H, I, K), w13, w2, lora13, lora2
    del w13, w2
    torch.cuda.empty_cache()


def _f32(lora: LoraWeights) -> LoraWeights:
    return LoraWeights.dense(lora.a.float(), lora.b.float(), lora.out_slices)


def _reference_moe(x, w13, w2, topk_weights, topk_ids, lora13, lora2, info) -> torch.Tensor:
    """The fp32 torch MoE of bf16 inputs: the oracle of every MoE test here."""
    return reference.fused_moe(
        x.float(),
        w13.float(),
        w2.float(),
        topk_weights,
        topk_ids,
        lora13=_f32(lora13),
        lora2=_f32(lora2),
        info=info,
    )


def _routing(T: int, E: int, K: int):
    logits = torch.randn(T, E, device=DEV)
    return reference.route_topk(logits, K, renormalize=True)


# 2048 tokens: past PMAX pairs at K = 8, the align's chunked path and the block shrinks
# (fused_moe.BLOCK_SHRINK_FROM); 4096: the same at K = 2 too, and the prefill tiles; 16384:
# the largest prefill bucket's tiles and program order
@pytest.mark.parametrize("T", [1, 7, 64, 256, 2048, 4096, 16384])
@pytest.mark.parametrize("spread", SPREADS)
def test_fused_moe_bf16(moe_weights, T, spread):
    name, (E, H, I, K), w13, w2, lora13, lora2 = moe_weights
    x = torch.randn(T, H, device=DEV).to(torch.bfloat16)
    topk_weights, topk_ids = _routing(T, E, K)
    info = batch_info(T, spread, DEV)
    out = fused_moe(x, w13, w2, topk_weights, topk_ids, lora13=lora13, lora2=lora2, info=info)
    ref = _reference_moe(x, w13, w2, topk_weights, topk_ids, lora13, lora2, info)
    assert torch.isfinite(out).all()
    assert rel_err(out, ref) <= 1e-2, (name, T, spread)


@pytest.mark.parametrize("group_m", [1, 5])
def test_prefill_moe_bits_do_not_depend_on_program_order(moe_weights, group_m):
    """At prefill sizes both LoRA shrinks run block by block (no atomic adds), so the fused MoE
    is deterministic with LoRA on, and groups of blocks sweeping the column blocks
    (MoeConfig.group_m; 5 leaves a short last group) give the 2D grid's bits."""
    name, (E, H, I, K), w13, w2, lora13, lora2 = moe_weights
    T = 4096
    x = torch.randn(T, H, device=DEV).to(torch.bfloat16)
    topk_weights, topk_ids = _routing(T, E, K)
    info = batch_info(T, "mixed", DEV)
    lora = dict(lora13=lora13, lora2=lora2, info=info)
    grid = MoeConfig(128, 64, 128, 128, 128, 8, 3)
    first = fused_moe(x, w13, w2, topk_weights, topk_ids, **lora, config=grid)
    assert torch.equal(first, fused_moe(x, w13, w2, topk_weights, topk_ids, **lora, config=grid))
    grouped = dataclasses.replace(grid, group_m=group_m)
    out = fused_moe(x, w13, w2, topk_weights, topk_ids, **lora, config=grouped)
    assert torch.equal(out, first), (name, group_m)
    ref = _reference_moe(x, w13, w2, topk_weights, topk_ids, lora13, lora2, info)
    assert rel_err(out, ref) <= 1e-2, (name, group_m)


def _rows_alone(info: LoraBatchInfo, rows: slice) -> LoraBatchInfo:
    """The step's rows `rows` as a step of their own: their slots, the same slot tables."""
    slots = info.slot_of_token[rows].contiguous()
    return LoraBatchInfo(slots, info.rank_of_slot, info.scaling_of_slot, info.slot_enabled)


@pytest.mark.parametrize("rows", [slice(1, 2), slice(5, 12), slice(100, 164), slice(300, 556)])
def test_deterministic_moe_rows_alone_equal_them_in_a_prefill_step(moe_weights, rows):
    """Deterministic inference's fused MoE (deterministic_config's tiles, the shrinks block by
    block): rows alone (a decode step's sizes, their own tile bucket) give the bits they get
    inside a 4096-token step of mixed adapters (the prefill bucket's rows): mma.sync tiles
    of 16 and 32 rows sum a row as warpgroup MMAs of 64 and more do. Mixtral's prefill bucket
    also checks that a tile made 128 deep stages what fits (Triton refused 3 stages)."""
    name, (E, H, I, K), w13, w2, lora13, lora2 = moe_weights
    T = 4096
    x = torch.randn(T, H, device=DEV).to(torch.bfloat16)
    topk_weights, topk_ids = _routing(T, E, K)
    info = batch_info(T, "mixed", DEV)
    lora = dict(lora13=lora13, lora2=lora2)
    batched = fused_moe(x, w13, w2, topk_weights, topk_ids, **lora, info=info, deterministic=True)
    alone_info = _rows_alone(info, rows)
    alone = fused_moe(
        x[rows].contiguous(),
        w13,
        w2,
        topk_weights[rows].contiguous(),
        topk_ids[rows].contiguous(),
        **lora,
        info=alone_info,
        deterministic=True,
    )
    assert torch.equal(alone, batched[rows]), (name, rows, (alone - batched[rows]).abs().max())
    ref = _reference_moe(x, w13, w2, topk_weights, topk_ids, lora13, lora2, info)
    assert rel_err(batched, ref) <= 1e-2, name


@pytest.mark.parametrize("T", [4096, 16384])
def test_prefill_moe_tma_gives_the_pointer_loads_bits(moe_weights, T):
    """The weight tiles and down's block rows through TMA descriptors (MoeConfig.tma) feed the
    same products in the same K order as the pointer loads: the same bits, LoRA on."""
    name, (E, H, I, K), w13, w2, lora13, lora2 = moe_weights
    x = torch.randn(T, H, device=DEV).to(torch.bfloat16)
    topk_weights, topk_ids = _routing(T, E, K)
    lora = dict(lora13=lora13, lora2=lora2, info=batch_info(T, "mixed", DEV))
    tiles = MoeConfig(128, 64, 128, 128, 128, 8, 3, group_m=1)
    loads = fused_moe(x, w13, w2, topk_weights, topk_ids, **lora, config=tiles)
    for tma in (
        dataclasses.replace(tiles, tma=True),
        dataclasses.replace(tiles, tma=True, block_n=128, num_stages=2, block_n_down=256),
    ):
        out = fused_moe(x, w13, w2, topk_weights, topk_ids, **lora, config=tma)
        assert torch.equal(out, loads), (name, T, tma)


@pytest.mark.parametrize(
    "config",
    [
        MoeConfig(block_m=16),
        # few rows in 64-row blocks through TMA: padding rows read whole
        MoeConfig(64, 64, 128, 128, 128, 8, 3, tma=True),
        # a prefill tile whose down GEMM has warps and stages of its own
        MoeConfig(64, 64, 128, 128, 128, 8, 3, num_warps_down=4, num_stages_down=2),
    ],
)
@pytest.mark.parametrize("T", [1, 7, 300])
def test_fused_moe_untuned_tiles_bf16(moe_weights, config, T):
    name, (E, H, I, K), w13, w2, lora13, lora2 = moe_weights
    x = torch.randn(T, H, device=DEV).to(torch.bfloat16)
    topk_weights, topk_ids = _routing(T, E, K)
    info = batch_info(T, "mixed", DEV)
    out = fused_moe(
        x, w13, w2, topk_weights, topk_ids, lora13=lora13, lora2=lora2, info=info, config=config
    )
    ref = _reference_moe(x, w13, w2, topk_weights, topk_ids, lora13, lora2, info)
    assert rel_err(out, ref) <= 1e-2, (name, T, config)


def _write_step(info: LoraBatchInfo, new: LoraBatchInfo) -> None:
    """new's buffers copied into info's, as the graph runner writes a captured step's inputs
    (any_enabled included); the host-side rank_tile stays the capture's (0: the pool's tile)."""
    for field in dataclasses.fields(info):
        buffer = getattr(info, field.name)
        if isinstance(buffer, torch.Tensor):
            buffer.copy_(getattr(new, field.name))


MXFP4_SHAPES = {"gpt-oss-20b": (32, 2880, 2880, 4), "gpt-oss-120b": (128, 2880, 2880, 4)}


@pytest.fixture(scope="module", params=list(MXFP4_SHAPES))
def mxfp4_experts(request):
    """Packed experts of a GPT-OSS shape: random codes, scale bytes 118..122 (weights of about
    1/sqrt(2880)), biases; their fp32 dequantization is the reference's weights."""
    E, H, I, K = MXFP4_SHAPES[request.param]
    torch.manual_seed(0)
    w13, w2 = mxfp4_weight(E, 2 * I, H, (118, 122), DEV), mxfp4_weight(E, H, I, (118, 122), DEV)
    b13 = (0.1 * torch.randn(E, 2 * I, device=DEV)).to(torch.bfloat16)
    b2 = (0.1 * torch.randn(E, H, device=DEV)).to(torch.bfloat16)
    info = batch_info(1, "none", DEV)
    ranks = info.rank_of_slot.cpu()
    lora13 = lora_weights(info.num_slots, (E,), 2, R, H, (I, I), ranks, torch.bfloat16, DEV)
    lora2 = lora_weights(info.num_slots, (E,), 1, R, I, (H,), ranks, torch.bfloat16, DEV)
    yield request.param, (E, H, I, K), w13, w2, b13, b2, lora13, lora2
    torch.cuda.empty_cache()


# BK 128 leaves a 64-deep tail of H = I = 2880: whole groups masked; the table lookups (the
# default) and the arithmetic expansion (mxfp4_lut=False)
@pytest.mark.parametrize(
    "config",
    [
        None,
        MoeConfig(block_k=128, block_k_down=128),
        MoeConfig(block_k=128, block_k_down=128, mxfp4_lut=False),
        MoeConfig(block_n=32, block_k=256, block_n_down=32, block_k_down=256),
    ],
)
@pytest.mark.parametrize("T", [1, 7, 64, 256])
@pytest.mark.parametrize("spread", ["none", "distinct", "mixed"])
def test_fused_moe_mxfp4_bf16(mxfp4_experts, config, T, spread):
    """MXFP4 experts expanded in the main loops (by table lookups or arithmetic), with
    biases, the clamped SwiGLU and the LoRA epilogues, against the fp32 reference on their
    dequantized weights."""
    name, (E, H, I, K), w13, w2, b13, b2, lora13, lora2 = mxfp4_experts
    x = torch.randn(T, H, device=DEV).to(torch.bfloat16)
    topk_weights, topk_ids = _routing(T, E, K)
    info = batch_info(T, spread, DEV)
    oss = dict(activation="swiglu_oai")
    lora = dict(lora13=lora13, lora2=lora2, info=info)
    out = fused_moe(
        x, w13, w2, topk_weights, topk_ids, **lora, b13=b13, b2=b2, config=config, **oss
    )
    dense13, dense2 = (reference.dense_experts(w, torch.float32) for w in (w13, w2))
    ref = reference.fused_moe(
        x.float(),
        dense13,
        dense2,
        topk_weights,
        topk_ids,
        lora13=_f32(lora13),
        lora2=_f32(lora2),
        info=info,
        b13=b13.float(),
        b2=b2.float(),
        **oss,
    )
    assert torch.isfinite(out).all()
    assert rel_err(out, ref) <= 1e-2, (name, T, spread, config)


def _gpt_oss_options(T: int, E: int, H: int, I: int) -> dict:
    """fused_moe's GPT-OSS options for T tokens on mixed slots: gate_up's LoRA (not down's:
    its shrink sums column blocks' partials by atomic adds, whose order, so their fp32 bits,
    changes from run to run), random biases and the clamped SwiGLU."""
    info = batch_info(T, "mixed", DEV)
    ranks = info.rank_of_slot.cpu()
    return dict(
        lora13=lora_weights(info.num_slots, (E,), 2, R, H, (I, I), ranks, torch.bfloat16, DEV),
        info=info,
        b13=(0.1 * torch.randn(E, 2 * I, device=DEV)).to(torch.bfloat16),
        b2=(0.1 * torch.randn(E, H, device=DEV)).to(torch.bfloat16),
        activation="swiglu_oai",
    )


@pytest.mark.parametrize("T", [7, 64])
@pytest.mark.parametrize("scales", [(118, 122), (100, 128)])
def test_mxfp4_bit_placement_gives_the_bits_of_the_table_lookups(T, scales):
    """Scale bytes up to 128 let the tiles expand by bit placement (code 1 a bf16 subnormal
    until its multiply), others take the table lookups: both exact, so the same tiles give
    the same bits. Every code, scales up to the largest the placement takes, with gate_up's
    LoRA epilogue, biases and the clamped SwiGLU (not down's LoRA: its shrink's atomic adds
    sum in a different order each run)."""
    E, H, I, K = MXFP4_SHAPES["gpt-oss-20b"]
    torch.manual_seed(T)
    w13, w2 = mxfp4_weight(E, 2 * I, H, scales, DEV), mxfp4_weight(E, H, I, scales, DEV)
    assert w13.small_scales and w2.small_scales
    oss = _gpt_oss_options(T, E, H, I)
    x = torch.randn(T, H, device=DEV).to(torch.bfloat16)
    topk_weights, topk_ids = _routing(T, E, K)
    placed = fused_moe(x, w13, w2, topk_weights, topk_ids, **oss)
    lookups = [dataclasses.replace(w, small_scales=False) for w in (w13, w2)]
    looked = fused_moe(x, *lookups, topk_weights, topk_ids, **oss)
    assert torch.isfinite(placed).all() and placed.abs().max() > 0
    assert torch.equal(placed, looked), (T, scales)


@pytest.mark.parametrize(
    "config",
    [
        None,
        MoeConfig(block_n=128, block_k=64, block_n_down=128, block_k_down=64),
        MoeConfig(block_k=128, block_k_down=128),  # a 64-deep tail of 2880: groups masked
        MoeConfig(block_n=32, block_k=256, block_n_down=32, block_k_down=256, num_stages=2),
        MoeConfig(block_m=64, block_k=128, block_k_down=128),
        # sub-tiles (MoeConfig.mxfp4_sub_k): 4 a tile, and 2 with the tail's second masked
        MoeConfig(block_k=256, block_k_down=256, num_stages=2, mxfp4_sub_k=64),
        MoeConfig(block_k=128, block_k_down=128, mxfp4_sub_k=64),
    ],
)
@pytest.mark.parametrize("T", [1, 7, 64, 256])
def test_mxfp4_gpu_layout_gives_the_bits_of_the_release_layout(T, config):
    """The codes rewritten into the GPU layout (Mxfp4Weight.swizzle_, the engine's for bf16)
    expand by their own rotations to the values the release layout's bit placement makes, at
    every tile depth (a thread's 4 code bytes must be one word of the layout): the same bits
    out, with gate_up's LoRA on experts of mixed slots, biases and the clamped SwiGLU, scale
    bytes up to 128 and every code. Not down's LoRA: its shrink sums column blocks' partials
    by atomic adds, whose order (so their fp32 bits) changes from run to run."""
    E, H, I, K = MXFP4_SHAPES["gpt-oss-20b"]
    torch.manual_seed(T)
    release = [mxfp4_weight(E, 2 * I, H, (100, 128), DEV), mxfp4_weight(E, H, I, (100, 128), DEV)]
    swizzled = [dataclasses.replace(w, blocks=w.blocks.clone()).swizzle_() for w in release]
    assert all(w.swizzled for w in swizzled)
    assert all(not torch.equal(a.blocks, b.blocks) for a, b in zip(release, swizzled))
    oss = _gpt_oss_options(T, E, H, I) | dict(config=config)
    x = torch.randn(T, H, device=DEV).to(torch.bfloat16)
    topk_weights, topk_ids = _routing(T, E, K)
    want = fused_moe(x, *release, topk_weights, topk_ids, **oss)
    got = fused_moe(x, *swizzled, topk_weights, topk_ids, **oss)
    assert torch.isfinite(got).all() and got.abs().max() > 0
    assert torch.equal(got, want), (T, config)
    # without the LoRA, whose factors must be x's dtype (an assertion that comes first)
    with pytest.raises(ValueError, match="GPU layout"):
        fused_moe(x.float(), *swizzled, topk_weights, topk_ids, **(oss | dict(lora13=None)))


def test_fused_moe_mxfp4_replays_in_a_cuda_graph(mxfp4_experts):
    """Captured with every slot disabled; replayed with slots on, it gives the eager bits."""
    name, (E, H, I, K), w13, w2, b13, b2, lora13, lora2 = mxfp4_experts
    T = 16
    x = torch.randn(T, H, device=DEV).to(torch.bfloat16)
    topk_weights, topk_ids = _routing(T, E, K)
    info = batch_info(T, "none", DEV)
    oss = dict(b13=b13, b2=b2, activation="swiglu_oai", lora13=lora13, lora2=lora2, info=info)
    graph, out = capture(lambda: fused_moe(x, w13, w2, topk_weights, topk_ids, **oss))
    _write_step(info, batch_info(T, "mixed", DEV))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, fused_moe(x, w13, w2, topk_weights, topk_ids, **oss)), name


@pytest.mark.parametrize("T", [1, 7, 64, 256])
@pytest.mark.parametrize("E,K", [(128, 8), (8, 2), (60, 4)])
@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
def test_route_topk_gpu(T, E, K, scoring):
    logits = (torch.stack([torch.randperm(E) for _ in range(T)]) * (4 / E) - 2).to(DEV)
    w, ids = route_topk(logits.to(torch.bfloat16), K, scoring=scoring, renormalize=True)
    ref_w, ref_ids = reference.route_topk(
        logits.to(torch.bfloat16), K, scoring=scoring, renormalize=True
    )
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(w, ref_w, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("T", [1, 64, 4096])
def test_mlp_elementwise_gpu(T):
    """kernels/mlp.py in bf16 against torch's separate ops: the same rounding steps, so at most
    one bf16 step apart where float32 exp rounds differently."""
    g = torch.Generator(device=DEV).manual_seed(T)
    gate_up = 2 * torch.randn(T, 2 * 1408, generator=g, device=DEV, dtype=torch.bfloat16)
    _within_one_bf16_step(mlp.silu_and_mul(gate_up), reference.silu_and_mul(gate_up))
    rows = torch.randn(T, 6, 2048, generator=g, device=DEV, dtype=torch.bfloat16)
    shared = torch.randn(T, 2048, generator=g, device=DEV, dtype=torch.bfloat16)
    for gate in (None, torch.randn(T, 1, generator=g, device=DEV, dtype=torch.bfloat16)):
        got = mlp.add_shared_expert(rows, shared, gate)
        _within_one_bf16_step(got, reference.add_shared_expert(rows, shared, gate))


@pytest.mark.parametrize("T", [1, 64, 4096])
def test_output_gate_gpu(T):
    """The gated attention's output gate at Qwen3.5's sizes (16 heads of 256), bf16."""
    g = torch.Generator(device=DEV).manual_seed(T + 2)
    out = torch.randn(T, 16, 256, generator=g, device=DEV, dtype=torch.bfloat16)
    q_gate = torch.randn(T, 16, 2, 256, generator=g, device=DEV, dtype=torch.bfloat16)
    gate = q_gate[:, :, 1]
    _within_one_bf16_step(output_gate(out, gate), reference.output_gate(out, gate))


@pytest.mark.parametrize("spread", ["none", "mixed", "distinct"])
@pytest.mark.parametrize("T", [1, 64, 256])
def test_silu_and_mul_lora_gpu(T, spread):
    """kernels/mlp.silu_and_mul_lora in bf16 at Moonlight's shared expert (H 2048, I 2816)
    against reference.silu_and_mul_lora on the same factors (8 slots of ranks 0-16): h within
    one bf16 step where the delta's float32 sum rounds alike (nearly everywhere), the shrink's
    partials summed within float32 summation order; under a CUDA graph replayed with new
    slots, the eager result."""
    H, I, R = 2048, 2816, 16
    info = batch_info(T, spread, DEV)
    gate_up_lora = lora_weights(8, (), 2, R, H, (I, I), info.rank_of_slot, torch.bfloat16, DEV)
    down_lora = lora_weights(8, (), 1, R, I, (H,), info.rank_of_slot, torch.bfloat16, DEV)
    g = torch.Generator(device=DEV).manual_seed(T)
    x = torch.randn(T, H, generator=g, device=DEV, dtype=torch.bfloat16)
    gate_up = 2 * torch.randn(T, 2 * I, generator=g, device=DEV, dtype=torch.bfloat16)
    expand = FoldedLora(reference.lora_shrink(x, gate_up_lora, info), gate_up_lora, info)

    def step():
        h, down = mlp.silu_and_mul_lora(gate_up, info, expand=expand, shrink=down_lora)
        return h, down.shrunk

    h, part = step()
    want, want_down = reference.silu_and_mul_lora(gate_up, info, expand=expand, shrink=down_lora)
    a, b = h.float(), want.float()
    # the delta sums in another order than the reference's matmul: a delta a rounding apart,
    # then gate + delta rounded, then silu * up; where gate + delta cancels, that is more than
    # one bf16 step of the small result (a few outputs in 10^5: a torch emulation of the
    # kernel's order gives 1-5 at 64-256 rows)
    off = (a - b).abs() > a.abs().maximum(b.abs()) * 2.0**-7 + 1e-6
    assert off.float().mean() <= 1e-4, f"{int(off.sum())} outputs past one bf16 step"
    assert rel_err(a, b) <= 1e-3 and (a == b).float().mean() > 0.98
    slots = info.slot_of_token[:T].long()
    base = (slots < 0) | (info.slot_enabled[slots.clamp(min=0)] == 0)
    assert torch.equal(h[base], mlp.silu_and_mul(gate_up)[base]), "a base row changed"
    rows = reference.lora_shrink(h, down_lora, info).abs().sum(dim=(1, 2)) > 0
    if rows.any():
        got = part[rows].sum(dim=1)
        assert rel_err(got, reference.lora_shrink(h, down_lora, info)[rows]) <= 1e-4
    graph, (h_g, part_g) = capture(step)
    info.slot_of_token.copy_(info.slot_of_token.flip(0))
    gate_up.normal_()
    graph.replay()
    h_e, part_e = step()
    assert torch.equal(h_g, h_e)
    rows = reference.lora_shrink(h_e, down_lora, info).abs().sum(dim=(1, 2)) > 0
    assert torch.equal(part_g[rows], part_e[rows])


def _within_one_bf16_step(got: torch.Tensor, want: torch.Tensor) -> None:
    a, b = got.float(), want.float()
    step = torch.maximum(a.abs(), b.abs()).clamp(min=1e-30) * 2.0**-7
    assert ((a - b).abs() <= step).all() and (a == b).float().mean() > 0.99


@pytest.mark.parametrize("T", [1, 7, 64, 4096])
@pytest.mark.parametrize(  # DeepSeek-V3, Moonlight (one group), DeepSeek-V2 (groups of 20)
    "E,K,n_group,topk_group,bias",
    [(256, 8, 8, 4, True), (64, 6, 1, 1, True), (160, 6, 8, 3, False)],
)
def test_grouped_route_gpu(T, E, K, n_group, topk_group, bias):
    grouped = GroupedRouting(
        n_group=n_group,
        topk_group=topk_group,
        group_score="top2_sum" if bias else "max",
        routed_scaling_factor=2.5,
        correction_bias=bias,
    )
    logits = (torch.stack([torch.randperm(E) for _ in range(T)]) * (4 / E) - 2).to(DEV)
    logits = logits.to(torch.bfloat16)  # distinct in bf16 too: 256 values over [-2, 2)
    correction = (torch.randperm(E, device=DEV).float() * (0.5 / E) - 0.25) if bias else None
    kw = dict(scoring="sigmoid" if bias else "softmax", renormalize=bias, grouped=grouped)
    w, ids = route_topk(logits, K, correction_bias=correction, **kw)
    ref_w, ref_ids = reference.route_topk(logits, K, correction_bias=correction, **kw)
    got, want = ids.long().sort(-1), ref_ids.long().sort(-1)
    assert torch.equal(got.values, want.values)
    torch.testing.assert_close(
        w.gather(1, got.indices), ref_w.gather(1, want.indices), rtol=1e-5, atol=1e-6
    )


@pytest.mark.parametrize(
    "T,spread", [(1, "one"), (64, "distinct"), (64, "mixed"), (256, "distinct"), (256, "one")]
)  # one token enables an adapter only with "one": slot 0 has rank 0, "mixed" starts on base
@pytest.mark.parametrize("rank", [16, 64])
def test_lora_shrink_split_bf16(T, spread, rank):
    """o_proj's split shrink (4096 inputs): the partials sum to the fp32 shrink."""
    info = batch_info(T, spread, DEV)
    lora = lora_weights(
        info.num_slots, (), 1, rank, 4096, (2048,), info.rank_of_slot.cpu(), torch.bfloat16, DEV
    )
    x = torch.randn(T, 4096, device=DEV).to(torch.bfloat16)
    part = lora_shrink_split(x, lora, info)
    slots = info.slot_of_token
    on = (slots >= 0) & (info.slot_enabled[slots.clamp(min=0)] != 0)
    expect = reference.lora_shrink(x.float(), _f32(lora), info)
    assert on.any()
    assert rel_err(part[on].sum(dim=1), expect[on]) <= 1e-2


def _dense_lora_step(T: int, in_dim: int, slices: tuple, pool_rank: int):
    """A T-token step of mixed slots on a dense LoRA of `slices` over in_dim inputs (a pool of
    rank pool_rank), bf16: (info, lora, x, y)."""
    info = batch_info(T, "mixed", DEV)
    ranks = info.rank_of_slot.cpu()
    lora = lora_weights(
        info.num_slots, (), len(slices), pool_rank, in_dim, slices, ranks, torch.bfloat16, DEV
    )
    x = torch.randn(T, in_dim, device=DEV).to(torch.bfloat16)
    y = torch.randn(T, sum(slices), device=DEV).to(torch.bfloat16)
    return info, lora, x, y


@pytest.mark.parametrize("in_dim,slices", [(2048, (4096, 512, 512)), (4096, (2048,))])
def test_add_lora_prefill_tiles_give_the_same_bits(in_dim, slices):
    """add_lora_tiles' prefill choices (512 columns, or 1024 with registers capped and two
    stages where the grid is large) split the columns differently and change no sum."""
    info, lora, x, y = _dense_lora_step(4096, in_dim, slices, 16)
    out = add_lora_(y.clone(), x, lora, info)
    for cw in (512, 1024):
        assert torch.equal(add_lora_(y.clone(), x, lora, info, tiles=dict(CW=cw)), out), cw


@pytest.mark.parametrize("T", [1, 7, 64, 256, 300, 4096])  # past 256: the prefill tiles
@pytest.mark.parametrize("spread", SPREADS)
@pytest.mark.parametrize(
    "in_dim,slices",
    [(2048, (4096, 512, 512)), (4096, (2048,)), (2048, (768, 768)), (2048, (8192, 4096, 32, 32))],
)  # q|k|v, o, shared-expert gate|up, Qwen3.5's in_proj (qkv|z|b|a)
def test_add_lora_bf16(T, spread, in_dim, slices):
    info = batch_info(T, spread, DEV)
    ranks = info.rank_of_slot.cpu()
    lora = lora_weights(
        info.num_slots, (), len(slices), 64, in_dim, slices, ranks, torch.bfloat16, DEV
    )
    x = torch.randn(T, in_dim, device=DEV).to(torch.bfloat16)
    y = torch.randn(T, sum(slices), device=DEV).to(torch.bfloat16)
    ref = reference.add_lora_(y.float(), x.float(), _f32(lora), info)
    out = add_lora_(y.clone(), x, lora, info)
    if spread == "none":
        assert torch.equal(out, y)
    else:
        assert rel_err(out - y, ref - y.float()) <= 1e-2


@pytest.mark.parametrize("rows", [slice(1, 2), slice(3, 11), slice(40, 296)])
def test_add_lora_rows_alone_equal_them_in_a_prefill_step(rows):
    """A decode step's rows (16-row tiles, mma.sync) give the bits they get inside a 4096-token
    step (64-row tiles, warpgroup MMAs, the step's rank tile): each sum is one ascending chain
    of k16 products into one float32 accumulator either way. Deterministic inference relies on
    it (layers/attention_lora.folds_lora)."""
    info, lora, x, y = _dense_lora_step(4096, 2048, (4096, 512, 512), 64)
    tiled = dataclasses.replace(info, rank_tile=16)
    batched = add_lora_(y.clone(), x, lora, tiled)
    alone_info = _rows_alone(info, rows)
    alone = add_lora_(y[rows].clone(), x[rows].contiguous(), lora, alone_info)
    assert torch.equal(alone, batched[rows]), (rows, (alone - batched[rows]).abs().max())


def test_prefill_lora_rank_tile_gives_the_pool_tiles_bits():
    """A 4096-token step whose slots have ranks of at most 16 in a rank-64 pool, run at the
    step's rank tile (LoraBatchInfo.rank_tile 16: the MoE's block shrinks and epilogues,
    add_lora_'s prefill tiles) and at the pool's: the rank rows it drops are zeros, so the
    bits are the same, and both match the fp32 reference."""
    E, H, I, K = SHAPES["qwen3-30b-a3b"]
    T = 4096
    info = batch_info(T, "mixed", DEV)
    tiled = dataclasses.replace(info, rank_tile=16)
    ranks = info.rank_of_slot.cpu()
    assert int(ranks.max()) <= 16
    bf16 = torch.bfloat16
    lora13 = lora_weights(info.num_slots, (E,), 2, 64, H, (I, I), ranks, bf16, DEV)
    lora2 = lora_weights(info.num_slots, (E,), 1, 64, I, (H,), ranks, bf16, DEV)
    w13 = (torch.randn(E, 2 * I, H, device=DEV) / H**0.5).to(bf16)
    w2 = (torch.randn(E, H, I, device=DEV) / I**0.5).to(bf16)
    x = torch.randn(T, H, device=DEV).to(bf16)
    topk_weights, topk_ids = _routing(T, E, K)
    moe = dict(lora13=lora13, lora2=lora2)
    pool = fused_moe(x, w13, w2, topk_weights, topk_ids, **moe, info=info)
    out = fused_moe(x, w13, w2, topk_weights, topk_ids, **moe, info=tiled)
    assert torch.equal(out, pool)
    ref = _reference_moe(x, w13, w2, topk_weights, topk_ids, lora13, lora2, info)
    assert rel_err(out, ref) <= 1e-2
    qkv = lora_weights(info.num_slots, (), 3, 64, H, (4096, 512, 512), ranks, bf16, DEV)
    y = torch.randn(T, 5120, device=DEV).to(bf16)
    pool = add_lora_(y.clone(), x, qkv, info)
    assert torch.equal(add_lora_(y.clone(), x, qkv, tiled), pool)
    assert (
        rel_err(pool - y, reference.add_lora_(y.float(), x.float(), _f32(qkv), info) - y.float())
        <= 1e-2
    )


def test_cuda_graph_replay_with_new_batch_info():
    """Captured with every slot disabled; replays see slots switched on and off in place."""
    E, H, I, K = SHAPES["qwen3-30b-a3b"]
    T, S = 16, 8
    torch.manual_seed(1)
    w13 = (torch.randn(E, 2 * I, H, device=DEV) / H**0.5).to(torch.bfloat16)
    w2 = (torch.randn(E, H, I, device=DEV) / I**0.5).to(torch.bfloat16)
    ranks = batch_info(T, "none", DEV, S).rank_of_slot.cpu()
    lora13 = lora_weights(S, (E,), 2, R, H, (I, I), ranks, torch.bfloat16, DEV)
    lora2 = lora_weights(S, (E,), 1, R, I, (H,), ranks, torch.bfloat16, DEV)
    qkv = lora_weights(S, (), 3, R, H, (4096, 512, 512), ranks, torch.bfloat16, DEV)
    # static buffers, written in place before each replay
    x = torch.zeros(T, H, device=DEV, dtype=torch.bfloat16)
    logits = torch.zeros(T, E, device=DEV)
    y = torch.zeros(T, 5120, device=DEV, dtype=torch.bfloat16)
    y_in = torch.zeros_like(y)
    info = batch_info(T, "none", DEV, S)

    def step():
        topk_weights, topk_ids = route_topk(logits, K, renormalize=True)
        moe = fused_moe(x, w13, w2, topk_weights, topk_ids, lora13=lora13, lora2=lora2, info=info)
        y.copy_(y_in)
        add_lora_(y, x, qkv, info)
        return moe

    graph, moe_out = capture(step)

    for spread in ("mixed", "none", "distinct", "one"):
        _write_step(info, batch_info(T, spread, DEV, S))
        x.copy_(torch.randn(T, H, device=DEV))
        logits.copy_(torch.randn(T, E, device=DEV))
        y_in.copy_(torch.randn(T, 5120, device=DEV))
        graph.replay()
        torch.cuda.synchronize()
        topk_weights, topk_ids = reference.route_topk(logits, K, renormalize=True)
        ref = _reference_moe(x, w13, w2, topk_weights, topk_ids, lora13, lora2, info)
        assert rel_err(moe_out, ref) <= 1e-2, spread
        ref_y = reference.add_lora_(y_in.float(), x.float(), _f32(qkv), info)
        assert rel_err(y, ref_y) <= 1e-2, spread
        if spread == "none":
            assert torch.equal(y, y_in)


def test_no_lora_work_without_enabled_slots():
    """LoraBatchInfo with every slot disabled gives exactly the base MoE (same launches)."""
    E, H, I, K = SHAPES["small-e8k2"]
    T = 8
    w13 = (torch.randn(E, 2 * I, H, device=DEV) / H**0.5).to(torch.bfloat16)
    w2 = (torch.randn(E, H, I, device=DEV) / I**0.5).to(torch.bfloat16)
    info = batch_info(T, "distinct", DEV)
    info = LoraBatchInfo(
        info.slot_of_token,
        info.rank_of_slot,
        info.scaling_of_slot,
        torch.zeros_like(info.slot_enabled),
    )
    lora13 = lora_weights(8, (E,), 2, R, H, (I, I), info.rank_of_slot.cpu(), torch.bfloat16, DEV)
    lora2 = lora_weights(8, (E,), 1, R, I, (H,), info.rank_of_slot.cpu(), torch.bfloat16, DEV)
    x = torch.randn(T, H, device=DEV).to(torch.bfloat16)
    topk_weights, topk_ids = _routing(T, E, K)
    base = fused_moe(x, w13, w2, topk_weights, topk_ids)
    out = fused_moe(x, w13, w2, topk_weights, topk_ids, lora13=lora13, lora2=lora2, info=info)
    assert torch.equal(out, base)


# Qwen3-30B-A3B's q|k|v, o and router, Mixtral's o, a shared-expert gate (N=1) with a bias
LINEAR_SHAPES = [(5120, 2048), (2048, 4096), (128, 2048), (4096, 4096), (1, 2048)]
# the row counts the batch-invariance test checks below INVARIANT_ROWS
CHECKED_ROWS = (1, 2, 3, 8, 13, 16, 17, 24, 32, 40, 64, 100, 101, 120)


def _linear_error(project, N: int, K: int, M: int) -> float:
    """project(x, w, bias) on fresh bf16 inputs (a bias where N == 1) against the fp32 linear."""
    x = torch.randn(M, K, device=DEV).to(torch.bfloat16)
    w = (torch.randn(N, K, device=DEV) / K**0.5).to(torch.bfloat16)
    bias = torch.randn(N, device=DEV).to(torch.bfloat16) if N == 1 else None
    ref = reference.linear(x.float(), w.float(), None if bias is None else bias.float())
    return rel_err(project(x, w, bias), ref)


@pytest.mark.parametrize("N,K", LINEAR_SHAPES)
@pytest.mark.parametrize("M", [1, 2, 3, 4, 8])
def test_skinny_linear_bf16(N, K, M):
    assert _linear_error(skinny_linear, N, K, M) <= 1e-2


@pytest.mark.parametrize("project,rows", [(skinny_linear, 2), (dot_linear, 5)])
def test_projection_chain_in_a_graph(project, rows):
    """Each projection reads the one before's output, and each launches early (PDL): the GEMV
    loads its weights before the wait and x after it, the tensor-core kernel waits first. A
    replay with a new input must give the new chain's result, not one built on the last
    replay's activations."""
    ws = [
        (torch.randn(n, k, device=DEV) / k**0.5).to(torch.bfloat16)
        for n, k in ((4096, 2048), (2048, 4096), (5120, 2048))
    ]
    x = torch.empty(rows, 2048, device=DEV, dtype=torch.bfloat16)

    def chain():
        h = x
        for w in ws[:2]:
            h = project(h, w)
        return project(h, ws[2])

    graph, out = capture(chain)
    for _ in range(3):
        x.copy_(torch.randn_like(x))
        graph.replay()
        ref = x.float()
        for w in ws[:2]:
            ref = (ref @ w.float().T).to(torch.bfloat16).float()
        assert rel_err(out, ref @ ws[2].float().T) <= 1e-2


@pytest.mark.parametrize("N,K", LINEAR_SHAPES)
@pytest.mark.parametrize("M", [1, 2, 4, 13, 24, 64, 100])
def test_dot_linear_bf16(N, K, M):
    assert _linear_error(dot_linear, N, K, M) <= 1e-2


@pytest.mark.parametrize(
    "N,K,bias", [(N, K, False) for N, K in LINEAR_SHAPES[:4]] + [(6144, 2048, True)]
)
def test_batch_invariant_linear_rows_do_not_depend_on_the_row_count(N, K, bias):
    """The default projections: a row's bits are the same at every row count, across the
    tensor-core kernel's configs, the row counts where cuBLAS was measured to agree, and the
    switch to cuBLAS at INVARIANT_ROWS (cuBLAS alone fails this at Qwen3-30B-A3B's o,
    2048 x 4096: it splits K below 101 rows)."""
    w = (torch.randn(N, K, device=DEV) / K**0.5).to(torch.bfloat16)
    b = torch.randn(N, device=DEV).to(torch.bfloat16) if bias else None
    x = torch.randn(1024, K, device=DEV).to(torch.bfloat16)
    batch_invariant_linear = BatchInvariantLinear()  # measures cuBLAS at the first call
    first = batch_invariant_linear(x[:3], w, b)
    for M in (*CHECKED_ROWS, INVARIANT_ROWS - 1, INVARIANT_ROWS, 200, 1024):
        rows = batch_invariant_linear(x[:M], w, b)[:3]
        assert torch.equal(rows, first[:M]), f"M={M}: {(rows != first[:M]).sum().item()} differ"
