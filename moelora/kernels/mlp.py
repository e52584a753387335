"""The elementwise steps around a dense MLP and a shared expert, in Triton: the SwiGLU of a dense
layer or shared expert, and the sum that joins the routed experts' top-k rows and the shared
expert (gated or not). Their references are reference.silu_and_mul and add_shared_expert.

Why: each is two to four of torch's elementwise launches, a few microseconds apiece in a decode
step's graph, and a torch launch also breaks the chain of programmatic dependent launches
(kernels/pdl.py). One program owns a block of one row.

Rounding. Each step is computed in float32 and rounded to the input dtype where torch's
separate ops round (silu, then the product; the top-k sum, the gate, its product, the sum),
so the bits are torch's but where float32 sigmoid and exp themselves round differently.
Compiled without fp fusion: torch's separate mul and add never form an FMA.

silu_and_mul_lora also takes the LoRA of the projections on either side (layers/mlp_lora.py):
each program expands gate_up_proj's LoRA (shrunk by the norm before) into its gate and up
columns, and shrinks down_proj's from the columns of h it writes, one partial a column block,
which the next norm sums and expands. A row without an enabled slot reads one slot entry and
no factor.

Legend: T = tokens, I = intermediate, K = top-k rows, H = hidden, R = the pool's max rank,
RP = R padded to a power of two.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moelora.kernels.lora import TAB_A_OFF, TAB_B_OFF, TAB_B_ROW, TAB_RANK, aligned, lora_row
from moelora.kernels.pdl import pdl_kwargs, pdl_wait
from moelora.kernels.sizes import cdiv, next_power_of_2
from moelora.step.lora import TABLE_WIDTH, FoldedLora, LoraBatchInfo, LoraWeights

BLOCK = 1024  # a program's columns
# with the LoRA: a [BLOCK, RP] tile of each factor a program; 256 x 16 is 32 values a lane
LORA_BLOCK = 256


@triton.jit
def _silu_and_mul_kernel(
    # Pointers.
    gate_up_ptr,  # [T, 2I], row stride stride_gt
    out_ptr,  # [T, I] contiguous
    # Sizes and strides.
    I,
    stride_gt,
    # Meta-parameters.
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_wait(PDL)  # first: see kernels/pdl.py
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < I
    dtype = out_ptr.dtype.element_ty
    gate = tl.load(gate_up_ptr + row * stride_gt + offs, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + row * stride_gt + I + offs, mask=ok, other=0.0).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    tl.store(out_ptr + row * I + offs, (act * up).to(dtype), mask=ok)


@triton.jit
def _silu_and_mul_lora_kernel(
    # Pointers.
    gate_up_ptr,  # [T, 2I], row stride stride_gt
    out_ptr,  # [T, I] contiguous
    shrunk_ptr,  # [T, 2, R_IN] float32 with EXPAND: gate_up_proj's LoRA shrunk, scaled
    b_ptr,  # with EXPAND: gate_up_proj's arena, its B [2I, r] where a row of b_tab_ptr says
    b_tab_ptr,  # [S, TW] int64
    a_ptr,  # with SHRINK: down_proj's arena, its A [1, r, I] where a row of a_tab_ptr says
    a_tab_ptr,  # [S, TW] int64
    part_ptr,  # [T, KS, 1, R_OUT] float32 with SHRINK: down_proj's partial shrinks
    slot_ptr,  # [>= T] int32
    enabled_ptr,  # [S] int32
    rank_ptr,  # [S] int32
    scaling_ptr,  # [S] float32
    # Sizes and strides.
    I,
    stride_gt,
    # Meta-parameters.
    TW: tl.constexpr,
    R_IN: tl.constexpr,
    R_OUT: tl.constexpr,
    RP: tl.constexpr,
    A_ALIGN: tl.constexpr,
    EXPAND: tl.constexpr,
    SHRINK: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_wait(PDL)  # first: see kernels/pdl.py
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < I
    dtype = out_ptr.dtype.element_ty
    slot, rank, scaling = lora_row(slot_ptr, enabled_ptr, rank_ptr, scaling_ptr, row)
    gate = tl.load(gate_up_ptr + row * stride_gt + offs, mask=ok, other=0.0)
    up = tl.load(gate_up_ptr + row * stride_gt + I + offs, mask=ok, other=0.0)
    offs_r = tl.arange(0, RP)
    # -- gate_up_proj's LoRA: each slice's delta rounded, then added (PEFT's order) --
    if EXPAND:
        entry = b_tab_ptr + slot * TW
        b_rank = tl.load(entry + TAB_RANK, mask=rank > 0, other=0)  # 0: no such module
        if b_rank > 0:
            b_slot = b_ptr + tl.load(entry + TAB_B_OFF)
            b_row = tl.load(entry + TAB_B_ROW)
            r_ok = offs_r < b_rank
            tile_ok = ok[:, None] & r_ok[None, :]
            s_gate = tl.load(shrunk_ptr + row * 2 * R_IN + offs_r, mask=r_ok, other=0.0)
            s_up = tl.load(shrunk_ptr + (row * 2 + 1) * R_IN + offs_r, mask=r_ok, other=0.0)
            b = tl.load(b_slot + offs[:, None] * b_row + offs_r[None, :], mask=tile_ok, other=0.0)
            d = tl.sum(b.to(tl.float32) * s_gate[None, :], axis=1).to(dtype)
            gate = (gate.to(tl.float32) + d.to(tl.float32)).to(dtype)
            b_up = b_slot + (I + offs)[:, None] * b_row + offs_r[None, :]
            b = tl.load(b_up, mask=tile_ok, other=0.0)
            d = tl.sum(b.to(tl.float32) * s_up[None, :], axis=1).to(dtype)
            up = (up.to(tl.float32) + d.to(tl.float32)).to(dtype)
    gate = gate.to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    h = (act * up.to(tl.float32)).to(dtype)
    tl.store(out_ptr + row * I + offs, h, mask=ok)
    # -- down_proj's LoRA shrink of these columns: the rows with its factors only --
    if SHRINK:
        entry = a_tab_ptr + slot * TW
        a_rank = tl.load(entry + TAB_RANK, mask=rank > 0, other=0)
        if a_rank > 0:
            a_slot = a_ptr + aligned(tl.load(entry + TAB_A_OFF), A_ALIGN)
            a_tile = a_slot + offs_r[:, None] * I + offs[None, :]
            a = tl.load(a_tile, mask=(offs_r < a_rank)[:, None] & ok[None, :], other=0.0)
            shrunk = tl.sum(a.to(tl.float32) * h.to(tl.float32)[None, :], axis=1) * scaling
            dst = part_ptr + (row * tl.num_programs(1) + tl.program_id(1)) * R_OUT + offs_r
            tl.store(dst, shrunk, mask=offs_r < R_OUT)


@triton.jit
def _add_shared_kernel(
    # Pointers.
    rows_ptr,  # [T, K, H] contiguous (K = 1: the routed experts' sum)
    shared_ptr,  # [T, H], row stride stride_st
    gate_ptr,  # [T] logits, row stride stride_gt; with GATED
    out_ptr,  # [T, H] contiguous
    # Sizes and strides.
    H,
    stride_st,
    stride_gt,
    # Meta-parameters.
    K: tl.constexpr,
    GATED: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_wait(PDL)  # first: see kernels/pdl.py
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < H
    dtype = out_ptr.dtype.element_ty
    # -- the routed experts' K rows, in order from zero, rounded (reference.sum_rows) --
    total = tl.zeros((BLOCK,), dtype=tl.float32)
    for k in range(0, K):
        total += tl.load(rows_ptr + (row * K + k) * H + offs, mask=ok, other=0.0).to(tl.float32)
    total = total.to(dtype).to(tl.float32)
    # -- the shared expert, scaled by its sigmoid gate (each rounded) --
    shared = tl.load(shared_ptr + row * stride_st + offs, mask=ok, other=0.0).to(tl.float32)
    if GATED:
        logit = tl.load(gate_ptr + row * stride_gt).to(tl.float32)
        gate = (1.0 / (1.0 + tl.exp(-logit))).to(dtype).to(tl.float32)
        shared = (gate * shared).to(dtype).to(tl.float32)
    tl.store(out_ptr + row * H + offs, (total + shared).to(dtype), mask=ok)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """Semantics: reference.silu_and_mul's: silu(x[..., :I]) * x[..., I:].

    gate_up [T, 2I], the last dim contiguous. Returns [T, I] in its dtype."""
    assert gate_up.dim() == 2 and gate_up.stride(1) == 1, (gate_up.shape, gate_up.stride())
    T, I = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(T, I, dtype=gate_up.dtype, device=gate_up.device)
    if T == 0:
        return out
    block = min(BLOCK, next_power_of_2(I))
    _silu_and_mul_kernel[(T, cdiv(I, block))](
        gate_up_ptr=gate_up,
        out_ptr=out,
        I=I,
        stride_gt=gate_up.stride(0),
        BLOCK=block,
        num_warps=4,
        enable_fp_fusion=False,
        **pdl_kwargs(gate_up.device),
    )
    return out


def silu_and_mul_lora(
    gate_up: torch.Tensor,
    info: LoraBatchInfo,
    *,
    expand: FoldedLora | None = None,
    shrink: LoraWeights | None = None,
) -> tuple[torch.Tensor, FoldedLora | None]:
    """Semantics: reference.silu_and_mul_lora's, in one launch (the module docstring): the
    shrink's partials [T, KS, 1, R] are one a column block, rows without an enabled slot with
    down_proj's factors left unwritten (the next norm checks the slot first).

    gate_up [T, 2I], the last dim contiguous; expand.shrunk [T, 2, R] float32 contiguous.
    Returns (h [T, I] in gate_up's dtype, the shrink or None). Reads no device value on the
    host: a CUDA graph captures it."""
    assert gate_up.dim() == 2 and gate_up.stride(1) == 1, (gate_up.shape, gate_up.stride())
    T, I = gate_up.shape[0], gate_up.shape[1] // 2
    assert info.slot_of_token.shape[0] >= T, (info.slot_of_token.shape, T)
    block = min(LORA_BLOCK, next_power_of_2(I))
    out = torch.empty(T, I, dtype=gate_up.dtype, device=gate_up.device)
    expand_args, r_in = _expand_args(gate_up, expand, info)
    shrink_args, part = _shrink_args(out, shrink, cdiv(I, block))
    if T == 0:
        return out, None if shrink is None else FoldedLora(part, shrink, info)
    _silu_and_mul_lora_kernel[(T, cdiv(I, block))](
        gate_up_ptr=gate_up,
        out_ptr=out,
        **expand_args,
        **shrink_args,
        slot_ptr=info.slot_of_token,
        enabled_ptr=info.slot_enabled,
        rank_ptr=info.rank_of_slot,
        scaling_ptr=info.scaling_of_slot,
        I=I,
        stride_gt=gate_up.stride(0),
        TW=TABLE_WIDTH,
        R_IN=r_in,
        RP=next_power_of_2(max(r_in, shrink_args["R_OUT"])),
        BLOCK=block,
        num_warps=4,
        enable_fp_fusion=False,
        **pdl_kwargs(gate_up.device),
    )
    return out, None if shrink is None else FoldedLora(part, shrink, info)


def _expand_args(
    gate_up: torch.Tensor, expand: FoldedLora | None, info: LoraBatchInfo
) -> tuple[dict, int]:
    """(the kernel's arguments for gate_up_proj's LoRA expand, its shrunk's rank dim)."""
    if expand is None:
        return dict(shrunk_ptr=gate_up, b_ptr=gate_up, b_tab_ptr=gate_up, EXPAND=False), 1
    b, shrunk = expand.weights, expand.shrunk
    I = gate_up.shape[1] // 2
    assert b.out_slices == (I, I) and b.num_experts == 0, (b.out_slices, I)
    assert b.table.is_contiguous(), b.table.stride()
    assert shrunk.shape == (gate_up.shape[0], 2, b.max_rank), (shrunk.shape, b.max_rank)
    assert shrunk.is_contiguous() and shrunk.dtype == torch.float32, shrunk.dtype
    assert expand.info is info, "the expand reads this step's batch info"
    args = dict(shrunk_ptr=shrunk, b_ptr=b.arena, b_tab_ptr=b.table, EXPAND=True)
    return args, b.max_rank


def _shrink_args(
    h: torch.Tensor, shrink: LoraWeights | None, blocks: int
) -> tuple[dict, torch.Tensor | None]:
    """(the kernel's arguments for down_proj's LoRA shrink, its partials [T, blocks, 1, R])."""
    if shrink is None:
        unused = dict(a_ptr=h, a_tab_ptr=h, part_ptr=h)
        return dict(unused, R_OUT=1, A_ALIGN=1, SHRINK=False), None
    T, I = h.shape
    assert shrink.in_features == I and shrink.num_experts == 0, (shrink.in_features, I)
    assert len(shrink.out_slices) == 1 and shrink.table.is_contiguous(), shrink.out_slices
    R = shrink.max_rank
    part = torch.empty(T, blocks, 1, R, dtype=torch.float32, device=h.device)
    args = dict(a_ptr=shrink.arena, a_tab_ptr=shrink.table, part_ptr=part)
    return dict(args, R_OUT=R, A_ALIGN=shrink.a_align, SHRINK=True), part


def add_shared_expert(
    moe_out: torch.Tensor, shared: torch.Tensor, gate_logits: torch.Tensor | None = None
) -> torch.Tensor:
    """Semantics: reference.add_shared_expert's: sum_rows(moe_out) + shared, the shared
    expert first scaled by sigmoid(gate_logits) where given.

    moe_out [T, K, H] contiguous (fused_moe(sum_topk=False)) or [T, H]; shared [T, H] and
    gate_logits [T, 1], last dims contiguous, moe_out's dtype. Returns [T, H]."""
    rows = moe_out if moe_out.dim() == 3 else moe_out[:, None]
    T, K, H = rows.shape
    assert rows.is_contiguous() and shared.shape == (T, H) and shared.stride(1) == 1
    assert gate_logits is None or gate_logits.shape == (T, 1), gate_logits.shape
    out = torch.empty(T, H, dtype=shared.dtype, device=shared.device)
    if T == 0:
        return out
    block = min(BLOCK, next_power_of_2(H))
    _add_shared_kernel[(T, cdiv(H, block))](
        rows_ptr=rows,
        shared_ptr=shared,
        gate_ptr=shared if gate_logits is None else gate_logits,
        out_ptr=out,
        H=H,
        stride_st=shared.stride(0),
        stride_gt=0 if gate_logits is None else gate_logits.stride(0),
        K=K,
        GATED=gate_logits is not None,
        BLOCK=block,
        num_warps=4,
        enable_fp_fusion=False,
        **pdl_kwargs(shared.device),
    )
    return out
