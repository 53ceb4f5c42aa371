"""Decode path of the quantized dense GEMV (attention projections, lm_head): gemv_v2's word loads and per-group
scales (gemv_v2.py) over the rows of one weight, or of two parts of the same K in one launch (q|k and v of a
Q4_K_M file); x read as it is, prepared in the weights' layout, or rounded to int8 (int8_dot.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moerun.kernels.pdl import launch_dependents, launch_options, quant_pdl_mode, wait_for_previous
from moerun.kernels.quant.gemv_v2 import (
    V2_TYPES, check_int8_x, chunking, group_elems, part_arrays, positions_per_word, rows_chunk, words_per_group,
    x_chunk, x_operands,
)
from moerun.kernels.quant.int8_dot import Int8Rows
from moerun.kernels.quant.repack import PackedWeight
from moerun.kernels.tile_configs import Config

# --------------------------------------------------------------------------------------------- device code


@triton.jit
def _matmul_v2_rows(x_row, xp_row, xs_row, dx_row, y_row, bias_ptr, wc, wh, ws, wd, pid_n, N, K, KQ, col_off,
                    X_WORDS, QT: tl.constexpr, WPG: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_G: tl.constexpr, FULL: tl.constexpr, REM: tl.constexpr, LOG_BG: tl.constexpr,
                    EVEN_K: tl.constexpr, XP: tl.constexpr, XQ8: tl.constexpr, EMULATE_DP4A: tl.constexpr):  # fmt: skip
    """Columns col_off + [pid_n * BLOCK_N, +BLOCK_N) of one row of y = x @ W^T for one weight part."""
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    ok = offs_n < N
    rows = tl.where(ok, offs_n, 0).to(tl.int64)
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for c in tl.static_range(FULL):
        gi = c * BLOCK_G + tl.arange(0, BLOCK_G)
        x0, x1, x2, x3, x4, x5, x6, x7, X0, X1 = x_chunk(QT, WPG, x_row, xp_row, xs_row, dx_row, K, X_WORDS, gi,
                                                         EVEN_K, XP, XQ8)  # fmt: skip
        acc += rows_chunk(QT, WPG, wc, wh, ws, wd, rows, ok, c * BLOCK_G, BLOCK_G, KQ,
                          x0, x1, x2, x3, x4, x5, x6, x7, X0, X1, XQ8, EMULATE_DP4A)  # fmt: skip
    for b in tl.static_range(LOG_BG):
        if (REM >> b) & 1:
            gi = FULL * BLOCK_G + (REM & ((1 << b) - 1)) + tl.arange(0, 1 << b)
            x0, x1, x2, x3, x4, x5, x6, x7, X0, X1 = x_chunk(QT, WPG, x_row, xp_row, xs_row, dx_row, K, X_WORDS, gi,
                                                             EVEN_K, XP, XQ8)  # fmt: skip
            acc += rows_chunk(QT, WPG, wc, wh, ws, wd, rows, ok, FULL * BLOCK_G + (REM & ((1 << b) - 1)), 1 << b,
                              KQ, x0, x1, x2, x3, x4, x5, x6, x7, X0, X1, XQ8, EMULATE_DP4A)  # fmt: skip
    if HAS_BIAS:
        acc += tl.load(bias_ptr + col_off + offs_n, mask=ok, other=0.0).to(tl.float32)
    tl.store(y_row + col_off + offs_n, acc.to(y_row.dtype.element_ty), mask=ok)


@triton.jit
def _matmul_v2_kernel(
    x_ptr,  # [M, K]
    xp_ptr,  # [M, K_pad] x position-major (XP), int32 words [M, K_pad / 4] (XQ8), else a dummy
    xs_ptr,  # [M, K_pad / 16] float32 sums of 16 (XP or XQ8; else a dummy)
    dx_ptr,  # [M, K_pad / 32] float32 int8 scales (XQ8; else a dummy)
    y_ptr,  # [M, N_total]; this part writes columns [col_off, col_off + N)
    bias_ptr,  # [N_total] or a dummy
    wc, wh, ws, wd,  # weight arrays (codes / high as int32 words)
    N,
    K,
    KQ,
    col_off,
    X_WORDS,
    stride_xm,
    stride_pm,
    stride_psm,
    stride_pdm,
    stride_ym,
    QT: tl.constexpr,
    WPG: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_G: tl.constexpr,
    FULL: tl.constexpr,
    REM: tl.constexpr,
    LOG_BG: tl.constexpr,
    EVEN_K: tl.constexpr,
    XP: tl.constexpr,  # read x from xp / xs
    XQ8: tl.constexpr = False,  # read x as int8 words (xp), scales (dx) and sums (xs): int8_dot.quantize_x
    EMULATE_DP4A: tl.constexpr = False,
    PDL: tl.constexpr = 0,  # kernels/pdl.py
    # A second part B of the same x in the same launch (HAS_B): programs from PROGS_A on write its columns.
    vc=None, vh=None, vs=None, vd=None,
    N_B=0,
    KQ_B=0,
    col_off_B=0,
    X_WORDS_B=0,
    PROGS_A=0,
    QT_B: tl.constexpr = 0,
    WPG_B: tl.constexpr = 0,
    BLOCK_G_B: tl.constexpr = 1,
    FULL_B: tl.constexpr = 0,
    REM_B: tl.constexpr = 0,
    LOG_BG_B: tl.constexpr = 0,
    HAS_B: tl.constexpr = False,
):  # fmt: skip
    """y = x @ W^T for a few rows of x: one program per (BLOCK_N rows of W, row of x), chunks as in GEMM 1."""
    launch_dependents(PDL)
    wait_for_previous(PDL)
    pid_n = tl.program_id(0)
    m = tl.program_id(1).to(tl.int64)
    x_row = x_ptr + m * stride_xm
    xp_row = xp_ptr + m * stride_pm
    xs_row = xs_ptr + m * stride_psm
    dx_row = dx_ptr + m * stride_pdm
    y_row = y_ptr + m * stride_ym
    if HAS_B:
        if pid_n >= PROGS_A:
            _matmul_v2_rows(x_row, xp_row, xs_row, dx_row, y_row, bias_ptr, vc, vh, vs, vd, pid_n - PROGS_A, N_B, K,
                            KQ_B, col_off_B, X_WORDS_B, QT_B, WPG_B, HAS_BIAS, BLOCK_N, BLOCK_G_B, FULL_B, REM_B,
                            LOG_BG_B, EVEN_K, XP, XQ8, EMULATE_DP4A)  # fmt: skip
            return
    _matmul_v2_rows(x_row, xp_row, xs_row, dx_row, y_row, bias_ptr, wc, wh, ws, wd, pid_n, N, K, KQ, col_off, X_WORDS,
                    QT, WPG, HAS_BIAS, BLOCK_N, BLOCK_G, FULL, REM, LOG_BG, EVEN_K, XP, XQ8, EMULATE_DP4A)


# ------------------------------------------------------------------------------------------------ host side


def matmul_v2_part(x: torch.Tensor, y: torch.Tensor, w: PackedWeight, bias: torch.Tensor | None, col_off: int,
                   cfg: Config, x_int8: Int8Rows | None = None,
                   second: tuple[PackedWeight, int] | None = None) -> None:  # fmt: skip
    """Columns [col_off, col_off + w.n) of y [M, N_total] = x [M, K] @ w^T (+ bias) for a w of V2_TYPES;
    with cfg["x_q8"] x is quantized to int8 first (int8_dot; x_int8 if given), with cfg["x_prep"] read through
    prepare_x. ``second`` = (w_b, col_off_b): another V2_TYPES part of the same K in the same launch, with
    the same config (not x_prep, whose layout depends on the type)."""
    M, K = x.shape
    groups = w.k_pad // group_elems(w.qtype)
    check_int8_x(cfg, w.qtype, *([second[0].qtype] if second is not None else []))
    xp, xs, dx, flags = x_operands(x, w.qtype, w.k_pad, cfg, x_int8)
    pdl = quant_pdl_mode(x.device, M)
    progs = triton.cdiv(w.n, cfg["BLOCK_N"])
    extra: dict = {}
    if second is not None:
        wb, col_b = second
        if cfg.get("x_prep") or wb.k_pad != w.k_pad or wb.qtype not in V2_TYPES:
            raise ValueError("a second part needs a weight of a gemv_v2 type and the same K, and a config without "
                             "x_prep")
        chunks_b = chunking(wb.k_pad // group_elems(wb.qtype), cfg["BLOCK_K"], wb.qtype)
        vc, vh, vs, vd = part_arrays(wb)
        extra = dict(vc=vc, vh=vh, vs=vs, vd=vd, N_B=wb.n, KQ_B=wb.kq, col_off_B=col_b,
                     X_WORDS_B=wb.k_pad // positions_per_word(wb.qtype), PROGS_A=progs, QT_B=int(wb.qtype),
                     WPG_B=words_per_group(wb.qtype), **{f"{key}_B": v for key, v in chunks_b.items()}, HAS_B=True)
        progs += triton.cdiv(wb.n, cfg["BLOCK_N"])
    _matmul_v2_kernel[(progs, M)](
        x, xp, xs, dx, y, y if bias is None else bias, *part_arrays(w), w.n, K, w.kq, col_off,
        w.k_pad // positions_per_word(w.qtype), x.stride(0), xp.stride(0), xs.stride(0), dx.stride(0), y.stride(0),
        QT=int(w.qtype), WPG=words_per_group(w.qtype), HAS_BIAS=bias is not None, BLOCK_N=cfg["BLOCK_N"],
        EVEN_K=w.k_pad == K, **chunking(groups, cfg["BLOCK_K"], w.qtype), num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"], PDL=pdl, **launch_options(pdl), **flags, **extra,
    )  # fmt: skip
