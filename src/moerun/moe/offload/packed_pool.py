"""PackedSlotPool: device slots of quantized experts kept in the repacked layout the fused quantized kernels read.

The plain pool (pool.py) holds the GGUF blocks of each slot; the fused quantized kernels need them repacked
(kernels/quant/repack.py), and repacking the whole pool on every pass would cost more than the pass. Here each
layer keeps its slots repacked ([S + 1, ...] arrays per packed part; row S, the null slot, decodes to zeros),
and an expert's GGUF blocks arrive in a one-row staging area of the layer, from which ``after_copy`` repacks them
into the slot. On CUDA both the copy and the repack run on the copy stream, in issue order, so one staging row
per layer serves every admission. A pass then runs the fused quantized kernels on slot ids, as for dense slots.
"""

from __future__ import annotations

import torch

from moerun.kernels.quant.repack import PackedWeight
from moerun.moe.offload.store import PartSpec, weights_from_parts
from moerun.ops.quant import fused_kernels_apply, packed_parts


class PackedSlotPool:
    """packed[layer] = (w13 parts, w2 parts): PackedWeights [S + 1, N, K]; staging[layer]: one raw row per part."""

    quantized = True

    def __init__(self, specs: list[list[PartSpec]], slots_per_layer: int, device: torch.device) -> None:
        self.specs, self.slots_per_layer, self.device = specs, slots_per_layer, device
        self.null_slot = slots_per_layer
        self.staging = [[torch.zeros((1, *s.shape), dtype=s.dtype, device=device) for s in layer] for layer in specs]
        self.packed: list[tuple[list[PackedWeight], list[PackedWeight]]] = []
        for layer in range(len(specs)):
            zero13, zero2 = self._repack_staging(layer)  # a zero expert: decodes to zeros
            self.packed.append((_repeat(zero13, slots_per_layer + 1), _repeat(zero2, slots_per_layer + 1)))

    @staticmethod
    def applies(specs: list[list[PartSpec]]) -> bool:
        """Whether every layer's quantized parts run in the fused quantized kernels (checked on one zero expert
        per distinct layout of a layer's parts)."""
        layouts = {tuple((s.which, s.shape, s.qtype, s.cols) for s in layer): layer for layer in specs}
        for layer in layouts.values():
            if any(s.qtype is None for s in layer):
                return False
            stage = [torch.zeros((1, *s.shape), dtype=s.dtype) for s in layer]
            w13, w2 = weights_from_parts(stage, layer)
            try:
                if not fused_kernels_apply(packed_parts(w13), packed_parts(w2)):
                    return False
            except ValueError:  # a type without a repacked layout
                return False
        return True

    def slot_views(self, layer: int, slot: int) -> list[torch.Tensor]:
        """Where one expert's GGUF blocks are copied before ``after_copy(layer, slot)``: the layer's staging row."""
        if not 0 <= slot < self.slots_per_layer:
            raise IndexError(f"layer {layer}: slot {slot} outside [0, {self.slots_per_layer})")
        return [t[0] for t in self.staging[layer]]

    def after_copy(self, layer: int, slot: int) -> None:
        """Repacks the staging row of ``layer`` into ``slot`` (queue it on the stream that copied the blocks)."""
        for dst_parts, src_parts in zip(self.packed[layer], self._repack_staging(layer)):
            for dst, src in zip(dst_parts, src_parts):
                for d, s in zip(dst.tensors(), src.tensors()):
                    if d is not None:
                        d[slot].copy_(s[0])

    def weights(self, layer: int) -> tuple[list[PackedWeight], list[PackedWeight]]:
        """(w13, w2) over the whole pool of a layer, repacked: the fused quantized kernels take them on slot ids."""
        return self.packed[layer]

    def _repack_staging(self, layer: int) -> tuple[list[PackedWeight], list[PackedWeight]]:
        # fresh QuantizedWeights over the staging row: nothing cached from an earlier expert
        w13, w2 = weights_from_parts(self.staging[layer], self.specs[layer])
        return packed_parts(w13), packed_parts(w2)


def _repeat(parts: list[PackedWeight], n: int) -> list[PackedWeight]:
    """Copies of one-expert PackedWeights [1, N, K] stacked n times: [n, N, K] with their own storage."""
    out = []
    for p in parts:
        arrays = [None if t is None else t.expand(n, *t.shape[1:]).contiguous() for t in p.tensors()]
        out.append(PackedWeight(p.qtype, (n, *p.shape[1:]), p.k_pad, *arrays))
    return out
