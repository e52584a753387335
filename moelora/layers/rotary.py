"""Rotary position embedding tables (rotate-half style), scaled as the HF config describes.

The inverse frequencies come from transformers' own rope functions so that every scaling kind
it defines for a fixed context (linear, yarn, llama3, ...) matches the reference exactly. The
rotation itself is applied by ops.rope_store_kv, fused with the per-head q/k norm where a model
has it and with the store of k and v in the cache.

Partial rotary (GLM-4.5's partial_rotary_factor: the first rotary_dim dims of a head rotate in
halves, the rest pass) runs through the same rotate-half over the whole head: rope_store_kv
(rotary_dim=) reads each head's dims in kernels/reference.partial_rotary_order, and the tables
hold cos 1 and sin 0 on the dims that pass, so the kernel leaves them as they are, bit for bit.
"""

from __future__ import annotations

import torch
from torch import nn

from moelora.errors import ModelConfigError

# These change the frequencies with the sequence length at run time; refused rather than wrong.
_LENGTH_DEPENDENT = ("dynamic", "longrope")


class RotaryEmbedding(nn.Module):
    def __init__(self, hf_config, max_len: int, *, device: torch.device):
        super().__init__()
        inv_freq, scale = _inv_freq(hf_config, device)
        positions = torch.arange(max_len, dtype=torch.float32, device=device)
        freqs = torch.outer(positions, inv_freq)  # [L, R/2], R = rotary dims
        cos, sin = freqs.cos() * scale, freqs.sin() * scale
        passing = _head_dim(hf_config) - 2 * inv_freq.shape[0]
        if passing > 0:  # partial rotary: cos 1, sin 0 on the dims that pass
            shape = (max_len, passing // 2)
            cos = torch.cat((cos, torch.ones(shape, device=device)), dim=-1)
            sin = torch.cat((sin, torch.zeros(shape, device=device)), dim=-1)
        self.register_buffer("cos", torch.cat((cos, cos), dim=-1), persistent=False)  # [L, D]
        self.register_buffer("sin", torch.cat((sin, sin), dim=-1), persistent=False)


def _head_dim(hf_config) -> int:
    return getattr(hf_config, "head_dim", None) or (
        hf_config.hidden_size // hf_config.num_attention_heads
    )


def _inv_freq(hf_config, device: torch.device) -> tuple[torch.Tensor, float]:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = getattr(hf_config, "rope_parameters", None) or {}
    kind = params.get("rope_type", "default")
    if kind in _LENGTH_DEPENDENT or (kind != "default" and kind not in ROPE_INIT_FUNCTIONS):
        supported = ["default"] + sorted(set(ROPE_INIT_FUNCTIONS) - set(_LENGTH_DEPENDENT))
        raise ModelConfigError(f"rope_type={kind!r} is not supported: expected one of {supported}")
    if kind == "default":
        factor = params.get("partial_rotary_factor") or 1.0
        dim = int(_head_dim(hf_config) * factor)
        base = params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
        steps = torch.arange(0, dim, 2, dtype=torch.float32)
        return (1.0 / (base ** (steps / dim))).to(device), 1.0
    init = ROPE_INIT_FUNCTIONS[kind]
    inv_freq, scale = init(hf_config, device)
    return inv_freq.float(), float(scale)
