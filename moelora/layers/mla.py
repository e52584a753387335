"""DeepSeek's multi-head latent attention (ModelConfig.mla) over the paged latent cache.

Legend: T = tokens, H = hidden, Hh = heads, N = qk_nope_head_dim, R = qk_rope_head_dim,
V = v_head_dim, L = kv_lora_rank, Q = q_lora_rank.

  qkv_proj: hidden -> q_a_proj's output [Q] (or q_proj's [Hh (N + R)]) | kv_a_proj_with_mqa's
            [L + R]: the two projections that read the hidden state, fused (each its own LoRA)
  q:        q_b_proj(q_a_layernorm(.)) -> [Hh, N + R]: q_nope | q_pe
  kv:       kv_a_layernorm(latent [L]), k_pe [R]: rotated and stored in the cache, 1 "head"
            (the latent's norm inside the rotary's launch: rope_store_kv(v_norm=))
  attention with kv_b_proj [Hh (N + V), L] and its LoRA inside (ops.mla_attention); in a
            prefill step also kv_b_proj of latents, the expanded keys and values that prompts'
            first chunks (and, eager, long extends) attend to (kernels/mla.py)
  o_proj:   [Hh V] -> hidden

Every projection takes its LoRA: q_a_proj and kv_a_proj_with_mqa as the slices of qkv_proj,
q_b_proj (or q_proj), kv_b_proj (inside the attention), o_proj.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from moelora.config import MlaConfig, ModelConfig
from moelora.kernels.mla import ExpandedKv
from moelora.kernels.ops import Ops
from moelora.layers.linear import LoraLinear
from moelora.layers.norm import RMSNorm
from moelora.layers.rotary import RotaryEmbedding
from moelora.step.batch import AttentionMetadata, ForwardBatch
from moelora.step.lora import FoldedLora, LoraBatchInfo, LoraWeights

# transformers builds q_a_layernorm and kv_a_layernorm with its RMSNorm's default eps, not the
# config's rms_norm_eps
_LATENT_NORM_EPS = 1e-6


class MlaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, ops: Ops, **kw):
        super().__init__()
        assert cfg.mla is not None and ops.shard.size == 1, "MLA runs on one rank (model.py)"
        mla, H, Hh = cfg.mla, cfg.hidden_size, cfg.num_heads
        self.cfg, self.mla, self.rotary, self.ops = cfg, mla, rotary, ops
        q_size = mla.q_lora_rank or Hh * mla.qk_head_dim
        fp8 = cfg.projections_fp8  # all but kv_b_proj, which the absorption reads whole
        self.qkv_proj = LoraLinear(H, (q_size, mla.cache_size), ops, fp8=fp8, **kw)
        self.q_a_layernorm = self.q_b_proj = None
        if mla.q_lora_rank:
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, _LATENT_NORM_EPS, ops, **kw)
            q_b = (Hh * mla.qk_head_dim,)
            self.q_b_proj = LoraLinear(mla.q_lora_rank, q_b, ops, fp8=fp8, **kw)
        self.kv_a_layernorm = RMSNorm(mla.kv_lora_rank, _LATENT_NORM_EPS, ops, **kw)
        kv_b_size = Hh * (mla.qk_nope_head_dim + mla.v_head_dim)
        # read by the attention whole (its weight, and its LoRA's slot buffers) in the latent
        # form; called on the step's latents for the expanded form
        self.kv_b_proj = LoraLinear(mla.kv_lora_rank, (kv_b_size,), ops, **kw)
        self.o_proj = LoraLinear(Hh * mla.v_head_dim, (H,), ops, fp8=fp8, **kw)

    def lora_linears(self) -> dict[str, LoraLinear]:
        """The projections that take LoRA, by their target's name (lora/slots.py)."""
        linears = {"qkv": self.qkv_proj, "kv_b": self.kv_b_proj, "o": self.o_proj}
        if self.q_b_proj is not None:
            linears["q_b"] = self.q_b_proj
        return linears

    def forward(
        self, x: torch.Tensor, batch: ForwardBatch, kv_cache: tuple[torch.Tensor, torch.Tensor]
    ) -> torch.Tensor:
        """o_proj's output [T, H]; kv_cache: (latent [P, page_size, 1, L], rotary key
        [P, page_size, 1, R]), where this step's tokens are stored first."""
        out = self._attend(x, batch, kv_cache)
        return self.o_proj(out.reshape(x.shape[0], -1), batch.lora)

    def forward_folded(
        self, x: torch.Tensor, batch: ForwardBatch, kv_cache: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, FoldedLora]:
        """forward with o_proj's LoRA folded (layers/attention_lora.py): (o_proj's base output,
        its LoRA shrunk inside the attention's last launch, which the norm after expands)."""
        out, o = self._attend(x, batch, kv_cache, o_lora=self.o_proj.lora)
        return self.o_proj(out.reshape(x.shape[0], -1), None), o

    def _attend(
        self,
        x: torch.Tensor,
        batch: ForwardBatch,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        *,
        o_lora: LoraWeights | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, FoldedLora]:
        """The attention's output [T, Hh, V] (o_proj's input); with o_lora, and o_lora's shrink
        of it (ops.mla_attention_o_shrink)."""
        mla, T, lora = self.mla, x.shape[0], batch.lora
        q, kv = self.qkv_proj(x, lora).split(self.qkv_proj.out_slices, dim=-1)
        if self.q_b_proj is not None:
            q = self.q_b_proj(self.q_a_layernorm(q)[0], lora)
        q_nope, q_pe = q.view(T, -1, mla.qk_head_dim).split(
            [mla.qk_nope_head_dim, mla.qk_rope_head_dim], dim=-1
        )
        latent, k_pe = kv.split([mla.kv_lora_rank, mla.qk_rope_head_dim], dim=-1)
        latent_cache, rope_cache = kv_cache
        # the rotary key and the latent stored as one head's k and v (in the same launch),
        # the latent first normed by kv_a_layernorm there, in place (latent holds it after)
        q_pe, k_pe = self.ops.rope_store_kv(
            q_pe,
            k_pe.view(T, 1, -1),
            batch.positions,
            self.rotary.cos,
            self.rotary.sin,
            None,
            None,
            _LATENT_NORM_EPS,  # no q/k norm: the latent's
            v=latent.view(T, 1, -1),
            v_norm=self.kv_a_layernorm.weight,
            k_cache=rope_cache,
            v_cache=latent_cache,
            slot_mapping=batch.attn.slot_mapping,
            # DeepSeek's adjacent rotary pairs made halves, which the rotate-half tables rotate
            # as transformers does (q and k alike: their dot products are unchanged)
            interleaved=mla.rope_interleave,
        )
        expanded = None
        if batch.attn.max_query_len > 1 and self.ops.mla_expanded_prefill:
            expanded = self._expanded(latent, k_pe.view(T, -1), kv_cache, batch)
        args = (q_nope, q_pe, latent_cache, rope_cache, batch.attn, self.kv_b_proj.weight)
        kv_b_lora = self.kv_b_proj.lora if lora is not None else None
        if o_lora is not None:
            return self.ops.mla_attention_o_shrink(
                *args,
                mla.softmax_scale,
                lora=kv_b_lora,
                info=lora,
                o_lora=o_lora,
                expanded=expanded,
            )
        return self.ops.mla_attention(
            *args, mla.softmax_scale, lora=kv_b_lora, info=lora, expanded=expanded
        )

    def _expanded(
        self,
        latent: torch.Tensor,
        k_pe: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        batch: ForwardBatch,
    ) -> ExpandedKv:
        """A prefill step's keys and values in the expanded form (kernels/mla.py): its own rows'
        (its prompts' first chunks attend to them), or, in an eager step with an extend worth
        expanding (expands), every expanded sequence's whole KV, its prefix read back from the
        cache."""
        attn, lora = batch.attn, batch.lora
        chunks = attn.chunks or ()
        extends = [start > 0 and expands(start, n, self.mla) for start, n in chunks]
        if not any(extends):
            every = bool(chunks) and all(start == 0 for start, _ in chunks)
            return self._expand(latent, k_pe, lora, attn.cu_seqlens_q, every)
        assert len(chunks) == attn.page_table.shape[0], (len(chunks), attn.page_table.shape)
        rows = _whole_kv_rows(latent, k_pe, kv_cache, attn, lora, extends)
        every = all(start == 0 or on for (start, _), on in zip(chunks, extends, strict=True))
        return self._expand(*rows, every)

    def _expand(
        self,
        latent: torch.Tensor,
        k_pe: torch.Tensor,
        lora: LoraBatchInfo | None,
        cu_seqlens_k: torch.Tensor,
        every: bool,
    ) -> ExpandedKv:
        """kv_b_proj (with its LoRA) of latent [K, L], split per head, beside k_pe [K, R]."""
        mla = self.mla
        kv = self.kv_b_proj(latent, lora).view(
            latent.shape[0], -1, mla.qk_nope_head_dim + mla.v_head_dim
        )
        k_nope, v = kv.split([mla.qk_nope_head_dim, mla.v_head_dim], dim=-1)
        return ExpandedKv(k_nope, k_pe, v, cu_seqlens_k, every)


def expands(prefix: int, tokens: int, mla: MlaConfig) -> bool:
    """Whether a chunk of `tokens` after `prefix` cached ones costs less in the expanded form
    (kv_b_proj over all prefix + tokens latents, then (N + R)- and V-wide products) than in the
    latent form ((L + R)- and L-wide products, and the queries' absorption), counted in
    multiply-adds a head."""
    L, N, V = mla.kv_lora_rank, mla.qk_nope_head_dim, mla.v_head_dim
    R = mla.qk_rope_head_dim
    pairs = tokens * prefix + tokens * (tokens + 1) // 2
    expanded = (prefix + tokens) * L * (N + V) + pairs * (N + R + V)
    latent = pairs * (2 * L + R) + tokens * (N + V) * L
    return expanded < latent


def _whole_kv_rows(
    latent: torch.Tensor,
    k_pe: torch.Tensor,
    kv_cache: tuple[torch.Tensor, torch.Tensor],
    attn: AttentionMetadata,
    lora: LoraBatchInfo | None,
    extends: list[bool],
) -> tuple[torch.Tensor, torch.Tensor, LoraBatchInfo | None, torch.Tensor]:
    """(latents [K, L], rotary keys [K, R], the LoRA info of those rows, cu_seqlens_k [B + 1])
    of every sequence whose chunk starts at 0 (its rows) or that extends (its prefix from the
    cache, then its rows), in sequence order; the others get no rows. An eager step's: the
    chunks are read on the host."""
    latent_cache, rope_cache = (c.flatten(0, 1)[:, 0] for c in kv_cache)
    page_size = kv_cache[0].shape[1]
    latents, keys, slots, kv_lens, row = [], [], [], [0], 0
    for b, ((start, n), extend) in enumerate(zip(attn.chunks, extends, strict=True)):
        on = n > 0 and (start == 0 or extend)
        kv_lens.append(kv_lens[-1] + (start + n if on else 0))
        if on:
            pos = torch.arange(start, device=latent.device)
            cached = attn.page_table[b].long()[pos // page_size] * page_size + pos % page_size
            latents += [latent_cache[cached].to(latent.dtype), latent[row : row + n]]
            keys += [rope_cache[cached].to(k_pe.dtype), k_pe[row : row + n]]
            if lora is not None:  # the prefix's rows take the sequence's slot
                slot = lora.slot_of_token[row : row + n]
                slots += [slot[:1].expand(start), slot]
        row += n
    info = None if lora is None else dataclasses.replace(lora, slot_of_token=torch.cat(slots))
    cu = torch.tensor(kv_lens, dtype=torch.int32)
    if latent.is_cuda:  # pinned, so that the copy waits for nothing queued before it
        cu = cu.pin_memory().to(latent.device, non_blocking=True)
    return torch.cat(latents), torch.cat(keys), info, cu
