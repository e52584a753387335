"""Rotary position embedding tables (rotate-half style), scaled as the HF config describes.

The inverse frequencies come from transformers' own rope functions so that every scaling kind
it defines for a fixed context (linear, yarn, llama3, ...) matches the reference exactly. The
rotation itself is applied by ops.rope_store_kv, fused with the per-head q/k norm where a model
has it and with the store of k and v in the cache.
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
        freqs = torch.outer(positions, inv_freq)  # [L, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [L, D]
        self.register_buffer("cos", emb.cos() * scale, persistent=False)
        self.register_buffer("sin", emb.sin() * scale, persistent=False)


def _inv_freq(hf_config, device: torch.device) -> tuple[torch.Tensor, float]:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = getattr(hf_config, "rope_parameters", None) or {}
    kind = params.get("rope_type", "default")
    if kind in _LENGTH_DEPENDENT or (kind != "default" and kind not in ROPE_INIT_FUNCTIONS):
        supported = ["default"] + sorted(set(ROPE_INIT_FUNCTIONS) - set(_LENGTH_DEPENDENT))
        raise ModelConfigError(f"rope_type={kind!r} is not supported: expected one of {supported}")
    if getattr(hf_config, "partial_rotary_factor", 1.0) not in (None, 1.0):
        raise ModelConfigError(
            f"partial_rotary_factor={hf_config.partial_rotary_factor} is not supported: "
            "expected 1.0"
        )
    if kind == "default":
        head_dim = getattr(hf_config, "head_dim", None) or (
            hf_config.hidden_size // hf_config.num_attention_heads
        )
        base = params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
        steps = torch.arange(0, head_dim, 2, dtype=torch.float32)
        return (1.0 / (base ** (steps / head_dim))).to(device), 1.0
    init = ROPE_INIT_FUNCTIONS[kind]
    inv_freq, scale = init(hf_config, device)
    return inv_freq.float(), float(scale)
