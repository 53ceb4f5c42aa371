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
def iq4_scales(QT: tl.constexpr, sub, scale, rows3, g3, KQ, ok3):
    """IQ4_NL (QT 20) / IQ4_XS (23) pair g: the float32 scale of its plane-0 and plane-1 32-element blocks
    [R0, R1, G] (IQ4_XS: d times the signed sub-block scale, rounded once as the GGUF decoder rounds it)."""
    if QT == 20:  # fp16 d per 32 elements, two a pair
        sp = scale + rows3 * (KQ * 2) + 2 * g3
        d0 = tl.load(sp, mask=ok3, other=0.0).to(tl.float32)
        d1 = tl.load(sp + 1, mask=ok3, other=0.0).to(tl.float32)
    else:  # signed bytes (sc 2g, sc 2g + 1, 0, 0), fp16 d per 256 elements
        sw = tl.load(sub + rows3 * KQ + g3, mask=ok3, other=0)
        d = tl.load(scale + rows3 * (KQ // 4) + g3 // 4, mask=ok3, other=0.0).to(tl.float32)
        d0 = d * ((sw << 24) >> 24).to(tl.float32)
        d1 = d * ((sw << 16) >> 24).to(tl.float32)
    return d0, d1


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
