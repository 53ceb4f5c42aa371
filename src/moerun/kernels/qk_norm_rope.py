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
from moerun.kernels.rmsnorm import mean_of_squares, round_to


@triton.jit
def _norm_rope_head(
    src_ptr,  # [D] one head of q or k
    w_ptr,  # [D] its norm weight
    cos_ptr,  # [D] the table row of its position
    sin_ptr,  # [D]
    eps,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    """One head [D]: weight * rms_normalise(x), rotated NeoX style; returns it in the source dtype."""
    half: tl.constexpr = D // 2
    d = tl.arange(0, BLOCK_D)  # [BLOCK_D]
    mask = d < D
    partner = tl.where(d < half, d + half, d - half)  # the element each one rotates with
    x = tl.load(src_ptr + d, mask=mask, other=0.0)  # [BLOCK_D] in the model dtype
    dtype = x.dtype
    xf = x.to(tl.float32)
    xpf = tl.load(src_ptr + partner, mask=mask, other=0.0).to(tl.float32)
    inv_rms = tl.math.rsqrt(mean_of_squares(xf, D, INTERPRET) + eps)
    w = tl.load(w_ptr + d, mask=mask, other=0.0).to(tl.float32)
    wp = tl.load(w_ptr + partner, mask=mask, other=0.0).to(tl.float32)
    normed = round_to(w * round_to(xf * inv_rms, dtype, INTERPRET).to(tl.float32), dtype, INTERPRET)
    normed_p = round_to(wp * round_to(xpf * inv_rms, dtype, INTERPRET).to(tl.float32), dtype, INTERPRET)
    # cat(-x2, x1): negation is exact, done in float32 because the interpreter cannot negate bfloat16
    rotated = tl.where(d < half, -normed_p.to(tl.float32), normed_p.to(tl.float32))
    c = tl.load(cos_ptr + d, mask=mask, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + d, mask=mask, other=0.0).to(tl.float32)
    # x*cos and rot*sin each round before the sum, as three separate torch ops do
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
    INTERPRET: tl.constexpr,
    PDL: tl.constexpr,
):
    launch_dependents(PDL)
    wait_for_previous(PDL)
    t = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)  # q heads first, then k heads (their columns follow q's in qkv)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    row_ptr = qkv_ptr + t * stride_qkv
    d = tl.arange(0, BLOCK_D)  # [BLOCK_D]
    mask = d < D
    cos_row = cos_ptr + pos * stride_cos
    sin_row = sin_ptr + pos * stride_sin
    if head < N_Q:
        out = _norm_rope_head(row_ptr + head * D, q_w_ptr, cos_row, sin_row, eps, D, BLOCK_D, INTERPRET)
        tl.store(q_ptr + (t * N_Q + head) * D + d, out, mask=mask)
    else:
        kv_head = head - N_Q
        out = _norm_rope_head(row_ptr + head * D, k_w_ptr, cos_row, sin_row, eps, D, BLOCK_D, INTERPRET)
        slot = tl.load(slot_ptr + t).to(tl.int64)
        k_dst = k_cache_ptr + slot * stride_ks + pos * stride_kl + kv_head * stride_kh
        tl.store(k_dst + d, out.to(k_cache_ptr.dtype.element_ty), mask=mask)
        v = tl.load(row_ptr + (N_Q + N_KV + kv_head) * D + d, mask=mask)  # v passes through unchanged
        v_dst = v_cache_ptr + slot * stride_vs + pos * stride_vl + kv_head * stride_vh
        tl.store(v_dst + d, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


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
) -> torch.Tensor:
    """Normalised, rotated q [T, n_q, D]; writes normalised, rotated k and raw v into the caches at (slot, position).

    positions must lie in the cos/sin tables and the cache, token_slots in the cache (not checked: no host reads).
    """
    D = cos.shape[-1]
    _check(qkv, q_norm_w, k_norm_w, cos, sin, positions, token_slots, k_cache, v_cache, n_q, n_kv, D)
    T = qkv.shape[0]
    if qkv.stride(1) != 1:
        qkv = qkv.contiguous()
    cos, sin = _unit_inner_stride(cos), _unit_inner_stride(sin)
    q = torch.empty(T, n_q, D, dtype=qkv.dtype, device=qkv.device)  # [T, n_q, D]
    if T == 0:
        return q
    block_d = triton.next_power_of_2(D)
    pdl = pdl_mode(qkv.device, T)
    _qk_norm_rope_write_kernel[(T, n_q + n_kv)](
        qkv,
        q_norm_w.contiguous(),
        k_norm_w.contiguous(),
        cos,
        sin,
        positions,
        token_slots,
        q,
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
        INTERPRET=interpreting(),
        num_warps=1 if block_d <= 128 else 2,
        # mul and add must round separately, as in torch; a fused multiply-add would round once
        enable_fp_fusion=False,
        PDL=pdl,
        **launch_options(pdl),
    )
    return q


def _unit_inner_stride(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _check(
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
