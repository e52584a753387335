"""The decoder layer every supported architecture shares: attention, then the MLP or MoE."""

from __future__ import annotations

import torch
from torch import nn

from moelora.config import ModelConfig
from moelora.kernels.ops import Ops
from moelora.layers.attention import Attention
from moelora.layers.attention_lora import folded_attention, folds_lora, folds_o_lora
from moelora.layers.linear_attention import GatedDeltaNet
from moelora.layers.mla import MlaAttention
from moelora.layers.mlp_lora import mlp_shrink
from moelora.layers.moe import DenseMLP, SparseMoE
from moelora.layers.norm import Joined, RMSNorm
from moelora.layers.rotary import RotaryEmbedding
from moelora.step.batch import ForwardBatch
from moelora.step.lora import FoldedLora, LoraWeights


class DecoderLayer(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        rotary: RotaryEmbedding,
        ops: Ops,
        *,
        sparse: bool,
        sliding: bool,
        linear: bool = False,
        **kw,
    ):
        """linear: the token mixer is gated DeltaNet (its cache: the recurrent states)."""
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops, **kw)
        self.self_attn: Attention | MlaAttention | GatedDeltaNet
        if linear:
            self.self_attn = GatedDeltaNet(cfg, ops, **kw)
        elif cfg.mla is not None:
            self.self_attn = MlaAttention(cfg, rotary, ops, **kw)
        else:
            self.self_attn = Attention(cfg, rotary, ops, sliding=sliding, **kw)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops, **kw)
        if sparse:
            self.mlp = SparseMoE(cfg, ops, **kw)
        else:
            self.mlp = DenseMLP(cfg.hidden_size, cfg.intermediate_size, ops, **kw)

    def forward(
        self,
        x: torch.Tensor | Joined,
        residual: torch.Tensor | None,
        batch: ForwardBatch,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
    ) -> tuple[torch.Tensor | Joined, torch.Tensor]:
        """(this layer's MLP output, the residual stream before it); the caller adds the two,
        inside the next norm, so every add shares a kernel with a norm. The MoE's output may
        come as its top-k rows [T, K, H], or those and its shared expert's (Joined): the next
        norm adds those too."""
        attn, T = self.self_attn, batch.positions.shape[0]
        # the MLP's LoRA folds into the norms on either side and its SwiGLU (layers/mlp_lora.py)
        shrink = mlp_shrink(self.mlp, batch, T)
        if isinstance(attn, Attention):
            folds = folds_lora(attn, batch, T)
        else:
            folds = folds_o_lora(attn, batch, T)
        if folds:
            # the attention's LoRA rides in the norms on either side of it and in rotary (MLA's
            # and gated DeltaNet's: the output projection's only, in the launch before it)
            h, residual, gate_up = folded_attention(self, x, residual, batch, kv_cache, shrink)
        else:
            h, residual = self.input_layernorm(x, residual)
            h = self.self_attn(h, batch, kv_cache)
            h, residual, gate_up = self._post_attention_norm(h, residual, batch, shrink)
        return self.mlp(h, batch, gate_up), residual

    def _post_attention_norm(
        self,
        h: torch.Tensor,
        residual: torch.Tensor,
        batch: ForwardBatch,
        shrink: LoraWeights | None,
    ) -> tuple[torch.Tensor, torch.Tensor, FoldedLora | None]:
        """The post-attention norm, shrinking the MLP's first LoRA where it folds."""
        norm = self.post_attention_layernorm
        if shrink is None:
            return *norm(h, residual), None
        return norm.with_lora(h, residual, batch.lora, shrink=shrink)
