from typing import NamedTuple

import torch
from torch import nn

from moelora.kernels.ops import Ops
from moelora.step.lora import FoldedLora, LoraBatchInfo, LoraWeights


class Joined(NamedTuple):
    """An MLP's output that the next norm joins before it normalizes (no launch of its own): the
    routed experts' top-k rows [T, K, H] (or their sum [T, H], or a dense MLP's output) and the
    shared expert's output [T, H] where there is one, scaled by sigmoid(gate_logits [T, 1])
    where given (reference.add_shared_expert); down_proj's LoRA, shrunk, which the norm
    expands into the shared expert's row (or the rows) first, where given (layers/mlp_lora.py).
    """

    rows: torch.Tensor
    shared: torch.Tensor | None
    gate_logits: torch.Tensor | None
    expand: FoldedLora | None = None


def _split(x: torch.Tensor | Joined) -> tuple[torch.Tensor, dict]:
    """(the rows, the norm op's shared-expert keywords) of a norm's input."""
    if isinstance(x, Joined):
        return x.rows, dict(shared=x.shared, shared_gate=x.gate_logits)
    return x, {}


def _carried(x: torch.Tensor | Joined) -> FoldedLora | None:
    """The LoRA a norm's input carries for it to expand (Joined.expand), or None."""
    return x.expand if isinstance(x, Joined) else None


class RMSNorm(nn.Module):
    """RMSNorm, optionally fused with the residual add before it (see reference.rms_norm)."""

    def __init__(
        self, size: int, eps: float, ops: Ops, *, dtype: torch.dtype, device: torch.device
    ):
        super().__init__()
        self.weight = nn.Parameter(
            torch.ones(size, dtype=dtype, device=device), requires_grad=False
        )
        self.eps = eps
        self.ops = ops

    def forward(
        self, x: torch.Tensor | Joined, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual); x may be a MoE's top-k rows, or Joined (with a
        LoRA to expand: then rms_norm_lora)."""
        expand = _carried(x)
        if expand is not None:
            return self.with_lora(x, residual, expand.info)[:2]
        rows, shared = _split(x)
        return self.ops.rms_norm(rows, self.weight, self.eps, residual, **shared)

    def with_lora(
        self,
        x: torch.Tensor | Joined,
        residual: torch.Tensor | None,
        info: LoraBatchInfo,
        *,
        shrink: LoraWeights | None = None,
        expand: FoldedLora | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, FoldedLora | None]:
        """forward with the LoRA of the projections on either side folded in: expand (the
        LoRA of the projection that produced x, already shrunk) is expanded into x first;
        shrink (the LoRA of the projection that reads the output) is shrunk from the output
        (see reference.rms_norm_lora and layers/attention_lora.py). A Joined x's own expand
        (Joined.expand) is the one, when there is one; expand is then None.
        Returns (out, x + residual, shrink as a FoldedLora, or None)."""
        carried = _carried(x)
        if carried is not None:
            assert expand is None, "one LoRA to expand: x's own"
            expand = carried
        rows, shared = _split(x)
        return self.ops.rms_norm_lora(
            rows, self.weight, self.eps, residual, info, shrink=shrink, expand=expand, **shared
        )
