"""The LoRA-aware linear: a base projection whose output slices each take a LoRA delta.

Its slot buffers (LoraWeights) are attached once by the slot pool; the delta is added by the
kernel into the projection's output, so no separate add runs when no slot is enabled.
"""

from __future__ import annotations

import torch
from torch import nn

from moelora.kernels.fp8_block import FP8_DTYPE, fp8_scale_shape
from moelora.kernels.ops import Ops
from moelora.step.lora import LoraBatchInfo, LoraWeights


class LoraLinear(nn.Module):
    def __init__(
        self,
        in_features: int,
        out_slices: tuple[int, ...],
        ops: Ops,
        *,
        bias: bool = False,
        fp8: bool = False,
        dtype: torch.dtype,
        device: torch.device,
    ):
        super().__init__()
        self.in_features = in_features
        self.out_slices = out_slices
        out = sum(out_slices)
        kw = dict(dtype=dtype, device=device)
        # fp8: the weight is block-FP8 codes with a float32 scale per 128 x 128 block
        # (kernels/fp8_block.py); every slice but the last ends on a block, so each slice's
        # grid of scales is a run of the fused grid's rows (engine/build.py checks it)
        shape = (out, in_features)
        w = torch.empty(shape, dtype=FP8_DTYPE if fp8 else dtype, device=device)
        self.weight = nn.Parameter(w, requires_grad=False)
        self.weight_scale_inv = None
        if fp8:
            s = torch.empty(fp8_scale_shape(shape), dtype=torch.float32, device=device)
            self.weight_scale_inv = nn.Parameter(s, requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(out, **kw), requires_grad=False) if bias else None
        self.ops = ops
        self.lora: LoraWeights | None = None  # set by the slot pool when LoRA is enabled

    def forward(self, x: torch.Tensor, lora_info: LoraBatchInfo | None) -> torch.Tensor:
        """The projection of x plus its LoRA delta; the LoRA reads x as it came (bf16), never
        an FP8 weight's dequantized or quantized operand."""
        if self.weight_scale_inv is None:
            y = self.ops.linear(x, self.weight, self.bias)
        else:
            y = self.ops.linear_fp8(x, self.weight, self.weight_scale_inv, self.bias)
        return self.add_lora_(y, x, lora_info)

    def add_lora_(
        self, y: torch.Tensor, x: torch.Tensor, lora_info: LoraBatchInfo | None
    ) -> torch.Tensor:
        """This projection's LoRA delta of x added into y, its product of x (which another
        module may have computed, in a wider product: y may be a view of it). In place."""
        if self.lora is not None and lora_info is not None:
            self.ops.add_lora_(y, x, self.lora, lora_info)
        return y
