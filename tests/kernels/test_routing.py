import dataclasses

import pytest
import torch

from moelora.config import GroupedRouting
from moelora.kernels import reference
from moelora.kernels.moe.routing import route_topk


@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("T,E,K", [(1, 4, 1), (7, 8, 2), (64, 8, 2), (33, 128, 8), (5, 60, 6)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_route_topk_matches_reference(poison_empty, T, E, K, scoring, renormalize, dtype):
    # distinct per row, also in fp16, so the order of the top k is well defined
    logits = (torch.stack([torch.randperm(E) for _ in range(T)]) * (4 / E) - 2).to(dtype)
    weights, ids = route_topk(logits, K, scoring=scoring, renormalize=renormalize)
    ref_w, ref_ids = reference.route_topk(logits, K, scoring=scoring, renormalize=renormalize)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_w, rtol=1e-5, atol=1e-6)


def test_route_topk_rejects_unknown_scoring():
    with pytest.raises(ValueError, match="scoring"):
        route_topk(torch.randn(2, 4), 1, scoring="relu", renormalize=False)


@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
def test_route_topk_breaks_ties_toward_the_lower_expert(scoring):
    # few distinct values per row: most of the k winners tie with another expert
    T, E, K = 9, 40, 6
    logits = torch.randint(-2, 3, (T, E)).float()
    weights, ids = route_topk(logits, K, scoring=scoring, renormalize=False)
    scores = logits.softmax(-1) if scoring == "softmax" else logits.sigmoid()
    order = torch.sort(scores, dim=-1, descending=True, stable=True)
    assert torch.equal(ids.long(), order.indices[:, :K])
    torch.testing.assert_close(weights, order.values[:, :K], rtol=1e-6, atol=1e-7)


# (E, n_group, topk_group, K): several groups, groups of sizes that are not powers of two, one
# group (Moonlight's and GLM-4.5's), every group allowed
GROUPED = [(64, 8, 3, 6), (60, 4, 2, 5), (24, 8, 2, 3), (64, 1, 1, 6), (40, 5, 5, 4)]


def _grouped_case(E: int, n_group: int, topk_group: int, bias: bool) -> GroupedRouting:
    return GroupedRouting(
        n_group=n_group,
        topk_group=topk_group,
        group_score="top2_sum" if bias else "max",
        routed_scaling_factor=2.5,
        correction_bias=bias,
    )


@pytest.mark.parametrize("E,n_group,topk_group,K", GROUPED)
@pytest.mark.parametrize("bias", [True, False])  # DeepSeek-V3 / GLM-4.5; DeepSeek-V2
@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_grouped_route_matches_reference(
    poison_empty, E, n_group, topk_group, K, bias, renormalize, dtype
):
    T = 11
    grouped = _grouped_case(E, n_group, topk_group, bias)
    # distinct per row (also in fp16), and a bias that moves choices but ties none
    logits = (torch.stack([torch.randperm(E) for _ in range(T)]) * (4 / E) - 2).to(dtype)
    correction = (torch.randperm(E).float() * (0.5 / E) - 0.25) if bias else None
    kw = dict(scoring="sigmoid" if bias else "softmax", renormalize=renormalize)
    weights, ids = route_topk(logits, K, grouped=grouped, correction_bias=correction, **kw)
    ref_w, ref_ids = reference.route_topk(
        logits, K, grouped=grouped, correction_bias=correction, **kw
    )
    got, want = ids.long().sort(-1), ref_ids.long().sort(-1)
    assert torch.equal(got.values, want.values)
    torch.testing.assert_close(
        weights.gather(1, got.indices), ref_w.gather(1, want.indices), rtol=1e-5, atol=1e-6
    )
    if topk_group < n_group:  # the group stage moves some choice: the test sees it
        every = dataclasses.replace(grouped, topk_group=n_group)
        loose = reference.route_topk(logits, K, grouped=every, correction_bias=correction, **kw)
        assert not torch.equal(loose[1].long().sort(-1).values, got.values)


@pytest.mark.parametrize("n_group,topk_group", [(1, 1), (4, 2)])
def test_grouped_route_breaks_ties_toward_the_lower_expert(n_group, topk_group):
    # few distinct values: winners tie with other experts, groups with other groups
    T, E, K = 9, 32, 5
    grouped = _grouped_case(E, n_group, topk_group, bias=True)
    logits = torch.randint(-2, 3, (T, E)).float()
    correction = torch.randint(-1, 2, (E,)).float() * 0.25
    weights, ids = route_topk(
        logits, K, scoring="sigmoid", renormalize=False, grouped=grouped, correction_bias=correction
    )
    scores = logits.sigmoid()
    choice = (scores + correction).view(T, n_group, -1)
    group_score = choice.topk(2, dim=-1).values.sum(-1)  # [T, G]
    groups = torch.sort(group_score, dim=-1, descending=True, stable=True).indices[:, :topk_group]
    allowed = torch.zeros(T, n_group, dtype=torch.bool).scatter_(1, groups, True)
    choice = choice.masked_fill(~allowed[..., None], float("-inf")).view(T, E)
    want = torch.sort(choice, dim=-1, descending=True, stable=True).indices[:, :K]
    assert torch.equal(ids.long(), want)
    torch.testing.assert_close(weights, scores.gather(1, want) * 2.5, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("route", [route_topk, reference.route_topk])
def test_grouped_route_refuses_a_variant_transformers_lacks(route):
    grouped = _grouped_case(16, 4, 2, bias=True)  # the bias belongs with sigmoid scores
    with pytest.raises(ValueError, match="scoring='softmax' with correction_bias=True"):
        route(torch.randn(3, 16), 2, renormalize=True, grouped=grouped)
