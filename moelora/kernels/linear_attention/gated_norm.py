"""gated_delta.rms_norm_gated in Triton: gated DeltaNet's output norm, gated by silu(z).

Algorithm. One program per BLOCK_R rows: each row normed in float32 and rounded to x's dtype
before the weight multiplies it (the product rounded), the gate's silu in float32, the last
product rounded once, as the reference rounds.

rms_norm_gated_o_shrink also shrinks out_proj's LoRA from the rows it writes (a row is one
head's V columns of out_proj's input: one partial a head, [T, H, 1, R]), which the next norm
sums and expands: out_proj's LoRA then takes no launch of its own. A program whose rows have
no enabled slot with out_proj's factors reads one slot entry a row and no factor.

Legend: N = rows (tokens x value heads), H = value heads, D = row width (the value head dim).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moelora.kernels.lora import TAB_A_OFF, TAB_RANK, aligned, module_slots
from moelora.kernels.pdl import pdl_kwargs, pdl_wait
from moelora.kernels.sizes import cdiv, next_power_of_2
from moelora.step.lora import TABLE_WIDTH, FoldedLora, LoraBatchInfo, LoraWeights

NORM_ROWS = 8  # rows a gated-norm program takes


@triton.jit
def _rms_norm_gated_kernel(
    # Pointers.
    x_ptr,  # [N / HEADS, HEADS, D], strides (stride_xt, stride_xh, 1)
    gate_ptr,  # the same shape, strides (stride_gt, stride_gh, 1)
    weight_ptr,  # [D], x's dtype
    out_ptr,  # [N, D] contiguous
    # out_proj's LoRA shrink (SHRINK; x_ptr when unused): the step's slots ([T] int32, [S]
    # int32, [S] float32), its arena and table, the partials [T, HEADS, 1, R] float32
    slot_ptr,
    enabled_ptr,
    scaling_ptr,
    a_ptr,
    a_tab_ptr,
    part_ptr,
    # Sizes and strides.
    num_rows,
    D,
    HEADS,  # rows a token: row r is token r // HEADS's head r % HEADS
    stride_xt,
    stride_xh,
    stride_gt,
    stride_gh,
    eps,
    # Meta-parameters.
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SHRINK: tl.constexpr,
    TW: tl.constexpr,
    R: tl.constexpr,
    RP: tl.constexpr,
    A_ALIGN: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_wait(PDL)  # first: see kernels/pdl.py
    rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    offs = tl.arange(0, BLOCK_D)
    ok = (rows < num_rows)[:, None] & (offs < D)[None, :]
    dtype = out_ptr.dtype.element_ty
    token, head = rows // HEADS, rows % HEADS
    x_rows = x_ptr + token * stride_xt + head * stride_xh
    x = tl.load(x_rows[:, None] + offs[None, :], mask=ok, other=0.0)
    gate_rows = gate_ptr + token * stride_gt + head * stride_gh
    gate = tl.load(gate_rows[:, None] + offs[None, :], mask=ok, other=0.0)
    w = tl.load(weight_ptr + offs, mask=offs < D, other=0.0)

    # -- the norm in float32, rounded; the weight's product rounded; masked lanes add nothing --
    h = x.to(tl.float32)
    scale = tl.rsqrt(tl.sum(h * h, axis=1) / D + eps)
    normed = (h * scale[:, None]).to(dtype)
    weighted = (w.to(tl.float32)[None, :] * normed.to(tl.float32)).to(dtype)

    # -- the gate's silu in float32, the product rounded once --
    z = gate.to(tl.float32)
    out = (weighted.to(tl.float32) * (z / (1.0 + tl.exp(-z)))).to(dtype)
    tl.store(out_ptr + rows[:, None] * D + offs[None, :], out, mask=ok)

    # -- out_proj's LoRA shrink of each row with a slot that has its factors --
    if SHRINK:
        slots = module_slots(slot_ptr, enabled_ptr, a_tab_ptr, token, rows < num_rows, TW)
        if tl.max(slots, 0) >= 0:
            offs_r = tl.arange(0, RP)
            for i in tl.static_range(BLOCK_R):
                mine = tl.arange(0, BLOCK_R) == i
                slot_i = tl.max(tl.where(mine, slots, -1), 0)
                if slot_i >= 0:
                    entry = a_tab_ptr + slot_i.to(tl.int64) * TW
                    rank_i = tl.load(entry + TAB_RANK)
                    row_i = tl.program_id(0) * BLOCK_R + i
                    head_i = row_i % HEADS
                    a_slot = a_ptr + aligned(tl.load(entry + TAB_A_OFF), A_ALIGN) + head_i * D
                    a = tl.load(
                        a_slot + offs_r[:, None] * (HEADS * D) + offs[None, :],
                        mask=(offs_r < rank_i)[:, None] & (offs < D)[None, :],
                        other=0.0,
                    )  # [RP, BLOCK_D]: A's columns of this head
                    x_i = tl.sum(tl.where(mine[:, None], out.to(tl.float32), 0.0), 0)
                    shrunk = tl.sum(a.to(tl.float32) * x_i[None, :], axis=1)
                    shrunk *= tl.load(scaling_ptr + slot_i)
                    tl.store(part_ptr + row_i.to(tl.int64) * R + offs_r, shrunk, mask=offs_r < R)


def rms_norm_gated(
    x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """Semantics: see gated_delta.rms_norm_gated: out = weight * rmsnorm(x) * silu(gate), the
    norm in float32 cast back to x's dtype before the weight, the gate's silu in float32.
    x, gate: [N, D] or [T, H, D] (a row a head; in_proj's z slice as it lies), strided, D
    contiguous; weight: [D] in x's dtype. Returns x's shape, contiguous, in x's dtype."""
    return _rms_norm_gated(x, gate, weight, eps)


def rms_norm_gated_o_shrink(
    x: torch.Tensor,
    gate: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    lora: LoraWeights,
    info: LoraBatchInfo,
) -> tuple[torch.Tensor, FoldedLora]:
    """Semantics: see gated_delta.rms_norm_gated_o_shrink: rms_norm_gated and out_proj's LoRA
    shrunk from its output in the same launch, one partial a head ([T, H, 1, R] float32; rows
    without an enabled slot with out_proj's factors left unwritten: the next norm checks the
    slot first). x, gate: [T, H, D]."""
    assert x.dim() == 3, x.shape
    T, H, D = x.shape
    assert lora.in_features == H * D and lora.num_experts == 0, (lora.in_features, x.shape)
    assert len(lora.out_slices) == 1 and lora.table.is_contiguous(), lora.out_slices
    assert info.slot_of_token.shape[0] >= T, (info.slot_of_token.shape, T)
    part = torch.empty(T, H, 1, lora.max_rank, dtype=torch.float32, device=x.device)
    args = dict(
        slot_ptr=info.slot_of_token,
        enabled_ptr=info.slot_enabled,
        scaling_ptr=info.scaling_of_slot,
        a_ptr=lora.arena,
        a_tab_ptr=lora.table,
        part_ptr=part,
        SHRINK=True,
        R=lora.max_rank,
        RP=next_power_of_2(lora.max_rank),
        A_ALIGN=lora.a_align,
    )
    return _rms_norm_gated(x, gate, weight, eps, args), FoldedLora(part, lora, info)


def _rms_norm_gated(
    x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float, lora: dict | None = None
) -> torch.Tensor:
    """rms_norm_gated's launch; lora: the kernel's SHRINK arguments (rms_norm_gated_o_shrink)."""
    assert gate.shape == x.shape and x.dim() in (2, 3), (gate.shape, x.shape)
    assert x.stride(-1) == gate.stride(-1) == 1, (x.stride(), gate.stride())
    D = x.shape[-1]
    assert weight.shape == (D,) and weight.dtype == x.dtype, (weight.shape, weight.dtype)
    assert weight.is_contiguous(), weight.stride()
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    N = out.numel() // D
    if N == 0:
        return out
    x3, gate3 = (t if t.dim() == 3 else t[:, None] for t in (x, gate))
    BLOCK_D = next_power_of_2(D)
    if lora is None:
        unused = dict(slot_ptr=x, enabled_ptr=x, scaling_ptr=x, a_ptr=x, a_tab_ptr=x, part_ptr=x)
        lora = dict(unused, SHRINK=False, R=1, RP=1, A_ALIGN=1)
    _rms_norm_gated_kernel[(cdiv(N, NORM_ROWS),)](
        x_ptr=x,
        gate_ptr=gate,
        weight_ptr=weight,
        out_ptr=out,
        **lora,
        num_rows=N,
        D=D,
        HEADS=x3.shape[1],
        stride_xt=x3.stride(0),
        stride_xh=x3.stride(1),
        stride_gt=gate3.stride(0),
        stride_gh=gate3.stride(1),
        eps=eps,
        BLOCK_R=NORM_ROWS,
        BLOCK_D=BLOCK_D,
        TW=TABLE_WIDTH,
        num_warps=min(max(NORM_ROWS * BLOCK_D // 512, 1), 8),
        enable_fp_fusion=False,
        **pdl_kwargs(x.device),
    )
    return out
