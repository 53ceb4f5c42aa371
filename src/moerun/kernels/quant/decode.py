"""In-register decoding of repacked weights (layouts in repack.py), shared by the MoE and matmul kernels.

`dequant_pair(QTYPE, codes, high, sub, scale, rows, q, lane, KQ)` returns the float32 values of pair q of the
given rows: (elements 64q + lane, elements 64q + 32 + lane). Arguments broadcast: rows [BN, 1] with q a scalar
and lane [1, 32] give two [BN, 32] tiles (tl.dot operands); rows [BN, 1, 1], q [1, P, 1], lane [1, 1, 32] give
[BN, P, 32] tiles (the GEMV paths). `rows` are global row indices (expert * N + n, int64); KQ = K_pad / 64 fixes
each array's row length. QTYPE is the GGUF type id. `x_planes` loads the activations those two planes meet.
`dequantize_triton` decodes a whole weight in one launch, `dequantize_rows` the rows an embedding looks up.

Codes become floats through the exponent trick (int | 0x4B000000 is 2^23 + int as a float32) instead of
integer-to-float conversions, which run at a quarter of the FMA rate.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from moerun.formats.quants import QuantType
from moerun.kernels.interpreter import interpreting
from moerun.kernels.quant.group_scales import bf16_pair
from moerun.kernels.quant.repack import LAYOUTS, PackedWeight
from moerun.kernels.rmsnorm import round_to


def supported(qtype: QuantType) -> bool:
    """True when dequant_pair can decode the type."""
    return qtype in LAYOUTS


@triton.jit
def dequant_pair(QTYPE: tl.constexpr, codes, high, sub, scale, rows, q, lane, KQ):
    """float32 values (elements 64q + lane, elements 64q + 32 + lane) of `rows`; see the module docstring."""
    # Written as one function without nested jit calls: the interpreter re-patches triton.language on every
    # call of a jit function, which would dominate the tests. Boolean chains stay two operands long (older
    # Triton front ends reject `A or B or C`). Conventions: c0/c1 are the int32 codes of the
    # two planes; (c | 0x4B000000) bitcast to float32 is 2^23 + c, so subtracting 2^23 + bias gives c - bias
    # exactly; a 16-element sub-block scale is chosen per lane with tl.where(lane < 16, ...).
    if QTYPE == 8:  # Q8_0: codes [.., 64 KQ], scale d [.., 2 KQ]
        base = codes + rows * (KQ * 64) + q * 64 + lane
        c0 = tl.load(base).to(tl.int32)
        c1 = tl.load(base + 32).to(tl.int32)
    elif QTYPE == 10 or QTYPE == 11:  # Q2_K, Q3_K: 2-bit codes [.., 16 KQ]
        c = tl.load(codes + rows * (KQ * 16) + (q // 2) * 32 + lane).to(tl.int32)
        s = (q % 2) * 4
        c0 = (c >> s) & 3
        c1 = (c >> (s + 2)) & 3
    else:  # 4-bit codes [.., 32 KQ]
        b = tl.load(codes + rows * (KQ * 32) + q * 32 + lane).to(tl.int32)
        c0 = b & 15
        c1 = b >> 4
    if (QTYPE == 6 or QTYPE == 7) or (QTYPE == 13 or QTYPE == 11):  # one high bit [.., 8 KQ]: Q5_0, Q5_1, Q5_K, Q3_K
        h = tl.load(high + rows * (KQ * 8) + (q // 4) * 32 + lane).to(tl.int32)
        s = (q % 4) * 2
        if QTYPE == 11:  # above 2 code bits
            c0 = c0 | (((h >> s) & 1) << 2)
            c1 = c1 | (((h >> (s + 1)) & 1) << 2)
        else:  # above 4 code bits
            c0 = c0 | (((h >> s) & 1) << 4)
            c1 = c1 | (((h >> (s + 1)) & 1) << 4)
    if QTYPE == 14:  # Q6_K: two high bits [.., 16 KQ]
        h = tl.load(high + rows * (KQ * 16) + (q // 2) * 32 + lane).to(tl.int32)
        s = (q % 2) * 4
        c0 = c0 | (((h >> s) & 3) << 4)
        c1 = c1 | (((h >> (s + 2)) & 3) << 4)

    if (QTYPE == 8 or QTYPE == 2) or QTYPE == 6:  # Q8_0, Q4_0, Q5_0: (c - bias) d, fp16 d per 32
        if QTYPE == 8:
            bias = 8388736.0  # 2^23 + 128
        elif QTYPE == 2:
            bias = 8388616.0  # 2^23 + 8
        else:
            bias = 8388624.0  # 2^23 + 16
        sp = scale + rows * (KQ * 2) + q * 2
        d0 = tl.load(sp).to(tl.float32)
        d1 = tl.load(sp + 1).to(tl.float32)
        v0 = ((c0 | 0x4B000000).to(tl.float32, bitcast=True) - bias) * d0
        v1 = ((c1 | 0x4B000000).to(tl.float32, bitcast=True) - bias) * d1
    elif QTYPE == 3 or QTYPE == 7:  # Q4_1, Q5_1: c d + m, fp16 (d, m) per 32
        sp = scale + (rows * (KQ * 2) + q * 2) * 2
        d0 = tl.load(sp).to(tl.float32)
        m0 = tl.load(sp + 1).to(tl.float32)
        d1 = tl.load(sp + 2).to(tl.float32)
        m1 = tl.load(sp + 3).to(tl.float32)
        v0 = ((c0 | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0) * d0 + m0
        v1 = ((c1 | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0) * d1 + m1
    elif QTYPE == 12 or QTYPE == 13:  # Q4_K, Q5_K: c (d sc) - dmin mn, bytes (sc0, sc1, mn0, mn1)
        w = tl.load(sub + rows * KQ + q)
        sp = scale + (rows * (KQ // 4) + q // 4) * 2
        d = tl.load(sp).to(tl.float32)
        dmin = tl.load(sp + 1).to(tl.float32)
        dl0 = d * (((w & 0xFF) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0)
        dl1 = d * ((((w >> 8) & 0xFF) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0)
        ml0 = dmin * ((((w >> 16) & 0xFF) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0)
        ml1 = dmin * ((((w >> 24) & 0xFF) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0)
        v0 = ((c0 | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0) * dl0 - ml0
        v1 = ((c1 | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0) * dl1 - ml1
    elif QTYPE == 10:  # Q2_K: c (d sc) - dmin mn, bytes (mn << 4) | sc of 16-element sub-blocks 4q..4q+3
        w = tl.load(sub + rows * KQ + q)
        sp = scale + (rows * (KQ // 4) + q // 4) * 2
        d = tl.load(sp).to(tl.float32)
        dmin = tl.load(sp + 1).to(tl.float32)
        # Scales per row first (4 sub-blocks), then one select per element.
        dl_a = d * ((((w >> 0) & 15) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0)
        dl_b = d * ((((w >> 8) & 15) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0)
        dl_c = d * ((((w >> 16) & 15) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0)
        dl_d = d * ((((w >> 24) & 15) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0)
        ml_a = dmin * ((((w >> 4) & 15) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0)
        ml_b = dmin * ((((w >> 12) & 15) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0)
        ml_c = dmin * ((((w >> 20) & 15) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0)
        ml_d = dmin * ((((w >> 28) & 15) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0)
        lo = lane < 16
        v0 = ((c0 | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0) * tl.where(lo, dl_a, dl_b) - tl.where(
            lo, ml_a, ml_b
        )
        v1 = ((c1 | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0) * tl.where(lo, dl_c, dl_d) - tl.where(
            lo, ml_c, ml_d
        )
    elif (QTYPE == 20 or QTYPE == 23) or QTYPE == 39:  # IQ4_NL, MXFP4: level(c) d; IQ4_XS: level(c) (d sc)
        if QTYPE == 20:  # fp16 d per 32
            sp = scale + rows * (KQ * 2) + q * 2
            d0 = tl.load(sp).to(tl.float32)
            d1 = tl.load(sp + 1).to(tl.float32)
        elif QTYPE == 39:  # bf16 d per 32
            d0, d1 = bf16_pair(scale, rows * (KQ * 2) + q * 2)
        else:  # signed bytes (sc 2q, sc 2q + 1, 0, 0), fp16 d per 256
            w = tl.load(sub + rows * KQ + q)
            d = tl.load(scale + rows * (KQ // 4) + q // 4).to(tl.float32)
            d0 = d * (((((w >> 0) & 0xFF) ^ 0x80) | 0x4B000000).to(tl.float32, bitcast=True) - 8388736.0)
            d1 = d * (((((w >> 8) & 0xFF) ^ 0x80) | 0x4B000000).to(tl.float32, bitcast=True) - 8388736.0)
        # The 16 levels (IQ4_VALUES, MXFP4's FP4_VALUES) as signed bytes of four int32 words, four levels a word:
        # code c is byte c % 4 of word c // 4, picked by two selects on bits 2 and 3 and a shift.
        if QTYPE == 39:
            w0, w1, w2, w3 = 50462976, 201852420, -33620224, -185009412
        else:
            w0, w1, w2, w3 = -1079142271, -152379953, 639175937, 1901675829
        t0 = tl.where((c0 & 4) != 0, w1, w0)  # levels 4..7 | 0..3
        t0 = tl.where(c0 >= 8, tl.where((c0 & 4) != 0, w3, w2), t0)  # levels 12..15 | 8..11
        t1 = tl.where((c1 & 4) != 0, w1, w0)
        t1 = tl.where(c1 >= 8, tl.where((c1 & 4) != 0, w3, w2), t1)
        l0 = ((((t0 >> ((c0 & 3) * 8)) & 0xFF) ^ 0x80) | 0x4B000000).to(tl.float32, bitcast=True) - 8388736.0
        l1 = ((((t1 >> ((c1 & 3) * 8)) & 0xFF) ^ 0x80) | 0x4B000000).to(tl.float32, bitcast=True) - 8388736.0
        v0 = l0 * d0
        v1 = l1 * d1
    else:  # Q6_K, Q3_K: (c - bias)(d sc), signed bytes sc of 16-element sub-blocks 4q..4q+3
        tl.static_assert(QTYPE == 14 or QTYPE == 11, "dequant_pair: unsupported quant type")
        if QTYPE == 14:
            bias = 8388640.0  # 2^23 + 32
        else:
            bias = 8388612.0  # 2^23 + 4
        w = tl.load(sub + rows * KQ + q)
        d = tl.load(scale + rows * (KQ // 4) + q // 4).to(tl.float32)
        # (byte ^ 0x80) is the signed byte + 128, so subtracting 2^23 + 128 gives the signed value.
        dl_a = d * (((((w >> 0) & 0xFF) ^ 0x80) | 0x4B000000).to(tl.float32, bitcast=True) - 8388736.0)
        dl_b = d * (((((w >> 8) & 0xFF) ^ 0x80) | 0x4B000000).to(tl.float32, bitcast=True) - 8388736.0)
        dl_c = d * (((((w >> 16) & 0xFF) ^ 0x80) | 0x4B000000).to(tl.float32, bitcast=True) - 8388736.0)
        dl_d = d * (((((w >> 24) & 0xFF) ^ 0x80) | 0x4B000000).to(tl.float32, bitcast=True) - 8388736.0)
        lo = lane < 16
        v0 = ((c0 | 0x4B000000).to(tl.float32, bitcast=True) - bias) * tl.where(lo, dl_a, dl_b)
        v1 = ((c1 | 0x4B000000).to(tl.float32, bitcast=True) - bias) * tl.where(lo, dl_c, dl_d)
    return v0, v1


@triton.jit
def x_planes(x_cols, q, lane_k, cols_ok, K, EVEN_K: tl.constexpr):
    """The x^T rows that meet pair q's two planes: x_cols [1, BM] points at each column's first element (one
    column a token), cols_ok [1, BM] masks the columns, lane_k = arange(0, 32); -> ([32, BM], [32, BM]) of
    elements 64q + lane_k and 64q + 32 + lane_k, zero past K (checked unless EVEN_K)."""
    k0 = (q * 64 + lane_k)[:, None]  # [32, 1]
    if EVEN_K:
        xa = tl.load(x_cols + k0, mask=cols_ok, other=0.0)  # [32, BM]
        xb = tl.load(x_cols + k0 + 32, mask=cols_ok, other=0.0)
    else:
        xa = tl.load(x_cols + k0, mask=cols_ok & (k0 < K), other=0.0)
        xb = tl.load(x_cols + k0 + 32, mask=cols_ok & (k0 + 32 < K), other=0.0)
    return xa, xb


# ----------------------------------------------------------------------------------- dequantising kernel


@triton.jit
def _dequant_kernel(
    out_ptr,  # [lead, N, K] (any strides but unit along K): row r of the weight is (r // N, r % N)
    codes,
    high,
    sub,
    scale,
    R,
    K,
    KQ,
    N,
    stride_ol,
    stride_on,
    QTYPE: tl.constexpr,
    BLOCK_R: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    """Writes rows [pid * BLOCK_R, +BLOCK_R) of the decoded weight, one pair per step."""
    offs_r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)  # [BLOCK_R]
    rows = (offs_r % R).to(tl.int64)[:, None]  # [BLOCK_R, 1]
    lane = tl.arange(0, 32)[None, :]  # [1, 32]
    out_rows = out_ptr + (rows // N) * stride_ol + (rows % N) * stride_on  # [BLOCK_R, 1]
    for q in range(0, KQ):
        v0, v1 = dequant_pair(QTYPE, codes, high, sub, scale, rows, q, lane, KQ)
        k0 = q * 64 + lane
        ok = offs_r[:, None] < R
        tl.store(out_rows + k0, round_to(v0, out_ptr.dtype.element_ty, INTERPRET), mask=ok & (k0 < K))
        tl.store(out_rows + k0 + 32, round_to(v1, out_ptr.dtype.element_ty, INTERPRET), mask=ok & (k0 + 32 < K))


def dequantize_triton(pw: PackedWeight, dtype: torch.dtype = torch.float32,
                      out: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """Dense [*lead, N, K] `dtype` tensor decoded by the kernels' decoder, in one launch (``pw.dequantize(dtype)``
    bit for bit in the interpreter; on the GPU code x scale - min may be one FMA, one rounding fewer). ``out``:
    write into this tensor of that shape and dtype instead (unit stride along K, any other strides of up to three
    dimensions: a slice of a larger buffer)."""
    shape = tuple(pw.shape)
    if out is None:
        out = torch.empty(shape, dtype=dtype, device=pw.device)
    elif tuple(out.shape) != shape or out.dtype != dtype or out.stride(-1) != 1 or (out.dim() > 3
                                                                                   and not out.is_contiguous()):
        raise ValueError(f"out must be {shape} of {dtype}, unit stride along K (contiguous beyond 3 dims), got "
                         f"{tuple(out.shape)} {out.dtype} strides {out.stride()}")  # fmt: skip
    if pw.is_dense:
        return out.copy_(pw.codes)
    rows = math.prod(shape[:-1])
    if rows == 0:
        return out
    N, K = shape[-2] if len(shape) > 1 else 1, shape[-1]
    view = out.view(-1, N, K) if out.dim() != 3 else out  # [lead, N, K]
    block_r = 32
    _dequant_kernel[(triton.cdiv(rows, block_r),)](
        view, *pw.kernel_args(), rows, K, pw.kq, N, view.stride(0), view.stride(1), QTYPE=int(pw.qtype),
        BLOCK_R=block_r, INTERPRET=interpreting(), num_warps=4,
    )  # fmt: skip
    return out


# ----------------------------------------------------------------------------------- row lookups (embeddings)


@triton.jit
def _rows_kernel(
    out_ptr,  # [T, K] (unit stride along K)
    ids_ptr,  # [T] the weight row each output row holds
    codes,
    high,
    sub,
    scale,
    N,
    K,
    KQ,
    stride_ot,
    QTYPE: tl.constexpr,
    P: tl.constexpr,  # pairs a program (a power of two)
    INTERPRET: tl.constexpr,
):
    """Writes pairs [pid_1 * P, +P) of output row pid_0: the decoded weight row its id names, all P pairs' loads
    issued together (a lookup of one token is one or two programs, a single memory round trip)."""
    t = tl.program_id(0)
    # an id outside [0, N) reads the nearest row rather than memory past the weight (the engine checks ids first)
    row = tl.minimum(tl.maximum(tl.load(ids_ptr + t).to(tl.int64), 0), N - 1)
    q = tl.program_id(1) * P + tl.arange(0, P)[:, None]  # [P, 1]
    lane = tl.arange(0, 32)[None, :]  # [1, 32]
    v0, v1 = dequant_pair(QTYPE, codes, high, sub, scale, row, tl.minimum(q, KQ - 1), lane, KQ)  # [P, 32] each
    k0 = q * 64 + lane  # [P, 32]
    dst = out_ptr + t.to(tl.int64) * stride_ot
    tl.store(dst + k0, round_to(v0, out_ptr.dtype.element_ty, INTERPRET), mask=(q < KQ) & (k0 < K))
    tl.store(dst + k0 + 32, round_to(v1, out_ptr.dtype.element_ty, INTERPRET), mask=(q < KQ) & (k0 + 32 < K))


def dequantize_rows(pw: PackedWeight, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows ids [T] of an [N, K] weight decoded by the kernels' decoder, dense [T, K] in ``dtype``, in one launch:
    an embedding lookup (``pw.dequantize(dtype)[ids]``, as dequantize_triton's values). No host synchronisation:
    ids are not checked here, and one outside [0, N) reads the nearest row."""
    if len(pw.shape) != 2:
        raise ValueError(f"row lookups need an [N, K] weight, got shape {pw.shape}")
    N, K = pw.shape
    T = ids.numel()
    if pw.is_dense:
        return pw.codes[ids].to(dtype)
    out = torch.empty(T, K, dtype=dtype, device=pw.device)  # [T, K]
    if T == 0:
        return out
    p = min(triton.next_power_of_2(pw.kq), 32)  # 2,048 values a program at most
    _rows_kernel[(T, triton.cdiv(pw.kq, p))](
        out, ids.reshape(-1), *pw.kernel_args(), N, K, pw.kq, out.stride(0), QTYPE=int(pw.qtype), P=p,
        INTERPRET=interpreting(), num_warps=4,
    )  # fmt: skip
    return out
