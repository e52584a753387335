"""MXFP4 weight tiles expanded in registers, and the fused MoE's main loops over packed experts
(mxfp4_layout.Mxfp4Weight; kernels/moe/fused.py takes them where its MXFP4 flag is set).

Four expansions. On the GPU in bf16, inline PTX (lut_tile_dot): bit placement from the codes
in the GPU layout the engine rewrites them into at load (e2m1_bf16_swizzled,
mxfp4_layout.SWIZZLE_SHIFTS: 6 masks and 5 shifts, done as multiplies, a word of 8 values), or
from the release layout (e2m1_bf16_placed: 16 integer instructions a word), both where every
scale byte is at most mxfp4_layout.PLACED_SCALE_MAX, as in any real checkpoint; else
byte-permute table lookups (e2m1_bf16_pairs). Each of the three takes fewer instructions an
element than the next, and all far fewer than the arithmetic one below (bench/sass_moe.py
counts them in the sm_90 SASS). Not tl.dot_scaled: Hopper has no MX tensor cores, and Triton's
lowering loads the codes a byte at a time. Everywhere else (the interpreter, fp16, fp32),
arithmetic:

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
from moelora.kernels.moe.mxfp4_layout import SWIZZLE_SHIFTS

GROUP: tl.constexpr = tl.constexpr(32)  # elements along K that share one scale byte


@triton.jit
def _e2m1_float(code):
    """float32 values of e2m1 codes (int32, 0..15)."""
    magnitude = code & 7
    bits = tl.where(magnitude >= 2, (magnitude + 252) << 22, tl.where(magnitude == 1, 252 << 22, 0))
    bits = bits.to(tl.uint32) | ((code & 8).to(tl.uint32) << 28)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def e2m1_bf16_pairs(codes):
    """(even, odd) [BK/2, BN] bfloat16: the e2m1 values of each code byte's low and high nibble
    (elements 2j and 2j + 1), by byte-permute table lookups in inline PTX (GPU only).

    A thread's 4 consecutive bytes are one 32-bit register r. r & 0x77777777 holds the 8
    magnitudes as nibbles in K order, which is what prmt takes as byte selectors: one prmt looks
    up the high bytes of 4 bfloat16 values (0x00, 0x3F x 3, 0x40 x 4 for 0, 0.5 .. 1.5, 2 .. 6)
    and one their low bytes (0x00 0x00 0x80 0xC0 0x00 0x40 0x80 0xC0). Two more prmt put them
    in pairs, the even and the odd elements apart, and the sign bit of each nibble is moved to
    bit 15 of its value. 21 instructions for 8 elements, where mxfp4_tile's arithmetic takes
    several times as many."""
    return tl.inline_asm_elementwise(
        asm="""
        {
        .reg .b32 m, mh, h0, l0, h1, l1, sh, sl, t;
        and.b32 m, $4, 0x77777777;
        prmt.b32 h0, 0x3F3F3F00, 0x40404040, m;
        prmt.b32 l0, 0xC0800000, 0xC0804000, m;
        shr.b32 mh, m, 16;
        prmt.b32 h1, 0x3F3F3F00, 0x40404040, mh;
        prmt.b32 l1, 0xC0800000, 0xC0804000, mh;
        and.b32 sh, $4, 0x80808080;
        shl.b32 sl, $4, 4;
        and.b32 sl, sl, 0x80808080;
        prmt.b32 $0, l0, h0, 0x6240;
        prmt.b32 t, sl, 0, 0x1404;
        or.b32 $0, $0, t;
        prmt.b32 $1, l1, h1, 0x6240;
        prmt.b32 t, sl, 0, 0x3424;
        or.b32 $1, $1, t;
        prmt.b32 $2, l0, h0, 0x7351;
        prmt.b32 t, sh, 0, 0x1404;
        or.b32 $2, $2, t;
        prmt.b32 $3, l1, h1, 0x7351;
        prmt.b32 t, sh, 0, 0x3424;
        or.b32 $3, $3, t;
        }
        """,
        constraints="=r,=r,=r,=r,r",
        args=[codes],
        dtype=(tl.bfloat16, tl.bfloat16),
        is_pure=True,
        pack=4,
    )


def _placed_asm() -> str:
    """e2m1_bf16_placed's PTX: t and u are bytes 0, 1 and 2, 3 of the input in the high bytes
    of two halves; each output takes its sign (shifted left) and its three low bits (shifted
    right) from one of them, the low nibbles (even elements) 4 bits below the high ones."""
    lines = [
        "{",
        ".reg .b32 t, u, a, b;",
        "prmt.b32 t, $4, 0, 0x1404;",
        "prmt.b32 u, $4, 0, 0x3424;",
    ]
    for out, src, sign, bits in (
        ("$0", "t", 4, 2),
        ("$1", "u", 4, 2),
        ("$2", "t", 0, 6),
        ("$3", "u", 0, 6),
    ):
        lines += [
            f"shl.b32 a, {src}, {sign};",
            "and.b32 a, a, 0x80008000;",
            f"shr.b32 b, {src}, {bits};",
            "and.b32 b, b, 0x01C001C0;",
            f"or.b32 {out}, a, b;",
        ]
    return "\n".join([*lines, "}"])


_PLACED_ASM: tl.constexpr = tl.constexpr(_placed_asm())


@triton.jit
def e2m1_bf16_placed(codes):
    """(even, odd) [BK/2, BN] bfloat16 as e2m1_bf16_pairs's, each value times 2^-126: its
    sign, exponent and mantissa bits placed where a bfloat16 keeps them (GPU only).

    An e2m1 code s e1 e0 m becomes the bfloat16 with sign s, exponent field e1 e0 and top
    mantissa bit m: 2^(e - 127) (1 + m / 2) for e > 0, the subnormal 2^-127 for code 1, which is
    the value times 2^-126 (the caller's multiply by the scale times 2^126 is exact). One prmt
    puts bytes 0 and 1 of the thread's register r in the high bytes of two halves; the high
    nibbles are then in place but for a shift of the three low bits, the low nibbles after a
    shift left by 4: 16 instructions for 8 elements, no table constants (the lookups take 21
    and 4 copies of their tables)."""
    return tl.inline_asm_elementwise(
        asm=_PLACED_ASM,
        constraints="=r,=r,=r,=r,r",
        args=[codes],
        dtype=(tl.bfloat16, tl.bfloat16),
        is_pure=True,
        pack=4,
    )


def _swizzled_asm() -> str:
    """e2m1_bf16_swizzled's PTX: the word shifted by each of SWIZZLE_SHIFTS's nonzero amounts
    (left shifts as multiplies, which ptxas issues to the FMA pipe: IMAD.SHL), then each output
    the magnitude bits of one shift and the sign bits of another (one mask, or two that ptxas
    merges into a three-input LOP3)."""
    shifts = sorted({d for pair in SWIZZLE_SHIFTS for d in pair if d})
    name = {d: f"l{d}" if d > 0 else f"r{-d}" for d in shifts} | {0: "$4"}
    lines = ["{", ".reg .b32 m, " + ", ".join(name[d] for d in shifts) + ";"]
    for d in shifts:
        op = (
            f"mul.lo.u32 {name[d]}, $4, {1 << d}"
            if d > 0
            else f"mul.hi.u32 {name[d]}, $4, {1 << (32 + d)}"
        )
        lines.append(op + ";")
    for i, (m, s) in enumerate(SWIZZLE_SHIFTS):
        if m == s:
            lines.append(f"and.b32 ${i}, {name[m]}, 0x81C081C0;")
        else:
            lines += [
                f"and.b32 m, {name[m]}, 0x01C001C0;",
                f"and.b32 ${i}, {name[s]}, 0x80008000;",
                f"or.b32 ${i}, ${i}, m;",
            ]
    return "\n".join([*lines, "}"])


_SWIZZLED_ASM: tl.constexpr = tl.constexpr(_swizzled_asm())


@triton.jit
def e2m1_bf16_swizzled(codes):
    """(even, odd) [BK/2, BN] bfloat16 as e2m1_bf16_placed's, each value times 2^-126, from
    code bytes in the GPU layout (mxfp4_layout.SWIZZLE_SHIFTS) (GPU only). A thread's 4
    consecutive code bytes along K are one word of the layout (the dot operand's K runs of 4
    start at multiples of 4): 6 masks and 5 shifts by multiplies for its 8 values, no byte
    moves."""
    return tl.inline_asm_elementwise(
        asm=_SWIZZLED_ASM,
        constraints="=r,=r,=r,=r,r",
        args=[codes],
        dtype=(tl.bfloat16, tl.bfloat16),
        is_pure=True,
        pack=4,
    )


@triton.jit
def lut_tile_dot(
    xt,  # [BM, BK] bfloat16
    code_ptrs,  # [BK/2, BN], as mxfp4_tile's
    scale_ptrs,  # [BK/32, BN], as mxfp4_tile's
    code_mask,
    scale_mask,
    acc,
    BK: tl.constexpr,
    BN: tl.constexpr,
    EXPAND: tl.constexpr,
):
    """acc + xt @ the tile, its values (EXPAND as gate_up_mxfp4_loop's) from e2m1_bf16_pairs
    (1), e2m1_bf16_placed (2) or e2m1_bf16_swizzled (3), the last two for scale bytes up to
    mxfp4_layout.PLACED_SCALE_MAX, times the scale in bfloat16 (a power of two: exact), as two
    dots: x's even columns times the even elements, its odd ones times the odd. bf16 on the GPU
    only."""
    codes = tl.load(code_ptrs, mask=code_mask, other=0)
    scale_bytes = tl.load(scale_ptrs, mask=scale_mask, other=0)
    return _lut_dot(xt, codes, scale_bytes, acc, BK, BN, EXPAND)


@triton.jit
def _lut_dot(xt, codes, scale_bytes, acc, BK: tl.constexpr, BN: tl.constexpr, EXPAND: tl.constexpr):
    """lut_tile_dot on loaded codes [BK/2, BN] and scale bytes [BK/32, BN]."""
    scale_bytes = scale_bytes.to(tl.uint16)
    if EXPAND == 1:
        even, odd = e2m1_bf16_pairs(codes)
    else:
        if EXPAND == 3:
            even, odd = e2m1_bf16_swizzled(codes)
        else:
            even, odd = e2m1_bf16_placed(codes)
        scale_bytes += 126  # the factor 2^(s - 127) * 2^126: exponent field s + 126
    scale = (scale_bytes << 7).to(tl.bfloat16, bitcast=True)
    scale = tl.broadcast_to(scale[:, None, :], (BK // GROUP, GROUP // 2, BN))
    scale = tl.reshape(scale, (BK // 2, BN))
    BM: tl.constexpr = xt.shape[0]
    x_even, x_odd = tl.split(tl.reshape(xt, (BM, BK // 2, 2)))
    acc = tl.dot(x_even, even * scale, acc)
    return tl.dot(x_odd, odd * scale, acc)


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
def _scale_part(scales, s: tl.constexpr, NSUB: tl.constexpr):
    """Rows s * G .. s * G + G - 1 of scales [NSUB * G, BN] (NSUB 1, 2 or 4): a sub-tile's
    scale bytes out of its tile's, which load as one (a sub-tile's alone are too few bytes a
    thread for the pipeline's asynchronous copies)."""
    if NSUB == 1:
        return scales
    else:
        G: tl.constexpr = scales.shape[0] // NSUB
        BN: tl.constexpr = scales.shape[1]
        t = tl.permute(tl.reshape(scales, (NSUB, G, BN)), (1, 2, 0))  # [G, BN, NSUB]
        if NSUB == 2:
            first, second = tl.split(t)
            return first if s == 0 else second
        else:
            low, high = tl.split(tl.reshape(t, (G, BN, 2, 2)))  # s % 2 = 0, 1
            part = low if s % 2 == 0 else high
            first, second = tl.split(part)  # s // 2 = 0, 1
            return first if s // 2 == 0 else second


@triton.jit
def _scale_mask(offs_ks, k_left, n_ok, EXPAND: tl.constexpr):
    """A scale tile's mask: in the GPU layout (3) the padded rows need none along K
    (mxfp4_layout.SCALE_ROW_GROUPS), else the groups before k_left columns are left."""
    if EXPAND == 3:
        return n_ok[None, :]
    else:
        return (offs_ks < k_left // GROUP)[:, None] & n_ok[None, :]


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
    EXPAND: tl.constexpr,
    SUB_K: tl.constexpr,
):
    """fused_moe's gate_up main loop on packed experts: (acc_g, acc_u) [BM, BN] fp32, x's block
    rows times gate's and up's columns offs_n. H is a multiple of 32. EXPAND (Experts.expand):
    0 by arithmetic (mxfp4_tile); with bf16 x on the GPU only, 1 by table lookups, 2 by bit
    placement, 3 by bit placement from the GPU layout (lut_tile_dot)."""
    # SUB_K (MoeConfig.mxfp4_sub_k): the expansion runs on sub-tiles that deep, not on the
    # whole BK-deep tile, whose bf16 values would all be live in registers before its dots
    # (fewer registers a thread, so more programs a multiprocessor); 0: the whole tile
    SUB: tl.constexpr = min(BK, SUB_K) if SUB_K != 0 else BK
    offs_k = tl.arange(0, SUB)
    offs_kc = tl.arange(0, SUB // 2)
    offs_ks = tl.arange(0, SUB // GROUP)
    rows = offs_n[None, :].to(tl.int64)
    cg0 = w_e + rows * stride_wn + offs_kc[:, None]  # [SUB/2, BN]
    cu0 = cg0 + I * stride_wn
    sg0 = s_e + rows * stride_sn + offs_ks[:, None]  # [SUB/32, BN]
    su0 = sg0 + I * stride_sn
    acc_g = tl.zeros((BM, BN), dtype=tl.float32)
    acc_u = tl.zeros((BM, BN), dtype=tl.float32)
    NSUB: tl.constexpr = BK // SUB
    offs_kt = tl.arange(0, BK // GROUP)
    for k0 in range(0, H, BK):
        if EXPAND == 3 and NSUB > 1:  # the tile's scales at once (padded rows: no K mask)
            tile_g = tl.load(
                s_e + rows * stride_sn + (k0 // GROUP + offs_kt)[:, None],
                mask=n_ok[None, :],
                other=0,
            )
            tile_u = tl.load(
                s_e + (rows + I) * stride_sn + (k0 // GROUP + offs_kt)[:, None],
                mask=n_ok[None, :],
                other=0,
            )
        for s in tl.static_range(NSUB):
            ks = k0 + s * SUB
            xt = tl.load(
                x_ptr + x_rows[:, None] + (ks + offs_k)[None, :],
                mask=row_ok[:, None] & (offs_k < H - ks)[None, :],
                other=0.0,
            )
            c_mask = (offs_kc < (H - ks) // 2)[:, None] & n_ok[None, :]
            s_mask = _scale_mask(offs_ks, H - ks, n_ok, EXPAND)
            cg, cu, sg, su = cg0 + ks // 2, cu0 + ks // 2, sg0 + ks // GROUP, su0 + ks // GROUP
            if EXPAND == 3 and NSUB > 1:
                codes_g = tl.load(cg, mask=c_mask, other=0)
                codes_u = tl.load(cu, mask=c_mask, other=0)
                part_g = _scale_part(tile_g, s, NSUB)
                part_u = _scale_part(tile_u, s, NSUB)
                acc_g = _lut_dot(xt, codes_g, part_g, acc_g, SUB, BN, EXPAND)
                acc_u = _lut_dot(xt, codes_u, part_u, acc_u, SUB, BN, EXPAND)
            elif EXPAND != 0:
                acc_g = lut_tile_dot(xt, cg, sg, c_mask, s_mask, acc_g, SUB, BN, EXPAND)
                acc_u = lut_tile_dot(xt, cu, su, c_mask, s_mask, acc_u, SUB, BN, EXPAND)
            else:
                wg = mxfp4_tile(cg, sg, c_mask, s_mask, SUB, BN).to(xt.dtype)
                acc_g = dot(xt, wg, acc_g)
                wu = mxfp4_tile(cu, su, c_mask, s_mask, SUB, BN).to(xt.dtype)
                acc_u = dot(xt, wu, acc_u)
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
    EXPAND: tl.constexpr,
    SUB_K: tl.constexpr,
):
    """fused_moe's down main loop on packed experts: acc [BM, BN] fp32, h's block rows times
    down's columns offs_n. I is a multiple of 32. EXPAND as gate_up_mxfp4_loop's."""
    SUB: tl.constexpr = min(BK, SUB_K) if SUB_K != 0 else BK  # as gate_up_mxfp4_loop's
    offs_k = tl.arange(0, SUB)
    offs_kc = tl.arange(0, SUB // 2)
    offs_ks = tl.arange(0, SUB // GROUP)
    rows = offs_n[None, :].to(tl.int64)
    c0 = w_e + rows * stride_wn + offs_kc[:, None]  # [SUB/2, BN]
    s0 = s_e + rows * stride_sn + offs_ks[:, None]  # [SUB/32, BN]
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    NSUB: tl.constexpr = BK // SUB
    offs_kt = tl.arange(0, BK // GROUP)
    for k0 in range(0, I, BK):
        if EXPAND == 3 and NSUB > 1:  # as gate_up_mxfp4_loop's
            tile_s = tl.load(
                s_e + rows * stride_sn + (k0 // GROUP + offs_kt)[:, None],
                mask=n_ok[None, :],
                other=0,
            )
        for s in tl.static_range(NSUB):
            ks = k0 + s * SUB
            ht = tl.load(
                h_ptr + h_offs[:, None] + (ks + offs_k)[None, :],
                mask=row_ok[:, None] & (offs_k < I - ks)[None, :],
                other=0.0,
            )
            c_mask = (offs_kc < (I - ks) // 2)[:, None] & n_ok[None, :]
            s_mask = _scale_mask(offs_ks, I - ks, n_ok, EXPAND)
            c, sc = c0 + ks // 2, s0 + ks // GROUP
            if EXPAND == 3 and NSUB > 1:
                codes = tl.load(c, mask=c_mask, other=0)
                acc = _lut_dot(ht, codes, _scale_part(tile_s, s, NSUB), acc, SUB, BN, EXPAND)
            elif EXPAND != 0:
                acc = lut_tile_dot(ht, c, sc, c_mask, s_mask, acc, SUB, BN, EXPAND)
            else:
                w = mxfp4_tile(c, sc, c_mask, s_mask, SUB, BN).to(ht.dtype)
                acc = dot(ht, w, acc)
    return acc
