"""MLA's absorption of kv_b_proj in Triton: each head's queries into the latent space and its
weighted latents out of it (kernels/mla.absorb_q and absorb_out are the references).

Semantics: out[t, h] = a[t, h] @ W[h], where W[h] is a [K, NOUT] view of head h's rows of kv_b
[Hh (N + V), L]: its N key rows as they lie (q side: K = N, NOUT = L), or its V value rows
transposed (out side: K = L, NOUT = V). One program owns a block of BT tokens, one head and
BN output columns, and walks K in BK steps, reading kv_b in its own dtype (no float32 copy of
the weight).

Precision. The references compute in float32 on the weight's values. Products of two bf16 (or
fp16) values are exact in float32, so the q side's dot on the tensor cores, with a float32
accumulator, is the reference's sum of the same products. The out side's rows are float32 (the
attention's output): each is split into a high part in the weight's dtype and the remainder,
rounded to it too, and both are dotted with the weight (the weight itself is exact in its
dtype), which leaves about 2^-16 of a row's relative error, near float32's own rounding of the
sums. float32 weights (the GPU tests against transformers) take ieee float32 dots.

No host read and a grid from shapes only: a decode step captures it in its graph.

Legend: T = tokens, Hh = heads, N = qk_nope_head_dim, V = v_head_dim, L = kv_lora_rank.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moelora.kernels.pdl import pdl_kwargs, pdl_wait
from moelora.kernels.sizes import cdiv

# how a program's dot reads its rows: "plain" (the weight's dtype), "split" (float32 rows as
# two parts in the weight's dtype), "ieee" (float32 weight)
_DOTS = ("plain", "split", "ieee")


@triton.jit(do_not_specialize=["T"])  # one compile for every batch size (graph capture)
def _absorb_kernel(
    # Pointers.
    a_ptr,  # [T, Hh, K] rows
    w_ptr,  # kv_b [Hh * HEAD_ROWS, L]
    out_ptr,  # [T, Hh, NOUT] float32 (or the rows' final dtype: rounded once)
    # Sizes and strides.
    T,
    stride_at,
    stride_ah,
    stride_ot,
    stride_oh,
    stride_wr,  # kv_b's row stride
    stride_wk,  # W[h]'s, along K and NOUT: (stride_wr, 1) q side, (1, stride_wr) out side
    stride_wn,
    # Meta-parameters.
    K: tl.constexpr,
    NOUT: tl.constexpr,
    HEAD_ROWS: tl.constexpr,  # N + V: kv_b's rows a head
    ROW0: tl.constexpr,  # W[h]'s first row inside the head's: 0 (keys) or N (values)
    DOT: tl.constexpr,  # one of _DOTS
    BT: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_wait(PDL)  # first: see kernels/pdl.py
    # -- program -> (token block, head, output columns) --
    pid_t = tl.program_id(0)
    head = tl.program_id(1)
    offs_t = pid_t * BT + tl.arange(0, BT)
    offs_n = tl.program_id(2) * BN + tl.arange(0, BN)
    offs_k = tl.arange(0, BK)
    t_ok = offs_t < T
    n_ok = offs_n < NOUT
    a_rows = a_ptr + offs_t[:, None].to(tl.int64) * stride_at + head * stride_ah
    w_head = w_ptr + (head * HEAD_ROWS + ROW0).to(tl.int64) * stride_wr

    # -- accumulate over K in fp32 --
    acc = tl.zeros((BT, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        k_ok = (k0 + offs_k) < K
        a = tl.load(a_rows + (k0 + offs_k)[None, :], mask=t_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(
            w_head + (k0 + offs_k)[:, None] * stride_wk + offs_n[None, :] * stride_wn,
            mask=k_ok[:, None] & n_ok[None, :],
            other=0.0,
        )
        if DOT == "ieee":
            acc = tl.dot(a.to(tl.float32), w, acc=acc, input_precision="ieee")
        elif DOT == "split":
            high = a.to(w.dtype)
            low = (a - high.to(tl.float32)).to(w.dtype)
            acc = tl.dot(high, w, acc=acc)
            acc = tl.dot(low, w, acc=acc)
        else:
            acc = tl.dot(a, w, acc=acc)

    # -- store the block's rows --
    out_ptrs = out_ptr + offs_t[:, None].to(tl.int64) * stride_ot + head * stride_oh
    out = acc.to(out_ptr.dtype.element_ty)
    tl.store(out_ptrs + offs_n[None, :], out, mask=t_ok[:, None] & n_ok[None, :])


def absorb_q(q_nope: torch.Tensor, kv_b: torch.Tensor) -> torch.Tensor:
    """Semantics: kernels/mla.absorb_q's: q_lat[t, h] = q_nope[t, h] @ W_k[h] (head h's first N
    rows of kv_b). q_nope [T, Hh, N]; kv_b [Hh (N + V), L]. Returns [T, Hh, L] float32."""
    return _absorb(q_nope, kv_b, kv_b.shape[1], row0=0, transposed=False)


def absorb_out(
    o_lat: torch.Tensor,
    kv_b: torch.Tensor,
    qk_nope_head_dim: int,
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Semantics: kernels/mla.absorb_out's: out[t, h] = o_lat[t, h] @ W_v[h].T (head h's rows
    of kv_b after its first qk_nope_head_dim), rounded to out_dtype once. o_lat [T, Hh, L]
    float32. Returns [T, Hh, V] in out_dtype."""
    V = kv_b.shape[0] // o_lat.shape[1] - qk_nope_head_dim
    return _absorb(o_lat, kv_b, V, row0=qk_nope_head_dim, transposed=True, out_dtype=out_dtype)


def _absorb(
    a: torch.Tensor,
    kv_b: torch.Tensor,
    n_out: int,
    *,
    row0: int,
    transposed: bool,
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """out [T, Hh, n_out] = a [T, Hh, K] @ W[h] in float32, rounded to out_dtype, W[h] head
    h's kv_b rows from row0 on, as they lie [K, n_out] or transposed [n_out, K] -> [K, n_out]."""
    T, Hh, K = a.shape
    assert a.stride(2) == 1 and kv_b.stride(1) == 1, (a.stride(), kv_b.stride())
    head_rows, L = kv_b.shape[0] // Hh, kv_b.shape[1]
    assert kv_b.shape[0] % Hh == 0 and (K if transposed else n_out) == L, (kv_b.shape, a.shape)
    assert row0 + (n_out if transposed else K) <= head_rows, (row0, n_out, K, head_rows)
    dot = _dot(a.dtype, kv_b.dtype)
    out = torch.empty(T, Hh, n_out, dtype=out_dtype, device=a.device)
    if T == 0:
        return out
    BT = 16 if T <= 16 else 32 if T <= 32 else 64
    BN, BK = 64, 64
    stride_wk, stride_wn = (1, kv_b.stride(0)) if transposed else (kv_b.stride(0), 1)
    _absorb_kernel[(cdiv(T, BT), Hh, cdiv(n_out, BN))](
        a_ptr=a,
        w_ptr=kv_b,
        out_ptr=out,
        T=T,
        stride_at=a.stride(0),
        stride_ah=a.stride(1),
        stride_ot=out.stride(0),
        stride_oh=out.stride(1),
        stride_wr=kv_b.stride(0),
        stride_wk=stride_wk,
        stride_wn=stride_wn,
        K=K,
        NOUT=n_out,
        HEAD_ROWS=head_rows,
        ROW0=row0,
        DOT=dot,
        BT=BT,
        BN=BN,
        BK=BK,
        num_warps=4,
        num_stages=2,
        **pdl_kwargs(a.device),
    )
    return out


def _dot(a_dtype: torch.dtype, w_dtype: torch.dtype) -> str:
    """The kernel's DOT for rows of a_dtype and a weight of w_dtype."""
    if w_dtype == torch.float32:
        return "ieee"
    if a_dtype == torch.float32:
        return "split"
    assert a_dtype == w_dtype, (a_dtype, w_dtype)
    return "plain"
