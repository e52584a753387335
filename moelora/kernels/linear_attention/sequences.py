"""What the conv and the delta rule share: each program's sequence, read on the device, and
what a padded step's rows and sequences get.

Graphs. The grids follow tensor shapes only (sequences = len(state_slots), channels, heads);
cu_seqlens_q, seq_lens and state_slots are read on the device. Decode and prefill launches
alike can be captured in a CUDA graph and replayed with new slots and lengths.

Padding. A captured step has rows past cu_seqlens_q[-1] and sequences with no rows (seq_len
0, the spare slot: engine/state_cache.py). A sequence with no rows reads and writes no state,
so its slot keeps what it held; the padded rows of the outputs are zeros, written by the
programs of sequence b for rows cu_seqlens_q[-1] + b + j B (j = 0, 1, ...), so no memset is
recorded, as paged attention's decode does. (The references' decode path computes a padded
row as a fresh token of its sequence and writes the spare slot; their prefill path leaves
padded rows unwritten. Real rows and real slots are the same in all.)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

if TYPE_CHECKING:
    from moelora.step.batch import AttentionMetadata


@triton.jit
def zero_padded_rows(ptrs, ok, b, cu_seqlens_q_ptr, num_seqs, num_rows, row_stride):
    """Rows past cu_seqlens_q[-1] are padding: sequence b's programs zero rows total + b + j B
    (j = 0, 1, ...) at ptrs, their columns of row 0 (ok: the columns in range)."""
    total = tl.load(cu_seqlens_q_ptr + num_seqs)
    zeros = tl.zeros(ok.shape, dtype=tl.float32)  # stored in out's dtype
    first = (total + b).to(tl.int64)
    for j in range(0, tl.cdiv(num_rows - total - b, num_seqs)):
        tl.store(ptrs + (first + j * num_seqs) * row_stride, zeros, mask=ok)


@triton.jit
def sequence(b, cu_seqlens_q_ptr, seq_lens_ptr, state_slots_ptr):
    """(first row, rows, continues from its slot's state, slot) of sequence b."""
    start = tl.load(cu_seqlens_q_ptr + b)
    n = tl.load(cu_seqlens_q_ptr + b + 1) - start
    continues = tl.load(seq_lens_ptr + b) != n  # else its chunk starts at position 0
    slot = tl.load(state_slots_ptr + b).to(tl.int64)
    return start, n, continues, slot


def step_sequences(attn: AttentionMetadata) -> int:
    """B, the step's sequences: its state slots' count, on the host (a shape, no device read)."""
    assert attn.state_slots is not None, "a hybrid model's steps carry state slots"
    B = attn.state_slots.shape[0]
    assert attn.cu_seqlens_q.shape == (B + 1,) and attn.seq_lens.shape == (B,), B
    return B


def check_delta_inputs(q, k, v, g, beta, state, gates=None) -> None:
    """gated_delta_rule's shapes, dtypes and layouts (see its docstring); with gates, g and
    beta are its raw a and b."""
    T, Hk, K = q.shape
    H, V = v.shape[1:]
    assert k.shape == q.shape and v.shape[0] == T and H % Hk == 0, (q.shape, k.shape, v.shape)
    assert g.shape == beta.shape == (T, H), (g.shape, beta.shape)
    assert gates is not None or g.dtype == torch.float32, g.dtype
    if gates is not None:
        assert gates.A_log.shape == gates.dt_bias.shape == (H,), gates.A_log.shape
    assert state.shape[1:] == (H, K, V) and state.dtype == torch.float32, state.shape
    assert state.is_contiguous(), state.stride()
    assert q.stride(2) == k.stride(2) == v.stride(2) == 1, (q.stride(), k.stride(), v.stride())


def strides(name: str, t: torch.Tensor) -> dict[str, int]:
    """stride_{name}t and stride_{name}h: t's token and head strides."""
    return {f"stride_{name}t": t.stride(0), f"stride_{name}h": t.stride(1)}
