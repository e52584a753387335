"""Multi-head latent attention's expanded form in Triton: a sequence given all its keys and values
expanded (kernels/mla.ExpandedKv) attends to them, as kernels/mla.expanded_attention_ (the
reference) has it.

Algorithm
---------
kv_b_proj expanded the sequence's keys and values (the layer): rows cu_seqlens_k[b] ..
cu_seqlens_k[b + 1] - 1, its positions from 0, so no cache is read. Head h's score of a query
row for key row j is scale * (q_nope . k_nope[j, h] + q_pe . k_pe[j]): two dots into one
accumulator, so the shared rotary key is never copied per head and no dimension is padded from
N + R (192 at DeepSeek's sizes) to a power of two. Values are V wide (128).

One program owns one head and one block of BLOCK_Q query rows of a sequence, taken from the
step's work table (paged.attention_work, the longest blocks first), so the grid depends on
shapes only and a prefill step can be captured in a CUDA graph. Programs of sequences not given
all their keys return at once: the latent form (kernels/attention/mla.py) attends to those.
The program walks the keys from position 0 in BLOCK_N tiles with the flash-attention online
softmax (base 2, fp32 running max, sum and accumulator). Tiles of keys before the block's
first query position are visible to every row and compute no mask; the tiles from there to
the block's last position mask after the exponent, so a key's weight is computed alike in
both kinds of tile, and a row's sums follow the key tiles only, not where its chunk starts.

Legend: T = tokens, B = sequences, Hh = heads, N = qk_nope_head_dim, R = qk_rope_head_dim,
V = v_head_dim.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from moelora.kernels.attention.paged import LOG2_E, attention_work
from moelora.kernels.mla import ExpandedKv
from moelora.kernels.pdl import pdl_kwargs, pdl_wait
from moelora.kernels.reference import WORK_SEQ
from moelora.kernels.sizes import next_power_of_2

if TYPE_CHECKING:
    from moelora.step.batch import AttentionMetadata

_WORK_SEQ = tl.constexpr(WORK_SEQ)  # a work entry: sequence * WORK_SEQ + blocks from its last


@dataclass(frozen=True)
class ExpandedConfig:
    """Tiles of one launch: block_q query rows of one head, keys block_n at a time."""

    block_q: int
    block_n: int
    num_warps: int
    num_stages: int


# First cut, not yet swept on a GPU: flash attention's usual Hopper tiles for head dims of 128
# to 256 (the accumulator is [128, V] fp32 over 8 warps).
CONFIG = ExpandedConfig(block_q=128, block_n=64, num_warps=8, num_stages=2)
# The interpreter runs every program in numpy: small tiles keep CPU tests fast, and give short
# prompts several blocks and tiles.
INTERPRETER_CONFIG = ExpandedConfig(block_q=16, block_n=8, num_warps=1, num_stages=1)


@triton.jit
def _attend_tile(
    q_nope,
    q_pe,
    m_i,
    l_i,
    acc,
    start,
    q_pos,
    kv_stop,
    k_base,  # [1, BLOCK_NOPE] pointers: the sequence's first key row, this head, each dim
    e_base,  # [1, BLOCK_ROPE]: k_pe's
    v_base,  # [1, BLOCK_V]: v's
    k_dims,  # [1, BLOCK_NOPE] the dims' mask, and likewise
    e_dims,
    v_dims,
    stride_kt,
    stride_et,
    stride_vt,
    scale_log2,
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """One key tile of the online softmax: (m_i, l_i, acc) after keys start .. start+BLOCK_N-1
    of the sequence. Without MASKED every row sees every key of the tile (the caller knows)."""
    offs_j = start + tl.arange(0, BLOCK_N)
    rows = offs_j.to(tl.int64)[:, None]
    j_mask = offs_j < kv_stop
    k = tl.load(k_base + rows * stride_kt, mask=j_mask[:, None] & k_dims, other=0.0)
    k_pe = tl.load(e_base + rows * stride_et, mask=j_mask[:, None] & e_dims, other=0.0)
    qk = tl.dot(q_nope, tl.trans(k), input_precision=DOT_PRECISION)
    qk = tl.dot(q_pe, tl.trans(k_pe), acc=qk, input_precision=DOT_PRECISION) * scale_log2
    if MASKED:
        visible = (offs_j[None, :] <= q_pos[:, None]) & j_mask[None, :]
        m_new = tl.maximum(m_i, tl.max(tl.where(visible, qk, float("-inf")), 1))
    else:
        m_new = tl.maximum(m_i, tl.max(qk, 1))
    # A row with nothing visible yet keeps max -inf; subtract 0 then so no NaN appears.
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.math.exp2(m_i - m_ref)
    # the mask applies after the exponent: a key's weight is computed alike in both kinds of
    # tile (the compiler fuses the scaling into the subtraction in both)
    p = tl.math.exp2(qk - m_ref[:, None])
    if MASKED:
        p = tl.where(visible, p, 0.0)
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(v_base + rows * stride_vt, mask=j_mask[:, None] & v_dims, other=0.0)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _mla_expanded_kernel(
    # Pointers
    q_nope_ptr,  # [T, Hh, N]
    q_pe_ptr,  # [T, Hh, R]
    k_nope_ptr,  # [T, Hh, N]
    k_pe_ptr,  # [T, R]
    v_ptr,  # [T, Hh, V]
    out_ptr,  # [T, Hh, V]: only the rows of the sequences given all their keys are written
    cu_seqlens_q_ptr,
    seq_lens_ptr,
    cu_seqlens_k_ptr,  # [B + 1] int32: each sequence's key rows in k_nope, k_pe and v
    work_ptr,  # [NW] int32: each program's (sequence, block), attention_work
    # Sizes
    nope_dim,
    rope_dim,
    v_dim,
    scale_log2,
    # Strides
    stride_qt,
    stride_qh,
    stride_qd,
    stride_pt,  # q_pe's
    stride_ph,
    stride_pd,
    stride_kt,
    stride_kh,
    stride_kd,
    stride_et,  # k_pe's
    stride_ed,
    stride_vt,
    stride_vh,
    stride_vd,
    stride_ot,
    stride_oh,
    stride_od,
    # Meta-parameters
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_NOPE: tl.constexpr,
    BLOCK_ROPE: tl.constexpr,
    BLOCK_V: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_wait(PDL)  # first: see kernels/pdl.py
    # entries past the step's blocks are -1 (a graph's grid is sized for its largest step)
    pid_h = tl.program_id(0)
    entry = tl.load(work_ptr + tl.program_id(1))
    if entry < 0:
        return
    pid_b = entry // _WORK_SEQ
    q_start = tl.load(cu_seqlens_q_ptr + pid_b)
    q_len = tl.load(cu_seqlens_q_ptr + pid_b + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + pid_b)
    k_start = tl.load(cu_seqlens_k_ptr + pid_b)
    if tl.load(cu_seqlens_k_ptr + pid_b + 1) - k_start != seq_len:
        return  # not given all its keys: the latent form's
    pid_m = tl.cdiv(q_len, BLOCK_Q) - 1 - entry % _WORK_SEQ

    # -- The block's query rows and their positions --------------------------------------------
    offs_m = pid_m * BLOCK_Q + tl.arange(0, BLOCK_Q)
    m_mask = offs_m < q_len
    prefix = seq_len - q_len
    q_pos = prefix + offs_m
    row = (q_start + offs_m).to(tl.int64)
    offs_n_dim = tl.arange(0, BLOCK_NOPE)
    offs_r_dim = tl.arange(0, BLOCK_ROPE)
    offs_v_dim = tl.arange(0, BLOCK_V)
    n_mask_dim = offs_n_dim < nope_dim
    r_mask_dim = offs_r_dim < rope_dim
    v_mask_dim = offs_v_dim < v_dim
    q_nope = tl.load(
        q_nope_ptr + row[:, None] * stride_qt + pid_h * stride_qh + offs_n_dim[None, :] * stride_qd,
        mask=m_mask[:, None] & n_mask_dim[None, :],
        other=0.0,
    )
    q_pe = tl.load(
        q_pe_ptr + row[:, None] * stride_pt + pid_h * stride_ph + offs_r_dim[None, :] * stride_pd,
        mask=m_mask[:, None] & r_mask_dim[None, :],
        other=0.0,
    )
    # the dots run in the keys' dtype (fp32 accumulators)
    q_nope = q_nope.to(k_nope_ptr.dtype.element_ty)
    q_pe = q_pe.to(k_pe_ptr.dtype.element_ty)

    # -- Keys 0 .. the block's last position, from the sequence's key rows ---------------------
    first = k_start.to(tl.int64)
    k_base = k_nope_ptr + first * stride_kt + pid_h * stride_kh + offs_n_dim[None, :] * stride_kd
    e_base = k_pe_ptr + first * stride_et + offs_r_dim[None, :] * stride_ed
    v_base = v_ptr + first * stride_vt + pid_h * stride_vh + offs_v_dim[None, :] * stride_vd
    k_dims, e_dims, v_dims = n_mask_dim[None, :], r_mask_dim[None, :], v_mask_dim[None, :]
    m_i = tl.full([BLOCK_Q], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_Q], dtype=tl.float32)
    acc = tl.zeros([BLOCK_Q, BLOCK_V], dtype=tl.float32)
    diagonal = prefix + pid_m * BLOCK_Q  # the block's first query position
    whole = diagonal // BLOCK_N * BLOCK_N  # keys before it in whole tiles: no mask
    kv_stop = prefix + tl.minimum(q_len, (pid_m + 1) * BLOCK_Q)
    for start in range(0, whole, BLOCK_N):
        m_i, l_i, acc = _attend_tile(
            q_nope,
            q_pe,
            m_i,
            l_i,
            acc,
            start,
            q_pos,
            kv_stop,
            k_base,
            e_base,
            v_base,
            k_dims,
            e_dims,
            v_dims,
            stride_kt,
            stride_et,
            stride_vt,
            scale_log2,
            BLOCK_N,
            False,
            DOT_PRECISION,
        )
    for start in range(whole, kv_stop, BLOCK_N):
        m_i, l_i, acc = _attend_tile(
            q_nope,
            q_pe,
            m_i,
            l_i,
            acc,
            start,
            q_pos,
            kv_stop,
            k_base,
            e_base,
            v_base,
            k_dims,
            e_dims,
            v_dims,
            stride_kt,
            stride_et,
            stride_vt,
            scale_log2,
            BLOCK_N,
            True,
            DOT_PRECISION,
        )

    # every row sees key 0 (itself at least): l_i > 0
    out = acc / l_i[:, None]
    tl.store(
        out_ptr + row[:, None] * stride_ot + pid_h * stride_oh + offs_v_dim[None, :] * stride_od,
        out.to(out_ptr.dtype.element_ty),
        mask=m_mask[:, None] & v_mask_dim[None, :],
    )


def expanded_attention_(
    out: torch.Tensor,
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    kv: ExpandedKv,
    attn: AttentionMetadata,
    scale: float,
    *,
    config: ExpandedConfig | None = None,
) -> None:
    """Semantics: kernels/mla.expanded_attention_'s. One launch, whose grid depends on shapes
    only (the step's work table): a prefill step can be captured. config: tests set it."""
    _check(out, q_nope, q_pe, kv, attn)
    T, Hh, N = q_nope.shape
    if T == 0 or attn.seq_lens.shape[0] == 0:
        return
    config, work = _plan(q_nope, attn, config)
    R, V = q_pe.shape[-1], kv.v.shape[-1]
    _mla_expanded_kernel[(Hh, work.shape[0])](
        q_nope_ptr=q_nope,
        q_pe_ptr=q_pe,
        k_nope_ptr=kv.k_nope,
        k_pe_ptr=kv.k_pe,
        v_ptr=kv.v,
        out_ptr=out,
        cu_seqlens_q_ptr=attn.cu_seqlens_q,
        seq_lens_ptr=attn.seq_lens,
        cu_seqlens_k_ptr=kv.cu_seqlens_k,
        work_ptr=work,
        nope_dim=N,
        rope_dim=R,
        v_dim=V,
        scale_log2=scale * LOG2_E,
        stride_qt=q_nope.stride(0),
        stride_qh=q_nope.stride(1),
        stride_qd=q_nope.stride(2),
        stride_pt=q_pe.stride(0),
        stride_ph=q_pe.stride(1),
        stride_pd=q_pe.stride(2),
        stride_kt=kv.k_nope.stride(0),
        stride_kh=kv.k_nope.stride(1),
        stride_kd=kv.k_nope.stride(2),
        stride_et=kv.k_pe.stride(0),
        stride_ed=kv.k_pe.stride(1),
        stride_vt=kv.v.stride(0),
        stride_vh=kv.v.stride(1),
        stride_vd=kv.v.stride(2),
        stride_ot=out.stride(0),
        stride_oh=out.stride(1),
        stride_od=out.stride(2),
        BLOCK_Q=config.block_q,
        BLOCK_N=config.block_n,
        BLOCK_NOPE=max(next_power_of_2(N), 16),
        BLOCK_ROPE=max(next_power_of_2(R), 16),
        BLOCK_V=max(next_power_of_2(V), 16),
        DOT_PRECISION="ieee" if kv.k_nope.dtype == torch.float32 else None,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        **pdl_kwargs(q_nope.device),
    )


def _plan(
    q_nope: torch.Tensor, attn: AttentionMetadata, config: ExpandedConfig | None
) -> tuple[ExpandedConfig, torch.Tensor]:
    """The tiles and the work table of a launch: the step's own where planned for these
    tiles, else one built here."""
    config = config or (CONFIG if q_nope.is_cuda else INTERPRETER_CONFIG)
    work = attn.work
    if work is None or attn.work_block_q != config.block_q:
        work = attention_work(attn.cu_seqlens_q, q_nope.shape[0], config.block_q)
    return config, work


def _check(
    out: torch.Tensor,
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    kv: ExpandedKv,
    attn: AttentionMetadata,
) -> None:
    T, Hh, N = q_nope.shape
    R, V = q_pe.shape[-1], kv.v.shape[-1]
    assert q_pe.shape == (T, Hh, R), f"q_pe {tuple(q_pe.shape)}, q_nope {tuple(q_nope.shape)}"
    K = kv.k_nope.shape[0]
    assert kv.k_nope.shape == (K, Hh, N), f"k_nope {tuple(kv.k_nope.shape)}, q_nope {(T, Hh, N)}"
    assert kv.k_pe.shape == (K, R), f"k_pe {tuple(kv.k_pe.shape)}, expected {(K, R)}"
    assert kv.v.shape == (K, Hh, V) and out.shape == (T, Hh, V), (kv.v.shape, out.shape)
    assert kv.k_nope.dtype == kv.k_pe.dtype == kv.v.dtype, (kv.k_nope.dtype, kv.v.dtype)
    num_seqs = attn.seq_lens.shape[0]
    assert attn.cu_seqlens_q.shape == (num_seqs + 1,), "cu_seqlens_q must be [B + 1]"
    assert kv.cu_seqlens_k.shape == (num_seqs + 1,), "cu_seqlens_k must be [B + 1]"
