"""Gated DeltaNet's kernels (Qwen3-Next, Qwen3.5; layers/linear_attention.py): the short causal
conv over each request's window, the gated delta rule over each request's state, and the gated
RMSNorm. Torch references, the CPU path; the arithmetic is transformers' torch fallback's.
Their Triton kernels, the same contract: kernels/linear_attention/.

Legend: T = tokens, B = sequences, S = state slots (+1 spare), C = conv channels, W = conv
taps, Hk = q/k heads, H = value heads, K = key head dim, V = value head dim.

A request's recurrent state lives in fixed tensors indexed by its slot (attn.state_slots [B],
one per sequence): conv_state [S, C, W - 1] holds its last W - 1 conv inputs, state
[S, H, K, V] (float32) its delta-rule state. A sequence whose chunk starts at position 0 starts
from zeros, whatever its slot holds (a freed slot keeps its last owner's values). Each call
reads the slots of the step's sequences and writes their new states back in place; a step
whose chunks have one token each (decode) does so for all rows at once, by the slot tensor,
in the fixed shapes a CUDA graph can capture.

Delta rule, per value head, for each token t in order (g_t <= 0 the log decay, b_t in (0, 1)):
    S = exp(g_t) S;  S += k_t (b_t (v_t - k_t^T S))^T;  o_t = S^T q_t
with q and k L2-normed and q scaled by K ** -0.5. The references run it token by token, a
prefill chunk as a decode does: a request's numbers then depend neither on how its prompt was
chunked nor on its batch-mates, bit for bit. chunked_delta_rule is the block form a prefill
kernel takes (transformers' torch_chunk_gated_delta_rule, blocks of CHUNK tokens with a
triangular solve in each), equal to the token loop up to float rounding.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from moelora.kernels.reference import lora_shrink_split
from moelora.step.batch import AttentionMetadata
from moelora.step.lora import FoldedLora, LoraBatchInfo, LoraWeights

CHUNK = 64  # tokens per block of the chunked delta rule (transformers' and fla's)


class DeltaGates(NamedTuple):
    """What the delta rule's g and beta come from (delta_gates): in_proj's a and b slices
    [T, H] and the layer's A_log, dt_bias [H]. Given to gated_delta_rule in their place, they
    are computed where the rule reads them (no launch of their own)."""

    a: torch.Tensor
    b: torch.Tensor
    A_log: torch.Tensor
    dt_bias: torch.Tensor


_L2_EPS = 1e-6  # of the q/k L2 norm, as fla's kernels and transformers' fallback have it


def _sequences(attn: AttentionMetadata) -> list[tuple[int, int, int, bool]]:
    """(first row, tokens, state slot, starts from zeros) of each sequence; on the host."""
    assert attn.state_slots is not None, "a hybrid model's steps carry state slots"
    starts = attn.cu_seqlens_q.tolist()
    kv_lens, slots = attn.seq_lens.tolist(), attn.state_slots.tolist()
    return [
        (row, end - row, slot, kv_len == end - row)
        for row, end, kv_len, slot in zip(starts, starts[1:], kv_lens, slots)
    ]


def _from_zero(attn: AttentionMetadata) -> torch.Tensor:
    """[B] bool, on the device: the sequence's chunk starts at position 0."""
    q_lens = attn.cu_seqlens_q[1:] - attn.cu_seqlens_q[:-1]
    return attn.seq_lens == q_lens


def causal_conv1d(
    x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor, attn: AttentionMetadata
) -> torch.Tensor:
    """Semantics: per sequence, out[t] = silu(sum_j weight[:, j] * u[t + j]) over u = its
    window (zeros at position 0) followed by x's rows; the window becomes u's last W - 1.
    x: [T, C]; weight: [C, W]; conv_state: [S, C, W - 1], written in place. Returns [T, C]."""
    if attn.max_query_len == 1:
        return _conv_decode(x, weight, conv_state, attn)
    out = torch.empty_like(x)
    taps = weight.shape[1]
    for row, n, slot, fresh in _sequences(attn):
        window = conv_state[slot]
        if fresh:
            window = torch.zeros_like(window)
        u = torch.cat([window, x[row : row + n].T.to(window.dtype)], dim=-1)  # [C, W - 1 + n]
        conv_state[slot] = u[:, u.shape[1] - (taps - 1) :]
        out[row : row + n] = _conv_taps(u.unfold(-1, taps, 1).transpose(0, 1), weight, x.dtype)
    return out


def _conv_taps(u: torch.Tensor, weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """silu of each row's W taps [N, C, W] against weight [C, W] -> [N, C]: one formula for
    prefill and decode, so a token's value does not depend on its chunk."""
    return F.silu((u * weight).sum(-1)).to(dtype)


def _conv_decode(
    x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor, attn: AttentionMetadata
) -> torch.Tensor:
    """causal_conv1d of one token per sequence (row b is sequence b), every row at once."""
    slots = attn.state_slots.long()
    window = conv_state[slots]  # [B, C, W - 1]
    window = torch.where(_from_zero(attn)[:, None, None], torch.zeros_like(window), window)
    u = torch.cat([window, x[:, :, None].to(window.dtype)], dim=-1)  # [B, C, W]
    conv_state[slots] = u[:, :, 1:]
    return _conv_taps(u, weight, x.dtype)


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + _L2_EPS)


def gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None,
    beta: torch.Tensor | None,
    state: torch.Tensor,
    attn: AttentionMetadata,
    *,
    gates: DeltaGates | None = None,
) -> torch.Tensor:
    """Semantics: the delta rule above per sequence, from its slot's state (zeros at position
    0), the slot then holding the state after its last token. q, k: [T, Hk, K] (each serves
    H // Hk value heads, in order); v: [T, H, V]; g (log decay, float32), beta: [T, H], or
    both None and gates given: g, beta = delta_gates(*gates); state: [S, H, K, V] float32,
    written in place. Returns [T, H, V] in v's dtype."""
    if gates is not None:
        assert g is None and beta is None, "g and beta, or the gates they come from"
        g, beta = delta_gates(*gates)
    groups = v.shape[1] // q.shape[1]
    q, k = (_l2norm(t.float()).repeat_interleave(groups, dim=1) for t in (q, k))
    q = q * q.shape[-1] ** -0.5
    vf, g, beta = v.float(), g.float(), beta.float()
    if attn.max_query_len == 1:
        return _delta_decode(q, k, vf, g, beta, state, attn).to(v.dtype)
    out = torch.empty_like(vf)
    for row, n, slot, fresh in _sequences(attn):
        s = torch.zeros_like(state[slot]) if fresh else state[slot]
        for t in range(row, row + n):  # one token at a time, as a decode: see above
            s, out[t] = _delta_step(s, q[t], k[t], vf[t], g[t], beta[t])
        state[slot] = s
    return out.to(v.dtype)


def _delta_decode(q, k, v, g, beta, state, attn) -> torch.Tensor:
    """One delta-rule step per sequence (row b is sequence b), every row at once, by slot:
    the fused recurrent step of a decode, in the fixed shapes a graph captures."""
    slots = attn.state_slots.long()
    s = state[slots]  # [B, H, K, V]
    s = torch.where(_from_zero(attn)[:, None, None, None], torch.zeros_like(s), s)
    state[slots], out = _delta_step(s, q, k, v, g, beta)
    return out


def _delta_step(s, q, k, v, g, beta) -> tuple[torch.Tensor, torch.Tensor]:
    """One token: (the new state [..., H, K, V], the output [..., H, V]) from state s, q, k
    [..., H, K], v [..., H, V], g, beta [..., H] (float32)."""
    s = s * g.exp()[..., None, None]
    remembered = (s * k[..., None]).sum(dim=-2)  # [..., H, V]: what the state gives for k
    delta = (v - remembered) * beta[..., None]
    s = s + k[..., None] * delta[..., None, :]
    return s, (s * q[..., None]).sum(dim=-2)


def chunked_delta_rule(q, k, v, g, beta, s0) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's delta rule in blocks of CHUNK tokens (transformers' chunked form, step for
    step): the reference of a prefill kernel's block algorithm. q, k: [L, H, K] (L2-normed, q
    scaled); v: [L, H, V]; g, beta: [L, H]; s0: [H, K, V], all float32. Returns (out [L, H, V],
    the state after the last token [H, K, V])."""
    L = q.shape[0]
    pad = (CHUNK - L % CHUNK) % CHUNK
    # [H, L', D] blocks of CHUNK: [H, N, CHUNK, D]
    q, k, v = (F.pad(t.transpose(0, 1), (0, 0, 0, pad)) for t in (q, k, v))
    g, beta = (F.pad(t.transpose(0, 1), (0, pad)) for t in (g, beta))
    H, blocks = q.shape[0], (L + pad) // CHUNK
    v_beta, k_beta = v * beta[..., None], k * beta[..., None]
    q, k, k_beta, v_beta = (t.reshape(H, blocks, CHUNK, -1) for t in (q, k, k_beta, v_beta))
    g = g.reshape(H, blocks, CHUNK).cumsum(dim=-1)  # log decay from the block's start
    upper = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=q.device).triu(1)
    decay = (g[..., :, None] - g[..., None, :]).masked_fill(upper, float("-inf")).exp()
    system = (k_beta @ k.transpose(-1, -2)) * decay
    within = (q @ k.transpose(-1, -2)) * decay
    new_v = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    k_decayed = k_beta * g.exp()[..., None]
    k_cum = torch.linalg.solve_triangular(system, k_decayed, upper=False, unitriangular=True)
    q = q * g.exp()[..., None]
    k = k * (g[..., -1:] - g).exp()[..., None]
    block_decay = g[..., -1].exp()[..., None, None]
    out = torch.zeros_like(new_v)
    s = s0.to(new_v)
    for i in range(blocks):
        v_new = new_v[:, i] - k_cum[:, i] @ s
        out[:, i] = q[:, i] @ s + within[:, i] @ v_new
        s = s * block_decay[:, i] + k[:, i].transpose(-1, -2) @ v_new
    return out.reshape(H, -1, out.shape[-1])[:, :L].transpose(0, 1), s


def delta_gates(
    a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Semantics: the delta rule's log decay g = -exp(A_log) softplus(a + dt_bias) in float32
    and write strength beta = sigmoid(b) in b's dtype (transformers' ops, in its order).
    a, b: [T, H]; A_log, dt_bias: [H]. Returns (g [T, H], beta [T, H])."""
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias)
    return g, b.sigmoid()


def rms_norm_gated(
    x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """Semantics: out = weight * rmsnorm(x) * silu(gate), the norm in float32 cast back to x's
    dtype before the weight, the gate's silu in float32 (transformers' RMSNormGated).
    x, gate: [N, V] or [T, H, V] (a row a head); weight: [V]. Returns x's shape and dtype."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    h = weight * h.to(x.dtype)
    return (h * F.silu(gate.float())).to(x.dtype)


def rms_norm_gated_o_shrink(
    x: torch.Tensor,
    gate: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    lora: LoraWeights,
    info: LoraBatchInfo,
) -> tuple[torch.Tensor, FoldedLora]:
    """Semantics: (out = rms_norm_gated(x, gate, weight, eps), FoldedLora(lora_shrink_split(
    out as [T, H V], lora, info), lora, info)): the norm and the shrink of out_proj's LoRA,
    which the next norm expands (layers/attention_lora.py). x, gate: [T, H, V]."""
    out = rms_norm_gated(x, gate, weight, eps)
    shrunk = lora_shrink_split(out.reshape(out.shape[0], -1), lora, info)
    return out, FoldedLora(shrunk, lora, info)
