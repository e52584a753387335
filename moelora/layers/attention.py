"""Self-attention over the paged KV cache: fused qkv (+LoRA), q/k norm, rotary, GQA, o (+LoRA).

Legend: T = tokens, Hq/Hkv = query/kv heads, D = head dim.

With tensor parallelism (ops.shard) each rank holds its query heads and their KV heads (one
replicated KV head when there are fewer than ranks): q/k/v are column-parallel, o is
row-parallel, and o's partial outputs, its LoRA's partial expand included, are all-reduced once.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from moelora.config import ModelConfig
from moelora.kernels.ops import Ops
from moelora.layers.linear import LoraLinear
from moelora.layers.norm import RMSNorm
from moelora.layers.rotary import RotaryEmbedding
from moelora.step.batch import ForwardBatch
from moelora.step.lora import FoldedLora


class Attention(nn.Module):
    def __init__(
        self, cfg: ModelConfig, rotary: RotaryEmbedding, ops: Ops, *, sliding: bool = False, **kw
    ):
        super().__init__()
        shard = ops.shard
        self.kv_replicas = shard.kv_replicas(cfg.num_kv_heads)  # ranks holding each KV head
        # this rank's heads: every size below (projections, views, cache) is the local one
        cfg = dataclasses.replace(
            cfg,
            num_heads=shard.heads(cfg.num_heads),
            num_kv_heads=shard.kv_heads(cfg.num_kv_heads),
        )
        self.cfg = cfg
        self.rotary = rotary
        self.ops = ops
        self.scale = cfg.head_dim**-0.5
        self.window = cfg.sliding_window if sliding else 0  # 0: the whole causal range
        # attn_output_gate: q_proj gives each head's query, then its output gate (Qwen3-Next)
        self.output_gate = cfg.attn_output_gate
        slices = (cfg.q_size * (2 if self.output_gate else 1), cfg.kv_size, cfg.kv_size)
        fp8 = cfg.projections_fp8
        self.qkv_proj = LoraLinear(cfg.hidden_size, slices, ops, bias=cfg.qkv_bias, fp8=fp8, **kw)
        self.o_proj = LoraLinear(
            cfg.q_size, (cfg.hidden_size,), ops, bias=cfg.o_bias, fp8=fp8, **kw
        )
        self.sinks = None
        if cfg.attention_sinks:
            # float32 whatever the model's dtype: they join the softmax's float32 sums
            sinks = torch.zeros(cfg.num_heads, dtype=torch.float32, device=kw["device"])
            self.sinks = nn.Parameter(sinks, requires_grad=False)
        eps = cfg.rms_norm_eps
        if cfg.qk_norm == "head":
            self.q_norm = RMSNorm(cfg.head_dim, eps, ops, **kw)
            self.k_norm = RMSNorm(cfg.head_dim, eps, ops, **kw)
        elif cfg.qk_norm == "full":
            self.q_norm = RMSNorm(cfg.q_size, eps, ops, **kw)
            self.k_norm = RMSNorm(cfg.kv_size, eps, ops, **kw)

    def lora_linears(self) -> dict[str, LoraLinear]:
        """The projections that take LoRA, by their target's name (lora/slots.py)."""
        return {"qkv": self.qkv_proj, "o": self.o_proj}

    def forward(
        self, x: torch.Tensor, batch: ForwardBatch, kv_cache: tuple[torch.Tensor, torch.Tensor]
    ) -> torch.Tensor:
        """o_proj's output; each projection adds its own LoRA."""
        T = x.shape[0]
        *qkv, gate = self._split(self.qkv_proj(x, batch.lora))
        q = self._rope_store_kv(*qkv, batch, kv_cache)
        k_cache, v_cache = kv_cache
        out = self.ops.paged_attention(
            q, k_cache, v_cache, batch.attn, self.scale, window=self.window, sinks=self.sinks
        )  # [T, Hq, D]
        if gate is not None:
            out = self.ops.output_gate(out, gate)
        return self.ops.shard.all_reduce(self.o_proj(out.reshape(T, self.cfg.q_size), batch.lora))

    def _split(
        self, qkv: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(q [T, Hq D], k, v [T, Hkv D], None) of qkv_proj's output, as views; with
        attn_output_gate its q slice holds each head's query [D] then its gate [D], so q and
        the gate come as strided views [T, Hq, D]."""
        cfg, T = self.cfg, qkv.shape[0]
        if not self.output_gate:
            return *qkv.split([cfg.q_size, cfg.kv_size, cfg.kv_size], dim=-1), None
        q_gate, k, v = qkv.split([2 * cfg.q_size, cfg.kv_size, cfg.kv_size], dim=-1)
        q, gate = q_gate.view(T, cfg.num_heads, 2, cfg.head_dim).unbind(dim=2)
        return q, k, v, gate

    def forward_folded(
        self,
        x: torch.Tensor,
        batch: ForwardBatch,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        qkv: FoldedLora,
    ) -> tuple[torch.Tensor, FoldedLora]:
        """forward with the LoRA folded (layers/attention_lora.py): qkv is q|k|v's LoRA that
        the norm before shrank, which rotary expands. Returns (o_proj's base output, o's LoRA
        shrunk from the attention's output, which the norm after expands)."""
        T = x.shape[0]
        q, k, v, gate = self._split(self.qkv_proj(x, None))
        assert gate is None, "an output gate is not folded (layers/attention_lora.py)"
        q = self._rope_store_kv(q, k, v, batch, kv_cache, expand=qkv)
        k_cache, v_cache = kv_cache
        out, o = self.ops.paged_attention_o_shrink(
            q,
            k_cache,
            v_cache,
            batch.attn,
            self.scale,
            self.o_proj.lora,
            batch.lora,
            window=self.window,
            sinks=self.sinks,
        )
        return self.o_proj(out.reshape(T, self.cfg.q_size), None), o

    def _rope_store_kv(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        batch: ForwardBatch,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        *,
        expand: FoldedLora | None = None,
    ) -> torch.Tensor:
        """q [T, Hq, D] normed and rotated, from q [T, Hq D] (or its heads' strided view); k
        [T, Hkv D] normed, rotated and stored in the cache with v, all in one launch."""
        cfg = self.cfg
        T = q.shape[0]
        if cfg.qk_norm == "full":
            q = self._full_norm(self.q_norm, q.reshape(T, cfg.q_size), 1)
            k = self._full_norm(self.k_norm, k, self.kv_replicas)
        if cfg.clip_qkv is not None:
            q, k, v = (t.clamp(-cfg.clip_qkv, cfg.clip_qkv) for t in (q, k, v))
        per_head = cfg.qk_norm == "head"
        q = q.view(T, cfg.num_heads, cfg.head_dim)
        k = k.view(T, cfg.num_kv_heads, cfg.head_dim)
        q_norm = self.q_norm.weight if per_head else None
        k_norm = self.k_norm.weight if per_head else None
        k_cache, v_cache = kv_cache
        q, _ = self.ops.rope_store_kv(
            q,
            k,
            batch.positions,
            self.rotary.cos,
            self.rotary.sin,
            q_norm,
            k_norm,
            cfg.rms_norm_eps,
            v=v.view(T, cfg.num_kv_heads, cfg.head_dim),
            k_cache=k_cache,
            v_cache=v_cache,
            slot_mapping=batch.attn.slot_mapping,
            expand=expand,
            # partial rotary: q and k in the order the tables expect (the dot products of q and
            # k, and so the attention, do not see the order)
            rotary_dim=cfg.rotary_dim,
        )
        return q

    def _full_norm(self, norm: RMSNorm, x: torch.Tensor, replicas: int) -> torch.Tensor:
        """The q (or k) RMSNorm over all heads when the heads are spread over the ranks: the
        sum of squares is all-reduced, a head that `replicas` ranks hold counted once."""
        shard = self.ops.shard
        if shard.size == 1:
            return norm(x)[0]
        h = x.float()
        total = shard.all_reduce(h.pow(2).sum(-1, keepdim=True)) / replicas
        width = x.shape[-1] * shard.size // replicas
        h = h * torch.rsqrt(total / width + norm.eps)
        return norm.weight * h.to(x.dtype)
