"""o_proj and the MoE router's logits in one launch, for decode (ops.o_proj_router).

The router reads norm(h) with h = r + o_proj(a) (r: the residual stream, a: the attention output), and RMSNorm is
a scale: norm(h) = g * h / rms(h). So its logits are (W_r * g) h / rms(h) = (M a + (W_r * g) r) / rms(h), with
M = (W_r * g) W_o, an [E, Q] matrix made once (moe/block.py). A launch of this kernel computes o_proj's rows and
writes h = r + o_proj(a) (the new residual stream), and beside them, in programs of their own, the router's rows
[M | W_r * g] against [a | r], writing the logits before the 1/rms; GEMM 1 then normalises h itself and scales the
logits (kernels/topk_select.TopkSelect with the norm). The router's launch, a latency-bound chain of loads between
o_proj and GEMM 1, is then not run (moe/block.py, on by default at one token; MOERUN_ROUTER_IN_OPROJ=0 turns it off).

Grid: ceil(E / BLOCK_R) router programs first (their rows are 1.5 times o_proj's long: fewer rows each, and a
start ahead of o_proj's programs, keep them from being the launch's tail), then ceil(H / BLOCK_N) o_proj programs;
each reads its rows once, one weight tile ahead of its products, as the dense GEMV (kernels/gemv.py) does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moerun.kernels.gemv import get_config, weight_tile
from moerun.kernels.interpreter import interpreting
from moerun.kernels.pdl import launch_dependents, launch_options, pdl_mode, wait_for_previous
from moerun.kernels.rmsnorm import residual_sum, round_to

MAX_TOKENS = 16  # the token rows are one tile


@triton.jit
def _rows_times(w_rows, w_first, x_ptr, t, t_mask, stride_xt, K: tl.constexpr, BLOCK_T: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    """w_rows [BLOCK_N, 1] (K-contiguous rows of K) times the token rows t of x [T, K] -> [BLOCK_T, BLOCK_N] float32;
    w_first: the rows' first tile, loaded by the caller (each step loads the next tile before its products)."""
    acc3 = tl.zeros([BLOCK_T, BLOCK_N, BLOCK_K], dtype=tl.float32)
    w_next = w_first
    last = ((K + BLOCK_K - 1) // BLOCK_K - 1) * BLOCK_K  # first column of the last tile
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)  # [BLOCK_K]
        w = w_next
        w_next = weight_tile(w_rows, tl.minimum(k0 + BLOCK_K, last), K, BLOCK_K, EVEN_K)  # the last re-reads its own
        if EVEN_K:
            x = tl.load(x_ptr + t.to(tl.int64)[:, None] * stride_xt + k[None, :], mask=t_mask[:, None], other=0.0)
        else:
            x = tl.load(x_ptr + t.to(tl.int64)[:, None] * stride_xt + k[None, :],
                        mask=t_mask[:, None] & (k < K)[None, :], other=0.0)  # fmt: skip
        acc3 += x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]  # [BLOCK_T, BLOCK_N, BLOCK_K]
    return tl.sum(acc3, axis=2)  # [BLOCK_T, BLOCK_N]


@triton.jit
def _o_proj_router_kernel(
    a_ptr,  # [T, Q] attention output
    r_ptr,  # [T, H] residual stream
    wo_ptr,  # [H, Q] o_proj weight
    rows_ptr,  # [E, Q + H]: M = (W_r * g) W_o, then W_r * g
    h_ptr,  # [T, H] out: r + o_proj(a), in r's dtype
    z_ptr,  # [T, E] float32 out: the router's logits times rms(h)
    T,
    E,
    stride_at,
    stride_rt,
    stride_ht,
    stride_zt,
    H: tl.constexpr,
    Q: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_N: tl.constexpr,  # o_proj rows a program
    BLOCK_R: tl.constexpr,  # router rows a program
    BLOCK_K: tl.constexpr,
    INTERPRET: tl.constexpr,
    PDL: tl.constexpr,
):
    launch_dependents(PDL)
    pid = tl.program_id(0)
    t = tl.arange(0, BLOCK_T)  # [BLOCK_T] token rows
    t_mask = t < T
    r_tiles = tl.cdiv(E, BLOCK_R)
    if pid >= r_tiles:
        n = (pid - r_tiles) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] columns of h
        n_mask = n < H
        w_rows = wo_ptr + (n % H).to(tl.int64)[:, None] * Q  # [BLOCK_N, 1]; rows past H re-read and are dropped
        w_first = weight_tile(w_rows, 0, Q, BLOCK_K, Q % BLOCK_K == 0)
        wait_for_previous(PDL)  # a and r come from the kernels before (the weights did not)
        o = _rows_times(w_rows, w_first, a_ptr, t, t_mask, stride_at, Q, BLOCK_T, BLOCK_N, BLOCK_K, Q % BLOCK_K == 0)
        mask = t_mask[:, None] & n_mask[None, :]
        r = tl.load(r_ptr + t.to(tl.int64)[:, None] * stride_rt + n[None, :], mask=mask, other=0.0)  # [T', N']
        o = round_to(o, r.dtype, INTERPRET)  # o_proj's output as it would be stored, then added as the norm adds it
        h = residual_sum(o, r, INTERPRET)
        tl.store(h_ptr + t.to(tl.int64)[:, None] * stride_ht + n[None, :], h, mask=mask)
    else:
        e = pid * BLOCK_R + tl.arange(0, BLOCK_R)  # [BLOCK_R] experts
        m_rows = rows_ptr + (e % E).to(tl.int64)[:, None] * (Q + H)  # [BLOCK_R, 1]
        m_first = weight_tile(m_rows, 0, Q, BLOCK_K, Q % BLOCK_K == 0)
        wait_for_previous(PDL)
        z = _rows_times(m_rows, m_first, a_ptr, t, t_mask, stride_at, Q, BLOCK_T, BLOCK_R, BLOCK_K, Q % BLOCK_K == 0)
        g_rows = m_rows + Q
        z += _rows_times(g_rows, weight_tile(g_rows, 0, H, BLOCK_K, H % BLOCK_K == 0), r_ptr, t, t_mask, stride_rt, H,
                         BLOCK_T, BLOCK_R, BLOCK_K, H % BLOCK_K == 0)  # fmt: skip
        z_mask = t_mask[:, None] & (e < E)[None, :]
        tl.store(z_ptr + t.to(tl.int64)[:, None] * stride_zt + e[None, :], z, mask=z_mask)


def o_proj_router_triton(a: torch.Tensor, residual: torch.Tensor, o_weight: torch.Tensor,
                         router_rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """(h = residual + a @ o_weight^T [T, H] in the residual's dtype, z = a @ M^T + residual @ (W_r * g)^T [T, E]
    float32) for a [T, Q], residual [T, H], o_weight [H, Q] and router_rows [E, Q + H] = [M | W_r * g]; the tiles
    are o_proj's tuned GEMV entry's (kernels/gemv.py), on multiply-adds."""
    check_o_proj_router(a, residual, o_weight, router_rows)
    T, Q = a.shape
    H, E = residual.shape[1], router_rows.shape[0]
    h = torch.empty(T, H, dtype=residual.dtype, device=a.device)  # [T, H]
    z = torch.empty(T, E, dtype=torch.float32, device=a.device)  # [T, E]
    if T == 0:
        return h, z
    cfg = get_config(H, Q, T, o_weight.dtype, a.device)
    block_n = min(cfg.block_n, triton.next_power_of_2(H))
    block_k = min(cfg.block_k, triton.next_power_of_2(min(H, Q)))
    block_r = max(1, block_n // 2)
    pdl = pdl_mode(a.device, T)
    grid = (triton.cdiv(E, block_r) + triton.cdiv(H, block_n),)
    _o_proj_router_kernel[grid](
        a, residual, o_weight, router_rows, h, z, T, E, a.stride(0), residual.stride(0), h.stride(0), z.stride(0),
        H=H, Q=Q, BLOCK_T=triton.next_power_of_2(T), BLOCK_N=block_n, BLOCK_R=block_r, BLOCK_K=block_k,
        INTERPRET=interpreting(),
        PDL=pdl, num_warps=cfg.num_warps, num_stages=cfg.num_stages, enable_fp_fusion=True, **launch_options(pdl),
    )  # fmt: skip
    return h, z


def check_o_proj_router(a: torch.Tensor, residual: torch.Tensor, o_weight: torch.Tensor,
                        router_rows: torch.Tensor) -> None:  # fmt: skip
    """Raises unless the operands are as o_proj_router_triton takes them (shapes, one dtype, contiguous rows, at
    most MAX_TOKENS tokens); nothing here reads device memory."""
    if a.dim() != 2 or residual.dim() != 2 or a.shape[0] != residual.shape[0]:
        raise ValueError(f"o_proj_router: a [T, Q] and residual [T, H] expected, got {tuple(a.shape)} and "
                         f"{tuple(residual.shape)}")  # fmt: skip
    T, Q = a.shape
    H = residual.shape[1]
    if tuple(o_weight.shape) != (H, Q) or router_rows.dim() != 2 or router_rows.shape[1] != Q + H:
        raise ValueError(f"o_proj_router: o_proj weight [{H}, {Q}] and router rows [E, {Q + H}] expected, got "
                         f"{tuple(o_weight.shape)} and {tuple(router_rows.shape)}")  # fmt: skip
    if len({a.dtype, residual.dtype, o_weight.dtype, router_rows.dtype}) != 1:
        raise ValueError(f"o_proj_router: one dtype expected, got {a.dtype}, {residual.dtype}, {o_weight.dtype}, "
                         f"{router_rows.dtype}")  # fmt: skip
    if not all(t.stride(-1) == 1 for t in (a, residual)) or not (o_weight.is_contiguous()
                                                               and router_rows.is_contiguous()):  # fmt: skip
        raise ValueError("o_proj_router: rows must be contiguous (the weights wholly)")
    if T > MAX_TOKENS:
        raise ValueError(f"o_proj_router: at most {MAX_TOKENS} tokens, got {T}")
