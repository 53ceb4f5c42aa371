"""Routing picked inside the experts' kernels: GEMM 1 of the gemv paths takes the router's logits and picks each
token-slot's expert and weight itself (softmax + top-k, ties to the lowest index, as kernels/router.py), so no
launch of its own runs between the router and the experts.

TopkSelect is what the model hands the fused MoE (ops.fused_moe ``select``): the logits, how to weight the picks,
and optionally the RMSNorm that GEMM 1 applies to x itself (kernels/o_proj_router.py computes such logits).
The device helpers a GEMM 1 kernel calls: select_slot (the dense gemv kernel in kernels/fused_moe_gemv.py and
gemv_v2's in kernels/quant/gemv_v2.py), and pick_by_value + scaled_weight where GEMM 1 also applies the RMSNorm
(the dense one); TopkOperands and TopkShape are their run-time and compile-time arguments.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from moerun.kernels.interpreter import interpreting
from moerun.kernels.router import pick_of_top_k, route_triton


class TopkOperands(NamedTuple):
    """The run-time operands of select_slot, passed to a GEMM 1 kernel as one argument."""

    logits_ptr: torch.Tensor  # [T, E] float32
    weights_ptr: torch.Tensor  # [T*k] float32 out


class TopkShape(NamedTuple):
    """Its compile-time arguments, passed as one constexpr."""

    E: int
    BLOCK_E: int  # next power of two >= E
    K: int  # top_k
    RENORMALIZE: bool
    ROWS: int  # the launch's warps: select_slot's copies of the logits
    BF16: bool = False  # the logits hold bfloat16 values exactly (kernels/router.pick_of_top_k: one key a column)


class TopkSelect(NamedTuple):
    """Routing left to the experts' kernels: the router's logits [T, E] float32 (ops.route_fused_logits), from which
    k experts a token are picked by the router's softmax + top-k (renormalised to sum 1 with ``renormalize``) and
    written into the topk_weights / topk_ids buffers given beside it. The gemv path's GEMM 1 picks them itself (no
    launch, no ticket in the router); other paths have them written first (``fill``)."""

    logits: torch.Tensor
    renormalize: bool
    # With an RMSNorm (its weight [H] and eps), the experts' x is the un-normalised row and the logits are the
    # router's before its 1/rms (kernels/o_proj_router.py): the gemv path's GEMM 1 normalises x and scales the
    # logits itself; other paths get both done first (``prenormalised``).
    norm_weight: torch.Tensor | None = None
    eps: float = 0.0
    # The logits hold bfloat16 values exactly (a bfloat16 router's, rounded as F.linear returns them): GEMM 1 then
    # orders them by one key a column (kernels/router.pick_of_top_k). Ignored with the norm.
    bf16: bool = False

    def prenormalised(self, x: torch.Tensor) -> tuple[torch.Tensor, TopkSelect]:
        """(x normalised [T, H], the select on the logits times each row's 1/rms), in plain torch; (x, self) where
        the select carries no norm."""
        if self.norm_weight is None:
            return x, self
        from moerun.ops.norm import rms_norm_reference

        inv_rms = torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)  # [T, 1]
        x_normed, _ = rms_norm_reference(x, self.norm_weight, self.eps)
        return x_normed, TopkSelect(self.logits * inv_rms, self.renormalize)

    def fill(self, topk_weights: torch.Tensor, topk_ids: torch.Tensor, triton_kernel: bool = True) -> None:
        """The picks written into the buffers: by the router's softmax + top-k kernel (kernels/router.py: ties to
        the lowest index, as GEMM 1 and the fused router pick), or by its torch reference."""
        from moerun.ops.moe_reference import route_reference

        pick = route_triton if triton_kernel else route_reference
        weights, ids = pick(self.logits, topk_ids.shape[1], self.renormalize)  # [T, k]
        topk_weights.copy_(weights)
        topk_ids.copy_(ids)

    def kernel_args(self, topk_weights: torch.Tensor, k: int, num_warps: int) -> dict:
        """The select keyword arguments of a GEMM 1 kernel (select_slot's) that writes the weights into
        topk_weights and runs num_warps warps."""
        E = self.logits.shape[1]
        shape = TopkShape(E, triton.next_power_of_2(E), k, bool(self.renormalize), num_warps,
                          bool(self.bf16) and self.norm_weight is None)
        args = dict(sel=TopkOperands(self.logits, topk_weights), SEL=shape, SELECT=True)
        if self.norm_weight is not None:
            H = self.norm_weight.shape[0]
            args.update(norm_ptr=self.norm_weight, eps=self.eps, NORM_H=H, INTERPRET=interpreting())
        return args

    def check(self, topk_weights: torch.Tensor, topk_ids: torch.Tensor, num_experts: int) -> None:
        """Raises unless the logits are [T, num_experts] float32 and the buffers [T, k] float32 / int32, contiguous,
        k <= num_experts (the kernels write into them)."""
        T, k = topk_ids.shape
        if self.logits.shape != (T, num_experts) or self.logits.dtype != torch.float32:
            raise ValueError(f"logits must be [{T}, {num_experts}] float32, got {tuple(self.logits.shape)} "
                             f"{self.logits.dtype}")  # fmt: skip
        if self.norm_weight is not None and (self.norm_weight.dim() != 1 or not self.norm_weight.is_contiguous()):
            raise ValueError(f"the select's RMSNorm weight must be a contiguous [H] vector, got "
                             f"{tuple(self.norm_weight.shape)}")  # fmt: skip
        if topk_ids.dtype != torch.int32 or topk_weights.dtype != torch.float32 or not (
                topk_ids.is_contiguous() and topk_weights.is_contiguous()) or k > num_experts:  # fmt: skip
            raise ValueError("with the top-k picked from logits, topk_weights / topk_ids must be contiguous float32 / "
                             f"int32 [T, k <= {num_experts}] buffers")  # fmt: skip


@triton.jit
def _logits_rows(sel, SEL: tl.constexpr, slot):
    """The router logits [E] of token-slot ``slot``'s token as ROWS equal rows [ROWS, BLOCK_E] (ROWS = the
    program's warps), so that each warp holds a whole row and reductions over it stay inside a warp, with no
    shared-memory round trips between warps; columns past E read 0."""
    token = slot // SEL.K
    cols = tl.arange(0, SEL.BLOCK_E)  # [BLOCK_E]
    rows = tl.arange(0, SEL.ROWS)  # [ROWS]
    # .cg: the router's stores, read through L2
    return tl.load(sel.logits_ptr + token.to(tl.int64) * SEL.E + rows[:, None] * 0 + cols[None, :],
                   mask=(cols < SEL.E)[None, :], other=0.0, cache_modifier=".cg")  # [ROWS, BLOCK_E]


@triton.jit
def select_slot(sel, SEL: tl.constexpr, ids_ptr, slot, writes):
    """The expert of token-slot ``slot`` (token slot // K, its slot % K-th pick) from the token's router logits
    [E], by the router's softmax + top-k (kernels/router.py: picks by logit, ties to the lowest index, weights in
    its float32 steps); where ``writes``, the slot's id and weight are stored too (sel: TopkOperands, SEL:
    TopkShape). The weight needs no reduction after the picks where SEL.RENORMALIZE, and comes out of the warps'
    rows (equal) in the same exchange as the expert: one barrier before the loads that need the expert."""
    cols = tl.arange(0, SEL.BLOCK_E)  # [BLOCK_E]
    x = tl.where((cols < SEL.E)[None, :], _logits_rows(sel, SEL, slot), float("-inf"))  # [ROWS, BLOCK_E]
    col, value, largest, pick_sum, _, _ = pick_of_top_k(x, slot % SEL.K, SEL.K, SEL.ROWS, SEL.BLOCK_E, SEL.BF16)
    if SEL.RENORMALIZE:
        weight = tl.exp(value - largest) / pick_sum  # [ROWS]
    else:
        weight = tl.exp(value - largest) / tl.sum(tl.exp(x - largest[:, None]), axis=1)
    both = (col.to(tl.int64) << 32) | (weight.to(tl.int32, bitcast=True).to(tl.int64) & 0xFFFFFFFF)  # [ROWS]
    both = tl.max(both, axis=0)  # (the rows are equal)
    expert = (both >> 32).to(tl.int32)
    if writes:
        tl.store(ids_ptr + slot, expert)
        tl.store(sel.weights_ptr + slot, both.to(tl.int32).to(tl.float32, bitcast=True))
    return expert


@triton.jit
def pick_by_value(sel, SEL: tl.constexpr, slot):
    """select_slot's pick from the logits' values (the K largest, ties to the lowest index), for logits to be
    scaled later: (the logits [ROWS, BLOCK_E], the pick's value [ROWS], the distinct values and the picks each
    covers [ROWS, BLOCK_E] (pick_of_top_k's), the slot's expert)."""
    cols = tl.arange(0, SEL.BLOCK_E)  # [BLOCK_E]
    x = tl.where((cols < SEL.E)[None, :], _logits_rows(sel, SEL, slot), float("-inf"))  # [ROWS, BLOCK_E]
    col, value, _, _, top_v, takes = pick_of_top_k(x, slot % SEL.K, SEL.K, SEL.ROWS, SEL.BLOCK_E, SEL.BF16)
    return x, value, top_v, takes, tl.max(col, axis=0)  # (the rows are equal)


@triton.jit
def scaled_weight(x, value, top_v, takes, scale, SEL: tl.constexpr):
    """The routing weight of the pick of ``value`` (pick_by_value's) under the logits x times scale [1]: the
    router's softmax of them (renormalised over the K picks where SEL.RENORMALIZE)."""
    cols = tl.arange(0, SEL.BLOCK_E)  # [BLOCK_E]
    xs = x * scale[:, None]  # [ROWS, BLOCK_E]; -inf past E
    x_max = tl.max(xs, axis=1)  # [ROWS]
    if SEL.RENORMALIZE:  # the K picks' exponentials: each distinct value times the picks it covers
        num = tl.exp(top_v * scale[:, None] - x_max[:, None]) * takes.to(tl.float32)  # [ROWS, BLOCK_E]
        total = tl.sum(tl.where(cols[None, :] < SEL.K, num, 0.0), axis=1)  # [ROWS]
    else:
        total = tl.sum(tl.exp(xs - x_max[:, None]), axis=1)
    return tl.max(tl.exp(value * scale - x_max) / total, axis=0)
