"""Decode-sized routing in one kernel: residual add + RMSNorm + router GEMV + softmax + top-k (+ renormalise).

Grid (T, SPLIT). Every program of a token rebuilds the normalised row itself (H elements, cheaper than a second
launch) and computes the logits of its share of the E router rows, rounded to the model dtype as F.linear
returns them, into a float32 scratch [T, E]. A per-token ticket counter elects the last program to finish: it
reads the scratch back through L2 and does the float32 softmax, top-k and renormalisation, then resets the
counter to zero so that the next launch (or CUDA-graph replay) starts clean. Program 0 of each token writes
the normalised row and the new residual; for quantized experts whose kernels round x to int8, that row rounded
too (route_fused_int8_triton), a slice a program after the routing. Splitting the 0.5 MB of router weights over
SPLIT programs per token spreads the read over as many SMs; SPLIT = 1 is one program per token, with no ticket.
route_fused_logits_triton stops at the logits (no ticket, no top-k), for experts whose GEMM 1 picks from them.

The roundings follow the unfused path (kernels/rmsnorm.py's, then F.linear in the model dtype, then
kernels/router.py's softmax_topk), so only float32 summation orders differ.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from moerun.kernels.interpreter import interpreting
from moerun.kernels.pdl import launch_dependents, launch_options, pdl_mode, wait_for_previous
from moerun.kernels.quant.int8_dot import Int8Rows, check_k_pad, quantize_store_row
from moerun.kernels.rmsnorm import add_rms_norm_row, check_norm_operands, rms_norm_slice, round_to
from moerun.kernels.router import softmax_topk
from moerun.kernels.tickets import ticket_counters

_SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class FusedRouteConfig:
    """Launch knobs of the fused router kernel.

    split       programs per token, each computing about E / split router logits (1: no ticket counter)
    block_rows  router rows per loop step of a program; 0 takes the program's whole share in one step when it
                is at most 16384 weights (each step waits out one trip to memory: fewer steps, less latency)
    num_warps   warps per program
    """

    # H200, Qwen3-30B-A3B router (E=128, H=2048, bf16), per layer inside a CUDA graph (cold L2): split 32 (4 rows a
    # program, one step) took 6.4-6.7 us for 1-8 tokens and 7.3 us for 16, against 11.7-12.4 us for RMSNorm +
    # cuBLAS GEMV + softmax/top-k; split 16 was up to 0.4 us slower, split 64 no faster, and split 8 (several
    # steps a program) about twice as slow. One token: see SINGLE_TOKEN_CONFIG.
    split: int = 32
    block_rows: int = 0
    num_warps: int = 4

    def __post_init__(self) -> None:
        if self.split < 1:
            raise ValueError(f"split must be >= 1, got {self.split}")
        if self.block_rows < 0 or self.block_rows & (self.block_rows - 1):
            raise ValueError(f"block_rows must be 0 or a power of two, got {self.block_rows}")


DEFAULT_CONFIG = FusedRouteConfig()
# One token on a GPU: a one-warp program per router row. Its reductions (the norm's sum of squares, the top-k's
# maxima) stay inside the warp, with no shared-memory round trips between warps. H200, E=128, H=2048, 48 layers
# chained in a CUDA graph with PDL: 3.9 us a layer against 4.9 for DEFAULT_CONFIG (split 64 / 1 warp 4.1; split 16
# / 1 warp 63: too many weights per thread).
SINGLE_TOKEN_CONFIG = FusedRouteConfig(split=128, num_warps=1)


# Triton's interpreter runs programs one by one, each op at a fixed cost: the fewest programs that still take the
# top-k ticket (four a token; a quantized tiny-model generation 10% faster than at split 32).
INTERPRETER_CONFIG = FusedRouteConfig(split=4)


def default_config(tokens: int) -> FusedRouteConfig:
    """The launch config for ``tokens`` rows when the caller gives none: INTERPRETER_CONFIG in the interpreter,
    SINGLE_TOKEN_CONFIG for one token on a GPU, else DEFAULT_CONFIG."""
    if interpreting():
        return INTERPRETER_CONFIG
    return SINGLE_TOKEN_CONFIG if tokens == 1 else DEFAULT_CONFIG


class RouteOperands(NamedTuple):
    """The run-time operands of the routing programs (route_program), besides x, passed to a kernel as one
    argument."""

    res_ptr: torch.Tensor  # [T, H], or x without a residual
    norm_w_ptr: torch.Tensor  # [H]
    gate_ptr: torch.Tensor  # [E, H]
    normed_ptr: torch.Tensor  # [T, H] out
    res_out_ptr: torch.Tensor  # [T, H] out (never written without a residual)
    logits_ptr: torch.Tensor  # [T, E] float32 scratch
    counter_ptr: torch.Tensor  # [>= T] int32 top-k tickets, zero on entry and left zero
    weights_ptr: torch.Tensor  # [T, K] float32 out
    ids_ptr: torch.Tensor  # [T, K] int32 out
    xq_ptr: torch.Tensor  # Q8: the normalised rows as Int8Rows (int8_dot.quantize_x's layout, K padded to K_PAD)
    dx_ptr: torch.Tensor
    xs_ptr: torch.Tensor
    eps: float
    stride_r: int
    stride_g: int


class RouteShape(NamedTuple):
    """The compile-time arguments of the routing programs, passed to a kernel as one constexpr."""

    H: int
    E: int
    K: int
    RENORMALIZE: bool
    HAS_RESIDUAL: bool
    SPLIT: int  # programs per token
    ROWS: int  # router rows per program, cdiv(E, SPLIT)
    BLOCK_ROWS: int
    BLOCK_H: int
    BLOCK_E: int
    K_PAD: int  # Q8: the int8 rows' padded length
    Q8: bool
    Q_BLOCK: int  # Q8: values each program rounds, a power of two >= 32 with SPLIT x Q_BLOCK >= K_PAD
    SELECT: bool = True  # False: the logits are the output (the experts' GEMM 1 picks from them); no ticket


@triton.jit
def _route_fused_kernel(
    x_ptr,  # [T, H]
    stride_x,
    ops,  # RouteOperands
    S: tl.constexpr,  # RouteShape
    INTERPRET: tl.constexpr,
    PDL: tl.constexpr,
):
    launch_dependents(PDL)
    route_program(tl.program_id(0).to(tl.int64), tl.program_id(1), x_ptr, stride_x, ops, S, INTERPRET, PDL)


@triton.jit
def route_program(token, split, x_ptr, stride_x, ops, S: tl.constexpr, INTERPRET: tl.constexpr, PDL: tl.constexpr):
    """Program ``split`` of token ``token``'s routing of x [T, H] (ops: RouteOperands, S: RouteShape)."""
    first = split * S.ROWS
    # The first step's router rows are requested before the norm (and before the previous kernel's end, with
    # PDL), so their trip to memory overlaps it.
    g, rows, row_ok = _load_router_rows(ops.gate_ptr, first, 0, ops.stride_g, S.H, S.E, S.ROWS, S.BLOCK_ROWS,
                                        S.BLOCK_H)  # fmt: skip
    wait_for_previous(PDL)
    # every program normalises the token's row; the first one stores it and the new residual
    normed, inv_rms = add_rms_norm_row(
        x_ptr, ops.res_ptr, ops.norm_w_ptr, ops.normed_ptr, ops.res_out_ptr, token, tl.where(split == 0, S.H, 0),
        ops.eps, stride_x, ops.stride_r, S.H, S.HAS_RESIDUAL, S.BLOCK_H, INTERPRET,
    )  # fmt: skip
    normed = normed.to(tl.float32)
    _store_logits(ops.logits_ptr, g, normed, token, rows, row_ok, S.E, INTERPRET)
    for r0 in range(S.BLOCK_ROWS, S.ROWS, S.BLOCK_ROWS):
        g_r, rows_r, ok_r = _load_router_rows(ops.gate_ptr, first, r0, ops.stride_g, S.H, S.E, S.ROWS, S.BLOCK_ROWS,
                                              S.BLOCK_H)  # fmt: skip
        _store_logits(ops.logits_ptr, g_r, normed, token, rows_r, ok_r, S.E, INTERPRET)
    if S.SELECT:
        # The barrier orders every thread's scratch stores before the release of the ticket (taken by one thread).
        tl.debug_barrier()
        if S.SPLIT == 1:
            _select_experts(ops.logits_ptr, ops.weights_ptr, ops.ids_ptr, token, S.E, S.K, S.RENORMALIZE, S.BLOCK_E)
        else:
            ticket = tl.atomic_add(ops.counter_ptr + token, 1, sem="acq_rel")
            if ticket == S.SPLIT - 1:
                _select_experts(ops.logits_ptr, ops.weights_ptr, ops.ids_ptr, token, S.E, S.K, S.RENORMALIZE,
                                S.BLOCK_E)  # fmt: skip
                tl.store(ops.counter_ptr + token, 0)
    if S.Q8:
        # The int8 row in slices of Q_BLOCK values, one a program (programs past K_PAD have none), after the
        # routing so that it never delays the last program's top-k. A slice is the normalised row's columns
        # computed again from x and the residual (L1 / L2 hits), bit for bit the values above.
        start = split * S.Q_BLOCK
        if start < S.K_PAD:
            v = rms_norm_slice(x_ptr, ops.res_ptr, ops.norm_w_ptr, token, start, inv_rms, stride_x, ops.stride_r, S.H,
                               S.HAS_RESIDUAL, S.Q_BLOCK, INTERPRET).to(tl.float32)  # fmt: skip
            quantize_store_row(v, S.Q_BLOCK, start, ops.xq_ptr, ops.dx_ptr, ops.xs_ptr, token, S.K_PAD, S.K_PAD)


@triton.jit
def _load_router_rows(
    gate_ptr, first, r0, stride_g,
    H: tl.constexpr, E: tl.constexpr, ROWS: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_H: tl.constexpr,
):  # fmt: skip
    """Router rows first + r0 + [0, BLOCK_ROWS) of this program's ROWS -> (weights [BLOCK_ROWS, BLOCK_H], row
    indices, row mask)."""
    offs = r0 + tl.arange(0, BLOCK_ROWS)  # [BLOCK_ROWS]
    rows = first + offs
    row_ok = (offs < ROWS) & (rows < E)
    cols = tl.arange(0, BLOCK_H)  # [BLOCK_H]
    g_ptrs = gate_ptr + rows.to(tl.int64)[:, None] * stride_g + cols[None, :]
    g = tl.load(g_ptrs, mask=row_ok[:, None] & (cols[None, :] < H), other=0.0)  # [BLOCK_ROWS, BLOCK_H]
    return g, rows, row_ok


@triton.jit
def _store_logits(logits_ptr, g, normed, token, rows, row_ok, E: tl.constexpr, INTERPRET: tl.constexpr):
    """Logits of router rows g [BLOCK_ROWS, BLOCK_H] for one normalised row [BLOCK_H], rounded to the weights'
    dtype as F.linear returns them, stored as float32 into the token's scratch row."""
    logit = tl.sum(g.to(tl.float32) * normed[None, :], axis=1)  # [BLOCK_ROWS]
    logit = round_to(logit, g.dtype, INTERPRET).to(tl.float32)
    tl.store(logits_ptr + token * E + rows, logit, mask=row_ok)


@triton.jit
def _select_experts(
    logits_ptr, weights_ptr, ids_ptr, token,
    E: tl.constexpr, K: tl.constexpr, RENORMALIZE: tl.constexpr, BLOCK_E: tl.constexpr,
):  # fmt: skip
    """Softmax + top-k of one token's scratch logits into its routing weights and expert ids."""
    cols = tl.arange(0, BLOCK_E)  # [BLOCK_E]
    # .cg reads through L2, where the other programs' logits are, never a stale L1 line.
    x = tl.load(logits_ptr + token * E + cols, mask=cols < E, other=0.0, cache_modifier=".cg")  # [BLOCK_E]
    top_w, top_i = softmax_topk(x[None, :], cols < E, K, RENORMALIZE, 1, BLOCK_E)  # [1, BLOCK_E]: slots < K
    slots = cols[None, :]  # [1, BLOCK_E]
    tl.store(weights_ptr + token * K + slots, top_w, mask=slots < K)
    tl.store(ids_ptr + token * K + slots, top_i, mask=slots < K)


def _check_inputs(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    gate_weight: torch.Tensor,
    k: int,
) -> None:
    check_norm_operands(x, norm_weight, residual)
    H = x.shape[1]
    if x.dtype not in _SUPPORTED_DTYPES:
        raise ValueError(f"unsupported dtype {x.dtype}; expected one of {_SUPPORTED_DTYPES}")
    if gate_weight.dim() != 2 or gate_weight.shape[1] != H or gate_weight.dtype != x.dtype:
        raise ValueError(
            f"gate weight must be [E, {H}] of {x.dtype}, got {tuple(gate_weight.shape)} {gate_weight.dtype}"
        )
    if not 1 <= k <= gate_weight.shape[0]:
        raise ValueError(f"k must be in [1, {gate_weight.shape[0]}], got {k}")


def route_fused_triton(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    gate_weight: torch.Tensor,
    k: int,
    renormalize: bool,
    config: FusedRouteConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x_normed [T, H], residual_out [T, H], topk_weights [T, k] float32, topk_ids [T, k] int32) of x [T, H].

    residual_out = x + residual (x itself when residual is None; never the residual buffer), x_normed its
    RMSNorm with norm_weight [H], and the routing the softmax + top-k of x_normed @ gate_weight^T [E, H].
    Correct for any T; it pays over the unfused kernels for decode-sized T (ops.moe.ROUTE_FUSED_MAX_TOKENS).
    """
    return _route_fused(x, residual, norm_weight, eps, gate_weight, k, renormalize, config, None)[:4]


def route_fused_logits_triton(
    x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float, gate_weight: torch.Tensor,
    config: FusedRouteConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """route_fused_triton up to the router logits: (x_normed [T, H], residual_out [T, H], logits [T, E] float32, each
    rounded to the weights' dtype as F.linear returns it). No softmax or top-k, so no program waits for another:
    the experts' kernels pick from the logits (kernels/topk_select.py)."""
    normed, residual_out, _, _, _, logits = _route_fused(x, residual, norm_weight, eps, gate_weight, 1, False, config,
                                                         None, select=False)  # fmt: skip
    return normed, residual_out, logits


def route_fused_int8_logits_triton(
    x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float, gate_weight: torch.Tensor,
    k_pad: int, config: FusedRouteConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Int8Rows]:
    """route_fused_logits_triton, plus x_normed rounded to int8 as route_fused_int8_triton writes it, in the same
    launch: (x_normed, residual_out, logits, the int8 rows)."""
    check_k_pad(k_pad, x.shape[-1])
    normed, residual_out, _, _, rows, logits = _route_fused(x, residual, norm_weight, eps, gate_weight, 1, False,
                                                            config, k_pad, select=False)  # fmt: skip
    assert rows is not None
    return normed, residual_out, logits, rows


def route_fused_int8_triton(
    x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float, gate_weight: torch.Tensor,
    k: int, renormalize: bool, k_pad: int, config: FusedRouteConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, Int8Rows]:
    """route_fused_triton, plus x_normed rounded to int8 as int8_dot.quantize_x(x_normed, k_pad) gives it (the
    input of quantized experts whose kernels round x), in the same launch."""
    check_k_pad(k_pad, x.shape[-1])
    out = _route_fused(x, residual, norm_weight, eps, gate_weight, k, renormalize, config, k_pad)
    assert out[4] is not None
    return out[:5]  # type: ignore[return-value]


def _route_fused(
    x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float, gate_weight: torch.Tensor,
    k: int, renormalize: bool, config: FusedRouteConfig | None, k_pad: int | None, select: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, Int8Rows | None, torch.Tensor]:
    """Every entry point: checks, one launch -> (normed, residual_out, weights, ids, the int8 rows when k_pad is
    given, logits); without ``select`` the weights and ids are left unwritten."""
    _check_inputs(x, residual, norm_weight, gate_weight, k)
    T, H = x.shape
    cfg = config or default_config(T)
    E = gate_weight.shape[0]
    if x.stride(1) != 1:
        x = x.contiguous()
    device = x.device
    normed = torch.empty(T, H, dtype=x.dtype, device=device)  # [T, H]
    residual_out = torch.empty_like(normed) if residual is not None else x  # [T, H]
    weights = torch.empty(T, k, dtype=torch.float32, device=device)  # [T, k]
    ids = torch.empty(T, k, dtype=torch.int32, device=device)  # [T, k]
    int8_rows = Int8Rows.empty(T, k_pad, device) if k_pad is not None else None
    logits = torch.empty(T, E, dtype=torch.float32, device=device)  # [T, E] scratch, or the output without select
    if T == 0:
        return normed, residual_out, weights, ids, int8_rows, logits
    ops, shape = _bundles(x, residual, norm_weight, gate_weight, normed, residual_out, logits, weights, ids, int8_rows,
                          eps, k, renormalize, cfg)  # fmt: skip
    shape = shape._replace(SELECT=select)
    pdl = pdl_mode(device, T)
    _route_fused_kernel[(T, shape.SPLIT)](
        x, x.stride(0), ops, shape, INTERPRET=interpreting(), num_warps=cfg.num_warps,
        # keeps x*x and the first adds of the sum of squares unfused, as kernels/rmsnorm.py does
        enable_fp_fusion=False, PDL=pdl, **launch_options(pdl),
    )  # fmt: skip
    return normed, residual_out, weights, ids, int8_rows, logits


def _bundles(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, gate_weight: torch.Tensor,
             normed: torch.Tensor, residual_out: torch.Tensor, logits: torch.Tensor, weights: torch.Tensor,
             ids: torch.Tensor, rows: Int8Rows | None, eps: float, k: int, renormalize: bool,
             cfg: FusedRouteConfig) -> tuple[RouteOperands, RouteShape]:  # fmt: skip
    """route_program's operands and shape for routing x [T, H] into the given outputs under cfg (the dummies where
    there is no residual or no int8 rows are x; the routing's tensors made unit-stride along H)."""
    H, E = x.shape[1], gate_weight.shape[0]
    if residual is not None and residual.stride(1) != 1:
        residual = residual.contiguous()
    if gate_weight.stride(1) != 1:
        gate_weight = gate_weight.contiguous()
    res = residual if residual is not None else x
    q8 = rows if rows is not None else (x, x, x)
    ops = RouteOperands(res, norm_weight.contiguous(), gate_weight, normed, residual_out, logits,
                        ticket_counters(x.device, x.shape[0], "route_fused"), weights, ids, q8[0], q8[1], q8[2], eps,
                        res.stride(0) if residual is not None else 0, gate_weight.stride(0))  # fmt: skip
    rows_per = triton.cdiv(E, min(cfg.split, E))  # router rows per program
    split = triton.cdiv(E, rows_per)  # no program without rows
    k_pad = rows.k_pad if rows is not None else 0
    block_h = triton.next_power_of_2(max(H, k_pad))
    shape = RouteShape(H, E, k, bool(renormalize), residual is not None, split, rows_per,
                       min(cfg.block_rows or max(1, 16384 // block_h), triton.next_power_of_2(rows_per)), block_h,
                       triton.next_power_of_2(E), k_pad, rows is not None,
                       max(32, triton.next_power_of_2(triton.cdiv(k_pad, split))) if rows is not None else 32)
    return ops, shape
