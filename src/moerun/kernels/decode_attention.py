"""Flash-decoding: one query token per sequence against its slot of the KV cache, split over the positions.

Stage 1 (grid B x n_kv x num_splits) runs an online softmax of all the query heads that share one kv head over
one chunk of positions (ceil(seq_len / num_splits) rounded up to BLOCK_N, read on the device) and writes a
partial output with its log-sum-exp; stage 2 (grid B x n_q) merges the chunks. The grid and every buffer depend only on B, n_q, n_kv, D, L and num_splits, never on seq_lens, so the
host never waits on the device and one CUDA graph serves every step of a batch-size bucket.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moerun.kernels.interpreter import interpreting
from moerun.kernels.rmsnorm import round_to

# tl.dot needs every tile side >= 16: query-head groups are padded up to this many rows
MIN_DOT = 16
LOG2E = 1.4426950408889634


@triton.jit
def _decode_partial_kernel(
    q_ptr,  # [B, n_q, D]
    k_ptr,  # [S, L, n_kv, D]
    v_ptr,  # [S, L, n_kv, D]
    slot_ptr,  # [B]
    seq_len_ptr,  # [B]
    o_part_ptr,  # [B, n_q, num_splits, D] float32
    lse_part_ptr,  # [B, n_q, num_splits] float32, log2 units
    qk_scale,  # softmax scale * log2(e): exp2 replaces exp
    num_splits,
    max_len,  # L: longer seq_lens are clamped to it
    stride_qb,
    stride_qh,
    stride_ks,
    stride_kl,
    stride_kh,
    stride_vs,
    stride_vl,
    stride_vh,
    N_Q: tl.constexpr,
    G: tl.constexpr,  # query heads per kv head
    BLOCK_G: tl.constexpr,
    D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.minimum(tl.load(seq_len_ptr + b).to(tl.int32), max_len)
    slot = tl.load(slot_ptr + b).to(tl.int64)
    # Chunks follow this sequence's own length, so a short sequence in a long cache still spreads over all
    # splits; programs past the end run no iterations and leave an empty partial.
    chunk = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    start = split * chunk
    end = tl.minimum(start + chunk, seq_len)

    g = tl.arange(0, BLOCK_G)  # [BLOCK_G]
    d = tl.arange(0, D)  # [D]
    g_mask = g < G
    heads = kv_head * G + g  # [BLOCK_G] query heads of this kv head
    q = tl.load(q_ptr + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + d[None, :],
                mask=g_mask[:, None], other=0.0)  # [BLOCK_G, D]
    if INTERPRET:
        q = q.to(tl.float32)
    k_base = k_ptr + slot * stride_ks + kv_head * stride_kh
    v_base = v_ptr + slot * stride_vs + kv_head * stride_vh

    m = tl.full([BLOCK_G], float("-inf"), tl.float32)  # running max (log2 units)
    l = tl.zeros([BLOCK_G], tl.float32)  # running sum of exp2(s - m)
    acc = tl.zeros([BLOCK_G, D], tl.float32)  # running sum of exp2(s - m) * v
    for n0 in range(start, end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)  # [BLOCK_N] cache positions
        n_mask = n < end
        k = tl.load(k_base + n[:, None] * stride_kl + d[None, :], mask=n_mask[:, None], other=0.0)  # [BLOCK_N, D]
        v = tl.load(v_base + n[:, None] * stride_vl + d[None, :], mask=n_mask[:, None], other=0.0)  # [BLOCK_N, D]
        if INTERPRET:
            k = k.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_G, BLOCK_N]
        s = tl.where(n_mask[None, :], s, float("-inf"))
        # every iterated block holds at least one valid position, so m_new is finite
        m_new = tl.maximum(m, tl.max(s, axis=1))  # [BLOCK_G]
        alpha = tl.math.exp2(m - m_new)  # [BLOCK_G], 0 on the first block
        p = tl.math.exp2(s - m_new[:, None])  # [BLOCK_G, BLOCK_N]
        l = l * alpha + tl.sum(p, axis=1)
        # p rounds to the cache dtype for the second product, as on the GPU's tensor cores
        p_v = round_to(p, v.dtype, INTERPRET)
        if INTERPRET:
            p_v = p_v.to(tl.float32)
            v = v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p_v, v, input_precision=DOT_PRECISION)
        m = m_new

    has_any = l > 0.0
    out = acc / tl.where(has_any, l, 1.0)[:, None]  # [BLOCK_G, D], zeros for an empty chunk
    lse = tl.where(has_any, m + tl.math.log2(tl.where(has_any, l, 1.0)), float("-inf"))  # [BLOCK_G]
    row = (b * N_Q + heads).to(tl.int64) * num_splits + split  # [BLOCK_G] index into [B, n_q, num_splits]
    tl.store(o_part_ptr + row[:, None] * D + d[None, :], out, mask=g_mask[:, None])
    tl.store(lse_part_ptr + row, lse, mask=g_mask)


@triton.jit
def _decode_combine_kernel(
    o_part_ptr,  # [B, n_q, num_splits, D] float32
    lse_part_ptr,  # [B, n_q, num_splits] float32, log2 units
    out_ptr,  # [B, n_q, D]
    num_splits,
    D: tl.constexpr,
    BLOCK_S: tl.constexpr,  # >= num_splits
    TILE_S: tl.constexpr,  # splits merged per iteration
    INTERPRET: tl.constexpr,
):
    bh = tl.program_id(0).to(tl.int64) * tl.num_programs(1) + tl.program_id(1)  # b * n_q + h
    splits = tl.arange(0, BLOCK_S)  # [BLOCK_S]
    lse_all = tl.load(lse_part_ptr + bh * num_splits + splits, mask=splits < num_splits, other=float("-inf"))
    lse_max = tl.max(lse_all, axis=0)
    # an all-empty row (seq_len 0) would give -inf - -inf; shift by 0 instead and output zeros
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)
    denom = tl.sum(tl.math.exp2(lse_all - lse_max), axis=0)

    d = tl.arange(0, D)  # [D]
    acc = tl.zeros([D], tl.float32)
    for s0 in range(0, num_splits, TILE_S):
        s_idx = s0 + tl.arange(0, TILE_S)  # [TILE_S]
        lse = tl.load(lse_part_ptr + bh * num_splits + s_idx, mask=s_idx < num_splits, other=float("-inf"))
        live = lse > float("-inf")  # empty partials are never read
        o = tl.load(o_part_ptr + (bh * num_splits + s_idx)[:, None] * D + d[None, :], mask=live[:, None],
                    other=0.0)  # [TILE_S, D]
        acc += tl.sum(tl.math.exp2(lse - lse_max)[:, None] * o, axis=0)
    out = acc / tl.where(denom > 0.0, denom, 1.0)  # [D]
    tl.store(out_ptr + bh * D + d, round_to(out, out_ptr.dtype.element_ty, INTERPRET))


def default_num_splits(batch: int, n_kv: int, max_len: int, block_n: int, device: torch.device) -> int:
    """A power of two giving about two programs per SM over B x n_kv x splits, at most one split per block."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132
    per_seq_head = max(1, (2 * sms) // (batch * n_kv))
    splits = 1 << (per_seq_head.bit_length() - 1)  # round down to a power of two
    return max(1, min(splits, triton.cdiv(max_len, block_n)))


def default_block_n(head_dim: int, dtype: torch.dtype) -> int:
    """Positions per iteration: at most 64, and a [BLOCK_N, D] tile of k (and of v) of at most 16 KiB."""
    return max(MIN_DOT, min(64, 16384 // (head_dim * dtype.itemsize)))


def decode_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_ids: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    num_splits: int | None = None,
    block_n: int | None = None,
) -> torch.Tensor:
    """softmax(q k^T * scale) v per sequence over cache positions [0, seq_lens[b]) of slot slot_ids[b] -> [B, n_q, D].

    D must be a power of two >= 16 (tl.dot tiles). seq_lens[b] >= 1 (0 gives zeros; larger than L reads L).
    """
    B, n_q, D = q.shape
    S, L, n_kv, _ = k_cache.shape
    _check(q, k_cache, v_cache, slot_ids, seq_lens)
    block_n = block_n or default_block_n(D, k_cache.dtype)
    if block_n < MIN_DOT or block_n & (block_n - 1):
        raise ValueError(f"block_n must be a power of two >= {MIN_DOT}, got {block_n}")
    if num_splits is None:
        num_splits = default_num_splits(B, n_kv, L, block_n, q.device)
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    out = torch.empty(B, n_q, D, dtype=q.dtype, device=q.device)  # [B, n_q, D]
    if B == 0:
        return out
    if q.stride(2) != 1:
        q = q.contiguous()
    o_part = torch.empty(B, n_q, num_splits, D, dtype=torch.float32, device=q.device)  # [B, n_q, splits, D]
    lse_part = torch.empty(B, n_q, num_splits, dtype=torch.float32, device=q.device)  # [B, n_q, splits]
    G = n_q // n_kv
    interpret = interpreting()
    _decode_partial_kernel[(B, n_kv, num_splits)](
        q,
        k_cache,
        v_cache,
        slot_ids,
        seq_lens,
        o_part,
        lse_part,
        scale * LOG2E,
        num_splits,
        L,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        N_Q=n_q,
        G=G,
        BLOCK_G=max(MIN_DOT, triton.next_power_of_2(G)),
        D=D,
        BLOCK_N=block_n,
        # float32 caches: full-precision products, not TF32
        DOT_PRECISION="ieee" if k_cache.dtype == torch.float32 else "tf32",
        INTERPRET=interpret,
        num_warps=4,
        enable_fp_fusion=True,  # explicit: Triton's default for this differs between releases
    )
    block_s = triton.next_power_of_2(num_splits)
    _decode_combine_kernel[(B, n_q)](
        o_part,
        lse_part,
        out,
        num_splits,
        D=D,
        BLOCK_S=block_s,
        TILE_S=min(block_s, 16),
        INTERPRET=interpret,
        num_warps=1 if D <= 64 else 2,
        enable_fp_fusion=True,
    )
    return out


def _check(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_ids: torch.Tensor, seq_lens: torch.Tensor
) -> None:
    """Shape and dtype checks only: nothing here reads device memory."""
    if q.dim() != 3:
        raise ValueError(f"q must be [B, n_q, D], got {tuple(q.shape)}")
    B, n_q, D = q.shape
    if D < MIN_DOT or D & (D - 1):
        raise ValueError(f"the Triton decode kernel needs a power-of-two head dim >= {MIN_DOT}, got {D}")
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape or k_cache.shape[3] != D:
        raise ValueError(f"k_cache, v_cache must both be [S, L, n_kv, {D}], got {tuple(k_cache.shape)}, "
                         f"{tuple(v_cache.shape)}")
    if k_cache.stride(3) != 1 or v_cache.stride(3) != 1:
        raise ValueError("k_cache and v_cache need a unit stride over the head dim")
    n_kv = k_cache.shape[2]
    if n_q % n_kv:
        raise ValueError(f"n_q={n_q} is not a multiple of n_kv={n_kv}")
    if not (q.dtype == k_cache.dtype == v_cache.dtype):
        raise ValueError(f"q, k_cache, v_cache dtypes differ: {q.dtype}, {k_cache.dtype}, {v_cache.dtype}")
    if slot_ids.shape != (B,) or seq_lens.shape != (B,):
        raise ValueError(f"slot_ids and seq_lens must be [{B}], got {tuple(slot_ids.shape)}, {tuple(seq_lens.shape)}")
