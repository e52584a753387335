"""The fused MoE's main loops over block-FP8 experts (fp8_block.Fp8Weight), weight-only: the
activations stay in x's dtype (kernels/moe/fused.py takes these loops where its FP8 flag is set).

A tile of e4m3 codes [BK, BN] is loaded and converted to x's dtype (exact: every e4m3 value is
an fp16 and a bf16 value) and fed to the same tl.dot as the dense loop. The block scales are
not applied to the tile but to its product: for each 128-deep slice of K (one block of scales
along K) the loop sums x @ codes over the slice's BK-deep tiles into a partial [BM, BN], then
adds partial * scale to the accumulator, scale [BN] the block of each column's own row
(n // 128: a tile's columns may straddle blocks, and gate's and up's halves of w13 need not
start at one). So BK divides 128, and the weights are never rounded: the sums are of code *
scale exactly, where the torch reference (dequantize_fp8_block to x's dtype, then a matmul)
rounds each weight once; the two differ by that rounding and by the order of the sums.

With MoeConfig.tma the code tiles come through a TMA descriptor of the codes as [E * N, K]
(zeros past K), the pointer tiles and their masks out of the loop's registers.

W8A8 (MoeConfig.w8a8): the activations arrive as e4m3 codes with a float32 scale per row and
group of columns (DeepSeek's per-token groups: quantize_rows_fp8 for x before gate_up, in
groups of 128; gate_up's epilogue for h, each of its BN-column tiles one group, BN 128 or 64),
so the dot takes both operands' codes on the FP8 tensor cores. A tile is one group deep
(gate_up's 128, down's h_group), and its product [BM, BN] scales by the rows' scales, then a
slice's by the columns' block scales, in float32: the promotion every group that keeps the FP8
MMA's narrow accumulation short. h's groups of 64 let gate_up take 128-row tiles: its four
float32 tiles (gate, up and their partials) at 128 x 128 do not fit the registers. The codes
are the only rounding; the LoRA path reads x and h unquantized (fused_moe's align and
epilogues), as the torch reference (reference.fused_moe_w8a8, h_group = BN).
"""

import torch
import triton
import triton.language as tl

from moelora.kernels.dot import dot
from moelora.kernels.fp8_block import FP8_BLOCK
from moelora.kernels.pdl import pdl_kwargs, pdl_wait
from moelora.kernels.sizes import cdiv

SCALE_K: tl.constexpr = tl.constexpr(FP8_BLOCK[1])  # K depth of one block of scales
SCALE_N: tl.constexpr = tl.constexpr(FP8_BLOCK[0])  # rows of one block of scales
FP8_MAX: tl.constexpr = tl.constexpr(448.0)  # e4m3's largest finite value
QUANT_ROWS = 16  # rows a program of quantize_rows_fp8 takes ([16, 128] tiles)


def fp8_tiles_fit(block_k: int, group: int = 0) -> bool:
    """Whether BK-deep tiles fit the loops: each within one block of scales along K; with a
    group (W8A8: the activations' columns a scale), exactly one group deep, a group that
    divides a block of scales."""
    if group:
        return block_k == group and FP8_BLOCK[1] % group == 0
    return block_k <= FP8_BLOCK[1] and FP8_BLOCK[1] % block_k == 0


@triton.jit
def _e4m3_values(v):
    """v (float32, |v| <= 448) rounded to nearest even e4m3 value, in float32: 3 mantissa bits
    by integer rounding of the bits where e4m3 is normal (|v| >= 2^-6), multiples of 2^-9 below
    (its subnormals, by the float32 rounding of v + 3 * 2^13). The conversion to e4m3 that
    follows is then exact, where the interpreter's own rounding does not carry into the
    exponent."""
    bits = v.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -0x100000
    magic = 24576.0  # 3 * 2^13: float32's step there is 2^-9
    small = (v + magic) - magic
    return tl.where(tl.abs(v) < 0.015625, small, bits.to(tl.float32, bitcast=True))


@triton.jit
def quantized_rows(xt):
    """(codes [BM, BK] e4m3, scales [BM] float32) of a tile (reference.quantize_rows_fp8): a
    row's scale amax / 448 (1 for a row of zeros), its values times 448 / amax, saturated and
    rounded to nearest even."""
    amax = tl.max(tl.abs(xt.to(tl.float32)), axis=1)
    zero = amax == 0
    scale = tl.where(zero, 1.0, tl.math.div_rn(amax, FP8_MAX))
    inv = tl.where(zero, 1.0, tl.math.div_rn(FP8_MAX, tl.where(zero, 1.0, amax)))
    v = tl.clamp(xt.to(tl.float32) * inv[:, None], -FP8_MAX, FP8_MAX)
    return _e4m3_values(v).to(tl.float8e4nv), scale


def _placed_asm() -> str:
    """e4m3_bf16_placed's PTX: t and u are bytes 0, 1 and 2, 3 of the input word in the high
    bytes of two halves; each half keeps its sign bit and takes its exponent and mantissa bits
    4 places lower (one three-input mask after the shift), then a multiply by 2^120 (bf16
    0x7B80) makes the placed value the code's."""
    lines = [
        "{",
        ".reg .b32 t, u, a, b, c;",
        "prmt.b32 t, $2, 0, 0x1404;",
        "prmt.b32 u, $2, 0, 0x3424;",
        "mov.b32 c, 0x7B807B80;",
    ]
    for out, src in (("$0", "t"), ("$1", "u")):
        lines += [
            f"and.b32 a, {src}, 0x80008000;",
            f"shr.b32 b, {src}, 4;",
            "and.b32 b, b, 0x07F007F0;",
            "or.b32 a, a, b;",
            f"mul.rn.bf16x2 {out}, a, c;",
        ]
    return "\n".join([*lines, "}"])


_PLACED_ASM: tl.constexpr = tl.constexpr(_placed_asm())


@triton.jit
def e4m3_bf16_placed(codes):
    """codes (uint8, e4m3fn bits) as bfloat16, the same values as their conversion (GPU only:
    inline PTX). An e4m3 code s eeee mmm placed as the bfloat16 s 0000eeee mmm0000 is the
    value times 2^-120, a bfloat16 subnormal for e = 0 as e4m3's subnormals are; the multiply
    by 2^120 is exact for every finite code (the NaN codes, never a weight's, come out 480).
    Integer instructions and one HMUL2 for 2 values, where the compiler's conversion goes
    e4m3 -> f16 -> bf16 (an F2F a value, on the conversion pipe, which bounds a decode step's
    FP8 MoE)."""
    return tl.inline_asm_elementwise(
        asm=_PLACED_ASM,
        constraints="=r,=r,r",
        args=[codes],
        dtype=tl.bfloat16,
        is_pure=True,
        pack=4,
    )


@triton.jit
def _codes_as(tile, dtype: tl.constexpr, PLACED: tl.constexpr):
    """A tile of e4m3 codes in dtype: converted, or by bit placement (PLACED: bf16, GPU)."""
    if PLACED:
        return e4m3_bf16_placed(tile.to(tl.uint8, bitcast=True))
    else:
        return tile.to(dtype)


@triton.jit
def _col_scales(s_e, rows, k0, n_ok, stride_sn):
    """[BN] float32: the scales of rows (int64 [BN]) in the block of scales at K offset k0."""
    return tl.load(s_e + (rows // SCALE_N) * stride_sn + k0 // SCALE_K, mask=n_ok, other=0.0)


@triton.jit
def _code_tile(ptrs, k_ok, n_ok, desc, row, ks, TMA: tl.constexpr):
    """A [BK, BN] tile of e4m3 codes: with TMA desc's [BN, BK] tile at (row, ks) transposed (the
    view is [E * N, K]: zeros past K, and a last column block's rows past N are the next rows',
    in columns the caller masks), else by pointers (masked codes 0)."""
    if TMA:
        return desc.load([row, ks]).T
    else:
        return tl.load(ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)


@triton.jit
def _row_codes(q_ptr, s_ptr, rows, row_ok, N, k0, offs_k, k_ok, GROUP: tl.constexpr):
    """(codes [BM, BK] e4m3, scales [BM] float32) of rows' GROUP-column group at k0, from a
    [R, N] code array and its [R, N / GROUP] scales (masked rows: codes 0, scale 0)."""
    codes = tl.load(
        q_ptr + rows[:, None] * N + (k0 + offs_k)[None, :],
        mask=row_ok[:, None] & k_ok[None, :],
        other=0.0,
    )
    scale = tl.load(s_ptr + rows * (N // GROUP) + k0 // GROUP, mask=row_ok, other=0.0)
    return codes, scale


@triton.jit
def _quantize_rows_kernel(
    x_ptr,  # [T, N], row stride stride_xt
    q_ptr,  # [T, N] e4m3 out
    s_ptr,  # [T, N / 128] float32 out
    T,
    N,
    stride_xt,
    BT: tl.constexpr,
    PDL: tl.constexpr,
):
    """One program: BT rows' 128-column group program_id(1)."""
    pdl_wait(PDL)  # first: see kernels/pdl.py
    rows = tl.program_id(0) * BT + tl.arange(0, BT)
    cols = tl.program_id(1) * SCALE_K + tl.arange(0, SCALE_K)
    ok = rows < T
    x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_xt + cols[None, :], mask=ok[:, None])
    codes, scale = quantized_rows(x)
    tl.store(q_ptr + rows[:, None].to(tl.int64) * N + cols[None, :], codes, mask=ok[:, None])
    tl.store(s_ptr + rows * (N // SCALE_K) + tl.program_id(1), scale, mask=ok)


def quantize_rows_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Semantics: reference.quantize_rows_fp8(x) (groups of 128 columns). x [T, N], N a
    multiple of 128, columns contiguous. One launch."""
    T, N = x.shape
    assert N % FP8_BLOCK[1] == 0 and x.stride(1) == 1, (x.shape, x.stride())
    codes = torch.empty(T, N, dtype=torch.float8_e4m3fn, device=x.device)
    scales = torch.empty(T, N // FP8_BLOCK[1], dtype=torch.float32, device=x.device)
    if T:
        BT = QUANT_ROWS
        _quantize_rows_kernel[(cdiv(T, BT), N // FP8_BLOCK[1])](
            x_ptr=x,
            q_ptr=codes,
            s_ptr=scales,
            T=T,
            N=N,
            stride_xt=x.stride(0),
            BT=BT,
            **pdl_kwargs(x.device),
        )
    return codes, scales


@triton.jit
def gate_up_fp8_loop(
    x_ptr,
    x_rows,  # [BM] int64 offsets of the block's token rows in x
    row_ok,
    w_e,  # expert e's codes [2I, H] float8_e4m3fn
    s_e,  # expert e's scales [ceil(2I / 128), ceil(H / 128)] float32
    offs_n,
    n_ok,
    H,
    I,
    stride_wn,
    stride_sn,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    xq_ptr=None,  # W8A8: x's codes [T, H] e4m3 and scales [T, H / 128] float32
    xs_ptr=None,
    tokens=None,  # W8A8: [BM] int64 token of each block row
    W8A8: tl.constexpr = False,
    w_desc=None,  # TMA: the codes' descriptor ([E * 2I, H], tiles [BN, BK]), gate's first row
    w_row=0,
    TMA: tl.constexpr = False,
    PLACED: tl.constexpr = False,  # weight-only, bf16 on the GPU: code tiles by bit placement
):
    """fused_moe's gate_up main loop on block-FP8 experts: (acc_g, acc_u) [BM, BN] fp32, x's
    block rows times gate's columns offs_n (rows offs_n of W13) and up's (rows I + offs_n)."""
    offs_k = tl.arange(0, BK)
    rows_g = offs_n.to(tl.int64)
    rows_u = rows_g + I
    wg0 = w_e + rows_g[None, :] * stride_wn + offs_k[:, None]  # [BK, BN]
    wu0 = w_e + rows_u[None, :] * stride_wn + offs_k[:, None]
    acc_g = tl.zeros((BM, BN), dtype=tl.float32)
    acc_u = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, H, SCALE_K):
        part_g = tl.zeros((BM, BN), dtype=tl.float32)
        part_u = tl.zeros((BM, BN), dtype=tl.float32)
        for s in tl.static_range(SCALE_K // BK):
            ks = k0 + s * BK
            k_ok = offs_k < H - ks
            if W8A8:  # one tile a slice (fp8_tiles_fit)
                xq, x_scale = _row_codes(
                    xq_ptr, xs_ptr, tokens, row_ok, H, ks, offs_k, k_ok, GROUP=SCALE_K
                )
                wg = _code_tile(wg0 + ks, k_ok, n_ok, w_desc, w_row, ks, TMA)
                part_g = tl.dot(xq, wg, part_g)
                wu = _code_tile(wu0 + ks, k_ok, n_ok, w_desc, w_row + I, ks, TMA)
                part_u = tl.dot(xq, wu, part_u)
                part_g *= x_scale[:, None]
                part_u *= x_scale[:, None]
            else:
                xt = tl.load(
                    x_ptr + x_rows[:, None] + (ks + offs_k)[None, :],
                    mask=row_ok[:, None] & k_ok[None, :],
                    other=0.0,
                )
                wg = _code_tile(wg0 + ks, k_ok, n_ok, w_desc, w_row, ks, TMA)
                part_g = dot(xt, _codes_as(wg, xt.dtype, PLACED), part_g)
                wu = _code_tile(wu0 + ks, k_ok, n_ok, w_desc, w_row + I, ks, TMA)
                part_u = dot(xt, _codes_as(wu, xt.dtype, PLACED), part_u)
        acc_g += part_g * _col_scales(s_e, rows_g, k0, n_ok, stride_sn)[None, :]
        acc_u += part_u * _col_scales(s_e, rows_u, k0, n_ok, stride_sn)[None, :]
    return acc_g, acc_u


@triton.jit
def down_fp8_loop(
    h_ptr,
    h_offs,  # [BM] int64 offsets of the block's rows in h
    row_ok,
    w_e,  # expert e's codes [H, I] float8_e4m3fn
    s_e,  # expert e's scales [ceil(H / 128), ceil(I / 128)] float32
    offs_n,
    n_ok,
    I,
    stride_wn,
    stride_sn,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    hq_ptr=None,  # W8A8: h's codes [NB*BM, I] e4m3 and scales [NB*BM, I / BK] float32
    hs_ptr=None,
    h_rows=None,  # W8A8: [BM] int64 block rows
    W8A8: tl.constexpr = False,  # h's groups are then BK columns (fp8_tiles_fit)
    w_desc=None,  # TMA: the codes' descriptor ([E * H, I], tiles [BN, BK]), the block's first row
    w_row=0,
    TMA: tl.constexpr = False,
    PLACED: tl.constexpr = False,  # weight-only, bf16 on the GPU: code tiles by bit placement
):
    """fused_moe's down main loop on block-FP8 experts: acc [BM, BN] fp32, h's block rows times
    down's columns offs_n."""
    offs_k = tl.arange(0, BK)
    rows = offs_n.to(tl.int64)
    w0 = w_e + rows[None, :] * stride_wn + offs_k[:, None]  # [BK, BN]
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, I, SCALE_K):
        part = tl.zeros((BM, BN), dtype=tl.float32)
        for s in tl.static_range(SCALE_K // BK):
            ks = k0 + s * BK
            k_ok = offs_k < I - ks
            if W8A8:  # one tile a group of h (fp8_tiles_fit): its product scaled alone
                hq, h_scale = _row_codes(hq_ptr, hs_ptr, h_rows, row_ok, I, ks, offs_k, k_ok, BK)
                w = _code_tile(w0 + ks, k_ok, n_ok, w_desc, w_row, ks, TMA)
                part += tl.dot(hq, w) * h_scale[:, None]
            else:
                ht = tl.load(
                    h_ptr + h_offs[:, None] + (ks + offs_k)[None, :],
                    mask=row_ok[:, None] & k_ok[None, :],
                    other=0.0,
                )
                w = _code_tile(w0 + ks, k_ok, n_ok, w_desc, w_row, ks, TMA)
                part = dot(ht, _codes_as(w, ht.dtype, PLACED), part)
        acc += part * _col_scales(s_e, rows, k0, n_ok, stride_sn)[None, :]
    return acc
