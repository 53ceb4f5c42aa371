"""Kernels for the types without a repacked layout (grid, ternary and FP4 types) that read their GGUF blocks
directly: dequantisation in one launch (a whole stacked weight, or the experts of given ids, repeats allowed), and
a GEMV for a few rows of x (each row against the expert its id names: the MoE's (token, slot) pairs at decode).

Each program decodes BLOCK_N rows of one output matrix, up to 256 elements (one or more GGUF blocks) a step:
every element's bytes are read from its block (loads of one address by many lanes are one transaction), grid
values from the type's table (formats/quants/grids.py, int8 [entries, width]), sign patterns from ksigns and FP4
levels from a 16-entry table.
Every value is a product of exact factors, so the float32 results are formats.quants.dequantize's bit for bit
(the torch reference the tests compare with); the GEMV sums their products with x in float32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moerun.formats.quants import FP4_VALUES, QuantType
from moerun.formats.quants.grids import GRID_OF, grid_table, sign_patterns
from moerun.kernels.interpreter import interpreting
from moerun.kernels.rmsnorm import round_to

BLOCK_TYPES: tuple[QuantType, ...] = (
    QuantType.IQ2_XXS, QuantType.IQ2_XS, QuantType.IQ2_S, QuantType.IQ3_XXS, QuantType.IQ3_S, QuantType.IQ1_S,
    QuantType.IQ1_M, QuantType.TQ1_0, QuantType.TQ2_0, QuantType.MXFP4, QuantType.NVFP4,
)  # fmt: skip
_TABLES: dict[tuple[str, torch.device], torch.Tensor] = {}


@triton.jit
def _u8(blk, off):
    """Byte `off` of the blocks at blk (off [1, S]; blk [BN, 1] or [BN, S]) -> int32 [BN, S]."""
    return tl.load(blk + off).to(tl.int32)


@triton.jit
def _u16(blk, off):
    return _u8(blk, off) | (_u8(blk, off + 1) << 8)


@triton.jit
def _u32(blk, off):
    return _u16(blk, off) | (_u16(blk, off + 2) << 16)


@triton.jit
def _half(bits):
    """fp16 bit patterns (int32) -> float32."""
    return bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _block_values(QTYPE: tl.constexpr, blk, j, grid, signs, levels):
    """float32 values of elements j (of their block; [1, S]) of the blocks at blk ([BN, 1] or [BN, S])."""
    if QTYPE == 16:  # IQ2_XXS: per 32: 4 grid index bytes, a word of 4 x 7-bit sign patterns + 4-bit scale
        g = j // 32
        l8 = (j % 32) // 8
        aux = _u32(blk, 2 + 8 * g + 4)
        neg = (tl.load(signs + ((aux >> (7 * l8)) & 127)).to(tl.int32) >> (j % 8)) & 1
        gv = tl.load(grid + _u8(blk, 2 + 8 * g + l8) * 8 + j % 8).to(tl.float32)
        mult = (2 * ((aux >> 28) & 15) + 1).to(tl.float32) * 0.125
        d = _half(_u16(blk, j * 0))
    elif QTYPE == 17:  # IQ2_XS: per 8 a uint16 (9-bit index | 7-bit sign pattern); 4-bit scales per 16
        q = _u16(blk, 2 + 2 * (j // 8))
        neg = (tl.load(signs + (q >> 9)).to(tl.int32) >> (j % 8)) & 1
        gv = tl.load(grid + (q & 511) * 8 + j % 8).to(tl.float32)
        s = (_u8(blk, 66 + j // 32) >> (4 * ((j // 16) % 2))) & 15
        mult = (2 * s + 1).to(tl.float32) * 0.125
        d = _half(_u16(blk, j * 0))
    elif QTYPE == 22:  # IQ2_S: index low bytes, sign bytes, 2-bit index tops, 4-bit scales per 16
        k = j // 8
        idx = _u8(blk, 2 + k) | (((_u8(blk, 66 + k // 4) >> (2 * (k % 4))) & 3) << 8)
        neg = (_u8(blk, 34 + k) >> (j % 8)) & 1
        gv = tl.load(grid + idx * 8 + j % 8).to(tl.float32)
        s = (_u8(blk, 74 + j // 32) >> (4 * ((j // 16) % 2))) & 15
        mult = (2 * s + 1).to(tl.float32) * 0.125
        d = _half(_u16(blk, j * 0))
    elif QTYPE == 18:  # IQ3_XXS: a grid index byte per 4; per 32 a word of 4 sign patterns + 4-bit scale
        aux = _u32(blk, 66 + 4 * (j // 32))
        neg = (tl.load(signs + ((aux >> (7 * ((j % 32) // 8))) & 127)).to(tl.int32) >> (j % 8)) & 1
        gv = tl.load(grid + _u8(blk, 2 + j // 4) * 4 + j % 4).to(tl.float32)
        mult = (2 * ((aux >> 28) & 15) + 1).to(tl.float32) * 0.25
        d = _half(_u16(blk, j * 0))
    elif QTYPE == 21:  # IQ3_S: index low bytes, 1-bit index tops, sign bytes, 4-bit scales per 32
        k = j // 4
        idx = _u8(blk, 2 + k) | (((_u8(blk, 66 + k // 8) >> (k % 8)) & 1) << 8)
        neg = (_u8(blk, 74 + j // 8) >> (j % 8)) & 1
        gv = tl.load(grid + idx * 4 + j % 4).to(tl.float32)
        s = (_u8(blk, 106 + j // 64) >> (4 * ((j // 32) % 2))) & 15
        mult = (2 * s + 1).to(tl.float32)
        d = _half(_u16(blk, j * 0))
    elif QTYPE == 19:  # IQ1_S: index low bytes; per 32 a uint16 of 3-bit index tops, scale, delta sign
        w = _u16(blk, 34 + 2 * (j // 32))
        idx = _u8(blk, 2 + j // 8) | (((w >> (3 * ((j % 32) // 8))) & 7) << 8)
        lvl = tl.load(grid + idx * 8 + j % 8).to(tl.int32) * 8 + tl.where((w & 0x8000) != 0, -1, 1)
        neg = lvl * 0
        gv = lvl.to(tl.float32)
        mult = (2 * ((w >> 12) & 7) + 1).to(tl.float32) * 0.125
        d = _half(_u16(blk, j * 0))
    elif QTYPE == 29:  # IQ1_M: index low bytes; a nibble per 8 (index top, delta sign); 3-bit scales per 16
        k = j // 8
        nib = (_u8(blk, 32 + k // 2) >> (4 * (k % 2))) & 15
        idx = _u8(blk, k) | ((nib & 7) << 8)
        lvl = tl.load(grid + idx * 8 + j % 8).to(tl.int32) * 8 + tl.where((nib & 8) != 0, -1, 1)
        neg = lvl * 0
        gv = lvl.to(tl.float32)
        s = (_u16(blk, 48 + 2 * (j // 64)) >> (3 * ((j // 16) % 4))) & 7
        mult = (2 * s + 1).to(tl.float32) * 0.125
        z = j * 0  # d: the top nibbles of the four scale words, low nibble first
        bits = ((_u16(blk, z + 48) >> 12) | ((_u16(blk, z + 50) >> 8) & 0xF0) | ((_u16(blk, z + 52) >> 4) & 0xF00)
                | (_u16(blk, z + 54) & 0xF000))  # fmt: skip
        d = _half(bits)
    elif QTYPE == 34:  # TQ1_0: base-3 digits, five a byte (bytes 0-47), four a byte (48-51); fp16 d at 52
        in0 = j < 160
        in1 = j < 240
        byte = tl.where(in0, j % 32, tl.where(in1, 32 + (j - 160) % 16, 48 + (j - 240) % 4))
        digit = tl.where(in0, j // 32, tl.where(in1, (j - 160) // 16, (j - 240) // 4))
        p3 = tl.where(digit == 0, 1, tl.where(digit == 1, 3, tl.where(digit == 2, 9, tl.where(digit == 3, 27, 81))))
        gv = ((((_u8(blk, byte) * p3) & 255) * 3) >> 8).to(tl.float32) - 1.0
        neg = j * 0
        mult = 1.0
        d = _half(_u16(blk, j * 0 + 52))
    elif QTYPE == 35:  # TQ2_0: 2-bit codes (element 128h + 32k + l at bits 2k of byte 32h + l); fp16 d at 64
        gv = ((_u8(blk, 32 * (j // 128) + j % 32) >> (2 * ((j % 128) // 32))) & 3).to(tl.float32) - 1.0
        neg = j * 0
        mult = 1.0
        d = _half(_u16(blk, j * 0 + 64))
    elif QTYPE == 39:  # MXFP4: E8M0 scale byte (2^(e - 128)), FP4 nibbles (element j low, j + 16 high)
        gv = tl.load(levels + ((_u8(blk, 1 + j % 16) >> (4 * (j // 16))) & 15)).to(tl.float32)
        neg = j * 0
        mult = 1.0
        e = _u8(blk, j * 0)
        d = tl.where(e < 2, 0x00200000 << e, (e - 1) << 23).to(tl.float32, bitcast=True)
    else:  # NVFP4: UE4M3 scale byte per 16 (halved), FP4 nibbles
        tl.static_assert(QTYPE == 40, "from_blocks: unsupported type")
        gv = tl.load(levels + ((_u8(blk, 4 + 8 * (j // 16) + j % 8) >> (4 * ((j % 16) // 8))) & 15)).to(tl.float32)
        neg = j * 0
        mult = 1.0
        x = _u8(blk, j // 16)
        ex = (x >> 3) & 15
        man = (x & 7).to(tl.float32)
        # (8 + man) 2^(ex - 11), subnormal man 2^-10 (2^(ex - 11) built from its exponent bits)
        d = tl.where(ex == 0, man * 0.0009765625, (man + 8.0) * ((ex + 116) << 23).to(tl.float32, bitcast=True))
        d = tl.where((x == 0) | (x == 0x7F), 0.0, d)
    return tl.where(neg != 0, -gv, gv) * (d * mult)


@triton.jit
def _row_blocks(raw, e, N, row_bytes, BLOCK_N: tl.constexpr, SB: tl.constexpr, STEP: tl.constexpr,
                BLOCK_BYTES: tl.constexpr):  # fmt: skip
    """This program's rows of expert e: (row indices [BN, 1] int64, clamped to N - 1; element columns [1, STEP];
    each element's block in the first step [BN, STEP])."""
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)[:, None]
    rows_c = tl.minimum(rows, N - 1).to(tl.int64)
    col = tl.arange(0, STEP)[None, :]
    return rows_c, col, raw + (e * N + rows_c) * row_bytes + (col // SB) * BLOCK_BYTES


@triton.jit
def _block_dequant_kernel(
    out_ptr,  # [P, N, K] (unit stride along K)
    raw,  # uint8 GGUF blocks of the stacked weight [E, N, row_bytes]
    ids,  # int64 [P]: which expert each output matrix holds (HAS_IDS), else p itself
    grid,
    signs,
    levels,
    N,
    K,
    row_bytes,
    stride_op,
    stride_on,
    QTYPE: tl.constexpr,
    SB: tl.constexpr,  # elements per GGUF block
    STEP: tl.constexpr,  # elements a loop step: a multiple of SB dividing K
    BLOCK_BYTES: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_IDS: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    p = tl.program_id(0)
    e = tl.load(ids + p).to(tl.int64) if HAS_IDS else p.to(tl.int64)
    rows_c, col, blk = _row_blocks(raw, e, N, row_bytes, BLOCK_N, SB, STEP, BLOCK_BYTES)
    ok = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)[:, None] < N  # [BN, 1]
    dst = out_ptr + p.to(tl.int64) * stride_op + rows_c * stride_on  # [BN, 1]
    for b in range(0, K // STEP):
        v = _block_values(QTYPE, blk + b * (STEP // SB * BLOCK_BYTES), col % SB, grid, signs, levels)
        tl.store(dst + b * STEP + col, round_to(v, out_ptr.dtype.element_ty, INTERPRET), mask=ok)


def _tables(qtype: QuantType, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(grid, sign patterns, FP4 levels) for the kernel; each type reads the ones it needs (the others are any
    valid pointer)."""
    key = ("fp4", device)
    if key not in _TABLES:
        _TABLES[key] = torch.tensor(FP4_VALUES, dtype=torch.int8, device=device)
    levels = _TABLES[key]
    grid = grid_table(qtype, device) if qtype in GRID_OF else levels
    return grid, sign_patterns(device), levels


def _step(qtype: QuantType, K: int) -> int:
    """Elements a loop step: 256 where K allows, else the largest power of two of whole blocks dividing K."""
    return next(s for s in (256, 128, 64, 32) if s >= qtype.block_elems and K % s == 0)


def block_dequantize(raw: torch.Tensor, qtype: QuantType, shape: tuple[int, ...], dtype: torch.dtype,
                     ids: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """Dense [E, N, K] (or [len(ids), N, K]: experts ids, repeats allowed) `dtype` tensor of the blocks raw of a
    weight of logical shape [E, N, K] or [N, K] of a BLOCK_TYPES type; [N, K] in, [N, K] out without ids."""
    if qtype not in BLOCK_TYPES:
        raise ValueError(f"block_dequantize decodes {[t.name for t in BLOCK_TYPES]}, not {qtype.name}")
    lead = shape[:-2]
    N, K = shape[-2:]
    E = 1 if not lead else lead[0]
    P = E if ids is None else ids.numel()
    out = torch.empty((P, N, K), dtype=dtype, device=raw.device)
    row_bytes = K // qtype.block_elems * qtype.block_bytes
    if P and N:
        grid_t, signs, levels = _tables(qtype, raw.device)
        block_n = 32
        step = _step(qtype, K)
        launch = (P, triton.cdiv(N, block_n))
        _block_dequant_kernel[launch](
            out, raw, raw if ids is None else ids, grid_t, signs, levels, N, K, row_bytes, out.stride(0), out.stride(1),
            QTYPE=int(qtype), SB=qtype.block_elems, STEP=step, BLOCK_BYTES=qtype.block_bytes, BLOCK_N=block_n,
            HAS_IDS=ids is not None, INTERPRET=interpreting(), num_warps=4,
        )  # fmt: skip
    return out if lead or ids is not None else out[0]


@triton.jit
def _block_gemv_kernel(
    out_ptr,  # [P, N]
    raw,  # uint8 GGUF blocks [E, N, row_bytes]
    ids,  # int64 [P]: the expert row p multiplies (HAS_IDS), else expert 0
    x_ptr,  # [P // X_DIV, K]: row p reads x row p // X_DIV
    grid,
    signs,
    levels,
    N,
    K,
    row_bytes,
    stride_x,
    stride_o,
    QTYPE: tl.constexpr,
    SB: tl.constexpr,
    STEP: tl.constexpr,
    BLOCK_BYTES: tl.constexpr,
    BLOCK_N: tl.constexpr,
    X_DIV: tl.constexpr,
    HAS_IDS: tl.constexpr,
):
    p = tl.program_id(0)
    e = tl.load(ids + p).to(tl.int64) if HAS_IDS else 0
    rows_c, col, blk = _row_blocks(raw, e, N, row_bytes, BLOCK_N, SB, STEP, BLOCK_BYTES)
    xrow = x_ptr + (p // X_DIV).to(tl.int64) * stride_x
    acc = tl.zeros((BLOCK_N, STEP), dtype=tl.float32)
    for b in range(0, K // STEP):
        v = _block_values(QTYPE, blk + b * (STEP // SB * BLOCK_BYTES), col % SB, grid, signs, levels)
        xs = tl.load(xrow + b * STEP + col).to(tl.float32)  # [1, STEP]
        acc += v * xs
    y = tl.sum(acc, axis=1)  # [BN]
    offs = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    tl.store(out_ptr + p.to(tl.int64) * stride_o + offs, y.to(out_ptr.dtype.element_ty), mask=offs < N)


def block_gemv(raw: torch.Tensor, qtype: QuantType, shape: tuple[int, ...], x: torch.Tensor,
               ids: torch.Tensor | None = None, x_div: int = 1) -> torch.Tensor:  # fmt: skip
    """y [P, N] in x's dtype: row p of y is W_e x_(p // x_div) for a weight of logical shape [E, N, K] (e = ids[p])
    or [N, K] (no ids), from its GGUF blocks raw; x [P / x_div, K]. P = len(ids) or, without ids, x's rows."""
    if qtype not in BLOCK_TYPES:
        raise ValueError(f"block_gemv reads {[t.name for t in BLOCK_TYPES]}, not {qtype.name}")
    N, K = shape[-2:]
    if x.shape[-1] != K or x.stride(-1) != 1:
        raise ValueError(f"x must be [rows, {K}] with unit stride along K, got {tuple(x.shape)} {x.stride()}")
    P = x.shape[0] * x_div if ids is None else ids.numel()
    out = torch.empty((P, N), dtype=x.dtype, device=x.device)
    if P and N:
        grid_t, signs, levels = _tables(qtype, raw.device)
        block_n = 16
        step = _step(qtype, K)
        _block_gemv_kernel[(P, triton.cdiv(N, block_n))](
            out, raw, raw if ids is None else ids, x, grid_t, signs, levels, N, K,
            K // qtype.block_elems * qtype.block_bytes, x.stride(0), out.stride(0), QTYPE=int(qtype),
            SB=qtype.block_elems, STEP=step, BLOCK_BYTES=qtype.block_bytes, BLOCK_N=block_n, X_DIV=x_div,
            HAS_IDS=ids is not None, num_warps=4,
        )  # fmt: skip
    return out
