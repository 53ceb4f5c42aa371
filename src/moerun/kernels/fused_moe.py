"""Fused experts of one MoE layer in Triton: GEMM over w13 with SiLU(gate)*up, GEMM over w2 with routing weights.

Two paths, picked by the tile config:
  gemv  one program per (token-slot, N-tile): reads the slot's expert rows once, reduces over K with tl.sum.
        No sorting; meant for decode, where the layer is a bandwidth-bound read of the touched experts.
  tile  tokens sorted by expert and padded to BLOCK_M (see align.py), then grouped GEMMs with tl.dot. Options:
        TAIL_M runs a block of at most TAIL_M token-slots (an expert's last) as a TAIL_M-row tile; tma brings the
        stacked weights' tiles in through tensor descriptors (the gathered activation rows stay on pointer loads).
The k slots of a token are summed either by fp32 atomic adds into [T, H], or by writing [T*k, H] and summing
("sum": fp32 rows; "sum_out", tile path only: rows in the output dtype; a second kernel on the tile path; on the
gemv path the last of a token's k programs on an N-tile sums them, found by a ticket counter), or (gemv path,
reduce "fused") inside GEMM2 itself: one program per (token, N-tile) walks the token's k slots.
Nothing reads back to the host: grids come from worst-case sizes and surplus programs exit early, so a decode
step can be captured in a CUDA graph. With a TopkSelect (kernels/topk_select.py) the gemv path's GEMM 1 picks the
routing itself from the router's logits (softmax + top-k a program), writing it for GEMM 2; a TopkSelect that
carries the RMSNorm also has GEMM 1 normalise x (the un-normalised residual row) and scale the logits by its 1/rms
(kernels/o_proj_router.py computes such logits).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from moerun.kernels.align import align_tokens
from moerun.kernels.gemv import rsqrt_mean
from moerun.kernels.interpreter import interpreting
from moerun.kernels.pdl import launch_dependents, launch_options, pdl_mode, wait_for_previous
from moerun.kernels.topk_select import TopkSelect, pick_by_value, scaled_weight, select_slot
from moerun.kernels.tickets import ticket_counters
from moerun.kernels.tile_configs import Config, get_config, normalize

_SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@dataclass
class StagedPairs:
    """Token-slot pairs whose experts are still being copied onto the device (zero-copy staging on another stream):
    ``flags`` [T*k] int32, 1 for such a pair; ``wait()`` makes the current stream wait for the copy. The pairs on
    the device are computed first, the flagged ones after the wait."""

    flags: torch.Tensor
    wait: Callable[[], None]


@triton.jit
def _silu_mul(gate, up):
    return gate / (1.0 + tl.exp(-gate)) * up


@triton.jit
def zero_slice(ptr, n, BLOCK: tl.constexpr):
    """Zeroes this program's BLOCK elements of ptr [n] (program p of a launch takes [p BLOCK, (p + 1) BLOCK)), the
    linear program id counted over a 2-D grid."""
    p = tl.program_id(0).to(tl.int64) * tl.num_programs(1) + tl.program_id(1)
    offs = p * BLOCK + tl.arange(0, BLOCK)
    tl.store(ptr + offs, tl.zeros([BLOCK], dtype=ptr.dtype.element_ty), mask=offs < n)


def zeroed_by_gemm1(T: int, H: int, grid1: tuple[int, int], device: torch.device) -> tuple[torch.Tensor, dict]:
    """A float32 [T, H] for GEMM 2's atomic adds, uninitialised, and the GEMM 1 launch arguments (zero_ptr, zero_n,
    ZERO_BLOCK) by which the programs of grid1 zero it, zero_slice's slices covering it."""
    out = torch.empty(T, H, dtype=torch.float32, device=device)  # [T, H]
    block = triton.next_power_of_2(triton.cdiv(T * H, grid1[0] * grid1[1]))
    return out, {"zero_ptr": out, "zero_n": T * H, "ZERO_BLOCK": block}


@triton.jit
def _tile_pid(pid, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    # Consecutive programs walk GROUP_M M-blocks (usually one expert) before moving to the next N band,
    # so an expert's weight tile is read from HBM once and reused from L2.
    width = GROUP_M * num_pid_n
    group = pid // width
    first_m = group * GROUP_M
    group_m = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % group_m
    pid_n = (pid % width) // group_m
    return pid_m, pid_n


@triton.jit
def _expert_base(table_ptr, expert, like_ptr, ALIGN: tl.constexpr):
    """Pointer to an expert's weights (element type of ``like_ptr``) from an int64 address table.

    The pointer is ``like_ptr`` plus an element offset rather than the address cast to a pointer: the compiler
    knows a kernel argument's alignment, and the hint on the offset carries ALIGN to the loads (vector loads).
    """
    # the element size is written out twice: a compile-time int kept in a local variable would become a tensor
    offset = tl.load(table_ptr + expert) - like_ptr.to(tl.int64)  # bytes
    offset = offset // (like_ptr.dtype.element_ty.primitive_bitwidth // 8)  # elements
    return like_ptr + tl.multiple_of(offset, ALIGN // (like_ptr.dtype.element_ty.primitive_bitwidth // 8))


@triton.jit
def _expert_weights(w_ptr, table_ptr, expert, stride_we, like_ptr, INDIRECT: tl.constexpr, ALIGN: tl.constexpr):
    """First element of an expert's weights: stacked (``w_ptr`` + expert * stride) or through the address table."""
    if INDIRECT:
        base = _expert_base(table_ptr, expert, like_ptr, ALIGN)
    else:
        base = w_ptr + expert.to(tl.int64) * stride_we
    return base


@triton.jit
def _block_weights(w_ptr, w_desc, table_ptr, expert, rows, stride_we, like_ptr, INDIRECT: tl.constexpr,
                   ALIGN: tl.constexpr, TMA: tl.constexpr):  # fmt: skip
    """(weights, first row) of an expert whose weight matrices have ``rows`` rows: with TMA the descriptor of the
    stacked [E * rows, K] view and the expert's first row in it; else a pointer to its first element and 0."""
    if TMA:
        base = w_desc
        first = expert * rows
    else:
        base = _expert_weights(w_ptr, table_ptr, expert, stride_we, like_ptr, INDIRECT, ALIGN)
        first = 0
    return base, first


@triton.jit
def _tail_block(sorted_ids_ptr, row0, num_pairs, BLOCK_M: tl.constexpr, TAIL_M: tl.constexpr):
    """Whether the M-block of rows [row0, row0 + BLOCK_M) holds at most TAIL_M pairs. An expert's pairs come first
    in its run and the padding last, so those pairs lie in the block's first TAIL_M rows: the block can run as a
    TAIL_M-row tile, skipping the padding rows' share of the matrix work."""
    pairs = tl.load(sorted_ids_ptr + row0 + tl.arange(0, BLOCK_M))  # [BLOCK_M]
    return tl.sum((pairs < num_pairs).to(tl.int32), axis=0) <= TAIL_M


# Sizes that follow the token count are not specialised on, so a new batch size reuses the compiled kernel.
@triton.jit(do_not_specialize=["num_pairs", "num_pid_m"])
def _gemm1_tile_kernel(
    x_ptr,  # [T, H]
    w_ptr,  # [E, 2I, H]
    table_ptr,  # [E] int64 address of each expert's weights (INDIRECT)
    inter_ptr,  # [P, I] one row per padded sorted position
    sorted_ids_ptr,  # [P]
    block_expert_ptr,  # [P / BLOCK_M]
    num_padded_ptr,  # [1]
    num_pairs,
    top_k,
    H,
    I,  # noqa: E741
    num_pid_m,
    stride_xt,
    stride_xh,
    stride_we,
    stride_wn,
    stride_wh,
    stride_it,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    INDIRECT: tl.constexpr,
    ALIGN: tl.constexpr,
    TAIL_M: tl.constexpr = 0,  # > 0: blocks of at most TAIL_M pairs run as TAIL_M-row tiles (their other rows,
    # padding, are never written: GEMM 2 with the same TAIL_M never reads them)
    w_desc=None,  # TMA: tensor descriptor of w viewed as [E * 2I, H], blocks [BLOCK_N, BLOCK_K]
    TMA: tl.constexpr = False,  # weight tiles come by the tensor memory accelerator (stacked weights only)
):
    pid_m, pid_n = _tile_pid(tl.program_id(0), num_pid_m, tl.cdiv(I, BLOCK_N), GROUP_M)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    expert = tl.load(block_expert_ptr + pid_m)
    if expert < 0:
        return
    w_base, w_row = _block_weights(w_ptr, w_desc, table_ptr, expert, 2 * I, stride_we, x_ptr, INDIRECT, ALIGN, TMA)
    # a short tile where the block has few pairs (the branch exists only with TAIL_M; a Python False is not a
    # compile-time constant to Triton, hence the row count spelled out in the call)
    tail = False
    if TAIL_M > 0:
        tail = _tail_block(sorted_ids_ptr, pid_m * BLOCK_M, num_pairs, BLOCK_M, TAIL_M)
    if tail:
        _gemm1_rows(x_ptr, w_base, w_row, inter_ptr, sorted_ids_ptr, pid_m * BLOCK_M,
                    TAIL_M if TAIL_M > 0 else BLOCK_M, pid_n, num_pairs, top_k, H, I, stride_xt, stride_xh, stride_wn,
                    stride_wh, stride_it, BLOCK_N, BLOCK_K, EVEN_K, UPCAST, DOT_PRECISION, TMA)  # fmt: skip
    else:
        _gemm1_rows(x_ptr, w_base, w_row, inter_ptr, sorted_ids_ptr, pid_m * BLOCK_M, BLOCK_M, pid_n, num_pairs,
                    top_k, H, I, stride_xt, stride_xh, stride_wn, stride_wh, stride_it, BLOCK_N, BLOCK_K, EVEN_K,
                    UPCAST, DOT_PRECISION, TMA)  # fmt: skip


@triton.jit
def _gemm1_rows(
    x_ptr, w_base, w_row, inter_ptr, sorted_ids_ptr, row0, ROWS: tl.constexpr, pid_n, num_pairs, top_k, H,
    I, stride_xt, stride_xh, stride_wn, stride_wh, stride_it,  # noqa: E741
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr, TMA: tl.constexpr,
):  # fmt: skip
    """GEMM 1 of sorted rows [row0, row0 + ROWS) (one expert's weights [2I, H]: at w_base, or with TMA rows w_row +
    [0, 2I) of the descriptor w_base) for N-tile pid_n: silu(x g^T) * (x u^T) into their intermediate rows."""
    rows = row0 + tl.arange(0, ROWS)  # [ROWS]
    pair = tl.load(sorted_ids_ptr + rows)  # [ROWS]
    row_ok = pair < num_pairs
    token = tl.where(row_ok, pair // top_k, 0).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    # Wrapping the N offsets keeps the weight loads unmasked; the extra columns are dropped at the store.
    offs_wn = offs_n % I
    offs_k = tl.arange(0, BLOCK_K)  # [BLOCK_K]

    x_ptrs = x_ptr + token[:, None] * stride_xt + offs_k[None, :] * stride_xh  # [ROWS, BLOCK_K]
    if not TMA:
        g_ptrs = w_base + offs_wn[None, :] * stride_wn + offs_k[:, None] * stride_wh  # [BLOCK_K, BLOCK_N]
        u_ptrs = g_ptrs + I * stride_wn
    acc_g = tl.zeros([ROWS, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([ROWS, BLOCK_N], dtype=tl.float32)
    for kb in range(0, tl.cdiv(H, BLOCK_K)):
        if EVEN_K:
            x = tl.load(x_ptrs, mask=row_ok[:, None], other=0.0)
        else:
            k_ok = offs_k < H - kb * BLOCK_K
            x = tl.load(x_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        if TMA:
            # rows past the expert's gate (or up) rows and columns past H belong to masked outputs or read zeros
            g = w_base.load([w_row + pid_n * BLOCK_N, kb * BLOCK_K]).T  # [BLOCK_K, BLOCK_N]
            u = w_base.load([w_row + I + pid_n * BLOCK_N, kb * BLOCK_K]).T
        elif EVEN_K:
            g = tl.load(g_ptrs)
            u = tl.load(u_ptrs)
        else:
            g = tl.load(g_ptrs, mask=k_ok[:, None], other=0.0)
            u = tl.load(u_ptrs, mask=k_ok[:, None], other=0.0)
        if UPCAST:
            x = x.to(tl.float32)
            g = g.to(tl.float32)
            u = u.to(tl.float32)
        acc_g = tl.dot(x, g, acc_g, input_precision=DOT_PRECISION)
        acc_u = tl.dot(x, u, acc_u, input_precision=DOT_PRECISION)
        x_ptrs += BLOCK_K * stride_xh
        if not TMA:
            g_ptrs += BLOCK_K * stride_wh
            u_ptrs += BLOCK_K * stride_wh

    act = _silu_mul(acc_g, acc_u).to(inter_ptr.dtype.element_ty)  # [ROWS, BLOCK_N]
    out_ptrs = inter_ptr + rows.to(tl.int64)[:, None] * stride_it + offs_n[None, :]
    tl.store(out_ptrs, act, mask=offs_n[None, :] < I)


@triton.jit(do_not_specialize=["num_pairs", "num_pid_m"])
def _gemm2_tile_kernel(
    inter_ptr,  # [P, I]
    w_ptr,  # [E, H, I]
    table_ptr,  # [E] int64 address of each expert's weights (INDIRECT)
    topk_w_ptr,  # [T*k]
    out_ptr,  # [T, H] fp32 (ATOMIC) or [T*k, H] fp32 or in the output dtype ("sum_out")
    sorted_ids_ptr,  # [P]
    block_expert_ptr,  # [P / BLOCK_M]
    num_padded_ptr,  # [1]
    num_pairs,
    top_k,
    H,
    I,  # noqa: E741
    num_pid_m,
    stride_it,
    stride_we,
    stride_wn,
    stride_wi,
    stride_ot,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr,
    ATOMIC: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    INDIRECT: tl.constexpr,
    ALIGN: tl.constexpr,
    TAIL_M: tl.constexpr = 0,  # as GEMM 1's (the same value: it reads only the rows GEMM 1 wrote)
    w_desc=None,  # TMA: tensor descriptor of w viewed as [E * H, I], blocks [BLOCK_N, BLOCK_K]
    TMA: tl.constexpr = False,
):
    pid_m, pid_n = _tile_pid(tl.program_id(0), num_pid_m, tl.cdiv(H, BLOCK_N), GROUP_M)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    expert = tl.load(block_expert_ptr + pid_m)
    if expert < 0:
        return
    w_base, w_row = _block_weights(w_ptr, w_desc, table_ptr, expert, H, stride_we, inter_ptr, INDIRECT, ALIGN, TMA)
    # a short tile where the block has few pairs (the branch exists only with TAIL_M; a Python False is not a
    # compile-time constant to Triton, hence the row count spelled out in the call)
    tail = False
    if TAIL_M > 0:
        tail = _tail_block(sorted_ids_ptr, pid_m * BLOCK_M, num_pairs, BLOCK_M, TAIL_M)
    if tail:
        _gemm2_rows(inter_ptr, w_base, w_row, topk_w_ptr, out_ptr, sorted_ids_ptr, pid_m * BLOCK_M,
                    TAIL_M if TAIL_M > 0 else BLOCK_M, pid_n, num_pairs, top_k, H, I, stride_it, stride_wn, stride_wi,
                    stride_ot, BLOCK_N, BLOCK_K, EVEN_K, ATOMIC, UPCAST, DOT_PRECISION, TMA)  # fmt: skip
    else:
        _gemm2_rows(inter_ptr, w_base, w_row, topk_w_ptr, out_ptr, sorted_ids_ptr, pid_m * BLOCK_M, BLOCK_M, pid_n,
                    num_pairs, top_k, H, I, stride_it, stride_wn, stride_wi, stride_ot, BLOCK_N, BLOCK_K, EVEN_K,
                    ATOMIC, UPCAST, DOT_PRECISION, TMA)  # fmt: skip


@triton.jit
def _gemm2_rows(
    inter_ptr, w_base, w_row, topk_w_ptr, out_ptr, sorted_ids_ptr, row0, ROWS: tl.constexpr, pid_n, num_pairs,
    top_k, H, I, stride_it, stride_wn, stride_wi, stride_ot, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,  # noqa: E741
    EVEN_K: tl.constexpr, ATOMIC: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr, TMA: tl.constexpr,
):  # fmt: skip
    """GEMM 2 of sorted rows [row0, row0 + ROWS) (one expert's weights [H, I]: at w_base, or with TMA rows w_row +
    [0, H) of the descriptor w_base) for N-tile pid_n, times the routing weights, added into each token's row
    (ATOMIC) or stored per token-slot."""
    rows = row0 + tl.arange(0, ROWS)  # [ROWS]
    pair = tl.load(sorted_ids_ptr + rows)  # [ROWS]
    row_ok = pair < num_pairs
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    offs_wn = offs_n % H
    offs_k = tl.arange(0, BLOCK_K)  # [BLOCK_K]

    a_ptrs = inter_ptr + rows.to(tl.int64)[:, None] * stride_it + offs_k[None, :]  # [ROWS, BLOCK_K]
    if not TMA:
        b_ptrs = w_base + offs_wn[None, :] * stride_wn + offs_k[:, None] * stride_wi  # [BLOCK_K, BLOCK_N]
    acc = tl.zeros([ROWS, BLOCK_N], dtype=tl.float32)
    for kb in range(0, tl.cdiv(I, BLOCK_K)):
        # Padding rows of the intermediate hold zeros (their inputs were masked), so A needs no row mask.
        if EVEN_K:
            a = tl.load(a_ptrs)
        else:
            k_ok = offs_k < I - kb * BLOCK_K
            a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
        if TMA:  # rows past the expert's H rows belong to masked outputs; columns past I read zeros
            b = w_base.load([w_row + pid_n * BLOCK_N, kb * BLOCK_K]).T  # [BLOCK_K, BLOCK_N]
        elif EVEN_K:
            b = tl.load(b_ptrs)
        else:
            b = tl.load(b_ptrs, mask=k_ok[:, None], other=0.0)
        if UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K
        if not TMA:
            b_ptrs += BLOCK_K * stride_wi

    weight = tl.load(topk_w_ptr + pair, mask=row_ok, other=0.0).to(tl.float32)  # [ROWS]
    acc = acc * weight[:, None]
    mask = row_ok[:, None] & (offs_n[None, :] < H)
    if ATOMIC:
        token = tl.where(row_ok, pair // top_k, 0).to(tl.int64)
        tl.atomic_add(out_ptr + token[:, None] * stride_ot + offs_n[None, :], acc, mask=mask, sem="relaxed")
    else:
        slot = tl.where(row_ok, pair, 0).to(tl.int64)
        tl.store(out_ptr + slot[:, None] * stride_ot + offs_n[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _gemm1_gemv_kernel(
    x_ptr,  # [T, H]
    w_ptr,  # [E, 2I, H]
    table_ptr,  # [E] int64 address of each expert's weights (INDIRECT)
    ids_ptr,  # [T*k]
    inter_ptr,  # [T*k, I]
    part_ptr,  # [T*k] int32 (PART): 1 where the pair's expert is still being staged
    top_k,
    H,
    I,  # noqa: E741
    stride_xt,
    stride_xh,
    stride_we,
    stride_wn,
    stride_wh,
    stride_it,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    INDIRECT: tl.constexpr,
    ALIGN: tl.constexpr,
    PDL: tl.constexpr = 0,
    PART: tl.constexpr = 0,  # 0 every pair; 1 the pairs whose flag is 0; 2 those whose flag is 1
    zero_ptr=None,  # ZERO_BLOCK > 0: GEMM 2's float32 output [zero_n], zeroed here ZERO_BLOCK elements a program
    zero_n=0,
    ZERO_BLOCK: tl.constexpr = 0,
    # SELECT: the routing is picked here from the router's logits (TopkSelect, select_slot): the programs of N-tile
    # 0 write each slot's id into ids_ptr and its weight, for GEMM 2
    sel=None,  # TopkOperands
    SEL: tl.constexpr = None,  # TopkShape
    SELECT: tl.constexpr = False,
    # NORM_H = H > 0 (with SELECT): x is the un-normalised row [H] and the logits are before its 1/rms. The picks
    # come from their values (a positive scale keeps the order; no softmax, which could underflow them to ties);
    # each program multiplies x by the RMSNorm weight (norm_ptr) and its products by the 1/rms that the row's sum
    # of squares, taken in the same loop, gives at the end; the programs of N-tile 0 then write the slot's weight,
    # the softmax of the logits times that 1/rms.
    norm_ptr=None,
    eps=0.0,
    NORM_H: tl.constexpr = 0,
    INTERPRET: tl.constexpr = False,
):
    launch_dependents(PDL)
    wait_for_previous(PDL)  # (and only then the zeroing: the buffer's memory may have served a kernel before)
    if ZERO_BLOCK > 0:
        zero_slice(zero_ptr, zero_n, ZERO_BLOCK)
    slot = tl.program_id(0)
    if NORM_H > 0:  # (SELECT)
        row, value, top_v, takes, expert = pick_by_value(sel, SEL, slot)
        if tl.program_id(1) == 0:
            tl.store(ids_ptr + slot, expert)
    elif SELECT:
        expert = select_slot(sel, SEL, ids_ptr, slot, tl.program_id(1) == 0)
    else:
        expert = tl.load(ids_ptr + slot)
    if PART == 0:
        inv_rms = _gemm1_gemv_rows(x_ptr, w_ptr, table_ptr, expert.to(tl.int64), inter_ptr, slot, top_k, H, I,
                                   stride_xt, stride_xh, stride_we, stride_wn, stride_wh, stride_it, BLOCK_N, BLOCK_K,
                                   EVEN_K, INDIRECT, ALIGN, norm_ptr, eps, NORM_H, INTERPRET)  # fmt: skip
        if NORM_H > 0:
            if tl.program_id(1) == 0:
                tl.store(sel.weights_ptr + slot, scaled_weight(row, value, top_v, takes, inv_rms, SEL))
    else:
        if (tl.load(part_ptr + slot) != 0) == (PART == 2):
            _gemm1_gemv_rows(x_ptr, w_ptr, table_ptr, expert.to(tl.int64), inter_ptr, slot, top_k, H, I, stride_xt,
                             stride_xh, stride_we, stride_wn, stride_wh, stride_it, BLOCK_N, BLOCK_K, EVEN_K,
                             INDIRECT, ALIGN)  # fmt: skip


@triton.jit
def _gemm1_gemv_rows(x_ptr, w_ptr, table_ptr, expert, inter_ptr, slot, top_k, H, I, stride_xt, stride_xh,  # noqa: E741
                     stride_we, stride_wn, stride_wh, stride_it, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     EVEN_K: tl.constexpr, INDIRECT: tl.constexpr, ALIGN: tl.constexpr, norm_ptr=None, eps=0.0,
                     NORM_H: tl.constexpr = 0, INTERPRET: tl.constexpr = False):
    """One program of _gemm1_gemv_kernel: an N-tile of SiLU(gate) * up for token-slot ``slot`` of ``expert``.
    With NORM_H = H > 0, of RMSNorm(x's row): x times the norm weight at norm_ptr in the loop, the products times
    the 1/rms of the row's sum of squares (taken in the same loop) at the end; returns that 1/rms [1] float32."""
    pid_n = tl.program_id(1)
    token = (slot // top_k).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    offs_wn = offs_n % I
    offs_k = tl.arange(0, BLOCK_K)  # [BLOCK_K]
    x_ptrs = x_ptr + token * stride_xt + offs_k * stride_xh  # [BLOCK_K]
    w_base = _expert_weights(w_ptr, table_ptr, expert, stride_we, x_ptr, INDIRECT, ALIGN)
    g_ptrs = w_base + offs_wn[:, None] * stride_wn + offs_k[None, :] * stride_wh
    u_ptrs = g_ptrs + I * stride_wn  # [BLOCK_N, BLOCK_K]
    # Partial products stay 2-D across the K loop; one cross-lane reduction at the end instead of one per step.
    acc_g = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    sq = tl.zeros([1, BLOCK_K], dtype=tl.float32)  # (NORM_H) the row's squares
    for kb in range(0, tl.cdiv(H, BLOCK_K)):
        if EVEN_K:
            x = tl.load(x_ptrs)  # [BLOCK_K]
            g = tl.load(g_ptrs)
            u = tl.load(u_ptrs)
        else:
            k_ok = offs_k < H - kb * BLOCK_K
            x = tl.load(x_ptrs, mask=k_ok, other=0.0)
            g = tl.load(g_ptrs, mask=k_ok[None, :], other=0.0)
            u = tl.load(u_ptrs, mask=k_ok[None, :], other=0.0)
        x = x.to(tl.float32)[None, :]  # [1, BLOCK_K]
        if NORM_H > 0:
            sq += x * x
            k = kb * BLOCK_K + offs_k
            x = x * tl.load(norm_ptr + k, mask=k < NORM_H, other=0.0).to(tl.float32)[None, :]
        acc_g += g.to(tl.float32) * x
        acc_u += u.to(tl.float32) * x
        x_ptrs += BLOCK_K * stride_xh
        g_ptrs += BLOCK_K * stride_wh
        u_ptrs += BLOCK_K * stride_wh
    gate, up = tl.sum(acc_g, axis=1), tl.sum(acc_u, axis=1)  # [BLOCK_N]
    inv_rms = tl.full([1], 1.0, tl.float32)
    if NORM_H > 0:
        inv_rms = rsqrt_mean(tl.sum(sq, axis=1), eps, NORM_H, INTERPRET)  # [1]
        gate, up = gate * inv_rms, up * inv_rms
    act = _silu_mul(gate, up)
    tl.store(inter_ptr + slot.to(tl.int64) * stride_it + offs_n, act.to(inter_ptr.dtype.element_ty), mask=offs_n < I)
    return inv_rms


@triton.jit
def _down_rows_dot(acc, a_ptrs, b_ptrs, scale, I, stride_wi, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):  # noqa: E741
    """acc [BLOCK_N, BLOCK_K] += W2 rows [BLOCK_N, I] * (scale * intermediate row [I]), one K-tile per step;
    the caller reduces acc over its last axis once."""
    offs_k = tl.arange(0, BLOCK_K)  # [BLOCK_K]
    for kb in range(0, tl.cdiv(I, BLOCK_K)):
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            k_ok = offs_k < I - kb * BLOCK_K
            a = tl.load(a_ptrs, mask=k_ok, other=0.0)
            b = tl.load(b_ptrs, mask=k_ok[None, :], other=0.0)
        acc += b.to(tl.float32) * (a.to(tl.float32) * scale)[None, :]
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K * stride_wi
    return acc


@triton.jit
def _gemm2_gemv_kernel(
    inter_ptr,  # [T*k, I]
    w_ptr,  # [E, H, I]
    table_ptr,  # [E] int64 address of each expert's weights (INDIRECT)
    ids_ptr,  # [T*k]
    topk_w_ptr,  # [T*k]
    out_ptr,  # [T, H] fp32 (ATOMIC) or [T*k, H] fp32
    sum_ptr,  # [T, H] in the output dtype: the k slots summed by the last program of each (token, N-tile)
    ticket_ptr,  # [T, N-tiles] int32, 0 between launches (not ATOMIC)
    top_k,
    H,
    I,  # noqa: E741
    stride_it,
    stride_we,
    stride_wn,
    stride_wi,
    stride_ot,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_SLOT: tl.constexpr,  # top_k rounded up to a power of two
    EVEN_K: tl.constexpr,
    ATOMIC: tl.constexpr,
    INDIRECT: tl.constexpr,
    ALIGN: tl.constexpr,
    PDL: tl.constexpr = 0,
):
    launch_dependents(PDL)
    wait_for_previous(PDL)
    slot = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(ids_ptr + slot).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    offs_wn = offs_n % H
    offs_k = tl.arange(0, BLOCK_K)  # [BLOCK_K]
    a_ptrs = inter_ptr + slot.to(tl.int64) * stride_it + offs_k  # [BLOCK_K]
    w_base = _expert_weights(w_ptr, table_ptr, expert, stride_we, inter_ptr, INDIRECT, ALIGN)
    b_ptrs = w_base + offs_wn[:, None] * stride_wn + offs_k[None, :] * stride_wi
    acc = _down_rows_dot(tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32), a_ptrs, b_ptrs, 1.0, I, stride_wi,
                         BLOCK_K, EVEN_K)  # [BLOCK_N, BLOCK_K]
    y = tl.sum(acc, axis=1) * tl.load(topk_w_ptr + slot).to(tl.float32)  # [BLOCK_N]
    if ATOMIC:
        token = (slot // top_k).to(tl.int64)
        tl.atomic_add(out_ptr + token * stride_ot + offs_n, y, mask=offs_n < H, sem="relaxed")
    else:
        tl.store(out_ptr + slot.to(tl.int64) * stride_ot + offs_n, y, mask=offs_n < H)
        # The last of a token's k programs on this N-tile sums the k partials (in slot order, as a separate
        # kernel would) and resets its counter for the next launch.
        token = (slot // top_k).to(tl.int64)
        counter = ticket_ptr + token * tl.num_programs(1) + pid_n
        tl.debug_barrier()  # every thread's partial is written before the ticket is taken
        ticket = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
        if ticket == top_k - 1:
            tl.atomic_xchg(counter, 0)
            _store_slot_sum(out_ptr, sum_ptr, token, offs_n, top_k, H, stride_ot, BLOCK_SLOT)


@triton.jit
def _gemm2_gemv_fused_kernel(
    inter_ptr,  # [T*k, I]
    w_ptr,  # [E, H, I]
    table_ptr,  # [E] int64 address of each expert's weights (INDIRECT)
    ids_ptr,  # [T*k]
    topk_w_ptr,  # [T*k]
    out_ptr,  # [T, H] in the output dtype
    top_k,
    H,
    I,  # noqa: E741
    stride_it,
    stride_we,
    stride_wn,
    stride_wi,
    stride_ot,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    INDIRECT: tl.constexpr,
    ALIGN: tl.constexpr,
    PDL: tl.constexpr = 0,
):
    launch_dependents(PDL)
    wait_for_previous(PDL)
    # One program per (token, N-tile) sums the token's k slots in registers: no atomics, no second kernel.
    token = tl.program_id(0).to(tl.int64)
    pid_n = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    offs_wn = offs_n % H
    offs_k = tl.arange(0, BLOCK_K)  # [BLOCK_K]
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for j in range(0, top_k):
        slot = token * top_k + j
        expert = tl.load(ids_ptr + slot).to(tl.int64)
        # The routing weight scales the activations, so all k slots share one accumulator and one reduction.
        weight = tl.load(topk_w_ptr + slot).to(tl.float32)
        a_ptrs = inter_ptr + slot * stride_it + offs_k  # [BLOCK_K]
        w_base = _expert_weights(w_ptr, table_ptr, expert, stride_we, inter_ptr, INDIRECT, ALIGN)
        b_ptrs = w_base + offs_wn[:, None] * stride_wn + offs_k[None, :] * stride_wi
        acc = _down_rows_dot(acc, a_ptrs, b_ptrs, weight, I, stride_wi, BLOCK_K, EVEN_K)
    y = tl.sum(acc, axis=1)  # [BLOCK_N]
    tl.store(out_ptr + token * stride_ot + offs_n, y.to(out_ptr.dtype.element_ty), mask=offs_n < H)


@triton.jit
def _store_slot_sum(src_ptr, out_ptr, token, offs_h, top_k, H, stride_src, BLOCK_SLOT: tl.constexpr):
    """out[token, offs_h] = fp32 sum over the token's k slot rows of src [T*k, H], in out's dtype. The rows are
    read through L2 (.cg): other programs of the same launch may have written them."""
    slots = tl.arange(0, BLOCK_SLOT)  # [BLOCK_SLOT]
    mask = (slots[:, None] < top_k) & (offs_h[None, :] < H)
    rows = (token * top_k + slots[:, None]) * stride_src + offs_h[None, :]  # [BLOCK_SLOT, BLOCK_H]
    vals = tl.load(src_ptr + rows, mask=mask, other=0.0, cache_modifier=".cg").to(tl.float32)
    tl.store(out_ptr + token * H + offs_h, tl.sum(vals, axis=0).to(out_ptr.dtype.element_ty), mask=offs_h < H)


@triton.jit
def _sum_slots_kernel(
    src_ptr,  # [T*k, H] fp32 or out's dtype
    out_ptr,  # [T, H]
    top_k,
    H,
    BLOCK_SLOT: tl.constexpr,
    BLOCK_H: tl.constexpr,
    PDL: tl.constexpr = 0,
):
    launch_dependents(PDL)
    wait_for_previous(PDL)
    token = tl.program_id(0).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)  # [BLOCK_H]
    _store_slot_sum(src_ptr, out_ptr, token, offs_h, top_k, H, H, BLOCK_SLOT)


def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 tests compare against full-precision torch matmuls; TF32 would need loose tolerances.
    return "ieee" if dtype == torch.float32 else "tf32"


def _finish(acc: torch.Tensor, T: int, k: int, H: int, atomic: bool, out_dtype: torch.dtype) -> torch.Tensor:
    """[T, H] in out_dtype from the fp32 atomic output [T, H] or the per-slot rows [T*k, H] (summed in fp32)."""
    if atomic:
        return acc if out_dtype == torch.float32 else acc.to(out_dtype)
    out = torch.empty(T, H, dtype=out_dtype, device=acc.device)  # [T, H]
    block_h = min(triton.next_power_of_2(H), 1024)
    pdl = pdl_mode(acc.device, T)  # the tile path (prefill sizes) sums here too
    _sum_slots_kernel[(T, triton.cdiv(H, block_h))](
        acc, out, k, H, BLOCK_SLOT=triton.next_power_of_2(k), BLOCK_H=block_h, num_warps=4, PDL=pdl,
        **launch_options(pdl),
    )
    return out


def _new_acc(T: int, k: int, H: int, reduce: str, device: torch.device, out_dtype: torch.dtype) -> torch.Tensor:
    """The buffer GEMM2 writes into: zeroed fp32 [T, H] for atomic adds, else uninitialised per-slot rows [T*k, H],
    fp32 ("sum") or in the output dtype ("sum_out": half the bytes to write and to sum)."""
    if reduce == "atomic":
        return torch.zeros(T, H, dtype=torch.float32, device=device)  # [T, H]
    dtype = out_dtype if reduce == "sum_out" else torch.float32
    return torch.empty(T * k, H, dtype=dtype, device=device)  # [T*k, H]


@dataclass(frozen=True)
class ExpertWeights:
    """Where the kernels find one weight (w13 or w2) of every expert: a stacked [E, N, K] tensor, or a table of
    int64 addresses of contiguous [N, K] matrices (``indirect``; they may lie in pinned host memory)."""

    tensor: torch.Tensor  # the stacked weights; when indirect, any tensor (unused by the kernels)
    table: torch.Tensor  # [E] int64 addresses when indirect; else any tensor (unused)
    strides: tuple[int, int, int]  # (expert, row, column) in elements
    indirect: bool
    align: int = 16  # bytes every address is a multiple of (indirect)

    @staticmethod
    def stacked(w: torch.Tensor) -> "ExpertWeights":
        return ExpertWeights(w, w, (w.stride(0), w.stride(1), w.stride(2)), False)

    @staticmethod
    def addresses(table: torch.Tensor, K: int, align: int) -> "ExpertWeights":  # noqa: N803
        return ExpertWeights(table, table, (0, K, 1), True, align)

    def args(self, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(w_ptr, table_ptr) kernel arguments; ``like`` stands in for the unused stacked pointer when indirect."""
        return (like if self.indirect else self.tensor), self.table


def _fused_moe_gemv(
    hidden: torch.Tensor,
    w13: ExpertWeights,
    w2: ExpertWeights,
    I: int,  # noqa: E741
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    cfg: Config,
    out_dtype: torch.dtype,
    staged: StagedPairs | None = None,
    keep_float32: bool = False,
    select: TopkSelect | None = None,
) -> torch.Tensor:
    """gemv path: one program per (token-slot, N-tile), no sorting; GEMM2 per (token, N-tile) when reduce is fused.
    With ``staged``, GEMM 1 runs in two launches around ``staged.wait()``. With reduce "atomic", GEMM 1 zeroes the
    float32 [T, H] that GEMM 2 adds into, returned as it is with ``keep_float32`` (else rounded to out_dtype). With
    ``select``, GEMM 1 picks the routing from the logits and writes it into topk_weights / topk_ids."""
    T, H = hidden.shape
    if select is not None and staged is not None:
        raise ValueError("the top-k picked in GEMM 1 and staged pairs do not go together: staging needs the picks")
    if select is not None and select.norm_weight is not None and select.norm_weight.shape[0] != H:
        raise ValueError(f"the select's RMSNorm weight has {select.norm_weight.shape[0]} values, x rows {H}")
    sel = {} if select is None else select.kernel_args(topk_weights, topk_ids.shape[1], cfg["num_warps"])
    k = topk_ids.shape[1]
    pairs = T * k
    atomic = cfg["reduce"] == "atomic"
    ids = topk_ids.reshape(-1)  # [T*k]
    inter = torch.empty(pairs, I, dtype=hidden.dtype, device=hidden.device)  # [T*k, I] in the weights' dtype
    bn1, bk1 = cfg["BLOCK_N"], cfg["BLOCK_K"]
    pdl = pdl_mode(hidden.device, T)
    grid1 = (pairs, triton.cdiv(I, bn1))
    acc, zero = zeroed_by_gemm1(T, H, grid1, hidden.device) if atomic else (None, {})  # [T, H]
    # with staged pairs: those on the device first, then (once their copy is done) the staged ones
    for part in (0,) if staged is None else (1, 2):
        if part == 2:
            staged.wait()
        _gemm1_gemv_kernel[grid1](
            hidden, *w13.args(hidden), ids, inter, staged.flags if staged is not None else ids, k, H, I,
            hidden.stride(0), hidden.stride(1), *w13.strides, inter.stride(0),
            BLOCK_N=bn1, BLOCK_K=bk1, EVEN_K=H % bk1 == 0, INDIRECT=w13.indirect, ALIGN=w13.align,
            num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], PDL=pdl, PART=part,
            **launch_options(pdl), **(zero if part < 2 else {}), **sel,
        )  # fmt: skip
    bn2, bk2 = cfg["BLOCK_N2"], cfg["BLOCK_K2"]
    if cfg["reduce"] == "fused":
        out = torch.empty(T, H, dtype=out_dtype, device=hidden.device)  # [T, H]
        _gemm2_gemv_fused_kernel[(T, triton.cdiv(H, bn2))](
            inter, *w2.args(inter), ids, topk_weights.reshape(-1), out, k, H, I,
            inter.stride(0), *w2.strides, out.stride(0),
            BLOCK_N=bn2, BLOCK_K=bk2, EVEN_K=I % bk2 == 0, INDIRECT=w2.indirect, ALIGN=w2.align,
            num_warps=cfg["num_warps2"], num_stages=cfg["num_stages2"], PDL=pdl,
            **launch_options(pdl),
        )  # fmt: skip
        return out
    n_tiles = triton.cdiv(H, bn2)
    if atomic:
        out = tickets = acc  # dummies, never touched
    else:
        acc = _new_acc(T, k, H, cfg["reduce"], hidden.device, out_dtype)
        out = torch.empty(T, H, dtype=out_dtype, device=hidden.device)  # [T, H]
        tickets = ticket_counters(hidden.device, T * n_tiles, "moe_slot_sum")  # [T, N-tiles]
    _gemm2_gemv_kernel[(pairs, n_tiles)](
        inter, *w2.args(inter), ids, topk_weights.reshape(-1), acc, out, tickets, k, H, I,
        inter.stride(0), *w2.strides, acc.stride(0),
        BLOCK_N=bn2, BLOCK_K=bk2, BLOCK_SLOT=triton.next_power_of_2(k), EVEN_K=I % bk2 == 0, ATOMIC=atomic,
        INDIRECT=w2.indirect, ALIGN=w2.align,
        num_warps=cfg["num_warps2"], num_stages=cfg["num_stages2"], PDL=pdl,
        **launch_options(pdl),
    )  # fmt: skip
    if atomic:
        return acc if keep_float32 else _finish(acc, T, k, H, True, out_dtype)
    return out


def _tma_fits(w: ExpertWeights) -> bool:
    """Whether stacked weights [E, N, K] can be read by tensor descriptors: a device with TMA (or the interpreter),
    contiguous, rows a multiple of 16 bytes and a 16-byte aligned start."""
    t = w.tensor
    if w.indirect or (t.is_cuda and torch.cuda.get_device_capability(t.device)[0] < 9):  # TMA: Hopper and later
        return False
    return t.is_contiguous() and t.shape[2] * t.element_size() % 16 == 0 and t.data_ptr() % 16 == 0


def _weight_descriptor(w: ExpertWeights, block_n: int, block_k: int) -> TensorDescriptor:
    """Host tensor descriptor of stacked weights [E, N, K] viewed as [E * N, K], tiles [block_n, block_k]."""
    E, N, K = w.tensor.shape  # noqa: N806
    return TensorDescriptor.from_tensor(w.tensor.view(E * N, K), [block_n, block_k])


def _fused_moe_tile(
    hidden: torch.Tensor,
    w13: ExpertWeights,
    w2: ExpertWeights,
    I: int,  # noqa: E741
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    cfg: Config,
    out_dtype: torch.dtype,
    keep_float32: bool = False,
) -> torch.Tensor:
    """tile path: align token-slots by expert, then two grouped GEMMs over M-blocks; with reduce "atomic" and
    ``keep_float32`` the float32 sums are returned unrounded."""
    T, H = hidden.shape
    E = w13.table.shape[0] if w13.indirect else w13.tensor.shape[0]
    k = topk_ids.shape[1]
    pairs = T * k
    atomic = cfg["reduce"] == "atomic"
    block_m = cfg["BLOCK_M"]
    upcast = interpreting()
    precision = _dot_precision(hidden.dtype)
    align = align_tokens(topk_ids, E, block_m)
    num_pid_m = align.block_expert.numel()
    inter = torch.empty(align.sorted_ids.numel(), I, dtype=hidden.dtype, device=hidden.device)  # [P, I]
    bn1, bk1 = cfg["BLOCK_N"], cfg["BLOCK_K"]
    bn2, bk2 = cfg["BLOCK_N2"], cfg["BLOCK_K2"]
    tma = cfg["tma"] and _tma_fits(w13) and _tma_fits(w2)
    _gemm1_tile_kernel[(num_pid_m * triton.cdiv(I, bn1),)](
        hidden, *w13.args(hidden), inter, align.sorted_ids, align.block_expert, align.num_padded, pairs, k, H, I,
        num_pid_m, hidden.stride(0), hidden.stride(1), *w13.strides, inter.stride(0),
        BLOCK_M=block_m, BLOCK_N=bn1, BLOCK_K=bk1, GROUP_M=cfg["GROUP_M"], EVEN_K=H % bk1 == 0,
        UPCAST=upcast, DOT_PRECISION=precision, INDIRECT=w13.indirect, ALIGN=w13.align, TAIL_M=cfg["TAIL_M"],
        w_desc=_weight_descriptor(w13, bn1, bk1) if tma else None, TMA=tma,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )  # fmt: skip
    acc = _new_acc(T, k, H, cfg["reduce"], hidden.device, out_dtype)
    _gemm2_tile_kernel[(num_pid_m * triton.cdiv(H, bn2),)](
        inter, *w2.args(inter), topk_weights.reshape(-1), acc, align.sorted_ids, align.block_expert,
        align.num_padded, pairs, k, H, I, num_pid_m,
        inter.stride(0), *w2.strides, acc.stride(0),
        BLOCK_M=block_m, BLOCK_N=bn2, BLOCK_K=bk2, GROUP_M=cfg["GROUP_M"], EVEN_K=I % bk2 == 0, ATOMIC=atomic,
        UPCAST=upcast, DOT_PRECISION=precision, INDIRECT=w2.indirect, ALIGN=w2.align, TAIL_M=cfg["TAIL_M"],
        w_desc=_weight_descriptor(w2, bn2, bk2) if tma else None, TMA=tma,
        num_warps=cfg["num_warps2"], num_stages=cfg["num_stages2"],
    )  # fmt: skip
    return acc if atomic and keep_float32 else _finish(acc, T, k, H, atomic, out_dtype)


def run_fused_moe(
    x: torch.Tensor,
    w13: ExpertWeights,
    w2: ExpertWeights,
    I: int,  # noqa: E741
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    cfg: Config,
    out_dtype: torch.dtype,
    staged: StagedPairs | None = None,
    keep_float32: bool = False,
    select: TopkSelect | None = None,
) -> torch.Tensor:
    """Runs the path the config names; x [T, H] already in the weights' dtype, ids int32 and contiguous. With
    ``staged`` (the gemv path only overlaps it; the tile path waits first), see StagedPairs. ``keep_float32``: the
    atomic reduce returns its float32 sums unrounded (fused_moe_triton's). ``select``: the routing is picked from
    logits into topk_weights / topk_ids (by GEMM 1 on the gemv path, else first)."""
    if cfg["path"] == "gemv":
        return _fused_moe_gemv(x, w13, w2, I, topk_weights, topk_ids, cfg, out_dtype, staged, keep_float32, select)
    if select is not None:
        x, select = select.prenormalised(x)
        select.fill(topk_weights, topk_ids)
    if staged is not None:
        staged.wait()
    return _fused_moe_tile(x, w13, w2, I, topk_weights, topk_ids, cfg, out_dtype, keep_float32)


def fused_moe_triton(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    config: Config | None = None,
    num_experts: int | None = None,
    keep_float32: bool = False,
    select: TopkSelect | None = None,
) -> torch.Tensor:
    """Experts of one MoE layer: hidden [T, H], w13 [E, 2I, H], w2 [E, H, I] -> [T, H] in hidden's dtype.
    ``num_experts``: the layer's expert count, which picks the tuned tables, where w13 and w2 stack another number
    of experts (a slot pool). ``keep_float32``: a config whose GEMM 2 adds into a float32 buffer (reduce "atomic";
    on the gemv path GEMM 1 zeroes it) returns that buffer as it is, float32 [T, H], for a consumer that rounds it.
    ``select``: topk_weights / topk_ids are buffers the routing is written into, picked from the router's logits
    (TopkSelect)."""
    T, H = hidden.shape
    E, two_i, h_w = w13.shape
    I = two_i // 2  # noqa: E741
    k = topk_ids.shape[1]
    if h_w != H or tuple(w2.shape) != (E, H, I) or two_i != 2 * I:
        raise ValueError(f"shape mismatch: hidden {tuple(hidden.shape)}, w13 {tuple(w13.shape)}, w2 {tuple(w2.shape)}")
    if tuple(topk_weights.shape) != (T, k):
        raise ValueError(f"topk_weights {tuple(topk_weights.shape)} must match topk_ids {tuple(topk_ids.shape)}")
    if w13.dtype not in _SUPPORTED_DTYPES or w2.dtype != w13.dtype:
        raise ValueError(f"unsupported weight dtypes {w13.dtype}, {w2.dtype}")
    if select is not None:
        select.check(topk_weights, topk_ids, num_experts or E)
    if T == 0:
        return torch.empty(0, H, dtype=hidden.dtype, device=hidden.device)
    # The reference runs each expert's GEMMs in the weights' dtype.
    x = hidden if hidden.dtype == w13.dtype else hidden.to(w13.dtype)
    ids = topk_ids if topk_ids.dtype == torch.int32 else topk_ids.to(torch.int32)
    ids = ids.contiguous()
    weights = topk_weights.contiguous()
    cfg = normalize(config) if config is not None else get_config(num_experts or E, H, I, k, w13.dtype, T)
    return run_fused_moe(x, ExpertWeights.stacked(w13), ExpertWeights.stacked(w2), I, weights, ids, cfg, hidden.dtype,
                         keep_float32=keep_float32, select=select)  # fmt: skip
