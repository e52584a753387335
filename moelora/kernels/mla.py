"""Multi-head latent attention (DeepSeek) over the paged latent cache: the torch reference, which
is the CPU path and the oracle of the Triton kernel (kernels/attention/mla.py).

The cache holds, per token, the normed latent c (kv_lora_rank values) and the rotated key k_pe
(qk_rope_head_dim values) that all heads share. kv_b_proj's weight W [Hh (N + V), L] expands c
into head h's no-rope key W_k[h] c and value W_v[h] c. Here the attention runs in the absorbed
form: q_nope moves into the latent space (q_lat = W_k[h].T q_nope), the scores are q_lat . c +
q_pe . k_pe, the probabilities weigh the latents, and W_v[h] maps their sum to the value space.
kv_b_proj's LoRA (delta scaling * B A) is absorbed the same way, as a rank-r correction in the
latent space on either side (lora_q_, lora_out_): the base path is never expanded, and a row
without an enabled slot costs it nothing. The absorption (absorb_q, absorb_out: small float32
matmuls, each with its side's LoRA correction, whose torch loops read the step's slots on the
host) sits around the attention over the cache in the latent space (latent_attention);
absorbed_latents chains the query side and the attention. The Triton table replaces each
(kernels/attention/mla.py, mla_absorb.py: the corrections inside the absorption's launches).

A prefill step may also have keys and values in the expanded form (ExpandedKv: the layer applies
kv_b_proj and its LoRA to latents, as transformers does): N + R wide scores and V wide values,
where the latent form's are L + R and L wide (a third of the work at DeepSeek's sizes). A
sequence given all its keys so attends to them (expanded_attention_); the others stay in the
latent form. In a captured step those are the step's own rows, so a prompt's first chunk
(seq_len == q_len) attends expanded; an eager step may also expand a long extend's cached
prefix (layers/mla.py decides by the work). The two forms are equal in exact arithmetic.

Legend: T = tokens, Hh = heads, N = qk_nope_head_dim, R = qk_rope_head_dim, V = v_head_dim,
L = kv_lora_rank, K = a sequence's KV length, S = adapter slots, r = max LoRA rank.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

import torch

from moelora.kernels.reference import lora_shrink_split
from moelora.step.lora import FoldedLora, LoraBatchInfo, LoraWeights

if TYPE_CHECKING:
    from moelora.step.batch import AttentionMetadata


class ExpandedKv(NamedTuple):
    """Keys and values in the expanded form: kv_b_proj (with its LoRA) of latents, split per
    head, and their rotated keys. Sequence b's are rows cu_seqlens_k[b] .. cu_seqlens_k[b + 1]
    - 1, its positions from 0; it attends expanded iff they are all its keys (seq_lens[b] of
    them), else (none) in the latent form. A captured step passes its own rows and
    cu_seqlens_q: its prompts' first chunks attend expanded."""

    k_nope: torch.Tensor  # [K, Hh, N]
    k_pe: torch.Tensor  # [K, R]
    v: torch.Tensor  # [K, Hh, V]
    cu_seqlens_k: torch.Tensor  # [B + 1] int32
    # known on the host: every sequence with rows attends expanded (nothing for the latent form)
    every: bool = False


def mla_attention(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    latent_cache: torch.Tensor,
    rope_cache: torch.Tensor,
    attn: AttentionMetadata,
    kv_b: torch.Tensor,
    scale: float,
    *,
    lora: LoraWeights | None = None,
    info: LoraBatchInfo | None = None,
    expanded: ExpandedKv | None = None,
) -> torch.Tensor:
    """Semantics: with k[h] = [W_k[h] c + d_k[h], k_pe] and v[h] = W_v[h] c + d_v[h] for each
    cached token (c, k_pe) of the sequence, d the LoRA delta of the query's slot s
    (scaling[s] * B[s] A[s] c, split like W; zero without an enabled slot), out[t, h] = causal
    softmax(scale * [q_nope, q_pe][t, h] . k[h]) @ v[h], computed in the absorbed form (above).

    q_nope [T, Hh, N]; q_pe [T, Hh, R] rotated; latent_cache [P, page_size, 1, L], rope_cache
    [P, page_size, 1, R] (this step's tokens already stored); kv_b [Hh (N + V), L], head h's
    rows N no-rope key then V value; slot s's lora
    factors A [1, r, L], B [Hh (N + V), r] (LoraWeights.factors).
    expanded: keys and values in the expanded form (a prefill step): the sequences given all
    their keys attend to them (expanded_attention_), the others in the latent form.
    Returns [T, Hh, V] in q_nope's dtype; rows past cu_seqlens_q[-1] (padding) are zeros.
    """
    args = (q_nope, q_pe, latent_cache, rope_cache, attn, kv_b, scale)
    if expanded is not None and expanded.every:
        out = q_nope.new_zeros(*q_nope.shape[:2], expanded.v.shape[-1])
    else:
        skip = None if expanded is None else expanded.cu_seqlens_k
        parts = Absorption(core=functools.partial(latent_attention, skip_expanded=skip))
        if lora is None or info is None:
            lora = info = None
        o_lat = absorbed_latents(parts, *args, lora=lora, info=info)
        out = absorb_out(o_lat, kv_b, q_nope.shape[2], q_nope.dtype, lora=lora, info=info)
    if expanded is not None:
        expanded_attention_(out, q_nope, q_pe, expanded, attn, scale)
    return out


def mla_attention_o_shrink(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    latent_cache: torch.Tensor,
    rope_cache: torch.Tensor,
    attn: AttentionMetadata,
    kv_b: torch.Tensor,
    scale: float,
    *,
    lora: LoraWeights | None,
    info: LoraBatchInfo,
    o_lora: LoraWeights,
    expanded: ExpandedKv | None = None,
) -> tuple[torch.Tensor, FoldedLora]:
    """Semantics: (out = mla_attention(...), FoldedLora(lora_shrink_split(out as [T, Hh V],
    o_lora, info), o_lora, info)): the attention and the shrink of its o projection's LoRA,
    which the next norm expands (layers/mla.py, as paged_attention_o_shrink for the other
    attentions)."""
    args = (q_nope, q_pe, latent_cache, rope_cache, attn, kv_b, scale)
    out = mla_attention(*args, lora=lora, info=info, expanded=expanded)
    shrunk = lora_shrink_split(out.reshape(out.shape[0], -1), o_lora, info)
    return out, FoldedLora(shrunk, o_lora, info)


def expanded_attention_(
    out: torch.Tensor,
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    kv: ExpandedKv,
    attn: AttentionMetadata,
    scale: float,
) -> None:
    """Semantics: for each sequence given all its keys in kv (ExpandedKv), its rows out[t, h] =
    causal softmax(scale * (q_nope[t, h] . k_nope[j, h] + q_pe[t, h] . k_pe[j])) @ v[j, h]
    over its key rows j (positions 0 .. the row's own); every other row of out is left as it
    is. out [T, Hh, V], written in place; q_nope [T, Hh, N], q_pe [T, Hh, R] rotated."""
    cu_q, cu_k = attn.cu_seqlens_q.tolist(), kv.cu_seqlens_k.tolist()
    heads = q_nope.shape[1]
    for b, kv_len in enumerate(attn.seq_lens.tolist()):
        start, end, first = cu_q[b], cu_q[b + 1], cu_k[b]
        if end == start or cu_k[b + 1] - first != kv_len:
            continue
        q = torch.cat([q_nope[start:end], q_pe[start:end]], dim=-1).float()
        keys = slice(first, first + kv_len)
        k_pe = kv.k_pe[keys, None].expand(-1, heads, -1)
        k = torch.cat([kv.k_nope[keys], k_pe], dim=-1).float()
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        q_pos = torch.arange(kv_len - (end - start), kv_len, device=q.device)
        k_pos = torch.arange(kv_len, device=q.device)
        scores.masked_fill_(k_pos[None, None, :] > q_pos[None, :, None], float("-inf"))
        o = torch.einsum("hqk,khv->qhv", scores.softmax(-1), kv.v[keys].float())
        out[start:end] = o.to(out.dtype)


# latent_attention's signature: (q_lat, q_pe, latent_cache, rope_cache, attn, scale) -> o_lat
LatentAttention = Callable[..., torch.Tensor]


class Absorption(NamedTuple):
    """The calls of the absorbed form's query side that a kernel table replaces, each keeping
    the contract of the reference it defaults to (kv_b_proj's LoRA inside absorb_q's call)."""

    core: LatentAttention | None = None
    absorb_q: Callable[..., torch.Tensor] | None = None  # absorb_q's signature


def absorbed_latents(
    parts: Absorption,
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    latent_cache: torch.Tensor,
    rope_cache: torch.Tensor,
    attn: AttentionMetadata,
    kv_b: torch.Tensor,
    scale: float,
    *,
    lora: LoraWeights | None = None,
    info: LoraBatchInfo | None = None,
) -> torch.Tensor:
    """The attention's weighted latents o_lat [T, Hh, L] float32 in the absorbed form (the
    queries absorbed, with kv_b_proj's correction, then the attention over the cache), by the
    calls `parts` gives (the references where it gives none): absorb_out (or a kernel table's)
    maps them to the value space."""
    q_lat = (parts.absorb_q or absorb_q)(q_nope, kv_b, lora=lora, info=info)
    return (parts.core or latent_attention)(q_lat, q_pe, latent_cache, rope_cache, attn, scale)


def absorb_q(
    q_nope: torch.Tensor,
    kv_b: torch.Tensor,
    *,
    lora: LoraWeights | None = None,
    info: LoraBatchInfo | None = None,
) -> torch.Tensor:
    """Semantics: q_lat[t, h] = q_nope[t, h] @ W_k[h], W_k[h] head h's first N rows of kv_b
    [Hh (N + V), L], in float32, then with lora and info kv_b_proj's correction (lora_q_).
    q_nope [T, Hh, N]. Returns [T, Hh, L] float32."""
    T, Hh, N = q_nope.shape
    w = kv_b.view(Hh, -1, kv_b.shape[1])[:, :N]  # [Hh, N, L]
    q_lat = torch.einsum("thn,hnl->thl", q_nope.float(), w.float())
    if lora is not None and info is not None:
        lora_q_(q_lat, q_nope, lora, info)
    return q_lat


def absorb_out(
    o_lat: torch.Tensor,
    kv_b: torch.Tensor,
    qk_nope_head_dim: int,
    out_dtype: torch.dtype = torch.float32,
    *,
    lora: LoraWeights | None = None,
    info: LoraBatchInfo | None = None,
) -> torch.Tensor:
    """Semantics: out[t, h] = o_lat[t, h] @ W_v[h].T, W_v[h] head h's rows of kv_b after its
    first qk_nope_head_dim, in float32, with lora and info kv_b_proj's correction added
    (lora_out_), rounded to out_dtype once. o_lat [T, Hh, L] float32. Returns [T, Hh, V] in
    out_dtype."""
    T, Hh, L = o_lat.shape
    w = kv_b.view(Hh, -1, L)[:, qk_nope_head_dim:]  # [Hh, V, L]
    out = torch.einsum("thl,hvl->thv", o_lat, w.float())
    if lora is not None and info is not None:
        lora_out_(out, o_lat, lora, info)
    return out.to(out_dtype)


def lora_q_(
    q_lat: torch.Tensor, q_nope: torch.Tensor, lora: LoraWeights, info: LoraBatchInfo
) -> None:
    """Semantics: q_lat[t, h] += scaling[s] * (q_nope[t, h] @ B_k[h]) @ A for each token t
    whose slot s is enabled and has kv_b_proj's factors A [r, L], B [Hh (N + V), r] (B_k[h]:
    head h's N rows), so that q_lat . c = q_nope . (W_k + scaling B_k A) c.

    q_lat [T, Hh, L] float32, updated in place; q_nope [T, Hh, N]. Reads the slots on the host
    (the CPU path; the Triton absorption adds it in its own launch)."""
    T, Hh, N = q_nope.shape
    for rows, a, b, scaling in _enabled_slots(lora, info, T, Hh):
        q_lat[rows] += scaling * torch.einsum("thn,hnr,rl->thl", q_nope[rows].float(), b[:, :N], a)


def lora_out_(
    out: torch.Tensor, o_lat: torch.Tensor, lora: LoraWeights, info: LoraBatchInfo
) -> None:
    """Semantics: out[t, h] += scaling[s] * (o_lat[t, h] @ A.T) @ B_v[h].T for each token t
    whose slot s is enabled and has kv_b_proj's factors (B_v[h]: head h's V rows, after its N),
    so that out = (W_v + scaling B_v A) applied to the weighted latents.

    out [T, Hh, V] float32, updated in place; o_lat [T, Hh, L] float32. Reads the slots on the
    host (the CPU path; the Triton absorption adds it in its own launch)."""
    T, Hh, V = out.shape
    for rows, a, b, scaling in _enabled_slots(lora, info, T, Hh):
        out[rows] += scaling * torch.einsum("thl,rl,hvr->thv", o_lat[rows], a, b[:, -V:])


def _enabled_slots(
    lora: LoraWeights, info: LoraBatchInfo, T: int, heads: int
) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(rows, A [r, L], B [Hh, N + V, r], scaling) in float32 for each slot enabled
    for some of the first T tokens."""
    slot_of_row = info.slot_of_token[:T]
    safe = slot_of_row.clamp(min=0).long()
    active = (slot_of_row >= 0) & (info.slot_enabled[safe] != 0)
    found = []
    for s in torch.unique(slot_of_row[active]).tolist():
        factors = lora.factors(s)
        if factors is None:
            continue  # the slot's adapter has no kv_b module
        rows = (slot_of_row == s).nonzero().squeeze(1)
        a = factors[0][0].float()
        b = factors[1].float().reshape(heads, -1, a.shape[0])
        found.append((rows, a, b, info.scaling_of_slot[s].float()))
    return found


def latent_attention(
    q_lat: torch.Tensor,
    q_pe: torch.Tensor,
    latent_cache: torch.Tensor,
    rope_cache: torch.Tensor,
    attn: AttentionMetadata,
    scale: float,
    *,
    skip_expanded: torch.Tensor | None = None,
) -> torch.Tensor:
    """Semantics: o[t, h] = causal softmax(scale * (q_lat[t, h] . c + q_pe[t, h] . k_pe)) @ c
    over the sequence's cached (c, k_pe), in float32. q_lat [T, Hh, L] float32, q_pe [T, Hh, R].
    Returns [T, Hh, L] float32; rows past cu_seqlens_q[-1] (padding) are zeros, and so are the
    rows of the sequences that skip_expanded (ExpandedKv.cu_seqlens_k) gives all their keys:
    the expanded form attends to them."""
    out = torch.zeros_like(q_lat)
    page_size = latent_cache.shape[1]
    cu = attn.cu_seqlens_q.tolist()
    expanded = [0] * len(cu) if skip_expanded is None else skip_expanded.diff().tolist()
    for b, kv_len in enumerate(attn.seq_lens.tolist()):
        start, end = cu[b], cu[b + 1]
        if end == start or (skip_expanded is not None and expanded[b] == kv_len):
            continue
        pages = attn.page_table[b, : -(-kv_len // page_size)].long()
        c = latent_cache[pages].flatten(0, 1)[:kv_len, 0].float()  # [K, L]
        k_pe = rope_cache[pages].flatten(0, 1)[:kv_len, 0].float()  # [K, R]
        scores = torch.einsum("qhl,kl->hqk", q_lat[start:end], c)
        scores = (scores + torch.einsum("qhr,kr->hqk", q_pe[start:end].float(), k_pe)) * scale
        q_pos = torch.arange(kv_len - (end - start), kv_len, device=q_lat.device)
        k_pos = torch.arange(kv_len, device=q_lat.device)
        scores.masked_fill_(k_pos[None, None, :] > q_pos[None, :, None], float("-inf"))
        out[start:end] = torch.einsum("hqk,kl->qhl", scores.softmax(-1), c)
    return out
