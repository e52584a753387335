"""The call of each kernel in the Ops table, as the layers make it: one Protocol per field.

kernels/reference.py and the Triton table (ops.triton_ops) both satisfy them, parameter for
parameter (names, kinds, defaults, annotations), and tests/kernels/test_ops_contract.py keeps it
so. A Triton entry may add tuning keywords that no layer passes (keyword-only, with a default);
the semantics of each call are in its reference's docstring.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

    from moelora.config import GroupedRouting
    from moelora.kernels.fp8_block import Fp8Weight
    from moelora.kernels.gated_delta import DeltaGates
    from moelora.kernels.mla import ExpandedKv
    from moelora.kernels.moe.mxfp4_layout import Mxfp4Weight
    from moelora.step.batch import AttentionMetadata
    from moelora.step.lora import FoldedLora, LoraBatchInfo, LoraWeights


class LinearOp(Protocol):
    """reference.linear: the dense projections, the router and the shared expert's gate."""

    def __call__(
        self, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor: ...


class LinearFp8Op(Protocol):
    """reference.linear_fp8: a projection of block-FP8 weights (codes [out, in] e4m3, float32
    scale_inv [ceil(out / 128), ceil(in / 128)]), as linear on their dequantized weight."""

    def __call__(
        self,
        x: torch.Tensor,
        codes: torch.Tensor,
        scale_inv: torch.Tensor,
        bias: torch.Tensor | None = None,
    ) -> torch.Tensor: ...


class RouteTopkOp(Protocol):
    """reference.route_topk: the MoE's router (layers/moe.py)."""

    def __call__(
        self,
        router_logits: torch.Tensor,
        top_k: int,
        *,
        scoring: str = "softmax",
        renormalize: bool,
        grouped: GroupedRouting | None = None,
        correction_bias: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]: ...


class OutputGateOp(Protocol):
    """reference.output_gate: the gated attention's output gate (layers/attention.py)."""

    def __call__(self, out: torch.Tensor, gate: torch.Tensor) -> torch.Tensor: ...


class SiluAndMulOp(Protocol):
    """reference.silu_and_mul: a dense MLP's and a shared expert's SwiGLU (layers/moe.py)."""

    def __call__(self, gate_up: torch.Tensor) -> torch.Tensor: ...


class SiluAndMulLoraOp(Protocol):
    """reference.silu_and_mul_lora: the SwiGLU with gate_up_proj's LoRA expanded and
    down_proj's shrunk (layers/mlp_lora.py)."""

    def __call__(
        self,
        gate_up: torch.Tensor,
        info: LoraBatchInfo,
        *,
        expand: FoldedLora | None = None,
        shrink: LoraWeights | None = None,
    ) -> tuple[torch.Tensor, FoldedLora | None]: ...


class AddSharedExpertOp(Protocol):
    """reference.add_shared_expert: the routed experts' rows and the shared expert, joined
    (layers/moe.py)."""

    def __call__(
        self,
        moe_out: torch.Tensor,
        shared: torch.Tensor,
        gate_logits: torch.Tensor | None = None,
    ) -> torch.Tensor: ...


class FusedMoeOp(Protocol):
    """reference.fused_moe: the experts with their LoRA (layers/moe.py)."""

    def __call__(
        self,
        x: torch.Tensor,
        w13: torch.Tensor | Mxfp4Weight | Fp8Weight,
        w2: torch.Tensor | Mxfp4Weight | Fp8Weight,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        *,
        lora13: LoraWeights | None = None,
        lora2: LoraWeights | None = None,
        info: LoraBatchInfo | None = None,
        sum_topk: bool = True,
        b13: torch.Tensor | None = None,
        b2: torch.Tensor | None = None,
        activation: str = "silu",
    ) -> torch.Tensor: ...


class AddLoraOp(Protocol):
    """reference.add_lora_: a projection's LoRA added in place (layers/linear.py)."""

    def __call__(
        self, y: torch.Tensor, x: torch.Tensor, lora: LoraWeights, info: LoraBatchInfo
    ) -> torch.Tensor: ...


class PagedAttentionOp(Protocol):
    """reference.paged_attention (layers/attention.py)."""

    def __call__(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        attn: AttentionMetadata,
        scale: float,
        *,
        window: int = 0,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor: ...


class PagedAttentionOShrinkOp(Protocol):
    """reference.paged_attention_o_shrink: the attention with its o projection's LoRA shrink
    (layers/attention.py, folded LoRA)."""

    def __call__(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        attn: AttentionMetadata,
        scale: float,
        lora: LoraWeights,
        info: LoraBatchInfo,
        *,
        window: int = 0,
        sinks: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, FoldedLora]: ...


class PlanAttentionOp(Protocol):
    """reference.plan_attention: once a step, before the layers (models/model.py)."""

    def __call__(
        self,
        attn: AttentionMetadata,
        num_rows: int,
        num_q_heads: int,
        num_kv_heads: int,
        head_dim: int,
    ) -> AttentionMetadata: ...


class RmsNormOp(Protocol):
    """reference.rms_norm (layers/norm.py)."""

    def __call__(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        residual: torch.Tensor | None = None,
        *,
        shared: torch.Tensor | None = None,
        shared_gate: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]: ...


class RmsNormLoraOp(Protocol):
    """reference.rms_norm_lora: the norm with the LoRA on either side folded in
    (layers/norm.py)."""

    def __call__(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        residual: torch.Tensor | None,
        info: LoraBatchInfo,
        *,
        shrink: LoraWeights | None = None,
        expand: FoldedLora | None = None,
        shared: torch.Tensor | None = None,
        shared_gate: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, FoldedLora | None]: ...


class RopeStoreKvOp(Protocol):
    """reference.rope_store_kv: q/k norm, rotary and the KV store (layers/attention.py)."""

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        positions: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        q_norm: torch.Tensor | None,
        k_norm: torch.Tensor | None,
        eps: float,
        *,
        v: torch.Tensor | None = None,
        k_cache: torch.Tensor | None = None,
        v_cache: torch.Tensor | None = None,
        slot_mapping: torch.Tensor | None = None,
        expand: FoldedLora | None = None,
        interleaved: bool = False,
        rotary_dim: int = 0,
        v_norm: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]: ...


class MlaAttentionOp(Protocol):
    """mla.mla_attention: DeepSeek's latent attention with kv_b_proj and its LoRA inside
    (layers/mla.py)."""

    def __call__(
        self,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        latent_cache: torch.Tensor,
        rope_cache: torch.Tensor,
        attn: AttentionMetadata,
        kv_b: torch.Tensor,
        scale: float,
        *,
        lora: LoraWeights | None = None,
        info: LoraBatchInfo | None = None,
        expanded: ExpandedKv | None = None,
    ) -> torch.Tensor: ...


class MlaAttentionOShrinkOp(Protocol):
    """mla.mla_attention_o_shrink: the latent attention with its o projection's LoRA shrink
    (layers/mla.py, o_proj's LoRA folded into the kernels around it)."""

    def __call__(
        self,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        latent_cache: torch.Tensor,
        rope_cache: torch.Tensor,
        attn: AttentionMetadata,
        kv_b: torch.Tensor,
        scale: float,
        *,
        lora: LoraWeights | None,
        info: LoraBatchInfo,
        o_lora: LoraWeights,
        expanded: ExpandedKv | None = None,
    ) -> tuple[torch.Tensor, FoldedLora]: ...


class CausalConv1dOp(Protocol):
    """gated_delta.causal_conv1d: gated DeltaNet's short conv over each request's window
    (layers/linear_attention.py)."""

    def __call__(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        conv_state: torch.Tensor,
        attn: AttentionMetadata,
    ) -> torch.Tensor: ...


class GatedDeltaRuleOp(Protocol):
    """gated_delta.gated_delta_rule: the delta rule over each request's recurrent state."""

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor | None,
        beta: torch.Tensor | None,
        state: torch.Tensor,
        attn: AttentionMetadata,
        *,
        gates: DeltaGates | None = None,
    ) -> torch.Tensor: ...


class RmsNormGatedOp(Protocol):
    """gated_delta.rms_norm_gated: gated DeltaNet's output norm, gated by silu(z)."""

    def __call__(
        self, x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> torch.Tensor: ...


class RmsNormGatedOShrinkOp(Protocol):
    """gated_delta.rms_norm_gated_o_shrink: the gated norm and out_proj's LoRA shrink of its
    output (layers/attention_lora.py)."""

    def __call__(
        self,
        x: torch.Tensor,
        gate: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        lora: LoraWeights,
        info: LoraBatchInfo,
    ) -> tuple[torch.Tensor, FoldedLora]: ...
