"""Fused router: softmax over experts in float32, top-k, optional renormalisation, in one Triton kernel."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def softmax_topk(
    x,
    col_ok,
    K: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    """Float32 softmax of logits x [BLOCK_T, BLOCK_E] over the columns where col_ok [BLOCK_E] holds, and its K
    largest probabilities (optionally renormalised to sum 1) -> (weights, ids), both [BLOCK_T, BLOCK_E] with slot j
    in column j < K (the others 0). They keep the logits' layout: each pick's maximum, reduced from a row, goes
    back into it for free, where a [BLOCK_T, K] result would take a move through shared memory and two barriers
    a slot. The picks come from the logits (the softmax keeps their order); a pick's weight is exp(its logit - the
    row's largest) over the sum of those of the K picks, added in pick order (renormalised), or of every column:
    the float32 steps of the picks in GEMM 1 (kernels/topk_select.select_slot)."""
    cols = tl.arange(0, BLOCK_E)  # [BLOCK_E]
    x = tl.where(col_ok[None, :], x, float("-inf"))
    top_x, top_i = top_k_columns(x, K, BLOCK_T, BLOCK_E)
    largest = tl.max(x, axis=1)  # [BLOCK_T]
    num = tl.where(cols[None, :] < K, tl.exp(top_x - largest[:, None]), 0.0)  # [BLOCK_T, BLOCK_E]
    if RENORMALIZE:
        total = tl.zeros([BLOCK_T], dtype=tl.float32)
        for j in tl.static_range(K):
            total += tl.sum(tl.where(cols[None, :] == j, num, 0.0), axis=1)
    else:
        total = tl.sum(tl.exp(x - largest[:, None]), axis=1)
    return num / total[:, None], top_i


@triton.jit
def top_k_columns(x, K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr):
    """The K largest of each row of x [BLOCK_T, BLOCK_E] (ties to the lowest index, as torch.topk on distinct
    values; columns to skip must hold less than any candidate) -> (values, ids), both [BLOCK_T, BLOCK_E] with slot
    j in column j < K (the others 0), in x's layout (see softmax_topk)."""
    cols = tl.arange(0, BLOCK_E)  # [BLOCK_E]
    top_x = tl.zeros([BLOCK_T, BLOCK_E], dtype=tl.float32)
    top_i = tl.zeros([BLOCK_T, BLOCK_E], dtype=tl.int32)
    for j in tl.static_range(K):
        best = tl.max(x, axis=1)  # [BLOCK_T]
        best_i = tl.min(tl.where(x == best[:, None], cols[None, :], BLOCK_E), axis=1)  # [BLOCK_T]
        top_x = tl.where(cols[None, :] == j, best[:, None], top_x)
        top_i = tl.where(cols[None, :] == j, best_i[:, None], top_i)
        x = tl.where(cols[None, :] == best_i[:, None], float("-inf"), x)  # picked: below anything left
    return top_x, top_i


@triton.jit
def _order_key(x):
    """int32 keys of float32 x whose signed order is the floats' (-0.0 below 0.0), and back: the map is its own
    inverse."""
    bits = x.to(tl.int32, bitcast=True)
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


@triton.jit
def _bf16_value(key):
    """The bfloat16 value (as float32) of a BF16 key of pick_of_top_k (its high 16 bits)."""
    high = key & -65536
    return _order_key(high | ((high >> 31) & 0xFFFF)).to(tl.float32, bitcast=True)


@triton.jit
def pick_of_top_k(x, s, K: tl.constexpr, ROWS: tl.constexpr, BLOCK_E: tl.constexpr, BF16: tl.constexpr = False):
    """Pick s (0 <= s < K) of the K largest of each row of x [ROWS, BLOCK_E], in top_k_columns' order (by value,
    ties to the lowest index; columns to skip hold -inf) -> (its column [ROWS] int32, its value [ROWS], the row's
    largest [ROWS], the sum over the K picks of exp(value - largest) in pick order [ROWS], the row's distinct values
    from the largest in columns j < K [ROWS, BLOCK_E] (the largest where a column covers no pick), how many of the
    K picks each one covers [ROWS, BLOCK_E]).

    From one pick to the next the chain is one integer max over a warp's row (a single warp instruction on sm_80
    and later, where a float max takes five shuffles), on int32 keys in the values' order. BF16 (x holds bfloat16
    values exactly: a bfloat16 router's logits): a key is the value's 16 bits above the reversed column, one per
    column, so the pick's column comes with it. Otherwise a pick removes every column of its value at once, the
    count of those ties is taken beside the chain, and pick s's column among its value's columns is found once, at
    the end (a prefix count of them)."""
    cols = tl.arange(0, BLOCK_E)  # [BLOCK_E]
    key = _order_key(tl.where(x == 0.0, 0.0, x))  # [ROWS, BLOCK_E]; -0.0 as 0.0 (equal values, equal keys)
    if BF16:  # the value's 16 bits (the low 16 of a bfloat16's float32 are 0, of its key 0 or all 1s)
        key = (key & -65536) | (BLOCK_E - 1 - cols)[None, :]
    rest = key
    before = tl.zeros([ROWS], dtype=tl.int32)  # picks the larger values cover
    mine_key = tl.zeros([ROWS], dtype=tl.int32)  # pick s's value's key
    place = tl.zeros([ROWS], dtype=tl.int32)  # pick s's place among the columns holding its value
    largest = tl.zeros([ROWS], dtype=tl.float32)
    pick_sum = tl.zeros([ROWS], dtype=tl.float32)
    top_v = tl.zeros([ROWS, BLOCK_E], dtype=tl.float32)
    takes = tl.zeros([ROWS, BLOCK_E], dtype=tl.int32)
    for j in tl.static_range(K):
        best = tl.max(rest, axis=1)  # [ROWS]
        hit = rest == best[:, None]  # [ROWS, BLOCK_E]
        rest = tl.where(hit, -2147483648, rest)  # below every key (that of -inf included)
        if BF16:
            v = _bf16_value(best)  # [ROWS]
            count = tl.full([ROWS], 1, tl.int32)
        else:
            v = _order_key(best).to(tl.float32, bitcast=True)
            count = tl.sum(hit.to(tl.int32), axis=1)  # (with every column removed, all of them)
        mine = (before <= s) & (s < before + count)
        mine_key = tl.where(mine, best, mine_key)
        place = tl.where(mine, s - before, place)
        take = tl.minimum(tl.maximum(K - before, 0), count)  # [ROWS]
        if j == 0:
            largest = v
        else:  # a pick past the K (with every column removed, v is NaN): the largest, finite, covering no pick
            v = tl.where(take > 0, v, largest)
        pick_sum += take.to(tl.float32) * tl.exp(v - largest)
        top_v = tl.where(cols[None, :] == j, v[:, None], top_v)
        takes = tl.where(cols[None, :] == j, take[:, None], takes)
        before += count
    if BF16:
        col = BLOCK_E - 1 - (mine_key & 0xFFFF)
        value = _bf16_value(mine_key)
    else:
        same = (key == mine_key[:, None]).to(tl.int32)  # [ROWS, BLOCK_E]
        lower = tl.cumsum(same, axis=1) - same  # columns of the value below each one
        col = tl.min(tl.where((same != 0) & (lower == place[:, None]), cols[None, :], BLOCK_E), axis=1)  # [ROWS]
        value = _order_key(mine_key).to(tl.float32, bitcast=True)
    return col, value, largest, pick_sum, top_v, takes


@triton.jit(do_not_specialize=["T"])
def _route_kernel(
    logits_ptr,  # [T, E]
    weights_ptr,  # [T, K] float32
    ids_ptr,  # [T, K] int32
    T,
    E,
    stride_lt,
    K: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = pid * BLOCK_T + tl.arange(0, BLOCK_T)  # [BLOCK_T]
    cols = tl.arange(0, BLOCK_E)  # [BLOCK_E]
    row_ok = rows < T
    mask = row_ok[:, None] & (cols[None, :] < E)
    ptrs = logits_ptr + rows.to(tl.int64)[:, None] * stride_lt + cols[None, :]
    x = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)  # [BLOCK_T, BLOCK_E]
    # Rows beyond T load zeros rather than -inf so they stay finite; their results are never stored.
    top_w, top_i = softmax_topk(x, cols < E, K, RENORMALIZE, BLOCK_T, BLOCK_E)  # [BLOCK_T, BLOCK_E]: slots < K

    out_mask = row_ok[:, None] & (cols[None, :] < K)
    out_offs = rows.to(tl.int64)[:, None] * K + cols[None, :]
    tl.store(weights_ptr + out_offs, top_w, mask=out_mask)
    tl.store(ids_ptr + out_offs, top_i, mask=out_mask)


def route_triton(router_logits: torch.Tensor, k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax + top-k (+ renormalise) over router_logits [T, E] -> (weights [T, k] float32, ids [T, k] int32)."""
    if router_logits.dim() != 2:
        raise ValueError(f"router_logits must be [T, E], got shape {tuple(router_logits.shape)}")
    T, E = router_logits.shape
    if not 1 <= k <= E:
        raise ValueError(f"k must be in [1, {E}], got {k}")
    if router_logits.stride(1) != 1:
        router_logits = router_logits.contiguous()
    weights = torch.empty(T, k, dtype=torch.float32, device=router_logits.device)  # [T, k]
    ids = torch.empty(T, k, dtype=torch.int32, device=router_logits.device)  # [T, k]
    if T == 0:
        return weights, ids
    block_e = triton.next_power_of_2(E)
    # Several rows per program keep prefill grids small while a row of E logits stays in registers.
    block_t = max(1, min(16, 2048 // block_e))
    grid = (triton.cdiv(T, block_t),)
    _route_kernel[grid](
        router_logits,
        weights,
        ids,
        T,
        E,
        router_logits.stride(0),
        K=k,
        RENORMALIZE=bool(renormalize),
        BLOCK_T=block_t,
        BLOCK_E=block_e,
        num_warps=4 if block_e * block_t >= 1024 else 1,
    )
    return weights, ids
