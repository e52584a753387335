"""Quantized weights: what a checkpoint's quantization_config says, checked once where the config
is read, and what the loader does with block-FP8 tensors on their way into the model.

moelora reads MXFP4 experts (GPT-OSS: gpt_oss.py, loader.py) and block-FP8 weights (Qwen3-*-FP8,
DeepSeek-V3: e4m3 codes and a float32 `weight_scale_inv` per 128x128 block, kernels/fp8_block.py),
stored per expert (`experts.N.gate_proj.weight` + `.weight_scale_inv`) or fused
(`experts.gate_up_proj` + `experts.gate_up_proj_scale_inv`). Which tensors are FP8 their dtypes
say: a float8_e4m3fn weight has its scales beside it; the rest (norms, routers, embeddings,
lm_head, whatever a release lists in modules_to_not_convert) is read as it is. `--quantization
fp8` block-quantizes a bf16 or float32 checkpoint's experts and projections at load by the same
recipe, so the model is its block-quantized twin.

The experts stay block-FP8 where the engine's kernels take them so (ModelConfig.experts_fp8,
engine/build.py: one rank, w13's halves on the grid the fused MoE reads): their codes and scales
pass through here, a checkpoint's as stored and online ones quantized, into the model's
Fp8Weight (layers/moe.py); so do attention's q/k/v/o where the model keeps them FP8
(ModelConfig.projections_fp8: LoraLinear's weight and weight_scale_inv). Every other FP8
weight, and those elsewhere, are dequantized at
load to the model's dtype: on the CPU (the reference path, bit for bit as transformers reads
them) and, as the correct fallback, on CUDA (which then holds them in bf16).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator, Mapping
from dataclasses import replace

import torch

from moelora.config import ModelConfig
from moelora.errors import ModelConfigError
from moelora.kernels.fp8_block import (
    FP8_BLOCK,
    FP8_DTYPE,
    dequantize_fp8_block,
    fp8_scale_shape,
    quantize_fp8_block,
)

log = logging.getLogger(__name__)

SCALE_SUFFIX = "_scale_inv"  # X.weight -> X.weight_scale_inv; fused X -> X_scale_inv
# the block-FP8 variant the releases store, field by field; a field left out means the same
# (transformers' defaults), any other value is refused
_FP8_FIELDS: tuple[tuple[str, object, str], ...] = (
    ("fmt", "e4m3", "e4m3 codes (float8_e4m3fn)"),
    ("activation_scheme", "dynamic", "activations quantized at run time, no stored scales"),
    ("weight_block_size", list(FP8_BLOCK), "one scale per 128x128 block"),
    ("scale_fmt", "float", "float32 scales"),
)
# the checkpoint tensors --quantization fp8 quantizes, as the FP8 releases do: attention's
# projections, the experts' (per expert, Mixtral's w1/w3/w2, or fused) and the dense and shared
# experts' MLPs; never a router, the shared expert's gate, a norm, the embedding or lm_head
_ONLINE = re.compile(
    r"\.(self_attn\.([qkvo]_proj|q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj)\.weight"
    r"|experts\.\d+\.(gate_proj|up_proj|down_proj|w1|w2|w3)\.weight"
    r"|experts\.(gate_up_proj|down_proj)"
    r"|mlp\.(shared_expert\.)?(gate_proj|up_proj|down_proj)\.weight)$"
)
# the routed experts' weights (per expert, Mixtral's w1/w3/w2, or fused): what a model with
# ModelConfig.experts_fp8 takes as codes and scales
_EXPERTS = re.compile(
    r"\.experts\.(\d+\.(gate_proj|up_proj|down_proj|w1|w2|w3)\.weight|gate_up_proj|down_proj)$"
)
# attention's projections (GQA's, MLA's but kv_b_proj): what a model with
# ModelConfig.projections_fp8 takes as codes and scales
_PROJECTIONS = re.compile(
    r"\.self_attn\.([qkvo]_proj|q_a_proj|q_b_proj|kv_a_proj_with_mqa)\.weight$"
)


def quant_method(hf, arch: str, supported: tuple[str, ...]) -> str | None:
    """quantization_config.quant_method of the HF config (None: it has none), refused unless
    `supported` lists it; a block-FP8 config's other fields are checked too."""
    quant = getattr(hf, "quantization_config", None) or {}
    if not isinstance(quant, Mapping):
        quant = quant.to_dict()
    if not quant:
        return None
    method = quant.get("quant_method")
    if method not in supported:
        raise ModelConfigError(
            f"quantization_config.quant_method={method!r} is not supported for {arch}: "
            f"expected none or one of {list(supported)}"
        )
    if method == "fp8":
        check_fp8_fields(quant)
    return method


def check_fp8_fields(quant: Mapping) -> None:
    """ModelConfigError naming the first field of a block-FP8 quantization_config that is not
    the releases' variant."""
    for name, expected, meaning in _FP8_FIELDS:
        value = quant.get(name, expected)
        if isinstance(value, tuple):
            value = list(value)
        if value != expected:
            raise ModelConfigError(
                f"quantization_config.{name}={value!r} is not supported: expected {expected!r} "
                f"({meaning})"
            )


def with_quantization(
    mc: ModelConfig, quantization: str | None, device: torch.device
) -> ModelConfig:
    """mc with EngineConfig.quantization applied: 'fp8' block-quantizes a bf16 or float32
    checkpoint at load ("online"); a block-FP8 checkpoint is already what it asks for."""
    if quantization is not None:
        assert quantization == "fp8", quantization  # EngineConfig checked it
        if mc.experts_mxfp4:
            raise ModelConfigError(
                "quantization='fp8' is not supported for this checkpoint, whose "
                "quantization_config.quant_method is 'mxfp4': expected no quantization, or a "
                "bf16 or float32 checkpoint"
            )
        if mc.weights_fp8 == "none":
            mc = replace(mc, weights_fp8="online")
    if mc.weights_fp8 != "none" and device.type == "cuda":
        # the rest have no FP8 kernel: dequantizing at load is the correct fallback
        log.warning(
            "block-FP8 weights (%s): the dense and shared experts' MLPs and MLA's kv_b_proj "
            "are dequantized to the model's dtype at load (bf16 memory on the GPU); the routed "
            "experts and attention's other projections stay FP8 where the kernels keep them "
            "(one rank), dequantized too otherwise",
            mc.weights_fp8,
        )
    return mc


def fp8_weights(
    tensors: Iterator[tuple[str, torch.Tensor]],
    mode: str,
    dtype: torch.dtype,
    where: str,
    *,
    keep_experts: bool = False,
    keep_projections: bool = False,
) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors as the model takes them, by ModelConfig.weights_fp8 (`mode`):
    block-FP8 pairs dequantized to dtype ("checkpoint"), the experts and projections quantized
    and dequantized again ("online"); a float8 tensor is refused unless the config says fp8.
    keep_experts (ModelConfig.experts_fp8): the routed experts come out as (X, codes) and
    (X_scale_inv, float32 scales) instead, checked or quantized by the same rules;
    keep_projections (ModelConfig.projections_fp8): attention's q/k/v/o as well."""
    kept = _kept(keep_experts=keep_experts, keep_projections=keep_projections)
    if mode == "checkpoint":
        return _dequantized(tensors, dtype, where, kept=kept)
    checked = _without_fp8(tensors, where)
    if mode == "online":
        return _round_tripped(checked, dtype, kept=kept)
    return checked


def _kept(*, keep_experts: bool, keep_projections: bool):
    """Whether a checkpoint key names a weight the model keeps as codes and scales."""
    patterns = [p for p, on in ((_EXPERTS, keep_experts), (_PROJECTIONS, keep_projections)) if on]
    return lambda key: any(p.search(key) for p in patterns)


def _is_float8(t: torch.Tensor) -> bool:
    return t.is_floating_point() and t.dtype.itemsize == 1


def _dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def _dequantized(
    tensors: Iterator[tuple[str, torch.Tensor]],
    dtype: torch.dtype,
    where: str,
    *,
    kept,
) -> Iterator[tuple[str, torch.Tensor]]:
    """(X, codes) and (X_scale_inv, scales), in either order and any shards -> (X, X
    dequantized to dtype), or, for kept weights (`kept(X)`), both checked; every other tensor
    as it is."""
    waiting: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in tensors:
        if key.endswith(SCALE_SUFFIX):
            base, kind = key.removesuffix(SCALE_SUFFIX), "scales"
        elif _is_float8(t):
            base, kind = key, "codes"
        else:
            yield key, t
            continue
        pair = waiting.setdefault(base, {})
        pair[kind] = t
        if len(pair) == 2:
            del waiting[base]
            codes, scales = _checked_pair(base, pair["codes"], pair["scales"], where)
            if kept(base):
                yield base, codes
                yield base + SCALE_SUFFIX, scales.to(torch.float32)
            else:
                yield base, dequantize_fp8_block(codes, scales, dtype)
    for base, pair in waiting.items():
        if "codes" in pair:
            raise ModelConfigError(
                f"{where}: checkpoint weight {base!r} is {_dtype_name(pair['codes'])} but has "
                f"no {base + SCALE_SUFFIX!r}: expected one scale per 128x128 block"
            )
        raise ModelConfigError(
            f"{where}: checkpoint has {base + SCALE_SUFFIX!r} but no float8_e4m3fn {base!r}"
        )


def _checked_pair(
    base: str, codes: torch.Tensor, scales: torch.Tensor, where: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, scales) as they came, once they are e4m3 codes with a float scale per block."""
    if codes.dtype != FP8_DTYPE:
        raise ModelConfigError(
            f"{where}: checkpoint weight {base!r} is {_dtype_name(codes)}: expected "
            "float8_e4m3fn (quantization_config.fmt='e4m3')"
        )
    scale_key = base + SCALE_SUFFIX
    if not scales.is_floating_point() or scales.dtype.itemsize < 2:
        raise ModelConfigError(
            f"{where}: checkpoint weight {scale_key!r} is {_dtype_name(scales)}: expected "
            "float32 scales"
        )
    if codes.dim() < 2:
        raise ModelConfigError(
            f"{where}: checkpoint weight {base!r} is float8 of shape {tuple(codes.shape)}: "
            "expected a weight [out, in] or experts [E, out, in]"
        )
    expected = fp8_scale_shape(codes.shape)
    if tuple(scales.shape) != expected:
        raise ModelConfigError(
            f"{where}: checkpoint weight {scale_key!r} has shape {tuple(scales.shape)}, "
            f"expected {expected}: one scale per 128x128 block of {base!r} "
            f"{tuple(codes.shape)}"
        )
    return codes, scales


def _without_fp8(
    tensors: Iterator[tuple[str, torch.Tensor]], where: str
) -> Iterator[tuple[str, torch.Tensor]]:
    for key, t in tensors:
        if _is_float8(t):
            raise ModelConfigError(
                f"{where}: checkpoint weight {key!r} is {_dtype_name(t)}, but config.json has "
                "no block-FP8 quantization_config: expected quant_method 'fp8' with a "
                "weight_scale_inv per 128x128 block"
            )
        yield key, t


def _round_tripped(
    tensors: Iterator[tuple[str, torch.Tensor]], dtype: torch.dtype, *, kept
) -> Iterator[tuple[str, torch.Tensor]]:
    """The experts and projections block-quantized as stored (a per-expert checkpoint's gate and
    up each on their own, a fused one's gate_up whole, as a release quantizes that layout) and
    dequantized to dtype, or, for kept weights (`kept(X)`), (X, codes) and (X_scale_inv,
    scales) as a block-FP8 checkpoint stores them; every other tensor as it is."""
    for key, t in tensors:
        if not (_ONLINE.search(key) and t.is_floating_point()):
            yield key, t
        elif kept(key):
            codes, scales = quantize_fp8_block(t)
            yield key, codes
            yield key + SCALE_SUFFIX, scales
        else:
            yield key, dequantize_fp8_block(*quantize_fp8_block(t), dtype)
