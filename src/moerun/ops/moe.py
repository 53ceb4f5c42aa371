"""Public MoE entry points: ``route``, ``route_fused`` (+ ``route_fused_int8``, ``route_fused_logits``,
``route_fused_int8_logits``) and ``fused_moe``, dispatched to the torch reference or Triton kernels."""

from __future__ import annotations

import torch

from moerun.ops.dispatch import pick_backend
from moerun.ops.moe_reference import (
    fused_moe_reference, o_proj_router_reference, route_fused_logits_reference, route_fused_reference,
    route_reference,
)

# Up to this many tokens, route_fused's one kernel beats RMSNorm + router GEMM + softmax/top-k; beyond it each
# of its programs re-reads the router weights for one token, and callers keep the unfused path.
ROUTE_FUSED_MAX_TOKENS = 16


def route(
    router_logits: torch.Tensor, k: int, renormalize: bool, backend: str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax + top-k (+ renormalise) over router_logits [T, E] -> (weights [T, k] float32, ids [T, k] int32)."""
    if not 1 <= k <= router_logits.shape[-1]:
        raise ValueError(f"k must be in [1, {router_logits.shape[-1]}], got {k}")
    if pick_backend(backend, router_logits.device, "MoE") == "torch":
        return route_reference(router_logits, k, renormalize)
    from moerun.kernels.router import route_triton

    return route_triton(router_logits, k, renormalize)


def route_fused(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    gate_weight: torch.Tensor,
    k: int,
    renormalize: bool,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Residual add + RMSNorm + router logits + softmax/top-k (+ renormalise) of x [T, H] in one step.

    Returns (x_normed [T, H], residual_out [T, H], topk_weights [T, k] float32, topk_ids [T, k] int32), as
    ``rms_norm(x, norm_weight, eps, residual)`` then ``route(F.linear(x_normed, gate_weight), k, renormalize)``
    with gate_weight [E, H]; residual_out is x + residual in a new buffer (x itself when residual is None).
    The Triton kernel is correct for any T but meant for T <= ROUTE_FUSED_MAX_TOKENS.
    """
    if not 1 <= k <= gate_weight.shape[0]:
        raise ValueError(f"k must be in [1, {gate_weight.shape[0]}], got {k}")
    if pick_backend(backend, x.device, "MoE") == "torch":
        return route_fused_reference(x, residual, norm_weight, eps, gate_weight, k, renormalize)
    from moerun.kernels.router_fused import route_fused_triton

    return route_fused_triton(x, residual, norm_weight, eps, gate_weight, k, renormalize)


def route_fused_logits(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                       gate_weight: torch.Tensor,
                       backend: str | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """route_fused up to the router logits: (x_normed [T, H], residual_out [T, H], logits [T, E] float32, rounded to
    the model dtype as F.linear returns them), for experts that pick the routing themselves (fused_moe's
    ``select``)."""
    if pick_backend(backend, x.device, "MoE") == "torch":
        return route_fused_logits_reference(x, residual, norm_weight, eps, gate_weight)
    from moerun.kernels.router_fused import route_fused_logits_triton

    return route_fused_logits_triton(x, residual, norm_weight, eps, gate_weight)


def o_proj_router(a: torch.Tensor, residual: torch.Tensor, o_weight: torch.Tensor, rows: torch.Tensor,
                  backend: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """o_proj and the router's logits in one launch (kernels/o_proj_router.py): a [T, Q] attention output,
    residual [T, H], o_weight [H, Q], rows = router_rows(gate, norm weight, o_weight) [E, Q + H] -> (h = residual +
    o_proj(a) [T, H], the new residual stream; z [T, E] float32, the router's logits times rms(h)), for GEMM 1 to
    normalise h and scale z itself (fused_moe's select with the norm)."""
    if pick_backend(backend, a.device, "MoE") == "torch":
        return o_proj_router_reference(a, residual, o_weight, rows)
    from moerun.kernels.o_proj_router import o_proj_router_triton

    return o_proj_router_triton(a, residual, o_weight, rows)


def route_fused_int8_logits(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                            gate_weight: torch.Tensor,
                            k_pad: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Int8Rows]:  # fmt: skip
    """route_fused_logits on the Triton path, plus x_normed rounded to int8 as route_fused_int8 writes it (for
    quantized experts that pick the routing themselves), in the same launch."""
    from moerun.kernels.router_fused import route_fused_int8_logits_triton

    return route_fused_int8_logits_triton(x, residual, norm_weight, eps, gate_weight, k_pad)


def route_fused_int8(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                     gate_weight: torch.Tensor, k: int, renormalize: bool,
                     k_pad: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, Int8Rows]:
    """route_fused on the Triton path, plus x_normed rounded to int8 for quantized experts whose kernels round
    x (kernels/quant/int8_dot.py, K padded to k_pad), in the same launch."""
    from moerun.kernels.router_fused import route_fused_int8_triton

    return route_fused_int8_triton(x, residual, norm_weight, eps, gate_weight, k, renormalize, k_pad)


def fused_moe(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    backend: str | None = None,
    x_int8: Int8Rows | None = None,
    num_experts: int | None = None,
    keep_float32: bool = False,
    select: TopkSelect | None = None,
) -> torch.Tensor:
    """Experts of one MoE layer: hidden [T, H], w13 [E, 2I, H], w2 [E, H, I] -> [T, H] in hidden's dtype.

    w13 / w2 may be quantized weights (layers/quantized.py): the torch path dequantises the touched experts;
    the Triton path runs kernels that read the repacked GGUF blocks and dequantise in registers (ops/quant.py).
    x_int8: hidden already rounded to int8 (route_fused_int8), for quantized kernels that round it.
    num_experts: the layer's expert count where w13 / w2 stack a slot pool (offloading), which picks the Triton
    kernels' tuned tables. keep_float32: kernels that sum the k slots in a float32 buffer (quantized ones, or the
    dense gemv path's atomic reduce) may return it as it is (float32 [T, H]) rather than rounded to hidden's dtype
    by one more launch; the caller's consumer then rounds it (the RMSNorm ops and rms_norm_linear do, as the cast
    would). select: topk_weights / topk_ids are buffers that the routing picked from the router's logits is
    written into (kernels/topk_select.TopkSelect: by the gemv paths' GEMM 1, dense or gemv_v2, else first).
    """
    if pick_backend(backend, hidden.device, "MoE") == "torch":
        if select is not None:
            hidden, select = select.prenormalised(hidden)
            select.fill(topk_weights, topk_ids, triton_kernel=False)
        return fused_moe_reference(hidden, w13, w2, topk_weights, topk_ids)
    if not isinstance(w13, torch.Tensor):
        from moerun.ops.quant import fused_moe_quantized

        if select is not None and select.norm_weight is not None:  # (its kernels take normalised rows)
            hidden, select = select.prenormalised(hidden)

        return fused_moe_quantized(hidden, w13, w2, topk_weights, topk_ids, x_int8=x_int8, num_experts=num_experts,
                                   keep_float32=keep_float32, select=select)  # fmt: skip
    from moerun.kernels.fused_moe import fused_moe_triton

    return fused_moe_triton(hidden, w13, w2, topk_weights, topk_ids, num_experts=num_experts,
                            keep_float32=keep_float32, select=select)  # fmt: skip


from typing import TYPE_CHECKING  # noqa: E402

if TYPE_CHECKING:  # the pointer tables are defined with the expert offloading that builds them
    from moerun.kernels.moe_parts import StagedPairs
    from moerun.kernels.topk_select import TopkSelect
    from moerun.kernels.quant.int8_dot import Int8Rows
    from moerun.moe.offload.pointers import ExpertPointers


def fused_moe_indirect(
    hidden: torch.Tensor,
    pointers: "ExpertPointers",
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    backend: str | None = None,
    staged: "StagedPairs | None" = None,
    keep_float32: bool = False,
) -> torch.Tensor:
    """Experts of one MoE layer found through address tables (moe/offload/pointers.py): hidden [T, H],
    routing [T, k] -> [T, H] in hidden's dtype.

    Expert e's w13 [2I, H] and w2 [H, I] start at ``pointers.w13[e]`` / ``pointers.w2[e]``: a device slot or a
    pinned host copy that the Triton kernels read in place (zero-copy); the torch reference resolves the addresses
    within ``pointers.regions``. Dense weights only. ``staged`` (Triton): pairs whose experts another stream is
    still copying onto the device, computed once it is done (kernels/moe_parts.StagedPairs). ``keep_float32``:
    fused_moe's.
    """
    if pick_backend(backend, hidden.device, "MoE") == "torch":
        from moerun.moe.offload.pointers import fused_moe_indirect_reference

        if staged is not None:
            staged.wait()
        return fused_moe_indirect_reference(hidden, pointers, topk_weights, topk_ids)
    from moerun.kernels.fused_moe_ptr import fused_moe_indirect_triton

    return fused_moe_indirect_triton(hidden, pointers.w13, pointers.w2, pointers.intermediate_size, pointers.dtype,
                                     topk_weights, topk_ids, pointers.align, staged=staged,
                                     keep_float32=keep_float32)  # fmt: skip
