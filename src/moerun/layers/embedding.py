"""Token embedding table (its parameters start uninitialised: the checkpoint fills them)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Embedding(nn.Module):
    """ids [T] -> rows [T, H] of weight [V, H]."""

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        q = self.__dict__.get("q_weight")
        if q is not None:
            from moerun.ops.quant import quantized_rows

            return quantized_rows(q, ids, self.dtype)  # [T, H]
        return F.embedding(ids, self.weight)

    @property
    def dtype(self) -> torch.dtype:
        """The model's compute dtype (kept when the table itself is quantized)."""
        return self.__dict__.get("compute_dtype") or self.weight.dtype
