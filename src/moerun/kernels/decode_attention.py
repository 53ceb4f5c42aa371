"""Flash-decoding: one query token per sequence against its slot of the KV cache, split over the positions.

A program of the grid B x n_kv x num_splits runs an online softmax of all the query heads that share one kv
head over one chunk of positions (ceil(seq_len / num_splits) rounded up to BLOCK_N, and in the single launch
to at least MIN_CHUNK, at least 1 / MAX_LIVE of the sequence, and the whole sequence up to ONE_CHUNK positions;
seq_len is read on the device).
The chunks are then merged by their log-sum-exps, in one of two ways (SINGLE_LAUNCH picks the default):
  single launch  the splits that hold positions ("live" ones: every program of a (sequence, kv head) derives
                 the same count from seq_len) write partials and take a ticket from a counter per (sequence,
                 kv head); the last to arrive merges them in split order and resets the counter to 0. Splits
                 past the end exit at once, and a sequence that fits one chunk writes its output directly.
  two launches   every split writes a partial (an empty one past the end); a second kernel (grid B x n_q)
                 merges them.
The grid and every buffer depend only on B, n_q, n_kv, D, L and num_splits, never on seq_lens, so the host
never waits on the device and one CUDA graph serves every step of a batch-size bucket.
For a quantized o_proj whose kernel rounds x to int8 (decode_attention_int8_triton), the program that stores a kv
head's query heads in the single launch also stores them rounded to int8 (quant/int8_dot.py's layout).
decode_attention_qk_triton also takes over qk_norm_rope.py's work for the new token (the single launch in "QK
mode"): the program whose chunk holds the new position first writes that position's k and v into the cache, then
a block barrier makes them visible to its own reads; each program with positions to attend to normalises and
rotates its kv head's query heads from the q|k|v row itself.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from moerun.kernels.interpreter import interpreting
from moerun.kernels.pdl import launch_dependents, launch_options, pdl_mode, wait_for_previous
from moerun.kernels.qk_norm_rope import check_qk_inputs, norm_rope_heads, unit_inner_stride
from moerun.kernels.quant.int8_dot import Int8Rows, check_k_pad, quantize_store_row, quantize_x
from moerun.kernels.rmsnorm import round_to
from moerun.kernels.tickets import ticket_counters

# tl.dot needs every tile side >= 16: query-head groups are padded up to this many rows
MIN_DOT = 16
LOG2E = 1.4426950408889634
# The default merge: True for the single launch, False for the partial + combine kernels (kept to compare).
SINGLE_LAUNCH = True
# Single launch, by default: a sequence of at most ONE_CHUNK positions runs as one program per (sequence, kv head)
# with no merge; a longer one splits into chunks of at least MIN_CHUNK positions (rounded up to BLOCK_N) and at
# least 1 / MAX_LIVE of its length, so that long ones merge fewer, longer chunks. On an H200, batch 1, Qwen3-30B
# heads, 48 layers in a graph (benchmarks/RESULTS.md): 5.1 us a layer at 160 positions in one chunk (2 chunks of
# 128: 6.3); at 512, 7.0 us in chunks of 128 against 8.4 in chunks of 256; at 4096, chunks of 256 beat 128.
ONE_CHUNK = 256
MIN_CHUNK = 128
MAX_LIVE = 16
# Positions a step at most, and bytes of a [BLOCK_N, D] tile of k (and of v) at most (default_block_n); warps a
# program.
MAX_BLOCK_N = 64
MAX_TILE_BYTES = 16384
NUM_WARPS = 4
# At most this many positions a step where the launch also rounds its output to int8 (a quantized o_proj's input:
# decode_attention_int8_triton, decode_attention_qk_triton with k_pad). On an H100, Q4_K_M batch-1 steps at a
# 128-token prompt were 0.02-0.03 ms shorter with 32 than with 64 in three runs, while bf16 steps (the plain
# launch) were 0.01 ms longer (benchmarks/RESULTS.md).
INT8_MAX_BLOCK_N = 32


@triton.jit
def _chunk_bounds(seq_len, split, num_splits, BLOCK_N: tl.constexpr, MIN_CHUNK: tl.constexpr,
                  ONE_CHUNK: tl.constexpr = 0, MAX_LIVE: tl.constexpr = 0):  # fmt: skip
    """(start, end, live splits) of one split's positions. Chunks follow the sequence's own length, so a short
    sequence in a long cache still spreads over the splits, in chunks of at least MIN_CHUNK (a multiple of
    BLOCK_N) positions and, with MAX_LIVE, at most MAX_LIVE of them; a sequence of at most ONE_CHUNK positions is
    one chunk. Splits from `live` on hold no position."""
    chunk = tl.maximum(tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N, MIN_CHUNK)
    if MAX_LIVE > 0:
        chunk = tl.maximum(chunk, tl.cdiv(tl.cdiv(seq_len, MAX_LIVE), BLOCK_N) * BLOCK_N)
    if ONE_CHUNK > 0:
        chunk = tl.where(seq_len <= ONE_CHUNK, tl.maximum(chunk, ONE_CHUNK), chunk)
    start = split * chunk
    return start, tl.minimum(start + chunk, seq_len), tl.cdiv(seq_len, chunk)


@triton.jit
def _chunk_softmax(q, k_base, v_base, start, end, stride_kl, stride_vl, qk_scale, BLOCK_G: tl.constexpr,
                   D: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr, INTERPRET: tl.constexpr):
    """Online softmax of q [BLOCK_G, D] over positions [start, end) of one kv head.

    Returns (acc [BLOCK_G, D] = sum exp2(s - m) v, l [BLOCK_G] = sum exp2(s - m), m [BLOCK_G] running max, log2
    units); l is 0 and m -inf for an empty range.
    """
    d = tl.arange(0, D)  # [D]
    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, D], tl.float32)
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
    return acc, l, m


@triton.jit
def _split_softmax(q_ptr, k_ptr, v_ptr, slot_ptr, b, kv_head, start, end, qk_scale, stride_qb, stride_qh,
                   stride_ks, stride_kl, stride_kh, stride_vs, stride_vl, stride_vh, G: tl.constexpr,
                   BLOCK_G: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
                   INTERPRET: tl.constexpr):  # fmt: skip
    """The online softmax of the query heads of kv_head (sequence b) over cache positions [start, end) of the
    sequence's slot: (acc [BLOCK_G, D], l, m [BLOCK_G], heads [BLOCK_G], g_mask [BLOCK_G])."""
    g = tl.arange(0, BLOCK_G)  # [BLOCK_G]
    d = tl.arange(0, D)  # [D]
    g_mask = g < G
    heads = kv_head * G + g  # [BLOCK_G] query heads of this kv head
    q = tl.load(q_ptr + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + d[None, :],
                mask=g_mask[:, None], other=0.0)  # [BLOCK_G, D]
    acc, l, m = _slot_softmax(q, k_ptr, v_ptr, slot_ptr, b, kv_head, start, end, qk_scale, stride_ks, stride_kl,
                              stride_kh, stride_vs, stride_vl, stride_vh, BLOCK_G, D, BLOCK_N, DOT_PRECISION,
                              INTERPRET)  # fmt: skip
    return acc, l, m, heads, g_mask


@triton.jit
def _slot_softmax(q, k_ptr, v_ptr, slot_ptr, b, kv_head, start, end, qk_scale, stride_ks, stride_kl, stride_kh,
                  stride_vs, stride_vl, stride_vh, BLOCK_G: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
                  DOT_PRECISION: tl.constexpr, INTERPRET: tl.constexpr):  # fmt: skip
    """_chunk_softmax of q [BLOCK_G, D] (the query heads of kv_head) over positions [start, end) of sequence b's
    cache slot."""
    slot = tl.load(slot_ptr + b).to(tl.int64)
    if INTERPRET:
        q = q.to(tl.float32)
    return _chunk_softmax(q, k_ptr + slot * stride_ks + kv_head * stride_kh,
                          v_ptr + slot * stride_vs + kv_head * stride_vh, start, end, stride_kl, stride_vl, qk_scale,
                          BLOCK_G, D, BLOCK_N, DOT_PRECISION, INTERPRET)  # fmt: skip


@triton.jit
def _write_new_kv(qkv_row, k_w_ptr, cos_row, sin_row, eps, pos, tslot, k_ptr, v_ptr, kv_head, writes, stride_ks,
                  stride_kl, stride_kh, stride_vs, stride_vl, stride_vh, N_Q: tl.constexpr, N_KV: tl.constexpr,
                  D: tl.constexpr, INTERPRET: tl.constexpr):  # fmt: skip
    """QK mode: where ``writes``, the new token's k (normed, rotated as qk_norm_rope.py does) and v of kv_head into
    the cache at (tslot, pos); then a block barrier, so that this program's cache reads after it see them."""
    d = tl.arange(0, D)  # [D]
    if writes:
        kv = kv_head + tl.arange(0, 1)  # [1]
        k_new = norm_rope_heads(qkv_row + N_Q * D, kv, N_KV, k_w_ptr, cos_row, sin_row, eps, D, D, INTERPRET)
        k_dst = k_ptr + tslot * stride_ks + pos * stride_kl + kv[:, None] * stride_kh + d[None, :]
        tl.store(k_dst, k_new.to(k_ptr.dtype.element_ty))  # [1, D]
        v_new = tl.load(qkv_row + (N_Q + N_KV + kv[:, None]) * D + d[None, :])  # v passes through unchanged
        tl.store(v_ptr + tslot * stride_vs + pos * stride_vl + kv[:, None] * stride_vh + d[None, :],
                 v_new.to(v_ptr.dtype.element_ty))
    tl.debug_barrier()  # every program reaches it: the writes are visible to the whole block after it


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
    """Two-launch path, stage 1: every split writes its partial (an empty one for splits past the end)."""
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.minimum(tl.load(seq_len_ptr + b).to(tl.int32), max_len)
    start, end, _ = _chunk_bounds(seq_len, split, num_splits, BLOCK_N, BLOCK_N)
    d = tl.arange(0, D)  # [D]
    acc, l, m, heads, g_mask = _split_softmax(q_ptr, k_ptr, v_ptr, slot_ptr, b, kv_head, start, end, qk_scale,
                                              stride_qb, stride_qh, stride_ks, stride_kl, stride_kh, stride_vs,
                                              stride_vl, stride_vh, G, BLOCK_G, D, BLOCK_N, DOT_PRECISION,
                                              INTERPRET)  # fmt: skip
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


@triton.jit
def _merge_live_splits(o_part_ptr, lse_part_ptr, rows, g_mask, live, BLOCK_GM: tl.constexpr, D: tl.constexpr,
                       BLOCK_S: tl.constexpr):
    """softmax-weighted sum of the partials of splits [0, live) of rows [BLOCK_GM] -> [BLOCK_GM, D] float32.

    BLOCK_S splits per step (one step at short contexts), merged with a running max in split order, so the
    result does not depend on which program merges. Partials are read from L2 (.cg): other programs wrote them.
    """
    d = tl.arange(0, D)  # [D]
    m = tl.full([BLOCK_GM], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_GM], tl.float32)
    acc = tl.zeros([BLOCK_GM, D], tl.float32)
    for s0 in range(0, live, BLOCK_S):
        s = s0 + tl.arange(0, BLOCK_S)  # [BLOCK_S]
        mask = g_mask[:, None] & (s < live)[None, :]  # [BLOCK_GM, BLOCK_S]
        lse = tl.load(lse_part_ptr + rows[:, None] + s[None, :], mask=mask, other=float("-inf"),
                      cache_modifier=".cg")
        o = tl.load(o_part_ptr + (rows[:, None, None] + s[None, :, None]) * D + d[None, None, :],
                    mask=mask[:, :, None], other=0.0, cache_modifier=".cg")  # [BLOCK_GM, BLOCK_S, D]
        lse = tl.where(g_mask[:, None], lse, 0.0)  # padding heads stay finite
        m_new = tl.maximum(m, tl.max(lse, axis=1))  # [BLOCK_GM], finite: every step holds a live split
        alpha = tl.math.exp2(m - m_new)  # 0 on the first step
        w = tl.math.exp2(lse - m_new[:, None])  # [BLOCK_GM, BLOCK_S], 0 for splits past `live`
        acc = acc * alpha[:, None] + tl.sum(w[:, :, None] * o, axis=1)
        l = l * alpha + tl.sum(w, axis=1)
        m = m_new
    return acc / l[:, None]


@triton.jit
def _store_out(out_ptr, out, b, kv_head, row_mask, N_Q: tl.constexpr, G: tl.constexpr, D: tl.constexpr,
               ROWS: tl.constexpr, INTERPRET: tl.constexpr, xq_ptr, dx_ptr, xs_ptr, K_PAD: tl.constexpr,
               Q8: tl.constexpr):  # fmt: skip
    """Stores out [ROWS, D] float32, row g the output of query head kv_head * G + g of sequence b (rows from G on
    are padding), rounded to out's dtype; with Q8 also that rounded row group as int8 (int8_dot.quantize_x's
    layout over the sequence's n_q * D outputs: D a multiple of 32, so no block crosses a head)."""
    g = tl.arange(0, ROWS)  # [ROWS]
    d = tl.arange(0, D)  # [D]
    rounded = round_to(out, out_ptr.dtype.element_ty, INTERPRET)
    dst = out_ptr + (b * N_Q + kv_head * G + g).to(tl.int64)[:, None] * D + d[None, :]
    tl.store(dst, rounded, mask=row_mask[:, None])
    start = kv_head * (G * D)
    if Q8:
        quantize_store_row(tl.reshape(rounded.to(tl.float32), [ROWS * D]), ROWS * D, start, xq_ptr, dx_ptr, xs_ptr,
                           b.to(tl.int64), K_PAD, start + G * D)  # fmt: skip


@triton.jit
def _decode_attention_kernel(
    q_ptr,  # [B, n_q, D]
    k_ptr,  # [S, L, n_kv, D]
    v_ptr,  # [S, L, n_kv, D]
    slot_ptr,  # [B]
    seq_len_ptr,  # [B]
    o_part_ptr,  # [B, n_q, num_splits, D] float32
    lse_part_ptr,  # [B, n_q, num_splits] float32, log2 units
    ticket_ptr,  # [B, n_kv] int32, 0 between launches
    out_ptr,  # [B, n_q, D]
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
    N_KV: tl.constexpr,
    G: tl.constexpr,  # query heads per kv head
    BLOCK_G: tl.constexpr,  # >= 16, the rows of the tl.dot tiles
    BLOCK_GM: tl.constexpr,  # next power of two >= G, the rows of the merge
    D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MIN_CHUNK: tl.constexpr,  # positions per split at least: fewer partials to merge at short contexts
    ONE_CHUNK: tl.constexpr,  # 0, or a sequence of at most this many positions is one chunk
    MAX_LIVE: tl.constexpr,  # 0, or the most chunks a sequence splits into (chunks no shorter than MIN_CHUNK)
    BLOCK_S: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    INTERPRET: tl.constexpr,
    PDL: tl.constexpr = 0,
    xq_ptr=None,  # Q8: the output rows as Int8Rows (int8_dot.quantize_x's layout, K_PAD = n_q * D)
    dx_ptr=None,
    xs_ptr=None,
    K_PAD: tl.constexpr = 0,
    Q8: tl.constexpr = 0,  # 1: the output also rounded to int8
    # QK mode: q is made here from the q|k|v row (per-head RMSNorm + RoPE), and the new token's k and v go into
    # the cache first (kernels/qk_norm_rope.py's work, without its launch); q_ptr is not read then
    qkv_ptr=None,  # [B, (n_q + 2 n_kv) D]
    q_w_ptr=None,  # [D]
    k_w_ptr=None,  # [D]
    cos_ptr=None,  # [P, D]
    sin_ptr=None,  # [P, D]
    pos_ptr=None,  # [B] the new token's position
    tslot_ptr=None,  # [B] the new token's cache slot
    eps=0.0,
    stride_qkv=0,
    stride_cos=0,
    stride_sin=0,
    QK: tl.constexpr = False,
):
    """Single-launch path: split-KV partials merged by the last live split of each (sequence, kv head)."""
    launch_dependents(PDL)
    wait_for_previous(PDL)
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.minimum(tl.load(seq_len_ptr + b).to(tl.int32), max_len)
    start, end, live = _chunk_bounds(seq_len, split, num_splits, BLOCK_N, MIN_CHUNK, ONE_CHUNK, MAX_LIVE)
    d = tl.arange(0, D)  # [D]
    if QK:
        pos = tl.load(pos_ptr + b).to(tl.int64)
        # the program whose chunk holds the new position writes its k and v (so that its own reads see them);
        # split 0 where no chunk holds it
        holds = (split < live) & (start <= pos) & (pos < end)
        qkv_row = qkv_ptr + b.to(tl.int64) * stride_qkv
        cos_row = cos_ptr + pos * stride_cos
        sin_row = sin_ptr + pos * stride_sin
        _write_new_kv(qkv_row, k_w_ptr, cos_row, sin_row, eps, pos, tl.load(tslot_ptr + b).to(tl.int64), k_ptr,
                      v_ptr, kv_head, holds | ((pos >= seq_len) & (split == 0)), stride_ks, stride_kl, stride_kh,
                      stride_vs, stride_vl, stride_vh, N_Q, N_KV, D, INTERPRET)  # fmt: skip
    if split < live:
        if QK:
            g = tl.arange(0, BLOCK_G)  # [BLOCK_G]
            g_mask = g < G
            heads = kv_head * G + g
            # the query heads of kv_head normed and rotated here; padding rows name no head and stay zero
            q = norm_rope_heads(qkv_row, tl.where(g_mask, heads, N_Q), N_Q, q_w_ptr, cos_row, sin_row, eps, D, D,
                                INTERPRET)  # [BLOCK_G, D]
            acc, l, m = _slot_softmax(q, k_ptr, v_ptr, slot_ptr, b, kv_head, start, end, qk_scale, stride_ks,
                                      stride_kl, stride_kh, stride_vs, stride_vl, stride_vh, BLOCK_G, D, BLOCK_N,
                                      DOT_PRECISION, INTERPRET)  # fmt: skip
        else:
            acc, l, m, heads, g_mask = _split_softmax(q_ptr, k_ptr, v_ptr, slot_ptr, b, kv_head, start, end,
                                                      qk_scale, stride_qb, stride_qh, stride_ks, stride_kl, stride_kh,
                                                      stride_vs, stride_vl, stride_vh, G, BLOCK_G, D, BLOCK_N,
                                                      DOT_PRECISION, INTERPRET)  # fmt: skip
        out = acc / tl.where(g_mask, l, 1.0)[:, None]  # [BLOCK_G, D]; a live chunk has l > 0
        if live == 1:
            # the whole sequence in one chunk: no partials, no ticket
            _store_out(out_ptr, out, b, kv_head, g_mask, N_Q, G, D, BLOCK_G, INTERPRET, xq_ptr, dx_ptr, xs_ptr, K_PAD,
                       Q8)  # fmt: skip
        else:
            row = (b * N_Q + heads).to(tl.int64) * num_splits + split  # [BLOCK_G] into [B, n_q, num_splits]
            tl.store(o_part_ptr + row[:, None] * D + d[None, :], out, mask=g_mask[:, None])
            tl.store(lse_part_ptr + row, m + tl.math.log2(tl.where(g_mask, l, 1.0)), mask=g_mask)
            tl.debug_barrier()  # every thread's partial is written before the ticket is taken
            # only live splits take a ticket: every program of this (b, kv head) computes the same `live`
            ticket_at = ticket_ptr + b * N_KV + kv_head
            if tl.atomic_add(ticket_at, 1, sem="acq_rel", scope="gpu") == live - 1:
                tl.atomic_xchg(ticket_at, 0)  # all live splits have arrived: reset for the next launch
                gm = tl.arange(0, BLOCK_GM)  # [BLOCK_GM]
                gm_mask = gm < G
                heads_m = kv_head * G + gm
                rows = (b * N_Q + heads_m).to(tl.int64) * num_splits  # [BLOCK_GM] first split of each head
                merged = _merge_live_splits(o_part_ptr, lse_part_ptr, rows, gm_mask, live, BLOCK_GM, D, BLOCK_S)
                _store_out(out_ptr, merged, b, kv_head, gm_mask, N_Q, G, D, BLOCK_GM, INTERPRET, xq_ptr, dx_ptr,
                           xs_ptr, K_PAD, Q8)  # fmt: skip
    elif live == 0:
        if split == 0:  # an empty sequence (seq_len 0) outputs zeros
            _store_out(out_ptr, tl.zeros([BLOCK_GM, D], tl.float32), b, kv_head, tl.arange(0, BLOCK_GM) < G, N_Q, G,
                       D, BLOCK_GM, INTERPRET, xq_ptr, dx_ptr, xs_ptr, K_PAD, Q8)  # fmt: skip


def default_num_splits(batch: int, n_kv: int, max_len: int, block_n: int, device: torch.device) -> int:
    """A power of two giving about two programs per SM over B x n_kv x splits, at most one split per block."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132
    per_seq_head = max(1, (2 * sms) // (batch * n_kv))
    splits = 1 << (per_seq_head.bit_length() - 1)  # round down to a power of two
    return max(1, min(splits, triton.cdiv(max_len, block_n)))


def default_block_n(head_dim: int, dtype: torch.dtype) -> int:
    """Positions per iteration: at most MAX_BLOCK_N, and a [BLOCK_N, D] tile of k (and of v) of at most MAX_TILE_BYTES
    (16 KiB)."""
    return max(MIN_DOT, min(MAX_BLOCK_N, MAX_TILE_BYTES // (head_dim * dtype.itemsize)))


def decode_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_ids: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    num_splits: int | None = None,
    block_n: int | None = None,
    single_launch: bool | None = None,
    min_chunk: int | None = None,
) -> torch.Tensor:
    """softmax(q k^T * scale) v per sequence over cache positions [0, seq_lens[b]) of slot slot_ids[b] -> [B, n_q, D].

    D must be a power of two >= 16 (tl.dot tiles). seq_lens[b] >= 1 (0 gives zeros; larger than L reads L).
    single_launch picks the merge by the last split (True) or the separate combine kernel (False); None takes
    the module's SINGLE_LAUNCH. min_chunk (single launch only) is the fewest positions a split takes, rounded up
    to block_n: a sequence of up to min_chunk positions needs no merge at all. None: the module's rule (ONE_CHUNK,
    MIN_CHUNK, MAX_LIVE).
    """
    return _decode_attention(q, k_cache, v_cache, slot_ids, seq_lens, scale, num_splits, block_n, single_launch,
                             min_chunk, None)[0]  # fmt: skip


def decode_attention_int8_triton(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_ids: torch.Tensor, seq_lens: torch.Tensor,
    scale: float, k_pad: int, num_splits: int | None = None,
) -> tuple[torch.Tensor, Int8Rows]:
    """decode_attention_triton, plus its output [B, n_q * D] rounded to int8 as int8_dot.quantize_x(out, k_pad)
    gives it (the input of a quantized o_proj whose kernel rounds x): in the same launch where k_pad = n_q * D and
    D is a multiple of 32 (the single launch), else by a quantize_x launch after it."""
    check_k_pad(k_pad, q.shape[1] * q.shape[2])
    out, rows = _decode_attention(q, k_cache, v_cache, slot_ids, seq_lens, scale, num_splits, None, None, None,
                                  k_pad)  # fmt: skip
    return out, rows if rows is not None else quantize_x(out.reshape(out.shape[0], -1), k_pad)


class NewTokenQK(NamedTuple):
    """What the q/k norm, RoPE and cache write of decode_attention_qk_triton read (qk_norm_rope_write's inputs)."""

    qkv: torch.Tensor  # [B, (n_q + 2 n_kv) D]
    q_norm_w: torch.Tensor  # [D]
    k_norm_w: torch.Tensor  # [D]
    eps: float
    cos: torch.Tensor  # [P, D]
    sin: torch.Tensor  # [P, D]
    positions: torch.Tensor  # [B]
    token_slots: torch.Tensor  # [B]

    def kernel_args(self) -> dict:
        cos, sin = unit_inner_stride(self.cos), unit_inner_stride(self.sin)
        return dict(qkv_ptr=self.qkv, q_w_ptr=self.q_norm_w.contiguous(), k_w_ptr=self.k_norm_w.contiguous(),
                    cos_ptr=cos, sin_ptr=sin, pos_ptr=self.positions, tslot_ptr=self.token_slots, eps=self.eps,
                    stride_qkv=self.qkv.stride(0), stride_cos=cos.stride(0), stride_sin=sin.stride(0), QK=True,
                    # the norm rounds as qk_norm_rope.py's kernel does: no fused multiply-adds
                    enable_fp_fusion=False)  # fmt: skip


def decode_attention_qk_triton(
    qkv: torch.Tensor, q_norm_w: torch.Tensor, k_norm_w: torch.Tensor, eps: float, cos: torch.Tensor,
    sin: torch.Tensor, positions: torch.Tensor, token_slots: torch.Tensor, k_cache: torch.Tensor,
    v_cache: torch.Tensor, slot_ids: torch.Tensor, seq_lens: torch.Tensor, scale: float, n_q: int, n_kv: int,
    k_pad: int | None = None, num_splits: int | None = None, min_chunk: int | None = None,
) -> tuple[torch.Tensor, Int8Rows | None]:
    """qk_norm_rope_write_triton then decode_attention_triton (decode_attention_int8_triton with k_pad) in one
    launch: one new token per sequence, its q|k|v row qkv [B, (n_q + 2 n_kv) D] -> (out [B, n_q, D], its int8
    rows or None). The token's normed, rotated k and its v go into the caches at (token_slots[b], positions[b]),
    which must lie inside the sequence's attended positions [0, seq_lens[b]) or past them (not checked: no host
    reads); q never leaves the kernel. Same values as the two launches, up to float32 summation order."""
    D = cos.shape[-1]
    check_qk_inputs(qkv, q_norm_w, k_norm_w, cos, sin, positions, token_slots, k_cache, v_cache, n_q, n_kv, D)
    if qkv.stride(1) != 1:
        qkv = qkv.contiguous()
    if k_pad is not None:
        check_k_pad(k_pad, n_q * D)
    qk = NewTokenQK(qkv, q_norm_w, k_norm_w, eps, cos, sin, positions, token_slots)
    q_view = qkv[:, : n_q * D].unflatten(1, (n_q, D))  # [B, n_q, D]: shapes and strides only, never read
    out, rows = _decode_attention(q_view, k_cache, v_cache, slot_ids, seq_lens, scale, num_splits, None, True,
                                  min_chunk, k_pad, qk)  # fmt: skip
    if k_pad is not None and rows is None:
        rows = quantize_x(out.reshape(out.shape[0], -1), k_pad)
    return out, rows


def _decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_ids: torch.Tensor, seq_lens: torch.Tensor,
    scale: float, num_splits: int | None, block_n: int | None, single_launch: bool | None, min_chunk: int | None,
    k_pad: int | None, qk: NewTokenQK | None = None,
) -> tuple[torch.Tensor, Int8Rows | None]:
    """Every entry point: (out, the int8 rows where the kernel wrote them); qk: QK mode (single launch)."""
    B, n_q, D = q.shape
    S, L, n_kv, _ = k_cache.shape
    _check(q, k_cache, v_cache, slot_ids, seq_lens)
    if block_n is None:
        block_n = default_block_n(D, k_cache.dtype)
        block_n = min(block_n, max(MIN_DOT, INT8_MAX_BLOCK_N)) if k_pad is not None else block_n
    if block_n < MIN_DOT or block_n & (block_n - 1):
        raise ValueError(f"block_n must be a power of two >= {MIN_DOT}, got {block_n}")
    if num_splits is None:
        num_splits = default_num_splits(B, n_kv, L, block_n, q.device)
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    out = torch.empty(B, n_q, D, dtype=q.dtype, device=q.device)  # [B, n_q, D]
    single = SINGLE_LAUNCH if single_launch is None else single_launch
    if single and min_chunk is None:
        # the module's rule: splits from MAX_LIVE on never hold a position (_chunk_bounds), so they get no programs
        # (and the chunks stay the same)
        num_splits = min(num_splits, MAX_LIVE)
    rows = None
    if k_pad is not None and single and k_pad == n_q * D and D % 32 == 0:
        rows = Int8Rows.empty(B, k_pad, q.device)
    if B == 0:
        return out, rows
    if q.stride(2) != 1 and qk is None:
        q = q.contiguous()
    o_part = torch.empty(B, n_q, num_splits, D, dtype=torch.float32, device=q.device)  # [B, n_q, splits, D]
    lse_part = torch.empty(B, n_q, num_splits, dtype=torch.float32, device=q.device)  # [B, n_q, splits]
    args = (q, k_cache, v_cache, slot_ids, seq_lens, o_part, lse_part)
    if single:
        # an explicit min_chunk is the whole rule: chunks of at least that many positions
        one_chunk, max_live = (ONE_CHUNK, MAX_LIVE) if min_chunk is None else (0, 0)
        chunk = max(block_n, triton.cdiv(MIN_CHUNK if min_chunk is None else min_chunk, block_n) * block_n)
        _launch_single(*args, out, scale, num_splits, block_n, chunk, one_chunk, max_live, rows, qk)
    else:
        _launch_partial(*args, scale, num_splits, block_n)
        _launch_combine(o_part, lse_part, out, num_splits)
    return out, rows


def _common_args(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float, num_splits: int) -> tuple:
    """The runtime arguments both split-KV kernels take after their pointers."""
    return (scale * LOG2E, num_splits, k_cache.shape[1], q.stride(0), q.stride(1), k_cache.stride(0),
            k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1), v_cache.stride(2))


def _common_meta(q: torch.Tensor, k_cache: torch.Tensor, block_n: int) -> dict:
    """The compile-time arguments and launch options both split-KV kernels take."""
    n_q, n_kv, D = q.shape[1], k_cache.shape[2], q.shape[2]
    G = n_q // n_kv
    return dict(
        N_Q=n_q,
        G=G,
        BLOCK_G=max(MIN_DOT, triton.next_power_of_2(G)),
        D=D,
        BLOCK_N=block_n,
        # float32 caches: full-precision products, not TF32
        DOT_PRECISION="ieee" if k_cache.dtype == torch.float32 else "tf32",
        INTERPRET=interpreting(),
        num_warps=NUM_WARPS,
        enable_fp_fusion=True,  # explicit: Triton's default for this differs between releases
    )


def _launch_single(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_ids: torch.Tensor,
    seq_lens: torch.Tensor,
    o_part: torch.Tensor,
    lse_part: torch.Tensor,
    out: torch.Tensor,
    scale: float,
    num_splits: int,
    block_n: int,
    min_chunk: int,
    one_chunk: int,
    max_live: int,
    rows: Int8Rows | None = None,
    qk: NewTokenQK | None = None,
) -> None:
    """One launch: partials, then the merge by the last live split of each (sequence, kv head); with rows, the
    output also as int8 into them; with qk, q made and the new k, v written in the same launch."""
    B, n_q, D = q.shape
    n_kv = k_cache.shape[2]
    tickets = ticket_counters(q.device, B * n_kv, "decode_attention")  # [B * n_kv]
    block_gm = triton.next_power_of_2(n_q // n_kv)
    # merge tiles of at most 8192 floats: [heads, splits, D]
    block_s = max(1, min(triton.next_power_of_2(num_splits), 8192 // (block_gm * D)))
    pdl = pdl_mode(q.device, B)
    _decode_attention_kernel[(B, n_kv, num_splits)](
        q, k_cache, v_cache, slot_ids, seq_lens, o_part, lse_part, tickets, out,
        *_common_args(q, k_cache, v_cache, scale, num_splits),
        N_KV=n_kv, BLOCK_GM=block_gm, MIN_CHUNK=min_chunk, ONE_CHUNK=one_chunk, MAX_LIVE=max_live, BLOCK_S=block_s,
        **{**_common_meta(q, k_cache, block_n), **(qk.kernel_args() if qk is not None else {})},
        PDL=pdl, **launch_options(pdl),
        **({**rows.store_args(), "Q8": 1} if rows is not None else {}),
    )  # fmt: skip


def _launch_partial(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_ids: torch.Tensor,
    seq_lens: torch.Tensor,
    o_part: torch.Tensor,
    lse_part: torch.Tensor,
    scale: float,
    num_splits: int,
    block_n: int,
) -> None:
    """Two-launch path, stage 1: a partial (output, log-sum-exp) per split."""
    B, n_kv = q.shape[0], k_cache.shape[2]
    _decode_partial_kernel[(B, n_kv, num_splits)](
        q, k_cache, v_cache, slot_ids, seq_lens, o_part, lse_part,
        *_common_args(q, k_cache, v_cache, scale, num_splits), **_common_meta(q, k_cache, block_n),
    )  # fmt: skip


def _launch_combine(o_part: torch.Tensor, lse_part: torch.Tensor, out: torch.Tensor, num_splits: int) -> None:
    """Two-launch path, stage 2: one program per (sequence, query head) merges its splits."""
    B, n_q, D = out.shape
    block_s = triton.next_power_of_2(num_splits)
    _decode_combine_kernel[(B, n_q)](
        o_part,
        lse_part,
        out,
        num_splits,
        D=D,
        BLOCK_S=block_s,
        TILE_S=min(block_s, 16),
        INTERPRET=interpreting(),
        num_warps=1 if D <= 64 else 2,
        enable_fp_fusion=True,
    )


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
