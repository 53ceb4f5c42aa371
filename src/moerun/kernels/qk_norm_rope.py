"""Per-head RMSNorm of q and k, NeoX rotary embedding, and the k/v cache write, in one Triton launch.

Every float op rounds to the model dtype where the torch composition (RMSNorm, then ``x*cos + rot(x)*sin``)
rounds, so the results differ from torch only through the order of the float32 sum of squares.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from moerun.kernels.interpreter import interpreting
from moerun.kernels.pdl import launch_dependents, launch_options, pdl_mode, wait_for_previous
from moerun.kernels.rmsnorm import mean_of_squares_rows, round_to
from moerun.kernels.tickets import ticket_counters


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
    CACHE: tl.constexpr,  # the heads' loads' cache modifier ("", or ".cg" for rows other programs of the launch stored)
):
    """Heads [HB, D]: weight * rms_normalise(x), rotated NeoX style; returns [HB, BLOCK_D] in the source dtype."""
    half: tl.constexpr = D // 2
    d = tl.arange(0, BLOCK_D)  # [BLOCK_D]
    d_ok = d < D
    partner = tl.where(d < half, d + half, d - half)  # the element each one rotates with
    mask = (heads[:, None] < n_heads) & d_ok[None, :]  # [HB, BLOCK_D]
    rows = src_ptr + heads[:, None] * D  # [HB, 1]
    x = tl.load(rows + d[None, :], mask=mask, other=0.0, cache_modifier=CACHE)  # [HB, BLOCK_D] in the model dtype
    dtype = x.dtype
    xf = x.to(tl.float32)
    xpf = tl.load(rows + partner[None, :], mask=mask, other=0.0, cache_modifier=CACHE).to(tl.float32)
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
def head_epilogue(
    y_row,  # this token's q|k|v row [(N_Q + 2 N_KV) * D] of the GEMV's output
    vals,  # [ROWS] the values this program stored at columns col0 + [0, ROWS) of it (within one head)
    col0,
    t,  # the token (row of x)
    qk,  # QkOperands
    QS: tl.constexpr,  # QkShape
    ROWS: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    """The work of _qk_norm_rope_write_kernel at the end of a q|k|v GEMV program (decode, no host reads): a program
    of a v head writes its values into the v cache; the last of a q or k head's D / ROWS programs to store its
    values normalises and rotates the whole head (read back from y) into q or the k cache, as that kernel does."""
    N_Q: tl.constexpr = QS.N_Q
    N_KV: tl.constexpr = QS.N_KV
    D: tl.constexpr = QS.D
    head = col0 // D
    pos = tl.load(qk.pos_ptr + t).to(tl.int64)
    slot = tl.load(qk.slot_ptr + t).to(tl.int64)
    if head >= N_Q + N_KV:  # v passes through unchanged
        d = col0 % D + tl.arange(0, ROWS)  # [ROWS]
        v_dst = qk.v_cache_ptr + slot * qk.stride_cs + pos * qk.stride_cl + (head - N_Q - N_KV) * qk.stride_ch + d
        tl.store(v_dst, vals.to(qk.v_cache_ptr.dtype.element_ty))
    else:
        counter = qk.counters_ptr + t * (N_Q + N_KV) + head
        tl.debug_barrier()  # every thread's values are stored before the ticket is taken
        if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == D // ROWS - 1:
            tl.atomic_xchg(counter, 0)  # the head is complete (acquire): reset for the next launch
            d = tl.arange(0, QS.BLOCK_D)  # [BLOCK_D]
            cos_row = qk.cos_ptr + pos * D
            sin_row = qk.sin_ptr + pos * D
            heads = head + tl.arange(0, 1)  # [1]
            if head < N_Q:
                out = norm_rope_heads(y_row, heads, N_Q, qk.q_w_ptr, cos_row, sin_row, qk.eps, D, QS.BLOCK_D,
                                      INTERPRET, ".cg")  # [1, BLOCK_D]
                tl.store(qk.q_ptr + (t * N_Q + heads[:, None]) * D + d[None, :], out, mask=d[None, :] < D)
            else:
                kv = heads - N_Q
                out = norm_rope_heads(y_row + N_Q * D, kv, N_KV, qk.k_w_ptr, cos_row, sin_row, qk.eps, D, QS.BLOCK_D,
                                      INTERPRET, ".cg")  # fmt: skip
                k_dst = qk.k_cache_ptr + slot * qk.stride_cs + pos * qk.stride_cl + kv[:, None] * qk.stride_ch + \
                    d[None, :]
                tl.store(k_dst, out.to(qk.k_cache_ptr.dtype.element_ty), mask=d[None, :] < D)


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
        out = norm_rope_heads(row_ptr, heads, N_Q, q_w_ptr, cos_row, sin_row, eps, D, BLOCK_D, INTERPRET, "")
        mask = (heads[:, None] < N_Q) & (d[None, :] < D)
        tl.store(q_ptr + (t * N_Q + heads[:, None]) * D + d[None, :], out, mask=mask)
    else:
        kv = (group - q_groups) * HB + tl.arange(0, HB)  # [HB] kv heads
        out = norm_rope_heads(row_ptr + N_Q * D, kv, N_KV, k_w_ptr, cos_row, sin_row, eps, D, BLOCK_D, INTERPRET,
                              "")
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


class QkEpilogue(NamedTuple):
    """What a q|k|v GEMV needs to end with the q/k norm, RoPE and k/v cache write (head_epilogue), and the q it
    writes: qk_norm_rope_write_triton's arguments, for the GEMV's output rows."""

    q_norm_w: torch.Tensor  # [D]
    k_norm_w: torch.Tensor  # [D]
    eps: float
    cos: torch.Tensor  # [P, D]
    sin: torch.Tensor  # [P, D]
    positions: torch.Tensor  # [T]
    token_slots: torch.Tensor  # [T]
    k_cache: torch.Tensor  # [S, L, n_kv, D]
    v_cache: torch.Tensor  # [S, L, n_kv, D]
    n_q: int
    n_kv: int
    q: torch.Tensor  # [T, n_q, D] output

    @classmethod
    def make(cls, T: int, dtype: torch.dtype, q_norm_w: torch.Tensor, k_norm_w: torch.Tensor, eps: float,
             cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor, token_slots: torch.Tensor,
             k_cache: torch.Tensor, v_cache: torch.Tensor, n_q: int, n_kv: int) -> QkEpilogue:  # fmt: skip
        """Checked as qk_norm_rope_write_triton checks its inputs, for a q|k|v output [T, (n_q + 2 n_kv) D] of
        dtype; q allocated."""
        D = cos.shape[-1]
        qkv = torch.empty(T, (n_q + 2 * n_kv) * D, dtype=dtype, device="meta")  # shapes and dtypes only
        check_qk_inputs(qkv, q_norm_w, k_norm_w, cos, sin, positions, token_slots, k_cache, v_cache, n_q, n_kv, D)
        if k_cache.stride() != v_cache.stride():
            raise ValueError(f"the k and v caches must share their strides, got {k_cache.stride()} and "
                             f"{v_cache.stride()}")  # fmt: skip
        q = torch.empty(T, n_q, D, dtype=dtype, device=cos.device)
        return cls(q_norm_w.contiguous(), k_norm_w.contiguous(), eps, cos.contiguous(), sin.contiguous(), positions,
                   token_slots, k_cache, v_cache, n_q, n_kv, q)  # fmt: skip

    @property
    def head_dim(self) -> int:
        return self.cos.shape[-1]

    def kernel_args(self) -> dict:
        """head_epilogue's arguments as keywords of a GEMV kernel that calls it: qk (QkOperands), QS (QkShape) and
        QK=True (the kernel's INTERPRET is its launcher's)."""
        T = self.q.shape[0]
        counters = ticket_counters(self.q.device, T * (self.n_q + self.n_kv), "qk_epilogue")
        kc = self.k_cache
        qk = QkOperands(counters, self.q, self.q_norm_w, self.k_norm_w, self.cos, self.sin, self.positions,
                        self.token_slots, kc, self.v_cache, self.eps, kc.stride(0), kc.stride(1), kc.stride(2))
        return dict(qk=qk, QS=QkShape(self.n_q, self.n_kv, self.head_dim, triton.next_power_of_2(self.head_dim)),
                    QK=True)  # fmt: skip


class QkOperands(NamedTuple):
    """head_epilogue's run-time operands, passed to a kernel as one argument."""

    counters_ptr: torch.Tensor  # [T, N_Q + N_KV] int32 ticket counters (tickets.py)
    q_ptr: torch.Tensor  # [T, N_Q, D] output
    q_w_ptr: torch.Tensor  # [D]
    k_w_ptr: torch.Tensor  # [D]
    cos_ptr: torch.Tensor  # [P, D] contiguous
    sin_ptr: torch.Tensor  # [P, D] contiguous
    pos_ptr: torch.Tensor  # [T]
    slot_ptr: torch.Tensor  # [T]
    k_cache_ptr: torch.Tensor  # [S, L, N_KV, D]
    v_cache_ptr: torch.Tensor  # [S, L, N_KV, D], strided as k_cache
    eps: float
    stride_cs: int  # the caches' strides along S, L and N_KV
    stride_cl: int
    stride_ch: int


class QkShape(NamedTuple):
    """head_epilogue's compile-time arguments, passed to a kernel as one constexpr."""

    N_Q: int
    N_KV: int
    D: int
    BLOCK_D: int


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
