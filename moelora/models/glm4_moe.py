"""GLM-4.5 / 4.6 (Glm4MoeForCausalLM): GQA attention with rotary on part of each head
(partial_rotary_factor), optional per-head q/k RMSNorm and q/k/v biases; DeepSeek-V3's routing
(sigmoid scores, a correction bias for the choice, grouped top-k, routed_scaling_factor), shared
experts without a gate and dense MLP layers before first_k_dense_replace."""

from __future__ import annotations

from moelora.config import ModelConfig
from moelora.errors import ModelConfigError
from moelora.models import common, deepseek


def model_config(hf) -> ModelConfig:
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    factor = (hf.rope_parameters or {}).get("partial_rotary_factor") or 1.0
    rotary_dim = int(head_dim * factor)
    if rotary_dim % 2 or (head_dim - rotary_dim) % 2:
        raise ModelConfigError(
            f"partial_rotary_factor={factor} is not supported with head_dim={head_dim}: "
            "expected an even number of rotated dims and of dims left as they are"
        )
    return common.model_config(
        hf,
        "glm4_moe",
        head_dim=head_dim,
        qk_norm="head" if getattr(hf, "use_qk_norm", False) else "none",
        num_experts=hf.n_routed_experts,
        sparse_layers=deepseek.dense_first(hf),
        shared_expert_intermediate_size=deepseek.shared_intermediate(hf),
        shared_expert_gate=False,
        scoring="sigmoid",
        renormalize=bool(getattr(hf, "norm_topk_prob", True)),
        routing=deepseek.routing_v3(hf),
        rotary_dim=0 if rotary_dim == head_dim else rotary_dim,
        mtp_layers=deepseek.mtp_layers(hf, "glm4_moe"),
    )
