"""The sparse MoE block: router (a linear layer + softmax/top-k) then the experts backend."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moerun import ops
from moerun.config import ModelConfig
from moerun.layers.linear import Linear
from moerun.moe.experts import Experts


class SparseMoeBlock(nn.Module):
    """x [T, H] -> sum over the k routed experts of weight * expert(x)."""

    def __init__(self, config: ModelConfig, layer: int, backend: str | None = None) -> None:
        super().__init__()
        self.layer = layer
        self.top_k = config.num_experts_per_tok
        self.renormalize = config.norm_topk_prob
        self.gate = Linear(config.hidden_size, config.num_experts)  # router, weight [E, H]
        self.experts = Experts(config.num_experts, config.hidden_size, config.moe_intermediate_size, backend)

    def router_logits(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.gate.weight)  # [T, E], in the model dtype as transformers computes it

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.router_logits(x)
        topk_weights, topk_ids = ops.route(logits, self.top_k, self.renormalize, backend=self.experts.backend)
        return self.experts(x, topk_weights, topk_ids)
