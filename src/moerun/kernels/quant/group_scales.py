"""Per-group scales of the decode kernels (gemv_v2 and its int8-x variant) read from the repacked arrays (layouts
in repack.py): rows3 [R0, R1, 1] row indices, g3 [.., G] group indices, ok3 the row mask, KQ = K_pad / 64."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def q4_k_scales(sub, scale, rows3, g3, KQ, ok3):
    """Q4_K pair g: (d, dmin, sc 2g, sc 2g + 1, mn 2g, mn 2g + 1) as float32 [R0, R1, G]."""
    sw = tl.load(sub + rows3 * KQ + g3, mask=ok3, other=0)  # bytes (sc 2q, sc 2q+1, mn 2q, mn 2q+1)
    sp = scale + (rows3 * (KQ // 4) + g3 // 4) * 2  # d, dmin per 256 elements
    d = tl.load(sp, mask=ok3, other=0.0).to(tl.float32)
    dmin = tl.load(sp + 1, mask=ok3, other=0.0).to(tl.float32)
    sc0 = (sw & 0xFF).to(tl.float32)
    sc1 = ((sw >> 8) & 0xFF).to(tl.float32)
    mn0 = ((sw >> 16) & 0xFF).to(tl.float32)
    mn1 = ((sw >> 24) & 0xFF).to(tl.float32)
    return d, dmin, sc0, sc1, mn0, mn1


@triton.jit
def block32_scales(QT: tl.constexpr, scale, rows3, g3, KQ, ok3):
    """Pair g of a type with a scale per 32-element block (Q4_0 2, Q4_1 3, Q5_0 6, Q5_1 7, IQ4_NL 20, MXFP4 39): (d0,
    m0, d1, m1) of its plane-0 and plane-1 blocks as float32 [R0, R1, G]; m is the fp16 offset of Q4_1 / Q5_1, else
    0 (MXFP4's d is bfloat16: bf16_pair)."""
    if QT == 3 or QT == 7:  # (d, m) per block
        sp = scale + (rows3 * (KQ * 2) + 2 * g3) * 2
        d0 = tl.load(sp, mask=ok3, other=0.0).to(tl.float32)
        m0 = tl.load(sp + 1, mask=ok3, other=0.0).to(tl.float32)
        d1 = tl.load(sp + 2, mask=ok3, other=0.0).to(tl.float32)
        m1 = tl.load(sp + 3, mask=ok3, other=0.0).to(tl.float32)
    elif QT == 39:  # MXFP4: bf16 d per block
        d0, d1 = bf16_pair(scale, rows3 * (KQ * 2) + 2 * g3, ok3)
        m0 = tl.zeros_like(d0)
        m1 = m0
    else:  # fp16 d per block
        sp = scale + rows3 * (KQ * 2) + 2 * g3
        d0 = tl.load(sp, mask=ok3, other=0.0).to(tl.float32)
        d1 = tl.load(sp + 1, mask=ok3, other=0.0).to(tl.float32)
        m0 = tl.zeros_like(d0)
        m1 = m0
    return d0, m0, d1, m1


@triton.jit
def bf16_pair(scale, idx, ok=None):
    """float32 of the bfloat16 scales at idx and idx + 1 (masked by ok, if given), widened by their bits: Triton's
    interpreter flushes bfloat16 subnormals (MXFP4's 2^-128, 2^-127) to zero in a conversion; the GPU's does not."""
    bits = scale.to(tl.pointer_type(tl.int16)) + idx
    if ok is None:
        b0 = tl.load(bits)
        b1 = tl.load(bits + 1)
    else:
        b0 = tl.load(bits, mask=ok, other=0)
        b1 = tl.load(bits + 1, mask=ok, other=0)
    return (b0.to(tl.int32) << 16).to(tl.float32, bitcast=True), (b1.to(tl.int32) << 16).to(tl.float32, bitcast=True)


@triton.jit
def iq4_xs_scales(sub, scale, rows3, g3, KQ, ok3):
    """IQ4_XS pair g: the float32 scale of its plane-0 and plane-1 32-element sub-blocks [R0, R1, G]: d times the
    signed sub-block scale, rounded once as the GGUF decoder rounds it."""
    sw = tl.load(sub + rows3 * KQ + g3, mask=ok3, other=0)  # signed bytes (sc 2g, sc 2g + 1, 0, 0)
    d = tl.load(scale + rows3 * (KQ // 4) + g3 // 4, mask=ok3, other=0.0).to(tl.float32)  # fp16 d per 256
    return d * ((sw << 24) >> 24).to(tl.float32), d * ((sw << 16) >> 24).to(tl.float32)


@triton.jit
def q2_k_scales(sub, scale, rows3, g3, KQ, ok3):
    """Q2_K group g = half h = g % 2 of pair g // 2: (d, dmin, scale and min of its plane-0 and plane-1
    16-element sub-blocks) as float32 [R0, R1, G]; the sub-block bytes are (min << 4) | scale."""
    sw = tl.load(sub + rows3 * KQ + g3 // 2, mask=ok3, other=0)  # [R0, R1, G]
    h3 = g3 % 2
    b0 = (sw >> (8 * h3)) & 0xFF  # sub-block h
    b1 = (sw >> (16 + 8 * h3)) & 0xFF  # sub-block 2 + h
    sp = scale + (rows3 * (KQ // 4) + g3 // 8) * 2  # d, dmin per 256 elements
    d = tl.load(sp, mask=ok3, other=0.0).to(tl.float32)
    dmin = tl.load(sp + 1, mask=ok3, other=0.0).to(tl.float32)
    return d, dmin, (b0 & 15).to(tl.float32), (b1 & 15).to(tl.float32), (b0 >> 4).to(tl.float32), \
        (b1 >> 4).to(tl.float32)


@triton.jit
def q6_k_scales(sub, scale, rows3, g3, KQ, ok3):
    """Q6_K group g = half h = g % 2 of pair g // 2: (d, scale of its plane-0 and plane-1 16-element sub-blocks)
    as float32 [R0, R1, G]."""
    sw = tl.load(sub + rows3 * KQ + g3 // 2, mask=ok3, other=0)  # [R0, R1, G] signed bytes
    h3 = g3 % 2
    sc0 = ((sw << (24 - 8 * h3)) >> 24).to(tl.float32)  # byte h
    sc1 = ((sw << (8 - 8 * h3)) >> 24).to(tl.float32)  # byte 2 + h
    d = tl.load(scale + rows3 * (KQ // 4) + g3 // 8, mask=ok3, other=0.0).to(tl.float32)
    return d, sc0, sc1


@triton.jit
def pair_codes(QT: tl.constexpr, codes, high, rows4, g4, j4, KQ, ok4):
    """Pair g's code words [R0, R1, G, 8] of a 4-bit type (Q4_K 12, Q4_0 2, Q4_1 3) or of one with a fifth bit
    (Q5_K 13, Q5_0 6, Q5_1 7): (plane-0 codes, plane-1 codes), four unsigned codes a word."""
    w = tl.load(codes + rows4 * (KQ * 8) + g4 * 8 + j4, mask=ok4, other=0)  # [R0, R1, G, 8] int32
    c0 = w & 0x0F0F0F0F  # low nibbles: plane 0
    c1 = (w >> 4) & 0x0F0F0F0F  # high nibbles: plane 1
    if QT == 13 or (QT == 6 or QT == 7):
        # Pair q's fifth bits are bits 2 (q % 4) (plane 0) and 2 (q % 4) + 1 (plane 1) of the bytes of word j of
        # group q // 4 of the high array (KQ * 2 words a row).
        hw = tl.load(high + rows4 * (KQ * 2) + (g4 // 4) * 8 + j4, mask=ok4, other=0)
        s = 2 * (g4 % 4)  # [1, 1, G, 1]
        c0 = c0 | (((hw >> s) & 0x01010101) << 4)
        c1 = c1 | (((hw >> (s + 1)) & 0x01010101) << 4)
    return c0, c1


@triton.jit
def q3_k_codes(QT: tl.constexpr, codes, high, rows4, g4, j4, KQ, ok4):
    """Q2_K (QT 10) / Q3_K (11) group g's code words [R0, R1, G, 4], the 2-bit codes (and Q3_K's third bit) of its
    plane-0 and plane-1 16-element halves as bytes: (plane-0 codes, plane-1 codes), four a word."""
    q4 = g4 // 2
    # Element 64q + 32p + 16h + 4j + b: byte 32 (q // 2) + 16h + 4j + b of the codes at bits 2 (2 (q % 2) + p)
    w = tl.load(codes + rows4 * (KQ * 4) + (q4 // 2) * 8 + (g4 % 2) * 4 + j4, mask=ok4, other=0)
    s = 4 * (q4 % 2)
    c0 = (w >> s) & 0x03030303
    c1 = (w >> (s + 2)) & 0x03030303
    if QT == 11:  # the third bit: byte 32 (q // 4) + 16h + 4j + b of the high array, bit 2 (q % 4) + p
        hw = tl.load(high + rows4 * (KQ * 2) + (q4 // 4) * 8 + (g4 % 2) * 4 + j4, mask=ok4, other=0)
        t = 2 * (q4 % 4)
        c0 = c0 | (((hw >> t) & 0x01010101) << 2)
        c1 = c1 | (((hw >> (t + 1)) & 0x01010101) << 2)
    return c0, c1


@triton.jit
def q6_k_codes(codes, high, rows4, g4, j4, KQ, ok4):
    """Q6_K group g's code words [R0, R1, G, 4] with the two high bits merged into each code byte: (plane-0 codes,
    plane-1 codes), four unsigned 6-bit codes a word."""
    q4 = g4 // 2
    w = tl.load(codes + rows4 * (KQ * 8) + g4 * 4 + j4, mask=ok4, other=0)  # [R0, R1, G, 4] int32
    # Pair q's high bits sit at bits 4 (q % 2) + 2p of the bytes of group 2 (q // 2) + h of the high array.
    hw = tl.load(high + rows4 * (KQ * 4) + (2 * (q4 // 2) + g4 % 2) * 4 + j4, mask=ok4, other=0)
    hw = hw >> (4 * (q4 % 2))
    c0 = (w & 0x0F0F0F0F) | ((hw << 4) & 0x30303030)
    c1 = ((w >> 4) & 0x0F0F0F0F) | ((hw << 2) & 0x30303030)
    return c0, c1
