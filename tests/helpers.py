"""Helpers shared by the tests: seeded tiny checkpoints and their transformers reference models."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from moerun.models.tiny import make_tiny_checkpoint

# Small vocabulary for speed; token ids of the tests stay below it.
SMALL_VOCAB = 1024


def build_checkpoint(folder: Path, seed: int, **overrides) -> Path:
    """A float32 tiny checkpoint (for exact comparisons) with a small vocabulary unless overridden."""
    overrides.setdefault("vocab_size", SMALL_VOCAB)
    overrides.setdefault("torch_dtype", "float32")
    spelling = overrides.pop("spelling", "published")
    fused = overrides.pop("fused_experts", False)
    with_tokenizer = overrides.pop("with_tokenizer", True)
    return make_tiny_checkpoint(folder, seed=seed, spelling=spelling, fused_experts=fused, dtype=torch.float32,
                                with_tokenizer=with_tokenizer, **overrides)


def reference_model(folder: Path):
    """transformers' Qwen3MoeForCausalLM on the same checkpoint, float32, eager attention."""
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(folder), dtype=torch.float32, attn_implementation="eager", experts_implementation="eager"
    )
    return model.eval()


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())
