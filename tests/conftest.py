"""Shared fixtures: the default tiny checkpoint and an LLM on it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from helpers import build_checkpoint
from moerun.models.tiny import QWEN3_VOCAB_SIZE

# the test models are tiny: threads cost more in synchronisation than they gain
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> Path:
    """The default tiny checkpoint: 4 MoE layers, 8 experts, top-2, tied embeddings, the full Qwen3 vocabulary."""
    return build_checkpoint(tmp_path_factory.mktemp("tiny"), seed=0, vocab_size=QWEN3_VOCAB_SIZE)


@pytest.fixture(scope="session")
def tiny_llm(tiny_checkpoint):
    from moerun import LLM

    return LLM(str(tiny_checkpoint), device="cpu", max_model_len=512, max_num_seqs=8)
