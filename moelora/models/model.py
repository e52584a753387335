"""MoeCausalLM: the one model class every supported architecture builds (embedding, the shared
decoder layers, final norm, lm_head). Architecture files in this package only read configs.

With tensor parallelism (ops.shard) the embedding and the lm_head are vocab-parallel: each rank
holds ceil(V / N) rows (the last rank's tail zero), the lookup is all-reduced and the logits are
gathered on rank 0."""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from moelora.config import ModelConfig
from moelora.errors import ModelConfigError
from moelora.kernels.ops import Ops
from moelora.layers.decoder import DecoderLayer
from moelora.layers.norm import RMSNorm
from moelora.layers.rotary import RotaryEmbedding
from moelora.step.batch import ForwardBatch


class MoeCausalLM(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        hf_config,
        max_len: int,
        ops: Ops,
        *,
        dtype: torch.dtype,
        device: torch.device,
    ):
        super().__init__()
        check_kernels(cfg, ops)
        self.cfg = cfg
        kw = dict(dtype=dtype, device=device)
        self.shard = ops.shard
        self.ops = ops
        rows = self.shard.vocab(cfg.vocab_size)
        rotary = RotaryEmbedding(hf_config, max_len, device=device)
        self.embed_tokens = nn.Parameter(
            torch.empty(rows, cfg.hidden_size, **kw), requires_grad=False
        )
        self.layers = nn.ModuleList(
            DecoderLayer(
                cfg, rotary, ops, sparse=sparse, sliding=sliding, linear=cfg.is_linear(i), **kw
            )
            for i, (sparse, sliding) in enumerate(zip(cfg.sparse_layers, cfg.sliding_layers))
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops, **kw)
        self.lm_head = (
            self.embed_tokens
            if cfg.tie_word_embeddings
            else nn.Parameter(torch.empty(rows, cfg.hidden_size, **kw), requires_grad=False)
        )

    def forward(
        self, batch: ForwardBatch, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
    ) -> torch.Tensor:
        """Returns the final hidden states [T, H] (normed). kv_caches: per layer its paged K
        and V, or a gated DeltaNet layer's recurrent states (engine/state_cache.py)."""
        heads = (self.shard.heads(self.cfg.num_heads), self.shard.kv_heads(self.cfg.num_kv_heads))
        attn = self.ops.plan_attention(
            batch.attn, batch.input_ids.shape[0], *heads, self.cfg.head_dim
        )
        if attn is not batch.attn:  # a prefill step's work table
            batch = dataclasses.replace(batch, attn=attn)
        x, residual = self.shard.embed(batch.input_ids, self.embed_tokens), None
        for layer, kv in zip(self.layers, kv_caches):
            x, residual = layer(x, residual, batch, kv)
        return self.norm(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """[N, V] float32 logits of hidden [N, H]; on a rank other than 0, None (its part went
        to rank 0)."""
        linear = self.ops.linear if self.ops.deterministic else F.linear  # Ops.deterministic
        return self.shard.gather_vocab(linear(hidden, self.lm_head).float(), self.cfg.vocab_size)


def check_kernels(cfg: ModelConfig, ops: Ops) -> None:
    """What the kernel table and the ranks cannot run yet. MLA, grouped routing, partial rotary
    and gated DeltaNet (the DeepSeek family, GLM-4.5, Qwen3-Next, Qwen3.5) run on one rank.
    On the Triton table every architecture runs: each engine passed the transformers+PEFT
    comparisons on a device (tests run with --moelora-device=cuda)."""
    needs = one_rank_only(cfg)
    if needs and ops.shard.size > 1:
        raise ModelConfigError(
            f"tensor_parallel_size={ops.shard.size} is not supported for {cfg.arch}: expected 1"
        )


def one_rank_only(cfg: ModelConfig) -> list[str]:
    """What of cfg runs on one rank only for now (tensor parallelism refuses it)."""
    parts = (
        ("multi-head latent attention", cfg.mla is not None),
        ("grouped routing", cfg.routing is not None),
        ("partial rotary", cfg.rotary_dim > 0),
        ("gated DeltaNet linear attention", cfg.linear_attention is not None),
    )
    return [what for what, used in parts if used]
