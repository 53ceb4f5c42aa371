"""Public RMSNorm entry points: ``rms_norm`` (optionally fused with the residual add), torch or Triton, and
``rms_norm_int8``, which also rounds the output to int8 for the quantized decode kernels."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from moerun.ops.dispatch import pick_backend

if TYPE_CHECKING:
    from moerun.kernels.quant.int8_dot import Int8Rows


def rms_norm_reference(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm.forward_with_residual as plain torch: (weight * normalise(x + residual), x + residual); float32 x beside
    a 16-bit residual (an MoE's unrounded slot sums) is rounded to the residual's dtype first."""
    if residual is not None:
        x = x.to(residual.dtype) + residual
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


def rms_norm_int8(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None, k_pad: int
) -> tuple[torch.Tensor, torch.Tensor, Int8Rows]:
    """rms_norm of x [T, H] on the Triton path, plus its output rounded to int8 for the quantized decode kernels
    (kernels/quant/int8_dot.py; K padded to k_pad), in one launch: (normed, new residual, Int8Rows)."""
    from moerun.kernels.rmsnorm import rms_norm_int8_triton

    return rms_norm_int8_triton(x, weight, eps, residual, k_pad)
