"""The in-register decode of the "tile64" prefill step: a whole pair (64 inputs) of a weight of any packed type
(repack.py) a step, for the tile kernels of fused_moe_quant.py and matmul_quant.py (their constexpr PAIR64).

Their other step decodes a pair as two [BLOCK_N, 32] planes (decode.dequant_pair), each multiplied in its own
32-deep tl.dot; compiled for sm_90 each of those dots waits for the one before it. decode_pair64 reads a pair's code
bytes as int32 words (8 words of a row a plane), masks the nibbles and top bits four elements an
instruction, turns each byte into a float with one PRMT on the GPU (0.5 + byte / 256: the byte under the exponent
bits of 0.5), scales and offsets it with one FMA, and joins the two planes' [BLOCK_N, 8, 4] (word, byte) tiles
into element order, so the [BLOCK_N, 64] tile enters one tl.dot as the left operand (out^T = W x^T).

Every load is at least four bytes a thread (the fp16 block scales are read as the int32 words that hold them), so
Triton's pipeliner issues them `num_stages` steps ahead.

The kernels state that the step loop runs at least once (`tl.assume(KQ > 0)`). Without it the compiled loop keeps a
path that skips it, and that path zeroes the accumulators again. The block layout places that path after the loop,
and ptxas then serialises every product (its note C7515: "non wgmma instructions defining accumulator registers"),
so a program's decode and products alternated. With the hint the products stay in flight behind the next pair's
decode: on an H200 the Q4_K_M layer is 10% faster at M = 1024 and 2048. The same kernel with the decode left out
runs at the bf16 kernel's speed (benchmarks/RESULTS.md): what remains is the decode's integer and float work.

Placing the code at 0.5 + c / 256 rather than 2^23 + c lets the offset fold into the FMA's addend (at 2^23 the
addend would round away the code's bits): one float instruction a value fewer. This is exact for Q6_K, Q8_0, Q3_K,
Q4_0 and Q5_0. For Q4_K, Q5_K, Q2_K, Q4_1 and Q5_1 the addend 128 s + m (128 d - m) is rounded once, by half its
float32 ulp: 2^-17 s where the scale's term leads, about one float32 rounding of the value where the minimum's does.

IQ4_NL, IQ4_XS and MXFP4 codes become their levels + 128 by byte permutes (iq4_levels.py), then the level itself by
one exact FMA (f 2^16 - 32896) and the value by one product with the plane's scale, as the GGUF decoder rounds it.
"""

from __future__ import annotations

import triton
import triton.language as tl

from moerun.formats.quants import QuantType
from moerun.kernels.quant.iq4_levels import iq4_levels
from moerun.kernels.quant.repack import PACKED_TYPES

TILE64_TYPES = PACKED_TYPES  # every type with a repacked layout


def tile64_supported(*qtypes: QuantType) -> bool:
    """True when the tile64 kernels decode every one of these types."""
    return all(t in TILE64_TYPES for t in qtypes)


@triton.jit
def _half(word, upper):
    """float32 of the fp16 in the low (upper = 0) or high (upper = 1) half of int32 `word`."""
    bits = (word >> (upper * 16)) & 0xFFFF
    return bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _byte(word, i):
    """float32 of unsigned byte i of int32 `word` (exponent trick: no integer-to-float conversion)."""
    return ((((word >> (i * 8)) & 0xFF) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0)


@triton.jit
def _bytes_float(word, b, SHIFT: tl.constexpr, INTERPRET: tl.constexpr):
    """0.5 + byte / 2^(24 - SHIFT) as float32, for byte b of int32 `word` (word [BN, W, 1], b [1, 1, 4] -> [BN, W,
    4]): the byte laid under the exponent bits of 0.5 at bit SHIFT (16 for codes below 128, 8 for whole bytes).

    On the GPU that is one PRMT (bytes 0x00 ... byte ... 0x3F), where shift, mask and OR take three instructions;
    the interpreter runs the same in plain integers. The caller's scale and offset fold the 0.5 back into one FMA,
    so no subtraction of the offset remains (the former 2^23 + byte needed one of its own: at that magnitude an
    offset folded into the FMA's addend loses the code's bits)."""
    if INTERPRET:
        bits = (((word >> (b * 8)) & 0xFF) << SHIFT) | 0x3F000000
    else:
        # result bytes from {word, 0x3F000000}: 0x00 (byte 4) below the code, the code at SHIFT, 0x3F on top (7)
        if SHIFT == 16:
            selector = 0x7044 + (b << 8)
        else:
            tl.static_assert(SHIFT == 8, "_bytes_float: the code goes to bit 8 or 16")
            selector = 0x7404 + (b << 4)
        bits = tl.inline_asm_elementwise("prmt.b32 $0, $1, 0x3F000000, $2;", "=r,r,r",
                                         [tl.broadcast_to(word, (word.shape[0], word.shape[1], 4)),
                                          tl.broadcast_to(selector, (word.shape[0], word.shape[1], 4))],
                                         dtype=tl.int32, is_pure=True, pack=1)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _scaled(f, scale, offset, INTERPRET: tl.constexpr):
    """f scale - offset, rounded once: the GPU contracts it into one FMA; the interpreter, which would round the
    product first, takes tl.fma (the Q8_0 product needs more than float32's 24 bits until the offset cancels it)."""
    if INTERPRET:
        return tl.fma(f, scale, -offset)
    return f * scale - offset


@triton.jit
def decode_pair64(QTYPE: tl.constexpr, codes, high, sub, scale, rows, q, KQ, INTERPRET: tl.constexpr):
    """float32 [BN, 64] values of elements 64q .. 64q + 63 of `rows` ([BN, 1] int64 global row indices).

    Code bytes are read as int32 words. Element 32p + 4i + b of the pair (plane p, word i, byte b) is decoded in
    a [BN, 8, 4] tile per plane; the two planes are joined and laid out in element order at the end."""
    words = scale.to(tl.pointer_type(tl.int32))  # fp16 scales read as the int32 words that hold them
    rows3 = rows[:, :, None]  # [BN, 1, 1]
    wi = tl.arange(0, 8)[None, :, None]  # [1, 8, 1]
    b = tl.arange(0, 4)[None, None, :]  # [1, 1, 4] byte of a word
    if QTYPE == 8:  # Q8_0: byte 64q + e is element e + 128; d0, d1 of the two 32-blocks in one word
        cp = codes.to(tl.pointer_type(tl.int32)) + rows3 * (KQ * 16) + q * 16 + wi  # [BN, 8, 1]
        dd = tl.load(words + rows3 * KQ + q)  # [BN, 1, 1]
        d0 = _half(dd, 0)
        d1 = _half(dd, 1)
        # (byte - 128) d = f 2^16 d - (2^15 + 128) d for f = 0.5 + byte / 2^16: exact in one FMA
        v0 = _scaled(_bytes_float(tl.load(cp), b, 8, INTERPRET), 65536.0 * d0, 32896.0 * d0, INTERPRET)  # [BN, 8, 4]
        v1 = _scaled(_bytes_float(tl.load(cp + 8), b, 8, INTERPRET), 65536.0 * d1, 32896.0 * d1, INTERPRET)
    elif (QTYPE == 20 or QTYPE == 23) or QTYPE == 39:  # IQ4_NL, IQ4_XS, MXFP4: level(c) times the plane's scale
        cw = tl.load(codes.to(tl.pointer_type(tl.int32)) + rows3 * (KQ * 8) + q * 8 + wi)  # [BN, 8, 1]
        u0, u1 = iq4_levels(cw, True, INTERPRET, QTYPE == 39)  # levels + 128, four a word
        if QTYPE == 20:  # fp16 d of each 32-element block, both of the pair in one word
            dd = tl.load(words + rows3 * KQ + q)  # [BN, 1, 1]
            d0 = _half(dd, 0)
            d1 = _half(dd, 1)
        elif QTYPE == 39:  # bf16 d of each 32-element block (a float32's top half), both in one word
            dd = tl.load(words + rows3 * KQ + q)  # [BN, 1, 1]
            d0 = (dd << 16).to(tl.float32, bitcast=True)
            d1 = (dd & -65536).to(tl.float32, bitcast=True)
        else:  # d (d per 256) times the signed scale of sub-block 2q + p
            idx = rows3 * (KQ // 4) + q // 4
            d = _half(tl.load(words + idx // 2), idx % 2)  # [BN, 1, 1]
            sw = tl.load(sub + rows3 * KQ + q)  # bytes (sc 2q, sc 2q + 1, 0, 0)
            d0 = d * ((sw << 24) >> 24).to(tl.float32)
            d1 = d * ((sw << 16) >> 24).to(tl.float32)
        # level = f 2^16 - (2^15 + 128) for f = 0.5 + (level + 128) / 2^16: exact, then one rounding times d
        v0 = (_bytes_float(u0, b, 8, INTERPRET) * 65536.0 - 32896.0) * d0  # [BN, 8, 4]
        v1 = (_bytes_float(u1, b, 8, INTERPRET) * 65536.0 - 32896.0) * d1
    elif QTYPE == 10 or QTYPE == 11:  # Q2_K, Q3_K: 2-bit codes, byte 32(q // 2) + l at bits 4(q % 2) + 2p
        cw = tl.load(codes.to(tl.pointer_type(tl.int32)) + rows3 * (KQ * 4) + (q // 2) * 8 + wi) >> ((q % 2) * 4)
        lo = cw & 0x03030303
        hi = (cw >> 2) & 0x03030303
        w = tl.load(sub + rows3 * KQ + q)  # [BN, 1, 1] the bytes of 16-element sub-blocks 2p + i // 4
        first = wi < 4
        if QTYPE == 11:  # Q3_K: third bits, byte 32(q // 4) + l of `high`, bit 2(q % 4) + p; (c - 4)(d sc)
            hw = tl.load(high.to(tl.pointer_type(tl.int32)) + rows3 * (KQ * 2) + (q // 4) * 8 + wi) >> ((q % 4) * 2)
            lo = lo | ((hw & 0x01010101) << 2)
            hi = hi | ((hw & 0x02020202) << 1)
            idx = rows3 * (KQ // 4) + q // 4  # fp16 d of the super-block
            d = _half(tl.load(words + idx // 2), idx % 2)  # [BN, 1, 1]
            ws = w ^ -2139062144  # 0x80808080: the signed scale + 128
            dl0 = tl.where(first, d * (_byte(ws, 0) - 128.0), d * (_byte(ws, 1) - 128.0))  # [BN, 8, 1]
            dl1 = tl.where(first, d * (_byte(ws, 2) - 128.0), d * (_byte(ws, 3) - 128.0))
            # (c - 4) dl = f 256 dl - 132 dl for f = 0.5 + c / 256; 132 dl is exact in float32
            v0 = _scaled(_bytes_float(lo, b, 16, INTERPRET), 256.0 * dl0, 132.0 * dl0, INTERPRET)
            v1 = _scaled(_bytes_float(hi, b, 16, INTERPRET), 256.0 * dl1, 132.0 * dl1, INTERPRET)
        else:  # Q2_K: c (d sc) - dmin mn, bytes (mn << 4) | sc; the addend rounded once, as Q4_K's
            dd = tl.load(words + rows3 * (KQ // 4) + q // 4)  # [BN, 1, 1] d | dmin << 16
            d = _half(dd, 0)
            dmin = _half(dd, 1)
            b0 = tl.where(first, w & 0xFF, (w >> 8) & 0xFF)  # [BN, 8, 1] sub-block byte of plane 0
            b1 = tl.where(first, (w >> 16) & 0xFF, (w >> 24) & 0xFF)
            s0 = d * (b0 & 15).to(tl.float32)
            s1 = d * (b1 & 15).to(tl.float32)
            v0 = _scaled(_bytes_float(lo, b, 16, INTERPRET), 256.0 * s0, 128.0 * s0 + dmin * (b0 >> 4).to(tl.float32),
                         INTERPRET)  # fmt: skip
            v1 = _scaled(_bytes_float(hi, b, 16, INTERPRET), 256.0 * s1, 128.0 * s1 + dmin * (b1 >> 4).to(tl.float32),
                         INTERPRET)  # fmt: skip
    else:  # 4-bit codes: Q4_K, Q5_K, Q6_K, and the 32-element-block types Q4_0, Q4_1, Q5_0, Q5_1
        # Nibbles and top bits are masked in whole words (four elements an instruction), then split into bytes.
        cw = tl.load(codes.to(tl.pointer_type(tl.int32)) + rows3 * (KQ * 8) + q * 8 + wi)  # [BN, 8, 1]
        lo = cw & 0x0F0F0F0F
        hi = (cw >> 4) & 0x0F0F0F0F
        if QTYPE == 12 or (QTYPE == 13 or QTYPE == 14):
            w = tl.load(sub + rows3 * KQ + q)  # [BN, 1, 1] four sub-block bytes
        if QTYPE == 13 or (QTYPE == 6 or QTYPE == 7):
            # Q5_K, Q5_0, Q5_1: fifth bits, byte 32(q // 4) + l of `high`, bit 2(q % 4) + p
            hw = tl.load(high.to(tl.pointer_type(tl.int32)) + rows3 * (KQ * 2) + (q // 4) * 8 + wi) >> ((q % 4) * 2)
            lo = lo | ((hw & 0x01010101) << 4)
            hi = hi | ((hw & 0x02020202) << 3)
        if QTYPE == 14:  # Q6_K: top two bits, byte 32(q // 2) + l of `high`, bits 4(q % 2) + 2p; (c - 32)(d sc)
            hw = tl.load(high.to(tl.pointer_type(tl.int32)) + rows3 * (KQ * 4) + (q // 2) * 8 + wi) >> ((q % 2) * 4)
            lo = lo | ((hw & 0x03030303) << 4)
            hi = hi | ((hw & 0x0C0C0C0C) << 2)
            idx = rows3 * (KQ // 4) + q // 4  # fp16 d of the super-block
            d = _half(tl.load(words + idx // 2), idx % 2)  # [BN, 1, 1]
            # signed scales of the 16-element sub-blocks 2p + i // 4: (byte ^ 0x80) is the signed byte + 128
            ws = w ^ -2139062144  # 0x80808080
            first = wi < 4
            dl0 = tl.where(first, d * (_byte(ws, 0) - 128.0), d * (_byte(ws, 1) - 128.0))  # [BN, 8, 1]
            dl1 = tl.where(first, d * (_byte(ws, 2) - 128.0), d * (_byte(ws, 3) - 128.0))
            # (c - 32) dl = f 256 dl - 160 dl for f = 0.5 + c / 256; 160 dl is exact in float32
            v0 = _scaled(_bytes_float(lo, b, 16, INTERPRET), 256.0 * dl0, 160.0 * dl0, INTERPRET)
            v1 = _scaled(_bytes_float(hi, b, 16, INTERPRET), 256.0 * dl1, 160.0 * dl1, INTERPRET)
        elif (QTYPE == 2 or QTYPE == 3) or (QTYPE == 6 or QTYPE == 7):  # blocks 2q, 2q + 1
            if QTYPE == 3 or QTYPE == 7:  # c d + m = f 256 d - (128 d - m): the addend rounded once, as Q4_K's
                dm0 = tl.load(words + rows3 * (KQ * 2) + 2 * q)  # [BN, 1, 1] d | m << 16 of block 2q
                dm1 = tl.load(words + rows3 * (KQ * 2) + 2 * q + 1)
                d0 = _half(dm0, 0)
                d1 = _half(dm1, 0)
                v0 = _scaled(_bytes_float(lo, b, 16, INTERPRET), 256.0 * d0, 128.0 * d0 - _half(dm0, 1), INTERPRET)
                v1 = _scaled(_bytes_float(hi, b, 16, INTERPRET), 256.0 * d1, 128.0 * d1 - _half(dm1, 1), INTERPRET)
            else:  # (c - 8) d = f 256 d - 136 d, (c - 16) d = f 256 d - 144 d: exact in one FMA
                dd = tl.load(words + rows3 * KQ + q)  # [BN, 1, 1] d of blocks 2q, 2q + 1
                d0 = _half(dd, 0)
                d1 = _half(dd, 1)
                offset = 136.0 if QTYPE == 2 else 144.0
                v0 = _scaled(_bytes_float(lo, b, 16, INTERPRET), 256.0 * d0, offset * d0, INTERPRET)
                v1 = _scaled(_bytes_float(hi, b, 16, INTERPRET), 256.0 * d1, offset * d1, INTERPRET)
        else:  # Q4_K, Q5_K: c (d sc) - dmin mn, sub-block p's scale byte p, min byte 2 + p
            tl.static_assert(QTYPE == 12 or QTYPE == 13, "decode_pair64: unsupported quant type")
            dd = tl.load(words + rows3 * (KQ // 4) + q // 4)  # [BN, 1, 1] d | dmin << 16
            d = _half(dd, 0)
            dmin = _half(dd, 1)
            # c s - m = f 256 s - (128 s + m) for f = 0.5 + c / 256. 128 s + m is rounded once (half its ulp:
            # at most 2^-17 s or one float32 rounding of m), far below the bf16 rounding of the value that follows.
            s0 = d * _byte(w, 0)
            s1 = d * _byte(w, 1)
            v0 = _scaled(_bytes_float(lo, b, 16, INTERPRET), 256.0 * s0, 128.0 * s0 + dmin * _byte(w, 2), INTERPRET)
            v1 = _scaled(_bytes_float(hi, b, 16, INTERPRET), 256.0 * s1, 128.0 * s1 + dmin * _byte(w, 3), INTERPRET)
    v = tl.permute(tl.join(v0, v1), (0, 3, 1, 2))  # [BN, 2, 8, 4]: plane, word, byte
    return tl.reshape(v, (v.shape[0], 64))
