"""Per-head RMSNorm of q and k, NeoX rotary embedding, and the k/v cache write, in one Triton launch.

Every float op rounds to the model dtype where the torch composition (RMSNorm, then ``x*cos + rot(x)*sin``)
rounds, so the results differ from torch only through the order of the float32 sum of squares.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moerun.kernels.interpreter import interpreting
from moerun.kernels.pdl import launch_dependents, launch_options, pdl_mode, wait_for_previous
from moerun.kernels.rmsnorm import mean_of_squares_rows, round_to


# Prompts of more than this many tokens run several heads per program (decode keeps one head per program).
MANY_TOKENS = 16
HEADS_PER_PROGRAM = 8


@triton.jit
def norm_rope_heads(
    src_ptr,  # first element of head 0 of q or k in this token's qkv row
    heads,  # [HB] head indices; those at or past n_heads are padding
    n_heads,
    w_ptr,  # [D] the norm weight
    cos_ptr,  # [D] the table row of this token's position
    sin_ptr,  # [D]
    eps,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    """Heads [HB, D]: weight * rms_normalise(x), rotated NeoX style; returns [HB, BLOCK_D] in the source dtype."""
    half: tl.constexpr = D // 2
    d = tl.arange(0, BLOCK_D)  # [BLOCK_D]
    d_ok = d < D
    partner = tl.where(d < half, d + half, d - half)  # the element each one rotates with
    mask = (heads[:, None] < n_heads) & d_ok[None, :]  # [HB, BLOCK_D]
    rows = src_ptr + heads[:, None] * D  # [HB, 1]
    x = tl.load(rows + d[None, :], mask=mask, other=0.0)  # [HB, BLOCK_D] in the model dtype
    dtype = x.dtype
    xf = x.to(tl.float32)
    xpf = tl.load(rows + partner[None, :], mask=mask, other=0.0).to(tl.float32)
    inv_rms = tl.math.rsqrt(mean_of_squares_rows(xf, D, INTERPRET) + eps)[:, None]  # [HB, 1]
    w = tl.load(w_ptr + d, mask=d_ok, other=0.0).to(tl.float32)[None, :]  # [1, BLOCK_D]
    wp = tl.load(w_ptr + partner, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    normed = round_to(w * round_to(xf * inv_rms, dtype, INTERPRET).to(tl.float32), dtype, INTERPRET)
    normed_p = round_to(wp * round_to(xpf * inv_rms, dtype, INTERPRET).to(tl.float32), dtype, INTERPRET)
    rotated = tl.where((d < half)[None, :], -normed_p.to(tl.float32), normed_p.to(tl.float32))
    c = tl.load(cos_ptr + d, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    s = tl.load(sin_ptr + d, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    a = round_to(normed.to(tl.float32) * c, dtype, INTERPRET).to(tl.float32)
    b = round_to(rotated * s, dtype, INTERPRET).to(tl.float32)
    return round_to(a + b, dtype, INTERPRET)


@triton.jit
def _qk_norm_rope_write_kernel(
    qkv_ptr,  # [T, (n_q + 2 n_kv) * D]
    q_w_ptr,  # [D]
    k_w_ptr,  # [D]
    cos_ptr,  # [P, D]
    sin_ptr,  # [P, D]
    pos_ptr,  # [T]
    slot_ptr,  # [T]
    q_ptr,  # [T, n_q, D] output
    k_out_ptr,  # [T, n_kv, D] output (WRITE_K)
    k_cache_ptr,  # [S, L, n_kv, D]
    v_cache_ptr,  # [S, L, n_kv, D]
    eps,
    stride_qkv,
    stride_cos,
    stride_sin,
    stride_ks,
    stride_kl,
    stride_kh,
    stride_vs,
    stride_vl,
    stride_vh,
    N_Q: tl.constexpr,
    N_KV: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HB: tl.constexpr,  # heads per program
    WRITE_K: tl.constexpr,
    INTERPRET: tl.constexpr,
    PDL: tl.constexpr,
):
    launch_dependents(PDL)
    wait_for_previous(PDL)
    t = tl.program_id(0).to(tl.int64)
    group = tl.program_id(1)  # groups of q heads first, then of k heads (their columns follow q's in qkv)
    q_groups: tl.constexpr = (N_Q + HB - 1) // HB
    pos = tl.load(pos_ptr + t).to(tl.int64)
    row_ptr = qkv_ptr + t * stride_qkv
    d = tl.arange(0, BLOCK_D)  # [BLOCK_D]
    cos_row = cos_ptr + pos * stride_cos
    sin_row = sin_ptr + pos * stride_sin
    if group < q_groups:
        heads = group * HB + tl.arange(0, HB)  # [HB]
        out = norm_rope_heads(row_ptr, heads, N_Q, q_w_ptr, cos_row, sin_row, eps, D, BLOCK_D, INTERPRET)
        mask = (heads[:, None] < N_Q) & (d[None, :] < D)
        tl.store(q_ptr + (t * N_Q + heads[:, None]) * D + d[None, :], out, mask=mask)
    else:
        kv = (group - q_groups) * HB + tl.arange(0, HB)  # [HB] kv heads
        out = norm_rope_heads(row_ptr + N_Q * D, kv, N_KV, k_w_ptr, cos_row, sin_row, eps, D, BLOCK_D, INTERPRET)
        mask = (kv[:, None] < N_KV) & (d[None, :] < D)
        slot = tl.load(slot_ptr + t).to(tl.int64)
        k_dst = k_cache_ptr + slot * stride_ks + pos * stride_kl + kv[:, None] * stride_kh + d[None, :]
        tl.store(k_dst, out.to(k_cache_ptr.dtype.element_ty), mask=mask)
        if WRITE_K:
            tl.store(k_out_ptr + (t * N_KV + kv[:, None]) * D + d[None, :], out, mask=mask)
        v = tl.load(row_ptr + (N_Q + N_KV + kv[:, None]) * D + d[None, :], mask=mask)  # v passes through unchanged
        v_dst = v_cache_ptr + slot * stride_vs + pos * stride_vl + kv[:, None] * stride_vh + d[None, :]
        tl.store(v_dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def qk_norm_rope_write_triton(
    qkv: torch.Tensor,
    q_norm_w: torch.Tensor,
    k_norm_w: torch.Tensor,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    token_slots: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    n_q: int,
    n_kv: int,
    k_out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Normalised, rotated q [T, n_q, D]; writes normalised, rotated k and raw v into the caches at (slot, position),
    and k also into ``k_out`` [T, n_kv, D] when given.

    positions must lie in the cos/sin tables and the cache, token_slots in the cache (not checked: no host reads).
    """
    D = cos.shape[-1]
    check_qk_inputs(qkv, q_norm_w, k_norm_w, cos, sin, positions, token_slots, k_cache, v_cache, n_q, n_kv, D)
    T = qkv.shape[0]
    if k_out is not None and (k_out.shape != (T, n_kv, D) or not k_out.is_contiguous() or k_out.dtype != qkv.dtype):
        raise ValueError(f"k_out must be a contiguous [{T}, {n_kv}, {D}] tensor of {qkv.dtype}, got "
                         f"{tuple(k_out.shape)} of {k_out.dtype}")
    if qkv.stride(1) != 1:
        qkv = qkv.contiguous()
    cos, sin = unit_inner_stride(cos), unit_inner_stride(sin)
    q = torch.empty(T, n_q, D, dtype=qkv.dtype, device=qkv.device)  # [T, n_q, D]
    if T == 0:
        return q
    block_d = triton.next_power_of_2(D)
    hb = HEADS_PER_PROGRAM if T > MANY_TOKENS else 1
    groups = triton.cdiv(n_q, hb) + triton.cdiv(n_kv, hb)
    pdl = pdl_mode(qkv.device, T)
    _qk_norm_rope_write_kernel[(T, groups)](
        qkv,
        q_norm_w.contiguous(),
        k_norm_w.contiguous(),
        cos,
        sin,
        positions,
        token_slots,
        q,
        k_out if k_out is not None else q,
        k_cache,
        v_cache,
        eps,
        qkv.stride(0),
        cos.stride(0),
        sin.stride(0),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        N_Q=n_q,
        N_KV=n_kv,
        D=D,
        BLOCK_D=block_d,
        HB=hb,
        WRITE_K=k_out is not None,
        INTERPRET=interpreting(),
        num_warps=max(1, min(hb * block_d // 256, 8)) if hb > 1 else (1 if block_d <= 128 else 2),
        # mul and add must round separately, as in torch; a fused multiply-add would round once
        enable_fp_fusion=False,
        PDL=pdl,
        **launch_options(pdl),
    )
    return q


def unit_inner_stride(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def check_qk_inputs(
    qkv: torch.Tensor,
    q_norm_w: torch.Tensor,
    k_norm_w: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    token_slots: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    n_q: int,
    n_kv: int,
    D: int,
) -> None:
    """Shape and dtype checks only: nothing here reads device memory."""
    if qkv.dim() != 2 or qkv.shape[1] != (n_q + 2 * n_kv) * D:
        raise ValueError(
            f"qkv must be [T, {(n_q + 2 * n_kv) * D}] for n_q={n_q}, n_kv={n_kv}, D={D}, got {tuple(qkv.shape)}"
        )
    if D % 2:
        raise ValueError(f"rotary needs an even head dim, got {D}")
    for name, w in (("q_norm_w", q_norm_w), ("k_norm_w", k_norm_w)):
        if w.shape != (D,) or w.dtype != qkv.dtype:
            raise ValueError(f"{name} must be [{D}] of {qkv.dtype}, got {tuple(w.shape)} of {w.dtype}")
    for name, table in (("cos", cos), ("sin", sin)):
        if table.dim() != 2 or table.shape[1] != D or table.dtype != qkv.dtype:
            raise ValueError(f"{name} must be [P, {D}] of {qkv.dtype}, got {tuple(table.shape)} of {table.dtype}")
    T = qkv.shape[0]
    if positions.shape != (T,) or token_slots.shape != (T,):
        raise ValueError(
            f"positions and token_slots must be [{T}], got {tuple(positions.shape)}, {tuple(token_slots.shape)}"
        )
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if cache.dim() != 4 or cache.shape[2:] != (n_kv, D) or cache.stride(3) != 1:
            raise ValueError(f"{name} must be [S, L, {n_kv}, {D}] with unit last stride, got {tuple(cache.shape)}")
