"""GPT-OSS against transformers(+PEFT), fp32 on the CPU: greedy tokens equal, logprobs within
1e-4, for the base model, each adapter alone and a mixed batch, on a tiny model whose sliding
window (5) is shorter than most prompts, with random sinks and biases (hf_fixtures)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import hf_fixtures as hf
import pytest
import torch
from test_vs_transformers import assert_matches, make_llm, run

if TYPE_CHECKING:
    from conftest import FixtureBank

ARCH = "gpt_oss"


def model(bank: FixtureBank):
    return bank.model_variant("base", ARCH)


def adapters(bank: FixtureBank) -> dict[str, object]:
    """a: rank 8 on q/k/v/o and both expert tensors; b: rank 4 on k/o and gate_up only."""
    path = model(bank)
    a = bank.adapter(
        "gpt-oss-a",
        lambda p: hf.make_peft_adapter(
            path,
            p,
            targets=["q_proj", "k_proj", "v_proj", "o_proj"],
            target_parameters=hf.EXPERT_PARAMS,
            seed=21,
            rank=8,
            alpha=16,
        ),
    )
    b = bank.adapter(
        "gpt-oss-b",
        lambda p: hf.make_peft_adapter(
            path,
            p,
            targets=["k_proj", "o_proj"],
            target_parameters=["mlp.experts.gate_up_proj"],
            seed=22,
            rank=4,
            alpha=12,
        ),
    )
    return {"a": a, "b": b}


@pytest.fixture(scope="module")
def llm(bank: FixtureBank):
    return make_llm(bank, model(bank), adapters(bank))


def test_fixture_is_what_the_release_is(bank: FixtureBank) -> None:
    """The tensors GPT-OSS differs by are there, random and non-zero; the layers alternate."""
    tensors = hf.read_checkpoint(model(bank))
    layer = "model.layers.0"
    assert tensors[f"{layer}.mlp.experts.gate_up_proj"].shape == (6, 64, 80)  # [E, H, 2I]
    assert tensors[f"{layer}.mlp.experts.down_proj"].shape == (6, 40, 64)  # [E, I, H]
    for name in [
        "self_attn.sinks",
        "self_attn.o_proj.bias",
        "self_attn.q_proj.bias",
        "mlp.router.bias",
        "mlp.experts.gate_up_proj_bias",
        "mlp.experts.down_proj_bias",
    ]:
        assert tensors[f"{layer}.{name}"].abs().min() > 0, name
    ref = hf.load_hf_model(model(bank))
    assert ref.config.layer_types == ["sliding_attention", "full_attention", "sliding_attention"]
    window = ref.config.sliding_window  # shorter than 3 of the prompts, and than every output
    assert sum(window < len(p) for p in hf.PROMPTS) >= 3
    assert all(window < len(p) + hf.MAX_TOKENS for p in hf.PROMPTS)


def test_references_are_not_degenerate(bank: FixtureBank) -> None:
    """The window, the sinks and the adapters each change greedy tokens; no near ties."""
    prompts = hf.PROMPTS
    base = bank.reference(model(bank), prompts, [None] * len(prompts))
    tokens = [o.tokens for o in base]
    assert len({t for o in base for t in o.tokens}) > 10
    assert min(m for o in base for m in o.margins) > 1e-3
    for name, variant in [
        ("no-window", bank.model_variant("wide", ARCH, sliding_window=512)),
        ("no-sinks", _zero_sinks(bank)),
    ]:
        other = bank.reference(variant, prompts, [None] * len(prompts))
        assert [o.tokens for o in other] != tokens, name
    for name, path in adapters(bank).items():
        outs = bank.reference(model(bank), prompts, [path] * len(prompts))
        assert [o.tokens for o in outs] != tokens, name
        assert min(m for o in outs for m in o.margins) > 1e-3, name


def _zero_sinks(bank: FixtureBank):
    def build(dst):
        src = model(bank)
        hf.write_checkpoint(src, dst, layout="fused")  # a copy: GPT-OSS's experts are fused
        tensors = hf.read_checkpoint(dst)
        for key in [k for k in tensors if k.endswith("sinks")]:
            tensors[key] = torch.full_like(tensors[key], -1e4)  # exp(-1e4) = 0: no sink at all
        from safetensors.torch import save_file

        save_file(tensors, dst / "model.safetensors")
        return dst

    return bank.adapter("gpt-oss-no-sinks", build)


def test_base_model(bank: FixtureBank, llm) -> None:
    refs = bank.reference(model(bank), hf.PROMPTS, [None] * len(hf.PROMPTS))
    assert_matches(bank, run(llm, hf.PROMPTS, None), refs, hf.PROMPTS, "gpt_oss base")


@pytest.mark.parametrize("adapter", ["a", "b"])
def test_one_adapter(bank: FixtureBank, llm, adapter: str) -> None:
    path = adapters(bank)[adapter]
    refs = bank.reference(model(bank), hf.PROMPTS, [path] * len(hf.PROMPTS))
    outs = run(llm, hf.PROMPTS, adapter)
    assert_matches(bank, outs, refs, hf.PROMPTS, f"gpt_oss adapter {adapter}")


def test_mixed_batch(bank: FixtureBank, llm) -> None:
    loras = ["a", None, "b", "a", None]
    paths = {**adapters(bank), None: None}
    refs = bank.reference(model(bank), hf.PROMPTS, [paths[n] for n in loras])
    outs = run(llm, hf.PROMPTS, loras)
    assert_matches(bank, outs, refs, hf.PROMPTS, f"gpt_oss mixed batch {loras}")


def mxfp4_models(bank: FixtureBank):
    """(the MXFP4 folder, the same dequantized by transformers): intermediate 64, so both
    expert tensors' inputs are whole groups of 32."""
    base = bank.model_variant("i64", ARCH, intermediate_size=64)
    packed = bank.adapter("gpt-oss-mxfp4", lambda p: hf.write_mxfp4_checkpoint(base, p, seed=31))
    plain = bank.adapter("gpt-oss-mxfp4-f32", lambda p: hf.write_dequantized_checkpoint(packed, p))
    return packed, plain


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_mxfp4_dequantizes_as_transformers_does(bank: FixtureBank, dtype) -> None:
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from moelora.kernels.reference import dequantize_mxfp4

    packed, _ = mxfp4_models(bank)
    tensors = hf.read_checkpoint(packed)
    for key in [k for k in tensors if k.endswith("_blocks")]:
        blocks, scales = tensors[key], tensors[key.replace("_blocks", "_scales")]
        want = convert_moe_packed_tensors(blocks, scales, dtype=dtype)  # [E, in, out]
        got = dequantize_mxfp4(blocks, scales, dtype).transpose(1, 2)
        assert got.dtype == want.dtype and torch.equal(got, want), key


def test_mxfp4_checkpoint_loads_to_the_bit_and_equals_transformers(bank: FixtureBank) -> None:
    """The engine's experts from the MXFP4 folder are transformers' dequantized ones, converted
    (de-interleaved, transposed) to the bit (on CUDA they stay packed: dequantized here); greedy
    outputs equal transformers' on them (on CUDA, from the packed fused MoE)."""
    from moelora.kernels.moe.mxfp4_layout import Mxfp4Weight
    from moelora.kernels.reference import dense_experts

    packed, plain = mxfp4_models(bank)
    llm = make_llm(bank, packed)
    want = hf.read_checkpoint(plain)
    mlp = llm.engine.model.layers[1].mlp
    assert isinstance(mlp.w13, Mxfp4Weight) == (bank.device != "cpu")
    gate_up = want["model.layers.1.mlp.experts.gate_up_proj"]  # [E, H, 2I], gate | up alternate
    w13 = torch.cat([gate_up[:, :, 0::2], gate_up[:, :, 1::2]], dim=2).transpose(1, 2)
    assert torch.equal(dense_experts(mlp.w13, torch.float32).cpu(), w13)
    down = want["model.layers.1.mlp.experts.down_proj"].transpose(1, 2)
    assert torch.equal(dense_experts(mlp.w2, torch.float32).cpu(), down)
    prompts = hf.PROMPTS[:3]
    refs = bank.reference(plain, prompts, [None] * 3)
    assert_matches(bank, run(llm, prompts, None), refs, prompts, "gpt_oss MXFP4")


def test_mxfp4_experts_load_packed_and_dummy_ones_are_made_packed(bank: FixtureBank) -> None:
    """Where the kernels take them packed (CUDA), the experts stay MXFP4: built here with the
    reference table on the CPU, whose fused_moe dequantizes them too. The codes and scales are
    the release's, gate_up's rows de-interleaved; dequantized, they are the engine's experts to
    the bit (the CPU engine's dequantized at load: it resolves the flag off). Dummy weights are
    made packed, no bf16 expert anywhere."""
    from moelora.kernels.moe.mxfp4_layout import Mxfp4Weight
    from moelora.kernels.ops import REFERENCE_OPS
    from moelora.kernels.reference import dense_experts
    from moelora.models.loader import fill_dummy, load_weights, settle
    from moelora.models.model import MoeCausalLM
    from moelora.models.registry import read_model_config

    packed, _ = mxfp4_models(bank)
    mc, hf_config = read_model_config(str(packed))
    assert mc.experts_mxfp4
    cpu, f32 = torch.device("cpu"), torch.float32
    model = MoeCausalLM(mc, hf_config, 64, REFERENCE_OPS, dtype=torch.float32, device=cpu)
    with torch.no_grad():
        load_weights(model, str(packed))
    llm = make_llm(bank, packed)
    assert llm.engine.model_config.experts_mxfp4 == (bank.device != "cpu")
    release = hf.read_checkpoint(packed)["model.layers.1.mlp.experts.gate_up_proj_blocks"]
    w13 = model.layers[1].mlp.w13
    assert torch.equal(w13.blocks[:, 1], release[:, 2].flatten(1))  # gate row 1 <- row 2
    assert torch.equal(w13.blocks[:, w13.shape[1] // 2], release[:, 1].flatten(1))  # up row 0
    for layer, dense in zip(model.layers, llm.engine.model.layers):
        mlp = layer.mlp
        assert isinstance(mlp.w13, Mxfp4Weight) and isinstance(mlp.w2, Mxfp4Weight)
        for w, engine_w in ((mlp.w13, dense.mlp.w13), (mlp.w2, dense.mlp.w2)):
            assert torch.equal(dense_experts(w, f32), dense_experts(engine_w, f32).cpu())
    with torch.no_grad():
        fill_dummy(model, seed=0)
    experts = {n: p for n, p in model.named_parameters() if ".mlp.w" in n and "bias" not in n}
    assert experts and all(p.dtype == torch.uint8 for p in experts.values()), list(experts)
    scales = torch.cat([p.flatten() for n, p in experts.items() if n.endswith("_scales")])
    assert scales.min() == 119 and scales.max() == 121
    # what the loaded bytes allow: bit placement up to scale byte 128, table lookups past it
    settle(model)
    mlp = model.layers[0].mlp
    assert mlp.w13.small_scales and mlp.w2.small_scales
    with torch.no_grad():
        mlp.w2.scales[0, 0, 0] = 129
    settle(model)
    assert mlp.w13.small_scales and not mlp.w2.small_scales


@pytest.mark.parametrize(
    "change,message",
    [
        (
            dict(layer_types=["sliding_attention", "chunked_attention", "full_attention"]),
            "layer_types",
        ),
        (dict(quantization_config={"quant_method": "fp8"}), "quant_method='fp8'"),
        (dict(attention_bias=False), "attention_bias=False"),
    ],
)
def test_unsupported_variants_are_refused(bank: FixtureBank, tmp_path, change, message) -> None:
    import json

    from moelora.errors import ModelConfigError
    from moelora.models.registry import read_model_config

    config = json.loads((model(bank) / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(ModelConfigError, match=message):
        read_model_config(str(tmp_path))
