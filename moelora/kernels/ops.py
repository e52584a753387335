"""The kernel table a model is built with: Triton on CUDA, the torch references elsewhere.

Chosen once at startup from the config (no globals): layers call `self.ops.fused_moe(...)`.
Each field's call is a Protocol of kernels/contracts.py, which both tables satisfy.
The Triton modules are imported only when a CUDA table is made: triton is optional on the CPU.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch

from moelora.config import PREFILL_ATTENTION_BACKENDS, PROJECTIONS
from moelora.kernels import gated_delta, mla, reference
from moelora.kernels.contracts import (
    AddLoraOp,
    AddSharedExpertOp,
    CausalConv1dOp,
    FusedMoeOp,
    GatedDeltaRuleOp,
    LinearFp8Op,
    LinearOp,
    MlaAttentionOp,
    MlaAttentionOShrinkOp,
    OutputGateOp,
    PagedAttentionOp,
    PagedAttentionOShrinkOp,
    PlanAttentionOp,
    RmsNormGatedOp,
    RmsNormGatedOShrinkOp,
    RmsNormLoraOp,
    RmsNormOp,
    RopeStoreKvOp,
    RouteTopkOp,
    SiluAndMulLoraOp,
    SiluAndMulOp,
)
from moelora.parallel import SINGLE, Shard


@dataclass(frozen=True)
class Ops:
    name: str
    linear: LinearOp
    linear_fp8: LinearFp8Op
    route_topk: RouteTopkOp
    fused_moe: FusedMoeOp
    silu_and_mul: SiluAndMulOp
    silu_and_mul_lora: SiluAndMulLoraOp
    add_shared_expert: AddSharedExpertOp
    add_lora_: AddLoraOp
    paged_attention: PagedAttentionOp
    paged_attention_o_shrink: PagedAttentionOShrinkOp
    plan_attention: PlanAttentionOp  # once a step, before the layers: the metadata they all read
    output_gate: OutputGateOp
    rms_norm: RmsNormOp
    rms_norm_lora: RmsNormLoraOp
    rope_store_kv: RopeStoreKvOp
    mla_attention: MlaAttentionOp
    mla_attention_o_shrink: MlaAttentionOShrinkOp
    # gated DeltaNet (layers/linear_attention.py)
    causal_conv1d: CausalConv1dOp
    gated_delta_rule: GatedDeltaRuleOp
    rms_norm_gated: RmsNormGatedOp
    rms_norm_gated_o_shrink: RmsNormGatedOShrinkOp
    # fused_moe takes MXFP4 experts packed (the reference would dequantize them at every call:
    # the engine has them dequantized once at load instead)
    keeps_mxfp4: bool
    # fused_moe takes block-FP8 experts as codes and scales (fp8_block.Fp8Weight): the engine
    # then keeps them so (layers/moe.py) where one rank holds the experts; False: dequantized
    # once at load, as the reference would dequantize them at every call
    keeps_fp8: bool
    # every kernel that reads LoRA factors reads them through LoraWeights.table (the compact
    # arena layout); False: some still read the dense views, so the pool keeps the old layout
    reads_lora_tables: bool
    # the part of the model this process holds and the collectives between the parts (NCCL or
    # gloo are kernels too): layers size themselves and reduce through it
    shard: Shard = SINGLE
    # deterministic inference: nothing a row sums follows what shares its step, the lm_head
    # included (the model's logits take `linear`, not cuBLAS, whose kernel follows the rows)
    deterministic: bool = False
    # mla_attention with LoRA reads no device value on the host, so a CUDA graph can capture
    # an MLA engine with enable_lora (engine/build.py runs it eagerly otherwise)
    mla_lora_capturable: bool = False
    # MLA layers hand prefill steps' own expanded keys and values to mla_attention, for the
    # prompts' first chunks (EngineConfig.mla_prefill; never with deterministic)
    mla_expanded_prefill: bool = False
    # linear_fp8 reads block-FP8 codes and scales at their bytes: the engine then keeps
    # attention's FP8 projections so (ModelConfig.projections_fp8); False: dequantized once at
    # load, as the reference would dequantize them at every call
    keeps_fp8_projections: bool = False


# The Triton table keeps attention's block-FP8 projections as codes and scales
# (kernels/linear.fp8_linear). Off until a device times it against the dequantized weights:
# `python bench/setting.py moelora.kernels.ops.FP8_PROJECTIONS=True -- bench/decode.py --fp8`.
FP8_PROJECTIONS = False
# EngineConfig.projections "auto": the skinny GEMV for these weights' small steps. float32
# weights keep the batch-invariant table's choice (cuBLAS), as before "auto": the GEMV's other
# summation order would be a change the float32 engine tests were not written against.
SKINNY_AUTO_DTYPES = (torch.bfloat16, torch.float16)


REFERENCE_OPS = Ops(
    name="torch",
    linear=reference.linear,
    linear_fp8=reference.linear_fp8,
    route_topk=reference.route_topk,
    fused_moe=reference.fused_moe,
    silu_and_mul=reference.silu_and_mul,
    silu_and_mul_lora=reference.silu_and_mul_lora,
    add_shared_expert=reference.add_shared_expert,
    add_lora_=reference.add_lora_,
    paged_attention=reference.paged_attention,
    paged_attention_o_shrink=reference.paged_attention_o_shrink,
    plan_attention=reference.plan_attention,
    output_gate=reference.output_gate,
    rms_norm=reference.rms_norm,
    rms_norm_lora=reference.rms_norm_lora,
    rope_store_kv=reference.rope_store_kv,
    mla_attention=mla.mla_attention,
    mla_attention_o_shrink=mla.mla_attention_o_shrink,
    causal_conv1d=gated_delta.causal_conv1d,
    gated_delta_rule=gated_delta.gated_delta_rule,
    rms_norm_gated=gated_delta.rms_norm_gated,
    rms_norm_gated_o_shrink=gated_delta.rms_norm_gated_o_shrink,
    keeps_mxfp4=False,
    keeps_fp8=False,
    reads_lora_tables=True,
)


def make_ops(
    device: torch.device,
    *,
    force_reference: bool = False,
    projections: str = "auto",
    prefill_attention_backend: str = "cudnn",
    deterministic: bool = False,
    mla_expanded_prefill: bool = False,
    chunked_delta_rule: bool = False,
    shard: Shard = SINGLE,
) -> Ops:
    """Triton kernels for CUDA tensors unless forced to the reference (for debugging), with the
    dense projections that `projections` names (see EngineConfig and kernels/linear.py) and the
    attention of long first prefill chunks that `prefill_attention_backend` names, for the
    model's part `shard`; deterministic: EngineConfig.enable_deterministic_inference's (the
    reference's bits never follow the batch: on the CPU nothing changes, but for MLA's
    prefill, which mla_expanded_prefill asks for and deterministic keeps absorbed);
    chunked_delta_rule: the Triton delta rule takes its block form for prefill steps
    (EngineConfig.linear_attention_prefill; never with deterministic)."""
    for name, value, valid in (
        ("projections", projections, PROJECTIONS),
        ("prefill_attention_backend", prefill_attention_backend, PREFILL_ATTENTION_BACKENDS),
    ):
        if value not in valid:
            raise ValueError(f"{name}={value!r} is invalid: expected one of {valid}")
    if device.type != "cuda" or force_reference:
        ops = REFERENCE_OPS
    else:
        ops = triton_ops(projections, prefill_attention_backend, deterministic=deterministic)
        if chunked_delta_rule and not deterministic:
            chunked = functools.partial(ops.gated_delta_rule, chunked=True)
            ops = replace(ops, gated_delta_rule=chunked)
    if mla_expanded_prefill and not deterministic:
        ops = replace(ops, mla_expanded_prefill=True)
    return ops if shard == SINGLE else replace(ops, shard=shard)


def triton_ops(
    projections: str, prefill_attention_backend: str = "cudnn", *, deterministic: bool = False
) -> Ops:
    """The Triton table with the dense projections EngineConfig.projections names and the
    prefill attention EngineConfig.prefill_attention_backend names. A new table each call: a
    BatchInvariantLinear keeps what it measured on its engine.

    deterministic: no kernel chooses by what shares the step: the fused MoE's tiles and LoRA
    shrinks fixed (fused.deterministic_config), decode steps' attention by the prefill kernel
    as in mixed steps, the attention's LoRA by add_lora_ at every step size (never folded into
    the norms: layers/attention_lora.folds_lora), long first chunks by the Triton kernel
    whatever prefill_attention_backend says (cuDNN's bits are not those of the same rows as a
    later chunk)."""
    from moelora.kernels import mlp
    from moelora.kernels.attention.mla import mla_attention, mla_attention_o_shrink
    from moelora.kernels.attention.norm_rope import rms_norm, rms_norm_lora, rope_store_kv
    from moelora.kernels.attention.output_gate import output_gate
    from moelora.kernels.linear_attention import conv, delta_rule, gated_norm
    from moelora.kernels.linear_fp8 import fp8_linear
    from moelora.kernels.lora import add_lora_
    from moelora.kernels.moe.fused import fused_moe
    from moelora.kernels.moe.routing import route_topk

    return Ops(
        name=f"triton-{projections}" + ("-deterministic" if deterministic else ""),
        deterministic=deterministic,
        linear=_linear(projections, deterministic=deterministic),
        linear_fp8=fp8_linear,  # batch-invariant whatever `projections` says
        keeps_fp8_projections=FP8_PROJECTIONS,
        route_topk=route_topk,
        fused_moe=functools.partial(fused_moe, deterministic=True) if deterministic else fused_moe,
        silu_and_mul=mlp.silu_and_mul,
        silu_and_mul_lora=mlp.silu_and_mul_lora,
        add_shared_expert=mlp.add_shared_expert,
        add_lora_=add_lora_,
        **_paged_attention_ops(prefill_attention_backend, deterministic=deterministic),
        output_gate=output_gate,
        rms_norm=rms_norm,
        rms_norm_lora=rms_norm_lora,
        rope_store_kv=rope_store_kv,
        # the latent attention, kv_b's absorption with its LoRA (and o's shrink) inside
        mla_attention=mla_attention,
        mla_attention_o_shrink=mla_attention_o_shrink,
        # models/model.py refuses Qwen3-Next with this table (family tests on a device first)
        causal_conv1d=conv.causal_conv1d,
        gated_delta_rule=delta_rule.gated_delta_rule,
        rms_norm_gated=gated_norm.rms_norm_gated,
        rms_norm_gated_o_shrink=gated_norm.rms_norm_gated_o_shrink,
        keeps_mxfp4=True,
        # the fused MoE reads Fp8Weight experts (kernels/moe/fp8.py); tests/test_fp8.py and
        # test_fp8_kept.py pass on --moelora-device=cuda with it
        keeps_fp8=True,
        # add_lora_, lora_shrink_split, the fused MoE's LoRA epilogues and align, and the
        # attention's folded LoRA (norm_rope, paged_attention_o_shrink) read the tables
        reads_lora_tables=True,
        # mla_attention's LoRA reads the slots through the table: tests/gpu/test_mla_gpu.py
        # replays it in a graph with new slots, the DeepSeek and GLM engines equal PEFT's
        mla_lora_capturable=True,
    )


def _linear(projections: str, *, deterministic: bool) -> LinearOp:
    """The Triton table's dense projections, as EngineConfig.projections names them."""
    from moelora.kernels.linear import BatchInvariantLinear

    if projections == "cublas":
        return reference.linear
    if projections == "auto":
        return BatchInvariantLinear(skinny=not deterministic, skinny_dtypes=SKINNY_AUTO_DTYPES)
    return BatchInvariantLinear(skinny=projections == "skinny")


def _paged_attention_ops(prefill_attention_backend: str, *, deterministic: bool) -> dict:
    """The Triton table's paged_attention, paged_attention_o_shrink and plan_attention: long
    first chunks by cuDNN where prefill_attention_backend says so and deterministic does not
    forbid it (triton_ops)."""
    from moelora.kernels.attention import paged as attention

    cudnn = prefill_attention_backend == "cudnn" and not deterministic
    # only where set, so that the default table's partials name what they change
    exact = {"deterministic": True} if deterministic else {}
    dense_from = attention.DENSE_FROM if cudnn else 0
    return {
        "paged_attention": functools.partial(
            attention.paged_attention, dense_from=dense_from, **exact
        ),
        "paged_attention_o_shrink": functools.partial(
            attention.paged_attention_o_shrink, dense_from=dense_from, **exact
        ),
        "plan_attention": (
            functools.partial(attention.plan_attention, **exact)
            if deterministic
            else attention.plan_attention
        ),
    }
