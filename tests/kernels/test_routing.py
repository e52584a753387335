import pytest
import torch

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
