"""Fused experts of one MoE layer over repacked GGUF weights (repack.py), decoded in registers (decode.py).

Same semantics as kernels/fused_moe.py's fused_moe_triton: GEMM 1 over gate|up with SiLU(gate)*up in its
epilogue, GEMM 2 over down with the routing weights, then the sum over the k slots. The paths, by config:
  gemv      decode: one program per (token-slot, N-tile) streams the slot's expert rows once; each step decodes
            [BLOCK_N, pairs, 32] weight tiles and FMAs them into an accumulator of that shape, reduced at the end.
  gemv_dot  decode, same grid, but the decoded [BLOCK_N, 32] planes go through tl.dot against the slot's
            activations padded to BLOCK_M columns: tensor cores take the multiply-adds off the FMA pipe.
  gemv_v2   decode, every packed type (gemv_v2.py; int8 x for those outside FLOAT_X_TYPES): int32 word loads,
            sub-block scales folded into per-group sums, the k-slot sum inside GEMM 2.
  tile      prefill (moe_tiles.py, as gemv_dot and tile64): token-slots sorted by expert and padded (align.py),
            an expert's last block short tiles under TAIL_M / TAIL_M2; each step decodes [BLOCK_N, 32] planes
            that enter tl.dot as the left operand (out^T = W x^T), so decoded weights never leave registers.
  dequant   prefill: the layer's experts decoded to the activation dtype in one launch per part
            (decode.dequantize_triton, into a scratch buffer), then kernels/fused_moe.py's fused_moe_triton, whose
            pipelined tensor-core tiles may outweigh the decoded layer's write and read at thousands of tokens.
  tile64    prefill, every packed type: the tile kernels with a whole 64-input pair decoded (tile64.py)
            and multiplied a step (PAIR64), every load of a step issued ahead by Triton's pipeliner. Grid-type
            parts (IQ1 ... IQ3, GroupBlocks: their GGUF blocks as they are) take this path alone, their groups'
            words loaded a step ahead by the kernel itself (from_groups.py; GROUPS).
Gate and up may be different quant types (two pointer sets) or rows of one packed tensor (row offsets).
Nothing reads back to the host, so a decode step can be captured in a CUDA graph.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from moerun.kernels.align import align_tokens
from moerun.kernels.fused_moe import fused_moe_triton
from moerun.kernels.moe_parts import dot_precision, finish_reduce, new_reduce_buffer, silu_mul
from moerun.kernels.quant.configs import default_moe_config, dot_steps, gemv_steps, get_moe_config, normalize_config
from moerun.kernels.quant.decode import dequant_pair, dequantize_triton, supported
from moerun.kernels.quant.from_blocks import GroupBlocks
from moerun.kernels.quant.from_groups import GROUP_TYPES
from moerun.kernels.quant.gemv_v2 import FLOAT_X_TYPES, PartTables, fused_moe_gemv_v2, v2_supported
from moerun.kernels.quant.int8_dot import Int8Rows
from moerun.kernels.quant.moe_tiles import gemm1_tile_kernel, gemm2_tile_kernel
from moerun.kernels.quant.repack import PackedWeight
from moerun.kernels.quant.tile64 import tile64_supported
from moerun.kernels.tickets import ticket_counters
from moerun.kernels.interpreter import interpreting
from moerun.kernels.tile_configs import Config
from moerun.kernels.topk_select import TopkSelect

_SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
RowsOf = tuple[PackedWeight, int]  # a packed tensor and the first row of one projection (gate or up) in it


# -------------------------------------------------------------------------------------------------- gemv


@triton.jit
def _gemm1_gemv_kernel(
    x_ptr,  # [T, H]
    ids_ptr,  # [T*k]
    inter_ptr,  # [T*k, I]
    gc, gh, gs, gd,  # gate arrays (repack.py)
    uc, uh, us, ud,  # up arrays
    top_k,
    H,
    I,  # noqa: E741
    G_ROWS,  # rows per expert of the packed tensor holding gate, and gate's first row in it
    G_OFF,
    U_ROWS,
    U_OFF,
    KQ,  # pairs per row (padded H / 64)
    stride_xt,
    stride_it,
    QG: tl.constexpr,
    QU: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAIRS: tl.constexpr,
    UNROLL: tl.constexpr,
    EVEN_K: tl.constexpr,
):  # fmt: skip
    slot = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(ids_ptr + slot).to(tl.int64)
    token = (slot // top_k).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    # Wrapped rows keep the weight loads unmasked; their outputs are dropped at the store.
    n = (offs_n % I).to(tl.int64)
    rows_g = (expert * G_ROWS + G_OFF + n)[:, None, None]  # [BLOCK_N, 1, 1]
    rows_u = (expert * U_ROWS + U_OFF + n)[:, None, None]
    pair = tl.arange(0, PAIRS)[None, :, None]  # [1, PAIRS, 1]
    lane = tl.arange(0, 32)[None, None, :]  # [1, 1, 32]
    x_row = x_ptr + token * stride_xt
    # Partial products stay 3-D across the K loop; one reduction at the end instead of one per step.
    acc_g = tl.zeros([BLOCK_N, PAIRS, 32], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_N, PAIRS, 32], dtype=tl.float32)
    # UNROLL independent tiles per step keep more loads in flight without growing the accumulators.
    for it in range(0, KQ // (PAIRS * UNROLL)):
        for un in tl.static_range(UNROLL):
            q = (it * UNROLL + un) * PAIRS + pair  # [1, PAIRS, 1]
            k0 = q * 64 + lane  # [1, PAIRS, 32]
            if EVEN_K:
                x0 = tl.load(x_row + k0).to(tl.float32)
                x1 = tl.load(x_row + k0 + 32).to(tl.float32)
            else:
                x0 = tl.load(x_row + k0, mask=k0 < H, other=0.0).to(tl.float32)
                x1 = tl.load(x_row + k0 + 32, mask=k0 + 32 < H, other=0.0).to(tl.float32)
            g0, g1 = dequant_pair(QG, gc, gh, gs, gd, rows_g, q, lane, KQ)
            acc_g += g0 * x0
            acc_g += g1 * x1
            u0, u1 = dequant_pair(QU, uc, uh, us, ud, rows_u, q, lane, KQ)
            acc_u += u0 * x0
            acc_u += u1 * x1
    gate = tl.sum(tl.sum(acc_g, axis=2), axis=1)  # [BLOCK_N]
    up = tl.sum(tl.sum(acc_u, axis=2), axis=1)
    act = silu_mul(gate, up)
    tl.store(inter_ptr + slot.to(tl.int64) * stride_it + offs_n, act.to(inter_ptr.dtype.element_ty), mask=offs_n < I)


@triton.jit
def _gemm2_gemv_kernel(
    inter_ptr,  # [T*k, I]
    ids_ptr,  # [T*k]
    topk_w_ptr,  # [T*k]
    out_ptr,  # [T, H] fp32 (ATOMIC) or [T*k, H] fp32
    wc, wh, ws, wd,  # down arrays
    top_k,
    H,
    I,  # noqa: E741
    KQ,  # pairs per row (padded I / 64)
    stride_it,
    stride_ot,
    QW: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAIRS: tl.constexpr,
    UNROLL: tl.constexpr,
    EVEN_K: tl.constexpr,
    ATOMIC: tl.constexpr,
):  # fmt: skip
    slot = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(ids_ptr + slot).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    rows = (expert * H + (offs_n % H))[:, None, None]  # [BLOCK_N, 1, 1]
    pair = tl.arange(0, PAIRS)[None, :, None]
    lane = tl.arange(0, 32)[None, None, :]
    a_row = inter_ptr + slot.to(tl.int64) * stride_it
    acc = tl.zeros([BLOCK_N, PAIRS, 32], dtype=tl.float32)
    for it in range(0, KQ // (PAIRS * UNROLL)):
        for un in tl.static_range(UNROLL):
            q = (it * UNROLL + un) * PAIRS + pair
            k0 = q * 64 + lane
            if EVEN_K:
                a0 = tl.load(a_row + k0).to(tl.float32)
                a1 = tl.load(a_row + k0 + 32).to(tl.float32)
            else:
                a0 = tl.load(a_row + k0, mask=k0 < I, other=0.0).to(tl.float32)
                a1 = tl.load(a_row + k0 + 32, mask=k0 + 32 < I, other=0.0).to(tl.float32)
            w0, w1 = dequant_pair(QW, wc, wh, ws, wd, rows, q, lane, KQ)
            acc += w0 * a0
            acc += w1 * a1
    y = tl.sum(tl.sum(acc, axis=2), axis=1) * tl.load(topk_w_ptr + slot).to(tl.float32)  # [BLOCK_N]
    if ATOMIC:
        token = (slot // top_k).to(tl.int64)
        tl.atomic_add(out_ptr + token * stride_ot + offs_n, y, mask=offs_n < H, sem="relaxed")
    else:
        tl.store(out_ptr + slot.to(tl.int64) * stride_ot + offs_n, y, mask=offs_n < H)


# ------------------------------------------------------------------------------------------------ host side


def register_cap(cfg: Config, gemm: str) -> dict[str, int]:
    """The launch option capping registers a thread (config key "maxnreg" for GEMM 1, "maxnreg2" for GEMM 2), so
    that more programs fit an SM; none where the config sets no cap."""
    cap = cfg.get(f"maxnreg{gemm}")
    return {"maxnreg": cap} if cap else {}


def dot_operand_dtype(dtype: torch.dtype) -> tl.dtype:
    """tl.dot operand dtype for activations of `dtype`; float32 in the interpreter, which multiplies 16-bit
    operands as raw bits."""
    if interpreting():
        return tl.float32
    return {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}[dtype]


def gate_up_parts(rows: Sequence[int]) -> tuple[tuple[int, int], tuple[int, int]]:
    """((index, first row) of the part holding gate's rows, the same for up's) of w13 [E, 2I, H] given as parts of
    these row counts, stacked; ValueError when a part straddles the gate/up boundary."""
    half = sum(rows) // 2
    found = []
    for start in (0, half):
        offset = 0
        for i, n in enumerate(rows):
            if offset <= start and start + half <= offset + n:
                found.append((i, start - offset))
                break
            offset += n
        else:
            raise ValueError(f"rows [{start}, {start + half}) straddle parts of {list(rows)} rows")
    return found[0], found[1]


def split_gate_up(w13: Sequence[PackedWeight] | PackedWeight) -> tuple[RowsOf, RowsOf]:
    """((gate part, first row), (up part, first row)) of w13 given as row-stacked parts of [E, 2I, H]."""
    parts = [w13] if isinstance(w13, PackedWeight) else list(w13)
    (g, g_off), (u, u_off) = gate_up_parts([p.n for p in parts])
    return (parts[g], g_off), (parts[u], u_off)


def _gemv(x: torch.Tensor, gate: RowsOf, up: RowsOf, w2: PackedWeight, weights: torch.Tensor, ids: torch.Tensor,
          cfg: Config, out_dtype: torch.dtype) -> torch.Tensor:  # fmt: skip
    """gemv path: one program per (token-slot, N-tile), no sorting."""
    (gw, g_off), (uw, u_off) = gate, up
    T, H = x.shape
    I = w2.k  # noqa: E741
    k = ids.shape[1]
    slots = T * k
    atomic = cfg["reduce"] == "atomic"
    flat_ids = ids.reshape(-1)  # [T*k]
    inter = torch.empty(slots, I, dtype=x.dtype, device=x.device)  # [T*k, I]
    bn1 = cfg["BLOCK_N"]
    p1, u1 = gemv_steps(cfg["BLOCK_K"], gw.kq)
    _gemm1_gemv_kernel[(slots, triton.cdiv(I, bn1))](
        x, flat_ids, inter, *gw.kernel_args(), *uw.kernel_args(), k, H, I, gw.n, g_off, uw.n, u_off, gw.kq,
        x.stride(0), inter.stride(0), QG=int(gw.qtype), QU=int(uw.qtype), BLOCK_N=bn1,
        PAIRS=p1, UNROLL=u1, EVEN_K=gw.k_pad == H,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )  # fmt: skip
    acc = new_reduce_buffer(T, k, H, cfg["reduce"], x.device, out_dtype)
    bn2 = cfg["BLOCK_N2"]
    p2, u2 = gemv_steps(cfg["BLOCK_K2"], w2.kq)
    _gemm2_gemv_kernel[(slots, triton.cdiv(H, bn2))](
        inter, flat_ids, weights.reshape(-1), acc, *w2.kernel_args(), k, H, I, w2.kq, inter.stride(0),
        acc.stride(0), QW=int(w2.qtype), BLOCK_N=bn2, PAIRS=p2, UNROLL=u2, EVEN_K=w2.k_pad == I, ATOMIC=atomic,
        num_warps=cfg["num_warps2"], num_stages=cfg["num_stages2"],
    )  # fmt: skip
    return finish_reduce(acc, T, k, H, atomic, out_dtype)


def _tile(x: torch.Tensor, gate: RowsOf, up: RowsOf, w2: PackedWeight, weights: torch.Tensor, ids: torch.Tensor,
          cfg: Config, out_dtype: torch.dtype, tables: PartTables | None = None) -> torch.Tensor:  # fmt: skip
    """tile and tile64 paths (token-slots aligned by expert, grouped GEMMs over M-blocks) and gemv_dot path (one
    token-slot per M-block, no sorting: tensor cores at decode); experts through ``tables`` when given."""
    (gw, g_off), (uw, u_off) = gate, up
    T, H = x.shape
    E = tables[2].shape[0] if tables else w2.shape[0]
    I = w2.k  # noqa: E741
    k = ids.shape[1]
    slots = T * k
    atomic = cfg["reduce"] == "atomic"
    block_m = cfg["BLOCK_M"]
    per_slot = cfg["path"] == "gemv_dot"
    # GEMM 2 may take M-blocks a power-of-two multiple of GEMM 1's: the runs are padded to its size, and GEMM 1
    # covers each of its blocks in `div` blocks of its own.
    block_m2 = block_m if per_slot else cfg.get("BLOCK_M2", block_m)
    div = block_m2 // block_m
    if per_slot:
        flat_ids = ids.reshape(-1)
        sorted_ids, block_expert, num_pid_m, group_m = flat_ids, flat_ids, slots, 1
        inter_rows = slots
    else:
        align = align_tokens(ids, E, block_m2)
        sorted_ids, block_expert, group_m = align.sorted_ids, align.block_expert, cfg["GROUP_M"]
        num_pid_m = block_expert.numel()
        inter_rows = sorted_ids.numel()
    dot = dict(PER_SLOT=per_slot, DOT_DTYPE=dot_operand_dtype(x.dtype), DOT_PRECISION=dot_precision(x.dtype),
               INDIRECT=tables is not None, PAIR64=cfg["path"] == "tile64", INTERPRET=interpreting())
    inter = torch.empty(inter_rows, I, dtype=x.dtype, device=x.device)  # [P, I]
    bn1 = cfg["BLOCK_N"]
    n_tiles1 = triton.cdiv(I, bn1)
    split = {}
    if cfg.get("split13"):  # a program for gate and one for up on each tile, the second writing silu(gate) * up
        split = {"scratch_ptr": torch.empty(inter_rows, 2 * I, dtype=x.dtype, device=x.device),  # [P, 2I]
                 "ticket_ptr": ticket_counters(x.device, num_pid_m * div * n_tiles1, "quant_moe_split13"),
                 "SPLIT13": True}  # fmt: skip
    gemm1_tile_kernel[(num_pid_m * div * (2 if split else 1) * n_tiles1,)](
        x, inter, sorted_ids, block_expert, *gw.kernel_args(), *uw.kernel_args(),
        *(tables[:2] if tables else (ids, ids)), slots, k, H, I, gw.n, g_off, uw.n, u_off, gw.kq, num_pid_m * div,
        x.stride(0), inter.stride(0), QG=int(gw.qtype), QU=int(uw.qtype), BLOCK_M=block_m, BLOCK_N=bn1,
        PAIRS=dot_steps(cfg["BLOCK_K"], gw.kq), GROUP_M=group_m, EVEN_K=gw.k_pad == H, EXPERT_DIV=div,
        GROUPS=gw.qtype in GROUP_TYPES, TAIL_M=cfg["TAIL_M"], **dot, **split,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **register_cap(cfg, ""),
    )  # fmt: skip
    acc = new_reduce_buffer(T, k, H, cfg["reduce"], x.device, out_dtype)
    bn2 = cfg["BLOCK_N2"]
    gemm2_tile_kernel[(num_pid_m * triton.cdiv(H, bn2),)](
        inter, weights.reshape(-1), acc, sorted_ids, block_expert, *w2.kernel_args(), tables[2] if tables else ids,
        slots, k, H, I, w2.kq, num_pid_m, inter.stride(0), acc.stride(0),
        QW=int(w2.qtype), BLOCK_M=block_m2, BLOCK_N=bn2, PAIRS=dot_steps(cfg["BLOCK_K2"], w2.kq),
        GROUP_M=group_m, EVEN_K=w2.k_pad == I, ATOMIC=atomic, GROUPS=w2.qtype in GROUP_TYPES,
        TAIL_M=cfg.get("TAIL_M2", 0), **dot,
        num_warps=cfg["num_warps2"], num_stages=cfg["num_stages2"], **register_cap(cfg, "2"),
    )  # fmt: skip
    return finish_reduce(acc, T, k, H, atomic, out_dtype)


def _dequant(x: torch.Tensor, parts13: list[PackedWeight], w2: PackedWeight, weights: torch.Tensor,
             ids: torch.Tensor) -> torch.Tensor:
    """dequant path: w13's parts decoded into one [E, 2I, H] scratch (in row order), w2 into [E, H, I], both in x's
    dtype, then the dense fused MoE -> [T, H] in x's dtype."""
    E, H, I = w2.shape[0], w2.n, w2.k  # noqa: E741
    w13 = torch.empty(E, 2 * I, H, dtype=x.dtype, device=x.device)  # [E, 2I, H]
    row = 0
    for p in parts13:
        dequantize_triton(p, x.dtype, out=w13[:, row : row + p.n])
        row += p.n
    down = dequantize_triton(w2, x.dtype)  # [E, H, I]
    return fused_moe_triton(x, w13, down, weights, ids)


def fused_moe_quant(
    hidden: torch.Tensor,
    w13: Sequence[PackedWeight] | PackedWeight,
    w2: PackedWeight,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    config: Config | None = None,
    out_dtype: torch.dtype | None = None,
    tables: tuple[Sequence[torch.Tensor], torch.Tensor] | None = None,
    x_int8: Int8Rows | None = None,
    num_experts: int | None = None,
    keep_float32: bool = False,
    select: TopkSelect | None = None,
) -> torch.Tensor:
    """Experts of one MoE layer: hidden [T, H], w13 [E, 2I, H] (row-stacked parts: gate|up or gate, up),
    w2 [E, H, I] packed -> [T, H] in out_dtype (default: hidden's dtype); the expert GEMMs run in hidden's dtype as
    the reference. out_dtype float32 keeps the sum over the k slots unrounded (partial sums of expert subsets).

    ``tables`` = (one [E, 4] int64 table per w13 part, one for w2): expert e's arrays are read at the addresses
    of row e (``expert_addresses``), which may lie in any allocation, device or pinned host memory (read over
    PCIe); w13 and w2 then only give the types, shapes and pointer types (any number of experts). The decode
    paths run gemv_v2 or gemv_dot, prefill the tile path. ``x_int8``: hidden already
    rounded to int8 (int8_dot.Int8Rows), read by gemv_v2 configs that round x. ``num_experts``: the layer's expert
    count, which picks the tuned tables, where w13 and w2 stack another number of experts (a slot pool).
    ``keep_float32``: a config whose GEMM 2 adds into a float32 buffer (gemv_v2 with sum2 = "atomic") returns that
    buffer as it is, whatever out_dtype says. ``select``: topk_weights / topk_ids are buffers the routing picked
    from the router's logits is written into (by gemv_v2's GEMM 1, else first; kernels/topk_select.TopkSelect)."""
    T, H = hidden.shape
    gate, up = split_gate_up(w13)
    gw, uw = gate[0], up[0]
    parts13 = [w13] if isinstance(w13, PackedWeight) else list(w13)
    E, I = (tables[1].shape[0] if tables else w2.shape[0]), w2.k  # noqa: E741
    k = topk_ids.shape[1]
    for name, p, n in (("gate", gw, None), ("up", uw, None), ("down", w2, H)):
        if len(p.shape) != 3 or (tables is None and p.shape[0] != E) or (n is not None and p.n != n):
            raise ValueError(f"{name} weight has shape {p.shape}; expected [E={E}, rows, K]")
        if not supported(p.qtype) and p.qtype not in GROUP_TYPES:
            raise ValueError(f"{name} weight type {p.qtype.name} has no quantized kernel")
    if (gw.qtype in GROUP_TYPES) != (uw.qtype in GROUP_TYPES):
        raise ValueError(f"gate {gw.qtype.name} and up {uw.qtype.name}: both grid types or neither")
    grouped = any(p.qtype in GROUP_TYPES for p in (gw, uw, w2))
    if grouped and (tables is not None or any(not isinstance(p, GroupBlocks) for p in (gw, uw, w2)
                                              if p.qtype in GROUP_TYPES)):  # fmt: skip
        raise ValueError("grid-type experts are read from their GGUF blocks (GroupBlocks), stacked")
    if gw.k != H or uw.k != H or gw.kq != uw.kq:
        raise ValueError(f"gate/up rows have {gw.k}/{uw.k} inputs; expected H = {H}")
    two_i = sum(p.n for p in parts13)
    if two_i != 2 * I:
        raise ValueError(f"w13 has {two_i} rows; expected 2 x I = {2 * I} (I from w2 {w2.shape})")
    if tuple(topk_weights.shape) != (T, k):
        raise ValueError(f"topk_weights {tuple(topk_weights.shape)} must match topk_ids {tuple(topk_ids.shape)}")
    if hidden.dtype not in _SUPPORTED_DTYPES:
        raise ValueError(f"unsupported hidden dtype {hidden.dtype}")
    part_tables = None
    if tables is not None:
        t13, t2 = tables
        if len(t13) != len(parts13) or any(t.shape != (E, 4) or t.dtype != torch.int64 for t in (*t13, t2)):
            raise ValueError(f"tables must be one [E, 4] int64 table per w13 part ({len(parts13)}) and one for w2")
        index = {id(p): i for i, p in enumerate(parts13)}
        part_tables = (t13[index[id(gw)]].contiguous(), t13[index[id(uw)]].contiguous(), t2.contiguous())
    out_dtype = out_dtype or hidden.dtype
    if select is not None:
        select.check(topk_weights, topk_ids, num_experts or E)
    if T == 0:
        return torch.empty(0, H, dtype=out_dtype, device=hidden.device)
    x = hidden.contiguous()
    ids = topk_ids if topk_ids.dtype == torch.int32 else topk_ids.to(torch.int32)
    ids = ids.contiguous()
    weights = topk_weights.contiguous()
    cfg = _kernel_config(config, gw, uw, w2, num_experts or E, k, T, indirect=part_tables is not None,
                         dense_out=out_dtype == x.dtype)  # fmt: skip
    if select is not None and cfg["path"] != "gemv_v2":
        select.fill(weights, ids)
    if cfg["path"] == "dequant":
        return _dequant(x, parts13, w2, weights, ids)
    if cfg["path"] == "gemv_v2":
        if keep_float32 and cfg.get("sum2") == "atomic":
            out_dtype = torch.float32
        return fused_moe_gemv_v2(x, gate, up, w2, weights, ids, cfg, out_dtype, part_tables, x_int8, select)
    if cfg["path"] == "gemv":
        return _gemv(x, gate, up, w2, weights, ids, cfg, out_dtype)
    return _tile(x, gate, up, w2, weights, ids, cfg, out_dtype, part_tables)  # tile, tile64, gemv_dot: tl.dot


def _kernel_config(config: Config | None, gw: PackedWeight, uw: PackedWeight, w2: PackedWeight, E: int, k: int,
                   T: int, indirect: bool, dense_out: bool = True) -> Config:
    """The config fused_moe_quant runs for T tokens: the one given, else the tuned or default one, its path
    moved to one the kernels take (gemv_v2 only for the types it reads; the plain gemv kernels take no address
    tables; the dequant path, whose dense kernels round the slot sum to x's dtype, only for stacked experts and
    an output in x's dtype: ``dense_out``)."""
    cfg = normalize_config(config) if config is not None else get_moe_config(gw.qtype.name, E, gw.k, w2.k, k, T)
    group = next((p.qtype.name for p in (gw, uw, w2) if p.qtype in GROUP_TYPES), None)
    if group is not None and cfg["path"] != "tile64":
        if config is not None:
            raise ValueError(f"experts of grid types run the tile64 path alone, not {cfg['path']!r}")
        return default_moe_config(T, k, qtype=group)
    if cfg["path"] == "dequant" and (indirect or not dense_out):
        cfg = default_moe_config(T, k, qtype=gw.qtype.name)
    chosen = config is None or (indirect and cfg["path"] == "gemv")  # a gemv_v2 config not given as such
    if indirect and cfg["path"] == "gemv":
        cfg = normalize_config({**cfg, "path": "gemv_v2"})
    if cfg["path"] == "gemv_v2" and not v2_supported(gw, uw, w2):  # (sum2 is gemv_v2's alone)
        cfg = normalize_config({**{key: v for key, v in cfg.items() if key != "sum2"},
                                "path": "gemv_dot" if indirect else "gemv"})  # fmt: skip
    if cfg["path"] == "tile64" and (indirect or not tile64_supported(gw.qtype, uw.qtype, w2.qtype)):
        # the tile kernels decode every type and take address tables; two pairs a step, as their defaults
        cfg = {**cfg, "path": "tile", "BLOCK_K": 128, "BLOCK_K2": 128}
    if cfg["path"] == "gemv_v2" and chosen and gw.qtype not in FLOAT_X_TYPES:
        cfg = {**cfg, "x_q8": True}  # the only x these types are read with
    if cfg.get("split13") and (group is not None or cfg["path"] != "tile64"):
        if config is not None:
            raise ValueError("split13 (gate and up in programs of their own) needs the tile64 path on stacked "
                             f"experts of packed types, not {cfg['path']!r} with {group or 'address tables'}")
        cfg = {key: v for key, v in cfg.items() if key != "split13"}
    return cfg


def int8_input_pad(w13: Sequence[PackedWeight] | PackedWeight, w2: PackedWeight, k: int, T: int) -> int | None:
    """The padded H at which fused_moe_quant (no config given, no tables) rounds hidden [T, H] to int8, else
    None."""
    gate, _ = split_gate_up(w13)
    return gate[0].k_pad if int8_roundings(w13, w2, k, T)[0] else None


def int8_roundings(w13: Sequence[PackedWeight] | PackedWeight, w2: PackedWeight, k: int, T: int) -> tuple[bool, bool]:
    """Whether fused_moe_quant (no config given, no tables) rounds hidden [T, H] to int8 for GEMM 1, and GEMM 1's
    output to int8 for GEMM 2."""
    gate, up = split_gate_up(w13)
    cfg = _kernel_config(None, gate[0], up[0], w2, w2.shape[0], k, T, indirect=False)
    if cfg["path"] != "gemv_v2":
        return (False, False)
    return (bool(cfg.get("x_q8")), bool(cfg.get("inter_q8")) or w2.qtype not in FLOAT_X_TYPES)
