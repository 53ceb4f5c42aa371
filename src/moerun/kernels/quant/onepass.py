"""Decode path "onepass" of the quantized fused MoE: both GEMMs in one launch, no program waiting for another.

gemv_v2 runs GEMM 1 and GEMM 2 as two launches: GEMM 2 needs a slot's whole intermediate row, so it starts only
after every GEMM 1 program has finished, and at a few tokens each launch is mostly ramp-up and tail. Here the
down projection is split along its inputs instead. Program (pair, chunk) takes BLOCK_N rows of gate and up of
its pair's expert over all of x (int8 x, dp4a: int8_dot.py), rounds SiLU(gate) * up for those rows to int8 as
gemv_v2's ``inter_q8`` does (a scale per 32, sums of 16), and multiplies them at once by the matching BLOCK_N
input columns of the down projection: all H output rows, BLOCK_N2 rows a step, times the pair's routing weight,
added into out [T, H] float32 by atomics. The program's intermediate goes through a scratch row that only it
reads (after a block barrier), so nothing orders the programs: the launch boundary between the GEMMs and GEMM 2's
own ramp-up are gone. The cost: out must be zero before the launch (the caller's, or a memset here), a
token's H sums take k x I / BLOCK_N atomic adds each (96 at the 30B shape and BLOCK_N 64), in no fixed order
(float32 sums that may differ run to run in the last bits), and the output stays float32.

A chunk covers whole groups of both weight types (pairs of 64 inputs for the 4-bit types, half pairs of Q6_K,
Q3_K, Q2_K inside whole pairs), so BLOCK_N is a multiple of 64. Every type gemv_v2 reads with int8 x is read.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moerun.kernels.fused_moe import _silu_mul
from moerun.kernels.pdl import launch_dependents, launch_options, quant_pdl_mode, wait_for_previous
from moerun.kernels.quant.gemv_v2 import (
    PartTables, RowsOf, _gemm1_chunk, chunking, group_elems, part_arrays, part_bases, positions_per_word,
    v2_supported, words_per_group,
)
from moerun.kernels.quant.int8_dot import Int8Rows, emulate_dp4a, q8_dot, quantize_store, quantize_x, xq_tiles
from moerun.kernels.quant.repack import PackedWeight
from moerun.kernels.tile_configs import Config

CHUNK = 64  # BLOCK_N is a multiple of this: whole groups of every packed type, in both projections


@triton.jit
def _onepass_kernel(
    x_ptr,  # [T, H] (its dtype only: the intermediate is rounded to it, as the reference's is)
    xq_ptr,  # [T, H_pad / 4] int32: x rounded to int8 (int8_dot.quantize_x)
    xs_ptr,  # [T, H_pad / 16] float32
    dx_ptr,  # [T, H_pad / 32] float32
    ids_ptr,  # [T*k]
    topk_w_ptr,  # [T*k]
    iq_ptr,  # [T*k, I_pad / 4] int32 scratch: each program's slice of the intermediate as int8 (Int8Rows)
    id_ptr,  # [T*k, I_pad / 32] float32 scratch: its scales
    is_ptr,  # [T*k, I_pad / 16] float32 scratch: its sums of 16
    out_ptr,  # [T, H] float32, zero on entry: the weighted sum over the k slots
    gc, gh, gs, gd,  # gate arrays (codes / high as int32 words)
    uc, uh, us, ud,  # up arrays
    wc, wh, ws, wd,  # down arrays
    gt, ut, wt,  # INDIRECT: [E, 4] int64 addresses of each expert's gate / up / down arrays (else dummies)
    top_k,
    H,
    I,  # noqa: E741
    G_ROWS,  # rows per expert of the packed tensor holding gate, and gate's first row in it
    G_OFF,
    U_ROWS,
    U_OFF,
    KQ,  # pairs per row of gate / up (padded H / 64)
    KQ2,  # pairs per row of down (padded I / 64)
    X_WORDS,  # words per row of gate / up
    stride_xt,
    stride_st,
    stride_dt,
    stride_it,
    stride_idt,
    stride_ist,
    stride_ot,
    QT: tl.constexpr,  # gate / up type
    QW: tl.constexpr,  # down type
    WPG: tl.constexpr,  # words per group of gate / up
    WPG2: tl.constexpr,  # words per group of down
    BLOCK_N: tl.constexpr,  # intermediate rows (down's inputs) a program, a multiple of CHUNK
    BLOCK_G: tl.constexpr,  # GEMM 1's chunking of H (gemv_v2.chunking)
    FULL: tl.constexpr,
    REM: tl.constexpr,
    LOG_BG: tl.constexpr,
    G2: tl.constexpr,  # down groups a program: BLOCK_N / group_elems(down)
    BLOCK_N2: tl.constexpr,  # output rows a step of the down product
    H_STEPS: tl.constexpr,  # cdiv(H, BLOCK_N2)
    STAGES: tl.constexpr = 1,  # > 1: both loops pipelined that deep (num_stages); 1: unrolled
    INDIRECT: tl.constexpr = False,
    EMULATE_DP4A: tl.constexpr = False,
    PDL: tl.constexpr = 0,  # kernels/pdl.py (the routing and x come from earlier kernels: nothing before the wait)
):  # fmt: skip
    launch_dependents(PDL)
    wait_for_previous(PDL)
    slot = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(ids_ptr + slot).to(tl.int64)
    weight = tl.load(topk_w_ptr + slot).to(tl.float32)
    token = (slot // top_k).to(tl.int64)
    # GEMM 1: BLOCK_N rows of gate and up over all of x.
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    ok = offs_n < I
    n = tl.where(ok, offs_n, 0).to(tl.int64)
    if INDIRECT:
        gc, gh, gs, gd = part_bases(gt, expert, gc, gh, gs, gd)
        uc, uh, us, ud = part_bases(ut, expert, uc, uh, us, ud)
        wc, wh, ws, wd = part_bases(wt, expert, wc, wh, ws, wd)
        rows_g = G_OFF + n  # [BLOCK_N]
        rows_u = U_OFF + n
        first_down = 0
    else:
        rows_g = expert * G_ROWS + G_OFF + n  # [BLOCK_N]
        rows_u = expert * U_ROWS + U_OFF + n
        first_down = expert * H
    xq_row = xq_ptr + token * stride_xt
    xs_row = xs_ptr + token * stride_st
    dx_row = dx_ptr + token * stride_dt
    acc_g = tl.zeros([BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_N], dtype=tl.float32)
    if STAGES > 1:  # a loop whose loads Triton's pipeliner issues STAGES - 1 chunks ahead, through shared memory
        for c in tl.range(0, FULL, num_stages=STAGES):
            dg, du = _pair_sums(QT, WPG, xq_row, xs_row, dx_row, gc, gh, gs, gd, uc, uh, us, ud, rows_g, rows_u, ok,
                                c * BLOCK_G + tl.arange(0, BLOCK_G), KQ, EMULATE_DP4A)  # fmt: skip
            acc_g += dg
            acc_u += du
    else:  # unrolled: every chunk's loads may be in flight at once, held in registers
        for c in tl.static_range(FULL):
            dg, du = _gemm1_chunk(QT, WPG, xq_row, xq_row, xs_row, dx_row, H, X_WORDS, gc, gh, gs, gd, uc, uh, us,
                                  ud, rows_g, rows_u, ok, c * BLOCK_G, BLOCK_G, KQ, True, False, True,
                                  EMULATE_DP4A)  # fmt: skip
            acc_g += dg
            acc_u += du
    for b in tl.static_range(LOG_BG):
        if (REM >> b) & 1:
            dg, du = _gemm1_chunk(QT, WPG, xq_row, xq_row, xs_row, dx_row, H, X_WORDS, gc, gh, gs, gd, uc, uh, us,
                                  ud, rows_g, rows_u, ok, FULL * BLOCK_G + (REM & ((1 << b) - 1)), 1 << b, KQ, True,
                                  False, True, EMULATE_DP4A)  # fmt: skip
            acc_g += dg
            acc_u += du
    # Rounded to the activation dtype, as the reference's intermediate is, then to int8 into the scratch row.
    act = tl.where(ok, _silu_mul(acc_g, acc_u), 0.0).to(x_ptr.dtype.element_ty).to(tl.float32)  # [BLOCK_N]
    i_row = iq_ptr + slot.to(tl.int64) * stride_it
    s_row = is_ptr + slot.to(tl.int64) * stride_ist
    d_row = id_ptr + slot.to(tl.int64) * stride_idt
    quantize_store(act, BLOCK_N, pid_n * BLOCK_N, i_row, d_row, s_row, KQ2 * 64)
    tl.debug_barrier()  # the slice's words, written by all of the program's threads, are read by all of them
    # GEMM 2 over this slice's inputs: every output row, BLOCK_N2 a step, added into out.
    gi = pid_n * G2 + tl.arange(0, G2)  # [G2] down groups of the slice
    g4 = gi[None, None, :, None]  # [1, 1, G2, 1]
    g3 = gi[None, None, :]  # [1, 1, G2]
    j4 = tl.arange(0, WPG2)[None, None, None, :]  # [1, 1, 1, WPG2]
    xa, xb, da, db, X0, X1 = xq_tiles(QW, i_row, d_row, s_row, g4, j4, g3)
    o_row = out_ptr + token * stride_ot
    if STAGES > 1:
        for step in tl.range(0, H_STEPS, num_stages=STAGES):
            _down_step(QW, wc, wh, ws, wd, first_down, step * BLOCK_N2 + tl.arange(0, BLOCK_N2), H, g4, g3, j4, KQ2,
                       xa, xb, da, db, X0, X1, weight, o_row, EMULATE_DP4A)  # fmt: skip
    else:
        for step in tl.static_range(H_STEPS):
            _down_step(QW, wc, wh, ws, wd, first_down, step * BLOCK_N2 + tl.arange(0, BLOCK_N2), H, g4, g3, j4, KQ2,
                       xa, xb, da, db, X0, X1, weight, o_row, EMULATE_DP4A)  # fmt: skip


@triton.jit
def _pair_sums(QT: tl.constexpr, WPG: tl.constexpr, xq_row, xs_row, dx_row, gc, gh, gs, gd, uc, uh, us, ud, rows_g,
               rows_u, ok, gi, KQ, EMULATE_DP4A: tl.constexpr):  # fmt: skip
    """(gate, up) partial sums [BLOCK_N] of the rows over groups gi [G] (a run-time range) against int8 x."""
    g4 = gi[None, None, :, None]  # [1, 1, G, 1]
    g3 = gi[None, None, :]  # [1, 1, G]
    j4 = tl.arange(0, WPG)[None, None, None, :]  # [1, 1, 1, WPG]
    xa, xb, da, db, X0, X1 = xq_tiles(QT, xq_row, dx_row, xs_row, g4, j4, g3)
    ok4, ok3 = ok[:, None, None, None], ok[:, None, None]
    dg = q8_dot(QT, gc, gh, gs, gd, rows_g[:, None, None, None], rows_g[:, None, None], g4, g3, j4, KQ, ok4, ok3, xa,
                xb, da, db, X0, X1, EMULATE_DP4A)  # fmt: skip
    du = q8_dot(QT, uc, uh, us, ud, rows_u[:, None, None, None], rows_u[:, None, None], g4, g3, j4, KQ, ok4, ok3, xa,
                xb, da, db, X0, X1, EMULATE_DP4A)  # fmt: skip
    return tl.sum(dg, axis=1), tl.sum(du, axis=1)  # [BLOCK_N] each


@triton.jit
def _down_step(QW: tl.constexpr, wc, wh, ws, wd, first_down, offs_h, H, g4, g3, j4, KQ2, xa, xb, da, db, X0, X1,
               weight, o_row, EMULATE_DP4A: tl.constexpr):  # fmt: skip
    """Output rows offs_h [BLOCK_N2] of the down projection over the program's slice (its groups g4 / g3 and int8
    tiles), times the routing weight, added into the token's output row."""
    ok_h = offs_h < H
    rows = first_down + tl.where(ok_h, offs_h, 0).to(tl.int64)  # [BLOCK_N2]
    part = q8_dot(QW, wc, wh, ws, wd, rows[:, None, None, None], rows[:, None, None], g4, g3, j4, KQ2,
                  ok_h[:, None, None, None], ok_h[:, None, None], xa, xb, da, db, X0, X1, EMULATE_DP4A)  # fmt: skip
    tl.atomic_add(o_row + offs_h, tl.sum(part, axis=1) * weight, mask=ok_h, sem="relaxed")


def onepass_supported(gate: PackedWeight, up: PackedWeight, down: PackedWeight) -> bool:
    """Whether the onepass kernel reads these parts: gemv_v2's types (gate and up alike), each padded row a whole
    number of chunks."""
    return v2_supported(gate, up, down) and down.k_pad % CHUNK == 0


def check_onepass_config(cfg: Config) -> None:
    """Raises unless cfg's tiles fit the kernel: BLOCK_N a power of two, a multiple of CHUNK."""
    bn = cfg["BLOCK_N"]
    if bn % CHUNK or bn & (bn - 1):
        raise ValueError(f"the onepass path takes BLOCK_N a power of two and a multiple of {CHUNK}, got {bn}")


def fused_moe_onepass(x: torch.Tensor, gate: RowsOf, up: RowsOf, w2: PackedWeight, weights: torch.Tensor,
                      ids: torch.Tensor, cfg: Config, tables: PartTables | None = None,
                      x_int8: Int8Rows | None = None, out: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """The onepass path: x [T, H], routing [T, k] -> [T, H] float32. ``out``: a float32
    [T, H] buffer that is zero (the sums are added to it), else one is zeroed here. ``tables``, ``x_int8`` as in
    gemv_v2.fused_moe_gemv_v2."""
    check_onepass_config(cfg)
    if ids.dtype != torch.int32 or not ids.is_contiguous():
        ids = ids.to(torch.int32).contiguous()
    (gw, g_off), (uw, u_off) = gate, up
    T, H = x.shape
    I, i_pad = w2.k, w2.k_pad  # noqa: E741
    k = ids.shape[1]
    slots = T * k
    if out is None:
        out = torch.zeros(T, H, dtype=torch.float32, device=x.device)
    elif out.shape != (T, H) or out.dtype != torch.float32 or out.stride(1) != 1:
        raise ValueError(f"out must be a float32 [{T}, {H}] buffer with unit column stride")
    usable = x_int8 is not None and x_int8.k_pad == gw.k_pad and x_int8.xq.shape[0] == T
    xq, dx, xs = x_int8 if usable else quantize_x(x, gw.k_pad)
    inter = Int8Rows.empty(slots, i_pad, x.device)  # [T*k, I_pad / 4], ...: each program writes and reads its slice
    bn = cfg["BLOCK_N"]
    while i_pad % bn:  # a slice never reaches past the padded row (i_pad is a multiple of 256)
        bn //= 2
    bn2 = min(cfg["BLOCK_N2"], triton.next_power_of_2(H))
    pdl = quant_pdl_mode(x.device, T)
    dummy = ids
    _onepass_kernel[(slots, triton.cdiv(I, bn))](
        x, xq, xs, dx, ids.reshape(-1), weights.reshape(-1).contiguous(), *inter, out, *part_arrays(gw),
        *part_arrays(uw), *part_arrays(w2), *(tables if tables else (dummy, dummy, dummy)), k, H, I, gw.n, g_off,
        uw.n, u_off, gw.kq, w2.kq, gw.k_pad // positions_per_word(gw.qtype), xq.stride(0), xs.stride(0), dx.stride(0),
        *(t.stride(0) for t in inter), out.stride(0), QT=int(gw.qtype), QW=int(w2.qtype),
        WPG=words_per_group(gw.qtype), WPG2=words_per_group(w2.qtype), BLOCK_N=bn,
        **chunking(gw.k_pad // group_elems(gw.qtype), cfg["BLOCK_K"], gw.qtype), G2=bn // group_elems(w2.qtype),
        BLOCK_N2=bn2, H_STEPS=triton.cdiv(H, bn2), STAGES=cfg["num_stages"], INDIRECT=tables is not None,
        EMULATE_DP4A=emulate_dp4a(), num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], PDL=pdl,
        **launch_options(pdl),
    )  # fmt: skip
    return out
