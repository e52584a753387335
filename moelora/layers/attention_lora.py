"""The attention's LoRA folded into the kernels around it: when, and what is folded where.

Up to FOLD_LORA_MAX_TOKENS tokens in a step, neither LoRA of the attention (q|k|v's, o's) takes
a launch of its own. Each is cut into its shrink and its expand, each half rides in a kernel
that runs anyway, and between the two halves the LoRA travels as a FoldedLora (step/lora.py):

  1. the input RMSNorm shrinks q|k|v's LoRA from its output       rms_norm_lora(shrink=)
  2. rotary expands it into q, k and v first (then the per-head   rope_store_kv(expand=)
     q/k norm and the rotation), and stores k and v in the cache
  3. the attention shrinks o's LoRA from its output: in the       paged_attention_o_shrink
     combine of a split decode, else in one split-shrink launch
  4. the post-attention RMSNorm expands o's into its input,       rms_norm_lora(expand=)
     before the residual add

MLA (layers/mla.py) folds o's LoRA only: kv_b_proj's absorption, the attention's last launch,
shrinks it (mla_attention_o_shrink) and the post-attention RMSNorm expands it (step 4). Its
q|kv projections feed more kernels than rotary (the absorption, the expanded prefill), and
keep add_lora_. Gated DeltaNet (layers/linear_attention.py) folds out_proj's the same way, its
shrink in the gated norm (rms_norm_gated_o_shrink); in_proj keeps add_lora_.

Each row reads its slot's A and B once, spread over programs (one program per row reading a
whole A is bound by its load latency). A base-only batch pays a few scalar loads, and one
launch when the decode is not split. Longer steps (big prefill chunks) take add_lora_ in each
projection instead, whose 16-row tiles share each tile of A.
"""

from __future__ import annotations

from typing import Protocol

import torch

from moelora.layers.attention import Attention
from moelora.layers.linear_attention import GatedDeltaNet
from moelora.layers.mla import MlaAttention
from moelora.layers.norm import Joined, RMSNorm
from moelora.step.batch import ForwardBatch
from moelora.step.lora import FoldedLora, LoraWeights

FOLD_LORA_MAX_TOKENS = 256


def folds_lora(attn: Attention, batch: ForwardBatch, num_tokens: int) -> bool:
    """Whether this step's attention LoRA is folded. Not with a full-width q/k norm or
    clip_qkv, which come between q|k|v and rotary, nor with a head dim that is not a power of
    two (rotary's expand swaps the halves of a head), nor with tensor parallelism, whose
    all-reduce of o's output comes between o and the norm that would expand o's LoRA. Nor with
    MLA (layers/mla.py), whose projections are others, nor with an output gate (q_proj's slice
    holds the gate too). Partial rotary folds: rotary reads the delta in its order too.

    Never in deterministic inference: a row's LoRA would then sum one way in a step of up to
    FOLD_LORA_MAX_TOKENS tokens (the norms' lane sums) and another in a longer one (add_lora_'s
    MMA chain), so its bits would follow the step's size. add_lora_ sums each row by the same
    ascending chain at every size."""
    cfg = attn.cfg
    return (
        batch.lora is not None
        and cfg.mla is None
        and not cfg.attn_output_gate
        and attn.qkv_proj.lora is not None
        and attn.o_proj.lora is not None
        and cfg.qk_norm != "full"
        and cfg.clip_qkv is None
        and cfg.head_dim & (cfg.head_dim - 1) == 0
        and num_tokens <= FOLD_LORA_MAX_TOKENS
        and attn.ops.shard.size == 1
        and not attn.ops.deterministic
    )


def folds_o_lora(attn: MlaAttention | GatedDeltaNet, batch: ForwardBatch, num_tokens: int) -> bool:
    """Whether this step's MLA or gated DeltaNet folds its output projection's LoRA (the module
    docstring): as folds_lora, up to FOLD_LORA_MAX_TOKENS tokens, on one rank, never in
    deterministic inference."""
    out_proj = attn.o_proj if isinstance(attn, MlaAttention) else attn.out_proj
    return (
        batch.lora is not None
        and out_proj.lora is not None
        and num_tokens <= FOLD_LORA_MAX_TOKENS
        and attn.ops.shard.size == 1
        and not attn.ops.deterministic
    )


class AroundAttention(Protocol):
    """What the fold needs of a decoder layer: the attention and the norms on either side."""

    input_layernorm: RMSNorm
    self_attn: Attention | MlaAttention | GatedDeltaNet
    post_attention_layernorm: RMSNorm


def folded_attention(
    layer: AroundAttention,
    x: torch.Tensor | Joined,
    residual: torch.Tensor | None,
    batch: ForwardBatch,
    kv_cache: tuple[torch.Tensor, torch.Tensor],
    mlp_shrink: LoraWeights | None = None,
) -> tuple[torch.Tensor, torch.Tensor, FoldedLora | None]:
    """The layer's input norm, attention and post-attention norm with the attention's LoRA
    folded (steps 1 to 4 above; MLA's and gated DeltaNet's: the output projection's only), the
    post-attention norm also shrinking
    mlp_shrink where given (layers/mlp_lora.py). Returns (the post-attention norm's output,
    the residual stream after the attention, mlp_shrink's FoldedLora or None), as the unfolded
    sequence does."""
    attn, info = layer.self_attn, batch.lora
    if isinstance(attn, (MlaAttention, GatedDeltaNet)):  # the output projection's LoRA only
        h, residual = layer.input_layernorm(x, residual)
        h, o = attn.forward_folded(h, batch, kv_cache)
    else:
        shrink = attn.qkv_proj.lora
        h, residual, qkv = layer.input_layernorm.with_lora(x, residual, info, shrink=shrink)
        h, o = attn.forward_folded(h, batch, kv_cache, qkv)
    norm = layer.post_attention_layernorm
    return norm.with_lora(h, residual, info, expand=o, shrink=mlp_shrink)
