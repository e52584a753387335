"""Pure-torch references for every kernel: the CPU path, the tests' oracle, the debug fallback.

Each Triton kernel in this package has the same signature as its reference here; for the Ops
table's entries that signature is a Protocol of kernels/contracts.py, which a test checks.
Legend: T = tokens, H = hidden, I = expert intermediate, E = experts, K = top-k,
S = adapter slots, R = max LoRA rank, n = output slices of a fused linear.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from moelora.kernels.fp8_block import Fp8Weight, dequantize_fp8_block
from moelora.kernels.grouped_routing import route_grouped
from moelora.kernels.moe.mxfp4_layout import MXFP4_GROUP, Mxfp4Weight
from moelora.step.lora import FoldedLora, LoraBatchInfo, LoraWeights

if TYPE_CHECKING:
    from moelora.config import GroupedRouting
    from moelora.step.batch import AttentionMetadata


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Semantics: y = x @ w.T (+ bias). x: [T, in], w: [out, in], bias: [out] or None."""
    return F.linear(x, w, bias)


def linear_fp8(
    x: torch.Tensor,
    codes: torch.Tensor,
    scale_inv: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Semantics: y = x @ dequantize_fp8_block(codes, scale_inv, x.dtype).T (+ bias).
    x: [T, in]; codes: [out, in] float8_e4m3fn; scale_inv: [ceil(out / 128), ceil(in / 128)]
    float32; bias: [out] or None."""
    return F.linear(x, dequantize_fp8_block(codes, scale_inv, x.dtype), bias)


def route_topk(
    router_logits: torch.Tensor,
    top_k: int,
    *,
    scoring: str = "softmax",
    renormalize: bool,
    grouped: GroupedRouting | None = None,
    correction_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Semantics: w, ids = topk(score(logits)); w /= w.sum() if renormalize. With `grouped`,
    DeepSeek's grouped choice instead (grouped_routing.route_grouped: the correction bias [E]
    float32 moves the choice, the weights are scaled by routed_scaling_factor).

    router_logits: [T, E] any float dtype. Returns weights [T, K] float32, ids [T, K] int32.
    """
    if grouped is not None:
        return route_grouped(
            router_logits,
            top_k,
            grouped,
            scoring=scoring,
            renormalize=renormalize,
            correction_bias=correction_bias,
        )
    logits = router_logits.float()
    if scoring == "softmax":
        scores = logits.softmax(dim=-1)
    elif scoring == "sigmoid":
        scores = logits.sigmoid()
    else:
        raise ValueError(f"scoring must be 'softmax' or 'sigmoid', got {scoring!r}")
    weights, ids = torch.topk(scores, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids.to(torch.int32)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """Semantics: silu(x[..., :I]) * x[..., I:]. [.., 2I] -> [.., I]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def silu_and_mul_lora(
    gate_up: torch.Tensor,
    info: LoraBatchInfo,
    *,
    expand: FoldedLora | None = None,
    shrink: LoraWeights | None = None,
) -> tuple[torch.Tensor, FoldedLora | None]:
    """silu_and_mul with the LoRA of the projections on either side folded in (a dense MLP's or
    a shared expert's: layers/mlp_lora.py).

    Semantics: with expand (gate_up_proj's LoRA, shrunk [T, 2, R] by the norm before: gate's
    slice, then up's), gate_up first takes lora_expand_(gate_up, expand.shrunk, ...); h =
    silu_and_mul(gate_up); with shrink (down_proj's LoRA), shrunk = FoldedLora(
    lora_shrink_split(h, shrink, info), shrink, info), which the next norm expands.
    Returns (h [T, I], shrunk or None)."""
    if expand is not None:
        gate_up = lora_expand_(gate_up.clone(), expand.shrunk, expand.weights, info)
    h = silu_and_mul(gate_up)
    if shrink is None:
        return h, None
    return h, FoldedLora(lora_shrink_split(h, shrink, info), shrink, info)


# attention_work's entries: sequence * WORK_SEQ + query blocks from the sequence's last
WORK_SEQ = 1 << 16
SWIGLU_OAI_ALPHA = 1.702
SWIGLU_OAI_LIMIT = 7.0


def swiglu_oai(gate_up: torch.Tensor) -> torch.Tensor:
    """Semantics: GPT-OSS's clamped SwiGLU, g = min(x[..., :I], 7), u = clamp(x[..., I:], -7,
    7): (u + 1) * g * sigmoid(1.702 g). [.., 2I] -> [.., I] (gate half first, as w13 is)."""
    gate, up = gate_up.chunk(2, dim=-1)
    gate = gate.clamp(max=SWIGLU_OAI_LIMIT)
    up = up.clamp(min=-SWIGLU_OAI_LIMIT, max=SWIGLU_OAI_LIMIT)
    return (up + 1) * (gate * torch.sigmoid(gate * SWIGLU_OAI_ALPHA))


ACTIVATIONS = {"silu": silu_and_mul, "swiglu_oai": swiglu_oai}

# MXFP4's e2m1 values by their 4-bit code (sign in the top bit)
FP4_VALUES = (
    0.0,
    0.5,
    1.0,
    1.5,
    2.0,
    3.0,
    4.0,
    6.0,
    -0.0,
    -0.5,
    -1.0,
    -1.5,
    -2.0,
    -3.0,
    -4.0,
    -6.0,
)


def dequantize_mxfp4(
    blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """Semantics: out[..., 32 g + 2 j + n] = FP4_VALUES[nibble n of blocks[..., g, j]] *
    2 ** (scales[..., g] - 127), the low nibble first (n = 0), as GPT-OSS's release stores its
    experts and transformers reads them (integrations/mxfp4.py), in the same operations, so the
    values are its to the bit. blocks [..., G, 16] uint8, scales [..., G] uint8 (E8M0).
    Returns [..., G * 32] in dtype."""
    *lead, G, B = blocks.shape
    assert tuple(scales.shape) == (*lead, G), (blocks.shape, scales.shape)
    lut = torch.tensor(FP4_VALUES, dtype=dtype, device=blocks.device)
    blocks = blocks.to(torch.uint8).reshape(-1, B)
    out = torch.empty(blocks.shape[0], 2 * B, dtype=dtype, device=blocks.device)
    out[:, 0::2] = lut[(blocks & 0x0F).to(torch.int)]
    out[:, 1::2] = lut[(blocks >> 4).to(torch.int)]
    torch.ldexp(out, scales.to(torch.int32).reshape(-1, 1) - 127, out=out)
    return out.reshape(*lead, G * 2 * B)


def quantize_rows_fp8(x: torch.Tensor, group: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """Semantics: x [T, N] (N a multiple of group) per row and group of columns (DeepSeek's
    per-token-group activation quantization): scale = amax / 448, codes = x * (448 / amax)
    saturated at +-448 and rounded to nearest even e4m3 (scale 1 and codes x for a group of
    zeros), in float32 arithmetic. Returns (codes [T, N] float8_e4m3fn, scales [T, N / group]
    float32)."""
    T, N = x.shape
    assert N % group == 0, (N, group)
    xf = x.float().view(T, N // group, group)
    amax = xf.abs().amax(dim=-1)
    zero = amax == 0
    one = torch.ones_like(amax)
    # both divisions correctly rounded, tensor by tensor: torch takes 448.0 / t as
    # t.reciprocal() * 448 (two roundings) and, on CUDA, t / 448.0 as t * (1 / 448); bf16
    # inputs put many values a float32 step from an e4m3 midpoint, where that step decides
    # the code
    fmax = torch.full_like(amax, 448.0)
    scale = torch.where(zero, one, amax.div(fmax))
    inv = torch.where(zero, one, fmax.div(torch.where(zero, one, amax)))
    codes = (xf * inv[..., None]).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return codes.view(T, N), scale


def fp8_rows(x: torch.Tensor, group: int = 128) -> torch.Tensor:
    """Semantics: x as W8A8 reads it: quantize_rows_fp8's codes times their scales, float32."""
    codes, scale = quantize_rows_fp8(x, group)
    T, N = x.shape
    return (codes.float().view(T, N // group, group) * scale[..., None]).view(T, N)


def dense_experts(w: torch.Tensor | Mxfp4Weight | Fp8Weight, dtype: torch.dtype) -> torch.Tensor:
    """Semantics: w [E, N, K] as a tensor: packed experts dequantized (dequantize_mxfp4) to
    dtype, in the GPU layout too (Mxfp4Weight.release_blocks), block-FP8 ones too
    (fp8_block.dequantize_fp8_block), a tensor as it is."""
    if isinstance(w, Fp8Weight):
        return w.dequantize(dtype)
    if not isinstance(w, Mxfp4Weight):
        return w
    E, N, K = w.shape
    blocks = w.release_blocks().view(E, N, K // MXFP4_GROUP, MXFP4_GROUP // 2)
    return dequantize_mxfp4(blocks, w.scales, dtype)


def _slot_mask(info: LoraBatchInfo, slots: torch.Tensor) -> torch.Tensor:
    """True where the token's slot is a real, enabled slot (NO_SLOT and disabled -> False)."""
    safe = slots.clamp(min=0).long()
    return (slots >= 0) & (info.slot_enabled[safe] != 0)


def _lora_delta(
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    out_slices: tuple[int, ...],
    scaling: torch.Tensor,
) -> torch.Tensor:
    """Per-row adapters. x [N, in], a [N, n, R, in], b [N, out, R], scaling [N] -> [N, out]."""
    shrunk = torch.einsum("ti,tnri->tnr", x.float(), a.float())  # [N, n, R]
    pieces, offset = [], 0
    for i, size in enumerate(out_slices):
        b_i = b[:, offset : offset + size].float()  # [N, size, R]
        pieces.append(torch.einsum("tr,tor->to", shrunk[:, i], b_i))
        offset += size
    return torch.cat(pieces, dim=-1) * scaling[:, None]


def lora_shrink(x: torch.Tensor, lora: LoraWeights, info: LoraBatchInfo) -> torch.Tensor:
    """Semantics: shrunk[t, i] = scaling[s] * x[t] @ A[s, i].T, s = slot[t], for tokens whose
    slot is enabled; other rows are zero (and kernels leave them unwritten: readers check the
    slot first). Computed in float32 from x as given.

    x: [T, in]; lora's A of slot s [n, r, in] (LoraWeights.factors: read through its table).
    Returns [T, n, R] float32, zero past each slot's rank r.
    """
    T = x.shape[0]
    n, R = len(lora.out_slices), lora.max_rank
    shrunk = torch.zeros(T, n, R, dtype=torch.float32, device=x.device)
    slots = info.slot_of_token[:T]
    active = _slot_mask(info, slots)
    for s in torch.unique(slots[active]).tolist():
        factors = lora.factors(s)
        if factors is None:
            continue  # the slot's adapter has no such module
        a = factors[0]
        rows = (slots == s).nonzero().squeeze(1)
        part = torch.einsum("ti,nri->tnr", x[rows].float(), a.float())
        shrunk[rows, :, : a.shape[1]] = part * info.scaling_of_slot[s].float()
    return shrunk


def lora_expand_(
    y: torch.Tensor, shrunk: torch.Tensor, lora: LoraWeights, info: LoraBatchInfo
) -> torch.Tensor:
    """Semantics: y[t, slice_i] += (shrunk[t, i] @ B[s, slice_i].T) rounded to y's dtype, for
    tokens whose slot s is enabled (PEFT's order: the delta is rounded, then added).

    y: [T, out]; shrunk: [T, n, R] float32 from lora_shrink. In place; returns y.
    """
    T = y.shape[0]
    slots = info.slot_of_token[:T]
    active = _slot_mask(info, slots)
    for s in torch.unique(slots[active]).tolist():
        factors = lora.factors(s)
        if factors is None:
            continue
        b = factors[1]  # [out, r]
        r = b.shape[1]
        rows = (slots == s).nonzero().squeeze(1)
        pieces, offset = [], 0
        for i, size in enumerate(lora.out_slices):
            b_i = b[offset : offset + size].float()  # [size, r]
            pieces.append(shrunk[rows, i, :r] @ b_i.T)
            offset += size
        y[rows] += torch.cat(pieces, dim=-1).to(y.dtype)
    return y


def add_lora_(
    y: torch.Tensor, x: torch.Tensor, lora: LoraWeights, info: LoraBatchInfo
) -> torch.Tensor:
    """Semantics: y[t, slice_i] += scaling[s] * (x[t] @ A[s, i].T) @ B[s, slice_i].T, s = slot[t].

    y: [T, out], x: [T, in], same dtype; only tokens whose slot is enabled change. In place;
    returns y.
    """
    return lora_expand_(y, lora_shrink(x, lora, info), lora, info)


def _expert_delta(
    x: torch.Tensor, lora: LoraWeights, slots: torch.Tensor, e: int, scale: torch.Tensor
) -> torch.Tensor:
    """Each row's delta from expert e's factors of its slot (read through lora's table), in
    float32: x [N, in], slots [N], scale [N] -> [N, out]."""
    delta = torch.zeros(x.shape[0], lora.out_features, dtype=torch.float32, device=x.device)
    for s in torch.unique(slots).tolist():
        factors = lora.factors(s)
        if factors is None:
            continue
        rows = (slots == s).nonzero().squeeze(1)
        a, b = factors[0][e], factors[1][e]  # [n, r, in], [out, r]
        n = len(rows)
        delta[rows] = _lora_delta(
            x[rows], a.expand(n, *a.shape), b.expand(n, *b.shape), lora.out_slices, scale[rows]
        )
    return delta


def fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor | Mxfp4Weight | Fp8Weight,
    w2: torch.Tensor | Mxfp4Weight | Fp8Weight,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    lora13: LoraWeights | None = None,
    lora2: LoraWeights | None = None,
    info: LoraBatchInfo | None = None,
    sum_topk: bool = True,
    b13: torch.Tensor | None = None,
    b2: torch.Tensor | None = None,
    activation: str = "silu",
) -> torch.Tensor:
    """Semantics: out[t] = sum_k w[t,k] * (act(x[t] @ W13[e].T + b13[e] + d13) @ W2[e].T + b2[e]
    + d2), act = ACTIVATIONS[activation] (silu_and_mul or swiglu_oai), biases zero when None.
    (sum_topk=False allows [T, K, H] rows whose sum_rows is out; this reference sums anyway.)

    e = ids[t, k]; d13/d2 are the LoRA deltas of token t's slot for expert e (zero when the
    slot is NO_SLOT or disabled): d13 = scaling * (x @ A13[s,e,i].T) @ B13[s,e,slice_i].T.
    x [T, H]; w13 [E, 2I, H] (gate rows, then up rows); w2 [E, H, I];
    topk_weights [T, K] float32; topk_ids [T, K] int32. Slot s's factors, read through each
    LoraWeights' table (LoraWeights.factors; a module absent from the slot's adapter adds
    nothing): A13 [E, 2, r, H], B13 [E, 2I, r]; A2 [E, 1, r, I], B2 [E, H, r], r the module's
    own rank, a factor shared by every expert stored once. b13 [E, 2I] (gate, then up), b2
    [E, H]. Returns [T, H]. MXFP4 and block-FP8 experts are dequantized to x's dtype first.
    """
    return _fused_moe(x, w13, w2, topk_weights, topk_ids, lora13, lora2, info, b13, b2, activation)


def fused_moe_w8a8(
    x: torch.Tensor,
    w13: Fp8Weight,
    w2: Fp8Weight,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    lora13: LoraWeights | None = None,
    lora2: LoraWeights | None = None,
    info: LoraBatchInfo | None = None,
    h_group: int = 128,
) -> torch.Tensor:
    """Semantics: fused_moe on block-FP8 experts as MoeConfig.w8a8 computes it: the base products
    read fp8_rows(x) (groups of 128) and fp8_rows(h, h_group) (MoeConfig.block_n, gate_up's
    tile) against the weights dequantized in float32, each rounded to x's dtype; the LoRA
    deltas read x and h unquantized."""
    args = (x, w13, w2, topk_weights, topk_ids, lora13, lora2, info, None, None, "silu")
    return _fused_moe(*args, w8a8=True, h_group=h_group)


def _fused_moe(
    x,
    w13,
    w2,
    topk_weights,
    topk_ids,
    lora13,
    lora2,
    info,
    b13,
    b2,
    activation,
    w8a8=False,
    h_group=128,
) -> torch.Tensor:
    """fused_moe's body (its semantics), W8A8's where w8a8 (h in groups of h_group)."""
    act = ACTIVATIONS[activation]
    assert not w8a8 or isinstance(w13, Fp8Weight), type(w13)
    w13, w2 = (dense_experts(w, torch.float32 if w8a8 else x.dtype) for w in (w13, w2))
    T, K = topk_ids.shape
    out = torch.zeros(T, x.shape[1], dtype=torch.float32, device=x.device)
    flat_ids = topk_ids.reshape(-1).long()
    token_of_pair = torch.arange(T, device=x.device).repeat_interleave(K)
    weight_of_pair = topk_weights.reshape(-1)
    use_lora = info is not None and (lora13 is not None or lora2 is not None)
    if use_lora:
        slot_of_pair = info.slot_of_token[:T].repeat_interleave(K)
        lora_pair = _slot_mask(info, slot_of_pair)
    for e in torch.unique(flat_ids).tolist():
        pairs = (flat_ids == e).nonzero().squeeze(1)
        tok = token_of_pair[pairs]
        xe = x[tok]
        gate_up = _base_product(xe, w13[e], w8a8) + (0 if b13 is None else b13[e])
        if use_lora:
            lp = pairs[lora_pair[pairs]]
            sel = lora_pair[pairs].nonzero().squeeze(1)
            slots = slot_of_pair[lp].long()
            scale = info.scaling_of_slot[slots].float()
        if use_lora and lora13 is not None and sel.numel():
            gate_up[sel] += _expert_delta(xe[sel], lora13, slots, e, scale).to(gate_up.dtype)
        h = act(gate_up)
        down = _base_product(h, w2[e], w8a8, h_group) + (0 if b2 is None else b2[e])
        if use_lora and lora2 is not None and sel.numel():
            down[sel] += _expert_delta(h[sel], lora2, slots, e, scale).to(down.dtype)
        out.index_add_(0, tok, down.float() * weight_of_pair[pairs, None])
    return out.to(x.dtype)


def _base_product(a: torch.Tensor, w: torch.Tensor, w8a8: bool, group: int = 128) -> torch.Tensor:
    """a @ w.T, W8A8's on fp8_rows(a, group) and w in float32, rounded to a's dtype."""
    return (fp8_rows(a, group) @ w.T).to(a.dtype) if w8a8 else a @ w.T


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Semantics: cache.view(-1, Hkv, D)[slot[t]] = kv[t] for slot[t] >= 0.

    k, v: [T, Hkv, D]; k_cache, v_cache: [num_pages, page_size, Hkv, D]; slot_mapping [T] int64.
    """
    keep = (slot_mapping >= 0).nonzero().squeeze(1)
    slots = slot_mapping[keep]
    k_cache.view(-1, *k_cache.shape[2:])[slots] = k[keep].to(k_cache.dtype)
    v_cache.view(-1, *v_cache.shape[2:])[slots] = v[keep].to(v_cache.dtype)


def attention_work(cu_seqlens_q: torch.Tensor, num_rows: int, block_q: int) -> torch.Tensor:
    """Semantics: the prefill attention's programs in the order they should start. Sequence b
    has nb_b = ceil(q_len_b / block_q) query blocks; round r (r = 0, 1, ...) lists, in
    sequence order, b * WORK_SEQ + r for every b with nb_b > r (its block r from the last:
    under the causal mask the last blocks have the most keys). Entries past them are -1, up to
    ceil(num_rows / block_q) + B entries, which bounds the blocks of any step of num_rows rows.
    Returns [ceil(num_rows / block_q) + B] int32."""
    num_seqs = cu_seqlens_q.shape[0] - 1
    q_lens = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).tolist()
    blocks = [-(-n // block_q) for n in q_lens]
    entries = [
        b * WORK_SEQ + r
        for r in range(max(blocks, default=0))
        for b in range(num_seqs)
        if blocks[b] > r
    ]
    size = -(-num_rows // block_q) + num_seqs
    work = torch.full((size,), -1, dtype=torch.int32)
    work[: len(entries)] = torch.tensor(entries, dtype=torch.int32)
    return work.to(cu_seqlens_q.device)


def plan_attention(
    attn: AttentionMetadata, num_rows: int, num_q_heads: int, num_kv_heads: int, head_dim: int
) -> AttentionMetadata:
    """Semantics: the step's attention metadata for every layer's attention: here attn as it
    is (the reference attention walks the sequences itself)."""
    return attn


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    attn: AttentionMetadata,
    scale: float,
    *,
    window: int = 0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Semantics: causal softmax(q k^T * scale) v over each sequence's paged KV, with GQA.

    With window > 0 the query at position p sees keys p - window < n <= p only (HF's sliding
    window). With sinks [Hq] (float32), head h's softmax has one more logit, sinks[h], in its
    denominator and none of its value: softmax([scores, sink])[:-1] @ v (GPT-OSS).
    q: [T, Hq, D]; caches [num_pages, page_size, Hkv, D]; Hq % Hkv == 0. Returns [T, Hq, D].
    Rows of q past cu_seqlens_q[-1] (padding) are returned as zeros.
    """
    out = torch.zeros_like(q)
    page_size = k_cache.shape[1]
    cu = attn.cu_seqlens_q.tolist()
    seq_lens = attn.seq_lens.tolist()
    groups = q.shape[1] // k_cache.shape[2]
    for b, kv_len in enumerate(seq_lens):
        start, end = cu[b], cu[b + 1]
        if end == start:
            continue
        n_pages = -(-kv_len // page_size)
        pages = attn.page_table[b, :n_pages].long()
        k = k_cache[pages].flatten(0, 1)[:kv_len].repeat_interleave(groups, dim=1)
        v = v_cache[pages].flatten(0, 1)[:kv_len].repeat_interleave(groups, dim=1)
        qb = q[start:end].float()
        scores = torch.einsum("qhd,khd->hqk", qb, k.float()) * scale
        q_pos = torch.arange(kv_len - (end - start), kv_len, device=q.device)
        k_pos = torch.arange(kv_len, device=q.device)
        hidden = k_pos[None, :] > q_pos[:, None]  # [q, k]
        if window > 0:
            hidden |= k_pos[None, :] <= q_pos[:, None] - window
        scores.masked_fill_(hidden[None], float("-inf"))
        if sinks is not None:
            sink = sinks.float()[:, None, None].expand(-1, scores.shape[1], 1)
            probs = torch.cat([scores, sink], dim=-1).softmax(-1)[..., :-1]
        else:
            probs = scores.softmax(-1)
        out[start:end] = torch.einsum("hqk,khd->qhd", probs, v.float()).to(q.dtype)
    return out


def paged_attention_o_shrink(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    attn: AttentionMetadata,
    scale: float,
    lora: LoraWeights,
    info: LoraBatchInfo,
    *,
    window: int = 0,
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, FoldedLora]:
    """Semantics: (out = paged_attention(...), FoldedLora(lora_shrink_split(out as
    [T, Hq * D], lora, info), lora, info)): the attention and the shrink of its o projection's
    LoRA, which the next norm expands (layers/attention_lora.py)."""
    out = paged_attention(q, k_cache, v_cache, attn, scale, window=window, sinks=sinks)
    shrunk = lora_shrink_split(out.reshape(out.shape[0], -1), lora, info)
    return out, FoldedLora(shrunk, lora, info)


def output_gate(out: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """Semantics: out * sigmoid(gate), each op rounded to the dtype as torch's separate ops are
    (the gated attention's output, Qwen3-Next and Qwen3.5). out, gate [T, Hq, D]."""
    return out * torch.sigmoid(gate)


def add_shared_expert(
    moe_out: torch.Tensor, shared: torch.Tensor, gate_logits: torch.Tensor | None = None
) -> torch.Tensor:
    """Semantics: sum_rows(moe_out) + shared, the shared expert first scaled by
    sigmoid(gate_logits) where given (Qwen2-MoE's and Qwen3.5's gate), each op rounded to the
    dtype as torch's separate ops are. moe_out [T, K, H] or [T, H]; shared [T, H]; gate_logits
    [T, 1] or None."""
    if gate_logits is not None:
        shared = torch.sigmoid(gate_logits) * shared
    return sum_rows(moe_out) + shared


def sum_rows(x: torch.Tensor) -> torch.Tensor:
    """Semantics: x [T, KX, N] -> [T, N], the KX rows added in order in float32 from zero, then
    rounded to x's dtype (how the MoE's top-k rows are summed); x [T, N] is returned as is."""
    if x.dim() == 2:
        return x
    total = torch.zeros(x.shape[0], x.shape[2], dtype=torch.float32, device=x.device)
    for k in range(x.shape[1]):
        total += x[:, k].float()
    return total.to(x.dtype)


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    *,
    shared: torch.Tensor | None = None,
    shared_gate: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Semantics: s = joined(x) + residual (joined(x) alone when None);
    out = weight * rmsnorm(s), where joined(x) = sum_rows(x), or with a shared expert's output
    add_shared_expert(x, shared, shared_gate) (the MoE's rows and its shared expert, joined
    here: no launch of their own).

    The sum is rounded to x's dtype, the norm computed in float32 and cast back to x's dtype
    before the weight multiplies it: the HF models' order, so float32 matches them exactly.
    x: [T, N], or [T, KX, N] rows to add first (the MoE's top-k rows, fused_moe(sum_topk=
    False)); residual, shared: [T, N]; shared_gate: [T, 1] logits or None; weight: [N].
    Returns (out [T, N], s [T, N]).
    """
    x = _joined(x, shared, shared_gate)
    s = x if residual is None else x + residual
    return _norm(s, weight, eps), s


def _joined(
    x: torch.Tensor, shared: torch.Tensor | None, shared_gate: torch.Tensor | None
) -> torch.Tensor:
    """The MoE's rows summed, with its shared expert where given (rms_norm's joined(x))."""
    assert shared is not None or shared_gate is None, "a gate without its shared expert"
    return sum_rows(x) if shared is None else add_shared_expert(x, shared, shared_gate)


def _norm(s: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * rmsnorm over the last dim, in rms_norm's rounding order (any leading dims)."""
    h = s.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(s.dtype)


def lora_shrink_split(x: torch.Tensor, lora: LoraWeights, info: LoraBatchInfo) -> torch.Tensor:
    """Semantics: lora_shrink in KS partial sums over slices of the input, summed by the reader
    (rms_norm_lora's expand). Returns [T, KS, n, R] float32; here KS = 1."""
    return lora_shrink(x, lora, info)[:, None]


def rms_norm_lora(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None,
    info: LoraBatchInfo,
    *,
    shrink: LoraWeights | None = None,
    expand: FoldedLora | None = None,
    shared: torch.Tensor | None = None,
    shared_gate: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, FoldedLora | None]:
    """rms_norm with the LoRA of the projections on either side of it folded in.

    Semantics: with expand (the LoRA of the projection that produced x, or with shared of
    the shared expert's down_proj, its shrunk the partial shrinks [T, KS, 1, R] from
    lora_shrink_split), the second half of that LoRA, lora_expand_(., partials summed over
    KS, expand.weights, info), goes into shared where given (before its gate: PEFT's order),
    else into x. x is joined(x) (rms_norm's: with shared, the MoE's shared expert), then
    (out, s) = rms_norm(x, weight, eps, residual), and with shrink, shrunk = FoldedLora(
    lora_shrink(out, shrink, info), shrink, info): the first half of the LoRA of the
    projection that reads out. Returns (out, s, shrunk), shrunk.shrunk [T, n, R] float32 (None
    without shrink).
    """
    if expand is not None:
        partials = expand.shrunk.sum(dim=1)
        if shared is not None:
            shared = lora_expand_(shared.clone(), partials, expand.weights, info)
        else:
            x = lora_expand_(_joined(x, None, None).clone(), partials, expand.weights, info)
    x = _joined(x, shared, shared_gate)
    out, s = rms_norm(x, weight, eps, residual)
    if shrink is None:
        return out, s, None
    return out, s, FoldedLora(lora_shrink(out, shrink, info), shrink, info)


def rope_store_kv(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    q_norm: torch.Tensor | None,
    k_norm: torch.Tensor | None,
    eps: float,
    *,
    v: torch.Tensor | None = None,
    k_cache: torch.Tensor | None = None,
    v_cache: torch.Tensor | None = None,
    slot_mapping: torch.Tensor | None = None,
    expand: FoldedLora | None = None,
    interleaved: bool = False,
    rotary_dim: int = 0,
    v_norm: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Semantics: per-head RMSNorm of q and k (when weights are given), then rotate-half rotary;
    with v and the caches, then store_kv(k_out, v, k_cache, v_cache, slot_mapping). With
    expand, q|k|v first take lora_expand_(q|k|v, expand.shrunk, expand.weights, expand.info):
    the second half of the q|k|v projection's LoRA (needs v). interleaved (DeepSeek's rotary
    pairs, adjacent dims): q's and k's dims are first reordered, the even ones then the odd
    ones, so that the pairs are halves, and returned (and stored) in that order, as
    transformers' apply_rotary_pos_emb_interleave does (without a norm or expand). rotary_dim
    (partial rotary, 0 < rotary_dim < D): q's and k's dims (after expand), and their norm
    weights, first in partial_rotary_order, returned (and stored) so. v_norm [DV] (MLA's
    kv_a_layernorm, needs v, not with expand): v first RMS-normed over its last dim with this
    weight and eps, as rms_norm rounds, in place (the caller's v then holds what is stored).

    q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, DV] (strided views of the fused qkv output are
    fine; DV is D but without expand: MLA stores its latents as v); positions [T] int64; cos,
    sin [L, D] float32 tables; q_norm, k_norm [D] or None; k_cache [num_pages, page_size, Hkv,
    D], v_cache [..., DV]; slot_mapping [T] int64, -1 = not stored.
    Returns new contiguous q [T, Hq, D], k [T, Hkv, D] in q's dtype.
    """
    if v_norm is not None:
        assert v is not None and expand is None, "v_norm norms v, without a folded LoRA"
        v.copy_(_norm(v, v_norm, eps))
    if expand is not None:
        q, k, v = _expanded_qkv(q, k, v, expand)
    if interleaved:
        assert q_norm is None and expand is None, "no model rotates interleaved pairs so"
        order = deinterleaved(q.shape[-1]).to(q.device)
        q, k = q[..., order], k[..., order]
    if rotary_dim:
        assert not interleaved, "no model rotates part of a head so"
        order = partial_rotary_order(q.shape[-1], rotary_dim).to(q.device)
        q, k = q[..., order], k[..., order]
        q_norm, k_norm = (None if w is None else w[order] for w in (q_norm, k_norm))
    if q_norm is not None:
        q, k = _norm(q, q_norm, eps), _norm(k, k_norm, eps)
    c = cos[positions].to(q.dtype)[:, None, :]
    s = sin[positions].to(q.dtype)[:, None, :]
    q, k = q * c + _rotate_half(q) * s, k * c + _rotate_half(k) * s
    if slot_mapping is not None:
        store_kv(k, v, k_cache, v_cache, slot_mapping)
    return q, k


def _expanded_qkv(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, expand: FoldedLora
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v [T, heads, D] with the q|k|v projection's folded LoRA expanded into them."""
    T, Hq, D = q.shape
    qkv = torch.cat([t.reshape(T, -1) for t in (q, k, v)], dim=-1)
    qkv = lora_expand_(qkv, expand.shrunk, expand.weights, expand.info)
    q, k, v = qkv.split([Hq * D, k.shape[1] * D, v.shape[1] * D], dim=-1)
    return q.view(T, Hq, D), k.view(T, -1, D), v.view(T, -1, D)


def deinterleaved(size: int) -> torch.Tensor:
    """[0, 2, 4, ..., 1, 3, 5, ...]: the even dims, then the odd ones."""
    return torch.cat([torch.arange(0, size, 2), torch.arange(1, size, 2)])


def partial_rotary_order(head_dim: int, rotary_dim: int) -> torch.Tensor:
    """The order of a head's dims under which rotate-half over the whole head (pairs n and
    n + D/2) rotates the first rotary_dim dims in their halves (pairs j and j + R/2) and pairs
    the passing dims among themselves: [0, R/2) + [R, R + P/2) + [R/2, R) + [R + P/2, D), P =
    D - R. layers/rotary.RotaryEmbedding's tables match it. [D] int64."""
    half, passing = rotary_dim // 2, (head_dim - rotary_dim) // 2
    parts = [(0, half), (rotary_dim, rotary_dim + passing), (half, rotary_dim)]
    parts.append((rotary_dim + passing, head_dim))
    return torch.cat([torch.arange(a, b) for a, b in parts])


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)
