import torch
from torch import nn

from moelora.kernels.ops import Ops


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
