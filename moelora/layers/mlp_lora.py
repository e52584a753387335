"""A dense MLP's or shared expert's LoRA folded into the kernels around it: when, and where.

Up to FOLD_LORA_MAX_TOKENS tokens in a step, neither LoRA of a SwiGLU MLP (gate_up_proj's,
down_proj's) takes a launch of its own, as the attention's do not (layers/attention_lora.py):

  1. the post-attention RMSNorm shrinks gate_up's LoRA from its output   rms_norm_lora(shrink=)
  2. the SwiGLU expands it into gate and up, then shrinks down's LoRA    silu_and_mul_lora
     from the h it writes (a partial a column block)
  3. the next RMSNorm (the next layer's input norm, or the model's       rms_norm_lora(expand=)
     final norm) expands down's into the MLP's output (Joined.expand):
     into the shared expert's row before its gate and the join with
     the routed experts' rows, as PEFT adds it

The MLPs that fold: a dense layer's, and a MoE's shared expert (DeepSeek, Moonlight, GLM-4.5;
sigmoid-gated: Qwen2-MoE, Qwen3.5, Qwen3-Next) once its inputs are fused, on one rank (an
all-reduce would come between down and the norm), never in deterministic inference (a row's
sums would follow the step's size, as folds_lora says).
"""

from __future__ import annotations

from moelora.layers.attention_lora import FOLD_LORA_MAX_TOKENS
from moelora.layers.moe import DenseMLP, SparseMoE
from moelora.step.batch import ForwardBatch
from moelora.step.lora import LoraWeights


def folded_mlp(mlp: DenseMLP | SparseMoE) -> DenseMLP | None:
    """The SwiGLU whose LoRA may fold: a dense MLP itself, a MoE's shared expert once its
    inputs are fused (SparseMoE.fuse_inputs), else None."""
    if isinstance(mlp, DenseMLP):
        return mlp
    if mlp.shared_expert is None or mlp.w_in is None:
        return None
    return mlp.shared_expert


def mlp_shrink(
    mlp: DenseMLP | SparseMoE, batch: ForwardBatch, num_tokens: int
) -> LoraWeights | None:
    """gate_up_proj's LoRA, for the post-attention norm to shrink, where this step folds the
    MLP's LoRA (the module docstring); None where it does not."""
    swiglu = folded_mlp(mlp)
    if swiglu is None or batch.lora is None or num_tokens > FOLD_LORA_MAX_TOKENS:
        return None
    gate_up, down = swiglu.gate_up_proj.lora, swiglu.down_proj.lora
    if gate_up is None or down is None or swiglu.ops.shard.size > 1 or swiglu.ops.deterministic:
        return None
    return gate_up
