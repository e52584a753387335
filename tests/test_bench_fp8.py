"""The benchmarks' --fp8 on the CPU: the model folder it writes reads as a block-FP8 model whose
engine keeps the experts FP8 (on a kernel table that keeps them: the reference one told to, as
tests/test_fp8_kept.py builds it) or says it dequantized them; the decode floor counts the FP8
experts' codes and float32 scales and the bf16 rest, to the byte; decode.py refuses --fp8 beside
--mxfp4 and on the gpt-oss shapes."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from test_fp8_kept import table_llm

from moelora import LLM, SamplingParams
from moelora.models.registry import read_model_config

ROOT = Path(__file__).resolve().parents[1]
H200_BYTES = 141e9
# tiny-qwen3-moe (moelora.models.shapes.DEMO_SHAPE): vocabulary 512, hidden 64, 2 MoE layers of 8
# experts of intermediate 32, 4 query and 2 KV heads of 16
TINY = dict(vocab=512, hidden=64, layers=2, experts=8, inter=32, q=4 * 16, kv=2 * 16)


@pytest.fixture
def bench(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.syspath_prepend(str(ROOT / "bench"))  # as `python bench/decode.py` has it
    import common
    import decode

    return common, decode


def tiny_fp8_weight_bytes(touched: list[int]) -> int:
    """Weight bytes of a decode step of tiny-qwen3-moe with FP8 experts, `touched` distinct
    experts per layer: the lm_head, attention and routers in bf16; an expert's w13 [64, 64] and
    w2 [64, 32] a byte a weight and one float32 scale each (each within one 128x128 block)."""
    H, elem = TINY["hidden"], 2
    lm_head = TINY["vocab"] * H * elem
    attention = (H * TINY["q"] + 2 * H * TINY["kv"] + TINY["q"] * H) * elem
    router = TINY["experts"] * H * elem
    expert = (2 * TINY["inter"] * H + 4) + (H * TINY["inter"] + 4)
    return lm_head + TINY["layers"] * (attention + router) + sum(touched) * expert


def test_an_fp8_folder_builds_kept_experts_and_floors_count_codes_and_scales(bank, bench) -> None:
    from moelora.kernels.fp8_block import Fp8Weight

    common, _ = bench
    folder = common.model_folder(None, "tiny-qwen3-moe", fp8=True)
    assert read_model_config(folder)[0].weights_fp8 == "checkpoint"
    llm = table_llm(bank, Path(folder), {}, True, load_format="dummy")
    engine, mc = llm.engine, llm.engine.model_config
    assert mc.experts_fp8 and isinstance(engine.model.layers[0].mlp.w13, Fp8Weight)
    assert common.experts_held(mc) == "FP8 experts (block 128x128)"
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    for i, prompt in enumerate(([1, 2, 3, 4, 5], [9, 8, 7])):
        engine.add_request(f"r{i}", prompt, params, None)
    engine.step()
    step = common.plan_step(engine)
    model, lora = common.floor_bytes(engine, step)
    touched = [int(ids.unique().numel()) for ids in step.routed_experts()]
    kv = int(step.inputs.seq_lens.sum()) * TINY["layers"] * 2 * TINY["kv"] * 2
    assert (model, lora) == (tiny_fp8_weight_bytes(touched) + kv, 0)
    for request_id in step.request_ids:
        engine.abort_request(request_id)


def test_an_fp8_expert_counts_each_block_of_its_grids(bench) -> None:
    """H = 256, I = 200: w13 [400, 256] on a 4 x 2 grid of scales (the last row of blocks
    ragged), w2 [256, 200] on a 2 x 2 one; and a bf16 expert of the same shape."""
    common, _ = bench
    mc, _ = read_model_config(common.model_folder(None, "tiny-qwen3-moe", fp8=True))
    mc = dataclasses.replace(mc, hidden_size=256, moe_intermediate_size=200, experts_fp8=True)
    assert common.expert_bytes(mc) == (400 * 256 + 4 * 8) + (256 * 200 + 4 * 4)
    bf16 = dataclasses.replace(mc, experts_fp8=False)
    assert common.expert_bytes(bf16) == 3 * 256 * 200 * 2


def test_an_engine_that_dequantizes_the_experts_says_so(bench, capsys) -> None:
    """The CPU's kernel table keeps no FP8 experts: the engine holds them in its dtype."""
    common, _ = bench
    folder = common.model_folder(None, "tiny-qwen3-moe", fp8=True)
    llm = LLM(folder, load_format="dummy", device="cpu", dtype="float32", num_pages=16)
    mc = llm.engine.model_config
    assert not mc.experts_fp8 and isinstance(llm.engine.model.layers[0].mlp.w13, torch.Tensor)
    held = common.built_experts(mc)
    assert held == "block-FP8 model, experts dequantized at load (not kept FP8)"
    assert "note: block-FP8 model, experts dequantized" in capsys.readouterr().out


def test_the_fp8_shape_fits_one_h200_only_in_fp8(bench) -> None:
    """glm-4.5-air-fp8's weights, every expert and the embedding counted: under an H200's
    memory with FP8 experts, over it in bf16."""
    common, _ = bench
    mc, _ = read_model_config(common.model_folder(None, "glm-4.5-air-fp8"))
    assert mc.weights_fp8 == "checkpoint" and mc.num_layers == 46
    every = [mc.num_experts] * sum(mc.sparse_layers)
    embedding = mc.vocab_size * mc.hidden_size * 2
    fp8 = common.weight_bytes(dataclasses.replace(mc, experts_fp8=True), every) + embedding
    bf16 = common.weight_bytes(mc, every) + embedding
    experts = 45 * 128 * 3 * 4096 * 1408  # 45 MoE layers of 128 experts, I = 1408 = 11 x 128
    assert bf16 - fp8 == experts - 4 * 45 * 128 * (22 * 32 + 32 * 11)
    assert fp8 < 0.85 * H200_BYTES < H200_BYTES < bf16


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--fp8", "--mxfp4"], "argument --mxfp4: not allowed with argument --fp8"),
        (["--fp8", "--shape", "gpt-oss-20b"], "--fp8 is not for the gpt-oss shapes"),
    ],
)
def test_decode_refuses_fp8_beside_mxfp4_or_on_gpt_oss(bench, capsys, argv, message) -> None:
    _, decode = bench
    with pytest.raises(SystemExit):
        decode.parse_args(argv)
    assert message in capsys.readouterr().err


def test_decode_fp8_defaults_to_the_qwen3_30b_a3b_shape(bench) -> None:
    _, decode = bench
    args = decode.parse_args(["--fp8"])
    assert args.fp8 and not args.mxfp4 and args.shape == "qwen3-30b-a3b"


def test_fp8_projections_count_codes_and_scales_in_the_floor(bench) -> None:
    """A model keeping attention's q/k/v/o FP8 (projections_fp8): each [out, in] of a layer a
    byte a weight and a float32 scale a 128x128 block, in place of two bytes a weight."""
    common, _ = bench
    mc, _ = read_model_config(common.model_folder(None, "tiny-qwen3-moe", fp8=True))
    mc = dataclasses.replace(mc, experts_fp8=True)
    kept = dataclasses.replace(mc, projections_fp8=True)
    touched = [2] * sum(mc.sparse_layers)
    saved = 0
    for layer in range(mc.num_layers):
        for n_in, n_out in common.attention_shapes(mc, layer):
            blocks = -(-n_in // 128) * -(-n_out // 128)
            saved += 2 * n_in * n_out - (n_in * n_out + 4 * blocks)
    assert saved > 0
    assert common.weight_bytes(mc, touched) - common.weight_bytes(kept, touched) == saved
    assert common.experts_held(kept) == "FP8 experts and attention projections (block 128x128)"


def test_mla_fp8_projections_keep_kv_b_in_bf16_in_the_floor(bench) -> None:
    """moonlight's MLA keeping its projections FP8: every one but kv_b_proj at a byte a weight
    and a float32 scale a block; kv_b_proj at two bytes a weight."""
    common, _ = bench
    mc, _ = read_model_config(common.model_folder(1, "moonlight-16b-a3b"))
    mc = dataclasses.replace(mc, weights_fp8="checkpoint")
    kept = dataclasses.replace(mc, projections_fp8=True)
    shapes = common.attention_shapes(mc, 0)
    kv_b = shapes[-2]
    want = 2 * kv_b[0] * kv_b[1] + sum(
        n_in * n_out + 4 * -(-n_in // 128) * -(-n_out // 128)
        for n_in, n_out in shapes[:-2] + shapes[-1:]
    )
    assert common.attention_bytes(kept, 0) == want
    assert common.attention_bytes(mc, 0) == 2 * sum(i * o for i, o in shapes)
