"""RMSNorm, computed in float32 and cast back, as Qwen3 defines it."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """y = weight * (x / sqrt(mean(x^2) + eps)), the normalisation in float32, the product in x's dtype."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dtype)

    def forward_with_residual(
        self, x: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Adds x to the residual stream, then normalises: returns (normed, new residual)."""
        if residual is not None:
            x = x + residual
        return self.forward(x), x
