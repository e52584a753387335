"""Block-FP8 experts kept as codes and scales (ModelConfig.experts_fp8) on the CPU, fp32.

The kernel table here is the device's told to keep FP8 experts or not: on the CPU the reference
one (its fused MoE dequantizes an Fp8Weight at every call), so the engine that keeps them is the
dequantize-at-load engine on the same checkpoint to the bit, its experts and its greedy tokens
and logprobs, with and without adapters; on --moelora-device=cuda the Triton table, whose fused
MoE reads the codes and scales, against its own engine with the experts dequantized at load.
Cases: a per-expert checkpoint (gate and up quantized apart: I = 128, so each half of w13's grid
starts on a block), Mixtral's w1/w3/w2 alike, a fused one with I = 40 (gate_up quantized whole:
up's rows start inside w13's one ragged block) and I = 136 (up starts 8 rows into the second
block, down's 136 columns end in a ragged one), online quantization of a bf16 checkpoint in
both layouts; and the case kept out: a per-expert checkpoint with I = 40, whose gate and up
would share a block of scales, is dequantized at load.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING

import hf_fixtures as hf
import pytest
import torch
from test_fp8 import random_prompts, to_bf16, write_fp8_checkpoint
from test_vs_transformers import greedy_params, make_llm

if TYPE_CHECKING:
    from conftest import FixtureBank

LORAS = ["a", None, "b", "a", None]


def table_llm(
    bank: FixtureBank,
    path: Path,
    loras: dict[str, Path],
    keeps: bool,
    *,
    field: str = "keeps_fp8",
    **kwargs,
):
    """make_llm on the device's kernel table with `field` (keeps_fp8: the experts;
    keeps_fp8_projections: attention's projections) set to `keeps`: on the CPU the reference's
    (it dequantizes FP8 weights at every call), on --moelora-device=cuda the Triton table (its
    FP8 kernels against the weights dequantized at load)."""
    from moelora.engine import build

    made = build.make_rank_ops

    def tables(cfg, shard, device):
        return dataclasses.replace(made(cfg, shard, device), **{field: keeps})

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(build, "make_rank_ops", tables)
        return make_llm(bank, path, loras, **kwargs)


def source(bank: FixtureBank, arch: str, intermediate: int) -> Path:
    """The float32 fixture of `arch` with expert intermediate size `intermediate`."""
    if intermediate == 40:
        return bank.model(arch)
    key = "intermediate_size" if arch == "mixtral" else "moe_intermediate_size"
    return bank.model_variant(f"i{intermediate}", arch, **{key: intermediate})


def adapters(bank: FixtureBank, arch: str, intermediate: int) -> dict[str, Path]:
    """a: PEFT rank 8 (attention, experts via target_parameters); b: per-expert rank 4. Random
    lora_B both, made on the float32 model of the same shapes."""
    src = source(bank, arch, intermediate)
    name = f"{arch}-i{intermediate}"
    return {
        "a": bank.adapter(
            f"kept-peft-{name}",
            lambda p: hf.make_peft_adapter(
                src,
                p,
                targets=hf.peft_targets(arch),
                target_parameters=hf.EXPERT_PARAMS,
                seed=1,
                rank=8,
                alpha=16,
            ),
        ),
        "b": bank.adapter(
            f"kept-per-expert-{name}",
            lambda p: hf.make_per_expert_adapter(src, p, seed=2, rank=4, alpha=8, arch=arch),
        ),
    }


def checkpoint(bank: FixtureBank, arch: str, intermediate: int, layout: str, kind: str) -> Path:
    """kind "fp8": a block-FP8 folder as the releases store it; "bf16": for quantization='fp8'."""
    src = source(bank, arch, intermediate)
    name = f"{arch}-i{intermediate}-{layout}"
    bf16 = bank.adapter(f"kept-bf16-{name}", lambda p: to_bf16(src, p, layout=layout))
    if kind == "bf16":
        return bf16
    shards = 2 if layout == "per_expert" else 1  # a weight and its scales in different files
    return bank.adapter(
        f"kept-fp8-{name}",
        lambda p: write_fp8_checkpoint(src, p, layout=layout, shards=shards),
    )


CASES = [
    ("qwen3_moe", 128, "per_expert", "fp8"),
    ("mixtral", 128, "per_expert", "fp8"),
    ("qwen3_moe", 40, "fused", "fp8"),
    ("qwen3_moe", 136, "fused", "fp8"),
    ("qwen3_moe", 128, "per_expert", "bf16"),
    ("qwen3_moe", 40, "fused", "bf16"),
]


def assert_same_outputs(got, want, label: str, tol: float) -> None:
    for n, (a, b) in enumerate(zip(got, want, strict=True)):
        assert list(a.token_ids) == list(b.token_ids), f"{label}, request {n}"
        for step, token in enumerate(a.token_ids):
            assert abs(a.logprobs[step][token] - b.logprobs[step][token]) <= tol, (label, n)


@pytest.mark.parametrize("arch,intermediate,layout,kind", CASES)
def test_kept_experts_are_the_dequantized_engine(bank, arch, intermediate, layout, kind) -> None:
    from moelora.kernels.fp8_block import Fp8Weight
    from moelora.kernels.reference import dense_experts

    path = checkpoint(bank, arch, intermediate, layout, kind)
    loras = adapters(bank, arch, intermediate)
    options = {"quantization": "fp8"} if kind == "bf16" else {}
    kept = table_llm(bank, path, loras, True, **options)
    loaded = table_llm(bank, path, loras, False, **options)
    assert kept.engine.model_config.experts_fp8 and not loaded.engine.model_config.experts_fp8
    for i, (layer, twin) in enumerate(zip(kept.engine.model.layers, loaded.engine.model.layers)):
        for w, dense in ((layer.mlp.w13, twin.mlp.w13), (layer.mlp.w2, twin.mlp.w2)):
            assert isinstance(w, Fp8Weight) and isinstance(dense, torch.Tensor), i
            # every block's scale on its own rows: a swapped or shifted block changes these
            assert torch.equal(dense_experts(w, torch.float32), dense), (i, w.shape)
        assert torch.equal(layer.self_attn.qkv_proj.weight, twin.self_attn.qkv_proj.weight)
    label = f"{arch} I={intermediate} {layout} {kind}"
    prompts = random_prompts(seed=5)
    tokens = []
    for lora in (None, LORAS):
        got, want = (llm.generate(prompts, greedy_params(), lora=lora) for llm in (kept, loaded))
        # on the CPU the same weights (the threaded matmuls may still round a last bit
        # differently); on the GPU the FP8 loop scales each 128-deep partial, the dequantized
        # weights are scaled before the sum: float32 rounding apart, as the families' 1e-4
        tol = 1e-5 if bank.device == "cpu" else 1e-4
        assert_same_outputs(got, want, f"{label}, lora={lora}", tol)
        tokens.append([list(o.token_ids) for o in got])
    assert tokens[0] != tokens[1], label  # the adapters matter


def test_gate_and_up_apart_on_a_shared_block_are_dequantized(bank: FixtureBank) -> None:
    """A per-expert checkpoint with I = 40: gate's and up's own [1, 1] scales cannot share w13's
    one block, so the experts are dequantized at load even where the kernels keep FP8."""
    path = checkpoint(bank, "qwen3_moe", 40, "per_expert", "fp8")
    llm = table_llm(bank, path, {}, True)
    assert not llm.engine.model_config.experts_fp8
    assert isinstance(llm.engine.model.layers[0].mlp.w13, torch.Tensor)


def test_dummy_fp8_experts_are_made_kept(bank: FixtureBank) -> None:
    """load_format='dummy' makes the codes and scales themselves: weights within +-0.02."""
    from moelora.kernels.fp8_block import FP8_DTYPE, Fp8Weight

    path = checkpoint(bank, "qwen3_moe", 40, "per_expert", "fp8")
    llm = table_llm(bank, path, {}, True, load_format="dummy")
    w13 = llm.engine.model.layers[1].mlp.w13
    assert isinstance(w13, Fp8Weight) and w13.codes.dtype == FP8_DTYPE
    weights = w13.dequantize(torch.float32)
    assert 0.015 < weights.abs().max() <= 0.02 and weights.std() > 0.005
    out = llm.generate(random_prompts(seed=6, n=2), greedy_params())
    assert all(len(o.token_ids) > 0 for o in out)
