"""Random weights for a model built in memory (benchmarks of real shapes; no checkpoint is needed)."""

from __future__ import annotations

import torch
from torch import nn

from moerun.config import ModelConfig
from moerun.models.loading import build_empty_model


@torch.no_grad()
def random_model(config: ModelConfig, device: torch.device, seed: int = 0, moe_backend: str | None = None,
                 std: float = 0.02) -> nn.Module:
    """The model with normal(0, std) matrices and norm weights near 1, generated directly on device."""
    model = build_empty_model(config, device, moe_backend)
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    for name, p in model.named_parameters():
        if p.dim() == 1:
            p.fill_(1.0) if name.endswith("norm.weight") else p.normal_(0.0, std, generator=g)
        elif name.endswith("mlp.gate.weight"):
            p.normal_(0.0, 1.0 / config.hidden_size**0.5, generator=g)  # router: moderately confident routing
        else:
            p.normal_(0.0, std, generator=g)
    return model
