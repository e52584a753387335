"""Gated DeltaNet, the linear attention of Qwen3-Next and Qwen3.5 (ModelConfig.linear_attention),
over each request's recurrent state (engine/state_cache.py) in place of the paged KV.

Legend: T = tokens, D = hidden, Hk = q/k heads, H = value heads, K = key head dim, V = value
head dim, C = conv channels (2 Hk K + H V).

  in_proj:  hidden -> q|k|v [C], z [H V], b [H], a [H]: the checkpoint's input projections
            fused, each its own slice and LoRA (Qwen3-Next: in_proj_qkvz, in_proj_ba, each key
            head's q, k, v, z and b, a side by side; Qwen3.5: in_proj_qkv, in_proj_z,
            in_proj_b, in_proj_a)
  conv:     causal, W taps per channel, then silu, over the request's conv window
  delta:    beta = sigmoid(b), g = -exp(A_log) softplus(a + dt_bias), q and k L2-normed:
            the gated delta rule over the request's state
  norm:     rmsnorm(out) * weight * silu(z) per value head
  out_proj: [H V] -> hidden

Every projection takes its LoRA: each slice of in_proj, and out_proj.
"""

from __future__ import annotations

import torch
from torch import nn

from moelora.config import LinearAttentionConfig, ModelConfig
from moelora.kernels.gated_delta import DeltaGates
from moelora.kernels.ops import Ops
from moelora.layers.linear import LoraLinear
from moelora.step.batch import ForwardBatch
from moelora.step.lora import FoldedLora


class GatedRMSNorm(nn.Module):
    """rmsnorm(x) * weight * silu(gate) over each value head (ops.rms_norm_gated)."""

    def __init__(self, size: int, eps: float, ops: Ops, *, dtype: torch.dtype, device):
        super().__init__()
        self.weight = nn.Parameter(
            torch.ones(size, dtype=dtype, device=device), requires_grad=False
        )
        self.eps, self.ops = eps, ops

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return self.ops.rms_norm_gated(x, gate, self.weight, self.eps)


class GatedDeltaNet(nn.Module):
    def __init__(self, cfg: ModelConfig, ops: Ops, *, dtype: torch.dtype, device: torch.device):
        super().__init__()
        assert cfg.linear_attention is not None and ops.shard.size == 1, "one rank (model.py)"
        la = self.la = cfg.linear_attention
        self.ops = ops
        kw = dict(dtype=dtype, device=device)
        H = la.num_v_heads
        slices = (la.conv_dim + la.value_dim, 2 * H)
        if not la.grouped_projections:
            slices = (la.conv_dim, la.value_dim, H, H)
        self.in_proj = LoraLinear(cfg.hidden_size, slices, ops, **kw)
        # the checkpoint's shapes: conv1d.weight [C, 1, W]
        self.conv1d = nn.Parameter(
            torch.empty(la.conv_dim, 1, la.conv_kernel, **kw), requires_grad=False
        )
        self.dt_bias = nn.Parameter(torch.empty(H, **kw), requires_grad=False)
        self.A_log = nn.Parameter(torch.empty(H, **kw), requires_grad=False)
        self.norm = GatedRMSNorm(la.head_v_dim, cfg.rms_norm_eps, ops, **kw)
        self.out_proj = LoraLinear(la.value_dim, (cfg.hidden_size,), ops, **kw)

    def lora_linears(self) -> dict[str, LoraLinear]:
        """The projections that take LoRA, by their target's name (lora/slots.py)."""
        return {"in_proj": self.in_proj, "out_proj": self.out_proj}

    def forward(
        self, x: torch.Tensor, batch: ForwardBatch, state: tuple[torch.Tensor, torch.Tensor]
    ) -> torch.Tensor:
        """out_proj's output [T, D]; state: (conv windows [S, C, W - 1], delta-rule states
        [S, H, K, V] float32) of every slot, this step's sequences' read and written."""
        out, z = self._mix(x, batch, state)
        out = self.norm(out, z)  # [T, H, V]
        return self.out_proj(out.reshape(x.shape[0], self.la.value_dim), batch.lora)

    def forward_folded(
        self, x: torch.Tensor, batch: ForwardBatch, state: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, FoldedLora]:
        """forward with out_proj's LoRA folded (layers/attention_lora.py): (out_proj's base
        output, its LoRA shrunk in the gated norm's launch, which the norm after expands)."""
        out, z = self._mix(x, batch, state)
        norm, lora = self.norm, self.out_proj.lora
        out, o = self.ops.rms_norm_gated_o_shrink(out, z, norm.weight, norm.eps, lora, batch.lora)
        return self.out_proj(out.reshape(x.shape[0], self.la.value_dim), None), o

    def _mix(
        self, x: torch.Tensor, batch: ForwardBatch, state: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the delta rule's output [T, H, V], in_proj's z slice viewed [T, H, V]): the layer up
        to its gated norm."""
        la, T, lora = self.la, x.shape[0], batch.lora
        conv_state, delta_state = state
        qkv, z, b, a = self._split(self.in_proj(x, lora))
        qkv = self.ops.causal_conv1d(qkv, self.conv1d[:, 0], conv_state, batch.attn)
        q, k, v = qkv.split([la.key_dim, la.key_dim, la.value_dim], dim=-1)
        out = self.ops.gated_delta_rule(
            q.reshape(T, la.num_k_heads, la.head_k_dim),
            k.reshape(T, la.num_k_heads, la.head_k_dim),
            v.reshape(T, la.num_v_heads, la.head_v_dim),
            None,
            None,
            delta_state,
            batch.attn,
            # g and beta computed where the rule reads them (no launch of their own)
            gates=DeltaGates(a, b, self.A_log, self.dt_bias),
        )  # [T, H, V]
        return out, z.view(T, la.num_v_heads, la.head_v_dim)

    def _split(
        self, y: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(q|k|v [T, C], z [T, H V], b [T, H], a [T, H]) of in_proj's output."""
        if not self.la.grouped_projections:
            return y.split(self.in_proj.out_slices, dim=-1)
        return _ungrouped(self.la, *y.split(self.in_proj.out_slices, dim=-1))


def _ungrouped(
    la: LinearAttentionConfig, qkvz: torch.Tensor, ba: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Qwen3-Next's grouped in_proj_qkvz [T, Hk (2K + 2 r V)] and in_proj_ba [T, Hk 2r]
    (r = H / Hk: each key head's q, k, its r value heads' v and z; b and a alike) -> q|k|v
    [T, C] (all q heads, all k heads, all v heads), z [T, H V], b, a [T, H]."""
    T, Hk, K, V = qkvz.shape[0], la.num_k_heads, la.head_k_dim, la.head_v_dim
    r = la.num_v_heads // Hk
    q, k, v, z = qkvz.view(T, Hk, -1).split([K, K, r * V, r * V], dim=-1)
    b, a = ba.view(T, Hk, 2 * r).split([r, r], dim=-1)
    qkv = torch.cat([q.reshape(T, -1), k.reshape(T, -1), v.reshape(T, -1)], dim=-1)
    return qkv, z.reshape(T, -1), b.reshape(T, -1), a.reshape(T, -1)
