"""Top-k routing: score the router logits, keep the k best experts, optionally renormalize.

Semantics: w, ids = topk(score(logits)); w /= w.sum() if renormalize.

Algorithm. A program owns BT tokens and holds their whole row of E scores (E <= a few
hundred) in registers. It takes the maximum k times, each time masking the winner out, so the
experts come out in descending score order like torch.topk; ties go to the lower expert id.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moelora.kernels.pdl import pdl_kwargs, pdl_wait


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

    # -- score in fp32 --
    if SIGMOID:
        scores = tl.sigmoid(logits)
        scores = tl.where(e_ok[None, :], scores, float("-inf"))
    else:
        row_max = tl.max(logits, axis=1)
        exp = tl.exp(logits - row_max[:, None])
        scores = exp / tl.sum(exp, axis=1)[:, None]
        scores = tl.where(e_ok[None, :], scores, float("-inf"))

    # -- k rounds of argmax; the winner is masked out for the next round. The K winners stay
    # in registers: a store then a load of them would put two memory round trips in the chain
    offs_k = tl.arange(0, K_PAD)
    top_w = tl.zeros((BT, K_PAD), dtype=tl.float32)
    top_id = tl.zeros((BT, K_PAD), dtype=tl.int32)
    total = tl.zeros((BT,), dtype=tl.float32)
    for k in tl.static_range(K):
        best = tl.max(scores, axis=1)
        best_id = tl.min(tl.where(scores == best[:, None], offs_e[None, :], E_PAD), axis=1)
        top_w = tl.where(offs_k[None, :] == k, best[:, None], top_w)
        top_id = tl.where(offs_k[None, :] == k, best_id[:, None], top_id)
        total += best
        scores = tl.where(offs_e[None, :] == best_id[:, None], float("-inf"), scores)
    if RENORMALIZE:
        top_w = top_w / total[:, None]

    # -- store the K winners of each row --
    out = offs_t[:, None] * K + offs_k[None, :]
    keep = t_ok[:, None] & (offs_k[None, :] < K)
    tl.store(ids_ptr + out, top_id, mask=keep)
    tl.store(weights_ptr + out, top_w, mask=keep)


def route_topk(
    router_logits: torch.Tensor, top_k: int, *, scoring: str = "softmax", renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Semantics: w, ids = topk(score(logits)); w /= w.sum() if renormalize.

    router_logits: [T, E] any float dtype, last dim contiguous; 0 < top_k <= E.
    Returns weights [T, K] float32, ids [T, K] int32.
    """
    if scoring not in ("softmax", "sigmoid"):
        raise ValueError(f"scoring must be 'softmax' or 'sigmoid', got {scoring!r}")
    T, E = router_logits.shape
    assert router_logits.stride(1) == 1 and 0 < top_k <= E, (router_logits.stride(), top_k, E)
    weights = torch.empty(T, top_k, dtype=torch.float32, device=router_logits.device)
    ids = torch.empty(T, top_k, dtype=torch.int32, device=router_logits.device)
    if T == 0:
        return weights, ids
    BT = 16
    _route_topk_kernel[(triton.cdiv(T, BT),)](
        router_logits, weights, ids, T, E, router_logits.stride(0),
        K=top_k, SIGMOID=scoring == "sigmoid", RENORMALIZE=renormalize,
        BT=BT, E_PAD=triton.next_power_of_2(E),
        K_PAD=triton.next_power_of_2(top_k), **pdl_kwargs(router_logits.device),
    )  # fmt: skip
    return weights, ids
