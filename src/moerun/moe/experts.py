"""The experts of one MoE layer, stacked: w13 [E, 2I, H] (gate rows, then up rows) and w2 [E, H, I].

This is the seam between the model and the experts backends: the model calls ``Experts.forward`` with the
routing result, and the backend (torch reference, Triton, quantized, offloaded) decides how to compute it.
"""

from __future__ import annotations

import torch
from torch import nn

from moerun import ops
from moerun.layers.linear import ShardIndex, attach_shard_index


class Experts(nn.Module):
    """E experts of the SiLU-gated MLP; forward(x [T, H], weights [T, k], ids [T, k]) -> [T, H]."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, backend: str | None = None):
        super().__init__()
        E, H, I = num_experts, hidden_size, intermediate_size
        self.num_experts, self.hidden_size, self.intermediate_size = E, H, I
        self.w13 = nn.Parameter(torch.empty(E, 2 * I, H))
        self.w2 = nn.Parameter(torch.empty(E, H, I))
        attach_shard_index(self, "w13", self._w13_index)
        attach_shard_index(self, "w2", self._w2_index)
        self.backend = backend

    def _w13_index(self, shard_id: tuple[int | None, str]) -> ShardIndex:
        expert, part = shard_id
        e = slice(None) if expert is None else expert
        rows = {"gate": slice(0, self.intermediate_size), "up": slice(self.intermediate_size, None),
                "gate_up": slice(None)}[part]
        return (e, rows)

    def _w2_index(self, shard_id: tuple[int | None, str]) -> ShardIndex:
        expert, part = shard_id
        if part != "down":
            raise KeyError(f"unknown shard {part!r} for w2")
        return (slice(None) if expert is None else expert,)

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        w13 = self.__dict__.get("q_w13") or self.w13
        w2 = self.__dict__.get("q_w2") or self.w2
        return ops.fused_moe(x, w13, w2, topk_weights, topk_ids, backend=self.backend)
