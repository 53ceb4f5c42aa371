"""Decode path "gemv_v2" of the quantized fused MoE (Q4_K, Q6_K, Q8_0; with int8 x also Q5_K, Q4_0, Q4_1, Q5_0,
Q5_1, Q2_K, Q3_K, IQ4_NL, IQ4_XS): fewer instructions per weight, two launches, the k-slot sum inside GEMM 2.
The dense GEMV on the same word loads and x tiles (x_chunk, rows_chunk): matmul_v2.py.

Weights are read as int32 words, a "group" of contiguous words per thread and row: a Q4_K pair q (8 words:
byte b of word j holds element 64q + 4j + b in its low nibble, 64q + 32 + 4j + b in its high nibble, see
repack.py; a Q5_K pair likewise, its fifth bits in the word of the high array covering the same elements), a
Q8_0 block (8 words, elements 32g + 4j + b) or half a Q6_K pair (4 words, h = g % 2: elements 64q + 16h + 4j + b
and + 32). A word is or'ed once with 0x4B000000; and-ing that with 0x4B000000 | (mask << s)
for each of its 8 (4-bit) or 4 (Q8_0) positions n gives, read as a float, 2^23 + c 2^s exactly, so one and, one
subtract and one FMA per weight leave c x: the activation side carries 2^-s ("pre-scaled" x). Sub-block scales
are applied per group, not per weight:
  sum_i (c_i d sc - dmin mn) x_i = d sc sum_i c_i x_i - dmin mn sum_i x_i   (Q4_K; Q6_K and Q8_0 subtract
  their code bias 32 / 128 times sum_i x_i the same way).
Q6_K first merges its two high bits into each code byte (two words of four 6-bit codes per code word).

GEMM 1 (one program per token-slot and BLOCK_N rows of gate and up) writes SiLU(gate) * up, rounded to the
activation dtype, in the order GEMM 2 reads it: [T*k, positions, words] with the position's 2^-s applied
("position-major": a thread's x values for one position are contiguous), plus the plain sums of every 16
consecutive values (GEMM 2's sum_i x_i). GEMM 2 (one program per token and BLOCK_N2 output rows) holds the k
slots of the token as [BLOCK_N2, slots] tiles of rows whose columns share their slot's x (all slots at once, or
config key "slots2" of them per step: fewer registers), weights the slots and sums them in registers, and stores
[T, H] in the output dtype: no atomics, no third launch. A row's K is covered in chunks of BLOCK_K inputs (a power
of two of groups) and the binary remainder, all unrolled, so every load of a program can be in flight at once and
any padded K runs unmasked.

x itself sits element-major, so GEMM 1 and the dense GEMV read its values for a word's eight positions as scalar
loads four elements apart, reloaded by every program (the L1 pipe, not DRAM, limited a Q6_K lm_head). With the
config key "x_prep", one small launch first writes x in the position-major, pre-scaled layout that GEMM 2 reads
(prepare_x, plus the sums of 16), and the kernels read it with vector loads instead. With the key "x_q8", x is
quantized to int8 instead (int8_dot.quantize_x) and GEMM 1 and the dense GEMV take four codes times four x values
per dp4a (int8_dot.q8_dot); with "inter_q8" too, GEMM 1 (programs of a multiple of 32 rows) writes its output as
int8 words, scales and sums, and GEMM 2 takes dp4a as well.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moerun.formats.quants import QuantType
from moerun.kernels.moe_parts import silu_mul, zero_slice, zeroed_by_gemm1
from moerun.kernels.pdl import launch_dependents, launch_options, quant_pdl_mode, wait_for_previous
from moerun.kernels.quant.group_scales import q4_k_scales, q6_k_codes, q6_k_scales
from moerun.kernels.quant.int8_dot import Int8Rows, emulate_dp4a, q8_dot, quantize_store, quantize_x, xq_tiles
from moerun.kernels.quant.repack import PACKED_TYPES, PackedWeight
from moerun.kernels.tile_configs import Config
from moerun.kernels.topk_select import TopkSelect, select_slot

V2_TYPES = PACKED_TYPES  # every type with a repacked layout
# The float-x variant reads these; the others take int8 x only (config key x_q8; as a down projection GEMM 1 writes
# its intermediate as int8 for them, whatever inter_q8 says).
FLOAT_X_TYPES = (QuantType.Q4_K, QuantType.Q6_K, QuantType.Q8_0)
RowsOf = tuple[PackedWeight, int]  # a packed tensor and the first row of one projection (gate or up) in it
PartTables = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # gate, up, down: [E, 4] int64 array addresses


def v2_supported(gate: PackedWeight, up: PackedWeight, down: PackedWeight) -> bool:
    """True when the v2 kernels read these types: gate and up of one type, each of V2_TYPES."""
    return gate.qtype == up.qtype and all(p.qtype in V2_TYPES for p in (gate, up, down))


# --------------------------------------------------------------------------------------------- device code


@triton.jit
def part_base(table_ptr, expert, a: tl.constexpr, like):
    """Array ``a`` (0 codes, 1 high, 2 sub, 3 scale) of expert ``expert`` (a scalar or a tensor of experts) from
    an int64 address table [E, 4], as pointers of ``like``'s element type: ``like`` plus an element offset, so
    that the address may lie in any allocation (a device slot or pinned host memory, read over PCIe)."""
    offset = tl.load(table_ptr + expert * 4 + a) - like.to(tl.int64)  # bytes
    return like + offset // (like.dtype.element_ty.primitive_bitwidth // 8)


@triton.jit
def part_bases(table_ptr, expert, codes, high, sub, scale):
    """``part_base`` of all four arrays of one expert part: (codes, high, sub, scale) pointers."""
    return (part_base(table_ptr, expert, 0, codes), part_base(table_ptr, expert, 1, high),
            part_base(table_ptr, expert, 2, sub), part_base(table_ptr, expert, 3, scale))


@triton.jit
def _masked_dot(lo, hi, MASK_A: tl.constexpr, MASK_B: tl.constexpr, xa, xb, xc, xd):
    """Sum of four codes times x: the codes under MASK_A and MASK_B (each or'ed with 0x4B000000) of the words lo
    (bytes 0, 1) and hi (bytes 2, 3, shifted down), each word already or'ed with 0x4B000000; read as floats
    they are 2^23 + code 2^s, so one and, one subtract and one FMA per code."""
    s = ((lo & MASK_A).to(tl.float32, bitcast=True) - 8388608.0) * xa
    s += ((lo & MASK_B).to(tl.float32, bitcast=True) - 8388608.0) * xb
    s += ((hi & MASK_A).to(tl.float32, bitcast=True) - 8388608.0) * xc
    s += ((hi & MASK_B).to(tl.float32, bitcast=True) - 8388608.0) * xd
    return s


@triton.jit
def _v2_dot(QT: tl.constexpr, WPG: tl.constexpr, codes, high, sub, scale, rows4, rows3, g4, g3, j4, KQ, ok4, ok3,
            x0, x1, x2, x3, x4, x5, x6, x7, X0, X1):  # fmt: skip
    """Sums over the chunk's groups of each row's weights times x: [R0, R1] float32.

    rows4 [R0, R1, 1, 1] / rows3 [R0, R1, 1] global row indices (int64); g4 [1, 1, G, 1] / g3 [1, 1, G] group
    indices in the row; j4 [1, 1, 1, WPG] word in the group; ok4 / ok3 row masks (masked rows read nothing);
    x0..x7 the pre-scaled x of each position ([R0 or 1, R1 or 1, G, WPG]; Q8_0 uses x0..x3); X0, X1 the plain
    sums of each group's plane-0 / plane-1 inputs ([.., .., G]; Q8_0: X0 is the block's sum).
    """
    # A word or'ed once with 0x4B000000, then and'ed with 0x4B000000 | mask per position: one op per weight.
    if QT == 8:  # Q8_0: a group is a 32-element block (8 words) with its d
        w = tl.load(codes + rows4 * (KQ * 16) + g4 * 8 + j4, mask=ok4, other=0)  # [R0, R1, G, 8] int32
        s = _masked_dot(w | 0x4B000000, (w >> 16) | 0x4B000000, 0x4B0000FF, 0x4B00FF00, x0, x1, x2, x3)
        d = tl.load(scale + rows3 * (KQ * 2) + g3, mask=ok3, other=0.0).to(tl.float32)  # [R0, R1, G]
        part = d * (tl.sum(s, axis=3) - 128.0 * X0)
    elif QT == 12:  # Q4_K: a group is pair q (8 words: sub-blocks 2q in the low, 2q + 1 in the high nibbles)
        w = tl.load(codes + rows4 * (KQ * 8) + g4 * 8 + j4, mask=ok4, other=0)  # [R0, R1, G, 8] int32
        wm = w | 0x4B000000
        tm = (w >> 16) | 0x4B000000  # nibbles of bytes 2, 3 at bits 0..15
        s0 = _masked_dot(wm, tm, 0x4B00000F, 0x4B000F00, x0, x2, x4, x6)  # low nibbles: plane 0
        s1 = _masked_dot(wm, tm, 0x4B0000F0, 0x4B00F000, x1, x3, x5, x7)  # high nibbles: plane 1
        d, dmin, sc0, sc1, mn0, mn1 = q4_k_scales(sub, scale, rows3, g3, KQ, ok3)  # [R0, R1, G] each
        part = d * (sc0 * tl.sum(s0, axis=3) + sc1 * tl.sum(s1, axis=3)) - dmin * (mn0 * X0 + mn1 * X1)
    else:  # Q6_K: a group is half of pair q (4 words); 16-element sub-blocks 4q + 2p + h, h = g % 2
        tl.static_assert(QT == 14, "gemv_v2 reads Q4_K, Q6_K and Q8_0")
        c0, c1 = q6_k_codes(codes, high, rows4, g4, j4, KQ, ok4)  # [R0, R1, G, 4] int32 each
        s0 = _masked_dot(c0 | 0x4B000000, (c0 >> 16) | 0x4B000000, 0x4B00003F, 0x4B003F00, x0, x2, x4, x6)
        s1 = _masked_dot(c1 | 0x4B000000, (c1 >> 16) | 0x4B000000, 0x4B00003F, 0x4B003F00, x1, x3, x5, x7)
        d, sc0, sc1 = q6_k_scales(sub, scale, rows3, g3, KQ, ok3)  # [R0, R1, G] each
        part = d * (sc0 * (tl.sum(s0, axis=3) - 32.0 * X0) + sc1 * (tl.sum(s1, axis=3) - 32.0 * X1))
    return tl.sum(part, axis=2)


@triton.jit
def _x_pos(QT: tl.constexpr, x_at, e, K, n: tl.constexpr, EVEN_K: tl.constexpr):
    """(x at elements e as float32, the same pre-scaled by 2^-s for position n)."""
    if EVEN_K:
        v = tl.load(x_at + e).to(tl.float32)
    else:
        v = tl.load(x_at + e, mask=e < K, other=0.0).to(tl.float32)
    # The factor 2^s that position n's mask leaves on a code (see _v2_dot); the x side takes 2^-s.
    if QT == 8:
        sh = 8 * (n % 2)
    elif QT == 12:
        sh = 4 * (n % 4)
    else:
        sh = 8 * ((n // 2) % 2)
    return v, v * (1.0 / (1 << sh))


@triton.jit
def _x_tiles(QT: tl.constexpr, WPG: tl.constexpr, x_row, K, g4, j4, EVEN_K: tl.constexpr):
    """x of one token for groups g4 [1, 1, G, 1], words j4: the pre-scaled tiles of the 8 positions (Q8_0: 4, the
    rest repeat them) and the plain plane sums X0, X1 [1, 1, G] that _v2_dot takes."""
    # Element of position n of word j in group g: e + n (Q8_0), e + n // 2 + 32 (n % 2) (4-bit layout).
    if QT == 8:
        e = 32 * g4 + 4 * j4  # [1, 1, G, 8]
    elif QT == 12:
        e = 64 * g4 + 4 * j4
    else:
        e = 64 * (g4 // 2) + 16 * (g4 % 2) + 4 * j4
    v0, x0 = _x_pos(QT, x_row, e, K, 0, EVEN_K)
    if QT == 8:
        v1, x1 = _x_pos(QT, x_row + 1, e, K - 1, 1, EVEN_K)
        v2, x2 = _x_pos(QT, x_row + 2, e, K - 2, 2, EVEN_K)
        v3, x3 = _x_pos(QT, x_row + 3, e, K - 3, 3, EVEN_K)
        X0 = tl.sum(v0 + v1 + v2 + v3, axis=3)  # [1, 1, G]
        X1 = X0
        x4, x5, x6, x7 = x0, x1, x2, x3  # unused
    else:
        v1, x1 = _x_pos(QT, x_row + 32, e, K - 32, 1, EVEN_K)
        v2, x2 = _x_pos(QT, x_row + 1, e, K - 1, 2, EVEN_K)
        v3, x3 = _x_pos(QT, x_row + 33, e, K - 33, 3, EVEN_K)
        v4, x4 = _x_pos(QT, x_row + 2, e, K - 2, 4, EVEN_K)
        v5, x5 = _x_pos(QT, x_row + 34, e, K - 34, 5, EVEN_K)
        v6, x6 = _x_pos(QT, x_row + 3, e, K - 3, 6, EVEN_K)
        v7, x7 = _x_pos(QT, x_row + 35, e, K - 35, 7, EVEN_K)
        X0 = tl.sum(v0 + v2 + v4 + v6, axis=3)  # plane 0 (even positions)
        X1 = tl.sum(v1 + v3 + v5 + v7, axis=3)
    return x0, x1, x2, x3, x4, x5, x6, x7, X0, X1


@triton.jit
def _pm_index(QT: tl.constexpr, e):
    """(position, word, exponent s) of row elements e in the position-major layout of type QT: element e is
    multiplied by the code at position `position` of int32 word `word` of its row, whose mask leaves 2^s on it."""
    if QT == 8:
        pos = e % 4
        word = e // 4
        exp = 8 * (pos % 2)
    else:
        r = e % 64
        pos = 2 * (r % 4) + r // 32
        word = 8 * (e // 64) + (r % 32) // 4
        if QT == 12:
            exp = 4 * (pos % 4)
        else:
            exp = 8 * ((pos // 2) % 2)
    return pos, word, exp


@triton.jit
def _x_prep_kernel(
    x_ptr,  # [T, K]
    xp_ptr,  # [T, K_PAD] position-major, pre-scaled
    xs_ptr,  # [T, K_PAD / 16] float32 sums of every 16 consecutive values
    K,
    K_PAD,
    WORDS,  # words per row (K_PAD / positions per word)
    stride_xt,
    stride_pt,
    stride_st,
    QT: tl.constexpr,
    BLOCK: tl.constexpr,
):  # fmt: skip
    """x in the layout the weights of type QT are read in (as GEMM 1 writes GEMM 2's input), once per row of x."""
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK] elements
    v = tl.load(x_ptr + t * stride_xt + offs, mask=offs < K, other=0.0).to(tl.float32)
    pos, word, exp = _pm_index(QT, offs)
    pre = v * ((127 - exp) << 23).to(tl.float32, bitcast=True)
    tl.store(xp_ptr + t * stride_pt + pos * WORDS + word, pre.to(xp_ptr.dtype.element_ty), mask=offs < K_PAD)
    sums = tl.sum(tl.reshape(v, [BLOCK // 16, 16]), axis=1)  # [BLOCK / 16]
    offs_s = tl.program_id(1) * (BLOCK // 16) + tl.arange(0, BLOCK // 16)
    tl.store(xs_ptr + t * stride_st + offs_s, sums, mask=offs_s * 16 < K_PAD)


@triton.jit
def _xp_tiles(QT: tl.constexpr, a, s_row, g3, ok4, ok3, WORDS):
    """The x tiles of _v2_dot read from position-major x (_x_prep_kernel, or GEMM 1's output): a points at
    position 0 of each (group, word), s_row at the row's sums of 16, g3 the group indices ([.., G])."""
    x0 = tl.load(a, mask=ok4, other=0.0).to(tl.float32)
    x1 = tl.load(a + WORDS, mask=ok4, other=0.0).to(tl.float32)
    x2 = tl.load(a + 2 * WORDS, mask=ok4, other=0.0).to(tl.float32)
    x3 = tl.load(a + 3 * WORDS, mask=ok4, other=0.0).to(tl.float32)
    if QT == 8:
        x4, x5, x6, x7 = x0, x1, x2, x3  # unused
        X0 = tl.load(s_row + 2 * g3, mask=ok3, other=0.0) + tl.load(s_row + 2 * g3 + 1, mask=ok3, other=0.0)
        X1 = X0
    else:
        x4 = tl.load(a + 4 * WORDS, mask=ok4, other=0.0).to(tl.float32)
        x5 = tl.load(a + 5 * WORDS, mask=ok4, other=0.0).to(tl.float32)
        x6 = tl.load(a + 6 * WORDS, mask=ok4, other=0.0).to(tl.float32)
        x7 = tl.load(a + 7 * WORDS, mask=ok4, other=0.0).to(tl.float32)
        if QT == 12:  # pair g, plane p: elements 64g + 32p + [0, 32)
            X0 = tl.load(s_row + 4 * g3, mask=ok3, other=0.0) + tl.load(s_row + 4 * g3 + 1, mask=ok3, other=0.0)
            X1 = tl.load(s_row + 4 * g3 + 2, mask=ok3, other=0.0) + tl.load(s_row + 4 * g3 + 3, mask=ok3, other=0.0)
        else:  # group (q, h), plane p: elements 64q + 32p + 16h + [0, 16)
            first = 4 * (g3 // 2) + g3 % 2
            X0 = tl.load(s_row + first, mask=ok3, other=0.0)
            X1 = tl.load(s_row + first + 2, mask=ok3, other=0.0)
    return x0, x1, x2, x3, x4, x5, x6, x7, X0, X1


@triton.jit
def x_chunk(QT: tl.constexpr, WPG: tl.constexpr, x_row, xp_row, xs_row, dx_row, K, X_WORDS, gi,
            EVEN_K: tl.constexpr, XP: tl.constexpr, XQ8: tl.constexpr):  # fmt: skip
    """x tiles of one row of x for groups gi [G]: int8 (XQ8: xp_row the int8 words, dx_row their scales; the
    tuple is (xa, xb, da, db, -, -, -, -, X0, X1)), from the prepared position-major row (XP) or from x itself."""
    g4 = gi[None, None, :, None]  # [1, 1, G, 1]
    j4 = tl.arange(0, WPG)[None, None, None, :]  # [1, 1, 1, WPG]
    # One return: Triton wants every return of a function to have the same types, constexpr branches included.
    if XQ8:
        xa, xb, da, db, X0, X1 = xq_tiles(QT, xp_row, dx_row, xs_row, g4, j4, gi[None, None, :])
        out = (xa, xb, da, db, xa, xa, xa, xa, X0, X1)
    elif XP:
        g3 = gi[None, None, :]  # [1, 1, G]
        out = _xp_tiles(QT, xp_row + g4 * WPG + j4, xs_row, g3, g4 >= 0, g3 >= 0, X_WORDS)
    else:
        out = _x_tiles(QT, WPG, x_row, K, g4, j4, EVEN_K)
    return out


@triton.jit
def rows_chunk(QT: tl.constexpr, WPG: tl.constexpr, codes, high, sub, scale, rows, ok, g0: tl.constexpr,
               G: tl.constexpr, KQ, x0, x1, x2, x3, x4, x5, x6, x7, X0, X1, XQ8: tl.constexpr,
               EMULATE_DP4A: tl.constexpr):  # fmt: skip
    """Partial sums [BLOCK_N] of rows [BLOCK_N] (ok: which to read) over groups [g0, g0 + G) against one token's
    x tiles (x_chunk of the same groups)."""
    gi = g0 + tl.arange(0, G)  # [G]
    j4 = tl.arange(0, WPG)[None, None, None, :]  # [1, 1, 1, WPG]
    if XQ8:
        part = q8_dot(QT, codes, high, sub, scale, rows[:, None, None, None], rows[:, None, None],
                      gi[None, None, :, None], gi[None, None, :], j4, KQ, ok[:, None, None, None], ok[:, None, None],
                      x0, x1, x2, x3, X0, X1, EMULATE_DP4A)  # fmt: skip
    else:
        part = _v2_dot(QT, WPG, codes, high, sub, scale, rows[:, None, None, None], rows[:, None, None],
                       gi[None, None, :, None], gi[None, None, :], j4, KQ, ok[:, None, None, None], ok[:, None, None],
                       x0, x1, x2, x3, x4, x5, x6, x7, X0, X1)  # fmt: skip
    return tl.sum(part, axis=1)  # [BLOCK_N, 1] -> [BLOCK_N]


@triton.jit
def _gemm1_chunk(QT: tl.constexpr, WPG: tl.constexpr, x_row, xp_row, xs_row, dx_row, H, X_WORDS, gc, gh, gs, gd,
                 uc, uh, us, ud, rows_g, rows_u, ok, g0: tl.constexpr, G: tl.constexpr, KQ, EVEN_K: tl.constexpr,
                 XP: tl.constexpr, XQ8: tl.constexpr, EMULATE_DP4A: tl.constexpr):  # fmt: skip
    """(gate, up) partial sums [BLOCK_N] over groups [g0, g0 + G) of the rows (rows where ok is false read
    nothing)."""
    gi = g0 + tl.arange(0, G)  # [G]
    x0, x1, x2, x3, x4, x5, x6, x7, X0, X1 = x_chunk(QT, WPG, x_row, xp_row, xs_row, dx_row, H, X_WORDS, gi, EVEN_K,
                                                     XP, XQ8)  # fmt: skip
    dg = rows_chunk(QT, WPG, gc, gh, gs, gd, rows_g, ok, g0, G, KQ, x0, x1, x2, x3, x4, x5, x6, x7, X0, X1, XQ8,
                    EMULATE_DP4A)  # fmt: skip
    du = rows_chunk(QT, WPG, uc, uh, us, ud, rows_u, ok, g0, G, KQ, x0, x1, x2, x3, x4, x5, x6, x7, X0, X1, XQ8,
                    EMULATE_DP4A)  # fmt: skip
    return dg, du


@triton.jit
def _gemm1_v2_kernel(
    x_ptr,  # [T, H]
    xp_ptr,  # [T, H_pad] x position-major for the gate type (XP), int32 words [T, H_pad / 4] (XQ8), else a dummy
    xs_ptr,  # [T, H_pad / 16] float32 sums of 16 (XP or XQ8; else a dummy)
    dx_ptr,  # [T, H_pad / 32] float32 int8 scales (XQ8; else a dummy)
    ids_ptr,  # [T*k]
    inter_ptr,  # [T*k, I_pad] position-major, pre-scaled for the down type QW (OUT_Q8: int32 words [T*k, I_pad / 4])
    sums_ptr,  # [T*k, I_pad / 16] float32
    dxi_ptr,  # OUT_Q8: [T*k, I_pad / 32] float32 int8 scales of the intermediate (else a dummy)
    gc, gh, gs, gd,  # gate arrays (codes / high as int32 words)
    uc, uh, us, ud,  # up arrays
    gt, ut,  # INDIRECT: [E, 4] int64 addresses of each expert's gate / up arrays (else dummies)
    top_k,
    H,
    I,  # noqa: E741
    G_ROWS,  # rows per expert of the packed tensor holding gate, and gate's first row in it
    G_OFF,
    U_ROWS,
    U_OFF,
    KQ,  # pairs per row (padded H / 64)
    I_WORDS,  # words per row of down (positions per word x I_WORDS = padded I)
    X_WORDS,  # words per row of gate / up
    stride_xt,
    stride_pt,
    stride_pst,
    stride_pdt,
    stride_it,
    stride_st,
    stride_dit,
    QT: tl.constexpr,
    QW: tl.constexpr,
    WPG: tl.constexpr,  # words per group of the gate/up type
    BLOCK_N: tl.constexpr,
    BLOCK_G: tl.constexpr,
    FULL: tl.constexpr,  # whole BLOCK_G chunks per row
    REM: tl.constexpr,  # groups left, covered by one chunk per set bit
    LOG_BG: tl.constexpr,
    EVEN_K: tl.constexpr,
    XP: tl.constexpr,  # read x from xp / xs
    INDIRECT: tl.constexpr = False,  # experts found through gt / ut; rows count within an expert
    XQ8: tl.constexpr = False,  # read x as int8 words (xp), scales (dx) and sums (xs): int8_dot.quantize_x
    EMULATE_DP4A: tl.constexpr = False,
    OUT_Q8: tl.constexpr = False,  # write the intermediate as int8 (words, scales, sums); BLOCK_N a multiple of 32
    PDL: tl.constexpr = 0,  # kernels/pdl.py (the expert ids come from the previous kernel: nothing before the wait)
    zero_ptr=None,  # ZERO_BLOCK > 0: GEMM 2's float32 output [zero_n], zeroed here ZERO_BLOCK elements a program
    zero_n=0,
    ZERO_BLOCK: tl.constexpr = 0,
    # SELECT: the routing picked here from the router's logits, as by the dense GEMM 1 (kernels/topk_select.py)
    sel=None,  # TopkOperands
    SEL: tl.constexpr = None,  # TopkShape
    SELECT: tl.constexpr = False,
):  # fmt: skip
    launch_dependents(PDL)
    wait_for_previous(PDL)  # (and only then the zeroing: the buffer's memory may have served a kernel before)
    if ZERO_BLOCK > 0:
        zero_slice(zero_ptr, zero_n, ZERO_BLOCK)
    slot = tl.program_id(0)
    pid_n = tl.program_id(1)
    if SELECT:
        expert = select_slot(sel, SEL, ids_ptr, slot, pid_n == 0).to(tl.int64)
    else:
        expert = tl.load(ids_ptr + slot).to(tl.int64)
    token = (slot // top_k).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    ok = offs_n < I
    n = tl.where(ok, offs_n, 0).to(tl.int64)
    if INDIRECT:
        gc, gh, gs, gd = part_bases(gt, expert, gc, gh, gs, gd)
        uc, uh, us, ud = part_bases(ut, expert, uc, uh, us, ud)
        rows_g = G_OFF + n  # [BLOCK_N]
        rows_u = U_OFF + n
    else:
        rows_g = expert * G_ROWS + G_OFF + n  # [BLOCK_N]
        rows_u = expert * U_ROWS + U_OFF + n
    x_row = x_ptr + token * stride_xt
    xp_row = xp_ptr + token * stride_pt
    xs_row = xs_ptr + token * stride_pst
    dx_row = dx_ptr + token * stride_pdt
    acc_g = tl.zeros([BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_N], dtype=tl.float32)
    for c in tl.static_range(FULL):
        dg, du = _gemm1_chunk(QT, WPG, x_row, xp_row, xs_row, dx_row, H, X_WORDS, gc, gh, gs, gd, uc, uh, us, ud,
                              rows_g, rows_u, ok, c * BLOCK_G, BLOCK_G, KQ, EVEN_K, XP, XQ8, EMULATE_DP4A)  # fmt: skip
        acc_g += dg
        acc_u += du
    for b in tl.static_range(LOG_BG):
        if (REM >> b) & 1:
            dg, du = _gemm1_chunk(QT, WPG, x_row, xp_row, xs_row, dx_row, H, X_WORDS, gc, gh, gs, gd, uc, uh, us,
                                  ud, rows_g, rows_u, ok, FULL * BLOCK_G + (REM & ((1 << b) - 1)), 1 << b, KQ, EVEN_K,
                                  XP, XQ8, EMULATE_DP4A)  # fmt: skip
            acc_g += dg
            acc_u += du
    # Rounded to the activation dtype, as the reference's intermediate is.
    act = tl.where(ok, silu_mul(acc_g, acc_u), 0.0).to(x_ptr.dtype.element_ty).to(tl.float32)  # [BLOCK_N]
    i_row = inter_ptr + slot.to(tl.int64) * stride_it
    s_row = sums_ptr + slot.to(tl.int64) * stride_st
    if OUT_Q8:  # int8 words in element order, a scale per 32 and the sums of 16 of the rounded values
        quantize_store(act, BLOCK_N, pid_n * BLOCK_N, i_row, dxi_ptr + slot.to(tl.int64) * stride_dit, s_row,
                       I_WORDS * 4)  # fmt: skip
    else:  # position-major for GEMM 2: element e -> (position, word) of the down type's layout, times 2^-s
        pos, word, exp = _pm_index(QW, offs_n)
        pre = act * ((127 - exp) << 23).to(tl.float32, bitcast=True)
        tl.store(i_row + pos * I_WORDS + word, pre.to(inter_ptr.dtype.element_ty), mask=ok)
        # Sums of every 16 consecutive values (BLOCK_N is a multiple of 16; padding rows add zeros).
        sums = tl.sum(tl.reshape(act, [BLOCK_N // 16, 16]), axis=1)  # [BLOCK_N / 16]
        offs_s = pid_n * (BLOCK_N // 16) + tl.arange(0, BLOCK_N // 16)
        tl.store(s_row + offs_s, sums, mask=offs_s * 16 < I)


@triton.jit
def _gemm2_chunk(QT: tl.constexpr, WPG: tl.constexpr, inter_ptr, sums_ptr, dxi_ptr, slot, ok, wc, wh, ws, wd, rows,
                 g0: tl.constexpr, G: tl.constexpr, KQ, I_WORDS, stride_it, stride_st, stride_dit,
                 XQ8: tl.constexpr, EMULATE_DP4A: tl.constexpr, X_TILE: tl.constexpr):  # fmt: skip
    """Partial sums [BLOCK_N, SLOTS] over groups [g0, g0 + G) of the rows [BLOCK_N, SLOTS]; slot [SLOTS] picks
    each column's intermediate, which all BLOCK_N rows share (XQ8: as int8 words, scales and sums). X_TILE: the
    intermediate is loaded in the rows' [BLOCK_N, SLOTS, G, ..] shape, each row's copy from L1, rather than as [1,
    SLOTS, G, ..] tiles that the compiler moves to the rows' layout through shared memory (barriers a tile)."""
    gi = g0 + tl.arange(0, G)
    g4 = gi[None, None, :, None]  # [1, 1, G, 1]
    g3 = gi[None, None, :]  # [1, 1, G]
    if X_TILE:
        g4 = tl.broadcast_to(g4, (rows.shape[0], rows.shape[1], G, 1))  # [BLOCK_N, SLOTS, G, 1]
        g3 = tl.broadcast_to(g3, (rows.shape[0], rows.shape[1], G))  # [BLOCK_N, SLOTS, G]
    j4 = tl.arange(0, WPG)[None, None, None, :]  # [1, 1, 1, WPG]
    ok4 = ok[None, :, None, None]  # [1, SLOTS, 1, 1]
    ok3 = ok[None, :, None]
    s_row = sums_ptr + slot[None, :, None] * stride_st  # [1, SLOTS, 1]; one sum per 16 elements
    if XQ8:
        q_row = inter_ptr + slot[None, :, None, None] * stride_it  # [1, SLOTS, 1, 1]
        d_row = dxi_ptr + slot[None, :, None] * stride_dit
        xa, xb, da, db, X0, X1 = xq_tiles(QT, q_row, d_row, s_row, g4, j4, g3)
        part = q8_dot(QT, wc, wh, ws, wd, rows[:, :, None, None], rows[:, :, None], g4, g3, j4, KQ, ok4, ok3,
                      xa, xb, da, db, X0, X1, EMULATE_DP4A)  # fmt: skip
    else:
        a = inter_ptr + slot[None, :, None, None] * stride_it + g4 * WPG + j4  # [1, SLOTS, G, WPG] position 0
        x0, x1, x2, x3, x4, x5, x6, x7, X0, X1 = _xp_tiles(QT, a, s_row, g3, ok4, ok3, I_WORDS)
        part = _v2_dot(QT, WPG, wc, wh, ws, wd, rows[:, :, None, None], rows[:, :, None], g4, g3, j4, KQ, ok4, ok3,
                       x0, x1, x2, x3, x4, x5, x6, x7, X0, X1)  # fmt: skip
    return part


@triton.jit
def _gemm2_v2_kernel(
    inter_ptr,  # [T*k, I_pad] position-major (GEMM 1; XQ8: int32 words [T*k, I_pad / 4])
    sums_ptr,  # [T*k, I_pad / 16]
    dxi_ptr,  # XQ8: [T*k, I_pad / 32] float32 int8 scales (else a dummy)
    ids_ptr,  # [T*k]
    topk_w_ptr,  # [T*k]
    out_ptr,  # [T, H] in the output dtype
    wc, wh, ws, wd,  # down arrays (codes / high as int32 words)
    wt,  # INDIRECT: [E, 4] int64 addresses of each expert's down arrays (else a dummy)
    top_k,
    H,
    KQ,  # pairs per row (padded I / 64)
    I_WORDS,
    stride_it,
    stride_st,
    stride_dit,
    stride_ot,
    QT: tl.constexpr,
    WPG: tl.constexpr,
    SLOTS: tl.constexpr,  # top_k rounded up to a power of two
    SLOT_STEP: tl.constexpr,  # slots held at once (a power of two dividing SLOTS): fewer, fewer registers
    BLOCK_N: tl.constexpr,
    BLOCK_G: tl.constexpr,
    FULL: tl.constexpr,
    REM: tl.constexpr,
    LOG_BG: tl.constexpr,
    INDIRECT: tl.constexpr = False,  # experts found through wt; rows count within an expert
    XQ8: tl.constexpr = False,  # the intermediate as int8 (GEMM 1 with OUT_Q8)
    EMULATE_DP4A: tl.constexpr = False,
    PDL: tl.constexpr = 0,  # kernels/pdl.py (everything it reads comes from earlier kernels of the step)
    X_TILE: tl.constexpr = False,  # the intermediate loaded in the rows' shape (config key x_tile2, _gemm2_chunk)
):  # fmt: skip
    launch_dependents(PDL)
    wait_for_previous(PDL)
    token = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    y = tl.zeros([BLOCK_N], dtype=tl.float32)
    for g in tl.static_range(SLOTS // SLOT_STEP):
        y += _gemm2_slots(QT, WPG, inter_ptr, sums_ptr, dxi_ptr, ids_ptr, topk_w_ptr, wc, wh, ws, wd, wt, token,
                          g * SLOT_STEP, SLOT_STEP, top_k, H, offs_n, KQ, I_WORDS, stride_it, stride_st, stride_dit,
                          BLOCK_N, BLOCK_G, FULL, REM, LOG_BG, INDIRECT, XQ8, EMULATE_DP4A, X_TILE)  # fmt: skip
    tl.store(out_ptr + token * stride_ot + offs_n, y.to(out_ptr.dtype.element_ty), mask=offs_n < H)


@triton.jit
def _gemm2_slots(QT: tl.constexpr, WPG: tl.constexpr, inter_ptr, sums_ptr, dxi_ptr, ids_ptr, topk_w_ptr, wc, wh, ws,
                 wd, wt, token, s0: tl.constexpr, STEP: tl.constexpr, top_k, H, offs_n, KQ, I_WORDS, stride_it,
                 stride_st, stride_dit, BLOCK_N: tl.constexpr, BLOCK_G: tl.constexpr, FULL: tl.constexpr,
                 REM: tl.constexpr, LOG_BG: tl.constexpr, INDIRECT: tl.constexpr, XQ8: tl.constexpr,
                 EMULATE_DP4A: tl.constexpr, X_TILE: tl.constexpr):  # fmt: skip
    """sum over slots s0 + [0, STEP) of the token of routing weight x (rows offs_n of the slot's expert) . (the
    slot's intermediate) -> [BLOCK_N] float32; the slots as the columns of [BLOCK_N, STEP] tiles."""
    s = s0 + tl.arange(0, STEP)  # [STEP]
    ok = s < top_k
    slot = token * top_k + tl.where(ok, s, 0)  # [STEP] int64
    return _weighted_rows(QT, WPG, inter_ptr, sums_ptr, dxi_ptr, ids_ptr, topk_w_ptr, wc, wh, ws, wd, wt, slot, ok,
                          STEP, H, offs_n, KQ, I_WORDS, stride_it, stride_st, stride_dit, BLOCK_N, BLOCK_G, FULL, REM,
                          LOG_BG, INDIRECT, XQ8, EMULATE_DP4A, X_TILE)  # fmt: skip


@triton.jit
def _weighted_rows(QT: tl.constexpr, WPG: tl.constexpr, inter_ptr, sums_ptr, dxi_ptr, ids_ptr, topk_w_ptr, wc, wh, ws,
                   wd, wt, slot, ok, STEP: tl.constexpr, H, offs_n, KQ, I_WORDS, stride_it, stride_st, stride_dit,
                   BLOCK_N: tl.constexpr, BLOCK_G: tl.constexpr, FULL: tl.constexpr, REM: tl.constexpr,
                   LOG_BG: tl.constexpr, INDIRECT: tl.constexpr, XQ8: tl.constexpr, EMULATE_DP4A: tl.constexpr,
                   X_TILE: tl.constexpr):  # fmt: skip
    """sum over the (token, slot) pairs slot [STEP] (where ok) of routing weight x (rows offs_n of the pair's expert)
    . (the pair's intermediate) -> [BLOCK_N] float32."""
    expert = tl.load(ids_ptr + slot, mask=ok, other=0).to(tl.int64)
    weight = tl.load(topk_w_ptr + slot, mask=ok, other=0.0).to(tl.float32)
    if INDIRECT:  # each slot's arrays through the table, shaped to broadcast against [rows, slots, groups, words]
        wc, wh, ws, wd = part_bases(wt, expert, wc, wh, ws, wd)  # [STEP] each
        wc, wh, ws, wd = wc[None, :, None, None], wh[None, :, None, None], ws[None, :, None], wd[None, :, None]
        rows = tl.where(offs_n < H, offs_n, 0).to(tl.int64)[:, None] + tl.zeros([1, STEP], dtype=tl.int64)
    else:
        rows = expert[None, :] * H + tl.where(offs_n < H, offs_n, 0)[:, None]  # [BLOCK_N, STEP]
    acc = tl.zeros([BLOCK_N, STEP], dtype=tl.float32)
    for c in tl.static_range(FULL):
        acc += _gemm2_chunk(QT, WPG, inter_ptr, sums_ptr, dxi_ptr, slot, ok, wc, wh, ws, wd, rows, c * BLOCK_G,
                            BLOCK_G, KQ, I_WORDS, stride_it, stride_st, stride_dit, XQ8, EMULATE_DP4A,
                            X_TILE)  # fmt: skip
    for b in tl.static_range(LOG_BG):
        if (REM >> b) & 1:
            acc += _gemm2_chunk(QT, WPG, inter_ptr, sums_ptr, dxi_ptr, slot, ok, wc, wh, ws, wd, rows,
                                FULL * BLOCK_G + (REM & ((1 << b) - 1)), 1 << b, KQ, I_WORDS, stride_it,
                                stride_st, stride_dit, XQ8, EMULATE_DP4A, X_TILE)  # fmt: skip
    return tl.sum(acc * weight[None, :], axis=1)  # [BLOCK_N] summed over the step's slots


@triton.jit
def _gemm2_pair_kernel(
    inter_ptr, sums_ptr, dxi_ptr, ids_ptr, topk_w_ptr,  # as _gemm2_v2_kernel's
    out_ptr,  # [T, H] float32, zeroed by GEMM 1 (its ZERO_BLOCK)
    wc, wh, ws, wd, wt, top_k, H, KQ, I_WORDS, stride_it, stride_st, stride_dit, stride_ot,
    QT: tl.constexpr,
    WPG: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_G: tl.constexpr,
    FULL: tl.constexpr,
    REM: tl.constexpr,
    LOG_BG: tl.constexpr,
    INDIRECT: tl.constexpr = False,
    XQ8: tl.constexpr = False,
    EMULATE_DP4A: tl.constexpr = False,
    PDL: tl.constexpr = 0,
    X_TILE: tl.constexpr = False,
):  # fmt: skip
    """GEMM 2 with config key sum2 = "atomic": one program per (token, slot) pair and BLOCK_N output rows (k times
    _gemm2_v2_kernel's programs, each a k-th of the work), its weighted rows added into out by float32 atomics."""
    launch_dependents(PDL)
    wait_for_previous(PDL)
    slot = tl.program_id(0).to(tl.int64) + tl.zeros([1], dtype=tl.int64)  # [1]
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    y = _weighted_rows(QT, WPG, inter_ptr, sums_ptr, dxi_ptr, ids_ptr, topk_w_ptr, wc, wh, ws, wd, wt, slot, slot >= 0,
                       1, H, offs_n, KQ, I_WORDS, stride_it, stride_st, stride_dit, BLOCK_N, BLOCK_G, FULL, REM, LOG_BG,
                       INDIRECT, XQ8, EMULATE_DP4A, X_TILE)  # fmt: skip
    token = tl.program_id(0).to(tl.int64) // top_k
    tl.atomic_add(out_ptr + token * stride_ot + offs_n, y, mask=offs_n < H, sem="relaxed")


# ------------------------------------------------------------------------------------------------ host side


def check_int8_x(cfg: Config, *qtypes: QuantType) -> None:
    """Raises unless cfg reads x as int8 where a type has no float-x variant (all but FLOAT_X_TYPES)."""
    for qt in qtypes:
        if qt not in FLOAT_X_TYPES and not cfg.get("x_q8"):
            raise ValueError(f"{qt.name} weights on the gemv_v2 path need int8 x: set the config key x_q8")


def words_per_group(qtype: QuantType) -> int:
    """int32 words per group: a pair (64 elements) of the 4-bit types, a Q8_0 block (32), or half a pair (32) of
    Q6_K, Q3_K and Q2_K, whose scales cover 16 elements."""
    return 4 if qtype in (QuantType.Q6_K, QuantType.Q3_K, QuantType.Q2_K) else 8


def group_elems(qtype: QuantType) -> int:
    """Row elements per group."""
    return words_per_group(qtype) * positions_per_word(qtype)


def positions_per_word(qtype: QuantType) -> int:
    """Elements per int32 word."""
    return 4 if qtype == QuantType.Q8_0 else 8


def chunking(groups: int, block_k: int, qtype: QuantType) -> dict[str, int]:
    """Chunk constants of a row of `groups` groups for about block_k elements per chunk: BLOCK_G (a power of
    two), FULL chunks of it, then REM groups as one chunk per set bit below LOG_BG."""
    want = max(1, block_k // group_elems(qtype))
    bg = min(1 << (want.bit_length() - 1), triton.next_power_of_2(groups))
    log_bg = bg.bit_length() - 1
    return {"BLOCK_G": bg, "FULL": groups // bg, "REM": groups % bg, "LOG_BG": log_bg}


def _words(t: torch.Tensor) -> torch.Tensor:
    """A uint8 array [.., n] viewed as int32 words [.., n / 4]."""
    return t.view(torch.int32)


def part_arrays(p: PackedWeight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes, high, sub, scale) with codes and high as int32 words; absent arrays stand in as the codes."""
    codes = _words(p.codes)
    high = codes if p.high is None else _words(p.high)
    return codes, high, codes if p.sub is None else p.sub, p.scale


def prepare_x(x: torch.Tensor, qtype: QuantType, k_pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] in the position-major layout of weights of type qtype (K padded to k_pad, pre-scaled as _v2_dot
    wants) and its float32 sums of every 16 values: ([T, k_pad], [T, k_pad / 16]). One launch."""
    T, K = x.shape
    # bf16 keeps the dtype (a power-of-two scale is exact); fp16 goes to float32, whose range 2^-12 x keeps.
    xp = torch.empty(T, k_pad, dtype=torch.bfloat16 if x.dtype == torch.bfloat16 else torch.float32,
                     device=x.device)  # fmt: skip
    xs = torch.empty(T, k_pad // 16, dtype=torch.float32, device=x.device)
    block = min(1024, triton.next_power_of_2(k_pad))
    _x_prep_kernel[(T, triton.cdiv(k_pad, block))](
        x, xp, xs, K, k_pad, k_pad // positions_per_word(qtype), x.stride(0), xp.stride(0), xs.stride(0), QT=int(qtype),
        BLOCK=block,
    )  # fmt: skip
    return xp, xs


def x_operands(x: torch.Tensor, qtype: QuantType, k_pad: int, cfg: Config,
               x_int8: Int8Rows | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict[str, bool]]:
    """(xp, xs, dx, flags) of one call: x quantized to int8 (cfg["x_q8"]; x_int8 when its producer rounded it
    already), prepared in the weights' layout (cfg["x_prep"]) or read as it is (x standing in for the unused
    arrays)."""
    if cfg.get("x_q8"):
        usable = x_int8 is not None and x_int8.k_pad == k_pad and x_int8.xq.shape[0] == x.shape[0]
        xq, dx, xs = x_int8 if usable else quantize_x(x, k_pad)
        return xq, xs, dx, {"XP": False, "XQ8": True, "EMULATE_DP4A": emulate_dp4a()}
    if cfg.get("x_prep"):
        xp, xs = prepare_x(x, qtype, k_pad)
        return xp, xs, x, {"XP": True}
    return x, x, x, {"XP": False}


def fused_moe_gemv_v2(x: torch.Tensor, gate: RowsOf, up: RowsOf, w2: PackedWeight, weights: torch.Tensor,
                      ids: torch.Tensor, cfg: Config, out_dtype: torch.dtype, tables: PartTables | None = None,
                      x_int8: Int8Rows | None = None, select: TopkSelect | None = None) -> torch.Tensor:  # fmt: skip
    """The gemv_v2 path: x [T, H], routing [T, k] (ids int32, contiguous) -> [T, H] in out_dtype. With ``tables``
    (gate, up, down [E, 4] int64 addresses, see fused_moe_quant) the experts are found through them and the
    PackedWeights only give types, shapes and pointer types. x_int8: x already rounded (with cfg["x_q8"]).
    ``select``: GEMM 1 picks the routing from the router's logits and writes it into weights / ids."""
    (gw, g_off), (uw, u_off) = gate, up
    T, H = x.shape
    I, i_pad = w2.k, w2.k_pad  # noqa: E741
    k = ids.shape[1]
    slots = T * k
    flat_ids = ids.reshape(-1)  # [T*k]
    new = torch.empty if i_pad == I else torch.zeros  # padding must read as zeros
    check_int8_x(cfg, gw.qtype)
    inter_q8 = bool(cfg.get("inter_q8")) or w2.qtype not in FLOAT_X_TYPES
    if inter_q8:  # int8 words in element order, a scale per 32 and sums, written by GEMM 1 programs of 32k rows
        inter, dxi, sums = Int8Rows.empty(slots, i_pad, x.device, zeros=i_pad != I)  # [T*k, I_pad / 4], ...
        i_words = i_pad // 4
        bn1 = max(32, cfg["BLOCK_N"] // 32 * 32)
    else:
        # bf16 keeps the intermediate's dtype; fp16 goes to float32, as 2^-12 pre-scaling would leave its range.
        inter_dtype = torch.bfloat16 if x.dtype == torch.bfloat16 else torch.float32
        inter = new(slots, i_pad, dtype=inter_dtype, device=x.device)  # [T*k, I_pad] position-major
        sums = new(slots, i_pad // 16, dtype=torch.float32, device=x.device)  # [T*k, I_pad / 16]
        dxi = inter
        i_words = i_pad // positions_per_word(w2.qtype)
        bn1 = max(16, cfg["BLOCK_N"] // 16 * 16)
    groups1 = gw.k_pad // group_elems(gw.qtype)
    xp, xs, dx, flags = x_operands(x, gw.qtype, gw.k_pad, cfg, x_int8)
    pdl = quant_pdl_mode(x.device, T)
    grid1 = (slots, triton.cdiv(I, bn1))
    pairs2 = cfg.get("sum2") == "atomic"
    out, zero = zeroed_by_gemm1(T, H, grid1, x.device) if pairs2 else (None, {})  # [T, H]
    sel = {} if select is None else select.kernel_args(weights, k, cfg["num_warps"])
    _gemm1_v2_kernel[grid1](
        x, xp, xs, dx, flat_ids, inter, sums, dxi, *part_arrays(gw), *part_arrays(uw),
        *(tables[:2] if tables else (ids, ids)), k, H, I, gw.n, g_off, uw.n, u_off, gw.kq, i_words,
        gw.k_pad // positions_per_word(gw.qtype), x.stride(0), xp.stride(0), xs.stride(0), dx.stride(0),
        inter.stride(0), sums.stride(0), dxi.stride(0), QT=int(gw.qtype), QW=int(w2.qtype),
        WPG=words_per_group(gw.qtype), BLOCK_N=bn1, EVEN_K=gw.k_pad == H, **chunking(groups1, cfg["BLOCK_K"], gw.qtype),
        INDIRECT=tables is not None, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], OUT_Q8=inter_q8,
        PDL=pdl, **launch_options(pdl), **{"EMULATE_DP4A": emulate_dp4a(), **flags}, **zero, **sel,
    )  # fmt: skip
    return _gemm2(inter, sums, dxi, inter_q8, i_words, flat_ids, weights, w2, T, k, H, cfg, out_dtype,
                  tables[2] if tables else None, pdl, out)  # fmt: skip


def moe_down_v2(inter: Int8Rows, ids: torch.Tensor, weights: torch.Tensor, w2: PackedWeight, cfg: Config,
                out_dtype: torch.dtype) -> torch.Tensor:  # fmt: skip
    """GEMM 2 of the gemv_v2 path alone, for an intermediate made elsewhere (the grid types' GEMM 1): inter, each
    (token, slot) pair's row [T*k, I] rounded to int8 (int8_dot.quantize_x at w2.k_pad), routing ids [T, k] and
    weights [T, k] -> [T, H] in out_dtype: each token's k down projections, weighted and summed in one launch.
    cfg: a gemv_v2 config's GEMM 2 tiles (BLOCK_N2, BLOCK_K2, num_warps2, num_stages2)."""
    T, k = ids.shape
    if inter.k_pad != w2.k_pad or inter.xq.shape[0] != T * k:
        raise ValueError(f"intermediate of {inter.xq.shape[0]} rows x {inter.k_pad} values does not fit {T} x {k} "
                         f"pairs of a down projection of {w2.k_pad} padded inputs")  # fmt: skip
    flat_ids = ids.reshape(-1).to(torch.int32).contiguous()
    pdl = quant_pdl_mode(inter.xq.device, T)
    return _gemm2(inter.xq, inter.xs, inter.dx, True, inter.k_pad // 4, flat_ids, weights, w2, T, k, w2.shape[-2],
                  cfg, out_dtype, None, pdl)  # fmt: skip


def _gemm2(inter: torch.Tensor, sums: torch.Tensor, dxi: torch.Tensor, inter_q8: bool, i_words: int,
           flat_ids: torch.Tensor, weights: torch.Tensor, w2: PackedWeight, T: int, k: int, H: int, cfg: Config,
           out_dtype: torch.dtype, table: torch.Tensor | None, pdl: int,
           zeroed: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """Launches _gemm2_v2_kernel over the intermediate's arrays -> [T, H] in out_dtype; with ``zeroed`` (a float32
    [T, H] that GEMM 1 zeroed: config key sum2 = "atomic") _gemm2_pair_kernel adds into it instead."""
    bn2 = cfg["BLOCK_N2"]
    out = zeroed if zeroed is not None else torch.empty(T, H, dtype=out_dtype, device=inter.device)  # [T, H]
    # both kernels take the same operands and tiles; they differ in their grid and in the slot constexprs
    args = (inter, sums, dxi, flat_ids, weights.reshape(-1), out, *part_arrays(w2),
            flat_ids if table is None else table, k, H, w2.kq, i_words, inter.stride(0), sums.stride(0),
            dxi.stride(0), out.stride(0))  # fmt: skip
    tiles = dict(QT=int(w2.qtype), WPG=words_per_group(w2.qtype), BLOCK_N=bn2,
                 **chunking(w2.k_pad // group_elems(w2.qtype), cfg["BLOCK_K2"], w2.qtype), INDIRECT=table is not None,
                 num_warps=cfg["num_warps2"], num_stages=cfg["num_stages2"], XQ8=inter_q8,
                 EMULATE_DP4A=emulate_dp4a(), PDL=pdl, X_TILE=bool(cfg.get("x_tile2", False)),
                 **launch_options(pdl))  # fmt: skip
    if zeroed is not None:
        _gemm2_pair_kernel[(T * k, triton.cdiv(H, bn2))](*args, **tiles)
        return zeroed if out_dtype == torch.float32 else zeroed.to(out_dtype)
    slots_p2 = triton.next_power_of_2(k)
    slot_step = min(cfg.get("slots2") or slots_p2, slots_p2)
    if slot_step & (slot_step - 1):
        raise ValueError(f"slots2 must be a power of two, got {cfg.get('slots2')}")
    _gemm2_v2_kernel[(T, triton.cdiv(H, bn2))](*args, SLOTS=slots_p2, SLOT_STEP=slot_step, **tiles)
    return out
