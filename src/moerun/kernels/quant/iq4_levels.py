"""The IQ4_NL / IQ4_XS / MXFP4 level lookup on packed code words, for the int8-x decode (int8_dot.q8_dot) and the
tile64 prefill step (tile64.decode_pair64).

A repacked 4-bit code word holds eight codes: byte b has the plane-0 code of element 4j + b in its low nibble and
the plane-1 code of element 32 + 4j + b in its high nibble (repack.py). `iq4_levels` turns one such word into two
words of four levels each (IQ4_VALUES, or MXFP4's FP4_VALUES, as signed bytes, or + 128 as unsigned bytes), one per
plane, with eight byte permutes (PTX prmt, as llama.cpp's CUDA kernels do): the low three bits of each code pick a
byte of one half of the 16-entry table, held in two pairs of int32 words, and its top bit picks the half. In
Triton's interpreter, and on GPUs that take no PTX, prmt is emulated with shifts and selects (constexpr EMULATE),
the same permutes.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def prmt(a, b, sel, EMULATE: tl.constexpr):
    """PTX prmt.b32 (default mode), elementwise on int32 of one shape: byte n of the result is byte
    (sel >> 4n) & 7 of {b, a} (a: bytes 0-3, b: 4-7), or that byte's sign replicated where bit 3 of the nibble
    is set. Only the low 16 bits of sel count."""
    if EMULATE:
        out = tl.zeros_like(a)
        for n in tl.static_range(4):
            s = (sel >> (4 * n)) & 0xF
            idx = s & 7
            byte = (tl.where(idx < 4, a, b) >> ((idx & 3) * 8)) & 0xFF
            byte = tl.where((s & 8) != 0, tl.where((byte & 0x80) != 0, 0xFF, 0), byte)
            out = out | (byte << (8 * n))
        return out
    return tl.inline_asm_elementwise("prmt.b32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, sel], dtype=tl.int32,
                                     is_pure=True, pack=1)  # fmt: skip


@triton.jit
def iq4_levels(w, UNSIGNED: tl.constexpr, EMULATE: tl.constexpr, FP4: tl.constexpr = False):
    """The levels of the eight codes of int32 words w (any shape): (plane-0 word, plane-1 word), byte b of each
    the level of the code in the low / high nibble of byte b of w; signed bytes, or level + 128 (UNSIGNED).
    FP4 picks MXFP4's table (formats.quants.FP4_VALUES) instead of IQ4_VALUES."""
    # The levels as little-endian bytes, four a word: levels 0-3, 4-7, 8-11, 12-15; plus 128 (UNSIGNED: the bytes
    # tile64 turns into floats) or signed. IQ4: -127, -104, ..., 113; FP4: 0, 1, 2, 3, 4, 6, 8, 12, 0, -1, ..., -12.
    if FP4:
        if UNSIGNED:
            t0, t1, t2, t3 = -2088599168, -1937209724, 2105442176, 1954052732
        else:
            t0, t1, t2, t3 = 50462976, 201852420, -33620224, -185009412
    elif UNSIGNED:
        t0, t1, t2, t3 = 1059919873, 1986682191, -1499886207, -237386315
    else:
        t0, t1, t2, t3 = -1079142271, -152379953, 639175937, 1901675829
    lo_a = tl.full(w.shape, t0, tl.int32)
    lo_b = tl.full(w.shape, t1, tl.int32)
    hi_a = tl.full(w.shape, t2, tl.int32)
    hi_b = tl.full(w.shape, t3, tl.int32)
    sel = w & 0x77777777  # each code's byte in its half of the table, sign-replicate bit clear
    pick = 0x32103210 | ((w >> 1) & 0x44444444)  # byte n of the lower half's result, or (code >= 8) the upper's
    # Nibbles 0-3 of w (bytes 0, 1), then 4-7 (bytes 2, 3): levels in nibble order, plane 0 and 1 alternating.
    first = prmt(prmt(lo_a, lo_b, sel, EMULATE), prmt(hi_a, hi_b, sel, EMULATE), pick, EMULATE)
    sel = sel >> 16
    pick = pick >> 16
    second = prmt(prmt(lo_a, lo_b, sel, EMULATE), prmt(hi_a, hi_b, sel, EMULATE), pick, EMULATE)
    even = tl.full(w.shape, 0x6420, tl.int32)
    odd = tl.full(w.shape, 0x7531, tl.int32)
    return prmt(first, second, even, EMULATE), prmt(first, second, odd, EMULATE)
