"""Block-FP8 weights on the CPU, fp32: checkpoints written as Qwen3-*-FP8 and DeepSeek-V3 store
them (e4m3 codes, a float32 `weight_scale_inv` per 128x128 block; experts per expert or fused)
against transformers+PEFT loading the same folder with FineGrainedFP8Config(dequantize=True):
greedy tokens equal and logprobs within 1e-4, for the base model, each adapter and a mixed batch.
Online FP8 (`quantization="fp8"`) of a bf16 checkpoint is its block-quantized twin to the bit,
and every variant moelora does not read is refused with the field and value named.

The fixtures quantize with their own blockwise loop (`quantize_blocks`), not moelora's function,
so the two recipes are checked against each other too.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

import hf_fixtures as hf
import pytest
import torch
from safetensors.torch import save_file
from test_vs_transformers import assert_matches, greedy_params, make_llm

if TYPE_CHECKING:
    from conftest import FixtureBank

FP8 = torch.float8_e4m3fn
FP8_CONFIG = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "activation_scheme": "dynamic",
    "weight_block_size": [128, 128],
    "modules_to_not_convert": ["lm_head", "model.layers.*.mlp.gate"],  # bf16 either way
}
# what the releases quantize: attention's projections and the experts, per expert (Mixtral's
# w1/w3/w2 too) or fused; routers, norms, embeddings and lm_head stay as they are
QUANTIZED = re.compile(
    r"\.(self_attn\.[qkvo]_proj\.weight|experts\.\d+\.(\w+_proj|w[123])\.weight"
    r"|experts\.(gate_up|down)_proj)$"
)
CASES = [("qwen3_moe", "per_expert"), ("qwen3_moe", "fused"), ("mixtral", "per_expert")]


# ---------------------------------------------------------------------------------------------
# Fixtures: block-FP8 folders as the releases store them


def quantize_blocks(w: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """One block at a time: scale = amax / 448 (1 for a block of zeros), codes = e4m3(w / scale)
    saturated at 448; blocks at a ragged edge cut short. w [..., N, K]."""
    x = w.float()
    n, k = x.shape[-2:]
    rows, cols = -(-n // block), -(-k // block)
    codes = torch.empty(x.shape, dtype=FP8)
    scales = torch.empty(*x.shape[:-2], rows, cols)
    for i in range(rows):
        for j in range(cols):
            r, c = slice(i * block, (i + 1) * block), slice(j * block, (j + 1) * block)
            part = x[..., r, c]
            amax = part.abs().amax(dim=(-2, -1))
            scale = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax))
            scales[..., i, j] = scale
            codes[..., r, c] = (part / scale[..., None, None]).clamp(-448.0, 448.0).to(FP8)
    return codes, scales


def scale_key(key: str) -> str:
    """X.weight -> X.weight_scale_inv; a fused X -> X_scale_inv."""
    if key.endswith(".weight"):
        return key.removesuffix(".weight") + ".weight_scale_inv"
    return key + "_scale_inv"


def write_folder(
    src: Path, dst: Path, tensors: dict[str, torch.Tensor], *, config: dict, shards: int = 1
) -> Path:
    """`src`'s config (with `config` merged in) and tokenizer, and `tensors`: in one file, or
    dealt round-robin over shards so a weight and its scale land in different files."""
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and not f.name.startswith("model"):
            shutil.copy(f, dst / f.name)
    merged = {**json.loads((src / "config.json").read_text()), **config}
    (dst / "config.json").write_text(json.dumps({k: v for k, v in merged.items() if v is not None}))
    keys = sorted(tensors)
    names = [f"model-{i + 1:05d}-of-{shards:05d}.safetensors" for i in range(shards)]
    if shards == 1:
        names = ["model.safetensors"]
    weight_map = {key: names[i % len(names)] for i, key in enumerate(keys)}
    for name in names:
        part = {k: tensors[k].contiguous() for k in keys if weight_map[k] == name}
        save_file(part, dst / name, metadata={"format": "pt"})
    if shards > 1:
        index = {"metadata": {}, "weight_map": weight_map}
        (dst / "model.safetensors.index.json").write_text(json.dumps(index))
    return dst


def write_fp8_checkpoint(src: Path, dst: Path, *, layout: str, shards: int = 1) -> Path:
    """`src` with its experts in `layout`, and attention's projections and the experts
    block-quantized, each with its `weight_scale_inv` (fused: `X_scale_inv`)."""
    plain = hf.write_checkpoint(src, dst.with_name(dst.name + "-plain"), layout=layout)
    tensors: dict[str, torch.Tensor] = {}
    for key, t in hf.read_checkpoint(plain).items():
        if QUANTIZED.search(key):
            tensors[key], tensors[scale_key(key)] = quantize_blocks(t)
        else:
            tensors[key] = t
    return write_folder(
        src, dst, tensors, config={"quantization_config": FP8_CONFIG}, shards=shards
    )


def write_transformers_dequantized(src: Path, dst: Path) -> Path:
    """A block-FP8 folder dequantized to float32 by transformers' own Fp8Dequantize, without its
    quantization_config: the reference for fused FP8 experts, which transformers' qwen3_moe
    does not dequantize when it loads them (it reads their codes as values)."""
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    dequantize = Fp8Dequantize(None)._dequantize_one
    tensors = hf.read_checkpoint(src)
    out = {k: t for k, t in tensors.items() if not k.endswith("_scale_inv")}
    for key, codes in tensors.items():
        if codes.dtype == FP8:
            out[key] = dequantize(codes, tensors[scale_key(key)], output_dtype=torch.float32)
    return write_folder(src, dst, out, config={"quantization_config": None})


def to_bf16(src: Path, dst: Path, *, layout: str) -> Path:
    plain = hf.write_checkpoint(src, dst.with_name(dst.name + "-f32"), layout=layout)
    tensors = {k: t.to(torch.bfloat16) for k, t in hf.read_checkpoint(plain).items()}
    return write_folder(src, dst, tensors, config={})


def fp8_model(bank: FixtureBank, arch: str, layout: str) -> Path:
    src = bank.model(arch)
    shards = 2 if layout == "per_expert" else 1  # weights and their scales in different files
    return bank.adapter(
        f"fp8-{arch}-{layout}",
        lambda p: write_fp8_checkpoint(src, p, layout=layout, shards=shards),
    )


def reference_model(bank: FixtureBank, arch: str, layout: str) -> Path:
    """What transformers loads as the FP8 model: the FP8 folder itself (FineGrainedFP8Config
    with dequantize=True), or for fused experts the folder transformers' Fp8Dequantize wrote."""
    fp8 = fp8_model(bank, arch, layout)
    if layout == "per_expert":
        return fp8
    return bank.adapter(
        f"fp8-{arch}-{layout}-dequantized", lambda p: write_transformers_dequantized(fp8, p)
    )


def random_prompts(seed: int, n: int = 5) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 15, (n,), generator=gen).tolist()
    return [torch.randint(0, 256, (length,), generator=gen).tolist() for length in lengths]


# ---------------------------------------------------------------------------------------------
# The format: dequantize and quantize against transformers and the fixtures' own loop


def random_codes(shape: tuple[int, ...], gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes of random values over much of e4m3's range; scales spread over about four decades."""
    from moelora.kernels.fp8_block import fp8_scale_shape

    codes = (torch.randn(shape, generator=gen) * 100).clamp(-448, 448).to(FP8)
    scales = torch.exp(torch.randn(fp8_scale_shape(shape), generator=gen) * 2.3) * 1e-3
    return codes, scales


@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(80, 64), (4, 80, 40), (256, 384), (2, 384, 128), (96, 256)])
def test_dequantize_is_transformers_to_the_bit(shape, dtype, scale_dtype) -> None:
    """Wherever transformers reads the releases' blocks: each dimension a multiple of 128, or
    within one block (test_ragged_blocks_follow_the_release_grid has the rest)."""
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    from moelora.kernels.fp8_block import dequantize_fp8_block

    gen = torch.Generator().manual_seed(sum(shape))
    codes, scales = random_codes(shape, gen)
    scales = scales.to(scale_dtype)
    got = dequantize_fp8_block(codes, scales, dtype)
    want = Fp8Dequantize(None)._dequantize_one(codes, scales, output_dtype=dtype)
    assert got.dtype == dtype and torch.equal(got, want)


@pytest.mark.parametrize("shape", [(200, 300), (3, 136, 40), (129, 257)])
def test_ragged_blocks_follow_the_release_grid(shape) -> None:
    """Blocks at a ragged edge are cut short: block (i, j) is rows 128i.. and columns 128j..,
    whatever is left of them; a quantize/dequantize round trip keeps e4m3's precision."""
    from moelora.kernels.fp8_block import dequantize_fp8_block, quantize_fp8_block

    gen = torch.Generator().manual_seed(sum(shape) + 1)
    codes, scales = random_codes(shape, gen)
    got = dequantize_fp8_block(codes, scales, torch.float32)
    for i in range(scales.shape[-2]):
        for j in range(scales.shape[-1]):
            r, c = slice(128 * i, 128 * (i + 1)), slice(128 * j, 128 * (j + 1))
            want = codes[..., r, c].float() * scales[..., i, j, None, None]
            assert torch.equal(got[..., r, c], want), (i, j)
    w = torch.randn(shape, generator=gen) * torch.rand(shape[-1], generator=gen)
    back = dequantize_fp8_block(*quantize_fp8_block(w), torch.float32)
    _, block_scales = quantize_blocks(w)
    scale = block_scales.repeat_interleave(128, -2)[..., : shape[-2], :]
    scale = scale.repeat_interleave(128, -1)[..., : shape[-1]]
    # half an ulp of e4m3 (3 mantissa bits), or of its smallest subnormal (2^-9), scaled
    assert ((back - w).abs() <= w.abs() / 16 + scale * 2.0**-10).all()
    assert not torch.equal(back, w)


@pytest.mark.parametrize("shape", [(80, 64), (3, 80, 64), (200, 300), (2, 256, 136)])
def test_quantize_is_the_release_recipe(shape) -> None:
    """moelora's quantize equals the fixtures' block-by-block loop to the bit, saturation and a
    block of zeros (scale 1) included."""
    from moelora.kernels.fp8_block import quantize_fp8_block

    gen = torch.Generator().manual_seed(sum(shape) + 2)
    w = torch.randn(shape, generator=gen) * torch.exp(torch.randn(shape[-1], generator=gen))
    w[..., :128, :128][..., :5, :7] = 0  # zeros inside a block change nothing
    if shape[-2] > 128:
        w[..., 128:, :128] = 0  # a whole block of zeros
    codes, scales = quantize_fp8_block(w)
    want_codes, want_scales = quantize_blocks(w)
    assert torch.equal(scales, want_scales)
    assert torch.equal(codes.view(torch.uint8), want_codes.view(torch.uint8))
    assert codes.float().abs().amax() == 448  # each block's largest value is +-448
    assert (shape[-2] > 128) == bool((scales == 1).any())


def test_fixture_is_what_the_releases_store(bank: FixtureBank) -> None:
    """Per expert: codes and a [1, 1] float32 scale beside every projection and expert weight,
    router, norms, embeddings and lm_head as they were; fused: [E, 1, 1] scales."""
    tensors = hf.read_checkpoint(fp8_model(bank, "qwen3_moe", "per_expert"))
    layer = "model.layers.1"
    for name in ("self_attn.q_proj", "self_attn.o_proj", "mlp.experts.3.gate_proj"):
        assert tensors[f"{layer}.{name}.weight"].dtype == FP8, name
        scale = tensors[f"{layer}.{name}.weight_scale_inv"]
        assert scale.dtype == torch.float32 and scale.shape == (1, 1) and scale.min() > 0
    for name in ("mlp.gate.weight", "input_layernorm.weight", "self_attn.q_norm.weight"):
        assert tensors[f"{layer}.{name}"].dtype == torch.float32, name
    assert tensors["lm_head.weight"].dtype == torch.float32
    fused = hf.read_checkpoint(fp8_model(bank, "qwen3_moe", "fused"))
    assert fused[f"{layer}.mlp.experts.gate_up_proj"].shape == (8, 80, 64)
    assert fused[f"{layer}.mlp.experts.gate_up_proj_scale_inv"].shape == (8, 1, 1)


# ---------------------------------------------------------------------------------------------
# The engine against transformers+PEFT


def adapters(bank: FixtureBank, arch: str) -> dict[str, Path]:
    """a: PEFT rank 8 (attention, experts via target_parameters); b: per-expert rank 4. Both
    made on the float32 model: the FP8 model has its shapes."""
    return {"a": bank.peft_adapter(arch), "b": bank.per_expert_adapter(arch)}


@pytest.fixture(scope="module")
def fp8_engines(bank: FixtureBank):
    llms: dict[tuple[str, str], object] = {}

    def get(arch: str, layout: str):
        if (arch, layout) not in llms:
            path = fp8_model(bank, arch, layout)
            llms[arch, layout] = make_llm(bank, path, adapters(bank, arch))
        return llms[arch, layout]

    return get


def dense(w) -> torch.Tensor:
    """An engine's experts as float32 on the CPU: where the GPU's kernels keep block-FP8
    experts as codes and scales (Fp8Weight), dequantized as the kernels read them."""
    from moelora.kernels.reference import dense_experts

    return dense_experts(w, torch.float32).cpu()


@pytest.mark.parametrize("arch,layout", CASES)
def test_engine_weights_are_transformers_dequantized(bank, fp8_engines, arch, layout) -> None:
    """The engine's experts and q/k/v are the weights transformers dequantized, to the bit."""
    model = fp8_engines(arch, layout).engine.model
    ref = hf.load_hf_model(reference_model(bank, arch, layout)).state_dict()
    plain = hf.load_hf_model(bank.model(arch)).state_dict()
    for i, layer in enumerate(model.layers):
        prefix = f"model.layers.{i}"
        experts = f"{prefix}.mlp.experts"
        assert torch.equal(dense(layer.mlp.w13), ref[f"{experts}.gate_up_proj"]), i
        assert torch.equal(dense(layer.mlp.w2), ref[f"{experts}.down_proj"]), i
        qkv = [ref[f"{prefix}.self_attn.{p}_proj.weight"] for p in "qkv"]
        assert torch.equal(layer.self_attn.qkv_proj.weight.cpu(), torch.cat(qkv)), i
        assert not torch.equal(ref[f"{experts}.down_proj"], plain[f"{experts}.down_proj"])


@pytest.mark.parametrize("arch,layout", CASES)
def test_base_model(bank: FixtureBank, fp8_engines, arch: str, layout: str) -> None:
    prompts = random_prompts(seed=1)
    refs = bank.reference(reference_model(bank, arch, layout), prompts, [None] * len(prompts))
    assert min(m for o in refs for m in o.margins) > 1e-3  # no near tie decides a token
    outs = fp8_engines(arch, layout).generate(prompts, greedy_params(), lora=None)
    assert_matches(bank, outs, refs, prompts, f"FP8 {arch} {layout} base")


@pytest.mark.parametrize("adapter", ["a", "b"])
@pytest.mark.parametrize("arch,layout", CASES)
def test_one_adapter(bank: FixtureBank, fp8_engines, arch: str, layout: str, adapter: str) -> None:
    prompts = random_prompts(seed=2)
    path = adapters(bank, arch)[adapter]
    refs = bank.reference(reference_model(bank, arch, layout), prompts, [path] * len(prompts))
    base = bank.reference(reference_model(bank, arch, layout), prompts, [None] * len(prompts))
    assert [o.tokens for o in refs] != [o.tokens for o in base]  # the adapter matters
    outs = fp8_engines(arch, layout).generate(prompts, greedy_params(), lora=adapter)
    assert_matches(bank, outs, refs, prompts, f"FP8 {arch} {layout} adapter {adapter}")


@pytest.mark.parametrize("arch,layout", CASES)
def test_mixed_batch(bank: FixtureBank, fp8_engines, arch: str, layout: str) -> None:
    prompts = random_prompts(seed=3)
    loras = ["a", None, "b", "a", None]
    paths = {**adapters(bank, arch), None: None}
    refs = bank.reference(reference_model(bank, arch, layout), prompts, [paths[n] for n in loras])
    outs = fp8_engines(arch, layout).generate(prompts, greedy_params(), lora=loras)
    assert_matches(bank, outs, refs, prompts, f"FP8 {arch} {layout} mixed batch {loras}")


def test_ragged_blocks_load_on_the_release_grid(bank: FixtureBank) -> None:
    """Expert intermediate 136: gate_up's 272 rows and down's 136 columns end in a cut-short
    block (transformers splits such grids evenly, so the check is the fixtures' own loop)."""
    src = bank.model_variant("i136", "qwen3_moe", moe_intermediate_size=136)
    path = bank.adapter("fp8-i136", lambda p: write_fp8_checkpoint(src, p, layout="fused"))
    tensors = hf.read_checkpoint(path)
    llm = make_llm(bank, path)
    for i, layer in enumerate(llm.engine.model.layers):
        for name, param in (("gate_up_proj", layer.mlp.w13), ("down_proj", layer.mlp.w2)):
            key = f"model.layers.{i}.mlp.experts.{name}"
            codes, scales = tensors[key], tensors[key + "_scale_inv"]
            assert scales.shape[1:] == ((3, 1) if name == "gate_up_proj" else (1, 2))
            per_element = scales.repeat_interleave(128, 1).repeat_interleave(128, 2)
            want = codes.float() * per_element[:, : codes.shape[1], : codes.shape[2]]
            assert torch.equal(dense(param), want), key


# ---------------------------------------------------------------------------------------------
# Online FP8: a bf16 checkpoint quantized at load is its block-quantized twin


@pytest.mark.parametrize("layout", ["per_expert", "fused"])
def test_online_fp8_equals_the_block_quantized_twin(bank: FixtureBank, layout: str) -> None:
    """quantization='fp8' on a bf16 folder gives every parameter of the same folder quantized
    offline (the fixtures' loop) and loaded as block-FP8, to the bit, and the same outputs."""
    src = bank.model("qwen3_moe")
    bf16 = bank.adapter(f"bf16-qwen3-{layout}", lambda p: to_bf16(src, p, layout=layout))
    twin = bank.adapter(
        f"bf16-qwen3-{layout}-fp8", lambda p: write_fp8_checkpoint(bf16, p, layout=layout)
    )
    loras = adapters(bank, "qwen3_moe")
    online = make_llm(bank, bf16, loras, quantization="fp8")
    offline = make_llm(bank, twin, loras)
    assert online.engine.model_config.weights_fp8 == "online"
    assert offline.engine.model_config.weights_fp8 == "checkpoint"
    got, want = online.engine.model.state_dict(), offline.engine.model.state_dict()
    assert got.keys() == want.keys()
    for key in want:
        assert torch.equal(got[key], want[key]), key
    plain = hf.read_checkpoint(bf16)["model.layers.0.self_attn.q_proj.weight"].float()
    q_rows = online.engine.model.layers[0].self_attn.qkv_proj.weight[: plain.shape[0]].cpu()
    assert not torch.equal(q_rows, plain) and torch.allclose(q_rows, plain, rtol=0.07, atol=1e-4)
    prompts, names = random_prompts(seed=4), ["a", None, "b", "a", None]
    outs = [llm.generate(prompts, greedy_params(), lora=names) for llm in (online, offline)]
    for a, b in zip(*outs):
        assert list(a.token_ids) == list(b.token_ids)
        # the same weights; the CPU's threaded matmuls may still round a last bit differently
        for step, token in enumerate(a.token_ids):
            assert abs(a.logprobs[step][token] - b.logprobs[step][token]) <= 1e-5


# ---------------------------------------------------------------------------------------------
# Refusals, each naming the field or tensor and what was expected


def edited_fp8_folder(bank: FixtureBank, tmp_path: Path, *, config: dict | None = None, edit=None):
    """A copy of the per-expert FP8 qwen3_moe folder with quantization_config fields replaced
    and its tensors edited (edit: dict -> None, in place)."""
    src = fp8_model(bank, "qwen3_moe", "per_expert")
    tensors = hf.read_checkpoint(src)
    if edit is not None:
        edit(tensors)
    quant = {**FP8_CONFIG, **(config or {})}
    return write_folder(src, tmp_path / "m", tensors, config={"quantization_config": quant})


def load_model(path: Path):
    """read_model_config and load_weights, as an engine does, on the CPU."""
    from moelora.kernels.ops import REFERENCE_OPS
    from moelora.models.loader import load_weights
    from moelora.models.model import MoeCausalLM
    from moelora.models.registry import read_model_config

    mc, hf_config = read_model_config(str(path))
    cpu = torch.device("cpu")
    model = MoeCausalLM(mc, hf_config, 64, REFERENCE_OPS, dtype=torch.float32, device=cpu)
    with torch.no_grad():
        load_weights(model, str(path))
    return model


@pytest.mark.parametrize(
    "config,message",
    [
        ({"fmt": "e5m2"}, "quantization_config.fmt='e5m2' is not supported: expected 'e4m3'"),
        (
            {"activation_scheme": "static"},
            "quantization_config.activation_scheme='static' is not supported: expected 'dynamic'",
        ),
        (
            {"weight_block_size": [64, 64]},
            r"quantization_config.weight_block_size=\[64, 64\] is not supported: expected "
            r"\[128, 128\]",
        ),
        (
            {"scale_fmt": "ue8m0"},
            "quantization_config.scale_fmt='ue8m0' is not supported: expected 'float'",
        ),
        (
            {"quant_method": "gptq"},
            r"quantization_config.quant_method='gptq' is not supported for qwen3_moe: expected "
            r"none or one of \['fp8'\]",
        ),
    ],
)
def test_other_fp8_variants_are_refused(bank: FixtureBank, tmp_path, config, message) -> None:
    from moelora.errors import ModelConfigError

    with pytest.raises(ModelConfigError, match=message):
        load_model(edited_fp8_folder(bank, tmp_path, config=config))


Q = "model.layers.1.self_attn.q_proj.weight"
GATE = "model.layers.2.mlp.experts.5.gate_proj.weight"


def _drop_scale(t):
    del t[scale_key(GATE)]


def _unquantize(t):
    t[Q] = torch.randn(t[Q].shape)


def _e5m2(t):
    t[Q] = torch.randn(t[Q].shape).to(torch.float8_e5m2)


def _scale_shape(t):
    t[scale_key(Q)] = torch.rand(2, 1) + 0.1


def _ue8m0_scales(t):
    t[scale_key(GATE)] = torch.randint(100, 130, (1, 1), dtype=torch.uint8)


@pytest.mark.parametrize(
    "edit,message",
    [
        (_drop_scale, rf"'{GATE}' is float8_e4m3fn but has no '{scale_key(GATE)}'"),
        (_unquantize, rf"has '{scale_key(Q)}' but no float8_e4m3fn '{Q}'"),
        (_e5m2, rf"'{Q}' is float8_e5m2: expected float8_e4m3fn"),
        (_scale_shape, rf"'{scale_key(Q)}' has shape \(2, 1\), expected \(1, 1\)"),
        (_ue8m0_scales, rf"'{scale_key(GATE)}' is uint8: expected float32 scales"),
    ],
)
def test_malformed_fp8_tensors_are_refused(bank: FixtureBank, tmp_path, edit, message) -> None:
    from moelora.errors import ModelConfigError

    with pytest.raises(ModelConfigError, match=message):
        load_model(edited_fp8_folder(bank, tmp_path, edit=edit))


def test_fp8_tensors_without_the_config_are_refused(bank: FixtureBank, tmp_path) -> None:
    from moelora.errors import ModelConfigError

    src = fp8_model(bank, "qwen3_moe", "per_expert")
    path = write_folder(
        src, tmp_path / "m", hf.read_checkpoint(src), config={"quantization_config": None}
    )
    with pytest.raises(
        ModelConfigError, match=r"is float8_e4m3fn, but config.json has no block-FP8"
    ):
        load_model(path)


def test_other_quantization_flags_are_refused(bank: FixtureBank) -> None:
    from moelora import LLM
    from moelora.cli import _parser
    from moelora.errors import ConfigError

    with pytest.raises(
        ConfigError, match=r"quantization='int8' is invalid: expected None or 'fp8'"
    ):
        LLM(str(bank.model("qwen3_moe")), quantization="int8")
    args = ["generate", "m", "--prompt", "x"]
    assert _parser().parse_args(args).quantization is None
    assert _parser().parse_args([*args, "--quantization", "fp8"]).quantization == "fp8"
    with pytest.raises(SystemExit):
        _parser().parse_args([*args, "--quantization", "int8"])


def test_online_fp8_of_an_mxfp4_checkpoint_is_refused(bank: FixtureBank) -> None:
    from moelora import LLM
    from moelora.errors import ModelConfigError

    base = bank.model_variant("i64", "gpt_oss", intermediate_size=64)
    packed = bank.adapter("gpt-oss-mxfp4", lambda p: hf.write_mxfp4_checkpoint(base, p, seed=31))
    with pytest.raises(ModelConfigError, match=r"quantization='fp8' is not supported .* 'mxfp4'"):
        LLM(str(packed), quantization="fp8", device="cpu", dtype="float32")
