"""RMSNorm (fused with the residual add) and per-head q/k norm fused with rotary, in Triton.

Semantics: see reference.rms_norm, reference.rms_norm_lora and reference.rope_store_kv; these
have the same signatures and the same rounding order, so that they replace ~45 tiny torch
launches per decoder layer in a CUDA graph without moving a single bit in bf16.

Algorithm. A norm program owns one row (N <= 8192) in one block of next_power_of_2(N) lanes:
it adds the residual and rounds the sum to the input dtype, reduces the squares in float32,
scales by rsqrt(mean + eps), rounds to the input dtype, multiplies by the weight and rounds
again, as torch's separate ops do. A rotary program owns one head of one token, q and k heads
in one grid: it loads the head's D values twice, once in place and once shifted by D/2, which
gives rotate_half without a shuffle (x_rot[d] = -x[d + D/2] for d < D/2, x[d - D/2] after),
normalizes both copies with the same row scale, then forms x * cos + x_rot * sin, each product
and the sum rounded to the input dtype. With the caches, the same launch stores the rotated k
and v (a v head's program copies it, with its LoRA delta when folded).

The attention's LoRA, folded in (the order: layers/attention_lora.py): rms_norm_lora(shrink=)
also shrinks its output for q|k|v, each row's n * R shrink rows spread over programs that each
redo the cheap norm; rope_store_kv(expand=) expands that shrink into each q, k and v head first
(the delta rounded, then added, as PEFT does) and swaps the halves of the head's delta for the
partner lanes; rms_norm_lora(expand=) after attention expands o's split shrink into the row
before the residual add.

Rounding. Every op is computed in float32 and rounded once to the input dtype, which is what
torch's elementwise kernels do for bf16 and fp16 (a product of two bf16 is exact in float32).
The kernels are compiled without fp fusion so that float32 inputs are not contracted to an FMA
that torch's separate mul and add never form; only the sum of squares differs in order.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from moelora.kernels.lora import (
    TAB_A_OFF,
    TAB_A_SLICE,
    TAB_B_OFF,
    TAB_B_ROW,
    TAB_RANK,
    TAB_WIDTH,
    aligned,
    lora_slot,
)
from moelora.kernels.pdl import pdl_kwargs, pdl_wait
from moelora.kernels.sizes import cdiv, next_power_of_2
from moelora.step.lora import FoldedLora, LoraBatchInfo, LoraWeights

SHRINK_WIDE_T = 32  # rows from which a norm program shrinks twice the rank rows

# Legend: T = tokens, N = row width, Hq/Hkv = query/kv heads, D = head dim, L = table rows.


@triton.jit
def _expand_delta(
    part_ptr,
    b_slot,
    b_stride,
    b_rank,
    row,
    offs,
    mask,
    R: tl.constexpr,
    RC: tl.constexpr,
    KS: tl.constexpr,
    KS_PAD: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """[BLOCK] float32: the row's partial shrinks [KS, R] summed, times its slot's B (b_slot
    [N, r], row stride b_stride) at the columns offs. RC rank rows per step, unrolled: every
    step's loads can be in flight at once."""
    delta = tl.zeros((BLOCK,), dtype=tl.float32)
    offs_ks = tl.arange(0, KS_PAD)
    for r0 in tl.static_range(0, R, RC):
        offs_r = r0 + tl.arange(0, RC)
        r_ok = offs_r < b_rank
        part = tl.load(
            part_ptr + (row * KS + offs_ks[:, None]) * R + offs_r[None, :],
            mask=(offs_ks[:, None] < KS) & r_ok[None, :],
            other=0.0,
        )  # [KS, RC], already scaled
        b = tl.load(
            b_slot + offs[:, None] * b_stride + offs_r[None, :],
            mask=mask[:, None] & r_ok[None, :],
            other=0.0,
        )  # [BLOCK, RC]
        delta += tl.sum(b.to(tl.float32) * tl.sum(part, axis=0)[None, :], axis=1)
    return delta


@triton.jit
def _rms_norm_kernel(
    # Pointers.
    x_ptr,  # [T, KX, N], strides stride_xt and stride_xk, last dim contiguous
    res_ptr,  # [T, N] or x_ptr when HAS_RESIDUAL is False (never read then)
    weight_ptr,  # [N], x's dtype
    out_ptr,  # [T, N] contiguous
    sum_ptr,  # [T, N] contiguous, x + residual; unused without a residual
    # LoRA shrink (SHRINK; x_ptr when unused): batch info ([T] int32, [S] int32, [S] int32,
    # [S] float32), the arena and table ([S, TAB_WIDTH] int64, step/lora.LoraWeights) of the
    # A of the projection that reads out (slot s's [NS, r, N]) and the shrink [T, NS, R]
    # float32, written for rows with an enabled slot only.
    slot_ptr,
    enabled_ptr,
    rank_ptr,
    scaling_ptr,
    a_ptr,
    a_tab_ptr,
    shrunk_ptr,
    # LoRA expand (EXPAND; x_ptr when unused): the partial shrinks of the projection that
    # produced x [T, KS, 1, R] float32 (paged_attention_o_shrink), the arena and table of its
    # B (slot s's [N, r]).
    part_ptr,
    b_ptr,
    b_tab_ptr,
    # The MoE's shared expert (SHARED; x_ptr when unused): its output [T, N] and, with GATED,
    # its gate's logits [T].
    shared_ptr,
    gate_ptr,
    # Sizes and strides.
    N,
    stride_xt,
    stride_xk,
    stride_rt,
    stride_st,
    stride_gt,
    eps,
    # Meta-parameters.
    KX: tl.constexpr,  # rows of x added first: the MoE's top-k rows (1: x is the row)
    SHARED: tl.constexpr,  # the shared expert's row added to them (reference.add_shared_expert)
    GATED: tl.constexpr,  # ... scaled by the sigmoid of its gate's logit
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
    SHRINK: tl.constexpr,
    EXPAND: tl.constexpr,
    NS: tl.constexpr,
    R: tl.constexpr,
    RC: tl.constexpr,
    KS: tl.constexpr,
    KS_PAD: tl.constexpr,
    A_ALIGN: tl.constexpr,  # the shrink's LoraWeights.a_align
    PDL: tl.constexpr,
):
    pdl_wait(PDL)  # first: see kernels/pdl.py
    # -- map the program to its row; with SHRINK, also to RC of the row's NS * R shrink rows --
    row = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    dtype = out_ptr.dtype.element_ty

    if SHRINK or EXPAND:
        slot_in = tl.load(slot_ptr + row)
    if SHRINK:
        if g > 0:
            # only program 0 of a row has work without an adapter: the norm itself
            _, rank_g, _ = lora_slot(slot_in, enabled_ptr, rank_ptr, scaling_ptr)
            if rank_g == 0:
                return

    # -- the residual add, rounded to x's dtype like torch's add --
    # (the slot first, the row next, then the slot's flag and rank: in-order issue would
    # otherwise hold the row's loads behind the slot's two dependent gathers)
    if KX == 1:
        x = tl.load(x_ptr + row * stride_xt + offs, mask=mask, other=0.0)
    else:
        # the MoE's top-k rows, added as its own sum would: in k order, in fp32, then rounded
        x_sum = tl.zeros((BLOCK,), dtype=tl.float32)
        for k in tl.static_range(KX):
            xk = tl.load(x_ptr + row * stride_xt + k * stride_xk + offs, mask=mask, other=0.0)
            x_sum += xk.to(tl.float32)
        x = x_sum.to(dtype)
    if SHRINK or EXPAND:
        slot, rank, scaling = lora_slot(slot_in, enabled_ptr, rank_ptr, scaling_ptr)
    # -- the LoRA of the projection that produced x (or the shared expert): its partial
    # shrinks summed, the row expanded --
    if EXPAND:
        b_rank = tl.load(b_tab_ptr + slot * TAB_WIDTH + TAB_RANK, mask=rank > 0, other=0)
        delta = tl.zeros((BLOCK,), dtype=dtype)
        if b_rank > 0:  # 0: no enabled slot, or no such module
            delta = _expand_delta(
                part_ptr,
                b_ptr + tl.load(b_tab_ptr + slot * TAB_WIDTH + TAB_B_OFF),
                tl.load(b_tab_ptr + slot * TAB_WIDTH + TAB_B_ROW),
                b_rank,
                row,
                offs,
                mask,
                R=R,
                RC=RC,
                KS=KS,
                KS_PAD=KS_PAD,
                BLOCK=BLOCK,
            ).to(dtype)
    if SHARED:
        # the shared expert (its LoRA's delta first, where it has one), scaled by its sigmoid
        # gate, then added: each op rounded (PEFT's order)
        sh = tl.load(shared_ptr + row * stride_st + offs, mask=mask, other=0.0).to(tl.float32)
        if EXPAND:
            if b_rank > 0:
                sh = (sh + delta.to(tl.float32)).to(dtype).to(tl.float32)
        if GATED:
            logit = tl.load(gate_ptr + row * stride_gt).to(tl.float32)
            gate = (1.0 / (1.0 + tl.exp(-logit))).to(dtype).to(tl.float32)
            sh = (gate * sh).to(dtype).to(tl.float32)
        x = (x.to(tl.float32) + sh).to(dtype)
    elif EXPAND:
        if b_rank > 0:  # PEFT's order: the delta is rounded to x's dtype, then added
            x = (x.to(tl.float32) + delta.to(tl.float32)).to(dtype)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_rt + offs, mask=mask, other=0.0)
    w = tl.load(weight_ptr + offs, mask=mask, other=0.0)
    if SHRINK:
        # shrink row j is rank row j % R of slice j // R; the module's own rank masks it (0:
        # the slot's adapter has no such module, and an enabled row's shrink is zeros)
        a_row = a_tab_ptr + slot * TAB_WIDTH
        a_rank = tl.load(a_row + TAB_RANK, mask=rank > 0, other=0)
        a_slot = a_ptr + aligned(tl.load(a_row + TAB_A_OFF, mask=rank > 0, other=0), A_ALIGN)
        a_slice = aligned(tl.load(a_row + TAB_A_SLICE, mask=rank > 0, other=0), A_ALIGN)
        offs_j = g * RC + tl.arange(0, RC)
        j_ok = (offs_j % R < a_rank) & (offs_j < NS * R)
        a_j = (offs_j // R) * a_slice + (offs_j % R) * N
        a = tl.load(
            a_slot + a_j[:, None] + offs[None, :],
            mask=j_ok[:, None] & mask[None, :],
            other=0.0,
        )  # [RC, BLOCK] this program's tile of A
    if HAS_RESIDUAL:
        x = (x.to(tl.float32) + r.to(tl.float32)).to(dtype)
        if g == 0:
            tl.store(sum_ptr + row * N + offs, x, mask=mask)
    elif EXPAND:
        tl.store(sum_ptr + row * N + offs, x, mask=mask)  # s is x, which the delta changed

    # -- the norm in float32; masked lanes are 0 and add nothing to the sum of squares --
    h = x.to(tl.float32)
    scale = tl.rsqrt(tl.sum(h * h, axis=0) / N + eps)
    normed = (h * scale).to(dtype)

    # -- the weight multiplies the rounded norm, and the product is rounded again --
    out = (w.to(tl.float32) * normed.to(tl.float32)).to(dtype)
    if g == 0:
        tl.store(out_ptr + row * N + offs, out, mask=mask)

    # -- this program's rows of out @ A.T, scaled; zeros past the rank (a whole shrink row) --
    if SHRINK:
        if rank > 0:
            s_j = tl.sum(a.to(tl.float32) * out.to(tl.float32)[None, :], axis=1) * scaling
            tl.store(shrunk_ptr + row * NS * R + offs_j, s_j, mask=offs_j < NS * R)


def _check_rows(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    shared: torch.Tensor | None = None,
    shared_gate: torch.Tensor | None = None,
) -> None:
    """x [T, N] or [T, KX, N] (the MoE's top-k rows), residual [T, N] or None, weight [N];
    shared [T, N] and shared_gate [T, 1] or None."""
    T, N = x.shape[0], x.shape[-1]
    assert x.dim() in (2, 3) and x.stride(-1) == 1, (x.shape, x.stride())
    joined = x.dim() == 3 or shared is not None
    assert not joined or residual is not None, "top-k rows are added into a residual"
    assert shared is not None or shared_gate is None, "a gate without its shared expert"
    if shared is not None:
        assert shared.shape == (T, N) and shared.dtype == x.dtype, (shared.shape, x.shape)
        assert shared.stride(-1) == 1, shared.stride()
    if shared_gate is not None:
        assert shared_gate.shape == (T, 1), shared_gate.shape
    if residual is not None:
        assert residual.shape == (T, N) and residual.dtype == x.dtype, (residual.shape, x.shape)
        assert residual.stride(-1) == 1, residual.stride()
    assert weight.shape == (N,) and weight.dtype == x.dtype, (weight.shape, weight.dtype, x.dtype)


def _norm_warps(BLOCK: int, x: torch.Tensor) -> int:
    """A warp per 512 lanes of the row, up to 8; twice that when the row is the sum of the
    MoE's top-k rows: one program reads all K of them, and at a token or a few that is the
    whole launch, bound by how many loads it has in flight."""
    warps = min(max(BLOCK // 512, 1), 8)
    return min(2 * warps, 16) if x.dim() == 3 else warps


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    *,
    shared: torch.Tensor | None = None,
    shared_gate: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Semantics: see reference.rms_norm: s = joined(x) + residual (joined(x) alone when
    None); out = weight * rmsnorm(s).

    x: [T, N], or [T, KX, N] rows to add first (the MoE's top-k rows: their sum needs no
    launch of its own), rows may be strided, the last dim contiguous; residual: [T, N] (needed
    with KX rows or shared), same dtype; shared: the MoE's shared expert [T, N], joined with
    the rows (no launch of its own either), shared_gate its gate's logits [T, 1] or None, last
    dims contiguous; weight: [N] in x's dtype. Returns (out [T, N] contiguous, s): s is x
    itself without a residual, else a new contiguous tensor.
    """
    T, N = x.shape[0], x.shape[-1]
    _check_rows(x, residual, weight, shared, shared_gate)
    assert weight.is_contiguous()
    out = torch.empty(T, N, dtype=x.dtype, device=x.device)
    s = x if residual is None else torch.empty(T, N, dtype=x.dtype, device=x.device)
    if T > 0:
        _launch_rms_norm(x, weight, eps, residual, out, s, _NormLora(), (shared, shared_gate))
    return out, s


def _rank_rows_per_step(T: int, rows: int, BLOCK: int, num_warps: int, shrink: bool) -> int:
    """RC rank rows per step (for the shrink: per program), a [RC, BLOCK] tile of A (or
    [BLOCK, RC] of B), at most 64 values a lane. Below SHRINK_WIDE_T rows a shrink takes at
    most 32, so that more programs read a row's A at once, each redoing the row's norm from L2:
    at a token or a few they are the whole launch, bound by how many loads each has in flight.
    From SHRINK_WIDE_T rows on there are programs enough, and each one's norm (the KX top-k
    rows, the residual and the weight: 40 KB at Qwen3's top 8) costs more L2 traffic than its
    tile of A."""
    per_lane = 64 if not shrink or T >= SHRINK_WIDE_T else 32
    return max(1, min(next_power_of_2(rows), per_lane * 32 * num_warps // BLOCK))


def rms_norm_lora(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None,
    info: LoraBatchInfo,
    *,
    shrink: LoraWeights | None = None,
    expand: FoldedLora | None = None,
    shared: torch.Tensor | None = None,
    shared_gate: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, FoldedLora | None]:
    """rms_norm with the LoRA of the projections on either side of it folded in.

    Semantics: see reference.rms_norm_lora. x, residual, shared, shared_gate: as rms_norm's;
    expand: the LoRA of
    the projection that produced x (one slice of N outputs), its shrunk the partial shrinks
    [T, KS, 1, R] float32 of paged_attention_o_shrink, its info this info; shrink: the LoRA of
    the projection that reads out (N inputs, n slices), of the same pool rank R. Both read
    their factors through their tables (any layout the tables describe). Returns (out, s,
    shrunk): shrunk = FoldedLora(out's shrink [T, n, R] float32, shrink, info), None without
    shrink. Rows of the shrink whose token has no enabled slot are left unwritten (readers
    check the slot first); an enabled row is written whole, zeros past the module's rank.

    Why here: neither half needs a launch of its own (a base-only batch pays one gather per
    row). Each row's n * R shrink rows are spread over programs, RC each, because one program
    reading a whole slot's A is bound by its load latency.
    """
    T, N = x.shape[0], x.shape[-1]
    _check_rows(x, residual, weight, shared, shared_gate)
    assert info.slot_of_token.shape[0] >= T, (info.slot_of_token.shape, T)
    out = torch.empty(T, N, dtype=x.dtype, device=x.device)
    changes_x = residual is not None or expand is not None  # else s is x itself
    s = torch.empty(T, N, dtype=x.dtype, device=x.device) if changes_x else x
    lora = _norm_lora(x, info, shrink, expand)
    if T > 0:
        _launch_rms_norm(x, weight, eps, residual, out, s, lora, (shared, shared_gate))
    return out, s, None if shrink is None else FoldedLora(lora.shrunk, shrink, info)


class _NormLora(NamedTuple):
    """The LoRA halves of one norm launch (see rms_norm_lora); None where a half is off."""

    info: LoraBatchInfo | None = None
    shrink: LoraWeights | None = None  # the LoRA of the projection that reads out
    shrunk: torch.Tensor | None = None  # shrink: its output [T, NS, R] float32
    part: torch.Tensor | None = None  # expand: the partial shrinks [T, KS, 1, R] float32
    expand: LoraWeights | None = None  # the LoRA of the projection that produced x
    NS: int = 1
    R: int = 1
    KS: int = 1


def _norm_lora(
    x: torch.Tensor, info: LoraBatchInfo, shrink: LoraWeights | None, expand: FoldedLora | None
) -> _NormLora:
    """Checks rms_norm_lora's two halves; allocates the shrink's output."""
    T, N = x.shape[0], x.shape[-1]
    NS, R, KS = 1, 1, 1
    if shrink is not None:
        NS, R = len(shrink.out_slices), shrink.max_rank
        assert shrink.in_features == N and shrink.num_experts == 0, (shrink.in_features, N)
        assert shrink.table.is_contiguous(), shrink.table.stride()
    if expand is not None:
        part, b = expand.shrunk, expand.weights
        R_b = b.max_rank
        assert b.out_slices == (N,) and b.num_experts == 0, (b.out_slices, N)
        assert b.table.is_contiguous(), b.table.stride()
        assert part.shape[0] == T and part.shape[2:] == (1, R_b), (part.shape, T, R_b)
        assert part.is_contiguous() and part.dtype == torch.float32, (part.stride(), part.dtype)
        assert shrink is None or R_b == R, (R_b, R)
        assert expand.info is info, "the expand reads this step's batch info"
        R, KS = R_b, part.shape[1]
    shrunk = None
    if shrink is not None:
        shrunk = torch.empty(T, NS, R, dtype=torch.float32, device=x.device)
    return _NormLora(
        info=info,
        shrink=shrink,
        shrunk=shrunk,
        part=None if expand is None else expand.shrunk,
        expand=None if expand is None else expand.weights,
        NS=NS,
        R=R,
        KS=KS,
    )


def _launch_rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None,
    out: torch.Tensor,
    s: torch.Tensor,
    lora: _NormLora,
    shared: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None),
) -> None:
    """One _rms_norm_kernel launch: a program a row, or with a shrink, a row's RC rank rows.
    shared: (the MoE's shared expert, its gate's logits), either None."""
    T, N = x.shape[0], x.shape[-1]
    KX, stride_xk = (x.shape[1], x.stride(1)) if x.dim() == 3 else (1, 0)
    BLOCK = next_power_of_2(N)
    num_warps = _norm_warps(BLOCK, x)
    if lora.part is not None:
        # the expand's B tiles [BLOCK, RC] are loaded one after another by the row's one
        # program: twice the warps halve the steps
        num_warps = min(2 * num_warps, 16)
    shrink = lora.shrink is not None
    RC = _rank_rows_per_step(T, lora.NS * lora.R, BLOCK, num_warps, shrink)
    res = x if residual is None else residual
    unused = x  # every pointer whose flag is off: never read
    _rms_norm_kernel[(T, cdiv(lora.NS * lora.R, RC) if shrink else 1)](
        x_ptr=x,
        res_ptr=res,
        weight_ptr=weight,
        out_ptr=out,
        sum_ptr=s,
        **_info_ptrs(lora.info, unused),
        **_factor_ptrs(lora.shrink, "a", unused),
        **_or_unused(unused, shrunk_ptr=lora.shrunk, part_ptr=lora.part),
        **_factor_ptrs(lora.expand, "b", unused),
        **_shared_args(*shared, unused),
        N=N,
        stride_xt=x.stride(0),
        stride_xk=stride_xk,
        stride_rt=res.stride(0),
        eps=eps,
        KX=KX,
        HAS_RESIDUAL=residual is not None,
        BLOCK=BLOCK,
        SHRINK=shrink,
        EXPAND=lora.part is not None,
        NS=lora.NS,
        R=lora.R,
        RC=RC,
        KS=lora.KS,
        KS_PAD=next_power_of_2(lora.KS),
        A_ALIGN=lora.shrink.a_align if shrink else 1,
        num_warps=num_warps,
        enable_fp_fusion=False,
        **pdl_kwargs(x.device),
    )


def _shared_args(
    shared: torch.Tensor | None, gate: torch.Tensor | None, unused: torch.Tensor
) -> dict:
    """The norm kernel's arguments for the MoE's shared expert (rms_norm(shared=))."""
    return dict(
        shared_ptr=unused if shared is None else shared,
        gate_ptr=unused if gate is None else gate,
        stride_st=0 if shared is None else shared.stride(0),
        stride_gt=0 if gate is None else gate.stride(0),
        SHARED=shared is not None,
        GATED=gate is not None,
    )


def _info_ptrs(info: LoraBatchInfo | None, unused: torch.Tensor) -> dict[str, torch.Tensor]:
    """The batch info's buffers under the names the kernels take them by; `unused` without."""
    if info is None:
        return dict.fromkeys(("slot_ptr", "enabled_ptr", "rank_ptr", "scaling_ptr"), unused)
    return dict(
        slot_ptr=info.slot_of_token,
        enabled_ptr=info.slot_enabled,
        rank_ptr=info.rank_of_slot,
        scaling_ptr=info.scaling_of_slot,
    )


def _factor_ptrs(
    lora: LoraWeights | None, factor: str, unused: torch.Tensor
) -> dict[str, torch.Tensor]:
    """{factor}_ptr and {factor}_tab_ptr: lora's arena and table, or `unused` for None."""
    arena, table = (unused, unused) if lora is None else (lora.arena, lora.table)
    return {f"{factor}_ptr": arena, f"{factor}_tab_ptr": table}


def _or_unused(unused: torch.Tensor, **ptrs: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """Launch keywords: each pointer, or `unused` (never read: its flag is off) for None."""
    return {name: unused if ptr is None else ptr for name, ptr in ptrs.items()}


@triton.jit
def _lora_expand_head(
    shrunk_ptr,
    b_ptr,
    b_row,
    t,
    rank,
    slice_i,
    col0,
    R: tl.constexpr,
    RC: tl.constexpr,
    D: tl.constexpr,
    ROTARY_HALF: tl.constexpr,
):
    """(d, d_rot), [D] float32 each: d = shrunk[t, slice_i] @ B[col0 + dim(lane)].T over the
    module's rank (b_ptr: the slot's B [out, rank], row stride b_row) and d_rot = d with its
    halves swapped, the rotate_half partner of each lane. dim(lane) is the lane's dim as the
    rotary reads it: the lane itself, or partial_rotary_order's with ROTARY_HALF > 0. D is a
    power of two."""
    HALF: tl.constexpr = D // 2
    ii = tl.arange(0, 2)
    lanes = ii[:, None] * HALF + tl.arange(0, HALF)[None, :]  # [2, HALF]
    if ROTARY_HALF > 0:
        lanes = _partial_rotary_dim(lanes, ROTARY_HALF, HALF - ROTARY_HALF)
    cols = col0 + lanes
    d2 = tl.zeros((2, HALF), dtype=tl.float32)
    for r0 in tl.static_range(0, R, RC):
        offs_r = r0 + tl.arange(0, RC)
        r_ok = offs_r < rank
        s_r = tl.load(shrunk_ptr + (t * 3 + slice_i) * R + offs_r, mask=r_ok, other=0.0)
        b = tl.load(
            b_ptr + cols[:, :, None].to(tl.int64) * b_row + offs_r[None, None, :],
            mask=r_ok[None, None, :],
            other=0.0,
        )  # [2, HALF, RC]
        d2 += tl.sum(b.to(tl.float32) * s_r[None, None, :], axis=2)
    # the swap picks the other half's value plus an exact zero: no rounding, no second load
    other = ii[:, None, None] != ii[None, :, None]  # [2, 2, 1]
    d2_rot = tl.sum(tl.where(other, d2[None, :, :], 0.0), axis=1)
    return tl.reshape(d2, (D,)), tl.reshape(d2_rot, (D,))


@triton.jit
def _expand_place(slot_in, enabled_ptr, rank_ptr, scaling_ptr, b_ptr, b_tab_ptr):
    """(B, its row stride, the module's rank) of the slot slot_in: where its q|k|v B starts in
    the arena. Rank 0 where the row has no enabled slot or the slot's adapter no such module:
    the table's other columns are not read then, nor is B."""
    slot, rank, _ = lora_slot(slot_in, enabled_ptr, rank_ptr, scaling_ptr)
    row = b_tab_ptr + slot * TAB_WIDTH
    rank = tl.load(row + TAB_RANK, mask=rank > 0, other=0)
    b_off = tl.load(row + TAB_B_OFF, mask=rank > 0, other=0)
    return b_ptr + b_off, tl.load(row + TAB_B_ROW, mask=rank > 0, other=0), rank


@triton.jit
def _partial_rotary_dim(lane, HALF: tl.constexpr, pass_half):
    """The head dim lane `lane` reads under reference.partial_rotary_order: [0, R/2), then
    [R, R + P/2), [R/2, R), [R + P/2, D), with R/2 = HALF and P/2 = pass_half."""
    rotary = 2 * HALF
    dim = tl.where((lane >= HALF) & (lane < HALF + pass_half), rotary + lane - HALF, lane)
    return tl.where((lane >= HALF + pass_half) & (lane < rotary + pass_half), lane - pass_half, dim)


@triton.jit
def _rope_store_kv_kernel(
    # Pointers (q_ptr stands for every one whose flag is off: never read then).
    q_ptr,  # [T, Hq, D], strides (stride_qt, stride_qh, 1)
    k_ptr,  # [T, Hkv, D], strides (stride_kt, stride_kh, 1)
    v_ptr,  # [T, Hkv, DV], strides (stride_vt, stride_vh, 1); with STORE_KV
    pos_ptr,  # [T] int64
    cos_ptr,  # [L, D] float32, row stride stride_cl
    sin_ptr,  # [L, D] float32, row stride stride_sl
    q_norm_ptr,  # [D] in q's dtype, with HAS_NORM
    k_norm_ptr,  # [D] likewise
    v_norm_ptr,  # [DV] in v's dtype, with V_NORM
    q_out_ptr,  # [T, Hq, D] contiguous
    k_out_ptr,  # [T, Hkv, D] contiguous
    k_cache_ptr,  # [num_pages, page_size, Hkv, D], strides (stride_cp, stride_cs, stride_ch, 1)
    v_cache_ptr,  # [..., DV], the same strides; both with STORE_KV
    slot_mapping_ptr,  # [T] int64, -1 = do not store; with STORE_KV
    # LoRA expand (EXPAND): batch info as in _rms_norm_kernel, the q|k|v shrink [T, 3, R]
    # float32, the arena and table ([S, TAB_WIDTH] int64) of the q|k|v B (slot s's
    # [(Hq + 2 Hkv) D, r]).
    slot_ptr,
    enabled_ptr,
    rank_ptr,
    scaling_ptr,
    shrunk_ptr,
    b_ptr,
    b_tab_ptr,
    # Sizes and strides.
    num_tokens,
    Hq,
    Hkv,
    D,
    DV,  # a v head's width: D, or MLA's latent (without EXPAND)
    page_size,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cl,
    stride_sl,
    stride_cp,
    stride_cs,
    stride_ch,
    eps,
    # Meta-parameters.
    HAS_NORM: tl.constexpr,
    V_NORM: tl.constexpr,  # v RMS-normed (in place too) before its store: MLA's latent norm
    STORE_KV: tl.constexpr,
    INTERLEAVED: tl.constexpr,  # the pairs are adjacent dims: lanes read evens, then odds
    ROTARY_HALF: tl.constexpr,  # partial rotary's rotary_dim / 2 (0: the whole head rotates)
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    EXPAND: tl.constexpr,
    R: tl.constexpr,
    RC: tl.constexpr,
    TOKENS: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_wait(PDL)  # first: see kernels/pdl.py
    # -- map the program to one head of TOKENS tokens: q heads, then k heads, then v heads --
    h = tl.program_id(1)
    offs = tl.arange(0, BLOCK_D)
    mask = offs < D
    dtype = q_out_ptr.dtype.element_ty
    offs_v = tl.arange(0, BLOCK_DV)  # a v head's lanes: D of them but for MLA's latent
    half = D // 2
    partner = (offs + half) % D
    read, read_partner = offs, partner  # the dims lane d and its partner load
    if INTERLEAVED:  # dims 0, 2, 4, ... then 1, 3, 5, ...: each pair becomes two halves
        read = tl.where(offs < half, 2 * offs, 2 * (offs - half) + 1)
        read_partner = tl.where(partner < half, 2 * partner, 2 * (partner - half) + 1)
    if ROTARY_HALF > 0:  # reference.partial_rotary_order
        read = _partial_rotary_dim(offs, ROTARY_HALF, half - ROTARY_HALF)
        read_partner = _partial_rotary_dim(partner, ROTARY_HALF, half - ROTARY_HALF)
    # v heads are only copied; they have no other output (without the store there are none:
    # the branch is compiled, never taken)
    is_v = (h >= Hq + Hkv) & STORE_KV
    if EXPAND:
        # this head's slice of q|k|v (its columns start at h * D: v heads come last, as in
        # the grid)
        slice_i = (h >= Hq).to(tl.int32) + (h >= Hq + Hkv).to(tl.int32)
    if h < Hq:
        norm_w = q_norm_ptr
    else:
        norm_w = k_norm_ptr
    if HAS_NORM:  # each lane's dim's weight
        w = tl.load(norm_w + read, mask=mask, other=0.0).to(tl.float32)
        w_rot = tl.load(norm_w + read_partner, mask=mask, other=0.0).to(tl.float32)
    for i in range(TOKENS):
        t = (tl.program_id(0) * TOKENS + i).to(tl.int64)
        if t < num_tokens:
            if EXPAND:
                lslot_in = tl.load(slot_ptr + t)  # asked for first: its flag and rank depend on it
            # the rotary's position too, before any branch on the LoRA's rank: its table rows
            # are then in flight while the slot's flag and rank come back
            pos = tl.load(pos_ptr + t)
            # -- the cache row of this token, as store_kv computes it; padded rows (-1) store
            # nothing --
            if STORE_KV:
                slot = tl.load(slot_mapping_ptr + t)
                cache_row = (slot // page_size) * stride_cp + (slot % page_size) * stride_cs
                store_mask = mask & (slot >= 0)
                v_mask = (offs_v < DV) & (slot >= 0)
            else:  # names for the v branch, which is compiled either way
                cache_row = t * 0
                store_mask = mask
                v_mask = offs_v < DV
            if is_v:
                hv = h - Hq - Hkv
                v_src = v_ptr + t * stride_vt + hv * stride_vh + offs_v
                x_v = tl.load(v_src, mask=offs_v < DV, other=0.0)
                if V_NORM:
                    # rms_norm's order: the norm in float32, rounded, times the weight, rounded;
                    # written back too, for the caller's later use of v (padded rows alike)
                    f_v = x_v.to(tl.float32)
                    v_scale = tl.rsqrt(tl.sum(f_v * f_v, axis=0) / DV + eps)
                    w_v = tl.load(v_norm_ptr + offs_v, mask=offs_v < DV, other=0.0)
                    normed_v = (f_v * v_scale).to(dtype).to(tl.float32)
                    x_v = (w_v.to(tl.float32) * normed_v).to(dtype)
                    tl.store(v_src, x_v, mask=offs_v < DV)
                if EXPAND:
                    lb, lb_row, rank = _expand_place(
                        lslot_in, enabled_ptr, rank_ptr, scaling_ptr, b_ptr, b_tab_ptr
                    )
                    if rank > 0:
                        d_v, d_unused = _lora_expand_head(
                            shrunk_ptr,
                            lb,
                            lb_row,
                            t,
                            rank,
                            slice_i,
                            h * D,
                            R=R,
                            RC=RC,
                            D=BLOCK_D,
                            ROTARY_HALF=0,  # v is not reordered
                        )
                        x_v = (x_v.to(tl.float32) + d_v.to(dtype).to(tl.float32)).to(dtype)
                v_dst = v_cache_ptr + cache_row + hv * stride_ch + offs_v
                tl.store(v_dst, x_v.to(v_cache_ptr.dtype.element_ty), mask=v_mask)
            else:
                if h < Hq:
                    src = q_ptr + t * stride_qt + h * stride_qh
                    dst = q_out_ptr + (t * Hq + h) * D
                else:
                    src = k_ptr + t * stride_kt + (h - Hq) * stride_kh
                    dst = k_out_ptr + (t * Hkv + (h - Hq)) * D

                # -- the head in place and its rotate_half partner, D/2 lanes away --
                x = tl.load(src + read, mask=mask, other=0.0).to(tl.float32)
                x_rot = tl.load(src + read_partner, mask=mask, other=0.0).to(tl.float32)
                c = tl.load(cos_ptr + pos * stride_cl + offs, mask=mask, other=0.0)
                sn = tl.load(sin_ptr + pos * stride_sl + offs, mask=mask, other=0.0)

                # -- the q|k|v projection's LoRA, expanded into this head (and its partner
                # lanes) --
                if EXPAND:
                    lb, lb_row, rank = _expand_place(
                        lslot_in, enabled_ptr, rank_ptr, scaling_ptr, b_ptr, b_tab_ptr
                    )
                    if rank > 0:
                        d, d_rot = _lora_expand_head(
                            shrunk_ptr,
                            lb,
                            lb_row,
                            t,
                            rank,
                            slice_i,
                            h * D,
                            R=R,
                            RC=RC,
                            D=BLOCK_D,
                            ROTARY_HALF=ROTARY_HALF,
                        )
                        x = (x + d.to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
                        x_rot = (x_rot + d_rot.to(dtype).to(tl.float32)).to(dtype).to(tl.float32)

                # -- per-head RMSNorm of both copies with the one row scale (reference.rms_norm's
                # order) --
                if HAS_NORM:
                    scale = tl.rsqrt(tl.sum(x * x, axis=0) / D + eps)
                    x = (w * (x * scale).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
                    x_rot = (
                        (w_rot * (x_rot * scale).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
                    )
                x_rot = tl.where(offs < half, -x_rot, x_rot)

                # -- x * cos + rotate_half(x) * sin with the tables rounded to x's dtype first --
                c = c.to(dtype).to(tl.float32)
                sn = sn.to(dtype).to(tl.float32)
                a = (x * c).to(dtype).to(tl.float32)
                b = (x_rot * sn).to(dtype).to(tl.float32)
                out = (a + b).to(dtype)
                tl.store(dst + offs, out, mask=mask)

                # -- the rotated k, rounded to x's dtype first, is what store_kv would cache
                # from k_out --
                if STORE_KV:
                    if h >= Hq:
                        k_dst = k_cache_ptr + cache_row + (h - Hq) * stride_ch + offs
                        tl.store(k_dst, out.to(k_cache_ptr.dtype.element_ty), mask=store_mask)


def rope_store_kv(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    q_norm: torch.Tensor | None,
    k_norm: torch.Tensor | None,
    eps: float,
    *,
    v: torch.Tensor | None = None,
    k_cache: torch.Tensor | None = None,
    v_cache: torch.Tensor | None = None,
    slot_mapping: torch.Tensor | None = None,
    expand: FoldedLora | None = None,
    interleaved: bool = False,
    rotary_dim: int = 0,
    v_norm: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Semantics: per-head RMSNorm of q and k (when weights are given), then rotate-half rotary;
    with v and the caches, then store_kv(k_out, v, k_cache, v_cache, slot_mapping). With
    expand (the q|k|v LoRA whose shrink [T, 3, R] float32 rms_norm_lora computed; needs v),
    q|k|v first take reference.lora_expand_ of it; expand.weights: out_slices (Hq D, Hkv D,
    Hkv D), B read through its table. interleaved, rotary_dim: reference.rope_store_kv's (the
    lanes read the even dims, then the odd ones, no norm or expand with it; or the dims in
    partial_rotary_order, the norm weights and the expanded delta too); v_norm [DV] in v's
    dtype: reference.rope_store_kv's (v normed in place before its store: MLA's latent norm,
    no launch of its own).

    q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, DV] (strided views of the fused qkv output are
    fine, the last dim contiguous), same dtype; DV is D but without expand (MLA stores its
    latents as v); positions [T] int64; cos, sin [L, D] float32 tables; q_norm, k_norm [D] in
    q's dtype, or both None; k_cache [num_pages, page_size, Hkv, D], v_cache [..., DV] with
    the same strides, the last dim contiguous; slot_mapping [T] int64, -1 for rows not stored.
    Returns new contiguous q [T, Hq, D], k [T, Hkv, D].
    """
    rope = _Rope(
        q, k, positions, cos, sin, q_norm, k_norm, eps, v, k_cache, v_cache, slot_mapping, v_norm
    )
    _check_rope(rope, expand)
    assert not interleaved or (q_norm is None and expand is None), "no model rotates pairs so"
    assert not rotary_dim or (not interleaved and 0 < rotary_dim < q.shape[2]), rotary_dim
    T, Hq, D = q.shape
    q_out = torch.empty(T, Hq, D, dtype=q.dtype, device=q.device)
    k_out = torch.empty(T, k.shape[1], D, dtype=q.dtype, device=q.device)
    if T > 0:
        _launch_rope(rope, expand, q_out, k_out, interleaved=interleaved, rotary_dim=rotary_dim)
    return q_out, k_out


class _Rope(NamedTuple):
    """One rope_store_kv call's tensors (see its docstring); the last four None without store."""

    q: torch.Tensor
    k: torch.Tensor
    positions: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    eps: float
    v: torch.Tensor | None
    k_cache: torch.Tensor | None
    v_cache: torch.Tensor | None
    slot_mapping: torch.Tensor | None
    v_norm: torch.Tensor | None = None

    @property
    def stores(self) -> bool:
        return self.slot_mapping is not None


def _check_rope(r: _Rope, expand: FoldedLora | None) -> None:
    T, Hq, D = r.q.shape
    Hkv = r.k.shape[1]
    q, k = r.q, r.k
    assert k.shape == (T, Hkv, D) and k.dtype == q.dtype, (q.shape, k.shape, q.dtype, k.dtype)
    assert q.stride(-1) == 1 and k.stride(-1) == 1, (q.stride(), k.stride())
    assert D % 2 == 0 and r.positions.shape == (T,), (D, r.positions.shape)
    assert r.cos.shape == r.sin.shape and r.cos.shape[1] == D, (r.cos.shape, r.sin.shape, D)
    assert r.cos.stride(-1) == 1 and r.sin.stride(-1) == 1, (r.cos.stride(), r.sin.stride())
    assert (r.q_norm is None) == (r.k_norm is None), "q_norm and k_norm come together"
    if r.q_norm is not None:
        for w in (r.q_norm, r.k_norm):
            assert w.shape == (D,) and w.dtype == q.dtype and w.is_contiguous(), (w.shape, w.dtype)
    stored = (r.v, r.k_cache, r.v_cache)
    assert all((x is None) != r.stores for x in stored), "v, caches, slots together"
    if r.stores:
        v, k_cache, v_cache = stored
        DV = v.shape[2]
        assert v.shape[:2] == k.shape[:2] and v.dtype == k.dtype, (v.shape, k.shape, v.dtype)
        assert v.stride(-1) == 1 and (DV == D or expand is None), (v.stride(), v.shape, D)
        assert k_cache.ndim == 4 and k_cache.shape[2:] == (Hkv, D), (k_cache.shape, k.shape)
        assert v_cache.shape == (*k_cache.shape[:3], DV), (v_cache.shape, k_cache.shape)
        assert v_cache.stride() == k_cache.stride() and k_cache.stride(-1) == 1, k_cache.stride()
        assert r.slot_mapping.shape == (T,), r.slot_mapping.shape
    if r.v_norm is not None:
        assert r.stores and expand is None, "v_norm norms the stored v, without a folded LoRA"
        w = r.v_norm
        assert w.shape == (r.v.shape[2],) and w.dtype == r.v.dtype and w.is_contiguous(), w.shape
    if expand is not None:
        shrunk, b = expand.shrunk, expand.weights
        assert r.stores, "the folded LoRA needs v (and the caches): it expands into v as well"
        assert D & (D - 1) == 0, f"the folded LoRA needs a power-of-two head dim, got {D}"
        R = b.max_rank
        assert b.out_slices == (Hq * D, Hkv * D, Hkv * D), (b.out_slices, Hq, Hkv, D)
        assert b.table.is_contiguous() and shrunk.is_contiguous(), "contiguous table, shrunk"
        assert shrunk.shape == (T, 3, R) and shrunk.dtype == torch.float32, shrunk.shape
        assert expand.info.slot_of_token.shape[0] >= T, (expand.info.slot_of_token.shape, T)


ROPE_GROUP_FROM = 1024  # tokens from which a rotary program takes 8 tokens of its head
# The q|k|v LoRA expand's launches (EXPAND): warps a program (past D 128 twice as many) and the
# values a lane holds of B's [BLOCK_D, RC] tile, which set RC. Every program of the launch
# pays the expand's registers, base rows too, and at decode sizes the registers decide how many
# programs share a multiprocessor, so how many waves a step's (token, head) programs take
# (bench/compile_audit.py counts the registers; gpu-check ab-rope times the choices).
ROPE_EXPAND_WARPS = 1
ROPE_EXPAND_LANE_VALUES = 16


def _launch_rope(
    r: _Rope,
    expand: FoldedLora | None,
    q_out: torch.Tensor,
    k_out: torch.Tensor,
    *,
    interleaved: bool,
    rotary_dim: int,
) -> None:
    """One _rope_store_kv_kernel launch: a program per q, k (and with the store, v) head of
    TOKENS tokens. A prefill's (token, head) programs would be a hundred thousand single warps,
    each too short to cover its own launch: 8 tokens a program from ROPE_GROUP_FROM on."""
    T, Hq, D = r.q.shape
    Hkv = r.k.shape[1]
    DV = D if r.v is None else r.v.shape[2]
    BLOCK_D = next_power_of_2(D)
    tokens = 1 if T < ROPE_GROUP_FROM else 8
    # a [BLOCK_D, RC] tile of B is at most ROPE_EXPAND_LANE_VALUES values per lane
    num_warps = (1 if D <= 128 else 2) * (ROPE_EXPAND_WARPS if expand is not None else 1)
    R = 1 if expand is None else expand.weights.max_rank
    RC = max(1, min(next_power_of_2(R), 32 * ROPE_EXPAND_LANE_VALUES * num_warps // BLOCK_D))
    unused = r.q  # every pointer whose flag is off: never read
    _rope_store_kv_kernel[(cdiv(T, tokens), Hq + (2 if r.stores else 1) * Hkv)](
        q_ptr=r.q,
        k_ptr=r.k,
        pos_ptr=r.positions,
        cos_ptr=r.cos,
        sin_ptr=r.sin,
        q_out_ptr=q_out,
        k_out_ptr=k_out,
        **_or_unused(unused, q_norm_ptr=r.q_norm, k_norm_ptr=r.k_norm, v_norm_ptr=r.v_norm),
        **_store_args(r, unused),
        **_expand_args(expand, unused),
        num_tokens=T,
        Hq=Hq,
        Hkv=Hkv,
        D=D,
        DV=DV,
        stride_qt=r.q.stride(0),
        stride_qh=r.q.stride(1),
        stride_kt=r.k.stride(0),
        stride_kh=r.k.stride(1),
        stride_cl=r.cos.stride(0),
        stride_sl=r.sin.stride(0),
        eps=r.eps,
        HAS_NORM=r.q_norm is not None,
        V_NORM=r.v_norm is not None,
        STORE_KV=r.stores,
        INTERLEAVED=interleaved,
        ROTARY_HALF=rotary_dim // 2,
        BLOCK_D=BLOCK_D,
        BLOCK_DV=next_power_of_2(DV),
        EXPAND=expand is not None,
        R=R,
        RC=RC,
        TOKENS=tokens,
        num_warps=num_warps,
        enable_fp_fusion=False,
        **pdl_kwargs(r.q.device),
    )


def _store_args(r: _Rope, unused: torch.Tensor) -> dict[str, torch.Tensor | int]:
    """The KV store's launch keywords: v, the caches, the slots and their strides."""
    if not r.stores:
        ptrs = ("v_ptr", "k_cache_ptr", "v_cache_ptr", "slot_mapping_ptr")
        strides = ("stride_vt", "stride_vh", "stride_cp", "stride_cs", "stride_ch")
        return dict.fromkeys(ptrs, unused) | dict.fromkeys(strides, 0) | dict(page_size=1)
    return dict(
        v_ptr=r.v,
        k_cache_ptr=r.k_cache,
        v_cache_ptr=r.v_cache,
        slot_mapping_ptr=r.slot_mapping,
        page_size=r.k_cache.shape[1],
        stride_vt=r.v.stride(0),
        stride_vh=r.v.stride(1),
        stride_cp=r.k_cache.stride(0),
        stride_cs=r.k_cache.stride(1),
        stride_ch=r.k_cache.stride(2),
    )


def _expand_args(expand: FoldedLora | None, unused: torch.Tensor) -> dict[str, torch.Tensor | int]:
    """The q|k|v LoRA's launch keywords: the batch info, the shrink, B's arena and table."""
    weights = None if expand is None else expand.weights
    shrunk = unused if expand is None else expand.shrunk
    info = None if expand is None else expand.info
    return _info_ptrs(info, unused) | dict(shrunk_ptr=shrunk) | _factor_ptrs(weights, "b", unused)
