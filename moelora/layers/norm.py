from typing import NamedTuple

import torch
from torch import nn

from moelora.kernels.ops import Ops
from moelora.step.lora import FoldedLora, LoraBatchInfo, LoraWeights


class Joined(NamedTuple):
    """A MoE's output that the next norm joins before it normalizes (no launch of its own): the
    routed experts' top-k rows [T, K, H] (or their sum [T, H]) and the shared expert's output
    [T, H], scaled by sigmoid(gate_logits [T, 1]) where given (reference.add_shared_expert)."""

    rows: torch.Tensor
    shared: torch.Tensor
    gate_logits: torch.Tensor | None


def _split(x: torch.Tensor | Joined) -> tuple[torch.Tensor, dict]:
    """(the rows, the norm op's shared-expert keywords) of a norm's input."""
    if isinstance(x, Joined):
        return x.rows, dict(shared=x.shared, shared_gate=x.gate_logits)
    return x, {}


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
        """(norm(x + residual), x + residual); x may be a MoE's top-k rows, or Joined."""
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
        (see reference.rms_norm_lora and layers/attention_lora.py).
        Returns (out, x + residual, shrink as a FoldedLora, or None)."""
        rows, shared = _split(x)
        return self.ops.rms_norm_lora(
            rows, self.weight, self.eps, residual, info, shrink=shrink, expand=expand, **shared
        )
