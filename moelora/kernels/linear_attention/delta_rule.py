"""gated_delta.gated_delta_rule in Triton: the gated delta rule over each request's state, in
its fused recurrent form, for decode and prefill alike.

Algorithm. One program per (block of BLOCK_V value columns, value head, sequence) holds its
[K, BLOCK_V] tile of the state in float32 registers, loaded from the sequence's slot (zeros
from position 0), and walks the sequence's tokens in order: q and k L2-normed (those of the
q/k head that serves this value head among H // Hk), q scaled by K ** -0.5, S = exp(g) S,
S += k (beta (v - k^T S))^T, o = S^T q, as the reference's token loop does, so a request's
numbers do not depend on how its prompt was chunked. The tile goes back to the slot after the
last token. A prefill chunk's tokens thus run one after another, unless the caller asks for
the block form (delta_chunked.py). The value blocks are the grid's fastest axis: programs
launched together read neighbouring pieces of the same state rows (a tile is K pieces of
BLOCK_V floats, a row of V apart), not pieces of different sequences' states.
Graphs and padding: see sequences.py.

Legend: T = tokens, B = sequences, S = state slots, Hk = q/k heads, H = value heads,
K = key head dim, V = value head dim.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from moelora.kernels.gated_delta import _L2_EPS, DeltaGates
from moelora.kernels.linear_attention.delta_chunked import chunked_gated_delta_rule
from moelora.kernels.linear_attention.gates import (
    SOFTPLUS_THRESHOLD,
    delta_gates,
    log_decay,
    write_strength,
)
from moelora.kernels.linear_attention.sequences import (
    check_delta_inputs,
    sequence,
    step_sequences,
    strides,
    zero_padded_rows,
)
from moelora.kernels.pdl import pdl_kwargs, pdl_wait
from moelora.kernels.sizes import cdiv, next_power_of_2

if TYPE_CHECKING:
    from moelora.step.batch import AttentionMetadata


@dataclass(frozen=True)
class DeltaTiles:
    block_v: int  # value columns a program owns
    num_warps: int


# A decode step moves each sequence's whole state once: 32 value columns a program (128-byte
# row pieces; 4 programs a value head, so one sequence of 32 heads still fills 128
# multiprocessors), with 4 warps so that the [K, 32] float32 tile takes no spills at K = 128
# (the delta-rule tile sweep on the benchmarks page has the alternatives). A prefill's token
# loop keeps one warp: each token's two sums over K stay inside it, where 4 warps would meet
# in shared memory twice a token, in the loop's serial chain.
DELTA_DECODE = DeltaTiles(block_v=32, num_warps=4)
DELTA_PREFILL = DeltaTiles(block_v=8, num_warps=1)


@triton.jit
def _unit(x, eps):
    """x / sqrt(|x|^2 + eps), in float32: the reference's _l2norm."""
    return x * tl.rsqrt(tl.sum(x * x, axis=0) + eps)


@triton.jit
def _token_inputs(
    q_head,
    k_head,
    v_head,
    g_head,
    beta_head,
    t64,
    ok,
    k_ok,
    v_ok,
    stride_qt,
    stride_kt,
    stride_vt,
    stride_gt,
    stride_bt,
    dt_bias,
    decay,
    RAW_GATES: tl.constexpr,
    THRESHOLD: tl.constexpr,
):
    """(q, k, v, g, beta) of token t64 in float32 (g as stored, or with RAW_GATES computed
    from the a that g_head reads, beta from the b that beta_head reads, as delta_gates
    computes them); zeros where not ok (past the sequence's last token: loaded ahead, never
    used)."""
    q = tl.load(q_head + t64 * stride_qt, mask=k_ok & ok, other=0.0).to(tl.float32)
    k = tl.load(k_head + t64 * stride_kt, mask=k_ok & ok, other=0.0).to(tl.float32)
    v = tl.load(v_head + t64 * stride_vt, mask=v_ok & ok, other=0.0).to(tl.float32)
    g = tl.load(g_head + t64 * stride_gt, mask=ok, other=0.0)
    beta = tl.load(beta_head + t64 * stride_bt, mask=ok, other=0.0)
    if RAW_GATES:
        g = log_decay(g, dt_bias, decay, THRESHOLD)
        beta = write_strength(beta)
    return q, k, v, g, beta.to(tl.float32)


@triton.jit
def _gated_delta_rule_kernel(
    # Pointers.
    q_ptr,  # [T, Hk, K], strided by stride_qt, stride_qh, K contiguous
    k_ptr,  # [T, Hk, K], strided by stride_kt, stride_kh, K contiguous
    v_ptr,  # [T, H, V], strided by stride_vt, stride_vh, V contiguous
    g_ptr,  # [T, H] float32, strided by stride_gt, stride_gh (RAW_GATES: in_proj's a)
    beta_ptr,  # [T, H], strided by stride_bt, stride_bh (RAW_GATES: in_proj's b)
    a_log_ptr,  # [H], with RAW_GATES (g_ptr when unused)
    dt_bias_ptr,  # [H], likewise
    state_ptr,  # [S, H, K, V] float32 contiguous: read, then written for the batch's slots
    out_ptr,  # [T, H, V] contiguous, v's dtype
    cu_seqlens_q_ptr,  # [B + 1] int32
    seq_lens_ptr,  # [B] int32
    state_slots_ptr,  # [B] int32
    # Sizes and strides.
    num_seqs,
    num_rows,
    H,
    K,
    V,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_gt,
    stride_gh,
    stride_bt,
    stride_bh,
    scale,  # K ** -0.5
    eps,  # of the q/k L2 norm
    # Meta-parameters.
    GROUPS: tl.constexpr,  # H // Hk: value heads per q/k head
    BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr,
    RAW_GATES: tl.constexpr,  # g and beta computed from a and b here (DeltaGates)
    THRESHOLD: tl.constexpr,  # softplus's (gates.py)
    PDL: tl.constexpr,
):
    pdl_wait(PDL)  # first: see kernels/pdl.py
    # -- map the program to its sequence, value head and value columns --
    b = tl.program_id(2)
    h = tl.program_id(1)
    offs_k = tl.arange(0, BLOCK_K)
    offs_v = tl.program_id(0) * BLOCK_V + tl.arange(0, BLOCK_V)
    k_ok, v_ok = offs_k < K, offs_v < V
    tile_ok = k_ok[:, None] & v_ok[None, :]
    out_head = out_ptr + h * V + offs_v  # + row * H * V
    zero_padded_rows(out_head, v_ok, b, cu_seqlens_q_ptr, num_seqs, num_rows, H * V)
    start, n, continues, slot = sequence(b, cu_seqlens_q_ptr, seq_lens_ptr, state_slots_ptr)
    if n == 0:
        return  # a padded sequence: its slot stays as it is

    # -- the state tile [BLOCK_K, BLOCK_V] in float32, zeros from position 0 --
    s_ptrs = state_ptr + ((slot * H + h) * K + offs_k[:, None]) * V + offs_v[None, :]
    s = tl.load(s_ptrs, mask=tile_ok & continues, other=0.0)
    q_head = q_ptr + (h // GROUPS) * stride_qh + offs_k
    k_head = k_ptr + (h // GROUPS) * stride_kh + offs_k
    v_head = v_ptr + h * stride_vh + offs_v
    g_head = g_ptr + h * stride_gh
    beta_head = beta_ptr + h * stride_bh
    dt_bias = 0.0
    decay = 0.0
    if RAW_GATES:
        dt_bias = tl.load(dt_bias_ptr + h).to(tl.float32)
        decay = -tl.exp(tl.load(a_log_ptr + h).to(tl.float32))

    # -- the tokens in order, each a decode step; the next token's inputs are loaded before
    # this one's arithmetic, so that their latency is not in the recurrence's chain --
    nq, nk, nv, ng, nbeta = _token_inputs(
        q_head,
        k_head,
        v_head,
        g_head,
        beta_head,
        start.to(tl.int64),
        0 < n,
        k_ok,
        v_ok,
        stride_qt,
        stride_kt,
        stride_vt,
        stride_gt,
        stride_bt,
        dt_bias,
        decay,
        RAW_GATES,
        THRESHOLD,
    )
    for i in range(0, n):
        t64 = (start + i).to(tl.int64)
        q, k, v, g, beta = nq, nk, nv, ng, nbeta
        nq, nk, nv, ng, nbeta = _token_inputs(
            q_head,
            k_head,
            v_head,
            g_head,
            beta_head,
            t64 + 1,
            i + 1 < n,
            k_ok,
            v_ok,
            stride_qt,
            stride_kt,
            stride_vt,
            stride_gt,
            stride_bt,
            dt_bias,
            decay,
            RAW_GATES,
            THRESHOLD,
        )
        q = _unit(q, eps) * scale
        k = _unit(k, eps)
        s = s * tl.exp(g)
        remembered = tl.sum(s * k[:, None], axis=0)  # [BLOCK_V]: what the state gives for k
        delta = (v - remembered) * beta
        s = s + k[:, None] * delta[None, :]
        o = tl.sum(s * q[:, None], axis=0)
        tl.store(out_head + t64 * H * V, o.to(out_ptr.dtype.element_ty), mask=v_ok)
    tl.store(s_ptrs, s, mask=tile_ok)


def gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None,
    beta: torch.Tensor | None,
    state: torch.Tensor,
    attn: AttentionMetadata,
    *,
    gates: DeltaGates | None = None,
    chunked: bool = False,
) -> torch.Tensor:
    """Semantics: see gated_delta.gated_delta_rule: the delta rule per sequence from its slot's
    state (zeros at position 0), the slot then holding the state after its last token. Padded
    rows (past cu_seqlens_q[-1]) are zeros, and sequences with no rows leave their slots as
    they are.

    q, k: [T, Hk, K] (each serves H // Hk value heads, in order); v: [T, H, V]; the last dim
    of each contiguous, rows and heads may be strided; g (log decay, float32), beta: [T, H],
    or both None and gates (a, b [T, H], A_log, dt_bias [H]), which the kernel turns into
    them as it reads each token; state: [S, H, K, V] float32 contiguous, written in place.
    Returns [T, H, V] contiguous in v's dtype. Reads no device value on the host: a graph can
    capture it. chunked: a prefill step takes the block form (delta_chunked.py; g and beta
    stored first), equal up to float rounding."""
    if chunked and attn.max_query_len > 1:
        g, beta = (g, beta) if gates is None else _stored(g, beta, gates)
        return chunked_gated_delta_rule(q, k, v, g, beta, state, attn)
    gate_args = _gate_args(g, beta, gates)
    check_delta_inputs(q, k, v, gate_args["g_ptr"], gate_args["beta_ptr"], state, gates)
    (T, Hk, K), (H, V), B = q.shape, v.shape[1:], step_sequences(attn)
    out = torch.empty(T, H, V, dtype=v.dtype, device=v.device)
    if T == 0:
        return out
    tiles = DELTA_DECODE if attn.max_query_len <= 1 else DELTA_PREFILL
    block_v = min(tiles.block_v, next_power_of_2(V))
    _gated_delta_rule_kernel[(cdiv(V, block_v), H, B)](
        q_ptr=q,
        k_ptr=k,
        v_ptr=v,
        state_ptr=state,
        out_ptr=out,
        cu_seqlens_q_ptr=attn.cu_seqlens_q,
        seq_lens_ptr=attn.seq_lens,
        state_slots_ptr=attn.state_slots,
        **dict(num_seqs=B, num_rows=T, H=H, K=K, V=V),
        **strides("q", q),
        **strides("k", k),
        **strides("v", v),
        **gate_args,
        scale=K**-0.5,
        eps=_L2_EPS,
        GROUPS=H // Hk,
        BLOCK_K=next_power_of_2(K),
        BLOCK_V=block_v,
        THRESHOLD=SOFTPLUS_THRESHOLD,
        num_warps=tiles.num_warps,
        enable_fp_fusion=False,
        **pdl_kwargs(v.device),
    )
    return out


def _stored(
    g: torch.Tensor | None, beta: torch.Tensor | None, gates: DeltaGates
) -> tuple[torch.Tensor, torch.Tensor]:
    """g and beta of gates, by delta_gates' launch (what the block form reads)."""
    assert g is None and beta is None, "g and beta, or the gates they come from"
    return delta_gates(*gates)


def _gate_args(g: torch.Tensor | None, beta: torch.Tensor | None, gates: DeltaGates | None) -> dict:
    """The kernel's gate pointers and strides: g and beta as stored, or the raw a and b that
    gates gives (RAW_GATES)."""
    if gates is None:
        assert g is not None and beta is not None, "g and beta, or the gates they come from"
        raw = dict(a_log_ptr=g, dt_bias_ptr=g, RAW_GATES=False)
    else:
        assert g is None and beta is None, "g and beta, or the gates they come from"
        g, beta = gates.a, gates.b
        raw = dict(a_log_ptr=gates.A_log, dt_bias_ptr=gates.dt_bias, RAW_GATES=True)
    return dict(g_ptr=g, beta_ptr=beta, **strides("g", g), **strides("b", beta), **raw)
