"""A quantized o_proj and the MoE router's logits in one decode launch (ops.o_proj_router_quant): the dense launch
of kernels/o_proj_router.py for a GGUF o_proj.

Router programs first, as there ([M | W_r * g] against [a^ | r], M made from the dequantised o_proj, a^ the
attention's output as its int8 rows hold it, the values o_proj multiplies); then o_proj's programs, gemv_v2's rows
over those int8 rows (the attention's int8 output, as the plain quantized o_proj reads them), each writing
h = r + o_proj(a^), the new residual stream. GEMM 1 of the experts then normalises h itself
(kernels/quant/gemv_v2.py with a TopkSelect carrying the RMSNorm), so the router's launch leaves the step.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moerun.kernels.interpreter import interpreting
from moerun.kernels.o_proj_router import MAX_TOKENS, router_logits_tile
from moerun.kernels.pdl import launch_dependents, launch_options, quant_pdl_mode, wait_for_previous
from moerun.kernels.quant.gemv_v2 import V2_TYPES, chunking, group_elems, part_arrays, positions_per_word
from moerun.kernels.quant.gemv_v2 import words_per_group
from moerun.kernels.quant.int8_dot import Int8Rows, emulate_dp4a
from moerun.kernels.quant.matmul_v2 import _matmul_v2_rows
from moerun.kernels.quant.repack import PackedWeight
from moerun.kernels.tile_configs import Config


@triton.jit
def _o_proj_router_v2_kernel(
    xq_ptr,  # [T, Q_pad / 4] the attention output's int8 words
    a8_ptr,  # the same words as int8 bytes [T, Q_pad], element order
    xs_ptr,  # [T, Q_pad / 16] float32 sums of 16
    dx_ptr,  # [T, Q_pad / 32] float32 scales
    r_ptr,  # [T, H] residual stream
    rows_ptr,  # [E, Q + H]: M = (W_r * g) W_o, then W_r * g
    h_ptr,  # [T, H] out: r + o_proj(a), in r's dtype
    z_ptr,  # [T, E] float32 out: the router's logits times rms(h)
    wc, wh, ws, wd,  # o_proj's arrays
    T,
    E,
    KQ,
    X_WORDS,
    stride_a8,
    stride_qt,
    stride_st,
    stride_dt,
    stride_rt,
    stride_ht,
    stride_zt,
    H: tl.constexpr,
    Q: tl.constexpr,
    QT: tl.constexpr,
    WPG: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_N: tl.constexpr,  # o_proj rows a program
    BLOCK_R: tl.constexpr,  # router rows a program
    BLOCK_KR: tl.constexpr,  # router K step
    BLOCK_G: tl.constexpr,
    FULL: tl.constexpr,
    REM: tl.constexpr,
    LOG_BG: tl.constexpr,
    EVEN_K: tl.constexpr,
    EMULATE_DP4A: tl.constexpr,
    INTERPRET: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    launch_dependents(PDL)
    pid = tl.program_id(0)
    m = tl.program_id(1)  # token row of the o_proj programs (router programs: all rows, from row 0's)
    r_tiles = tl.cdiv(E, BLOCK_R)
    if pid < r_tiles:
        if m == 0:
            t = tl.arange(0, BLOCK_T)  # [BLOCK_T]
            router_logits_tile(pid, a8_ptr, r_ptr, rows_ptr, z_ptr, t, t < T, E, stride_a8, stride_rt, stride_zt,
                               H, Q, BLOCK_T, BLOCK_R, BLOCK_KR, PDL, dx_ptr, stride_dt, True)  # fmt: skip
    else:
        wait_for_previous(PDL)
        row = m.to(tl.int64)
        # (on int8 x the rows read xq, dx and xs alone: the words stand in for x's row)
        _matmul_v2_rows(xq_ptr + row * stride_qt, xq_ptr + row * stride_qt, xs_ptr + row * stride_st,
                        dx_ptr + row * stride_dt, h_ptr + row * stride_ht, h_ptr, wc, wh, ws, wd, pid - r_tiles, H, Q,
                        KQ, 0, X_WORDS, QT, WPG, False, BLOCK_N, BLOCK_G, FULL, REM, LOG_BG, EVEN_K, False, True,
                        EMULATE_DP4A, r_ptr + row * stride_rt, True, INTERPRET)  # fmt: skip


def o_proj_router_v2(a: torch.Tensor, a_int8: Int8Rows, residual: torch.Tensor, w: PackedWeight,
                     router_rows: torch.Tensor, cfg: Config) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """(h = residual + a^ @ W_o^T [T, H] in the residual's dtype, z = a^ @ M^T + residual @ (W_r * g)^T [T, E]
    float32) for a [T, Q] (model dtype) with a_int8 its int8 rows (a^), residual [T, H], a packed o_proj w [H, Q]
    of a gemv_v2 type and router_rows [E, Q + H] = [M | W_r * g]; cfg: o_proj's gemv_v2 config with x_q8 (its
    BLOCK_N rows an o_proj program, half as many router rows a program)."""
    T, Q = a.shape
    H, E = residual.shape[1], router_rows.shape[0]
    check_o_proj_router_v2(a, a_int8, residual, w, router_rows, cfg)
    h = torch.empty(T, H, dtype=residual.dtype, device=a.device)  # [T, H]
    z = torch.empty(T, E, dtype=torch.float32, device=a.device)  # [T, E]
    if T == 0:
        return h, z
    block_n = cfg["BLOCK_N"]
    block_r = max(1, block_n // 2)
    pdl = quant_pdl_mode(a.device, T)
    grid = (triton.cdiv(E, block_r) + triton.cdiv(H, block_n), T)
    xq, dx, xs = a_int8
    a8 = xq.view(torch.int8)  # [T, Q_pad]
    _o_proj_router_v2_kernel[grid](
        xq, a8, xs, dx, residual, router_rows, h, z, *part_arrays(w), T, E, w.kq,
        w.k_pad // positions_per_word(w.qtype), a8.stride(0), xq.stride(0), xs.stride(0), dx.stride(0),
        residual.stride(0), h.stride(0), z.stride(0), H=H, Q=Q, QT=int(w.qtype), WPG=words_per_group(w.qtype),
        BLOCK_T=triton.next_power_of_2(T), BLOCK_N=block_n, BLOCK_R=block_r,
        BLOCK_KR=min(1024, triton.next_power_of_2(min(H, Q))), EVEN_K=w.k_pad == Q,
        **chunking(w.k_pad // group_elems(w.qtype), cfg["BLOCK_K"], w.qtype), EMULATE_DP4A=emulate_dp4a(),
        INTERPRET=interpreting(), PDL=pdl, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
        **launch_options(pdl),
    )  # fmt: skip
    return h, z


def check_o_proj_router_v2(a: torch.Tensor, a_int8: Int8Rows, residual: torch.Tensor, w: PackedWeight,
                           router_rows: torch.Tensor, cfg: Config) -> None:  # fmt: skip
    """Raises unless the operands are as o_proj_router_v2 takes them; nothing here reads device memory."""
    if a.dim() != 2 or residual.dim() != 2 or a.shape[0] != residual.shape[0]:
        raise ValueError(f"o_proj_router_v2: a [T, Q] and residual [T, H] expected, got {tuple(a.shape)} and "
                         f"{tuple(residual.shape)}")  # fmt: skip
    T, Q = a.shape
    H = residual.shape[1]
    if len(w.shape) != 2 or w.n != H or w.k != Q or w.qtype not in V2_TYPES:
        raise ValueError(f"o_proj_router_v2: a packed [{H}, {Q}] o_proj of a gemv_v2 type expected, got "
                         f"{w.qtype.name} {tuple(w.shape)}")  # fmt: skip
    if cfg.get("path") != "gemv_v2" or not cfg.get("x_q8"):
        raise ValueError("o_proj_router_v2: o_proj's config must be gemv_v2 on int8 x (x_q8)")
    if a_int8.k_pad != w.k_pad or a_int8.xq.shape[0] != T:
        raise ValueError(f"o_proj_router_v2: int8 rows of {a_int8.xq.shape[0]} x {a_int8.k_pad} values; expected "
                         f"{T} x {w.k_pad}")  # fmt: skip
    if router_rows.dim() != 2 or router_rows.shape[1] != Q + H or router_rows.dtype != a.dtype:
        raise ValueError(f"o_proj_router_v2: router rows [E, {Q + H}] in {a.dtype} expected, got "
                         f"{tuple(router_rows.shape)} {router_rows.dtype}")  # fmt: skip
    if residual.dtype != a.dtype or not all(t.stride(-1) == 1 for t in (a, residual)):
        raise ValueError("o_proj_router_v2: a and residual of one dtype with contiguous rows")
    if not router_rows.is_contiguous():
        raise ValueError("o_proj_router_v2: router rows must be contiguous")
    if T > MAX_TOKENS:
        raise ValueError(f"o_proj_router_v2: at most {MAX_TOKENS} tokens, got {T}")
