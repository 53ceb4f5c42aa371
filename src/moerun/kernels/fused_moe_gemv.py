"""The fused MoE's gemv path (kernels/fused_moe.py picks it by the tile config): one program per (token-slot,
N-tile), no sorting; meant for decode, where the layer is a bandwidth-bound read of the touched experts. GEMM 1
reads the slot's expert rows once and reduces over K with tl.sum, writing SiLU(gate) * up; GEMM 2 reduces the k
slots by fp32 atomic adds (GEMM 1 zeroes the buffer), by per-slot rows summed by the last of a token's k programs on
an N-tile (found by a ticket counter), or (reduce "fused") one program per (token, N-tile) walking the token's k
slots. With a TopkSelect (kernels/topk_select.py) GEMM 1 picks the routing itself from the router's logits
(softmax + top-k a program), writing it for GEMM 2; a TopkSelect that carries the RMSNorm also has GEMM 1
normalise x (the un-normalised residual row) and scale the logits by its 1/rms (kernels/o_proj_router.py computes
such logits). With StagedPairs, GEMM 1 runs in two launches: the pairs on the device, then the staged ones.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moerun.kernels.gemv import rsqrt_mean
from moerun.kernels.moe_parts import (
    ExpertWeights,
    StagedPairs,
    expert_weights,
    finish_reduce,
    new_reduce_buffer,
    silu_mul,
    store_slot_sum,
    zero_slice,
    zeroed_by_gemm1,
)
from moerun.kernels.pdl import launch_dependents, launch_options, pdl_mode, wait_for_previous
from moerun.kernels.tickets import ticket_counters
from moerun.kernels.tile_configs import Config
from moerun.kernels.topk_select import TopkSelect, pick_by_value, scaled_weight, select_slot


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
    w_base = expert_weights(w_ptr, table_ptr, expert, stride_we, x_ptr, INDIRECT, ALIGN)
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
    act = silu_mul(gate, up)
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
    w_base = expert_weights(w_ptr, table_ptr, expert, stride_we, inter_ptr, INDIRECT, ALIGN)
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
            store_slot_sum(out_ptr, sum_ptr, token, offs_n, top_k, H, stride_ot, BLOCK_SLOT)


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
        w_base = expert_weights(w_ptr, table_ptr, expert, stride_we, inter_ptr, INDIRECT, ALIGN)
        b_ptrs = w_base + offs_wn[:, None] * stride_wn + offs_k[None, :] * stride_wi
        acc = _down_rows_dot(acc, a_ptrs, b_ptrs, weight, I, stride_wi, BLOCK_K, EVEN_K)
    y = tl.sum(acc, axis=1)  # [BLOCK_N]
    tl.store(out_ptr + token * stride_ot + offs_n, y.to(out_ptr.dtype.element_ty), mask=offs_n < H)


def fused_moe_gemv(
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
        acc = new_reduce_buffer(T, k, H, cfg["reduce"], hidden.device, out_dtype)
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
        return acc if keep_float32 else finish_reduce(acc, T, k, H, True, out_dtype)
    return out
