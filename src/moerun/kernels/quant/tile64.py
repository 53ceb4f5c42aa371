"""Prefill tiles of the quantized fused MoE and dense matmul that decode a whole pair (64 inputs) a step: "tile64".

Same grids, routing and epilogues as the tile path (fused_moe_quant.py, matmul_quant.py), for Q4_K, Q5_K, Q6_K and
Q8_0. The tile path decodes a pair as two [BLOCK_N, 32] planes, each multiplied in its own 32-deep tl.dot; compiled
for sm_90 each of those dots waits for the one before it. Here one step reads a pair's code bytes as int32 words
(8 words of a row for the 4-bit types), masks the nibbles and top bits four elements an instruction, turns each
byte into a float with one PRMT on the GPU (2^23 + byte under the exponent bytes), scales the two planes as
[BLOCK_N, 8, 4] (word, byte) tiles, joins them into element order and multiplies the [BLOCK_N, 64] tile in one
tl.dot as the left operand (out^T = W x^T). Every load is at least four bytes a thread (the fp16 block scales are
read as the int32 words that hold them), so Triton's pipeliner issues them `num_stages` steps ahead and the dots
overlap. What remains is the decode's integer and float work: on an H200 the same kernel with the decode left out
runs at the bf16 kernel's speed (benchmarks/RESULTS.md).
"""

from __future__ import annotations

import triton
import triton.language as tl

from moerun.formats.quants import QuantType
from moerun.kernels.fused_moe import _silu_mul, _tile_pid
from moerun.kernels.quant.tile_rows import block_rows, store_down_tile

TILE64_TYPES = (QuantType.Q4_K, QuantType.Q5_K, QuantType.Q6_K, QuantType.Q8_0)


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
def _bytes_float(word, b, bias: tl.constexpr, INTERPRET: tl.constexpr):
    """float32 of byte b of int32 `word` minus `bias` (word [BN, W, 1], b [1, 1, 4] -> [BN, W, 4]).

    On the GPU one PRMT builds 2^23 + byte as float32 bits (the byte under the exponent bytes 0x4B, 0, 0), where
    the shift, mask and OR it replaces take three instructions; the interpreter runs the same in plain integers."""
    if INTERPRET:
        bits = ((word >> (b * 8)) & 0xFF) | 0x4B000000
    else:
        selector = b + 0x7540  # result bytes: word byte b, then bytes 0, 1, 3 of 0x4B000000
        bits = tl.inline_asm_elementwise("prmt.b32 $0, $1, 0x4B000000, $2;", "=r,r,r",
                                         [tl.broadcast_to(word, (word.shape[0], word.shape[1], 4)),
                                          tl.broadcast_to(selector, (word.shape[0], word.shape[1], 4))],
                                         dtype=tl.int32, is_pure=True, pack=1)
    return bits.to(tl.float32, bitcast=True) - (8388608.0 + bias)


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
        v0 = _bytes_float(tl.load(cp), b, 128, INTERPRET) * _half(dd, 0)  # [BN, 8, 4]
        v1 = _bytes_float(tl.load(cp + 8), b, 128, INTERPRET) * _half(dd, 1)
    else:
        # Nibbles and top bits are masked in whole words (four elements an instruction), then split into bytes.
        cw = tl.load(codes.to(tl.pointer_type(tl.int32)) + rows3 * (KQ * 8) + q * 8 + wi)  # [BN, 8, 1]
        lo = cw & 0x0F0F0F0F
        hi = (cw >> 4) & 0x0F0F0F0F
        w = tl.load(sub + rows3 * KQ + q)  # [BN, 1, 1] four sub-block bytes
        if QTYPE == 13:  # Q5_K: fifth bits, byte 32(q // 4) + l of `high`, bit 2(q % 4) + p
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
            v0 = _bytes_float(lo, b, 32, INTERPRET) * dl0
            v1 = _bytes_float(hi, b, 32, INTERPRET) * dl1
        else:  # Q4_K, Q5_K: c (d sc) - dmin mn, sub-block p's scale byte p, min byte 2 + p
            tl.static_assert(QTYPE == 12 or QTYPE == 13, "decode_pair64: unsupported quant type")
            dd = tl.load(words + rows3 * (KQ // 4) + q // 4)  # [BN, 1, 1] d | dmin << 16
            d = _half(dd, 0)
            dmin = _half(dd, 1)
            v0 = _bytes_float(lo, b, 0, INTERPRET) * (d * _byte(w, 0)) - dmin * _byte(w, 2)
            v1 = _bytes_float(hi, b, 0, INTERPRET) * (d * _byte(w, 1)) - dmin * _byte(w, 3)
    v = tl.permute(tl.join(v0, v1), (0, 3, 1, 2))  # [BN, 2, 8, 4]: plane, word, byte
    return tl.reshape(v, (v.shape[0], 64))


@triton.jit(do_not_specialize=["num_pairs", "num_pid_m"])
def _gemm1_tile64_kernel(
    x_ptr,  # [T, H]
    inter_ptr,  # [P, I] one row per padded sorted position
    sorted_ids_ptr,  # [P]
    block_expert_ptr,  # [P / BLOCK_M]
    gc, gh, gs, gd,
    uc, uh, us, ud,
    num_pairs,
    top_k,
    H,
    I,  # noqa: E741
    G_ROWS,
    G_OFF,
    U_ROWS,
    U_OFF,
    KQ,
    num_pid_m,
    stride_xt,
    stride_it,
    QG: tl.constexpr,
    QU: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    GROUP_M: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    INTERPRET: tl.constexpr,
):  # fmt: skip
    pid_m, pid_n = _tile_pid(tl.program_id(0), num_pid_m, tl.cdiv(I, BLOCK_N), GROUP_M)
    expert, pair, row_ok, irow = block_rows(pid_m, sorted_ids_ptr, block_expert_ptr, num_pairs, BLOCK_M, False)
    if expert < 0:  # unused blocks, past the padded length too
        return
    token = tl.where(row_ok, pair // top_k, 0).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    n = (offs_n % I).to(tl.int64)
    rows_g = (expert * G_ROWS + G_OFF + n)[:, None]  # [BLOCK_N, 1]
    rows_u = (expert * U_ROWS + U_OFF + n)[:, None]
    offs_k = tl.arange(0, 64)  # [64]
    x_rows = x_ptr + token * stride_xt  # [BLOCK_M]
    cdt = x_ptr.dtype.element_ty
    acc_g = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)  # gate^T
    acc_u = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for q in range(0, KQ):
        k = q * 64 + offs_k  # [64]
        g = decode_pair64(QG, gc, gh, gs, gd, rows_g, q, KQ, INTERPRET)  # [BLOCK_N, 64]
        u = decode_pair64(QU, uc, uh, us, ud, rows_u, q, KQ, INTERPRET)
        # Decoded weights are rounded to the activation dtype, as dequantize(dtype) rounds them.
        g = g.to(cdt).to(DOT_DTYPE)
        u = u.to(cdt).to(DOT_DTYPE)
        xt = tl.load(x_rows[None, :] + k[:, None], mask=row_ok[None, :] & (k[:, None] < H), other=0.0)  # [64, M]
        xt = xt.to(DOT_DTYPE)
        acc_g = tl.dot(g, xt, acc_g, input_precision=DOT_PRECISION)
        acc_u = tl.dot(u, xt, acc_u, input_precision=DOT_PRECISION)
    act = _silu_mul(acc_g, acc_u).to(inter_ptr.dtype.element_ty)  # [BLOCK_N, BLOCK_M]
    # Padding rows had zero inputs, so they store zeros, which GEMM 2 relies on.
    tl.store(inter_ptr + irow[None, :] * stride_it + offs_n[:, None], act, mask=offs_n[:, None] < I)


@triton.jit(do_not_specialize=["num_pairs", "num_pid_m"])
def _gemm2_tile64_kernel(
    inter_ptr,  # [P, I]
    topk_w_ptr,  # [T*k]
    out_ptr,  # [T, H] fp32 (ATOMIC) or [T*k, H] in fp32 or the output dtype
    sorted_ids_ptr,  # [P]
    block_expert_ptr,  # [P / BLOCK_M]
    wc, wh, ws, wd,
    num_pairs,
    top_k,
    H,
    I,  # noqa: E741
    KQ,
    num_pid_m,
    stride_it,
    stride_ot,
    QW: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    GROUP_M: tl.constexpr,
    ATOMIC: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    INTERPRET: tl.constexpr,
):  # fmt: skip
    pid_m, pid_n = _tile_pid(tl.program_id(0), num_pid_m, tl.cdiv(H, BLOCK_N), GROUP_M)
    expert, pair, row_ok, irow = block_rows(pid_m, sorted_ids_ptr, block_expert_ptr, num_pairs, BLOCK_M, False)
    if expert < 0:
        return
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    rows = (expert * H + (offs_n % H))[:, None]  # [BLOCK_N, 1]
    offs_k = tl.arange(0, 64)  # [64]
    a_rows = inter_ptr + irow * stride_it  # [BLOCK_M]
    cdt = inter_ptr.dtype.element_ty
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)  # out^T
    for q in range(0, KQ):
        k = q * 64 + offs_k  # [64]
        w = decode_pair64(QW, wc, wh, ws, wd, rows, q, KQ, INTERPRET)  # [BLOCK_N, 64]
        w = w.to(cdt).to(DOT_DTYPE)
        # Padding rows of the sorted intermediate hold zeros, so they need no row mask.
        at = tl.load(a_rows[None, :] + k[:, None], mask=k[:, None] < I, other=0.0).to(DOT_DTYPE)  # [64, M]
        acc = tl.dot(w, at, acc, input_precision=DOT_PRECISION)
    store_down_tile(acc, topk_w_ptr, out_ptr, pair, row_ok, offs_n, H, top_k, stride_ot, ATOMIC)


# The row count of x follows the batch, so it is not specialised on.
@triton.jit(do_not_specialize=["M"])
def _matmul_tile64_kernel(
    x_ptr,  # [M, K]
    y_ptr,  # [M, N_total]; this part writes columns [col_off, col_off + N)
    bias_ptr,  # [N_total] or a dummy
    wc, wh, ws, wd,
    M,
    N,
    K,
    KQ,
    col_off,
    stride_xm,
    stride_ym,
    QW: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    GROUP_M: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    INTERPRET: tl.constexpr,
):  # fmt: skip
    """y = x W^T for one dense weight part, y^T tiles [BLOCK_N, BLOCK_M] (matmul_quant.py's tile grid)."""
    pid_m, pid_n = _tile_pid(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    m_ok = offs_m < M
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    rows = (offs_n % N).to(tl.int64)[:, None]  # [BLOCK_N, 1]
    offs_k = tl.arange(0, 64)  # [64]
    x_rows = x_ptr + tl.where(m_ok, offs_m, 0).to(tl.int64) * stride_xm  # [BLOCK_M]
    cdt = x_ptr.dtype.element_ty
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)  # y^T
    for q in range(0, KQ):
        k = q * 64 + offs_k  # [64]
        xt = tl.load(x_rows[None, :] + k[:, None], mask=m_ok[None, :] & (k[:, None] < K), other=0.0)  # [64, M]
        w = decode_pair64(QW, wc, wh, ws, wd, rows, q, KQ, INTERPRET)  # [BLOCK_N, 64]
        # Decoded weights are rounded to the activation dtype, as dequantize(dtype) rounds them.
        acc = tl.dot(w.to(cdt).to(DOT_DTYPE), xt.to(DOT_DTYPE), acc, input_precision=DOT_PRECISION)
    n_ok = offs_n < N
    if HAS_BIAS:
        acc += tl.load(bias_ptr + col_off + offs_n, mask=n_ok, other=0.0).to(tl.float32)[:, None]
    y_ptrs = y_ptr + offs_m.to(tl.int64)[None, :] * stride_ym + col_off + offs_n[:, None]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=m_ok[None, :] & n_ok[:, None])
