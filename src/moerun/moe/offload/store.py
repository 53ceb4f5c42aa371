"""The host store: every expert of every MoE layer in host memory, pinned for fast copies to the device.

A layer's experts are a few stacked "parts" with a leading expert dimension: dense w13 [E, 2I, H] and w2 [E, H, I],
or, for GGUF models, the raw block bytes of each quantized tensor (e.g. gate, up and down as uint8
[E, rows, row_bytes]). Expert e of a layer is the e-th row of each part; quantized experts travel as block bytes.

Pinning: tensors the store owns are page-locked in place (cudaHostRegister, exact size); tensors it may not write
to (a read-only memory map) are copied into one pinned arena. Arenas start on a 2 MiB boundary and are advised to
take transparent huge pages before they are touched (page-locking 16 GiB so took 4.2 s against 7.6 s on an H100
host). With ``pinned=False`` the parts stay where they are (e.g. a memory-mapped GGUF) and copies go through a pinned
staging ring instead (transfer.py).
"""

from __future__ import annotations

import ctypes
import logging
import sys
import weakref
from dataclasses import dataclass

import numpy as np
import torch

from moerun.formats.quants import QuantizedTensor
from moerun.layers.quantized import QuantizedWeight

logger = logging.getLogger("moerun")


@dataclass(frozen=True)
class PartSpec:
    """One stacked part of a layer's experts: what it is and how one expert's slice is laid out."""

    which: str  # 'w13' or 'w2': the weight the part belongs to (parts of one weight stack along rows)
    shape: tuple[int, ...]  # one expert's slice as stored: dense (rows, cols) or raw (rows, row_bytes)
    dtype: torch.dtype  # dense dtype, or torch.uint8 for raw GGUF blocks
    qtype: int | None = None  # GGUF type of raw blocks; None for dense
    cols: int = 0  # logical columns of a quantized part
    name: str = ""

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape)) * torch.empty((), dtype=self.dtype).element_size()


def layer_parts(experts: object) -> tuple[list[torch.Tensor], list[PartSpec]]:
    """The stacked parts [E, ...] and their specs of an ``Experts`` module (dense or quantized weights)."""
    tensors, specs = [], []
    for which in ("w13", "w2"):
        q = experts.__dict__.get(f"q_{which}")
        if q is None:
            t = getattr(experts, which).detach()
            tensors.append(t)
            specs.append(PartSpec(which, tuple(t.shape[1:]), t.dtype))
            continue
        for p in q.parts:
            tensors.append(p.raw)
            specs.append(PartSpec(which, tuple(p.raw.shape[1:]), torch.uint8, int(p.qtype), p.shape[-1], p.name))
    return tensors, specs


def weights_from_parts(parts: list[torch.Tensor], specs: list[PartSpec]) -> tuple[object, object]:
    """(w13, w2) over stacked parts [N, ...]: the dense tensors, or QuantizedWeights viewing the raw blocks."""
    out = []
    for which in ("w13", "w2"):
        chosen = [(t, s) for t, s in zip(parts, specs) if s.which == which]
        if len(chosen) == 1 and chosen[0][1].qtype is None:
            out.append(chosen[0][0])
            continue
        if any(s.qtype is None for _, s in chosen):
            raise ValueError(f"{which}: dense and quantized parts cannot be mixed")
        out.append(QuantizedWeight([QuantizedTensor(t, s.qtype, (t.shape[0], s.shape[0], s.cols), s.name)
                                    for t, s in chosen]))
    return out[0], out[1]


class HostExpertStore:
    """parts[layer][i]: host tensor [E, *specs[layer][i].shape]; ``expert_parts(l, e)`` are its e-th rows."""

    def __init__(self, parts: list[list[torch.Tensor]], specs: list[list[PartSpec]], pinned: bool = False,
                 registered: list[int] | None = None) -> None:
        if len(parts) != len(specs) or not parts:
            raise ValueError(f"expected one list of parts per MoE layer, got {len(parts)} and {len(specs)} specs")
        self.parts, self.specs, self.pinned = parts, specs, pinned
        self.num_layers = len(parts)
        self.num_experts = int(parts[0][0].shape[0])
        self._registered: list[int] = registered if registered is not None else []  # cudaHostRegister'd
        self._finalizer = weakref.finalize(self, unregister_all, self._registered)

    @classmethod
    def from_experts(cls, experts: list[object], pin: bool) -> "HostExpertStore":
        """The experts of each layer's ``Experts`` module (on the host), pinned if asked and possible."""
        parts, specs = [], []
        for ex in experts:
            t, s = layer_parts(ex)
            bad = [x.device for x in t if x.device.type != "cpu"]
            if bad:
                raise ValueError(f"the host store takes experts in host memory, found a part on {bad[0]}")
            parts.append(t)
            specs.append(s)
        store = cls(parts, specs)
        if pin:
            store.pin()
        return store

    # ---- layout ----
    def expert_bytes(self, layer: int) -> int:
        return sum(s.nbytes for s in self.specs[layer])

    @property
    def total_bytes(self) -> int:
        return sum(self.expert_bytes(layer) for layer in range(self.num_layers)) * self.num_experts

    def expert_parts(self, layer: int, expert: int) -> list[torch.Tensor]:
        """Host views of one expert: one tensor per part."""
        return [t[expert] for t in self.parts[layer]]

    def weights(self, layer: int) -> tuple[object, object]:
        """The layer's (w13, w2) in host memory, for computing experts on the CPU."""
        return weights_from_parts(self.parts[layer], self.specs[layer])

    # ---- pinning ----
    def pin(self) -> None:
        """Page-locks every part: in place where allowed, else by copying into one pinned arena."""
        if self.pinned or not torch.cuda.is_available():
            return
        copies = []
        for layer, ts in enumerate(self.parts):
            for i, t in enumerate(ts):
                # raw GGUF blocks usually view a read-only memory map, which cannot be page-locked: copy them
                in_place = t.dtype != torch.uint8 and t.is_contiguous()
                if not (in_place and _register(t, self._registered)):
                    copies.append((layer, i))
        if copies:
            total = sum(_aligned(self.parts[layer][i].numel() * self.parts[layer][i].element_size())
                        for layer, i in copies)
            arena = pinned_empty(total, self._registered)
            offset = 0
            for layer, i in copies:
                t = self.parts[layer][i]
                n = t.numel() * t.element_size()
                view = arena[offset : offset + n].view(t.dtype).view(t.shape)
                view.copy_(t)
                self.parts[layer][i] = view
                offset += _aligned(n)
            logger.info("copied %d expert parts (%.2f GiB) into pinned memory", len(copies), total / 2**30)
        self.pinned = True

    def close(self) -> None:
        self._finalizer()


def _aligned(n: int, to: int = 4096) -> int:
    return (n + to - 1) // to * to


HUGE_PAGE = 2**21
_MADV_HUGEPAGE = 14


def huge_page_empty(nbytes: int) -> torch.Tensor:
    """An uninitialised uint8 host tensor of ``nbytes`` starting on a 2 MiB boundary, advised (before any page is
    touched) to be backed by 2 MiB pages where the kernel allows transparent huge pages."""
    if nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    raw = torch.empty(nbytes + HUGE_PAGE, dtype=torch.uint8)
    start = raw.data_ptr() + (-raw.data_ptr()) % HUGE_PAGE
    _madvise(start, nbytes, _MADV_HUGEPAGE)
    # a tensor whose storage starts at the aligned address, not a view into raw: torch judges a tensor pinned by
    # its storage's first byte, and only the aligned region is page-locked
    window = (ctypes.c_uint8 * nbytes).from_address(start)
    window.owner = raw  # the buffer keeps raw's memory alive as long as the tensor holds the buffer
    return torch.frombuffer(window, dtype=torch.uint8)


def _madvise(address: int, nbytes: int, advice: int) -> bool:
    """Linux's madvise (the advice numbers are Linux's); True when it took the advice."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        return libc.madvise(address, nbytes, advice) == 0
    except (OSError, AttributeError):  # a libc without madvise
        return False


def pinned_empty(nbytes: int, registry: list[int]) -> torch.Tensor:
    """An uninitialised uint8 host tensor of exactly ``nbytes``, page-locked (unregistered by the registry's
    owner) and advised to take huge pages; falls back to the caching pinned allocator when registration is not
    available."""
    t = huge_page_empty(nbytes)
    if _register(t, registry):
        return t
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


def _register(t: torch.Tensor, registry: list[int]) -> bool:
    """cudaHostRegister on a tensor's memory; True when it is page-locked now."""
    nbytes = t.numel() * t.element_size()
    if nbytes == 0:
        return True
    try:
        cudart = torch.cuda.cudart()
        err = cudart.cudaHostRegister(t.data_ptr(), nbytes, 0)
    except (AttributeError, RuntimeError):
        return False
    if int(err) != 0:
        clear = getattr(cudart, "cudaGetLastError", None)
        if clear is not None:  # a failed call leaves the runtime's last error set; a later launch check reads it
            clear()
        return False
    registry.append(t.data_ptr())
    return True


def unregister_all(registry: list[int]) -> None:
    """Unlocks every address a registry holds (from ``pinned_empty`` or in-place pinning) and empties it."""
    if not registry:
        return
    try:
        cudart = torch.cuda.cudart()
        for ptr in registry:
            cudart.cudaHostUnregister(ptr)
    except Exception:  # interpreter shutdown: the driver releases the memory with the process
        pass
    registry.clear()
