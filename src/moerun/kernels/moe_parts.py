"""Pieces both paths of the fused MoE share (kernels/fused_moe.py's tile path, kernels/fused_moe_gemv.py's gemv
path, kernels/fused_moe_ptr.py's address tables) and that the quantized kernels reuse: the weight dtypes served,
where an expert's weights lie (ExpertWeights, expert_weights), the pairs still being staged (StagedPairs), SiLU * up,
the grouped program order, the tail-block test, and the k slots' reduction (the buffer GEMM 2 writes into, and the
sum of its per-slot rows into the output).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from moerun.kernels.pdl import launch_dependents, launch_options, pdl_mode, wait_for_previous

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)  # of the dense experts' weights


@dataclass
class StagedPairs:
    """Token-slot pairs whose experts are still being copied onto the device (zero-copy staging on another stream):
    ``flags`` [T*k] int32, 1 for such a pair; ``wait()`` makes the current stream wait for the copy. The pairs on
    the device are computed first, the flagged ones after the wait."""

    flags: torch.Tensor
    wait: Callable[[], None]


@triton.jit
def silu_mul(gate, up):
    return gate / (1.0 + tl.exp(-gate)) * up


@triton.jit
def zero_slice(ptr, n, BLOCK: tl.constexpr):
    """Zeroes this program's BLOCK elements of ptr [n] (program p of a launch takes [p BLOCK, (p + 1) BLOCK)), the
    linear program id counted over a 2-D grid."""
    p = tl.program_id(0).to(tl.int64) * tl.num_programs(1) + tl.program_id(1)
    offs = p * BLOCK + tl.arange(0, BLOCK)
    tl.store(ptr + offs, tl.zeros([BLOCK], dtype=ptr.dtype.element_ty), mask=offs < n)


def zeroed_by_gemm1(T: int, H: int, grid1: tuple[int, int], device: torch.device) -> tuple[torch.Tensor, dict]:
    """A float32 [T, H] for GEMM 2's atomic adds, uninitialised, and the GEMM 1 launch arguments (zero_ptr, zero_n,
    ZERO_BLOCK) by which the programs of grid1 zero it, zero_slice's slices covering it."""
    out = torch.empty(T, H, dtype=torch.float32, device=device)  # [T, H]
    block = triton.next_power_of_2(triton.cdiv(T * H, grid1[0] * grid1[1]))
    return out, {"zero_ptr": out, "zero_n": T * H, "ZERO_BLOCK": block}


@triton.jit
def tile_pid(pid, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    # Consecutive programs walk GROUP_M M-blocks (usually one expert) before moving to the next N band,
    # so an expert's weight tile is read from HBM once and reused from L2.
    width = GROUP_M * num_pid_n
    group = pid // width
    first_m = group * GROUP_M
    group_m = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % group_m
    pid_n = (pid % width) // group_m
    return pid_m, pid_n


@triton.jit
def _expert_base(table_ptr, expert, like_ptr, ALIGN: tl.constexpr):
    """Pointer to an expert's weights (element type of ``like_ptr``) from an int64 address table.

    The pointer is ``like_ptr`` plus an element offset rather than the address cast to a pointer: the compiler
    knows a kernel argument's alignment, and the hint on the offset carries ALIGN to the loads (vector loads).
    """
    # the element size is written out twice: a compile-time int kept in a local variable would become a tensor
    offset = tl.load(table_ptr + expert) - like_ptr.to(tl.int64)  # bytes
    offset = offset // (like_ptr.dtype.element_ty.primitive_bitwidth // 8)  # elements
    return like_ptr + tl.multiple_of(offset, ALIGN // (like_ptr.dtype.element_ty.primitive_bitwidth // 8))


@triton.jit
def expert_weights(w_ptr, table_ptr, expert, stride_we, like_ptr, INDIRECT: tl.constexpr, ALIGN: tl.constexpr):
    """First element of an expert's weights: stacked (``w_ptr`` + expert * stride) or through the address table."""
    if INDIRECT:
        base = _expert_base(table_ptr, expert, like_ptr, ALIGN)
    else:
        base = w_ptr + expert.to(tl.int64) * stride_we
    return base


@triton.jit
def tail_block(sorted_ids_ptr, row0, num_pairs, BLOCK_M: tl.constexpr, TAIL_M: tl.constexpr):
    """Whether the M-block of rows [row0, row0 + BLOCK_M) holds at most TAIL_M pairs. An expert's pairs come first
    in its run and the padding last, so those pairs lie in the block's first TAIL_M rows: the block can run as a
    TAIL_M-row tile, skipping the padding rows' share of the matrix work."""
    pairs = tl.load(sorted_ids_ptr + row0 + tl.arange(0, BLOCK_M))  # [BLOCK_M]
    return tl.sum((pairs < num_pairs).to(tl.int32), axis=0) <= TAIL_M


@triton.jit
def store_slot_sum(src_ptr, out_ptr, token, offs_h, top_k, H, stride_src, BLOCK_SLOT: tl.constexpr):
    """out[token, offs_h] = fp32 sum over the token's k slot rows of src [T*k, H], in out's dtype. The rows are
    read through L2 (.cg): other programs of the same launch may have written them."""
    slots = tl.arange(0, BLOCK_SLOT)  # [BLOCK_SLOT]
    mask = (slots[:, None] < top_k) & (offs_h[None, :] < H)
    rows = (token * top_k + slots[:, None]) * stride_src + offs_h[None, :]  # [BLOCK_SLOT, BLOCK_H]
    vals = tl.load(src_ptr + rows, mask=mask, other=0.0, cache_modifier=".cg").to(tl.float32)
    tl.store(out_ptr + token * H + offs_h, tl.sum(vals, axis=0).to(out_ptr.dtype.element_ty), mask=offs_h < H)


@triton.jit
def _sum_slots_kernel(
    src_ptr,  # [T*k, H] fp32 or out's dtype
    out_ptr,  # [T, H]
    top_k,
    H,
    BLOCK_SLOT: tl.constexpr,
    BLOCK_H: tl.constexpr,
    PDL: tl.constexpr = 0,
):
    launch_dependents(PDL)
    wait_for_previous(PDL)
    token = tl.program_id(0).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)  # [BLOCK_H]
    store_slot_sum(src_ptr, out_ptr, token, offs_h, top_k, H, H, BLOCK_SLOT)


def dot_precision(dtype: torch.dtype) -> str:
    # fp32 tests compare against full-precision torch matmuls; TF32 would need loose tolerances.
    return "ieee" if dtype == torch.float32 else "tf32"


def finish_reduce(acc: torch.Tensor, T: int, k: int, H: int, atomic: bool, out_dtype: torch.dtype) -> torch.Tensor:
    """[T, H] in out_dtype from the fp32 atomic output [T, H] or the per-slot rows [T*k, H] (summed in fp32)."""
    if atomic:
        return acc if out_dtype == torch.float32 else acc.to(out_dtype)
    out = torch.empty(T, H, dtype=out_dtype, device=acc.device)  # [T, H]
    block_h = min(triton.next_power_of_2(H), 1024)
    pdl = pdl_mode(acc.device, T)  # the tile path (prefill sizes) sums here too
    _sum_slots_kernel[(T, triton.cdiv(H, block_h))](
        acc, out, k, H, BLOCK_SLOT=triton.next_power_of_2(k), BLOCK_H=block_h, num_warps=4, PDL=pdl,
        **launch_options(pdl),
    )
    return out


def new_reduce_buffer(
    T: int, k: int, H: int, reduce: str, device: torch.device, out_dtype: torch.dtype
) -> torch.Tensor:
    """The buffer GEMM2 writes into: zeroed fp32 [T, H] for atomic adds, else uninitialised per-slot rows [T*k, H],
    fp32 ("sum") or in the output dtype ("sum_out": half the bytes to write and to sum)."""
    if reduce == "atomic":
        return torch.zeros(T, H, dtype=torch.float32, device=device)  # [T, H]
    dtype = out_dtype if reduce == "sum_out" else torch.float32
    return torch.empty(T * k, H, dtype=dtype, device=device)  # [T*k, H]


@dataclass(frozen=True)
class ExpertWeights:
    """Where the kernels find one weight (w13 or w2) of every expert: a stacked [E, N, K] tensor, or a table of
    int64 addresses of contiguous [N, K] matrices (``indirect``; they may lie in pinned host memory)."""

    tensor: torch.Tensor  # the stacked weights; when indirect, any tensor (unused by the kernels)
    table: torch.Tensor  # [E] int64 addresses when indirect; else any tensor (unused)
    strides: tuple[int, int, int]  # (expert, row, column) in elements
    indirect: bool
    align: int = 16  # bytes every address is a multiple of (indirect)

    @staticmethod
    def stacked(w: torch.Tensor) -> "ExpertWeights":
        return ExpertWeights(w, w, (w.stride(0), w.stride(1), w.stride(2)), False)

    @staticmethod
    def addresses(table: torch.Tensor, K: int, align: int) -> "ExpertWeights":  # noqa: N803
        return ExpertWeights(table, table, (0, K, 1), True, align)

    def args(self, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(w_ptr, table_ptr) kernel arguments; ``like`` stands in for the unused stacked pointer when indirect."""
        return (like if self.indirect else self.tensor), self.table
