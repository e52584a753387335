"""Tiny DeepSeek-V2, DeepSeek-V3 and GLM-4.5 models and their adapters (fp32, seeded, random
unit-scale weights like hf_fixtures' and non-zero correction biases), for the comparisons
against transformers+PEFT in test_deepseek_glm.py.

Each model has a dense first layer (first_k_dense_replace=1) and two MoE layers of 8 experts in
groups, with shared experts; DeepSeek-V2 has no q_lora_rank (q_proj, as V2-Lite), V3 has one,
DeepSeek's YaRN with mscale_all_dim (a softmax scale other than qk_head_dim ** -0.5) and
rotary pairs interleaved; GLM-4.5 has partial rotary, q/k norms and q/k/v biases.
"""

from __future__ import annotations

from pathlib import Path

import hf_fixtures as hf
import torch

ARCHS = ("deepseek_v2", "deepseek_v3", "glm4_moe")
_COMMON = dict(
    vocab_size=hf.VOCAB_SIZE,
    hidden_size=64,
    num_hidden_layers=3,
    num_attention_heads=4,
    intermediate_size=96,
    moe_intermediate_size=24,
    n_routed_experts=8,
    num_experts_per_tok=2,
    first_k_dense_replace=1,
    rms_norm_eps=1e-6,
    max_position_embeddings=512,
    eos_token_id=hf.EOS_TOKEN_ID,
    bos_token_id=None,
    pad_token_id=None,
    tie_word_embeddings=False,
)
# num_key_value_heads: transformers repeats the expanded K and V by heads // it (V3 defaults to 128)
_MLA = dict(
    kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, num_key_value_heads=4
)
_ARCH_CONFIG: dict[str, dict] = {
    "deepseek_v2": dict(
        **_MLA,
        q_lora_rank=None,
        n_shared_experts=2,
        n_group=4,
        topk_group=2,
        topk_method="group_limited_greedy",
        routed_scaling_factor=1.5,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    ),
    "deepseek_v3": dict(
        **_MLA,
        q_lora_rank=24,
        n_shared_experts=1,
        n_group=4,
        topk_group=2,
        num_experts_per_tok=3,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        rope_interleave=True,
        rope_parameters={
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 128,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "mscale": 1.0,
            "mscale_all_dim": 0.8,
            "rope_theta": 10000.0,
        },
    ),
    "glm4_moe": dict(
        head_dim=16,
        num_key_value_heads=2,
        n_shared_experts=1,
        n_group=2,
        topk_group=1,
        routed_scaling_factor=1.8,
        norm_topk_prob=True,
        use_qk_norm=True,
        attention_bias=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        partial_rotary_factor=0.5,
    ),
}
_CLASSES = {
    "deepseek_v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM"),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM"),
    "glm4_moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM"),
}
# the projections of each architecture's attention that adapters target
ATTENTION = {
    "deepseek_v2": ["q_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"],
    "deepseek_v3": ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"],
    "glm4_moe": ["q_proj", "k_proj", "v_proj", "o_proj"],
}
MLP = ["gate_proj", "up_proj", "down_proj"]  # the dense layer's MLP and the shared experts


def make_model(arch: str, path: str | Path, *, seed: int = 0, **overrides) -> Path:
    """A tiny random `arch` model saved as transformers saves it (experts per expert), with a
    tokenizer; every router's e_score_correction_bias random too (where it has one)."""
    import transformers

    config_name, model_name = _CLASSES[arch]
    config = getattr(transformers, config_name)(**{**_COMMON, **_ARCH_CONFIG[arch], **overrides})
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config).to(torch.float32).eval()
    hf._randomize(model, seed=seed, tied=False)
    gen = torch.Generator().manual_seed(seed + 1000)
    with torch.no_grad():
        for name, buffer in sorted(model.named_buffers()):
            if name.endswith("e_score_correction_bias"):
                # sigmoid scores differ by about 0.1 to 0.3: a bias of that size moves choices
                buffer.copy_(0.2 * torch.randn(buffer.shape, generator=gen))
    path = Path(path)
    model.save_pretrained(path)
    hf._save_tokenizer(path)
    return path


def peft_adapter(model: Path, path: Path, arch: str, *, seed: int) -> Path:
    """PEFT rank 8: every attention projection (kv_b_proj included) and the experts through
    target_parameters. Not the dense layer's MLP nor the shared experts: on these model types
    PEFT 0.21 turns target_modules gate_proj / up_proj / down_proj into target_parameters on
    the fused experts (peft/utils/transformers_weight_conversion.py), so no PEFT adapter made
    on transformers 5 adapts them; per_expert_adapter does, against a merged reference."""
    return hf.make_peft_adapter(
        model,
        path,
        targets=ATTENTION[arch],
        target_parameters=hf.EXPERT_PARAMS,
        seed=seed,
        rank=8,
        alpha=16,
    )


def per_expert_adapter(model: Path, path: Path, arch: str, *, seed: int, rank: int = 4) -> Path:
    """A hand-written adapter with per-expert keys (`mlp.experts.{e}.gate_proj` ...), every
    attention projection, the dense MLP and the shared experts; alpha 2 * rank."""
    modules = hf.linear_shapes(model, set(ATTENTION[arch] + MLP))
    return hf.write_adapter_of_shapes(model, path, modules, seed=seed, rank=rank)
