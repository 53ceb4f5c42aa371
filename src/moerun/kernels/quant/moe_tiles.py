"""The tile kernels of the quantized fused MoE (fused_moe_quant.py's tile, tile64 and gemv_dot paths).

Token-slots come sorted by expert and padded (align.py) or, on the gemv_dot path, one slot an M-block (PER_SLOT).
Each program decodes a [BLOCK_N, 64] weight tile a step (tile64: one pair, tile64.py; tile: two [BLOCK_N, 32]
planes, decode.py; grid types: from_groups.py) and multiplies it as the left operand of tl.dot (out^T = W x^T), so
decoded weights never leave registers. GEMM 1 ends in SiLU(gate) * up; GEMM 2 in the routing weights.

With TAIL_M (GEMM 1) or TAIL_M2 (GEMM 2's TAIL_M) above 0, an M-block holding at most that many token-slots (the
last, partly filled block of an expert's run: its pairs come first, its padding last) runs as a tile of that many
rows, as the bf16 kernel's TAIL_M does (kernels/fused_moe.py): the weight decode is the same, the products and the
activation loads of the padding rows are skipped. GEMM 1 leaves the skipped padding rows unwritten; that is safe
for any GEMM 2 block, because an output column of out^T = W inter^T depends on its own intermediate row only and
the outputs of padding rows are masked.

With SPLIT13 (tile64), GEMM 1 runs the gate rows and the up rows of an N-tile in two programs, one accumulator
each, so an M-block can be twice as long in the same registers and a decoded tile serves twice the token-slots;
the second of the two to finish (by a ticket counter) writes silu(gate) * up (_gemm1_half_rows).
"""

from __future__ import annotations

import triton
import triton.language as tl

from moerun.kernels.moe_parts import silu_mul, tail_block, tile_pid
from moerun.kernels.quant.decode import dequant_pair, x_planes
from moerun.kernels.quant.from_groups import group_values64, group_words64
from moerun.kernels.quant.gemv_v2 import part_bases
from moerun.kernels.quant.tile64 import decode_pair64


@triton.jit
def _block_rows(pid_m, sorted_ids_ptr, num_pairs, BLOCK_M: tl.constexpr, ROWS: tl.constexpr, PER_SLOT: tl.constexpr):
    """(flat pair index, validity, row of the intermediate) of the first ROWS columns of M-block pid_m.

    Sorted: the block's rows are sorted positions [pid_m BLOCK_M, pid_m BLOCK_M + ROWS) and the intermediate has one
    row per padded position. PER_SLOT: block pid_m is token-slot pid_m alone (column 0; the others are masked) and
    the intermediate has one row per slot.
    """
    cols = tl.arange(0, ROWS)  # [ROWS]
    if PER_SLOT:
        row_ok = cols == 0
        pair = tl.where(row_ok, pid_m, num_pairs)
        irow = tl.where(row_ok, pid_m, 0)
    else:
        irow = pid_m * BLOCK_M + cols
        pair = tl.load(sorted_ids_ptr + irow)
        row_ok = pair < num_pairs
    return pair, row_ok, irow.to(tl.int64)


# Sizes that follow the token count are not specialised on, so a new batch size reuses the compiled kernel.
@triton.jit(do_not_specialize=["num_pairs", "num_pid_m"])
def gemm1_tile_kernel(
    x_ptr,  # [T, H]
    inter_ptr,  # [P, I] one row per padded sorted position (PER_SLOT: per token-slot)
    sorted_ids_ptr,  # [P]
    block_expert_ptr,  # [P / BLOCK_M] (PER_SLOT: flat topk ids [T*k])
    gc, gh, gs, gd,
    uc, uh, us, ud,
    gt, ut,  # INDIRECT: [E, 4] int64 addresses of each expert's gate / up arrays (else dummies)
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
    PAIRS: tl.constexpr,
    GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr,
    PER_SLOT: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    INDIRECT: tl.constexpr = False,  # experts found through gt / ut; rows count within an expert
    PAIR64: tl.constexpr = False,  # tile64: a whole pair decoded a step (tile64.py; not with PER_SLOT)
    EXPERT_DIV: tl.constexpr = 1,  # runs padded to EXPERT_DIV blocks (GEMM 2's larger BLOCK_M)
    GROUPS: tl.constexpr = False,  # gate and up grid types: gc / uc their GGUF blocks, gh / uh their tables
    TAIL_M: tl.constexpr = 0,  # > 0: blocks of at most TAIL_M pairs run as TAIL_M-row tiles (sorted rows only)
    INTERPRET: tl.constexpr = False,
    scratch_ptr=None,  # SPLIT13: [P, 2I] in the activation dtype, each half's product for its partner
    ticket_ptr=None,  # SPLIT13: [num_pid_m, N-tiles] int32, 0 between launches
    SPLIT13: tl.constexpr = False,  # gate and up in programs of their own (tile64 only; see _gemm1_half_rows)
):  # fmt: skip
    num_pid_n = tl.cdiv(I, BLOCK_N)
    if SPLIT13:  # the gate and the up program of an N-tile side by side in the launch order
        pid_m, pid_n2 = tile_pid(tl.program_id(0), num_pid_m, 2 * num_pid_n, GROUP_M)
        half = pid_n2 % 2
        pid_n = pid_n2 // 2
    else:
        pid_m, pid_n = tile_pid(tl.program_id(0), num_pid_m, num_pid_n, GROUP_M)
        half = 0
    # Unused blocks (past the padded length too) have expert -1.
    expert = tl.load(block_expert_ptr + pid_m // EXPERT_DIV).to(tl.int64)
    if expert < 0:
        return
    if EXPERT_DIV > 1:
        # A block of padding alone (runs put their pairs first): its rows are left unwritten, and GEMM 2 masks
        # the outputs of those rows (each output column depends on its own intermediate row only).
        if tl.load(sorted_ids_ptr + pid_m * BLOCK_M) >= num_pairs:
            return
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    n = (offs_n % I).to(tl.int64)
    if INDIRECT:
        gc, gh, gs, gd = part_bases(gt, expert, gc, gh, gs, gd)
        uc, uh, us, ud = part_bases(ut, expert, uc, uh, us, ud)
        rows_g = (G_OFF + n)[:, None]  # [BLOCK_N, 1]
        rows_u = (U_OFF + n)[:, None]
    else:
        rows_g = (expert * G_ROWS + G_OFF + n)[:, None]  # [BLOCK_N, 1]
        rows_u = (expert * U_ROWS + U_OFF + n)[:, None]
    # a short tile where the block has few pairs (the branch exists only with TAIL_M; a Python False is not a
    # compile-time constant to Triton, hence the row count spelled out in the call)
    tail = False
    if TAIL_M > 0:
        tail = tail_block(sorted_ids_ptr, pid_m * BLOCK_M, num_pairs, BLOCK_M, TAIL_M)
    if SPLIT13:
        tl.static_assert(PAIR64 and not (GROUPS or PER_SLOT), "SPLIT13: the tile64 path of the packed types")
        ticket = ticket_ptr + pid_m * num_pid_n + pid_n
        if tail:
            _gemm1_half_rows(x_ptr, inter_ptr, scratch_ptr, ticket, sorted_ids_ptr, pid_m,
                             TAIL_M if TAIL_M > 0 else BLOCK_M, offs_n, half, rows_g, rows_u, gc, gh, gs, gd, uc, uh,
                             us, ud, num_pairs, top_k, H, I, KQ, stride_xt, stride_it, QG, QU, BLOCK_M, BLOCK_N,
                             DOT_DTYPE, DOT_PRECISION, INTERPRET)  # fmt: skip
        else:
            _gemm1_half_rows(x_ptr, inter_ptr, scratch_ptr, ticket, sorted_ids_ptr, pid_m, BLOCK_M, offs_n, half,
                             rows_g, rows_u, gc, gh, gs, gd, uc, uh, us, ud, num_pairs, top_k, H, I, KQ, stride_xt,
                             stride_it, QG, QU, BLOCK_M, BLOCK_N, DOT_DTYPE, DOT_PRECISION, INTERPRET)  # fmt: skip
    elif tail:
        _gemm1_rows(x_ptr, inter_ptr, sorted_ids_ptr, pid_m, TAIL_M if TAIL_M > 0 else BLOCK_M, offs_n, rows_g, rows_u,
                    gc, gh, gs, gd, uc, uh, us, ud, num_pairs, top_k, H, I, KQ, stride_xt, stride_it, QG, QU, BLOCK_M,
                    BLOCK_N, PAIRS, EVEN_K, PER_SLOT, DOT_DTYPE, DOT_PRECISION, PAIR64, GROUPS, INTERPRET)  # fmt: skip
    else:
        _gemm1_rows(x_ptr, inter_ptr, sorted_ids_ptr, pid_m, BLOCK_M, offs_n, rows_g, rows_u,
                    gc, gh, gs, gd, uc, uh, us, ud, num_pairs, top_k, H, I, KQ, stride_xt, stride_it, QG, QU, BLOCK_M,
                    BLOCK_N, PAIRS, EVEN_K, PER_SLOT, DOT_DTYPE, DOT_PRECISION, PAIR64, GROUPS, INTERPRET)  # fmt: skip


@triton.jit
def _pair64_product(QTYPE: tl.constexpr, codes, high, sub, scale, rows, x_cols, row_ok, H, KQ, ROWS: tl.constexpr,
                    BLOCK_N: tl.constexpr, DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
                    INTERPRET: tl.constexpr):  # fmt: skip
    """float32 [BLOCK_N, ROWS] = W x^T of one projection's rows ([BLOCK_N, 1] global row indices of its packed
    arrays) and the ROWS token columns at x_cols ([1, ROWS]; row_ok masks them), a whole pair decoded a step."""
    cdt = x_cols.dtype.element_ty
    offs_k = tl.arange(0, 64)[:, None]  # [64, 1]
    acc = tl.zeros([BLOCK_N, ROWS], dtype=tl.float32)
    tl.assume(KQ > 0)  # lets the products overlap the decode (tile64.py)
    for q in range(0, KQ):
        k = q * 64 + offs_k  # [64, 1]
        w = decode_pair64(QTYPE, codes, high, sub, scale, rows, q, KQ, INTERPRET).to(cdt).to(DOT_DTYPE)  # [BN, 64]
        xt = tl.load(x_cols + k, mask=row_ok[None, :] & (k < H), other=0.0).to(DOT_DTYPE)  # [64, ROWS]
        acc = tl.dot(w, xt, acc, input_precision=DOT_PRECISION)
    return acc


@triton.jit
def _gemm1_half_rows(
    x_ptr, inter_ptr, scratch_ptr, ticket_ptr, sorted_ids_ptr, pid_m, ROWS: tl.constexpr, offs_n, half, rows_g, rows_u,
    gc, gh, gs, gd, uc, uh, us, ud, num_pairs, top_k, H, I, KQ, stride_xt, stride_it,  # noqa: E741
    QG: tl.constexpr, QU: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    """SPLIT13: half 0 multiplies the gate rows, half 1 the up rows, of the first ROWS rows of M-block pid_m.

    With one accumulator a program instead of two, an M-block can be twice as long in the same registers, so a
    decoded weight tile serves twice the token-slots. Each half stores its product, rounded to the activation dtype,
    in its half of the scratch rows and takes a ticket; the second to arrive reads its partner's product and writes
    silu(gate) * up. Both factors are the rounded products whichever half arrives last, so the result does not
    depend on the order.
    """
    pair, row_ok, irow = _block_rows(pid_m, sorted_ids_ptr, num_pairs, BLOCK_M, ROWS, False)  # [ROWS] each
    token = tl.where(row_ok, pair // top_k, 0).to(tl.int64)
    x_cols = x_ptr + token[None, :] * stride_xt  # [1, ROWS]
    if QG == QU:  # one loop, on the pointers of this half's part
        up = half == 1
        acc = _pair64_product(QG, tl.where(up, uc, gc), tl.where(up, uh, gh), tl.where(up, us, gs),
                              tl.where(up, ud, gd), tl.where(up, rows_u, rows_g), x_cols, row_ok, H, KQ, ROWS,
                              BLOCK_N, DOT_DTYPE, DOT_PRECISION, INTERPRET)  # fmt: skip
    elif half == 0:
        acc = _pair64_product(QG, gc, gh, gs, gd, rows_g, x_cols, row_ok, H, KQ, ROWS, BLOCK_N, DOT_DTYPE,
                              DOT_PRECISION, INTERPRET)  # fmt: skip
    else:
        acc = _pair64_product(QU, uc, uh, us, ud, rows_u, x_cols, row_ok, H, KQ, ROWS, BLOCK_N, DOT_DTYPE,
                              DOT_PRECISION, INTERPRET)  # fmt: skip
    mine = acc.to(scratch_ptr.dtype.element_ty)  # [BLOCK_N, ROWS]
    col_ok = offs_n[:, None] < I  # [BLOCK_N, 1]
    rows_at = scratch_ptr + irow[None, :] * (2 * I) + offs_n[:, None]  # [BLOCK_N, ROWS] this N-tile's gate half
    tl.store(rows_at + half * I, mine, mask=col_ok)
    tl.debug_barrier()  # every thread's product is written before the ticket is taken
    if tl.atomic_add(ticket_ptr, 1, sem="acq_rel", scope="gpu") == 1:
        tl.atomic_xchg(ticket_ptr, 0)  # for the next launch or graph replay
        # written by another program of this launch: read through L2 (.cg)
        other = tl.load(rows_at + (1 - half) * I, mask=col_ok, other=0.0, cache_modifier=".cg").to(tl.float32)
        own = mine.to(tl.float32)
        gate = tl.where(half == 0, own, other)
        act = silu_mul(gate, tl.where(half == 0, other, own)).to(inter_ptr.dtype.element_ty)  # [BLOCK_N, ROWS]
        # Padding rows had zero inputs, so they store zeros (GEMM 2 masks their outputs in any case).
        tl.store(inter_ptr + irow[None, :] * stride_it + offs_n[:, None], act, mask=col_ok)


@triton.jit
def _gemm1_rows(
    x_ptr, inter_ptr, sorted_ids_ptr, pid_m, ROWS: tl.constexpr, offs_n, rows_g, rows_u,
    gc, gh, gs, gd, uc, uh, us, ud, num_pairs, top_k, H, I, KQ, stride_xt, stride_it,  # noqa: E741
    QG: tl.constexpr, QU: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PAIRS: tl.constexpr,
    EVEN_K: tl.constexpr,
    PER_SLOT: tl.constexpr, DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr, PAIR64: tl.constexpr,
    GROUPS: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    """GEMM 1 of the first ROWS rows of M-block pid_m against gate rows rows_g and up rows rows_u ([BLOCK_N, 1]
    global row indices of the packed arrays): silu(g x^T) * (u x^T) into their intermediate rows."""
    pair, row_ok, irow = _block_rows(pid_m, sorted_ids_ptr, num_pairs, BLOCK_M, ROWS, PER_SLOT)  # [ROWS] each
    token = tl.where(row_ok, pair // top_k, 0).to(tl.int64)
    lane_k = tl.arange(0, 32)  # [32]
    lane = lane_k[None, :]  # [1, 32]
    x_cols = x_ptr + token[None, :] * stride_xt  # [1, ROWS]
    cdt = x_ptr.dtype.element_ty
    acc_g = tl.zeros([BLOCK_N, ROWS], dtype=tl.float32)  # gate^T
    acc_u = tl.zeros([BLOCK_N, ROWS], dtype=tl.float32)
    if GROUPS:  # a pair a step, its group words loaded one step ahead (their loads are too narrow to pipeline)
        offs_k = tl.arange(0, 64)[:, None]  # [64, 1]
        tl.assume(KQ > 0)
        g0, g1, gsc, gdl = group_words64(QG, gc, gh, rows_g, 0, KQ)  # [8, BLOCK_N, 1] each
        u0, u1, usc, udl = group_words64(QU, uc, uh, rows_u, 0, KQ)
        for q in range(0, KQ):
            g = group_values64(QG, g0, g1, gsc, gdl, INTERPRET).to(cdt).to(DOT_DTYPE)  # [BLOCK_N, 64]
            u = group_values64(QU, u0, u1, usc, udl, INTERPRET).to(cdt).to(DOT_DTYPE)
            g0, g1, gsc, gdl = group_words64(QG, gc, gh, rows_g, tl.minimum(q + 1, KQ - 1), KQ)
            u0, u1, usc, udl = group_words64(QU, uc, uh, rows_u, tl.minimum(q + 1, KQ - 1), KQ)
            k = q * 64 + offs_k  # [64, 1]
            xt = tl.load(x_cols + k, mask=row_ok[None, :] & (k < H), other=0.0).to(DOT_DTYPE)  # [64, ROWS]
            acc_g = tl.dot(g, xt, acc_g, input_precision=DOT_PRECISION)
            acc_u = tl.dot(u, xt, acc_u, input_precision=DOT_PRECISION)
    elif PAIR64:  # decoded weights rounded to the activation dtype, as dequantize(dtype) rounds them
        offs_k = tl.arange(0, 64)[:, None]  # [64, 1]
        tl.assume(KQ > 0)  # lets the products overlap the decode (tile64.py)
        for q in range(0, KQ):
            k = q * 64 + offs_k  # [64, 1]
            g = decode_pair64(QG, gc, gh, gs, gd, rows_g, q, KQ, INTERPRET).to(cdt).to(DOT_DTYPE)  # [BLOCK_N, 64]
            u = decode_pair64(QU, uc, uh, us, ud, rows_u, q, KQ, INTERPRET).to(cdt).to(DOT_DTYPE)
            xt = tl.load(x_cols + k, mask=row_ok[None, :] & (k < H), other=0.0).to(DOT_DTYPE)  # [64, ROWS]
            acc_g = tl.dot(g, xt, acc_g, input_precision=DOT_PRECISION)
            acc_u = tl.dot(u, xt, acc_u, input_precision=DOT_PRECISION)
    else:  # two 32-wide planes a pair, each in its own tl.dot
        tl.assume(KQ // PAIRS > 0)  # PAIRS divides KQ; as in the tile64 loop above
        for it in range(0, KQ // PAIRS):
            for j in tl.static_range(PAIRS):
                q = it * PAIRS + j
                xa, xb = x_planes(x_cols, q, lane_k, row_ok[None, :], H, EVEN_K)  # [32, ROWS] each
                g0, g1 = dequant_pair(QG, gc, gh, gs, gd, rows_g, q, lane, KQ)  # [BLOCK_N, 32] each
                # Decoded weights are rounded to the activation dtype, as dequantize(dtype) rounds them.
                xa = xa.to(DOT_DTYPE)
                xb = xb.to(DOT_DTYPE)
                acc_g = tl.dot(g0.to(cdt).to(DOT_DTYPE), xa, acc_g, input_precision=DOT_PRECISION)
                acc_g = tl.dot(g1.to(cdt).to(DOT_DTYPE), xb, acc_g, input_precision=DOT_PRECISION)
                u0, u1 = dequant_pair(QU, uc, uh, us, ud, rows_u, q, lane, KQ)
                acc_u = tl.dot(u0.to(cdt).to(DOT_DTYPE), xa, acc_u, input_precision=DOT_PRECISION)
                acc_u = tl.dot(u1.to(cdt).to(DOT_DTYPE), xb, acc_u, input_precision=DOT_PRECISION)

    act = silu_mul(acc_g, acc_u).to(inter_ptr.dtype.element_ty)  # [BLOCK_N, ROWS]
    out_ptrs = inter_ptr + irow[None, :] * stride_it + offs_n[:, None]
    if PER_SLOT:
        tl.store(out_ptrs, act, mask=row_ok[None, :] & (offs_n[:, None] < I))
    else:
        # Padding rows had zero inputs, so they store zeros (GEMM 2 masks their outputs in any case).
        tl.store(out_ptrs, act, mask=offs_n[:, None] < I)


@triton.jit(do_not_specialize=["num_pairs", "num_pid_m"])
def gemm2_tile_kernel(
    inter_ptr,  # [P, I] (PER_SLOT: [T*k, I])
    topk_w_ptr,  # [T*k]
    out_ptr,  # [T, H] fp32 (ATOMIC) or [T*k, H] fp32 or in the output dtype ("sum_out")
    sorted_ids_ptr,  # [P]
    block_expert_ptr,  # [P / BLOCK_M] (PER_SLOT: flat topk ids [T*k])
    wc, wh, ws, wd,
    wt,  # INDIRECT: [E, 4] int64 addresses of each expert's down arrays (else a dummy)
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
    PAIRS: tl.constexpr,
    GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr,
    PER_SLOT: tl.constexpr,
    ATOMIC: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    INDIRECT: tl.constexpr = False,  # experts found through wt; rows count within an expert
    PAIR64: tl.constexpr = False,  # tile64: a whole pair decoded a step (tile64.py; not with PER_SLOT)
    GROUPS: tl.constexpr = False,  # down a grid type: wc its GGUF blocks, wh its table
    TAIL_M: tl.constexpr = 0,  # > 0: blocks of at most TAIL_M pairs run as TAIL_M-row tiles (sorted rows only)
    INTERPRET: tl.constexpr = False,
):  # fmt: skip
    pid_m, pid_n = tile_pid(tl.program_id(0), num_pid_m, tl.cdiv(H, BLOCK_N), GROUP_M)
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    if expert < 0:
        return
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    if INDIRECT:
        wc, wh, ws, wd = part_bases(wt, expert, wc, wh, ws, wd)
        rows = (offs_n % H).to(tl.int64)[:, None]  # [BLOCK_N, 1]
    else:
        rows = (expert * H + (offs_n % H))[:, None]  # [BLOCK_N, 1]
    tail = False  # as in GEMM 1
    if TAIL_M > 0:
        tail = tail_block(sorted_ids_ptr, pid_m * BLOCK_M, num_pairs, BLOCK_M, TAIL_M)
    if tail:
        _gemm2_rows(inter_ptr, topk_w_ptr, out_ptr, sorted_ids_ptr, pid_m, TAIL_M if TAIL_M > 0 else BLOCK_M, offs_n,
                    rows, wc, wh, ws, wd, num_pairs, top_k, H, I, KQ, stride_it, stride_ot, QW, BLOCK_M, BLOCK_N,
                    PAIRS, EVEN_K, PER_SLOT, ATOMIC, DOT_DTYPE, DOT_PRECISION, PAIR64, GROUPS, INTERPRET)  # fmt: skip
    else:
        _gemm2_rows(inter_ptr, topk_w_ptr, out_ptr, sorted_ids_ptr, pid_m, BLOCK_M, offs_n,
                    rows, wc, wh, ws, wd, num_pairs, top_k, H, I, KQ, stride_it, stride_ot, QW, BLOCK_M, BLOCK_N,
                    PAIRS, EVEN_K, PER_SLOT, ATOMIC, DOT_DTYPE, DOT_PRECISION, PAIR64, GROUPS, INTERPRET)  # fmt: skip


@triton.jit
def _gemm2_rows(
    inter_ptr, topk_w_ptr, out_ptr, sorted_ids_ptr, pid_m, ROWS: tl.constexpr, offs_n, rows,
    wc, wh, ws, wd, num_pairs, top_k, H, I, KQ, stride_it, stride_ot,  # noqa: E741
    QW: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PAIRS: tl.constexpr, EVEN_K: tl.constexpr,
    PER_SLOT: tl.constexpr,
    ATOMIC: tl.constexpr, DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr, PAIR64: tl.constexpr,
    GROUPS: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    """GEMM 2 of the first ROWS rows of M-block pid_m against down rows `rows` ([BLOCK_N, 1] global row indices),
    times the routing weights, added into each token's row (ATOMIC) or stored per token-slot."""
    pair, row_ok, irow = _block_rows(pid_m, sorted_ids_ptr, num_pairs, BLOCK_M, ROWS, PER_SLOT)  # [ROWS] each
    lane_k = tl.arange(0, 32)
    lane = lane_k[None, :]
    a_cols = inter_ptr + irow[None, :] * stride_it  # [1, ROWS]
    cdt = inter_ptr.dtype.element_ty
    acc = tl.zeros([BLOCK_N, ROWS], dtype=tl.float32)  # out^T
    if GROUPS:  # as GEMM 1's
        offs_k = tl.arange(0, 64)[:, None]  # [64, 1]
        tl.assume(KQ > 0)
        w0, w1, wsc, wdl = group_words64(QW, wc, wh, rows, 0, KQ)  # [8, BLOCK_N, 1] each
        for q in range(0, KQ):
            w = group_values64(QW, w0, w1, wsc, wdl, INTERPRET).to(cdt).to(DOT_DTYPE)  # [BLOCK_N, 64]
            w0, w1, wsc, wdl = group_words64(QW, wc, wh, rows, tl.minimum(q + 1, KQ - 1), KQ)
            k = q * 64 + offs_k  # [64, 1]
            at = tl.load(a_cols + k, mask=k < I, other=0.0).to(DOT_DTYPE)  # [64, ROWS]
            acc = tl.dot(w, at, acc, input_precision=DOT_PRECISION)
    elif PAIR64:
        offs_k = tl.arange(0, 64)[:, None]  # [64, 1]
        tl.assume(KQ > 0)  # lets the products overlap the decode (tile64.py)
        for q in range(0, KQ):
            k = q * 64 + offs_k  # [64, 1]
            w = decode_pair64(QW, wc, wh, ws, wd, rows, q, KQ, INTERPRET).to(cdt).to(DOT_DTYPE)  # [BLOCK_N, 64]
            # No row mask: an output column depends on its own intermediate row only, and padding's are masked.
            at = tl.load(a_cols + k, mask=k < I, other=0.0).to(DOT_DTYPE)  # [64, ROWS]
            acc = tl.dot(w, at, acc, input_precision=DOT_PRECISION)
    else:
        tl.assume(KQ // PAIRS > 0)  # PAIRS divides KQ; as in the tile64 loop above
        for it in range(0, KQ // PAIRS):
            for j in tl.static_range(PAIRS):
                q = it * PAIRS + j
                k0 = (q * 64 + lane_k)[:, None]  # [32, 1]
                if PER_SLOT:
                    aa = tl.load(a_cols + k0, mask=row_ok[None, :] & (k0 < I), other=0.0)  # [32, ROWS]
                    ab = tl.load(a_cols + k0 + 32, mask=row_ok[None, :] & (k0 + 32 < I), other=0.0)
                elif EVEN_K:
                    # No row mask: an output column depends on its own intermediate row only, and padding's are masked.
                    aa = tl.load(a_cols + k0)
                    ab = tl.load(a_cols + k0 + 32)
                else:
                    aa = tl.load(a_cols + k0, mask=k0 < I, other=0.0)
                    ab = tl.load(a_cols + k0 + 32, mask=k0 + 32 < I, other=0.0)
                w0, w1 = dequant_pair(QW, wc, wh, ws, wd, rows, q, lane, KQ)
                acc = tl.dot(w0.to(cdt).to(DOT_DTYPE), aa.to(DOT_DTYPE), acc, input_precision=DOT_PRECISION)
                acc = tl.dot(w1.to(cdt).to(DOT_DTYPE), ab.to(DOT_DTYPE), acc, input_precision=DOT_PRECISION)

    weight = tl.load(topk_w_ptr + pair, mask=row_ok, other=0.0).to(tl.float32)  # [ROWS]
    acc = acc * weight[None, :]
    mask = row_ok[None, :] & (offs_n[:, None] < H)
    if ATOMIC:
        token = tl.where(row_ok, pair // top_k, 0).to(tl.int64)
        tl.atomic_add(out_ptr + token[None, :] * stride_ot + offs_n[:, None], acc, mask=mask, sem="relaxed")
    else:
        slot = tl.where(row_ok, pair, 0).to(tl.int64)
        tl.store(out_ptr + slot[None, :] * stride_ot + offs_n[:, None], acc.to(out_ptr.dtype.element_ty), mask=mask)
