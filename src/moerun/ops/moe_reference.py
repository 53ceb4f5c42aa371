"""Plain PyTorch reference for routing and the experts of an MoE layer.

Dimensions: T tokens, H hidden size, E experts, k experts per token, I expert intermediate size.
These functions define what the fast paths must compute; tests compare the kernels against them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moerun.ops.norm import rms_norm_reference


def route_reference(router_logits: torch.Tensor, k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax in float32 over the experts, top-k, optional renormalisation to sum 1.

    Equal probabilities go to the lowest expert index first, as in the routing kernels (torch.topk leaves the
    order of ties unspecified, and bfloat16 logits tie often enough to matter).
    """
    probs = torch.softmax(router_logits.float(), dim=-1)  # [T, E]
    order = torch.sort(probs, dim=-1, descending=True, stable=True)  # stable: ties keep ascending index order
    topk_weights, topk_ids = order.values[..., :k], order.indices[..., :k]  # [T, k]
    if renormalize:
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
    return topk_weights, topk_ids.to(torch.int32)


def route_fused_reference(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    gate_weight: torch.Tensor,
    k: int,
    renormalize: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The unfused routing of a decoder layer: residual add + RMSNorm, router logits in the model dtype, then
    route_reference -> (x_normed [T, H], residual_out [T, H], topk_weights [T, k] float32, topk_ids [T, k] int32)."""
    x_normed, residual_out, logits = route_fused_logits_reference(x, residual, norm_weight, eps, gate_weight)
    topk_weights, topk_ids = route_reference(logits, k, renormalize)  # [T, k]
    return x_normed, residual_out, topk_weights, topk_ids


def route_fused_logits_reference(
    x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float, gate_weight: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """route_fused_reference up to the logits: (x_normed [T, H], residual_out [T, H], logits [T, E] float32 of the
    model-dtype F.linear, as transformers computes them)."""
    x_normed, residual_out = rms_norm_reference(x, norm_weight, eps, residual)  # [T, H], [T, H]
    return x_normed, residual_out, F.linear(x_normed, gate_weight).float()


def router_rows(gate_weight: torch.Tensor, norm_weight: torch.Tensor, o_weight: torch.Tensor) -> torch.Tensor:
    """The router seen through o_proj and the residual stream (kernels/o_proj_router.py): [M | W_r * g] [E, Q + H]
    in the weights' dtype, M = (W_r * g) W_o [E, Q] made in float32 and rounded once; gate_weight W_r [E, H],
    norm_weight g [H] (the RMSNorm in front of the router), o_weight W_o [H, Q]."""
    scaled = gate_weight.float() * norm_weight.float()  # [E, H]
    through_o = scaled @ o_weight.float()  # [E, Q]
    return torch.cat([through_o, scaled], dim=1).to(o_weight.dtype).contiguous()


def o_proj_router_reference(a: torch.Tensor, residual: torch.Tensor, o_weight: torch.Tensor,
                            rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """(residual + F.linear(a, o_weight) [T, H] in the model dtype (o_proj's output rounded, then added as the
    norm adds it), a @ M^T + residual @ (W_r * g)^T [T, E] float32) for rows = router_rows(...) [E, Q + H]."""
    Q = a.shape[1]
    h = F.linear(a, o_weight) + residual  # [T, H]
    z = a.float() @ rows[:, :Q].float().T + residual.float() @ rows[:, Q:].float().T  # [T, E]
    return h, z


def fused_moe_reference(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """sum_j topk_weights[t, j] * down_e(silu(gate_e(x_t)) * up_e(x_t)), e = topk_ids[t, j].

    hidden [T, H], w13 [E, 2I, H] (gate rows first), w2 [E, H, I], topk_weights [T, k], topk_ids [T, k].
    w13 / w2 may also be quantized weights (anything with ``.shape`` and ``.expert(e, dtype)``); then only
    the experts that receive tokens are dequantised. Each expert's GEMMs run in the dtype of the weights; the
    weighted sum over the k slots accumulates in float32 and the result is cast to the dtype of ``hidden``.
    """
    T, H = hidden.shape
    E, two_i, _ = w13.shape
    k = topk_ids.shape[1]
    inter = two_i // 2
    flat_ids = topk_ids.reshape(-1).long()  # [T*k]
    order = torch.argsort(flat_ids, stable=True)  # (token, slot) pairs sorted by expert
    counts = torch.bincount(flat_ids, minlength=E).tolist()
    per_slot = torch.empty(T * k, H, dtype=torch.float32, device=hidden.device)  # [T*k, H]
    weights = topk_weights.reshape(-1).float()  # [T*k]
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        slots = order[start : start + n]  # [n] flat (token, slot) indices
        start += n
        w13_e, w2_e = _expert(w13, e, hidden.dtype), _expert(w2, e, hidden.dtype)  # [2I, H], [H, I]
        x = hidden[slots // k].to(w13_e.dtype)  # [n, H]
        gate_up = x @ w13_e.t()  # [n, 2I]
        act = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]  # [n, I]
        y = act @ w2_e.t()  # [n, H]
        per_slot[slots] = y.float() * weights[slots, None]
    return per_slot.view(T, k, H).sum(dim=1).to(hidden.dtype)


def _expert(w, e: int, dtype: torch.dtype) -> torch.Tensor:
    return w[e] if isinstance(w, torch.Tensor) else w.expert(e, dtype)
