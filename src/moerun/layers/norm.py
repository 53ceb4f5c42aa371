"""RMSNorm, computed in float32 and cast back, as Qwen3 defines it (optionally fused with the residual add)."""

from __future__ import annotations

import torch
from torch import nn

from moerun import ops


class RMSNorm(nn.Module):
    """y = weight * (x / sqrt(mean(x^2) + eps)), the normalisation in float32, the product in x's dtype."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.rms_norm(x, self.weight, self.eps)[0]

    def forward_with_residual(
        self, x: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Adds x to the residual stream, then normalises: returns (normed, new residual)."""
        return ops.rms_norm(x, self.weight, self.eps, residual)
