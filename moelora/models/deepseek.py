"""DeepSeek-V2 and V3 (and what shares their architecture: Kimi-K2, Moonlight): multi-head
latent attention (ModelConfig.mla), grouped top-k routing scaled by routed_scaling_factor
(V2: softmax scores, a group's best expert scores it; V3: sigmoid scores with a correction bias
for the choice, a group's two best score it), shared experts without a gate, and dense MLP
layers before first_k_dense_replace. Multi-token-prediction layers in a checkpoint are skipped
at load."""

from __future__ import annotations

import logging
import math

from moelora.config import GroupedRouting, MlaConfig, ModelConfig
from moelora.errors import ModelConfigError
from moelora.models import common

log = logging.getLogger(__name__)

# transformers' DeepseekV2TopkRouter knows these two; V3's router takes no topk_method
_V2_TOPK_METHODS = ("greedy", "group_limited_greedy")


def v2_model_config(hf) -> ModelConfig:
    method = getattr(hf, "topk_method", None) or "greedy"
    if method not in _V2_TOPK_METHODS:
        raise ModelConfigError(
            f"topk_method={method!r} is not supported for deepseek_v2: expected one of "
            f"{list(_V2_TOPK_METHODS)}"
        )
    grouped = method == "group_limited_greedy"
    routing = _routing(hf, group_score="max", correction_bias=False, grouped=grouped)
    # V2's router never renormalizes the top-k, whatever norm_topk_prob says
    return _model_config(hf, "deepseek_v2", routing, scoring="softmax", renormalize=False)


def v3_model_config(hf) -> ModelConfig:
    renormalize = bool(getattr(hf, "norm_topk_prob", True))
    return _model_config(
        hf, "deepseek_v3", routing_v3(hf), scoring="sigmoid", renormalize=renormalize
    )


def routing_v3(hf) -> GroupedRouting:
    """DeepSeek-V3's routing (GLM-4.5's too)."""
    return _routing(hf, group_score="top2_sum", correction_bias=True, grouped=True)


def _model_config(
    hf, arch: str, routing: GroupedRouting, *, scoring: str, renormalize: bool
) -> ModelConfig:
    _refuse(hf, arch)
    mla = mla_config(hf)
    return common.model_config(
        hf,
        arch,
        num_kv_heads=1,  # the cache holds one latent and one rotary key per token
        head_dim=mla.qk_head_dim,
        num_experts=hf.n_routed_experts,
        sparse_layers=dense_first(hf),
        shared_expert_intermediate_size=shared_intermediate(hf),
        shared_expert_gate=False,
        scoring=scoring,
        renormalize=renormalize,
        routing=routing,
        mla=mla,
        mtp_layers=mtp_layers(hf, arch),
    )


def _refuse(hf, arch: str) -> None:
    """What transformers' DeepSeek classes may hold that moelora does not serve yet."""
    for name in ("attention_bias", "mlp_bias"):
        if getattr(hf, name, False):
            raise ModelConfigError(f"{name}=True is not supported for {arch}: expected False")
    freq = getattr(hf, "moe_layer_freq", 1) or 1
    if freq != 1:
        raise ModelConfigError(
            f"moe_layer_freq={freq} is not supported for {arch}: expected 1 (every layer from "
            "first_k_dense_replace on is sparse, as transformers builds it)"
        )


def mla_config(hf) -> MlaConfig:
    qk_head_dim = hf.qk_nope_head_dim + hf.qk_rope_head_dim
    return MlaConfig(
        q_lora_rank=hf.q_lora_rank or 0,
        kv_lora_rank=hf.kv_lora_rank,
        qk_nope_head_dim=hf.qk_nope_head_dim,
        qk_rope_head_dim=hf.qk_rope_head_dim,
        v_head_dim=hf.v_head_dim,
        softmax_scale=yarn_softmax_scale(hf.rope_parameters or {}, qk_head_dim**-0.5),
        # V2 rotates adjacent pairs (as complex numbers); V3 as rope_interleave says
        rope_interleave=bool(getattr(hf, "rope_interleave", True)),
    )


def yarn_softmax_scale(rope: dict, scale: float) -> float:
    """The attention's softmax scale under DeepSeek's YaRN: qk_head_dim ** -0.5 times
    mscale(factor, mscale_all_dim) ** 2 where mscale_all_dim is set, with mscale(s, m) =
    0.1 m ln(s) + 1 for s > 1 (transformers' deepseek_v3 yarn_apply_mscale, step for step)."""
    if rope.get("rope_type", "default") == "default":
        return scale
    factor, mscale_all_dim = rope["factor"], rope.get("mscale_all_dim", 0)
    if mscale_all_dim and factor > 1:
        mscale = 0.1 * mscale_all_dim * math.log(factor) + 1.0
        scale = scale * mscale * mscale
    return scale


def _routing(hf, *, group_score: str, correction_bias: bool, grouped: bool) -> GroupedRouting:
    n_group = (getattr(hf, "n_group", None) or 1) if grouped else 1
    topk_group = (getattr(hf, "topk_group", None) or n_group) if grouped else 1
    per_group = hf.n_routed_experts // n_group
    if hf.n_routed_experts % n_group or (group_score == "top2_sum" and per_group < 2):
        raise ModelConfigError(
            f"n_group={n_group} is not supported with n_routed_experts={hf.n_routed_experts}: "
            "expected a divisor of it"
            + (" that leaves two experts a group at least" if group_score == "top2_sum" else "")
        )
    if not 1 <= topk_group <= n_group:
        raise ModelConfigError(
            f"topk_group={topk_group} is not supported with n_group={n_group}: expected 1 to "
            f"{n_group}"
        )
    if topk_group * per_group < hf.num_experts_per_tok:
        raise ModelConfigError(
            f"topk_group={topk_group} groups of {per_group} experts cannot hold "
            f"num_experts_per_tok={hf.num_experts_per_tok}: expected at least that many experts"
        )
    return GroupedRouting(
        n_group=n_group,
        topk_group=topk_group,
        group_score=group_score,
        routed_scaling_factor=float(getattr(hf, "routed_scaling_factor", 1.0) or 1.0),
        correction_bias=correction_bias,
    )


def dense_first(hf) -> tuple[bool, ...]:
    """Per layer: sparse from first_k_dense_replace on."""
    first = getattr(hf, "first_k_dense_replace", 0) or 0
    return tuple(i >= first for i in range(hf.num_hidden_layers))


def shared_intermediate(hf) -> int:
    return hf.moe_intermediate_size * (getattr(hf, "n_shared_experts", 0) or 0)


def mtp_layers(hf, arch: str) -> int:
    """Multi-token-prediction layers a checkpoint may hold after the decoder's: skipped at
    load (speculative decoding will use them)."""
    n = getattr(hf, "num_nextn_predict_layers", 0) or 0
    if n:
        log.info(
            "%s: num_nextn_predict_layers=%d: a checkpoint's multi-token-prediction layers "
            "are skipped at load",
            arch,
            n,
        )
    return n
