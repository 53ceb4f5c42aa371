"""Weights kept in GGUF blocks inside the model: one or more QuantizedTensors stacked along the rows.

A layer whose checkpoint tensors are block-quantised holds a QuantizedWeight instead of a dense Parameter
(q|k|v may each have a different type, so the parts stay separate). The CPU path dequantises a layer's
weight when it runs; the touched experts of an MoE layer are dequantised one by one. Once the kernels' repacked
copy exists (ops/quant.py caches it as `packed`), `release_blocks` drops the GGUF blocks so that the weight is
held once; it then answers from the repacked arrays.
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
    def released(self) -> bool:
        """True once the GGUF blocks were dropped in favour of the repacked copy."""
        return not self.parts

    def _stored(self) -> list:
        """What holds the weight now: the GGUF parts, or the repacked parts (PackedWeights) once released."""
        return self.parts or self.__dict__["packed"]

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self._stored())

    @property
    def device(self) -> torch.device:
        return self._stored()[0].device

    @property
    def qtypes(self) -> list[str]:
        return [p.qtype.name for p in self._stored()]

    def release_blocks(self) -> None:
        """Drops the GGUF blocks, keeping only the repacked copy (`packed`, made by ops.quant.packed_parts)."""
        packed = self.__dict__.get("packed")
        if not packed or packed[0].device != self.device:
            raise ValueError(f"weight of shape {self.shape}: repack it on its device before releasing its blocks")
        self.parts = []

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """The whole weight, dense."""
        return torch.cat([p.dequantize(dtype) for p in self._stored()], dim=-2)

    def expert(self, e: int, dtype: torch.dtype) -> torch.Tensor:
        """Expert e of a stacked [E, rows, cols] weight, dense [rows, cols]."""
        return torch.cat([p[e].dequantize(dtype) for p in self._stored()], dim=-2)

    def experts(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Experts ids [n] (repeats allowed) of a stacked [E, rows, cols] weight, dense [n, rows, cols], gathered on
        the weight's device without a host synchronisation."""
        if self.released:
            raise ValueError("expert gathers read the GGUF blocks, which this weight released")
        parts = [QuantizedTensor(p.raw.index_select(0, ids), p.qtype, (ids.numel(), *p.shape[-2:]), p.name)
                 for p in self.parts]  # fmt: skip
        return torch.cat([p.dequantize(dtype) for p in parts], dim=-2)

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows ids [T] of a [rows, cols] weight, dense [T, cols] (an embedding lookup)."""
        if self.released:
            raise ValueError("row lookups read the GGUF blocks, which this weight released")
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
