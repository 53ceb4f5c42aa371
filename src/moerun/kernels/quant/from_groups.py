"""The grid types (IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S) read a group of 8 values at a time.

A grid type stores, per 8 values (two table entries of 4 for IQ3), an index into a fixed table of small integers
(formats/quants/grids.py), a sign byte (IQ2_S, IQ3_S) or a 7-bit sign pattern whose eighth sign makes the count
of negatives even (IQ2_XXS, IQ2_XS, IQ3_XXS), and a 3- or 4-bit scale per 16 or 32 values beside the block's d.
So each group's values are signed int8 codes times one float scale, exactly: `group_words` returns them as two
int32 words of four codes (value i of the group in byte i % 4 of word i // 4) and the scale, from one index
load, one or two table loads and a few scale bytes, instead of a gather per value. IQ1_S and IQ1_M add a delta of
+-1/8 per group to the -1 / 0 / 1 table values: their codes are 8 g + delta, returned as the table words, the
delta and a factor 8 (a value is scale (8 g + delta) with scale = d (2s + 1) / 8).

The words feed dp4a against x rounded to int8 (int8_dot.quantize_x, as llama.cpp's CUDA decode of these types
does), or are split into bytes for the float kernels. The prefill tile kernels (fused_moe_quant.py, matmul_quant.py)
take 64 values of BLOCK_N rows a step: `group_words64` loads the 8 groups' words a step ahead of `group_values64`,
which turns each value into a float with one PRMT and one FMA (tile64.py's placement under the exponent of 0.5 of
the code + 64, which the signs give at no extra cost: _biased). Signs are applied a word at a time: a byte b
becomes -b by (b ^ 0xFF) + 1, and no byte carries into the next because no table value is 0 where the pattern can
negate it (IQ2: 8, 25, 43; IQ3: 1 ... 62; IQ1 is unsigned).
"""

from __future__ import annotations

import triton
import triton.language as tl

from moerun.formats.quants import QuantType
from moerun.kernels.pdl import launch_dependents, wait_for_previous
from moerun.kernels.quant.int8_dot import dp4a
from moerun.kernels.quant.tile64 import _bytes_float, _scaled
from moerun.kernels.rmsnorm import round_to

GROUP_TYPES: tuple[QuantType, ...] = (
    QuantType.IQ2_XXS, QuantType.IQ2_XS, QuantType.IQ2_S, QuantType.IQ3_XXS, QuantType.IQ3_S, QuantType.IQ1_S,
    QuantType.IQ1_M,
)  # fmt: skip


@triton.jit
def _u8(blk, off):
    """Byte `off` of the blocks at blk -> int32 (broadcast shapes)."""
    return tl.load(blk + off).to(tl.int32)


@triton.jit
def _u16(blk, off):
    """The little-endian uint16 at byte `off` (even; the blocks start at even addresses) -> int32: one load."""
    return tl.load((blk + off).to(tl.pointer_type(tl.int16))).to(tl.int32) & 0xFFFF


@triton.jit
def _u32(blk, off):
    return _u16(blk, off) | (_u16(blk, off + 2) << 16)


@triton.jit
def _half(bits):
    """fp16 bit patterns (int32) -> float32."""
    return bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _with_parity(s7):
    """A 7-bit sign pattern -> its sign byte: bit 7 set when bits 0-6 hold an odd count (ggml's ksigns_iq2xs)."""
    p = s7 ^ (s7 >> 4)
    p ^= p >> 2
    p ^= p >> 1
    return s7 | ((p & 1) << 7)


@triton.jit
def _signed(w, nibble):
    """Word w of four positive int8 codes with byte i negated where bit i of nibble (0-15) is set."""
    ones = ((nibble * 0x204081) & 0x01010101)  # bit i -> bit 0 of byte i (the four shifted copies do not overlap)
    return (w ^ (ones * 255)) + ones


@triton.jit
def _biased(w, nibble):
    """Word w of four table values t (1 <= t < 64) -> four bytes 64 + t, or 64 - t where bit i of nibble is set:
    t ^ 0x40 and (t ^ 0x3F) + 1, every byte below 128, so nothing carries and the PRMT placement of codes below 128
    takes them (group_values64)."""
    ones = ((nibble * 0x204081) & 0x01010101)  # bit i -> bit 0 of byte i
    return (w ^ (ones * 0x3F) ^ ((ones ^ 0x01010101) * 0x40)) + ones


@triton.jit
def group_words(QTYPE: tl.constexpr, blk, g, grid, GATHER: tl.constexpr = False):
    """Group g (0-31; values 8g .. 8g + 7) of the 256-value blocks at blk (g and blk broadcast together):
    (w0, w1 int32: the group's codes, four a word; scale float32; delta int32, 0 but for IQ1: +-1). grid as
    _group_fields takes it."""
    w0, w1, sgn, scale, delta = _group_fields(QTYPE, blk, g, grid, GATHER)
    if QTYPE != 19 and QTYPE != 29:
        w0 = _signed(w0, sgn & 15)
        w1 = _signed(w1, sgn >> 4)
    return w0, w1, scale, delta


@triton.jit
def _gathered(table, i):
    """table[i] for a table held in registers (one program's copy, [entries]) and indices i of any shape: Triton
    gathers through shared memory, where a load per lane from the table in global memory costs a pass of the L1
    for every distinct line the warp's indices touch."""
    return tl.reshape(tl.gather(table, tl.reshape(i, [i.numel]), 0), i.shape)


@triton.jit
def _pair_entry(grid, idx, GATHER: tl.constexpr):
    """The two int32 words of entry idx of a pair table: grid an int32 pointer to it (GATHER off) or its int64
    entries in registers (GATHER on)."""
    if GATHER:
        v = _gathered(grid, idx)
        w0, w1 = v.to(tl.int32), (v >> 32).to(tl.int32)
    else:
        w0, w1 = tl.load(grid + 2 * idx), tl.load(grid + 2 * idx + 1)
    return w0, w1


@triton.jit
def _entry(grid, i, GATHER: tl.constexpr):
    """Word i of a one-word table (IQ3): grid an int32 pointer to it, or its words in registers (GATHER)."""
    if GATHER:
        w = _gathered(grid, i)
    else:
        w = tl.load(grid + i)
    return w


@triton.jit
def load_table(grid, QTYPE: tl.constexpr, ENTRIES: tl.constexpr):
    """A grid type's table into registers for _pair_entry / _entry with GATHER: int64 entries of a pair table,
    int32 words of IQ3's ([ENTRIES])."""
    if QTYPE == 18 or QTYPE == 21:
        table = tl.load(grid + tl.arange(0, ENTRIES))
    else:
        table = tl.load(grid.to(tl.pointer_type(tl.int64)) + tl.arange(0, ENTRIES))
    return table


@triton.jit
def _group_fields(QTYPE: tl.constexpr, blk, g, grid, GATHER: tl.constexpr = False):
    """group_words before the signs: (w0, w1 the table's values of group g, four a word; its signs, a byte (0 for
    IQ1); scale; delta, 0 but for IQ1). grid: the table's int32 words in global memory, or (GATHER) in registers
    as load_table gives them."""
    zero = g * 0
    delta = zero
    if QTYPE == 16:  # IQ2_XXS: per 32, 4 index bytes then a word of 4 x 7-bit sign patterns + 4-bit scale
        base = 2 + 8 * (g // 4)
        idx = _u8(blk, base + g % 4)
        aux = _u32(blk, base + 4)
        sgn = _with_parity((aux >> (7 * (g % 4))) & 127)
        w0, w1 = _pair_entry(grid, idx, GATHER)
        scale = _half(_u16(blk, zero)) * ((2 * ((aux >> 28) & 15) + 1).to(tl.float32) * 0.125)
    elif QTYPE == 17:  # IQ2_XS: per 8, a uint16 (9-bit index | 7-bit sign pattern); 4-bit scales per 16
        q = _u16(blk, 2 + 2 * g)
        idx = q & 511
        sgn = _with_parity(q >> 9)
        w0, w1 = _pair_entry(grid, idx, GATHER)
        s = (_u8(blk, 66 + g // 4) >> (4 * ((g // 2) % 2))) & 15
        scale = _half(_u16(blk, zero)) * ((2 * s + 1).to(tl.float32) * 0.125)
    elif QTYPE == 22:  # IQ2_S: index low bytes, sign bytes, 2-bit index tops, 4-bit scales per 16
        idx = _u8(blk, 2 + g) | (((_u8(blk, 66 + g // 4) >> (2 * (g % 4))) & 3) << 8)
        sgn = _u8(blk, 34 + g)
        w0, w1 = _pair_entry(grid, idx, GATHER)
        s = (_u8(blk, 74 + g // 4) >> (4 * ((g // 2) % 2))) & 15
        scale = _half(_u16(blk, zero)) * ((2 * s + 1).to(tl.float32) * 0.125)
    elif QTYPE == 18:  # IQ3_XXS: an index byte per 4 values; per 32 a word of 4 sign patterns + 4-bit scale
        aux = _u32(blk, 66 + 4 * (g // 4))
        sgn = _with_parity((aux >> (7 * (g % 4))) & 127)
        w0, w1 = _entry(grid, _u8(blk, 2 + 2 * g), GATHER), _entry(grid, _u8(blk, 3 + 2 * g), GATHER)
        scale = _half(_u16(blk, zero)) * ((2 * ((aux >> 28) & 15) + 1).to(tl.float32) * 0.25)
    elif QTYPE == 21:  # IQ3_S: index low bytes, 1-bit index tops, sign bytes, 4-bit scales per 32
        tops = _u8(blk, 66 + g // 4) >> (2 * (g % 4))
        w0 = _entry(grid, _u8(blk, 2 + 2 * g) | ((tops & 1) << 8), GATHER)
        w1 = _entry(grid, _u8(blk, 3 + 2 * g) | ((tops & 2) << 7), GATHER)
        sgn = _u8(blk, 74 + g)
        s = (_u8(blk, 106 + g // 8) >> (4 * ((g // 4) % 2))) & 15
        scale = _half(_u16(blk, zero)) * (2 * s + 1).to(tl.float32)
    elif QTYPE == 19:  # IQ1_S: index low bytes; per 32 a uint16 of 3-bit index tops, 3-bit scale, delta sign
        w = _u16(blk, 34 + 2 * (g // 4))
        idx = _u8(blk, 2 + g) | (((w >> (3 * (g % 4))) & 7) << 8)
        w0, w1 = _pair_entry(grid, idx, GATHER)
        sgn = zero
        scale = _half(_u16(blk, zero)) * ((2 * ((w >> 12) & 7) + 1).to(tl.float32) * 0.125)
        delta = tl.where((w & 0x8000) != 0, -1, 1)
    else:  # IQ1_M: index low bytes; a nibble per 8 (index top, delta sign); 3-bit scales per 16; d in the tops
        tl.static_assert(QTYPE == 29, "group_words: not a grid type")
        nib = (_u8(blk, 32 + g // 2) >> (4 * (g % 2))) & 15
        idx = _u8(blk, g) | ((nib & 7) << 8)
        w0, w1 = _pair_entry(grid, idx, GATHER)
        sgn = zero
        s = (_u16(blk, 48 + 2 * (g // 8)) >> (3 * ((g // 2) % 4))) & 7
        bits = ((_u16(blk, zero + 48) >> 12) | ((_u16(blk, zero + 50) >> 8) & 0xF0)
                | ((_u16(blk, zero + 52) >> 4) & 0xF00) | (_u16(blk, zero + 54) & 0xF000))  # fmt: skip
        scale = _half(bits) * ((2 * s + 1).to(tl.float32) * 0.125)
        delta = tl.where((nib & 8) != 0, -1, 1)
    return w0, w1, sgn, scale, delta


@triton.jit
def group_values(QTYPE: tl.constexpr, blk, g, grid, GATHER: tl.constexpr = False):
    """The 8 float32 values of group g [BN, G] of the blocks at blk: [BN, G, 8] (value i of group g at [.., g, i])."""
    w0, w1, scale, delta = group_words(QTYPE, blk, g, grid, GATHER)
    i = tl.arange(0, 8)[None, None, :]
    w = tl.where(i < 4, w0[:, :, None], w1[:, :, None])  # [BN, G, 8]
    code = (w << (24 - 8 * (i % 4))) >> 24  # signed byte i % 4
    if QTYPE == 19 or QTYPE == 29:
        code = 8 * code + delta[:, :, None]
    return code.to(tl.float32) * scale[:, :, None]


@triton.jit
def group_words64(QTYPE: tl.constexpr, raw, grid, rows, q, KQ):
    """group_words of the 8 groups of elements 64q .. 64q + 63 of `rows` ([BN, 1] int64 row indices) of the blocks
    at raw (rows of KQ pairs, K a multiple of 256), but with codes + 64 (_biased) in place of the signed codes, save
    for IQ1 (signed codes and a delta): (w0, w1, scale, delta), [8, BN, 1] each (delta [8, 1, 1] but for IQ1).

    Groups lead: where the loads leave the order of the dimensions open, Triton's layouts make the first one the
    fastest, and groups fastest keep a row's values of consecutive groups in one thread, as the tensor-core operand
    wants them (rows fastest split the operand into four K = 16 pieces stored 16 bits at a time)."""
    BB: tl.constexpr = (66 if QTYPE == 16 else 74 if QTYPE == 17 else 82 if QTYPE == 22 else 98 if QTYPE == 18
                        else 110 if QTYPE == 21 else 50 if QTYPE == 19 else 56)  # bytes a block; fmt: skip
    blk = raw + rows[None, :, :] * ((KQ // 4) * BB) + (q // 4) * BB  # [1, BN, 1] this pair's block
    g = 8 * (q % 4) + tl.arange(0, 8)[:, None, None]  # [8, 1, 1] its groups
    w0, w1, sgn, scale, delta = _group_fields(QTYPE, blk, g, grid)
    if QTYPE != 19 and QTYPE != 29:  # codes + 64, for group_values64's single FMA
        w0 = _biased(w0, sgn & 15)
        w1 = _biased(w1, sgn >> 4)
    return w0, w1, scale, delta


@triton.jit
def group_values64(QTYPE: tl.constexpr, w0, w1, scale, delta, INTERPRET: tl.constexpr):
    """group_words64's groups as float32 [BN, 64] in element order (value i of group g at 8g + i), each value
    exactly its code times the scale rounded once, as group_values (and the GGUF decoder) compute it."""
    b = tl.arange(0, 4)[None, None, :]  # [1, 1, 4] byte of a word
    s = scale  # [8, BN, 1]
    if QTYPE == 19 or QTYPE == 29:
        # g + 128 under the exponent of 0.5: f = 0.5 + (g + 128) / 2^16, so g = f 2^16 - 32896 exactly; then
        # (8 g + delta) s = g (8 s) + delta s, rounded once (8 s and delta s are exact)
        c0 = _bytes_float(w0 ^ -2139062144, b, 8, INTERPRET) * 65536.0 - 32896.0  # [8, BN, 4]
        c1 = _bytes_float(w1 ^ -2139062144, b, 8, INTERPRET) * 65536.0 - 32896.0
        v0 = _scaled(c0, 8.0 * s, -(delta.to(tl.float32) * s), INTERPRET)
        v1 = _scaled(c1, 8.0 * s, -(delta.to(tl.float32) * s), INTERPRET)
    else:
        # code + 64 under the exponent of 0.5: f = 0.5 + (code + 64) / 256, so code s = f (256 s) - 192 s, one FMA
        # rounding once: 256 s and 192 s are exact (s has at most 16 significant bits: fp16 d times 2k + 1 < 32)
        v0 = _scaled(_bytes_float(w0, b, 16, INTERPRET), 256.0 * s, 192.0 * s, INTERPRET)  # [8, BN, 4]
        v1 = _scaled(_bytes_float(w1, b, 16, INTERPRET), 256.0 * s, 192.0 * s, INTERPRET)
    v = tl.permute(tl.join(v0, v1), (1, 0, 3, 2))  # [BN, 8, 2, 4]: row, group, word, byte
    return tl.reshape(v, (v.shape[0], 64))


@triton.jit
def _group_rows(raw, e, N, row_bytes, BLOCK_N: tl.constexpr, BLOCK_BYTES: tl.constexpr):
    """(the first block of each of this program's rows of expert e [BN, 1] (rows past N read row N - 1), which
    rows are real [BN, 1])."""
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)[:, None]
    rows_c = tl.minimum(rows, N - 1).to(tl.int64)
    return raw + (e * N + rows_c) * row_bytes, rows < N


@triton.jit
def _group_dequant_kernel(
    out_ptr,  # [P, N, K] (unit stride along K)
    raw,  # uint8 GGUF blocks of the stacked weight [E, N, row_bytes]
    ids,  # int64 [P]: which expert each output matrix holds (HAS_IDS), else p itself
    grid,  # int32 view of the type's table: an IQ2 / IQ1 entry is two words, an IQ3 entry one
    N,
    K,
    row_bytes,
    stride_op,
    stride_on,
    QTYPE: tl.constexpr,
    BLOCK_BYTES: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_IDS: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    p = tl.program_id(0)
    e = tl.load(ids + p).to(tl.int64) if HAS_IDS else p.to(tl.int64)
    row_blk, ok = _group_rows(raw, e, N, row_bytes, BLOCK_N, BLOCK_BYTES)
    g = tl.arange(0, 32)[None, :]  # [1, 32] groups of one block
    col = tl.arange(0, 256)[None, :]
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)[:, None]
    dst = out_ptr + p.to(tl.int64) * stride_op + tl.minimum(rows, N - 1).to(tl.int64) * stride_on  # [BN, 1]
    for b in range(0, K // 256):
        v = tl.reshape(group_values(QTYPE, row_blk + b * BLOCK_BYTES, g, grid), [BLOCK_N, 256])  # [BN, 256]
        tl.store(dst + b * 256 + col, round_to(v, out_ptr.dtype.element_ty, INTERPRET), mask=ok)


@triton.jit
def _group_step(QTYPE: tl.constexpr, row_blk, gk, NG, grid, x_row, dx_row, BLOCK_BYTES: tl.constexpr,
                X_Q8: tl.constexpr, EMULATE_DP4A: tl.constexpr, GATHER: tl.constexpr,
                X_TILE: tl.constexpr):  # fmt: skip
    """Products of groups gk ([1, G] indices in the row, NG a row; those past it count 0) of each row (first blocks
    at row_blk [BN, 1]) with x's values there: [BN, G] float32 (x_row: int8 words with scales at dx_row when X_Q8,
    else float values; grid the table as _group_fields takes it). Every load of the step is independent of the
    others but the table's, so a step of G groups has them all in flight at once."""
    ok = gk < NG
    gc = tl.minimum(gk, NG - 1)  # groups past the row read its last group (in bounds), times x = 0
    blk = row_blk + (gc // 32) * BLOCK_BYTES  # [BN, G]
    g = gc % 32
    if X_Q8:
        xg = gk
        if X_TILE:
            # x's words loaded in the tile's own shape, each row's copy from L1: a [1, G] load is laid out across the
            # program's warps and moved to the [BN, G] layout through shared memory, two barriers a load
            xg = tl.broadcast_to(gk, blk.shape)  # [BN, G]
        x_ok = xg < NG
        xa = tl.load(x_row + 2 * xg, mask=x_ok, other=0)  # [1 or BN, G] words of x's int8 values 8g .. 8g + 3
        xb = tl.load(x_row + 2 * xg + 1, mask=x_ok, other=0)
        dx = tl.load(dx_row + xg // 4, mask=x_ok, other=0.0)
        w0, w1, scale, delta = group_words(QTYPE, blk, g, grid, GATHER)
        s = dp4a(w0, xa, EMULATE_DP4A) + dp4a(w1, xb, EMULATE_DP4A)  # [BN, G]
        if QTYPE == 19 or QTYPE == 29:
            ones = tl.full(gk.shape, 0x01010101, tl.int32)
            s = 8 * s + delta * (dp4a(ones, xa, EMULATE_DP4A) + dp4a(ones, xb, EMULATE_DP4A))
        return s.to(tl.float32) * (scale * dx)
    v = group_values(QTYPE, blk, g, grid, GATHER)  # [BN, G, 8]
    i = tl.arange(0, 8)[None, None, :]
    xs = tl.load(x_row + 8 * gk[:, :, None] + i, mask=ok[:, :, None], other=0.0).to(tl.float32)  # [1, G, 8]
    return tl.sum(v * xs, axis=2)


@triton.jit
def _rows_step(QTYPE: tl.constexpr, row_blk, up_blk, gk, NG, table, x_row, dx_row, acc, acc_up,
               BLOCK_BYTES: tl.constexpr, X_Q8: tl.constexpr, EMULATE_DP4A: tl.constexpr, GATHER: tl.constexpr,
               X_TILE: tl.constexpr, GATE_UP: tl.constexpr):  # fmt: skip
    """One step of _group_gemv_kernel: groups gk of the rows (and of the up rows with GATE_UP) added into
    (acc, acc_up) [BN, G]."""
    acc += _group_step(QTYPE, row_blk, gk, NG, table, x_row, dx_row, BLOCK_BYTES, X_Q8, EMULATE_DP4A, GATHER, X_TILE)
    if GATE_UP:
        acc_up += _group_step(QTYPE, up_blk, gk, NG, table, x_row, dx_row, BLOCK_BYTES, X_Q8, EMULATE_DP4A, GATHER,
                              X_TILE)  # fmt: skip
    return acc, acc_up


@triton.jit
def _group_gemv_kernel(
    out_ptr,  # [P // SLOTS, N]
    raw,  # uint8 GGUF blocks [E, N, row_bytes]
    raw_up,  # GATE_UP: the up projection's blocks, same type and shape; the output is silu(W x) * (W_up x)
    ids,  # int32 or int64 [P]: the expert pair p multiplies (HAS_IDS), else expert 0
    x_ptr,  # float x [P // X_DIV, K] (not X_Q8), or int8 words int32 [P // X_DIV, K / 4] (int8_dot.Int8Rows.xq)
    dx_ptr,  # float32 [P // X_DIV, K / 32]: x's int8 scales (X_Q8)
    weights_ptr,  # [P] (WEIGHTED): pair p's product is multiplied by weights[p] (a routing weight)
    grid,
    N,
    K,
    row_bytes,
    stride_x,
    stride_dx,
    stride_o,
    QTYPE: tl.constexpr,
    BLOCK_BYTES: tl.constexpr,
    BLOCK_N: tl.constexpr,
    GROUPS: tl.constexpr,  # groups of 8 values of a row a loop step (a power of two)
    X_DIV: tl.constexpr,
    SLOTS: tl.constexpr,  # pairs a program sums (an MoE token's k slots), row p // SLOTS of the output
    HAS_IDS: tl.constexpr,
    X_Q8: tl.constexpr,
    GATE_UP: tl.constexpr,
    WEIGHTED: tl.constexpr,
    EMULATE_DP4A: tl.constexpr,
    GATHER: tl.constexpr,  # the table read into registers first and gathered through shared memory (load_table)
    TABLE_ENTRIES: tl.constexpr,
    PDL: tl.constexpr = 0,  # kernels/pdl.py: the blocks are read after the wait too (their rows need the ids)
    STATIC_NG: tl.constexpr = 0,  # K // 8 when the step loop is unrolled (config key "unroll"), else 0
    X_TILE: tl.constexpr = False,  # X_Q8: x's words loaded in the [BLOCK_N, GROUPS] tile's shape (the MoE parts)
):
    launch_dependents(PDL)
    table = load_table(grid, QTYPE, TABLE_ENTRIES) if GATHER else grid  # constant data: before the wait
    wait_for_previous(PDL)
    NG = K // 8  # groups a row
    if STATIC_NG > 0:
        NG = STATIC_NG
    gs = tl.arange(0, GROUPS)[None, :]  # [1, G]
    y = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for slot in tl.static_range(SLOTS):
        p = tl.program_id(0) * SLOTS + slot
        e = tl.load(ids + p).to(tl.int64) if HAS_IDS else 0
        row_blk, _ = _group_rows(raw, e, N, row_bytes, BLOCK_N, BLOCK_BYTES)
        up_blk, _ = _group_rows(raw_up, e, N, row_bytes, BLOCK_N, BLOCK_BYTES)
        xrow = (p // X_DIV).to(tl.int64)
        x_row = x_ptr + xrow * stride_x
        dx_row = dx_ptr + xrow * stride_dx
        acc = tl.zeros((BLOCK_N, GROUPS), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_N, GROUPS), dtype=tl.float32)
        if STATIC_NG > 0:
            # unrolled: no loop boundary between the slots, so every slot's loads can be in flight at once
            for k0 in tl.static_range(0, STATIC_NG, GROUPS):
                acc, acc_up = _rows_step(QTYPE, row_blk, up_blk, k0 + gs, NG, table, x_row, dx_row, acc, acc_up,
                                         BLOCK_BYTES, X_Q8, EMULATE_DP4A, GATHER, X_TILE, GATE_UP)  # fmt: skip
        else:
            for k0 in range(0, NG, GROUPS):
                acc, acc_up = _rows_step(QTYPE, row_blk, up_blk, k0 + gs, NG, table, x_row, dx_row, acc, acc_up,
                                         BLOCK_BYTES, X_Q8, EMULATE_DP4A, GATHER, X_TILE, GATE_UP)  # fmt: skip
        part = tl.sum(acc, axis=1)  # [BN]
        if GATE_UP:
            part = part / (1.0 + tl.exp(-part)) * tl.sum(acc_up, axis=1)
        if WEIGHTED:
            part = part * tl.load(weights_ptr + p).to(tl.float32)
        y += part
    offs = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    tl.store(out_ptr + tl.program_id(0).to(tl.int64) * stride_o + offs, y.to(out_ptr.dtype.element_ty),
             mask=offs < N)  # fmt: skip
