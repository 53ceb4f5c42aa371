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
    """Float32 softmax of logits x [BLOCK_T, BLOCK_E] over the columns where col_ok [BLOCK_E] holds, then the K
    largest probabilities (optionally renormalised to sum 1) -> (weights, ids), both [BLOCK_T, BLOCK_E] with slot j
    in column j < K (the others 0). They keep the logits' layout: each pick's maximum, reduced from a row, goes
    back into it for free, where a [BLOCK_T, K] result would take a move through shared memory and two barriers
    a slot."""
    x = tl.where(col_ok[None, :], x, float("-inf"))
    x_max = tl.max(x, axis=1)  # [BLOCK_T]
    num = tl.exp(x - x_max[:, None])
    probs = num / tl.sum(num, axis=1)[:, None]  # [BLOCK_T, BLOCK_E]
    # Padding columns drop below any real probability so they are never selected.
    probs = tl.where(col_ok[None, :], probs, -1.0)
    top_w, top_i = top_k_columns(probs, K, BLOCK_T, BLOCK_E)
    if RENORMALIZE:
        top_w = top_w / tl.sum(top_w, axis=1)[:, None]
    return top_w, top_i


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
