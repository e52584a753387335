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
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moelora.kernels.pdl import pdl_kwargs, pdl_wait
from moelora.kernels.sizes import cdiv, next_power_of_2


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
