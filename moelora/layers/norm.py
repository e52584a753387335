import torch
from torch import nn

from moelora.kernels.ops import Ops
from moelora.lora.batch_info import LoraBatchInfo, LoraWeights


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
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual)."""
        return self.ops.rms_norm(x, self.weight, self.eps, residual)

    def with_lora(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        info: LoraBatchInfo,
        *,
        delta: tuple[torch.Tensor, LoraWeights] | None = None,
        shrink: LoraWeights | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """forward with the neighbouring projections' LoRA folded in: x first takes the LoRA
        of delta = (its projection's input, LoRA weights); shrink's A is applied to the output
        (see reference.rms_norm_lora). Returns (out, x + residual, shrunk or None)."""
        return self.ops.rms_norm_lora(
            x, self.weight, self.eps, residual, info, delta=delta, shrink=shrink
        )
