"""Token/expert alignment on the GPU: sort (token, slot) pairs by expert and pad each expert's run to BLOCK_M.

Everything stays on the device and every output has a size fixed by (T, k, E, BLOCK_M), so the alignment can be
captured in a CUDA graph. The sort is a stable counting sort: pairs of one expert keep their flat order t*k+j.
Two launches over chunks of the pairs: a histogram per chunk, then a scatter in which every chunk derives the
experts' padded runs and its own offsets in them from all the histograms (and the M-blocks' experts, strided).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

# Elements of the [chunk, experts] one-hot tiles and of the [blocks, experts] owner tiles: bounds register use.
_TILE_ELEMS = 16384
# Most chunks (programs) of the alignment: each program sums the counts of every chunk, C * E reads, so larger
# inputs give each chunk more pairs instead of adding chunks.
_MAX_CHUNKS = 128


class Alignment(NamedTuple):
    """Expert-sorted, BLOCK_M-padded layout of the T*k (token, slot) pairs."""

    sorted_ids: torch.Tensor  # [max_padded] int32 flat index t*k+j, or T*k for padding
    block_expert: torch.Tensor  # [max_blocks] int32 expert of each M-block, -1 when unused
    num_padded: torch.Tensor  # [1] int32 number of valid padded rows (a multiple of BLOCK_M)
    block_m: int


def max_padded_rows(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Worst-case padded length: every expert that can receive a pair wastes up to BLOCK_M - 1 rows."""
    worst = num_pairs + min(num_experts, num_pairs) * (block_m - 1)
    return triton.cdiv(worst, block_m) * block_m


# Sizes that follow the token count are not specialised on, so a new batch size reuses the compiled kernel.
@triton.jit(do_not_specialize=["N", "P", "subs", "fill_per_program"])
def _histogram_kernel(
    ids_ptr,  # [N] expert of each flat pair
    chunk_counts_ptr,  # [C, E] pairs per (chunk, expert)
    sorted_ids_ptr,  # [P] filled with the sentinel here, overwritten by the scatter kernel
    N,
    E,
    P,
    subs,  # sub-chunks of SUB pairs per chunk (one chunk per program)
    fill_per_program,
    SUB: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    pid = tl.program_id(0)
    experts = tl.arange(0, BLOCK_E)  # [BLOCK_E]
    counts = tl.zeros([BLOCK_E], dtype=tl.int32)
    for s in tl.range(0, subs):
        offs = (pid * subs + s) * SUB + tl.arange(0, SUB)  # [SUB]
        ids = tl.load(ids_ptr + offs, mask=offs < N, other=-1)
        counts += tl.sum((ids[:, None] == experts[None, :]).to(tl.int32), axis=0)  # [BLOCK_E]
    tl.store(chunk_counts_ptr + pid * E + experts, counts, mask=experts < E)

    # The sentinel fill is spread over the same programs so it costs no extra launch.
    fill_end = tl.minimum((pid + 1) * fill_per_program, P)
    for start in tl.range(pid * fill_per_program, fill_end, SUB):
        pos = start + tl.arange(0, SUB)
        tl.store(sorted_ids_ptr + pos, N + tl.zeros([SUB], dtype=tl.int32), mask=pos < fill_end)


@triton.jit(do_not_specialize=["N", "C", "B", "subs"])
def _scatter_kernel(
    ids_ptr,  # [N]
    chunk_counts_ptr,  # [C, E] pairs per (chunk, expert)
    sorted_ids_ptr,  # [P]
    block_expert_ptr,  # [B] out: expert of each M-block or -1
    num_padded_ptr,  # [1] out
    N,
    E,
    C,
    B,
    subs,
    BLOCK_M: tl.constexpr,
    SUB: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_B: tl.constexpr,
):
    """Each program (one chunk) sums the chunk counts itself, all of them for the experts' padded runs and those of
    the chunks before its own for its pairs' places in them, so no program waits for another: C reads of E counts
    a program, against a serial scan over the chunks in a launch of its own."""
    pid = tl.program_id(0)
    experts = tl.arange(0, BLOCK_E)  # [BLOCK_E]
    e_ok = experts < E
    totals = tl.zeros([BLOCK_E], dtype=tl.int32)
    before = tl.zeros([BLOCK_E], dtype=tl.int32)  # pairs of each expert in the chunks before this one
    for c0 in tl.range(0, C, BLOCK_C):
        chunks = c0 + tl.arange(0, BLOCK_C)  # [BLOCK_C]
        counts = tl.load(chunk_counts_ptr + chunks[:, None] * E + experts[None, :],
                         mask=(chunks[:, None] < C) & e_ok[None, :], other=0)  # [BLOCK_C, BLOCK_E]  # fmt: skip
        totals += tl.sum(counts, axis=0)
        before += tl.sum(tl.where(chunks[:, None] < pid, counts, 0), axis=0)
    padded = (totals + BLOCK_M - 1) // BLOCK_M * BLOCK_M  # [BLOCK_E]
    ends = tl.cumsum(padded, axis=0)  # [BLOCK_E] one past each expert's last padded row
    total = tl.sum(padded, axis=0)
    if pid == 0:
        tl.store(num_padded_ptr, total)

    # M-block owners, strided over the programs: block b belongs to the first expert whose run ends after it
    # (empty experts end where they start).
    end_blocks = tl.where(e_ok, ends // BLOCK_M, 2147483647)  # [BLOCK_E]
    for b0 in tl.range(pid * BLOCK_B, B, C * BLOCK_B):
        blocks = b0 + tl.arange(0, BLOCK_B)  # [BLOCK_B]
        owner = tl.sum((end_blocks[None, :] <= blocks[:, None]).to(tl.int32), axis=1)  # [BLOCK_B]
        owner = tl.where(blocks * BLOCK_M < total, owner, -1)
        tl.store(block_expert_ptr + blocks, owner, mask=blocks < B)

    # This chunk's pairs, sub-chunk by sub-chunk: a pair's row is its expert's next free row.
    next_row = ends - padded + before  # [BLOCK_E]
    for s in tl.range(0, subs):
        offs = (pid * subs + s) * SUB + tl.arange(0, SUB)  # [SUB]
        valid = offs < N
        ids = tl.load(ids_ptr + offs, mask=valid, other=-1)
        onehot = (ids[:, None] == experts[None, :]).to(tl.int32)  # [SUB, BLOCK_E]
        # rank among the earlier pairs of the same expert in this sub-chunk, plus the expert's next free row
        row = tl.sum(onehot * (tl.cumsum(onehot, axis=0) - 1 + next_row[None, :]), axis=1)  # [SUB]
        tl.store(sorted_ids_ptr + row, offs, mask=valid)
        next_row += tl.sum(onehot, axis=0)


def align_tokens(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> Alignment:
    """Expert-sorted flat pair indices of topk_ids [T, k], each expert's run padded to a multiple of block_m."""
    device = topk_ids.device
    ids = topk_ids.reshape(-1)  # [N]
    if ids.dtype != torch.int32:
        ids = ids.to(torch.int32)
    ids = ids.contiguous()
    n = ids.numel()
    E = num_experts
    max_padded = max_padded_rows(n, E, block_m)
    max_blocks = max_padded // block_m
    block_e = triton.next_power_of_2(E)
    sub = max(16, min(256, _TILE_ELEMS // block_e))  # pairs of a [pairs, experts] one-hot tile
    subs = max(1, triton.cdiv(n, sub * _MAX_CHUNKS))  # sub-chunks a program takes, so that chunks stay few
    num_chunks = max(1, triton.cdiv(n, sub * subs))

    sorted_ids = torch.empty(max_padded, dtype=torch.int32, device=device)  # [P]
    block_expert = torch.empty(max_blocks, dtype=torch.int32, device=device)  # [B]
    num_padded = torch.empty(1, dtype=torch.int32, device=device)
    chunk_counts = torch.empty(num_chunks, E, dtype=torch.int32, device=device)  # [C, E]

    # Tile sizes depend only on E, so a new T never triggers a recompilation.
    tile_rows = max(1, _TILE_ELEMS // 2 // block_e)
    fill = triton.cdiv(max_padded, num_chunks)
    _histogram_kernel[(num_chunks,)](
        ids, chunk_counts, sorted_ids, n, E, max_padded, subs, fill, SUB=sub, BLOCK_E=block_e, num_warps=8
    )  # fmt: skip
    _scatter_kernel[(num_chunks,)](
        ids, chunk_counts, sorted_ids, block_expert, num_padded, n, E, num_chunks, max_blocks, subs,
        BLOCK_M=block_m, SUB=sub, BLOCK_E=block_e, BLOCK_C=tile_rows, BLOCK_B=tile_rows, num_warps=8,
    )  # fmt: skip
    return Alignment(sorted_ids, block_expert, num_padded, block_m)
