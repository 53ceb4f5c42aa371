"""y = x @ W^T for repacked GGUF weights W [N, K] (attention projections, lm_head), decoded in registers.

Three paths, by config:
  gemv     few rows of x: one program per (N-tile, row of x) streams its weight rows once, FMAs into a
           [BLOCK_N, pairs, 32] accumulator (decode.py's 3-D form) and reduces at the end.
  gemv_v2  the same grid with gemv_v2.py's word loads and per-group scales (every packed type, int8 x for those
           outside FLOAT_X_TYPES; float parts take torch).
  tile     tl.dot over [BLOCK_N, 32] decoded planes as the left operand (y^T = W x^T), M-blocks of x grouped
           so a band of weight tiles is reused from L2.
  tile64   the same grid, one 64-input pair decoded and multiplied a step, every load issued ahead by Triton's
           pipeliner (tile64.py; every packed type). Grid-type parts (from_blocks.GroupBlocks: their GGUF blocks)
           take this path alone, their groups' words loaded a step ahead by the kernel (from_groups.py; GROUPS).
A weight given as several parts (q | k | v of different types) runs one launch per part, each writing its own
output columns; parts that are float types use torch. Two consecutive gemv_v2 parts (q|k Q4_K and v Q6_K in a
Q4_K_M file) share one launch under the first one's config (``MOERUN_QUANT_JOINT=0``: one launch each; a Q4_K_M
batch-1 step on an H200 2.499 -> 2.358 ms, benchmarks/RESULTS.md).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from moerun.kernels.moe_parts import dot_precision, tile_pid
from moerun.kernels.quant.configs import default_matmul_config, dot_steps, get_matmul_config, gemv_steps
from moerun.kernels.quant.from_blocks import GroupBlocks
from moerun.kernels.quant.decode import dequant_pair, supported, x_planes
from moerun.kernels.quant.from_groups import GROUP_TYPES, group_values64, group_words64
from moerun.kernels.quant.fused_moe_quant import dot_operand_dtype
from moerun.kernels.quant.gemv_v2 import V2_TYPES
from moerun.kernels.quant.int8_dot import Int8Rows
from moerun.kernels.quant.matmul_v2 import matmul_v2_part
from moerun.kernels.quant.repack import PackedWeight
from moerun.kernels.quant.tile64 import decode_pair64, tile64_supported
from moerun.kernels.interpreter import interpreting
from moerun.kernels.tile_configs import Config


@triton.jit
def _gemv_kernel(
    x_ptr,  # [M, K]
    y_ptr,  # [M, N_total]; this part writes columns [col_off, col_off + N)
    bias_ptr,  # [N_total] or a dummy
    wc, wh, ws, wd,  # weight arrays (repack.py)
    N,
    K,
    KQ,
    col_off,
    stride_xm,
    stride_ym,
    QW: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAIRS: tl.constexpr,
    UNROLL: tl.constexpr,
    EVEN_K: tl.constexpr,
):  # fmt: skip
    pid_n = tl.program_id(0)
    m = tl.program_id(1).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    rows = (offs_n % N).to(tl.int64)[:, None, None]  # [BLOCK_N, 1, 1]; wrapped rows are dropped at the store
    pair = tl.arange(0, PAIRS)[None, :, None]  # [1, PAIRS, 1]
    lane = tl.arange(0, 32)[None, None, :]  # [1, 1, 32]
    x_row = x_ptr + m * stride_xm
    acc = tl.zeros([BLOCK_N, PAIRS, 32], dtype=tl.float32)
    # UNROLL independent tiles per step keep more loads in flight without growing the accumulator.
    for it in range(0, KQ // (PAIRS * UNROLL)):
        for un in tl.static_range(UNROLL):
            q = (it * UNROLL + un) * PAIRS + pair
            k0 = q * 64 + lane  # [1, PAIRS, 32]
            if EVEN_K:
                x0 = tl.load(x_row + k0).to(tl.float32)
                x1 = tl.load(x_row + k0 + 32).to(tl.float32)
            else:
                x0 = tl.load(x_row + k0, mask=k0 < K, other=0.0).to(tl.float32)
                x1 = tl.load(x_row + k0 + 32, mask=k0 + 32 < K, other=0.0).to(tl.float32)
            w0, w1 = dequant_pair(QW, wc, wh, ws, wd, rows, q, lane, KQ)
            acc += w0 * x0
            acc += w1 * x1
    y = tl.sum(tl.sum(acc, axis=2), axis=1)  # [BLOCK_N]
    n_ok = offs_n < N
    if HAS_BIAS:
        y += tl.load(bias_ptr + col_off + offs_n, mask=n_ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + m * stride_ym + col_off + offs_n, y.to(y_ptr.dtype.element_ty), mask=n_ok)


# The row count of x follows the batch, so it is not specialised on.
@triton.jit(do_not_specialize=["M"])
def _tile_kernel(
    x_ptr,  # [M, K]
    y_ptr,  # [M, N_total]
    bias_ptr,
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
    PAIRS: tl.constexpr,
    GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    PAIR64: tl.constexpr = False,  # tile64: a whole pair decoded a step (tile64.py)
    GROUPS: tl.constexpr = False,  # a grid type: wc its GGUF blocks, wh its table (from_groups.py)
    INTERPRET: tl.constexpr = False,
):  # fmt: skip
    pid_m, pid_n = tile_pid(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    m_ok = offs_m < M
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    rows = (offs_n % N).to(tl.int64)[:, None]  # [BLOCK_N, 1]
    lane_k = tl.arange(0, 32)
    lane = lane_k[None, :]  # [1, 32]
    x_cols = x_ptr + tl.where(m_ok, offs_m, 0).to(tl.int64)[None, :] * stride_xm  # [1, BLOCK_M]
    cdt = x_ptr.dtype.element_ty
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)  # y^T
    if GROUPS:  # a pair a step, its group words loaded one step ahead (their loads are too narrow to pipeline)
        offs_k = tl.arange(0, 64)[:, None]  # [64, 1]
        tl.assume(KQ > 0)
        w0, w1, wsc, wdl = group_words64(QW, wc, wh, rows, 0, KQ)  # [8, BLOCK_N, 1] each
        for q in range(0, KQ):
            w = group_values64(QW, w0, w1, wsc, wdl, INTERPRET)  # [BLOCK_N, 64]
            w0, w1, wsc, wdl = group_words64(QW, wc, wh, rows, tl.minimum(q + 1, KQ - 1), KQ)
            k = q * 64 + offs_k  # [64, 1]
            xt = tl.load(x_cols + k, mask=m_ok[None, :] & (k < K), other=0.0)  # [64, BLOCK_M]
            acc = tl.dot(w.to(cdt).to(DOT_DTYPE), xt.to(DOT_DTYPE), acc, input_precision=DOT_PRECISION)
    elif PAIR64:  # decoded weights rounded to the activation dtype, as dequantize(dtype) rounds them
        offs_k = tl.arange(0, 64)[:, None]  # [64, 1]
        tl.assume(KQ > 0)  # lets the products overlap the decode (tile64.py)
        for q in range(0, KQ):
            k = q * 64 + offs_k  # [64, 1]
            xt = tl.load(x_cols + k, mask=m_ok[None, :] & (k < K), other=0.0)  # [64, BLOCK_M]
            w = decode_pair64(QW, wc, wh, ws, wd, rows, q, KQ, INTERPRET)  # [BLOCK_N, 64]
            acc = tl.dot(w.to(cdt).to(DOT_DTYPE), xt.to(DOT_DTYPE), acc, input_precision=DOT_PRECISION)
    else:
        tl.assume(KQ // PAIRS > 0)  # PAIRS divides KQ; as in the tile64 loop above
        for it in range(0, KQ // PAIRS):
            for j in tl.static_range(PAIRS):
                q = it * PAIRS + j
                xa, xb = x_planes(x_cols, q, lane_k, m_ok[None, :], K, EVEN_K)  # [32, BLOCK_M] each
                w0, w1 = dequant_pair(QW, wc, wh, ws, wd, rows, q, lane, KQ)  # [BLOCK_N, 32] each
                # Decoded weights are rounded to the activation dtype, as dequantize(dtype) rounds them.
                acc = tl.dot(w0.to(cdt).to(DOT_DTYPE), xa.to(DOT_DTYPE), acc, input_precision=DOT_PRECISION)
                acc = tl.dot(w1.to(cdt).to(DOT_DTYPE), xb.to(DOT_DTYPE), acc, input_precision=DOT_PRECISION)

    n_ok = offs_n < N
    if HAS_BIAS:
        acc += tl.load(bias_ptr + col_off + offs_n, mask=n_ok, other=0.0).to(tl.float32)[:, None]
    y_ptrs = y_ptr + offs_m.to(tl.int64)[None, :] * stride_ym + col_off + offs_n[:, None]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=m_ok[None, :] & n_ok[:, None])


def _launch_part(x: torch.Tensor, y: torch.Tensor, w: PackedWeight, bias: torch.Tensor | None, col_off: int,
                 cfg: Config, x_int8: Int8Rows | None = None) -> None:  # fmt: skip
    """Columns [col_off, col_off + w.n) of y [M, N_total] = x [M, K] @ w^T (+ bias)."""
    M, K = x.shape
    has_bias = bias is not None
    b = bias if has_bias else y
    common = dict(QW=int(w.qtype), HAS_BIAS=has_bias, BLOCK_N=cfg["BLOCK_N"], EVEN_K=w.k_pad == K,
                  num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])  # fmt: skip
    grouped = w.qtype in GROUP_TYPES
    if grouped and cfg["path"] != "tile64":
        cfg = default_matmul_config(M, w.n, qtype=w.qtype.name)
    if cfg["path"] == "gemv_v2" and w.qtype in V2_TYPES:
        matmul_v2_part(x, y, w, bias, col_off, cfg, x_int8)
        return
    if cfg["path"] in ("gemv", "gemv_v2"):
        grid = (triton.cdiv(w.n, cfg["BLOCK_N"]), M)
        pairs, unroll = gemv_steps(cfg["BLOCK_K"], w.kq)
        _gemv_kernel[grid](x, y, b, *w.kernel_args(), w.n, K, w.kq, col_off, x.stride(0), y.stride(0),
                           PAIRS=pairs, UNROLL=unroll, **common)  # fmt: skip
        return
    grid = (triton.cdiv(M, cfg["BLOCK_M"]) * triton.cdiv(w.n, cfg["BLOCK_N"]),)
    _tile_kernel[grid](
        x, y, b, *w.kernel_args(), M, w.n, K, w.kq, col_off, x.stride(0), y.stride(0),
        BLOCK_M=cfg["BLOCK_M"], GROUP_M=cfg["GROUP_M"], PAIRS=dot_steps(cfg["BLOCK_K"], w.kq),
        DOT_DTYPE=dot_operand_dtype(x.dtype), DOT_PRECISION=dot_precision(x.dtype),
        PAIR64=cfg["path"] == "tile64" and tile64_supported(w.qtype), GROUPS=grouped, INTERPRET=interpreting(),
        **common,
    )  # fmt: skip


def quant_matmul_triton(
    x: torch.Tensor,
    parts: Sequence[PackedWeight] | PackedWeight,
    bias: torch.Tensor | None = None,
    config: Config | None = None,
    x_int8: Int8Rows | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [M, K] @ W^T (+ bias) -> [M, N] in x's dtype; W [N, K] is the row-stacked parts (any mix of types).

    config applies to every part; by default each part takes its own (configs.get_matmul_config). Grid-type parts
    (GroupBlocks) run tile64 alone: under a config of another path they take its default tiles. x_int8: x already
    rounded to int8 (int8_dot.Int8Rows), which the parts whose config rounds x read instead. out: where to write
    the result (an [M, N] view with unit stride along N, e.g. columns of a wider output), returned."""
    parts = [parts] if isinstance(parts, PackedWeight) else list(parts)
    M, K = x.shape
    n_total = sum(p.n for p in parts)
    for p in parts:
        if len(p.shape) != 2 or p.k != K:
            raise ValueError(f"weight part of shape {p.shape} does not take inputs of length {K}")
        if not p.is_dense and not supported(p.qtype) and p.qtype not in GROUP_TYPES:
            raise ValueError(f"weight type {p.qtype.name} has no quantized kernel")
        if p.qtype in GROUP_TYPES and not isinstance(p, GroupBlocks):
            raise ValueError(f"a {p.qtype.name} part is read from its GGUF blocks (GroupBlocks)")
    if bias is not None and tuple(bias.shape) != (n_total,):
        raise ValueError(f"bias of shape {tuple(bias.shape)} does not match {n_total} outputs")
    if out is not None and (tuple(out.shape) != (M, n_total) or out.stride(-1) != 1 or out.dtype != x.dtype):
        raise ValueError(f"out must be [{M}, {n_total}] {x.dtype} with unit stride along N, got "
                         f"{tuple(out.shape)} {out.dtype} {out.stride()}")  # fmt: skip
    y = torch.empty(M, n_total, dtype=x.dtype, device=x.device) if out is None else out  # [M, N]
    if M == 0:
        return y
    x = x.contiguous()
    col, i = 0, 0
    while i < len(parts):
        p = parts[i]
        if p.is_dense:
            b = None if bias is None else bias[col : col + p.n]
            y[:, col : col + p.n] = F.linear(x, p.codes.to(x.dtype), b)
        else:
            cfg = config or get_matmul_config(p.qtype.name, p.n, K, M)
            nxt = parts[i + 1] if i + 1 < len(parts) else None
            if nxt is not None and _joins(p, nxt, cfg):  # both parts in one launch, under the first one's config
                matmul_v2_part(x, y, p, bias, col, cfg, x_int8, second=(nxt, col + p.n))
                col, i = col + p.n + nxt.n, i + 2
                continue
            _launch_part(x, y, p, bias, col, cfg, x_int8)
        col, i = col + p.n, i + 1
    return y


def _joins(a: PackedWeight, b: PackedWeight, cfg: Config) -> bool:
    """Whether parts a, b (consecutive, same K) run as one gemv_v2 launch under a's config: unless
    ``MOERUN_QUANT_JOINT=0``, when both are of the types gemv_v2 reads and the config is of that path and reads x
    as it is or as int8 (x_prep's layout depends on the type)."""
    return (os.environ.get("MOERUN_QUANT_JOINT", "1") != "0" and not b.is_dense and a.qtype in V2_TYPES
            and b.qtype in V2_TYPES and cfg["path"] == "gemv_v2" and not cfg.get("x_prep"))  # fmt: skip


def int8_input_pad(parts: Sequence[PackedWeight], M: int) -> int | None:
    """The padded K at which some part's default config (configs.get_matmul_config at M rows) rounds x to int8,
    else None."""
    for p in parts:
        if not p.is_dense and p.qtype in V2_TYPES and get_matmul_config(p.qtype.name, p.n, p.k, M).get("x_q8"):
            return p.k_pad
    return None


def int8_roundings(parts: Sequence[PackedWeight], M: int) -> tuple[bool, ...]:
    """Per part, whether quant_matmul_triton (no config given) rounds x [M, K] to int8 for it: a part that joins
    the launch of the one before it is read as that one's config says."""
    out: list[bool] = []
    i = 0
    while i < len(parts):
        p = parts[i]
        if p.is_dense:
            out.append(False)
            i += 1
            continue
        cfg = get_matmul_config(p.qtype.name, p.n, p.k, M)
        q8 = cfg["path"] == "gemv_v2" and p.qtype in V2_TYPES and bool(cfg.get("x_q8"))
        joined = i + 1 < len(parts) and _joins(p, parts[i + 1], cfg)
        out += [q8] * (2 if joined else 1)
        i += 2 if joined else 1
    return tuple(out)

