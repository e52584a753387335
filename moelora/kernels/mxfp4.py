"""MXFP4 weight tiles expanded in registers, and the fused MoE's main loops over packed experts
(step/mxfp4.Mxfp4Weight; kernels/fused_moe.py takes them where its MXFP4 flag is set).

A [BK, BN] tile of a weight packed along K comes from a [BK/2, BN] tile of code bytes and a
[BK/32, BN] tile of scale bytes. Each e2m1 code becomes its float32 bits directly (no table
lookup): codes 2..7 are 2^(e - 1) * (1 + m / 2), exponent field e + 126 and mantissa bit m, which
is (code + 252) << 22; code 1 is 0.5, code 0 is 0; bit 3 is the sign. The E8M0 scale byte s is
the float32 2^(s - 127) whose exponent field is s. Both products are exact, so a tile equals
reference.dequantize_mxfp4's values to the bit in every dtype they fit (bf16 always), for scale
bytes 1..254 (0 would read as 0, 255 as infinity, not 2^-127 and NaN).
"""

import triton
import triton.language as tl

from moelora.kernels.dot import dot

GROUP: tl.constexpr = tl.constexpr(32)  # elements along K that share one scale byte


@triton.jit
def _e2m1_float(code):
    """float32 values of e2m1 codes (int32, 0..15)."""
    magnitude = code & 7
    bits = tl.where(magnitude >= 2, (magnitude + 252) << 22, tl.where(magnitude == 1, 252 << 22, 0))
    bits = bits.to(tl.uint32) | ((code & 8).to(tl.uint32) << 28)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def mxfp4_tile(
    code_ptrs,  # [BK/2, BN] pointers to code bytes: row j holds elements 2j (low) and 2j+1
    scale_ptrs,  # [BK/32, BN] pointers to scale bytes
    code_mask,
    scale_mask,
    BK: tl.constexpr,
    BN: tl.constexpr,
):
    """The [BK, BN] weight tile in float32; masked codes read as 0. BK is a multiple of 32."""
    codes = tl.load(code_ptrs, mask=code_mask, other=0).to(tl.int32)
    scale_bits = tl.load(scale_ptrs, mask=scale_mask, other=0).to(tl.uint32) << 23
    scale = scale_bits.to(tl.float32, bitcast=True)  # [BK/32, BN]
    # each scale covers 16 code bytes: [BK/32, 16, BN] -> [BK/2, BN]
    scale = tl.broadcast_to(scale[:, None, :], (BK // GROUP, GROUP // 2, BN))
    scale = tl.reshape(scale, (BK // 2, BN))
    low = _e2m1_float(codes & 15) * scale
    high = _e2m1_float(codes >> 4) * scale
    # rows 2j and 2j + 1 from byte row j: [BK/2, BN, 2] -> [BK/2, 2, BN] -> [BK, BN]
    return tl.reshape(tl.permute(tl.join(low, high), (0, 2, 1)), (BK, BN))


@triton.jit
def gate_up_mxfp4_loop(
    x_ptr,
    x_rows,  # [BM] int64 offsets of the block's token rows in x
    row_ok,
    w_e,  # expert e's code bytes [2I, H/2]
    s_e,  # expert e's scale bytes [2I, H/32]
    offs_n,
    n_ok,
    H,
    I,
    stride_wn,
    stride_sn,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
):
    """fused_moe's gate_up main loop on packed experts: (acc_g, acc_u) [BM, BN] fp32, x's block
    rows times gate's and up's columns offs_n. H is a multiple of 32."""
    offs_k = tl.arange(0, BK)
    offs_kc = tl.arange(0, BK // 2)
    offs_ks = tl.arange(0, BK // GROUP)
    rows = offs_n[None, :].to(tl.int64)
    cg_ptrs = w_e + rows * stride_wn + offs_kc[:, None]  # [BK/2, BN]
    cu_ptrs = cg_ptrs + I * stride_wn
    sg_ptrs = s_e + rows * stride_sn + offs_ks[:, None]  # [BK/32, BN]
    su_ptrs = sg_ptrs + I * stride_sn
    acc_g = tl.zeros((BM, BN), dtype=tl.float32)
    acc_u = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, H, BK):
        k_ok = offs_k < H - k0
        xt = tl.load(
            x_ptr + x_rows[:, None] + (k0 + offs_k)[None, :],
            mask=row_ok[:, None] & k_ok[None, :],
            other=0.0,
        )
        c_mask = (offs_kc < (H - k0) // 2)[:, None] & n_ok[None, :]
        s_mask = (offs_ks < (H - k0) // GROUP)[:, None] & n_ok[None, :]
        wg = mxfp4_tile(cg_ptrs, sg_ptrs, c_mask, s_mask, BK, BN).to(xt.dtype)
        acc_g = dot(xt, wg, acc_g)
        wu = mxfp4_tile(cu_ptrs, su_ptrs, c_mask, s_mask, BK, BN).to(xt.dtype)
        acc_u = dot(xt, wu, acc_u)
        cg_ptrs += BK // 2
        cu_ptrs += BK // 2
        sg_ptrs += BK // GROUP
        su_ptrs += BK // GROUP
    return acc_g, acc_u


@triton.jit
def down_mxfp4_loop(
    h_ptr,
    h_offs,  # [BM] int64 offsets of the block's rows in h
    row_ok,
    w_e,  # expert e's code bytes [H, I/2]
    s_e,  # expert e's scale bytes [H, I/32]
    offs_n,
    n_ok,
    I,
    stride_wn,
    stride_sn,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
):
    """fused_moe's down main loop on packed experts: acc [BM, BN] fp32, h's block rows times
    down's columns offs_n. I is a multiple of 32."""
    offs_k = tl.arange(0, BK)
    offs_kc = tl.arange(0, BK // 2)
    offs_ks = tl.arange(0, BK // GROUP)
    rows = offs_n[None, :].to(tl.int64)
    c_ptrs = w_e + rows * stride_wn + offs_kc[:, None]  # [BK/2, BN]
    s_ptrs = s_e + rows * stride_sn + offs_ks[:, None]  # [BK/32, BN]
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, I, BK):
        k_ok = offs_k < I - k0
        ht = tl.load(
            h_ptr + h_offs[:, None] + (k0 + offs_k)[None, :],
            mask=row_ok[:, None] & k_ok[None, :],
            other=0.0,
        )
        c_mask = (offs_kc < (I - k0) // 2)[:, None] & n_ok[None, :]
        s_mask = (offs_ks < (I - k0) // GROUP)[:, None] & n_ok[None, :]
        w = mxfp4_tile(c_ptrs, s_ptrs, c_mask, s_mask, BK, BN).to(ht.dtype)
        acc = dot(ht, w, acc)
        c_ptrs += BK // 2
        s_ptrs += BK // GROUP
    return acc
