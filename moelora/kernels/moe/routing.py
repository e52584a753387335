"""Top-k routing: score the router logits, keep the k best experts, optionally renormalize.

Semantics: w, ids = topk(score(logits)); w /= w.sum() if renormalize.

Algorithm. A program owns one token (BT = 1; one warp up to 512 experts) and holds its whole
row of E scores in registers. It takes the maximum k times, each time masking the winner out,
so the experts come out in descending score order like torch.topk; ties go to the lower expert
id. Each round is one reduction, inside the warp (shuffles, no barrier): a score is >= 0
(softmax or sigmoid), so its float32 bits order as the scores do, and the key
(bits << 32) | (E_PAD - 1 - expert) orders by score, then by lower expert id; the maximum key
is the winner and holds both. The layout is the same at every T, so a token's weights do not
depend on its batch.

DeepSeek's grouped choice (ModelConfig.routing; reference: kernels/grouped_routing.py) has its
own kernel, again one program a token: the row is held as a [groups, experts a group] tile, so
a group's score is a reduction along the tile's rows (its best expert, or the sum of its two
best biased scores), the topk_group best groups are taken one at a time, and then the top_k
best experts of those groups, each round a maximum and then the lowest expert id that holds it
(a biased score may be negative, so the packed keys above do not apply). The weight of a winner
is its unbiased score, picked out of the tile by a masked sum (exact: every other term is 0).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from moelora.kernels.grouped_routing import biased_variant
from moelora.kernels.pdl import pdl_kwargs, pdl_wait
from moelora.kernels.sizes import cdiv, next_power_of_2

if TYPE_CHECKING:
    from moelora.config import GroupedRouting


@triton.jit(do_not_specialize=["T"])  # one compile for every batch size (graph capture)
def _route_topk_kernel(
    # Pointers.
    logits_ptr,  # [T, E], any float dtype
    weights_ptr,  # [T, K] float32
    ids_ptr,  # [T, K] int32
    # Sizes and strides.
    T,
    E,
    stride_lt,
    # Meta-parameters.
    K: tl.constexpr,
    SIGMOID: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    BT: tl.constexpr,
    E_PAD: tl.constexpr,
    K_PAD: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_wait(PDL)  # first: see kernels/pdl.py
    # -- load BT rows of logits, padding experts past E with -inf --
    offs_t = tl.program_id(0) * BT + tl.arange(0, BT)
    offs_e = tl.arange(0, E_PAD)
    t_ok = offs_t < T
    e_ok = offs_e < E
    logits = tl.load(
        logits_ptr + offs_t[:, None].to(tl.int64) * stride_lt + offs_e[None, :],
        mask=t_ok[:, None] & e_ok[None, :],
        other=float("-inf"),
    ).to(tl.float32)
    logits = tl.where(t_ok[:, None], logits, 0.0)  # rows past T: finite, never stored

    # -- score in fp32 (padded experts get key -1 below) --
    if SIGMOID:
        scores = tl.sigmoid(logits)
    else:
        row_max = tl.max(logits, axis=1)
        exp = tl.exp(logits - row_max[:, None])
        scores = exp / tl.sum(exp, axis=1)[:, None]

    # -- k rounds of argmax on the packed keys; the winner's key is then -1, below every
    # expert's. The K winners stay in registers: a store then a load of them would put two
    # memory round trips in the chain
    low = (E_PAD - 1 - offs_e).to(tl.int64)
    keys = (scores.to(tl.int32, bitcast=True).to(tl.int64) << 32) | low[None, :]
    keys = tl.where(e_ok[None, :], keys, -1)
    offs_k = tl.arange(0, K_PAD)
    top_key = tl.zeros((BT, K_PAD), dtype=tl.int64)
    total = tl.zeros((BT,), dtype=tl.float32)
    for k in tl.static_range(K):
        best = tl.max(keys, axis=1)
        top_key = tl.where(offs_k[None, :] == k, best[:, None], top_key)
        total += (best >> 32).to(tl.int32).to(tl.float32, bitcast=True)
        keys = tl.where(keys == best[:, None], -1, keys)
    top_w = (top_key >> 32).to(tl.int32).to(tl.float32, bitcast=True)
    top_id = (E_PAD - 1 - (top_key & 0xFFFFFFFF)).to(tl.int32)
    if RENORMALIZE:
        top_w = top_w / total[:, None]

    # -- store the K winners of each row --
    out = offs_t[:, None] * K + offs_k[None, :]
    keep = t_ok[:, None] & (offs_k[None, :] < K)
    tl.store(ids_ptr + out, top_id, mask=keep)
    tl.store(weights_ptr + out, top_w, mask=keep)


@triton.jit(do_not_specialize=["T"])  # one compile for every batch size (graph capture)
def _route_grouped_kernel(
    # Pointers.
    logits_ptr,  # [T, E], any float dtype
    bias_ptr,  # [E] float32: the correction bias (placeholder without BIAS)
    weights_ptr,  # [T, K] float32
    ids_ptr,  # [T, K] int32
    # Sizes and strides.
    T,
    stride_lt,
    scaling,  # routed_scaling_factor, float32
    # Meta-parameters.
    K: tl.constexpr,
    N_GROUP: tl.constexpr,
    GROUP_SIZE: tl.constexpr,  # experts a group: E = N_GROUP * GROUP_SIZE
    TOPK_GROUP: tl.constexpr,
    BIAS: tl.constexpr,  # sigmoid scores, the bias in the choice, groups by their two best
    RENORMALIZE: tl.constexpr,
    G_PAD: tl.constexpr,
    GS_PAD: tl.constexpr,
    K_PAD: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_wait(PDL)  # first: see kernels/pdl.py
    # -- the token's row as [groups, experts a group]; padding chooses nothing --
    t = tl.program_id(0)
    offs_g = tl.arange(0, G_PAD)
    offs_j = tl.arange(0, GS_PAD)
    valid = (offs_g[:, None] < N_GROUP) & (offs_j[None, :] < GROUP_SIZE)
    expert = tl.where(valid, offs_g[:, None] * GROUP_SIZE + offs_j[None, :], N_GROUP * GROUP_SIZE)
    logits = tl.load(
        logits_ptr + t.to(tl.int64) * stride_lt + expert, mask=valid, other=float("-inf")
    ).to(tl.float32)

    # -- scores in fp32, as the reference's variants: sigmoid with the bias, or softmax --
    if BIAS:
        scores = tl.sigmoid(logits)
        choice = scores + tl.load(bias_ptr + expert, mask=valid, other=0.0)
    else:
        row_max = tl.max(tl.max(logits, axis=1), axis=0)
        exp = tl.exp(logits - row_max)
        scores = exp / tl.sum(tl.sum(exp, axis=1), axis=0)
        choice = scores
    choice = tl.where(valid, choice, float("-inf"))

    # -- the topk_group best groups (all of them: nothing to mask) --
    if TOPK_GROUP < N_GROUP:
        best = tl.max(choice, axis=1)  # [G_PAD]
        if BIAS:  # the sum of the two best: the best twice where two experts hold it
            ties = tl.sum((choice == best[:, None]).to(tl.int32), axis=1)
            second = tl.max(tl.where(choice < best[:, None], choice, float("-inf")), axis=1)
            best = best + tl.where(ties > 1, best, second)
        group_score = tl.where(offs_g < N_GROUP, best, float("-inf"))
        allowed = tl.zeros((G_PAD,), dtype=tl.int32)
        for _ in tl.static_range(TOPK_GROUP):
            top = tl.max(group_score, axis=0)
            pick = tl.min(tl.where(group_score == top, offs_g, G_PAD), axis=0)
            allowed = tl.where(offs_g == pick, 1, allowed)
            group_score = tl.where(offs_g == pick, float("-inf"), group_score)
        choice = tl.where(allowed[:, None] != 0, choice, float("-inf"))

    # -- k rounds: the best choice, the lowest expert id holding it, its unbiased score --
    offs_k = tl.arange(0, K_PAD)
    top_w = tl.zeros((K_PAD,), dtype=tl.float32)
    top_id = tl.zeros((K_PAD,), dtype=tl.int32)
    total = 0.0
    for k in tl.static_range(K):
        top = tl.max(tl.max(choice, axis=1), axis=0)
        pick = tl.min(tl.min(tl.where(choice == top, expert, N_GROUP * GROUP_SIZE), axis=1), axis=0)
        won = expert == pick
        w = tl.sum(tl.sum(tl.where(won, scores, 0.0), axis=1), axis=0)
        top_w = tl.where(offs_k == k, w, top_w)
        top_id = tl.where(offs_k == k, pick, top_id)
        total += w
        choice = tl.where(won, float("-inf"), choice)
    if RENORMALIZE:
        top_w = top_w / (total + 1e-20)
    top_w = top_w * scaling

    # -- store the K winners --
    keep = offs_k < K
    tl.store(ids_ptr + t * K + offs_k, top_id, mask=keep)
    tl.store(weights_ptr + t * K + offs_k, top_w, mask=keep)


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
    DeepSeek's grouped choice (kernels/grouped_routing.route_grouped; correction_bias [E]
    float32 where grouped.correction_bias says).

    router_logits: [T, E] any float dtype, last dim contiguous; 0 < top_k <= E.
    Returns weights [T, K] float32, ids [T, K] int32 (in descending order of the choice).
    """
    if scoring not in ("softmax", "sigmoid"):
        raise ValueError(f"scoring must be 'softmax' or 'sigmoid', got {scoring!r}")
    T, E = router_logits.shape
    assert router_logits.stride(1) == 1 and 0 < top_k <= E, (router_logits.stride(), top_k, E)
    weights = torch.empty(T, top_k, dtype=torch.float32, device=router_logits.device)
    ids = torch.empty(T, top_k, dtype=torch.int32, device=router_logits.device)
    if T == 0:
        return weights, ids
    if grouped is not None:
        _launch_grouped(router_logits, weights, ids, grouped, scoring, renormalize, correction_bias)
        return weights, ids
    E_PAD = next_power_of_2(E)
    BT = 1  # see the module docstring
    warps = max(1, min(8, E_PAD // 512))
    _route_topk_kernel[(cdiv(T, BT),)](
        logits_ptr=router_logits,
        weights_ptr=weights,
        ids_ptr=ids,
        T=T,
        E=E,
        stride_lt=router_logits.stride(0),
        K=top_k,
        SIGMOID=scoring == "sigmoid",
        RENORMALIZE=renormalize,
        BT=BT,
        E_PAD=E_PAD,
        K_PAD=next_power_of_2(top_k),
        num_warps=warps,
        **pdl_kwargs(router_logits.device),
    )
    return weights, ids


def _launch_grouped(
    router_logits: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    grouped: GroupedRouting,
    scoring: str,
    renormalize: bool,
    correction_bias: torch.Tensor | None,
) -> None:
    """The grouped kernel over weights' and ids' rows, for the variants the reference has."""
    T, E = router_logits.shape
    K = weights.shape[1]
    bias = biased_variant(scoring, grouped)
    group_size = E // grouped.n_group
    assert E % grouped.n_group == 0 and grouped.topk_group * group_size >= K, (E, grouped, K)
    if bias:
        assert correction_bias is not None and correction_bias.dtype == torch.float32
        assert correction_bias.shape == (E,) and correction_bias.is_contiguous()
    G_PAD, GS_PAD = next_power_of_2(grouped.n_group), next_power_of_2(group_size)
    _route_grouped_kernel[(T,)](
        logits_ptr=router_logits,
        bias_ptr=correction_bias if bias else weights,
        weights_ptr=weights,
        ids_ptr=ids,
        T=T,
        stride_lt=router_logits.stride(0),
        scaling=grouped.routed_scaling_factor,
        K=K,
        N_GROUP=grouped.n_group,
        GROUP_SIZE=group_size,
        TOPK_GROUP=grouped.topk_group,
        BIAS=bias,
        RENORMALIZE=renormalize,
        G_PAD=G_PAD,
        GS_PAD=GS_PAD,
        K_PAD=next_power_of_2(K),
        num_warps=max(1, min(8, G_PAD * GS_PAD // 512)),
        **pdl_kwargs(router_logits.device),
    )
