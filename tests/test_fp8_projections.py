"""Attention's block-FP8 q/k/v/o kept as codes and scales (ModelConfig.projections_fp8), fp32.

As tests/test_fp8_kept.py does for the experts: the device's kernel table told to keep FP8
projections or not. On the CPU that is the reference table, whose linear_fp8 dequantizes at
every call, so the engine that keeps them is the dequantize-at-load engine on the same
checkpoint (its weights to the bit, its greedy tokens and logprobs, with and without adapters);
on --moelora-device=cuda the Triton table, whose fp8_linear reads the codes and scales.

The fixture's attention is widened so q (4 heads of 64) and k, v (2 of 64) end on 128-row
blocks: the checkpoint's three grids of scales stack into q|k|v's one. Hidden 192 gives q|k|v
a ragged second block of columns and o a ragged second block of rows. The tiny default
fixture (q 64 rows) is the case kept out: dequantized at load. DeepSeek-V3's MLA (all but
kv_b_proj kept) and GLM-4.5's GQA with biases, widened likewise, are quantized online.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import hf_fixtures as hf
import pytest
import torch
from test_fp8 import random_prompts, to_bf16, write_fp8_checkpoint
from test_fp8_kept import LORAS, assert_same_outputs
from test_fp8_kept import table_llm as kept_table_llm
from test_vs_transformers import greedy_params

if TYPE_CHECKING:
    from conftest import FixtureBank

WIDE = dict(hidden_size=192, head_dim=64, num_attention_heads=4, num_key_value_heads=2)


def table_llm(bank: FixtureBank, path: Path, loras: dict[str, Path], keeps: bool, **kwargs):
    """make_llm on the device's kernel table told whether to keep FP8 projections."""
    return kept_table_llm(bank, path, loras, keeps, field="keeps_fp8_projections", **kwargs)


def wide(bank: FixtureBank) -> Path:
    return bank.model_variant("wide-attention", "qwen3_moe", **WIDE)


def wide_adapters(bank: FixtureBank) -> dict[str, Path]:
    """a: PEFT rank 8 on attention and the experts; b: rank 4 on q and o. Random lora_B."""
    src = wide(bank)
    targets = hf.peft_targets("qwen3_moe")  # q, k, v, o
    return {
        "a": bank.adapter(
            "fp8-proj-peft-a",
            lambda p: hf.make_peft_adapter(
                src,
                p,
                targets=targets,
                target_parameters=hf.EXPERT_PARAMS,
                seed=1,
                rank=8,
                alpha=16,
            ),
        ),
        "b": bank.adapter(
            "fp8-proj-peft-b",
            lambda p: hf.make_peft_adapter(
                src, p, targets=["q_proj", "o_proj"], seed=2, rank=4, alpha=8
            ),
        ),
    }


def wide_checkpoint(bank: FixtureBank, kind: str) -> Path:
    """kind "fp8": a block-FP8 folder as the releases store it; "bf16": for quantization='fp8'."""
    src = wide(bank)
    if kind == "bf16":
        return bank.adapter("fp8-proj-bf16", lambda p: to_bf16(src, p, layout="per_expert"))
    return bank.adapter(
        "fp8-proj-fp8",
        lambda p: write_fp8_checkpoint(src, p, layout="per_expert", shards=2),
    )


@pytest.mark.parametrize("kind", ["fp8", "bf16"])
def test_kept_projections_are_the_dequantized_engine(bank: FixtureBank, kind: str) -> None:
    from moelora.kernels.fp8_block import FP8_DTYPE, dequantize_fp8_block

    path = wide_checkpoint(bank, kind)
    loras = wide_adapters(bank)
    options = {"quantization": "fp8"} if kind == "bf16" else {}
    kept = table_llm(bank, path, loras, True, **options)
    loaded = table_llm(bank, path, loras, False, **options)
    assert kept.engine.model_config.projections_fp8
    assert not loaded.engine.model_config.projections_fp8
    for i, (layer, twin) in enumerate(zip(kept.engine.model.layers, loaded.engine.model.layers)):
        for name in ("qkv_proj", "o_proj"):
            proj, dense = getattr(layer.self_attn, name), getattr(twin.self_attn, name)
            assert proj.weight.dtype == FP8_DTYPE and dense.weight_scale_inv is None, (i, name)
            # each slice's scales on its own rows: a shifted or swapped block changes these
            got = dequantize_fp8_block(proj.weight, proj.weight_scale_inv, torch.float32)
            assert torch.equal(got, dense.weight), (i, name)
    prompts = random_prompts(seed=7)
    tokens = []
    for lora in (None, LORAS):
        got, want = (llm.generate(prompts, greedy_params(), lora=lora) for llm in (kept, loaded))
        # the CPU: the same weights, dequantized at each call; the GPU: float32 products of
        # the same dequantized weights by another kernel, as test_fp8_kept's tolerance
        tol = 1e-5 if bank.device == "cpu" else 1e-4
        assert_same_outputs(got, want, f"{kind}, lora={lora}", tol)
        tokens.append([list(o.token_ids) for o in got])
    assert tokens[0] != tokens[1], kind  # the adapters matter


def test_projections_off_the_block_grid_are_dequantized(bank: FixtureBank) -> None:
    """The default fixture's q is 64 rows: q|k|v's slices would share blocks of scales, so the
    projections are dequantized at load even where the kernels keep FP8."""
    path = bank.adapter(
        "fp8-proj-narrow",
        lambda p: write_fp8_checkpoint(bank.model("qwen3_moe"), p, layout="per_expert"),
    )
    llm = table_llm(bank, path, {}, True)
    assert not llm.engine.model_config.projections_fp8
    assert llm.engine.model.layers[0].self_attn.qkv_proj.weight.dtype == torch.float32


def test_dummy_fp8_projections_are_made_kept(bank: FixtureBank) -> None:
    """load_format='dummy' makes the codes and scales themselves: weights within +-0.02."""
    from moelora.kernels.fp8_block import FP8_DTYPE, dequantize_fp8_block

    llm = table_llm(bank, wide_checkpoint(bank, "fp8"), {}, True, load_format="dummy")
    proj = llm.engine.model.layers[1].self_attn.qkv_proj
    assert proj.weight.dtype == FP8_DTYPE
    weights = dequantize_fp8_block(proj.weight, proj.weight_scale_inv, torch.float32)
    assert 0.015 < weights.abs().max() <= 0.02 and weights.std() > 0.005
    out = llm.generate(random_prompts(seed=8, n=2), greedy_params())
    assert all(len(o.token_ids) > 0 for o in out)


# DeepSeek-V3's MLA with q_lora_rank 128 (q_a|kv_a's grid: q_a's one block of rows, then
# kv_a's 40 rows in a ragged one; q_b, o kept too, kv_b dequantized), and GLM-4.5's GQA with
# q/k/v biases at 4 heads of 32 (q and k/v 128 rows each): a bf16 checkpoint quantized online
FAMILIES = {
    "deepseek_v3": dict(q_lora_rank=128),
    "glm4_moe": dict(head_dim=32, num_key_value_heads=4),
}


@pytest.mark.parametrize("arch", list(FAMILIES))
def test_kept_family_projections_are_the_dequantized_engine(bank: FixtureBank, arch: str) -> None:
    import mla_fixtures as fx

    from moelora.kernels.fp8_block import FP8_DTYPE, dequantize_fp8_block

    src = bank.adapter(
        f"fp8-proj-{arch}", lambda p: fx.make_model(arch, p, seed=3, **FAMILIES[arch])
    )
    loras = {
        "a": bank.adapter(f"fp8-proj-{arch}-a", lambda p: fx.peft_adapter(src, p, arch, seed=11))
    }
    kept = table_llm(bank, src, loras, True, quantization="fp8")
    loaded = table_llm(bank, src, loras, False, quantization="fp8")
    assert kept.engine.model_config.projections_fp8
    assert not loaded.engine.model_config.projections_fp8
    names = ["qkv_proj", "o_proj"] + (["q_b_proj"] if arch == "deepseek_v3" else [])
    for i, (layer, twin) in enumerate(zip(kept.engine.model.layers, loaded.engine.model.layers)):
        for name in names:
            proj, dense = getattr(layer.self_attn, name), getattr(twin.self_attn, name)
            assert proj.weight.dtype == FP8_DTYPE, (i, name)
            got = dequantize_fp8_block(proj.weight, proj.weight_scale_inv, torch.float32)
            assert torch.equal(got, dense.weight), (i, name)
        if arch == "deepseek_v3":  # read whole by the absorption: never kept
            assert layer.self_attn.kv_b_proj.weight_scale_inv is None
    prompts = random_prompts(seed=9)
    for lora in (None, ["a", None, "a", None, "a"]):
        got, want = (llm.generate(prompts, greedy_params(), lora=lora) for llm in (kept, loaded))
        tol = 1e-5 if bank.device == "cpu" else 1e-4
        assert_same_outputs(got, want, f"{arch}, lora={lora}", tol)


def test_a_projection_left_unquantized_beside_kept_ones_is_refused(
    bank: FixtureBank, tmp_path: Path
) -> None:
    """A block-FP8 checkpoint whose k_proj is stored in float32 while q, v and o are FP8: the
    model keeps q|k|v FP8 and cannot take k's slice unquantized; refused, naming the weight."""
    from safetensors.torch import load_file, save_file

    from moelora.errors import ModelConfigError
    from moelora.kernels.fp8_block import dequantize_fp8_block

    src = bank.adapter(
        "fp8-proj-fp8-one-file",
        lambda p: write_fp8_checkpoint(wide(bank), p, layout="per_expert", shards=1),
    )
    folder = tmp_path / "k-unquantized"
    folder.mkdir()
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            (folder / f.name).write_bytes(f.read_bytes())
            continue
        tensors = load_file(f)
        key = "model.layers.0.self_attn.k_proj.weight"
        scale = tensors.pop(key + "_scale_inv")
        tensors[key] = dequantize_fp8_block(tensors[key], scale, torch.float32)
        save_file(tensors, folder / f.name)
    with pytest.raises(ModelConfigError, match=r"k_proj\.weight' is torch\.float32.*keeps it"):
        table_llm(bank, folder, {}, True)
