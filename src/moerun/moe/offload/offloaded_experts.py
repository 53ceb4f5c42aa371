"""OffloadedExperts: the drop-in replacement of a layer's ``Experts`` when its weights live in the host store.

It holds no weights: ``forward`` hands the routing result to the model's offload manager, which serves the layer
from the device slot pool and, for what is not cached, copies it or computes it on the CPU (manager.py) or reads it
in place from pinned host memory (zero_copy.py).
"""

from __future__ import annotations

import torch
from torch import nn


class OffloadedExperts(nn.Module):
    """forward(x [T, H], weights [T, k], ids [T, k]) -> [T, H], like ``Experts``."""

    def __init__(self, manager: object, layer: int, num_experts: int, hidden_size: int, intermediate_size: int,
                 backend: str | None) -> None:
        super().__init__()
        self.layer = layer  # index among the model's MoE layers
        self.num_experts, self.hidden_size, self.intermediate_size = num_experts, hidden_size, intermediate_size
        self.backend = backend
        self.__dict__["manager"] = manager  # not a submodule: the manager is shared by every layer

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                keep_float32: bool = False) -> torch.Tensor:  # fmt: skip
        """keep_float32: ops.fused_moe's (the result may be float32 slot sums, for a consumer that rounds them)."""
        return self.__dict__["manager"].forward_layer(self.layer, x, topk_weights, topk_ids, keep_float32)

    def extra_repr(self) -> str:
        return f"layer={self.layer}, experts={self.num_experts}, offloaded"
