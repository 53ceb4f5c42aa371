"""Fused experts of one MoE layer in Triton: GEMM over w13 with SiLU(gate)*up, GEMM over w2 with routing weights.

Two paths, picked by the tile config:
  gemv  one program per (token-slot, N-tile), no sorting; meant for decode (kernels/fused_moe_gemv.py).
  tile  this module: tokens sorted by expert and padded to BLOCK_M (see align.py), then grouped GEMMs with tl.dot.
        Options: TAIL_M runs a block of at most TAIL_M token-slots (an expert's last) as a TAIL_M-row tile; tma
        brings the stacked weights' tiles in through tensor descriptors (the gathered activation rows stay on
        pointer loads).
The k slots of a token are summed either by fp32 atomic adds into [T, H], or by writing [T*k, H] and summing
("sum": fp32 rows; "sum_out", tile path only: rows in the output dtype; a second kernel on the tile path; the gemv
path sums them in GEMM 2, kernels/fused_moe_gemv.py says how). Nothing reads back to the host: grids come from
worst-case sizes and surplus programs exit early, so a decode step can be captured in a CUDA graph. With a
TopkSelect (kernels/topk_select.py) the routing is picked from the router's logits: by GEMM 1 itself on the gemv
path, by a launch of its own before the tile path. The pieces both paths share are in kernels/moe_parts.py.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from moerun.kernels.align import align_tokens
from moerun.kernels.fused_moe_gemv import fused_moe_gemv
from moerun.kernels.interpreter import interpreting
from moerun.kernels.moe_parts import (
    SUPPORTED_DTYPES,
    ExpertWeights,
    StagedPairs,
    dot_precision,
    expert_weights,
    finish_reduce,
    new_reduce_buffer,
    silu_mul,
    tail_block,
    tile_pid,
)
from moerun.kernels.tile_configs import Config, get_config, normalize
from moerun.kernels.topk_select import TopkSelect


@triton.jit
def _block_weights(w_ptr, w_desc, table_ptr, expert, rows, stride_we, like_ptr, INDIRECT: tl.constexpr,
                   ALIGN: tl.constexpr, TMA: tl.constexpr):  # fmt: skip
    """(weights, first row) of an expert whose weight matrices have ``rows`` rows: with TMA the descriptor of the
    stacked [E * rows, K] view and the expert's first row in it; else a pointer to its first element and 0."""
    if TMA:
        base = w_desc
        first = expert * rows
    else:
        base = expert_weights(w_ptr, table_ptr, expert, stride_we, like_ptr, INDIRECT, ALIGN)
        first = 0
    return base, first


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
    pid_m, pid_n = tile_pid(tl.program_id(0), num_pid_m, tl.cdiv(I, BLOCK_N), GROUP_M)
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
        tail = tail_block(sorted_ids_ptr, pid_m * BLOCK_M, num_pairs, BLOCK_M, TAIL_M)
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

    act = silu_mul(acc_g, acc_u).to(inter_ptr.dtype.element_ty)  # [ROWS, BLOCK_N]
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
    pid_m, pid_n = tile_pid(tl.program_id(0), num_pid_m, tl.cdiv(H, BLOCK_N), GROUP_M)
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
        tail = tail_block(sorted_ids_ptr, pid_m * BLOCK_M, num_pairs, BLOCK_M, TAIL_M)
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
    precision = dot_precision(hidden.dtype)
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
    acc = new_reduce_buffer(T, k, H, cfg["reduce"], hidden.device, out_dtype)
    _gemm2_tile_kernel[(num_pid_m * triton.cdiv(H, bn2),)](
        inter, *w2.args(inter), topk_weights.reshape(-1), acc, align.sorted_ids, align.block_expert,
        align.num_padded, pairs, k, H, I, num_pid_m,
        inter.stride(0), *w2.strides, acc.stride(0),
        BLOCK_M=block_m, BLOCK_N=bn2, BLOCK_K=bk2, GROUP_M=cfg["GROUP_M"], EVEN_K=I % bk2 == 0, ATOMIC=atomic,
        UPCAST=upcast, DOT_PRECISION=precision, INDIRECT=w2.indirect, ALIGN=w2.align, TAIL_M=cfg["TAIL_M"],
        w_desc=_weight_descriptor(w2, bn2, bk2) if tma else None, TMA=tma,
        num_warps=cfg["num_warps2"], num_stages=cfg["num_stages2"],
    )  # fmt: skip
    return acc if atomic and keep_float32 else finish_reduce(acc, T, k, H, atomic, out_dtype)


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
        return fused_moe_gemv(x, w13, w2, I, topk_weights, topk_ids, cfg, out_dtype, staged, keep_float32, select)
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
    if w13.dtype not in SUPPORTED_DTYPES or w2.dtype != w13.dtype:
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
