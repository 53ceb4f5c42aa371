"""Missed experts staged in device memory before the fused MoE of a zero-copy layer reads them.

A fused MoE kernel reading an expert in place from pinned host memory over PCIe gets about 29 GB/s on an H200;
a kernel that only copies reaches about 51 GB/s, as fast as the copy engine (benchmarks/RESULTS.md). So for a
layer whose routed experts are not all cached, one launch copies each missed expert's arrays from host memory
into a row of a device staging area and writes the step's address table: the layer's table with those experts'
entries pointing at their staging row. The fused MoE then reads the step's table. Graph-safe: the routing, the
residency flags and the addresses are read on the device.

Grid (pairs scanned, arrays, chunks). A program copies one chunk of one array of the expert routed to its pair
when that pair is the expert's first and the expert is read from host memory; the staging row is the number of
such pairs before it. Missed experts beyond the staging rows, or first routed after the scanned pairs, stay
where the table points (read in place: correct, slower).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

CHUNK_WORDS = 8192  # words a program copies (64 KiB of int64 words: 50.7 GB/s from host memory on an H200)
BLOCK_WORDS = 1024  # words per load instruction group
SCAN_PAIRS = 64  # pairs looked at (a batch of 8 tokens at top-8); the experts of later pairs are not staged


@triton.jit
def _stage_misses_kernel(
    table_ptr,  # [P * E * W] int64: the layer's addresses (expert e's array w of part p at (p * E + e) * W + w)
    is_host_ptr,  # [E] int32: 1 where the expert's entries point at host memory
    ids_ptr,  # [>= N] int32 or int64: the expert of each (token, slot) pair
    sizes_ptr,  # [P * W] int64: words of each array of one expert (0: no such array)
    offsets_ptr,  # [P * W] int64: word offset of each array inside a staging row
    staging_ptr,  # [R, ROW_WORDS] words (int64 or int32)
    out_ptr,  # [P * E * W] int64: the step's table, already a copy of the layer's; staged entries rewritten
    N,  # pairs scanned
    E,
    R,  # staging rows
    ROW_WORDS,
    W: tl.constexpr,
    WORD: tl.constexpr,  # bytes of a word
    BLOCK_N: tl.constexpr,  # >= N, a power of two
    CHUNK: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)  # the pair
    a = tl.program_id(1)
    c = tl.program_id(2)
    scan = tl.arange(0, BLOCK_N)  # [BLOCK_N]
    ids = tl.load(ids_ptr + scan, mask=scan < N, other=-1).to(tl.int64)  # [BLOCK_N]
    # a pair stages its expert when it is the expert's first pair and the expert is read from host memory
    repeats = (ids[:, None] == ids[None, :]) & (scan[None, :] < scan[:, None])  # [BLOCK_N, BLOCK_N]
    first = tl.sum(repeats.to(tl.int32), axis=1) == 0  # [BLOCK_N]
    host = tl.load(is_host_ptr + ids, mask=scan < N, other=0) != 0  # [BLOCK_N]
    staged = first & host & (scan < N)  # [BLOCK_N]
    rank = tl.sum((staged & (scan < row)).to(tl.int32), axis=0)  # this pair's staging row
    mine = tl.sum((staged & (scan == row)).to(tl.int32), axis=0) > 0
    size = tl.load(sizes_ptr + a)
    if mine & (rank < R) & (size > 0):
        e = tl.load(ids_ptr + row).to(tl.int64)
        entry = (a // W * E + e) * W + a % W
        src_words = (tl.load(table_ptr + entry) - staging_ptr.to(tl.int64)) // WORD  # from staging_ptr, in words
        dst_words = rank.to(tl.int64) * ROW_WORDS + tl.load(offsets_ptr + a)
        offs = tl.arange(0, BLOCK)  # [BLOCK]
        for i in tl.static_range(0, CHUNK, BLOCK):
            o = c * CHUNK + i + offs  # [BLOCK] words of the array
            ok = o < size
            v = tl.load(staging_ptr + src_words + o, mask=ok, cache_modifier=".cg")
            tl.store(staging_ptr + dst_words + o, v, mask=ok)
        if c == 0:
            tl.store(out_ptr + entry, staging_ptr.to(tl.int64) + dst_words * WORD)


def stage_misses_triton(table: torch.Tensor, is_host: torch.Tensor, ids: torch.Tensor, sizes: torch.Tensor,
                        offsets: torch.Tensor, max_words: int, staging: torch.Tensor, out: torch.Tensor
                        ) -> torch.Tensor:
    """Writes into ``out`` [P, E, W] (int64) the layer's ``table`` [P, E, W] with the first R distinct missed
    experts among the first SCAN_PAIRS pairs of ``ids`` [N] copied into the R rows of ``staging`` [R, row words]
    (in order of their first pair) and pointed at.

    is_host [E] int32 (1: the table points at host memory), sizes / offsets [P * W] int64 in words of staging's
    element type, max_words the largest size; every address in the table a multiple of that word. Returns out."""
    P, E, W = table.shape
    word = staging.element_size()
    out.copy_(table)
    n = min(ids.numel(), SCAN_PAIRS)
    if n == 0 or staging.shape[0] == 0:
        return out
    chunks = triton.cdiv(max_words, CHUNK_WORDS)
    _stage_misses_kernel[(n, P * W, chunks)](
        table, is_host, ids, sizes, offsets, staging, out, n, E, staging.shape[0], staging.shape[1], W=W, WORD=word,
        BLOCK_N=triton.next_power_of_2(n), CHUNK=CHUNK_WORDS, BLOCK=BLOCK_WORDS, num_warps=4,
    )  # fmt: skip
    return out
