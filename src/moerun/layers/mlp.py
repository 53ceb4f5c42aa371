"""The dense SiLU-gated MLP of the layers that have no experts."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moerun.layers.linear import Linear, MergedLinear


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)) with gate|up as one projection."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_up_proj = MergedLinear(hidden_size, [intermediate_size] * 2, ["gate", "up"])
        self.down_proj = Linear(intermediate_size, hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj.split(self.gate_up_proj(x))
        return self.down_proj(F.silu(gate) * up)
