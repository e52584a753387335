"""The recurrent-state cache of hybrid models (gated DeltaNet layers, ModelConfig.linear_attention),
the second kind of cache beside the paged KV of their full-attention layers.

A request holds one state slot from its admission until it finishes or is preempted (the
scheduler owns the slots, as it owns the pages: Scheduler._admit takes one, _release gives it
back, once no step in flight computes the request). The slot indexes, in every linear layer,
its conv window and its delta-rule state; a request's first chunk starts from zeros, so a
preempted request that recomputes from scratch needs nothing cleared, and its chunks carry the
state from one to the next. The tensors are allocated once, with one spare slot past the
last for the padded rows of a captured batch, and are never reallocated.
"""

from __future__ import annotations

import torch

from moelora.config import ModelConfig

# the delta-rule state is kept in float32 whatever the model's dtype, as transformers and
# fla keep it: a bfloat16 state would drift over a long sequence
STATE_DTYPE = torch.float32


class StateSlots:
    """Which state slots are free. Slots 0 .. num_slots - 1 are handed out; the spare
    (num_slots) never is."""

    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))  # pop() hands out low ids first

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_slots - len(self._free)

    def allocate(self) -> int:
        assert self._free, "callers check num_free first"
        return self._free.pop()

    def free(self, slot: int) -> None:
        assert 0 <= slot < self.num_slots and slot not in self._free, f"slot {slot} freed twice"
        self._free.append(slot)


def slot_bytes(cfg: ModelConfig, dtype: torch.dtype) -> int:
    """One state slot across all linear layers: the conv window (in the model's dtype) and
    the delta-rule state (float32)."""
    la = cfg.linear_attention
    if la is None:
        return 0
    elem = torch.tensor([], dtype=dtype).element_size()
    state_elem = torch.tensor([], dtype=STATE_DTYPE).element_size()
    per_layer = la.conv_dim * (la.conv_kernel - 1) * elem
    per_layer += la.num_v_heads * la.head_k_dim * la.head_v_dim * state_elem
    return sum(la.layers) * per_layer


def layer_states(
    cfg: ModelConfig, num_slots: int, *, dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """One linear layer's states: conv windows [num_slots + 1, C, W - 1] in dtype and delta-rule
    states [num_slots + 1, H, K, V] float32 (the last slot is the spare)."""
    la = cfg.linear_attention
    assert la is not None
    conv = torch.zeros(num_slots + 1, la.conv_dim, la.conv_kernel - 1, dtype=dtype, device=device)
    shape = (num_slots + 1, la.num_v_heads, la.head_k_dim, la.head_v_dim)
    return conv, torch.zeros(shape, dtype=STATE_DTYPE, device=device)
