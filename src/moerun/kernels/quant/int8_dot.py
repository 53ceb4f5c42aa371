"""Integer dot products for the quantized decode kernels: x quantized to int8 per 32 values, then four weight
codes times four x values per instruction (dp4a), as llama.cpp's mmvq does.

The float path of gemv_v2 spends about three instructions a weight (mask, subtract, FMA) and holds x as float32
tiles in registers. Here x [T, K] becomes, once per call (one launch, `quantize_x`):
  xq  int32 [T, K_pad / 4]   four int8 values a word, element order: word m holds elements 4m .. 4m + 3
  dx  float32 [T, K_pad / 32]  the scale of each 32-element block: x ~ dx * xq, dx = max |x| / 127
  xs  float32 [T, K_pad / 16]  sums of every 16 consecutive values of x^ = dx * xq (the min / code-bias terms)
A weight word's four code bytes (Q4_K: a nibble plane masked out; Q6_K: the merged 6-bit codes; Q8_0: the
bytes, sign restored) meet the x word of the same four elements in one dp4a, so a Q4_K word of eight weights
costs two logic operations and two dp4a; an IQ4_NL / IQ4_XS / MXFP4 word's codes become two words of signed
levels by byte permutes first (iq4_levels.py). Sub-block scales are applied per group as in gemv_v2:
  Q4_K  d sc dx sum(c xq) - dmin mn X      Q6_K  d sc (dx sum(c xq) - 32 X)      Q8_0  d dx sum((c - 128) xq)
  IQ4_NL, MXFP4  d dx sum(level(c) xq)     IQ4_XS  (d sc) dx sum(level(c) xq)
  Q4_0 / Q5_0  d (dx sum(c xq) - 8 / 16 X)  Q4_1 / Q5_1  d dx sum(c xq) + m X
  Q3_K  d sc (dx sum(c xq) - 4 X)           Q2_K  d sc dx sum(c xq) - dmin mn X
(X the sum of x^ over the elements a scale covers: 16 for Q6_K, Q3_K and Q2_K, 32 for the others).
The kernels compute W x^ exactly (to float32 rounding): it differs from W x by x's rounding to int8, at most half
a step of its block's scale per element, which is what llama.cpp's CUDA decode computes too (q8_1 activations).
In Triton's interpreter, and on GPUs other than NVIDIA's (whose PTX this inline assembly is), dp4a is emulated
with shifts (constexpr EMULATE_DP4A); on NVIDIA GPUs it is the instruction.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from moerun.kernels.interpreter import interpreting
from moerun.kernels.pdl import launch_dependents, launch_options, quant_pdl_mode, wait_for_previous
from moerun.kernels.quant.group_scales import (
    block32_scales, iq4_xs_scales, pair_codes, q2_k_scales, q3_k_codes, q4_k_scales, q6_k_codes, q6_k_scales,
)
from moerun.kernels.quant.iq4_levels import iq4_levels

X_BLOCK = 32  # x values per int8 scale


class Int8Rows(NamedTuple):
    """Rows of x rounded to int8 as the kernels read them (quantize_x's output; the module docstring's layout)."""

    xq: torch.Tensor  # int32 [T, k_pad / 4], four int8 values a word
    dx: torch.Tensor  # float32 [T, k_pad / 32]
    xs: torch.Tensor  # float32 [T, k_pad / 16]

    @property
    def k_pad(self) -> int:
        return self.xq.shape[1] * 4

    def store_args(self) -> dict:
        """The keyword arguments of a kernel that also writes its output rows as int8 (quantize_store_row)."""
        return {"xq_ptr": self.xq, "dx_ptr": self.dx, "xs_ptr": self.xs, "K_PAD": self.k_pad, "Q8": True}

    @classmethod
    def empty(cls, T: int, k_pad: int, device: torch.device, zeros: bool = False) -> Int8Rows:
        """Uninitialised (or zeroed) rows for T rows of k_pad values."""
        new = torch.zeros if zeros else torch.empty
        return cls(new(T, k_pad // 4, dtype=torch.int32, device=device),
                   new(T, k_pad // X_BLOCK, dtype=torch.float32, device=device),
                   new(T, k_pad // 16, dtype=torch.float32, device=device))  # fmt: skip


def check_k_pad(k_pad: int, cols: int) -> None:
    """Raises unless k_pad is a whole number of 256-value super-blocks covering a row of cols values."""
    if k_pad % 256 or k_pad < cols:
        raise ValueError(f"k_pad must be a multiple of 256 covering the {cols} columns, got {k_pad}")


@triton.jit
def dp4a(a, b, EMULATE_DP4A: tl.constexpr):
    """Sum over the four bytes of int32 a and b of their products as signed int8: int32, elementwise."""
    if EMULATE_DP4A:  # no PTX inline assembly: the interpreter, or a GPU that is not NVIDIA's
        s = ((a << 24) >> 24) * ((b << 24) >> 24)
        s += ((a << 16) >> 24) * ((b << 16) >> 24)
        s += ((a << 8) >> 24) * ((b << 8) >> 24)
        s += (a >> 24) * (b >> 24)
        return s
    return tl.inline_asm_elementwise("dp4a.s32.s32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, tl.zeros_like(a)],
                                     dtype=tl.int32, is_pure=True, pack=1)  # fmt: skip


@triton.jit
def quantize_store(v, BLOCK: tl.constexpr, start, xq_row, dx_row, xs_row, end):
    """Quantize v [BLOCK] float32, the values of elements start + [0, BLOCK) of a row (start a multiple of 32), and
    store their int8 words at xq_row, block scales at dx_row and the sums of 16 of x^ at xs_row, for the elements
    before ``end`` (the row's K_PAD, or less where another program writes the rest; a multiple of 32)."""
    blocks = tl.reshape(v, [BLOCK // 32, 32])  # [B, 32]
    amax = tl.max(tl.abs(blocks), axis=1)  # [B]
    d = amax / 127.0
    inv = tl.where(amax > 0, 127.0 / tl.maximum(amax, 1e-30), 0.0)
    scaled = blocks * inv[:, None]
    q = (scaled + tl.where(scaled >= 0, 0.5, -0.5)).to(tl.int32)  # round half away from zero, |q| <= 127
    quads = tl.reshape(q & 0xFF, [BLOCK // 4, 4])  # [BLOCK / 4, 4] bytes
    word = tl.sum(quads << (8 * tl.arange(0, 4))[None, :], axis=1)  # disjoint bits: the sum is the or
    offs_w = start // 4 + tl.arange(0, BLOCK // 4)
    tl.store(xq_row + offs_w, word, mask=offs_w * 4 < end)
    offs_d = start // 32 + tl.arange(0, BLOCK // 32)
    tl.store(dx_row + offs_d, d, mask=offs_d * 32 < end)
    halves = tl.sum(tl.reshape(q, [BLOCK // 32, 2, 16]), axis=2).to(tl.float32) * d[:, None]  # [B, 2]
    offs_s = start // 16 + tl.arange(0, BLOCK // 16)
    tl.store(xs_row + offs_s, tl.reshape(halves, [BLOCK // 16]), mask=offs_s * 16 < end)


@triton.jit
def quantize_store_row(v, BLOCK: tl.constexpr, start, xq_ptr, dx_ptr, xs_ptr, row, K_PAD: tl.constexpr, end):
    """quantize_store into row `row` of Int8Rows arrays of K_PAD values a row (Int8Rows.store_args)."""
    quantize_store(v, BLOCK, start, xq_ptr + row * (K_PAD // 4), dx_ptr + row * (K_PAD // 32),
                   xs_ptr + row * (K_PAD // 16), end)  # fmt: skip


@triton.jit
def _quantize_x_kernel(
    x_ptr,  # [T, K]
    xq_ptr,  # [T, K_PAD / 4] int32
    dx_ptr,  # [T, K_PAD / 32] float32
    xs_ptr,  # [T, K_PAD / 16] float32
    K,
    K_PAD,
    stride_xt,
    stride_qt,
    stride_dt,
    stride_st,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr = 0,  # kernels/pdl.py
):  # fmt: skip
    launch_dependents(PDL)
    wait_for_previous(PDL)
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK] elements
    v = tl.load(x_ptr + t * stride_xt + offs, mask=offs < K, other=0.0).to(tl.float32)
    quantize_store(v, BLOCK, tl.program_id(1) * BLOCK, xq_ptr + t * stride_qt, dx_ptr + t * stride_dt,
                   xs_ptr + t * stride_st, K_PAD)


@triton.jit
def xq_tiles(QT: tl.constexpr, xq_row, dx_row, xs_row, g4, j4, g3):
    """x of one token for groups g4 [1, 1, G, 1] / g3 [1, 1, G], words j4 [1, 1, 1, WPG] of a weight type QT
    (groups as in gemv_v2): (xa, xb) the int8 words meeting plane 0 / 1 codes [1, 1, G, WPG], (da, db) their
    block scales and (X0, X1) the plane sums of x^ [1, 1, G]. Q8_0 uses xa, da only."""
    if QT == 8:  # block g: elements 32g + 4j + b
        xa = tl.load(xq_row + 8 * g4 + j4)
        xb = xa
        da = tl.load(dx_row + g3)
        db = da
        X0 = da
        X1 = da
    elif not ((QT == 14 or QT == 10) or QT == 11):  # a pair g (8 words): plane p holds elements 64g + 32p + 4j + b
        xa = tl.load(xq_row + 16 * g4 + j4)
        xb = tl.load(xq_row + 16 * g4 + 8 + j4)
        da = tl.load(dx_row + 2 * g3)
        db = tl.load(dx_row + 2 * g3 + 1)
        X0 = tl.load(xs_row + 4 * g3) + tl.load(xs_row + 4 * g3 + 1)
        X1 = tl.load(xs_row + 4 * g3 + 2) + tl.load(xs_row + 4 * g3 + 3)
    else:  # Q6_K, Q3_K, Q2_K group (q, h) = (g // 2, g % 2): plane p holds elements 64q + 32p + 16h + 4j + b
        first = 16 * (g4 // 2) + 4 * (g4 % 2)
        xa = tl.load(xq_row + first + j4)
        xb = tl.load(xq_row + first + 8 + j4)
        da = tl.load(dx_row + 2 * (g3 // 2))
        db = tl.load(dx_row + 2 * (g3 // 2) + 1)
        first3 = 4 * (g3 // 2) + g3 % 2
        X0 = tl.load(xs_row + first3)
        X1 = tl.load(xs_row + first3 + 2)
    return xa, xb, da, db, X0, X1


@triton.jit
def q8_dot(QT: tl.constexpr, codes, high, sub, scale, rows4, rows3, g4, g3, j4, KQ, ok4, ok3, xa, xb, da, db, X0,
           X1, EMULATE_DP4A: tl.constexpr):  # fmt: skip
    """Sums over the chunk's groups of each row's weights times int8 x (xq_tiles): [R0, R1] float32 (every packed
    type: gemv_v2.V2_TYPES). Arguments as gemv_v2._v2_dot's: rows4 / rows3 row indices, g4 / g3 groups, j4
    words, ok4 / ok3 row masks."""
    if QT == 8:  # Q8_0: codes c + 128; xor 0x80 per byte gives c as a signed byte
        w = tl.load(codes + rows4 * (KQ * 16) + g4 * 8 + j4, mask=ok4, other=0)  # [R0, R1, G, 8]
        isum = tl.sum(dp4a(w ^ -0x7F7F7F80, tl.broadcast_to(xa, w.shape), EMULATE_DP4A), axis=3)  # [R0, R1, G]
        d = tl.load(scale + rows3 * (KQ * 2) + g3, mask=ok3, other=0.0).to(tl.float32)
        part = (d * da) * isum.to(tl.float32)
    elif (QT == 20 or QT == 23) or QT == 39:  # IQ4_NL / IQ4_XS / MXFP4 pair: low nibbles plane 0, high plane 1
        w = tl.load(codes + rows4 * (KQ * 8) + g4 * 8 + j4, mask=ok4, other=0)  # [R0, R1, G, 8] int32
        l0, l1 = iq4_levels(w, False, EMULATE_DP4A, QT == 39)  # signed levels, four a word
        i0 = tl.sum(dp4a(l0, tl.broadcast_to(xa, w.shape), EMULATE_DP4A), axis=3)  # [R0, R1, G]
        i1 = tl.sum(dp4a(l1, tl.broadcast_to(xb, w.shape), EMULATE_DP4A), axis=3)
        if QT != 23:
            d0, _, d1, _ = block32_scales(QT, scale, rows3, g3, KQ, ok3)  # [R0, R1, G] each
        else:
            d0, d1 = iq4_xs_scales(sub, scale, rows3, g3, KQ, ok3)
        part = d0 * da * i0.to(tl.float32) + d1 * db * i1.to(tl.float32)
    elif (QT == 12 or QT == 13) or ((QT == 2 or QT == 3) or (QT == 6 or QT == 7)):
        # a pair of 4-bit (Q5: + fifth bit) codes, sub-blocks (Q4_K, Q5_K) or blocks (Q4_0 ... Q5_1) of 32
        c0, c1 = pair_codes(QT, codes, high, rows4, g4, j4, KQ, ok4)  # [R0, R1, G, 8] int32 each
        i0 = tl.sum(dp4a(c0, tl.broadcast_to(xa, c0.shape), EMULATE_DP4A), axis=3)  # [R0, R1, G]
        i1 = tl.sum(dp4a(c1, tl.broadcast_to(xb, c0.shape), EMULATE_DP4A), axis=3)
        if QT == 12 or QT == 13:  # c (d sc) - dmin mn
            d, dmin, sc0, sc1, mn0, mn1 = q4_k_scales(sub, scale, rows3, g3, KQ, ok3)  # [R0, R1, G] each
            part = d * (sc0 * da * i0.to(tl.float32) + sc1 * db * i1.to(tl.float32)) - dmin * (mn0 * X0 + mn1 * X1)
        else:
            i0 = da * i0.to(tl.float32)
            i1 = db * i1.to(tl.float32)
            d0, m0, d1, m1 = block32_scales(QT, scale, rows3, g3, KQ, ok3)  # [R0, R1, G] each
            if QT == 3 or QT == 7:  # c d + m
                part = d0 * i0 + m0 * X0 + d1 * i1 + m1 * X1
            else:  # (c - 8) d, (c - 16) d
                bias = 8.0 if QT == 2 else 16.0
                part = d0 * (i0 - bias * X0) + d1 * (i1 - bias * X1)
    else:  # Q6_K, Q3_K, Q2_K half pair (4 words): codes of 16-element sub-blocks, high bits merged into each byte
        tl.static_assert((QT == 14 or QT == 10) or QT == 11, "q8_dot: a type without an int8-x decode")
        if QT == 14:
            c0, c1 = q6_k_codes(codes, high, rows4, g4, j4, KQ, ok4)  # [R0, R1, G, 4] int32 each
        else:
            c0, c1 = q3_k_codes(QT, codes, high, rows4, g4, j4, KQ, ok4)
        i0 = da * tl.sum(dp4a(c0, tl.broadcast_to(xa, c0.shape), EMULATE_DP4A), axis=3).to(tl.float32)  # [R0, R1, G]
        i1 = db * tl.sum(dp4a(c1, tl.broadcast_to(xb, c0.shape), EMULATE_DP4A), axis=3).to(tl.float32)
        if QT == 10:  # Q2_K: c (d sc) - dmin mn
            d, dmin, sc0, sc1, mn0, mn1 = q2_k_scales(sub, scale, rows3, g3, KQ, ok3)  # [R0, R1, G] each
            part = d * (sc0 * i0 + sc1 * i1) - dmin * (mn0 * X0 + mn1 * X1)
        else:  # Q6_K, Q3_K: (c - bias)(d sc), bias 32 / 4
            bias = 32.0 if QT == 14 else 4.0
            d, sc0, sc1 = q6_k_scales(sub, scale, rows3, g3, KQ, ok3)  # [R0, R1, G] each
            part = d * (sc0 * (i0 - bias * X0) + sc1 * (i1 - bias * X1))
    return tl.sum(part, axis=2)


def quantize_x(x: torch.Tensor, k_pad: int) -> Int8Rows:
    """x [T, K] -> (xq int32 [T, k_pad / 4], dx float32 [T, k_pad / 32], xs float32 [T, k_pad / 16]) as the
    module docstring lays them out (K zero-padded to k_pad, a multiple of 256). One launch."""
    T, K = x.shape
    rows = Int8Rows.empty(T, k_pad, x.device)
    block = min(1024, triton.next_power_of_2(k_pad))
    pdl = quant_pdl_mode(x.device, T)
    _quantize_x_kernel[(T, triton.cdiv(k_pad, block))](
        x, *rows, K, k_pad, x.stride(0), *(t.stride(0) for t in rows), BLOCK=block,
        enable_fp_fusion=False,  # rounds as the RMSNorm kernel that can quantize its output does (no fused FMA)
        PDL=pdl, **launch_options(pdl),
    )  # fmt: skip
    return rows


def quantize_x_reference(x: torch.Tensor, k_pad: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Torch reference of quantize_x: (xq int8 [T, k_pad], dx, xs) with xq unpacked, one value per element."""
    T, K = x.shape
    v = torch.zeros(T, k_pad, dtype=torch.float32, device=x.device)
    v[:, :K] = x.float()
    blocks = v.view(T, -1, X_BLOCK)  # [T, k_pad / 32, 32]
    amax = blocks.abs().amax(dim=2)  # [T, k_pad / 32]
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    scaled = blocks * inv[..., None]
    q = torch.trunc(scaled + torch.where(scaled >= 0, 0.5, -0.5))  # [T, k_pad / 32, 32]
    d = amax / 127.0
    sums = q.view(T, -1, 2, 16).sum(dim=3) * d[..., None]  # [T, k_pad / 32, 2]
    return q.to(torch.int8).view(T, k_pad), d, sums.view(T, -1)


def dequantize_xq(xq: torch.Tensor, dx: torch.Tensor) -> torch.Tensor:
    """x^ [T, k_pad] float32 from quantize_x's words and scales: the values the kernels multiply."""
    q = unpack_xq(xq).float()  # [T, k_pad]
    return (q.view(q.shape[0], -1, X_BLOCK) * dx[..., None]).view(q.shape)


def unpack_xq(xq: torch.Tensor) -> torch.Tensor:
    """int32 words [T, n] of quantize_x -> int8 values [T, 4n] in element order."""
    return xq.contiguous().view(torch.int8).view(xq.shape[0], -1)


def emulate_dp4a() -> bool:
    """The EMULATE_DP4A constexpr of the kernels that call dp4a: in Triton's interpreter, or on a ROCm build of
    torch (whose GPUs take no PTX)."""
    return interpreting() or torch.version.hip is not None
