"""Architecture name -> model class. A second architecture is added here and nowhere else."""

from __future__ import annotations

from torch import nn

from moerun.models.qwen3_moe import Qwen3MoeForCausalLM

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
}


def get_model_class(architecture: str) -> type[nn.Module]:
    if architecture not in MODEL_REGISTRY:
        raise ValueError(f"architecture {architecture!r} is not supported; moerun supports {sorted(MODEL_REGISTRY)}")
    return MODEL_REGISTRY[architecture]
