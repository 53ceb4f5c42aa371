"""Device slot pools: per MoE layer, one tensor per expert part with ``slots + 1`` rows.

Row ``slots`` (the null slot) is all zeros and never written: routing pairs that a pass must skip point there
with weight 0, so the fused kernels run on slot ids unchanged, and a zero expert adds exactly nothing.
"""

from __future__ import annotations

import torch

from moerun.formats.quants import QuantizedTensor
from moerun.moe.offload.store import PartSpec, weights_from_parts


class SlotPool:
    """parts[layer][i]: device tensor [S + 1, *spec.shape] (dense dtype or uint8 GGUF blocks)."""

    def __init__(self, specs: list[list[PartSpec]], slots_per_layer: int, device: torch.device) -> None:
        self.specs, self.slots_per_layer, self.device = specs, slots_per_layer, device
        self.null_slot = slots_per_layer
        self.parts = [[torch.zeros((slots_per_layer + 1, *s.shape), dtype=s.dtype, device=device) for s in layer]
                      for layer in specs]
        self._weights = [weights_from_parts(p, s) for p, s in zip(self.parts, specs)]
        self.quantized = any(s.qtype is not None for layer in specs for s in layer)

    @staticmethod
    def nbytes(specs: list[list[PartSpec]], slots_per_layer: int) -> int:
        """Device bytes of pools of ``slots_per_layer`` slots (plus the null slot) for every layer."""
        return sum(s.nbytes for layer in specs for s in layer) * (slots_per_layer + 1)

    def slot_views(self, layer: int, slot: int) -> list[torch.Tensor]:
        """The device rows of one slot, one per part (copy destinations)."""
        if not 0 <= slot < self.slots_per_layer:
            raise IndexError(f"layer {layer}: slot {slot} outside [0, {self.slots_per_layer})")
        return [t[slot] for t in self.parts[layer]]

    def weights(self, layer: int) -> tuple[object, object]:
        """(w13, w2) over the whole pool of a layer: [S + 1, 2I, H] and [S + 1, H, I], dense or quantized."""
        return self._weights[layer]

    def dense_subset(self, layer: int, slots: list[int], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Dequantised (w13 [m + 1, 2I, H], w2 [m + 1, H, I]) of the given slots followed by the null slot, so
        that a pass dequantises only the experts it computes."""
        index = torch.tensor([*slots, self.null_slot], dtype=torch.int64).to(self.device, non_blocking=True)
        out = []
        for which in ("w13", "w2"):
            pieces = []
            for t, s in zip(self.parts[layer], self.specs[layer]):
                if s.which != which:
                    continue
                rows = t.index_select(0, index)  # [m + 1, *shape]
                if s.qtype is None:
                    pieces.append(rows.to(dtype))
                else:
                    q = QuantizedTensor(rows, s.qtype, (rows.shape[0], s.shape[0], s.cols), s.name)
                    pieces.append(q.dequantize(dtype))
            out.append(pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=1))
        return out[0], out[1]
