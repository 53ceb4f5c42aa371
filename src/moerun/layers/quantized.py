"""Weights kept in GGUF blocks inside the model: one or more QuantizedTensors stacked along the rows.

A layer whose checkpoint tensors are block-quantised holds a QuantizedWeight instead of a dense Parameter
(q|k|v may each have a different type, so the parts stay separate). The CPU path dequantises a layer's
weight when it runs; the touched experts of an MoE layer are dequantised one by one.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from moerun.formats.quants import QuantizedTensor


class QuantizedWeight:
    """Parts [..., rows_i, cols] concatenated along the row dimension into the logical weight."""

    def __init__(self, parts: Sequence[QuantizedTensor]) -> None:
        if not parts:
            raise ValueError("a quantized weight needs at least one part")
        lead, cols = parts[0].shape[:-2], parts[0].shape[-1]
        for p in parts:
            if p.shape[:-2] != lead or p.shape[-1] != cols:
                raise ValueError(f"quantized parts do not stack: {[q.shape for q in parts]}")
        self.parts = list(parts)
        self.shape = (*lead, sum(p.shape[-2] for p in parts), cols)

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    @property
    def device(self) -> torch.device:
        return self.parts[0].device

    @property
    def qtypes(self) -> list[str]:
        return [p.qtype.name for p in self.parts]

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """The whole weight, dense."""
        return torch.cat([p.dequantize(dtype) for p in self.parts], dim=-2)

    def expert(self, e: int, dtype: torch.dtype) -> torch.Tensor:
        """Expert e of a stacked [E, rows, cols] weight, dense [rows, cols]."""
        return torch.cat([p[e].dequantize(dtype) for p in self.parts], dim=-2)

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows ids [T] of a [rows, cols] weight, dense [T, cols] (an embedding lookup)."""
        if len(self.parts) != 1:
            return self.dequantize(dtype)[ids]
        p = self.parts[0]
        return QuantizedTensor(p.raw[ids], p.qtype, (ids.numel(), p.shape[-1]), p.name).dequantize(dtype)


def set_quantized(module: nn.Module, attr: str, weight: QuantizedWeight) -> None:
    """Replaces module.<attr> (a Parameter) by a QuantizedWeight stored as module.q_<attr>."""
    if attr in module._parameters:
        del module._parameters[attr]
    setattr(module, attr, None)
    module.__dict__[f"q_{attr}"] = weight


def dense_or_dequantized(module: nn.Module, attr: str, dtype: torch.dtype) -> torch.Tensor:
    """module.<attr> when dense; its dequantised QuantizedWeight otherwise."""
    q = module.__dict__.get(f"q_{attr}")
    return getattr(module, attr) if q is None else q.dequantize(dtype)
