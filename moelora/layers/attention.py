"""Self-attention over the paged KV cache: fused qkv (+LoRA), q/k norm, rotary, GQA, o (+LoRA).

Legend: T = tokens, Hq/Hkv = query/kv heads, D = head dim.
"""

from __future__ import annotations

import torch
from torch import nn

from moelora.config import ModelConfig
from moelora.kernels.ops import Ops
from moelora.layers.linear import LoraLinear
from moelora.layers.norm import RMSNorm
from moelora.layers.rotary import RotaryEmbedding
from moelora.step.batch import ForwardBatch

# Up to this many tokens in a step, the attention's LoRA is folded into the kernels around it:
# q|k|v's shrink into the input RMSNorm and its expand into rotary; o's shrink comes out of the
# attention (paged_attention_lora: in the combine of a split decode, else one split launch)
# and its expand rides in the post-attention RMSNorm. Each row reads its slot's A and B once,
# spread over programs (one program per row reading a whole A is bound by its load latency:
# 18 µs per norm at one token on an H200). A base-only batch pays a few scalar loads, and one
# launch when the decode is not split. Longer steps (big prefill chunks) take add_lora_, whose
# 16-row tiles share each tile of A.
FOLD_LORA_MAX_TOKENS = 256


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, ops: Ops, **kw):
        super().__init__()
        self.cfg = cfg
        self.rotary = rotary
        self.ops = ops
        self.scale = cfg.head_dim**-0.5
        slices = (cfg.q_size, cfg.kv_size, cfg.kv_size)
        self.qkv_proj = LoraLinear(cfg.hidden_size, slices, ops, bias=cfg.qkv_bias, **kw)
        self.o_proj = LoraLinear(cfg.q_size, (cfg.hidden_size,), ops, **kw)
        eps = cfg.rms_norm_eps
        if cfg.qk_norm == "head":
            self.q_norm = RMSNorm(cfg.head_dim, eps, ops, **kw)
            self.k_norm = RMSNorm(cfg.head_dim, eps, ops, **kw)
        elif cfg.qk_norm == "full":
            self.q_norm = RMSNorm(cfg.q_size, eps, ops, **kw)
            self.k_norm = RMSNorm(cfg.kv_size, eps, ops, **kw)

    def folds_lora(self, batch: ForwardBatch, num_tokens: int) -> bool:
        """Whether this step's LoRA is folded into the norms and rotary (see forward). Not with
        a full-width q/k norm or clip_qkv, which come between q|k|v and rotary, nor with a
        head dim that is not a power of two (rotary's LoRA swaps the halves of a head)."""
        return (
            batch.lora is not None
            and self.qkv_proj.lora is not None
            and self.o_proj.lora is not None
            and self.cfg.qk_norm != "full"
            and self.cfg.clip_qkv is None
            and self.cfg.head_dim & (self.cfg.head_dim - 1) == 0
            and num_tokens <= FOLD_LORA_MAX_TOKENS
        )

    def forward(
        self,
        x: torch.Tensor,
        batch: ForwardBatch,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        qkv_shrunk: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(o_proj's output, the split shrink of its LoRA or None). With qkv_shrunk
        (folds_lora: the norm before took the q|k|v LoRA's shrink), rotary adds the q|k|v LoRA
        and the o LoRA's expand is left to the norm after; otherwise both projections add
        their own LoRA and the second value is None."""
        cfg = self.cfg
        T = x.shape[0]
        folded = qkv_shrunk is not None
        qkv = self.qkv_proj(x, None if folded else batch.lora)  # [T, (Hq + 2 Hkv) D]
        q, k, v = qkv.split([cfg.q_size, cfg.kv_size, cfg.kv_size], dim=-1)
        if cfg.qk_norm == "full":
            q, k = self.q_norm(q)[0], self.k_norm(k)[0]
        if cfg.clip_qkv is not None:
            q, k, v = (t.clamp(-cfg.clip_qkv, cfg.clip_qkv) for t in (q, k, v))
        per_head = cfg.qk_norm == "head"
        k_cache, v_cache = kv_cache
        # the rotary launch also stores k and v in the cache: one launch fewer per layer
        q, k = self.ops.rope_qk(
            q.view(T, cfg.num_heads, cfg.head_dim),
            k.view(T, cfg.num_kv_heads, cfg.head_dim),
            batch.positions,
            self.rotary.cos,
            self.rotary.sin,
            self.q_norm.weight if per_head else None,
            self.k_norm.weight if per_head else None,
            cfg.rms_norm_eps,
            v=v.view(T, cfg.num_kv_heads, cfg.head_dim),
            k_cache=k_cache,
            v_cache=v_cache,
            slot_mapping=batch.attn.slot_mapping,
            lora=(qkv_shrunk, self.qkv_proj.lora, batch.lora) if folded else None,
        )
        if not folded:
            out = self.ops.paged_attention(q, k_cache, v_cache, batch.attn, self.scale)
            return self.o_proj(out.reshape(T, cfg.q_size), batch.lora), None
        out, o_shrunk = self.ops.paged_attention_lora(
            q, k_cache, v_cache, batch.attn, self.scale, self.o_proj.lora, batch.lora
        )
        return self.o_proj(out.reshape(T, cfg.q_size), None), o_shrunk
