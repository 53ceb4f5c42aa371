"""Public MoE entry points: ``route`` and ``fused_moe``, dispatched to the torch reference or Triton kernels."""

from __future__ import annotations

import torch

from moerun.ops.dispatch import pick_backend
from moerun.ops.moe_reference import fused_moe_reference, route_reference


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


def fused_moe(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    backend: str | None = None,
) -> torch.Tensor:
    """Experts of one MoE layer: hidden [T, H], w13 [E, 2I, H], w2 [E, H, I] -> [T, H] in hidden's dtype.

    w13 / w2 may be quantized weights (layers/quantized.py): the torch path dequantises the touched experts;
    the Triton path runs kernels that read the repacked GGUF blocks and dequantise in registers (ops/quant.py).
    """
    if pick_backend(backend, hidden.device, "MoE") == "torch":
        return fused_moe_reference(hidden, w13, w2, topk_weights, topk_ids)
    if not isinstance(w13, torch.Tensor):
        from moerun.ops.quant import fused_moe_quantized

        return fused_moe_quantized(hidden, w13, w2, topk_weights, topk_ids)
    from moerun.kernels.fused_moe import fused_moe_triton

    return fused_moe_triton(hidden, w13, w2, topk_weights, topk_ids)
