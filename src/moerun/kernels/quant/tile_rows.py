"""What the quantized tile paths (fused_moe_quant.py's tile and gemv_dot, tile64.py) share around their K loops:
the token-slots of an M-block and GEMM 2's store of an out^T tile."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def block_rows(pid_m, sorted_ids_ptr, block_expert_ptr, num_pairs, BLOCK_M: tl.constexpr, PER_SLOT: tl.constexpr):
    """(expert, flat pair index, validity, row of the intermediate) of each column of M-block pid_m.

    Sorted: block_expert_ptr holds each block's expert (-1 when unused) and the intermediate has one row per
    padded position. PER_SLOT: block pid_m is token-slot pid_m alone (column 0; the others are masked),
    block_expert_ptr is the flat topk ids and the intermediate has one row per slot.
    """
    cols = tl.arange(0, BLOCK_M)  # [BLOCK_M]
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    if PER_SLOT:
        row_ok = cols == 0
        pair = tl.where(row_ok, pid_m, num_pairs)
        irow = tl.where(row_ok, pid_m, 0)
    else:
        irow = pid_m * BLOCK_M + cols
        pair = tl.load(sorted_ids_ptr + irow)
        row_ok = pair < num_pairs
    return expert, pair, row_ok, irow.to(tl.int64)


@triton.jit
def store_down_tile(acc, topk_w_ptr, out_ptr, pair, row_ok, offs_n, H, top_k, stride_ot, ATOMIC: tl.constexpr):
    """GEMM 2's out^T tile acc [BLOCK_N, BLOCK_M] times the slots' routing weights, added into the token rows of
    out [T, H] by fp32 atomics (ATOMIC) or stored into the slot rows of out [T*k, H]."""
    weight = tl.load(topk_w_ptr + pair, mask=row_ok, other=0.0).to(tl.float32)  # [BLOCK_M]
    acc = acc * weight[None, :]
    mask = row_ok[None, :] & (offs_n[:, None] < H)
    if ATOMIC:
        token = tl.where(row_ok, pair // top_k, 0).to(tl.int64)
        tl.atomic_add(out_ptr + token[None, :] * stride_ot + offs_n[:, None], acc, mask=mask, sem="relaxed")
    else:
        slot = tl.where(row_ok, pair, 0).to(tl.int64)
        tl.store(out_ptr + slot[None, :] * stride_ot + offs_n[:, None], acc.to(out_ptr.dtype.element_ty), mask=mask)
