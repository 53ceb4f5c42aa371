"""PackedSlotPool: device slots of quantized experts kept in the repacked layout the fused quantized kernels read.

The plain pool (pool.py) holds the GGUF blocks of each slot; the fused quantized kernels need them repacked
(kernels/quant/repack.py), and repacking the whole pool on every pass would cost more than the pass. Here each
layer keeps its slots repacked ([S + 1, ...] arrays per packed part; row S, the null slot, decodes to zeros).
The experts admitted together into a layer arrive (GGUF blocks) in the rows of a staging area, and
``repack_staged`` repacks them in one go (a dozen small operations per part, whatever the number of experts)
into their slots. On CUDA the copies and the repack run on the copy stream, in issue order, so one staging area
serves every layer whose parts have its layout. A pass then runs the fused quantized kernels on slot ids, as for
dense slots.

With a pinned host store on CUDA whose repacked copy fits in host memory (or ``host_copy``: zero-copy offloading
reads the host copy in place) the pool first keeps a repacked copy of every expert in host memory, page-locked in
place on CUDA at its exact size (``host_packed``, made layer by layer on the device at start-up): an admission is
then plain copies of the expert's packed arrays into its slot (``packed_copy``), with no staging and no repack on
the host's path.
"""

from __future__ import annotations

import weakref

import torch

from moerun.engine.memory import available_bytes
from moerun.formats.quants import QuantType
from moerun.kernels.quant.repack import PackedWeight, packed_nbytes
from moerun.moe.offload.store import HostExpertStore, PartSpec, pinned_empty, unregister_all, weights_from_parts
from moerun.ops.quant import fused_kernels_apply, packed_parts


STAGING_ROWS = 8  # experts repacked together at most


class PackedSlotPool:
    """packed[layer] = (w13 parts, w2 parts): PackedWeights [S + 1, N, K]; staging[layer]: raw rows [R, ...] per
    part, shared by the layers of one layout."""

    quantized = True

    def __init__(self, specs: list[list[PartSpec]], slots_per_layer: int, device: torch.device,
                 store: HostExpertStore | None = None, host_copy: bool = False) -> None:
        self.specs, self.slots_per_layer, self.device = specs, slots_per_layer, device
        self.null_slot = slots_per_layer
        self.staging_rows = max(1, min(STAGING_ROWS, slots_per_layer))
        areas: dict[tuple, list[torch.Tensor]] = {}
        for layer in specs:
            if _layout(layer) not in areas:
                areas[_layout(layer)] = [torch.zeros((self.staging_rows, *s.shape), dtype=s.dtype, device=device)
                                         for s in layer]  # fmt: skip
        self.staging = [areas[_layout(layer)] for layer in specs]
        self.packed: list[tuple[list[PackedWeight], list[PackedWeight]]] = []
        for layer in range(len(specs)):
            zero13, zero2 = self._repack_staging(layer, 1)  # a zero expert: decodes to zeros
            self.packed.append((_repeat(zero13, slots_per_layer + 1), _repeat(zero2, slots_per_layer + 1)))
        self.host_packed: list[tuple[list[PackedWeight], list[PackedWeight]]] | None = None
        self._registered: list[int] = []  # host copy memory page-locked in place (cudaHostRegister)
        self._finalizer = weakref.finalize(self, unregister_all, self._registered)
        if store is not None and (host_copy or (store.pinned and device.type == "cuda"
                                                and host_copy_fits(specs, store.num_experts))):
            pin = self._registered if device.type == "cuda" else None
            self.host_packed = [_host_packed(store, layer, device, pin) for layer in range(len(specs))]
            self.staging = []  # admissions copy the packed host arrays; the staging areas would only hold memory

    @staticmethod
    def applies(specs: list[list[PartSpec]]) -> bool:
        """Whether every layer's quantized parts run in the fused quantized kernels (checked on one zero expert
        per distinct layout of a layer's parts)."""
        layouts = {_layout(layer): layer for layer in specs}
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

    def staging_views(self, layer: int, row: int) -> list[torch.Tensor]:
        """Where the row-th expert of an admission batch of ``layer`` is copied (its GGUF blocks, one view per
        part) before ``repack_staged``."""
        self._check_staging()
        if not 0 <= row < self.staging_rows:
            raise IndexError(f"staging row {row} outside [0, {self.staging_rows})")
        return [t[row] for t in self.staging[layer]]

    def repack_staged(self, layer: int, slots: list[int]) -> None:
        """Repacks staging rows [0, len(slots)) of ``layer`` into ``slots`` (queue it on the stream that copied
        the blocks, after the copies)."""
        self._check_staging()
        if not 0 < len(slots) <= self.staging_rows:
            raise ValueError(f"{len(slots)} experts to repack; a batch holds 1 to {self.staging_rows}")
        for slot in slots:
            if not 0 <= slot < self.slots_per_layer:
                raise IndexError(f"layer {layer}: slot {slot} outside [0, {self.slots_per_layer})")
        for dst_parts, src_parts in zip(self.packed[layer], self._repack_staging(layer, len(slots))):
            for dst, src in zip(dst_parts, src_parts):
                for d, s in zip(dst.tensors(), src.tensors()):
                    if d is not None:
                        for row, slot in enumerate(slots):
                            d[slot].copy_(s[row])

    def packed_copy(self, layer: int, slot: int, expert: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(slot arrays, the expert's pinned packed arrays): what admitting ``expert`` into ``slot`` copies
        (``host_packed`` only)."""
        if self.host_packed is None:
            raise ValueError("this pool keeps no packed host copy of the experts")
        if not 0 <= slot < self.slots_per_layer:
            raise IndexError(f"layer {layer}: slot {slot} outside [0, {self.slots_per_layer})")
        dst, src = [], []
        for dst_parts, src_parts in zip(self.packed[layer], self.host_packed[layer]):
            for d, s in zip(dst_parts, src_parts):
                for dt, st in zip(d.tensors(), s.tensors()):
                    if dt is not None:
                        dst.append(dt[slot])
                        src.append(st[expert])
        return dst, src

    def weights(self, layer: int) -> tuple[list[PackedWeight], list[PackedWeight]]:
        """(w13, w2) over the whole pool of a layer, repacked: the fused quantized kernels take them on slot ids."""
        return self.packed[layer]

    def _check_staging(self) -> None:
        if not self.staging:
            raise ValueError("this pool keeps a packed host copy of the experts and no staging area: admissions copy "
                             "the packed arrays (packed_copy)")

    def _repack_staging(self, layer: int, rows: int) -> tuple[list[PackedWeight], list[PackedWeight]]:
        # fresh QuantizedWeights over the first staging rows: nothing cached from an earlier batch
        w13, w2 = weights_from_parts([t[:rows] for t in self.staging[layer]], self.specs[layer])
        return packed_parts(w13), packed_parts(w2)


def packed_part_bytes(spec: PartSpec) -> int:
    """Bytes of one expert's slice of a part once repacked (dense parts as they are)."""
    if spec.qtype is None:
        return spec.nbytes
    return max(spec.nbytes, packed_nbytes(QuantType(spec.qtype), (spec.shape[0], spec.cols)))


def host_copy_fits(specs: list[list[PartSpec]], num_experts: int) -> bool:
    """Whether a repacked host copy of every expert takes at most half of the host memory available now."""
    nbytes = sum(packed_part_bytes(s) for layer in specs for s in layer) * num_experts
    return nbytes <= available_bytes(torch.device("cpu")) // 2


def _host_packed(store: HostExpertStore, layer: int, device: torch.device,
                 registry: list[int] | None) -> tuple[list[PackedWeight], list[PackedWeight]]:
    """Every expert of one layer repacked (on ``device``) into host arrays (w13 parts, w2 parts) [E, N, K],
    page-locked at their exact size when a registry is given (the caching pinned allocator would round each
    array up to a power of two)."""
    w13, w2 = weights_from_parts([t.to(device, non_blocking=True) for t in store.parts[layer]], store.specs[layer])
    out = []
    for parts in (packed_parts(w13), packed_parts(w2)):
        host = []
        for p in parts:
            arrays = [None if t is None else _host_like(t, registry).copy_(t) for t in p.tensors()]
            host.append(PackedWeight(p.qtype, p.shape, p.k_pad, *arrays))
        out.append(host)
    return out[0], out[1]


def _host_like(t: torch.Tensor, registry: list[int] | None) -> torch.Tensor:
    if registry is None:
        return torch.empty(t.shape, dtype=t.dtype)
    return pinned_empty(t.numel() * t.element_size(), registry).view(t.dtype).view(t.shape)


def _layout(layer: list[PartSpec]) -> tuple:
    """What a layer's staging area depends on: its parts' kinds, shapes and types."""
    return tuple((s.which, s.shape, s.dtype, s.qtype, s.cols) for s in layer)


def _repeat(parts: list[PackedWeight], n: int) -> list[PackedWeight]:
    """Copies of one-expert PackedWeights [1, N, K] stacked n times: [n, N, K] with their own storage."""
    out = []
    for p in parts:
        arrays = [None if t is None else t.expand(n, *t.shape[1:]).contiguous() for t in p.tensors()]
        out.append(PackedWeight(p.qtype, (n, *p.shape[1:]), p.k_pad, *arrays))
    return out
