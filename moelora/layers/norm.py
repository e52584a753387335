import torch
from torch import nn

from moelora.kernels.ops import Ops
from moelora.step.lora import FoldedLora, LoraBatchInfo, LoraWeights


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
        shrink: LoraWeights | None = None,
        expand: FoldedLora | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, FoldedLora | None]:
        """forward with the LoRA of the projections on either side folded in: expand (the
        LoRA of the projection that produced x, already shrunk) is expanded into x first;
        shrink (the LoRA of the projection that reads the output) is shrunk from the output
        (see reference.rms_norm_lora and layers/attention_lora.py).
        Returns (out, x + residual, shrink as a FoldedLora, or None)."""
        return self.ops.rms_norm_lora(
            x, self.weight, self.eps, residual, info, shrink=shrink, expand=expand
        )
