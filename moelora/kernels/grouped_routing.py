"""DeepSeek's grouped routing (ModelConfig.routing) in torch: the reference of route_topk's
grouped form (reference.route_topk on the CPU, kernels/moe/routing.py's grouped kernel on the
GPU). One function per variant, each the operations of transformers' router for it in the same
order, so float32 picks the same experts with the same weights. They run on any device and
never read the device from the host.

Legend: T = tokens, E = experts, G = groups, K = top-k.
"""

from __future__ import annotations

import torch

from moelora.config import GroupedRouting


def route_grouped(
    router_logits: torch.Tensor,
    top_k: int,
    routing: GroupedRouting,
    *,
    scoring: str,
    renormalize: bool,
    correction_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The variant `routing` and `scoring` name. Returns weights [T, K] float32 (times
    routed_scaling_factor) and expert ids [T, K] int32, as route_topk does."""
    if not biased_variant(scoring, routing):
        weights, ids = group_limited_softmax_topk(router_logits, top_k, routing)
    else:
        assert correction_bias is not None, "the MoE holds e_score_correction_bias"
        weights, ids = biased_grouped_sigmoid_topk(router_logits, top_k, routing, correction_bias)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * routing.routed_scaling_factor, ids.to(torch.int32)


def biased_variant(scoring: str, routing: GroupedRouting) -> bool:
    """Which of the two variants transformers has: sigmoid scores with the correction bias
    (True), or softmax without one (False); any other pairing is refused."""
    if (scoring == "sigmoid") != routing.correction_bias or scoring not in ("softmax", "sigmoid"):
        raise ValueError(
            f"scoring={scoring!r} with correction_bias={routing.correction_bias} is not a "
            "routing transformers has: expected softmax without a bias or sigmoid with one"
        )
    return routing.correction_bias


def group_limited_softmax_topk(
    router_logits: torch.Tensor, top_k: int, routing: GroupedRouting
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V2: softmax scores; a group's score is its best expert's; the experts of all
    but the topk_group best groups score 0; the top_k scores are the weights (unscaled).
    One group is V2's plain greedy top-k."""
    scores = router_logits.float().softmax(dim=-1)  # [T, E]
    group_scores = _grouped(scores, routing).max(dim=-1).values  # [T, G]
    scores = scores.masked_fill(~_allowed(group_scores, scores, routing), 0.0)
    return torch.topk(scores, k=top_k, dim=-1, sorted=False)


def biased_grouped_sigmoid_topk(
    router_logits: torch.Tensor,
    top_k: int,
    routing: GroupedRouting,
    correction_bias: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3 and GLM-4.5: sigmoid scores; the choice reads them plus the correction bias
    [E]: a group's score is the sum of its two best, the top_k best of the topk_group best
    groups are chosen. The weights are the chosen experts' unbiased scores (unscaled)."""
    scores = router_logits.float().sigmoid()  # [T, E]
    choice = scores + correction_bias.float()
    group_scores = _grouped(choice, routing).topk(2, dim=-1)[0].sum(dim=-1)  # [T, G]
    choice = choice.masked_fill(~_allowed(group_scores, choice, routing), float("-inf"))
    ids = torch.topk(choice, k=top_k, dim=-1, sorted=False)[1]
    return scores.gather(1, ids), ids


def _grouped(scores: torch.Tensor, routing: GroupedRouting) -> torch.Tensor:
    """[T, E] -> [T, G, E / G]: consecutive experts form a group."""
    return scores.view(scores.shape[0], routing.n_group, -1)


def _allowed(
    group_scores: torch.Tensor, scores: torch.Tensor, routing: GroupedRouting
) -> torch.Tensor:
    """[T, E] bool: the experts of each token's topk_group best groups."""
    group_idx = torch.topk(group_scores, k=routing.topk_group, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1.0)  # [T, G]
    per_group = scores.shape[1] // routing.n_group
    mask = group_mask.unsqueeze(-1).expand(-1, -1, per_group).reshape(scores.shape)
    return mask.bool()
