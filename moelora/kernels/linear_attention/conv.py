"""gated_delta.causal_conv1d in Triton: gated DeltaNet's short causal conv over each
request's window, decode and prefill in one kernel.

Algorithm. One program per (sequence, block of channels). Token t's tap j reads u[t + j] of
u = the sequence's window followed by its rows: the chunk's row t + j - (W - 1) when that is
>= 0, else the window's entry t + j (zeros when the sequence starts at position 0). No value
passes from one token to the next, so the program takes its rows BLOCK_T at a time and a
token's value does not depend on its block or its chunk. Each tap's product is rounded to the
window's dtype and summed in float32 in tap order, then rounded, passed through silu in
float32 and rounded again, as the reference's (u * weight).sum(-1) and silu are. Last, the
program reads its new window (the last W - 1 entries of u, old entries included when the
chunk is shorter) and, once all its lanes have read, stores it over the old one: no other
program touches its slot's channels. Graphs and padding: see sequences.py.

Legend: T = tokens, B = sequences, S = state slots, C = conv channels, W = conv taps.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from moelora.kernels.linear_attention.sequences import sequence, step_sequences, zero_padded_rows
from moelora.kernels.pdl import pdl_kwargs, pdl_wait
from moelora.kernels.sizes import cdiv, next_power_of_2

if TYPE_CHECKING:
    from moelora.step.batch import AttentionMetadata


@dataclass(frozen=True)
class ConvTiles:
    block_t: int  # tokens a program takes at once
    block_c: int  # channels a program owns
    num_warps: int


# A decode has one token a sequence: wide channel blocks. Prefill: a tile of tokens.
CONV_DECODE = ConvTiles(block_t=1, block_c=256, num_warps=4)
CONV_PREFILL = ConvTiles(block_t=16, block_c=128, num_warps=4)
# Prefill rows a program takes: a long prompt's tokens are independent of each other (each
# reads its own W inputs), so they split over programs as its channels do, where one program
# a channel block would walk the whole prompt alone. At least CONV_SPAN rows a program, and at
# most CONV_SPLITS programs a sequence and channel block: the grid covers the longest
# sequence a step may hold (T rows), and in a step of many sequences most would be empty.
CONV_SPAN = 256
CONV_SPLITS = 16


@triton.jit
def _conv_input(x_ptr, window_ptr, start, src, offs_c, ok, continues, stride_xt, W: tl.constexpr):
    """u at chunk rows src ([BT] or [1, WP], < 0: the window's entry src + W - 1) and channels
    offs_c, in the window's dtype; ok masks the pairs to read."""
    in_x = src >= 0
    from_x = tl.load(
        x_ptr + (start + src).to(tl.int64) * stride_xt + offs_c, mask=ok & in_x, other=0.0
    )
    from_w = tl.load(window_ptr + (src + W - 1), mask=ok & (src < 0) & continues, other=0.0)
    return tl.where(in_x, from_x, from_w)


@triton.jit
def _conv_block(
    x_ptr,
    window_ptr,
    weight_ptr,
    out_ptr,
    start,
    t0,
    end,
    offs_c,
    c_ok,
    continues,
    stride_xt,
    C,
    W: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_C: tl.constexpr,
    WINDOW: tl.constexpr,  # some row's tap may read the window (a row below W - 1)
):
    """Rows t0 .. t0 + BLOCK_T (below end) of the sequence starting at chunk row `start`:
    their W taps, each product rounded to the output's dtype and summed in tap order in
    float32, rounded, through silu in float32, rounded and stored."""
    dtype = out_ptr.dtype.element_ty
    offs_t = t0 + tl.arange(0, BLOCK_T)
    ok = (offs_t < end)[:, None] & c_ok[None, :]
    acc = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)
    for j in tl.static_range(W):
        src = (offs_t + j - (W - 1))[:, None]
        if WINDOW:
            u = _conv_input(
                x_ptr, window_ptr[None, :], start, src, offs_c[None, :], ok, continues, stride_xt, W
            )
        else:
            rows = (start + src).to(tl.int64) * stride_xt
            u = tl.load(x_ptr + rows + offs_c[None, :], mask=ok, other=0.0)
        w = tl.load(weight_ptr + offs_c * W + j, mask=c_ok, other=0.0)
        acc += (u.to(tl.float32) * w.to(tl.float32)[None, :]).to(dtype).to(tl.float32)
    y = acc.to(dtype).to(tl.float32)
    y = y / (1.0 + tl.exp(-y))
    rows = (start + offs_t).to(tl.int64)[:, None]
    tl.store(out_ptr + rows * C + offs_c[None, :], y.to(dtype), mask=ok)


@triton.jit
def _causal_conv1d_kernel(
    # Pointers.
    x_ptr,  # [T, C], rows strided by stride_xt, channels contiguous
    weight_ptr,  # [C, W] contiguous
    conv_state_ptr,  # [S, C, W - 1] contiguous: read, then written for the batch's slots
    out_ptr,  # [T, C] contiguous
    cu_seqlens_q_ptr,  # [B + 1] int32
    seq_lens_ptr,  # [B] int32
    state_slots_ptr,  # [B] int32
    # Sizes and strides.
    num_seqs,
    num_rows,
    C,
    stride_xt,
    span,  # tokens a program takes: program_id(2) takes rows span * z .. of its sequence
    # Meta-parameters.
    W: tl.constexpr,
    W_PAD: tl.constexpr,  # next_power_of_2(W - 1): lanes of the window
    BLOCK_T: tl.constexpr,
    BLOCK_C: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_wait(PDL)  # first: see kernels/pdl.py
    # -- map the program to its sequence and channels; padded rows are zeroed first --
    b = tl.program_id(0)
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    z = tl.program_id(2)
    c_ok = offs_c < C
    if z == 0:
        zero_padded_rows(out_ptr + offs_c, c_ok, b, cu_seqlens_q_ptr, num_seqs, num_rows, C)
    start, n, continues, slot = sequence(b, cu_seqlens_q_ptr, seq_lens_ptr, state_slots_ptr)
    if n == 0:
        return  # a padded sequence: its slot stays as it is
    window_ptr = conv_state_ptr + (slot * C + offs_c) * (W - 1)  # [BLOCK_C]

    # -- each token's W taps: products rounded to the dtype, summed in tap order in float32.
    # The blocks before row W - 1 may read the window; the others take every tap from the
    # chunk's rows (no window loads: they are strided by W - 1, one element each), in a loop of
    # their own, so the row loads take vector width and neither loop carries the other's --
    end = tl.minimum(z * span + span, n)  # this program's rows: z * span .. end
    first = z * span
    past = first + tl.cdiv(tl.maximum(W - 1 - first, 0), BLOCK_T) * BLOCK_T  # first block >= W - 1
    for part in tl.static_range(2):  # the blocks before `past`, then the others
        lo = first if part == 0 else past
        hi = tl.minimum(past, end) if part == 0 else end
        for t0 in range(lo, hi, BLOCK_T):
            _conv_block(
                x_ptr,
                window_ptr,
                weight_ptr,
                out_ptr,
                start,
                t0,
                end,
                offs_c,
                c_ok,
                continues,
                stride_xt,
                C,
                W,
                BLOCK_T,
                BLOCK_C,
                part == 0,
            )

    # -- the new window, u's last W - 1 entries: read by every lane before any is stored, by
    # the one program that reads the old window (the rows before span, z 0, read it) --
    if z != 0:
        return
    offs_w = tl.arange(0, W_PAD)
    w_ok = c_ok[:, None] & (offs_w < W - 1)[None, :]
    src = (n + offs_w - (W - 1))[None, :]
    new = _conv_input(
        x_ptr, window_ptr[:, None], start, src, offs_c[:, None], w_ok, continues, stride_xt, W
    )  # [BLOCK_C, W_PAD]
    tl.debug_barrier()
    tl.store(window_ptr[:, None] + offs_w[None, :], new, mask=w_ok)


def causal_conv1d(
    x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor, attn: AttentionMetadata
) -> torch.Tensor:
    """Semantics: see gated_delta.causal_conv1d: per sequence, out[t] = silu(sum_j weight[:, j]
    * u[t + j]) over u = its window (zeros at position 0) followed by x's rows; the window
    becomes u's last W - 1. Padded rows (past cu_seqlens_q[-1]) are zeros, and sequences with
    no rows leave their slots as they are.

    x: [T, C], rows may be strided, channels contiguous; weight: [C, W]; conv_state: [S, C,
    W - 1] contiguous, written in place; all three in one dtype. Returns [T, C] contiguous.
    Reads no device value on the host: a graph can capture it."""
    T, C = x.shape
    W = weight.shape[1]
    B = step_sequences(attn)
    assert weight.shape == (C, W) and weight.is_contiguous(), (weight.shape, C)
    assert conv_state.shape[1:] == (C, W - 1) and conv_state.is_contiguous(), conv_state.shape
    assert x.dtype == weight.dtype == conv_state.dtype, (x.dtype, weight.dtype, conv_state.dtype)
    assert x.stride(1) == 1, x.stride()
    out = torch.empty(T, C, dtype=x.dtype, device=x.device)
    if T == 0:
        return out
    tiles = CONV_DECODE if attn.max_query_len <= 1 else CONV_PREFILL
    block_c = min(tiles.block_c, next_power_of_2(C))
    # the longest sequence has at most T rows (a graph's T: its padded size)
    span = max(CONV_SPAN, cdiv(T, CONV_SPLITS))
    assert span >= W - 1, (span, W)  # so that only z 0's rows read the old window
    _causal_conv1d_kernel[(B, cdiv(C, block_c), cdiv(T, span))](
        x_ptr=x,
        weight_ptr=weight,
        conv_state_ptr=conv_state,
        out_ptr=out,
        cu_seqlens_q_ptr=attn.cu_seqlens_q,
        seq_lens_ptr=attn.seq_lens,
        state_slots_ptr=attn.state_slots,
        num_seqs=B,
        num_rows=T,
        C=C,
        stride_xt=x.stride(0),
        span=span,
        W=W,
        W_PAD=next_power_of_2(W - 1),
        BLOCK_T=tiles.block_t,
        BLOCK_C=block_c,
        num_warps=tiles.num_warps,
        enable_fp_fusion=False,
        **pdl_kwargs(x.device),
    )
    return out
