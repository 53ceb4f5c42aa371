"""Public RMSNorm entry point ``rms_norm`` (optionally fused with the residual add), torch or Triton."""

from __future__ import annotations

import torch

from moerun.ops.dispatch import pick_backend

def rms_norm_reference(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm.forward_with_residual as plain torch: (weight * normalise(x + residual), x + residual)."""
    if residual is not None:
        x = x + residual
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)  # [T, H] float32
    return weight * xf.to(x.dtype), x


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., H] (+ residual) -> (normed, new residual), same shape; new residual is x when residual is None."""
    if pick_backend(backend, x.device, "RMSNorm") == "torch":
        return rms_norm_reference(x, weight, eps, residual)
    from moerun.kernels.rmsnorm import rms_norm_triton

    shape, H = x.shape, x.shape[-1]
    flat_residual = residual.reshape(-1, H) if residual is not None else None
    out, new_residual = rms_norm_triton(x.reshape(-1, H), weight, eps, flat_residual)
    return out.view(shape), new_residual.view(shape)
