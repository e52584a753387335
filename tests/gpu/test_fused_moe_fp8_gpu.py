"""The fused MoE on block-FP8 experts (fp8_block.Fp8Weight) on the GPU, bf16 activations, at
Qwen3-30B-A3B's expert shapes (E=128, H=2048, I=768, top-8), against the fp32 torch reference on
the dequantized weights: relative error of the whole output <= 1e-2, as the bf16 MoE's tests.
Decode (1, 64 tokens) and prefill (4096) sizes, LoRA on mixed slots and off; a CUDA-graph
replay gives the eager bits.
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
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from cuda_graphs import capture  # noqa: E402
from lora_cases import batch_info, fp8_weight, lora_weights, rel_err  # noqa: E402

from moelora.kernels import reference  # noqa: E402
from moelora.kernels.moe import fp8, fused  # noqa: E402
from moelora.kernels.moe.config import default_config  # noqa: E402
from moelora.kernels.moe.fused import MoeConfig, fused_moe  # noqa: E402
from moelora.step.lora import LoraBatchInfo, LoraWeights  # noqa: E402

DEV = "cuda"
E, H, I, K = 128, 2048, 768, 8  # Qwen3-30B-A3B's experts
R = 16  # pool rank; slots have ranks {0, 1, 8, 16}
OCTAVES = 4  # blocks' magnitudes 2^-2 .. 2^2 (lora_cases.fp8_weight)


@pytest.fixture(scope="module")
def experts():
    """FP8 experts, their fp32 dequantization (the reference's weights) and a LoRA pool."""
    torch.manual_seed(0)
    w13, w2 = fp8_weight(E, 2 * I, H, OCTAVES, DEV), fp8_weight(E, H, I, OCTAVES, DEV)
    dense = (w13.dequantize(torch.float32), w2.dequantize(torch.float32))
    info = batch_info(1, "none", DEV)
    ranks = info.rank_of_slot.cpu()
    lora13 = lora_weights(info.num_slots, (E,), 2, R, H, (I, I), ranks, torch.bfloat16, DEV)
    lora2 = lora_weights(info.num_slots, (E,), 1, R, I, (H,), ranks, torch.bfloat16, DEV)
    yield (w13, w2), dense, lora13, lora2
    torch.cuda.empty_cache()


def _f32(lora: LoraWeights) -> LoraWeights:
    return LoraWeights.dense(lora.a.float(), lora.b.float(), lora.out_slices)


def _inputs(T: int):
    x = torch.randn(T, H, device=DEV).to(torch.bfloat16)
    topk_weights, topk_ids = reference.route_topk(
        torch.randn(T, E, device=DEV), K, renormalize=True
    )
    return x, topk_weights, topk_ids


# the default tiles (no tuned FP8 table: BK 64, two tiles a block of scales); 128-deep tiles,
# one a block, by pointers and through TMA; and 256 columns a tile, each spanning two blocks
# of rows
BK128 = MoeConfig(
    block_m=64, block_n=64, block_k=128, block_n_down=128, block_k_down=128, num_warps=8
)
CONFIGS = [
    None,
    BK128,
    dataclasses.replace(BK128, tma=True),
    MoeConfig(block_m=16, block_n=256, block_k=32, block_n_down=256, block_k_down=32),
]


@pytest.mark.parametrize("config", CONFIGS, ids=["default", "bk128", "tma", "bn256"])
@pytest.mark.parametrize("T", [1, 64, 4096])
@pytest.mark.parametrize("spread", ["none", "one", "mixed"])
def test_fused_moe_fp8_bf16(experts, config, T, spread):
    """LoRA off, one adapter for every token, and mixed slots (at 1 token: the base model).
    The default tiles are the device's table, which may pick W8A8 for a bucket: its reference
    is then W8A8's."""
    (w13, w2), (dense13, dense2), lora13, lora2 = experts
    x, topk_weights, topk_ids = _inputs(T)
    info = batch_info(T, spread, DEV)
    out = fused_moe(
        x, w13, w2, topk_weights, topk_ids, lora13=lora13, lora2=lora2, info=info, config=config
    )
    chosen = config or default_config(T, E, H, I, K, torch.device(DEV), fp8=True)
    f32 = dict(lora13=_f32(lora13), lora2=_f32(lora2), info=info)
    if chosen.w8a8:
        ref = reference.fused_moe_w8a8(
            x.float(), w13, w2, topk_weights, topk_ids, **f32, h_group=chosen.block_n
        )
    else:
        ref = reference.fused_moe(x.float(), dense13, dense2, topk_weights, topk_ids, **f32)
    assert torch.isfinite(out).all()
    assert rel_err(out, ref) <= 1e-2, (T, spread, chosen)


def _write_step(info: LoraBatchInfo, new: LoraBatchInfo) -> None:
    """new's buffers copied into info's, as the graph runner writes a captured step's inputs."""
    for field in dataclasses.fields(info):
        buffer = getattr(info, field.name)
        if isinstance(buffer, torch.Tensor):
            buffer.copy_(getattr(new, field.name))


@pytest.mark.parametrize("T", [1, 64])
@pytest.mark.parametrize("deterministic", [False, True])
def test_fused_moe_fp8_replays_in_a_cuda_graph(experts, T, deterministic):
    """Captured with every slot disabled and replayed so; then replayed with adapters written
    in place (one for the token at 1, mixed slots at 64), it gives the eager bits. Down's LoRA
    only where deterministic (its shrinks block by block): else its shrink sums column blocks'
    partials by atomic adds, whose order changes between runs."""
    (w13, w2), _, lora13, lora2 = experts
    x, topk_weights, topk_ids = _inputs(T)
    info = batch_info(T, "none", DEV)
    lora = dict(lora13=lora13, lora2=lora2 if deterministic else None, info=info)
    graph, out = capture(
        lambda: fused_moe(x, w13, w2, topk_weights, topk_ids, **lora, deterministic=deterministic)
    )
    graph.replay()
    base = out.clone()
    _write_step(info, batch_info(T, "one" if T == 1 else "mixed", DEV))
    assert info.any_enabled.item() == 1
    graph.replay()
    torch.cuda.synchronize()
    eager = fused_moe(x, w13, w2, topk_weights, topk_ids, **lora, deterministic=deterministic)
    assert torch.equal(out, eager), (T, deterministic)
    assert not torch.equal(out, base)  # the adapters changed the output


W8A8 = [  # gate_up 128 wide (h in groups of 128) on 64 or 16 rows (mma.sync on f16), or 64
    # wide (groups of 64, down 64 deep) on 128 rows
    MoeConfig(
        **dict(block_m=bm, block_n=bn, block_k=128, block_n_down=bnd, block_k_down=bn),
        num_warps=warps,
        num_stages=stages,
        w8a8=True,
        tma=tma,
    )
    for bm, bn, bnd, warps, stages, tma in (
        (64, 128, 128, 8, 2, False),
        (64, 128, 128, 8, 3, True),  # the weights' code tiles through TMA
        (64, 128, 64, 8, 3, False),
        (16, 128, 64, 4, 3, False),
        (128, 64, 128, 8, 3, True),
        (128, 64, 64, 8, 3, False),
    )
]


@pytest.mark.parametrize(
    "config", W8A8, ids=["64-128", "64-128-tma", "64-64", "16-64", "128x64-tma", "128x64-64"]
)
@pytest.mark.parametrize("T", [64, 4096])
@pytest.mark.parametrize("spread", ["none", "mixed"])
def test_fused_moe_w8a8(experts, config, T, spread):
    """W8A8 (x and h quantized per row and group as they load, x's of 128 columns, h's gate_up's
    tile width; FP8 tensor cores)
    against the reference's own W8A8 (fp8_rows of x and h against the fp32 weights; LoRA on the
    unquantized activations), and within the activations' rounding of the weight-only MoE."""
    (w13, w2), (dense13, dense2), lora13, lora2 = experts
    x, topk_weights, topk_ids = _inputs(T)
    info = batch_info(T, spread, DEV)
    lora = dict(lora13=lora13, lora2=lora2, info=info)
    out = fused_moe(x, w13, w2, topk_weights, topk_ids, **lora, config=config)
    f32 = dict(lora13=_f32(lora13), lora2=_f32(lora2), info=info)
    ref = reference.fused_moe_w8a8(
        x.float(), w13, w2, topk_weights, topk_ids, **f32, h_group=config.block_n
    )
    weight_only = reference.fused_moe(x.float(), dense13, dense2, topk_weights, topk_ids, **f32)
    assert torch.isfinite(out).all()
    assert rel_err(out, ref) <= 1e-2, (T, spread, config)
    # e4m3 keeps 3 bits: each activation is off by up to 1/16, the sums by far less
    assert rel_err(out, weight_only) <= 6e-2, (T, spread, config)
    assert rel_err(ref, weight_only) > 1e-3  # the activations were rounded


@triton.jit
def _placed_kernel(codes_ptr, out_ptr):
    offs = tl.arange(0, 256)
    tl.store(out_ptr + offs, fp8.e4m3_bf16_placed(tl.load(codes_ptr + offs)))


def test_placement_gives_every_finite_codes_value():
    """fp8.e4m3_bf16_placed on the GPU: every finite e4m3 code's bfloat16 conversion, bit for
    bit (subnormals through the bf16x2 multiply, -0 included)."""
    codes = torch.arange(256, dtype=torch.uint8, device=DEV)
    out = torch.empty(256, dtype=torch.bfloat16, device=DEV)
    _placed_kernel[(1,)](codes_ptr=codes, out_ptr=out)
    want = codes.view(torch.float8_e4m3fn).to(torch.bfloat16)
    finite = torch.isfinite(want)
    assert torch.equal(out[finite].view(torch.int16), want[finite].view(torch.int16))


@pytest.mark.parametrize("tma", [False, True], ids=["pointers", "tma"])
@pytest.mark.parametrize("T", [1, 64, 4096])
def test_placed_code_tiles_give_the_conversions_bits(experts, monkeypatch, T, tma):
    """fused.FP8_PLACED (weight-only code tiles by bit placement) gives the converted tiles'
    output to the bit, LoRA on mixed slots: the dots take the same bf16 values."""
    (w13, w2), _, lora13, lora2 = experts
    x, topk_weights, topk_ids = _inputs(T)
    info = batch_info(T, "mixed", DEV)
    chosen = default_config(T, E, H, I, K, torch.device(DEV), fp8=True)
    config = dataclasses.replace(chosen, w8a8=False, tma=tma)  # placement is weight-only's
    outs = []
    for placed in (False, True):
        monkeypatch.setattr(fused, "FP8_PLACED", placed)
        lora = dict(lora13=lora13, lora2=lora2, info=info)
        outs.append(fused_moe(x, w13, w2, topk_weights, topk_ids, **lora, config=config))
    assert torch.equal(outs[0], outs[1]), (T, config)
    assert torch.isfinite(outs[1]).all()
