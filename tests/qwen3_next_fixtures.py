"""Tiny Qwen3-Next and Qwen3.5-MoE models and their adapters (fp32, seeded, random unit-scale
weights like hf_fixtures'), for the comparisons against transformers+PEFT in
test_qwen3_next.py.

Each model has 4 layers: 3 gated DeltaNet, then 1 gated full attention (transformers' default
pattern), 8 experts top-2 with a gated shared expert; Qwen3-Next's layer 1 is a dense MLP
(mlp_only_layers). The DeltaNet has 2 q/k heads of 8 and 4 value heads of 12 (each q/k head
serves two), a conv of 4 taps; the attention 4 heads of 16 (2 KV heads) with rotary on a
quarter of each head. A_log is drawn so that the state decays by 2% to 20% a token: it
remembers tens of tokens, so a state carried wrongly from chunk to chunk shows.
"""

from __future__ import annotations

import math
from pathlib import Path

import hf_fixtures as hf
import torch

ARCHS = ("qwen3_next", "qwen3_5_moe")
# The logprob tolerance of their comparisons with transformers: twice the suite's. On these
# fixtures a float32 run's logprobs move with rounding several times more than the other
# families' do (the delta rule's float32 state, which transformers keeps too, carries it from
# token to token): transformers' own float32 run is as far as the suite's tolerance from a
# float64 one, and moelora's float32 run about as far, while run in float64 throughout the two
# agree to within a thousandth of it (bench/results/NOTES.md, session of 2026-12-04, seventh).
LOGPROB_TOL = 2e-4
_COMMON = dict(
    vocab_size=hf.VOCAB_SIZE,
    hidden_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=8,
    linear_value_head_dim=12,
    linear_conv_kernel_dim=4,
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=40,
    shared_expert_intermediate_size=48,
    rms_norm_eps=1e-6,
    max_position_embeddings=512,
    eos_token_id=hf.EOS_TOKEN_ID,
    bos_token_id=None,
    pad_token_id=None,
    tie_word_embeddings=False,
)
_ARCH_CONFIG: dict[str, dict] = {
    "qwen3_next": dict(intermediate_size=96, mlp_only_layers=[1], norm_topk_prob=True),
    "qwen3_5_moe": dict(),
}
_CLASSES = {
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM"),
    "qwen3_5_moe": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM"),
}
FULL_ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
LINEAR_ATTENTION = {
    "qwen3_next": ["in_proj_qkvz", "in_proj_ba", "out_proj"],
    "qwen3_5_moe": ["in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"],
}
MLP = ["gate_proj", "up_proj", "down_proj"]  # the shared experts and the dense layer's MLP


def make_model(arch: str, path: str | Path, *, seed: int = 0) -> Path:
    """A tiny random `arch` model saved as transformers saves it, with a tokenizer."""
    import transformers

    config_name, model_name = _CLASSES[arch]
    config = getattr(transformers, config_name)(**{**_COMMON, **_ARCH_CONFIG[arch]})
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config).to(torch.float32).eval()
    hf._randomize(model, seed=seed, tied=False)
    gen = torch.Generator().manual_seed(seed + 1000)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if name.endswith("A_log"):  # decay exp(-A softplus(.)) of 2% to 20% a token
                p.copy_(torch.empty(p.shape).uniform_(0.02, 0.2, generator=gen).log())
    path = Path(path)
    model.save_pretrained(path)
    hf._save_tokenizer(path)
    return path


def peft_adapter(model: Path, path: Path, arch: str, *, seed: int) -> Path:
    """PEFT rank 8: every projection of both attentions, and the experts through
    target_parameters (target_modules gate_proj / up_proj / down_proj would become
    target_parameters on the fused experts in PEFT 0.21: per_expert_adapter covers the
    shared expert and the dense MLP)."""
    return hf.make_peft_adapter(
        model,
        path,
        targets=FULL_ATTENTION + LINEAR_ATTENTION[arch],
        target_parameters=hf.EXPERT_PARAMS,
        seed=seed,
        rank=8,
        alpha=16,
    )


def per_expert_adapter(model: Path, path: Path, arch: str, *, seed: int, rank: int = 4) -> Path:
    """A hand-written adapter with per-expert keys (`mlp.experts.{e}.gate_proj` ...), every
    projection of both attentions, the shared experts and the dense MLP; alpha 2 * rank."""
    modules = hf.linear_shapes(model, set(FULL_ATTENTION + LINEAR_ATTENTION[arch] + MLP))
    return hf.write_adapter_of_shapes(model, path, modules, seed=seed, rank=rank)


def make_multimodal_model(path: str | Path, *, seed: int = 0) -> Path:
    """A tiny Qwen3_5MoeForConditionalGeneration (the text model above behind a one-block
    vision tower), saved as transformers saves it: `model.language_model.*`, `model.visual.*`,
    `lm_head.weight`; its weights drawn as make_model's."""
    from transformers.models.qwen3_5_moe import (
        Qwen3_5MoeConfig,
        Qwen3_5MoeForConditionalGeneration,
    )

    vision = dict(
        depth=1,
        hidden_size=32,
        intermediate_size=64,
        num_heads=2,
        out_hidden_size=64,
        patch_size=4,
        temporal_patch_size=1,
        spatial_merge_size=1,
    )
    text = {k: v for k, v in _COMMON.items() if k != "tie_word_embeddings"}
    config = Qwen3_5MoeConfig(text_config=text, vision_config=vision, tie_word_embeddings=False)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = Qwen3_5MoeForConditionalGeneration(config).to(torch.float32).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            noise = torch.randn(p.shape, generator=gen)
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * noise)
            elif name.endswith("A_log"):
                p.copy_(torch.empty(p.shape).uniform_(0.02, 0.2, generator=gen).log())
            elif "embed_tokens" in name:
                p.copy_(noise)
            elif name == "lm_head.weight":
                p.copy_(noise * 3.0 / math.sqrt(_COMMON["hidden_size"]))
            else:
                p.copy_(noise / math.sqrt(p.shape[-1]) if p.dim() > 1 else 0.3 * noise)
    path = Path(path)
    model.save_pretrained(path)
    hf._save_tokenizer(path)
    return path
