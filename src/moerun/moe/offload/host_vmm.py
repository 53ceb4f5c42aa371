"""Host memory for experts that kernels read in place, allocated through the CUDA driver (ctypes, no extra package).

Two kinds besides plain page-locked memory (``cudaHostRegister`` / ``pin_memory``):
- ``vmm``: ``cuMemCreate`` with a host location, mapped at one address for the CPU and the GPU in chunks of the
  allocation granularity, so that the GPU may map it with large pages (a kernel reading freshly routed experts
  over PCIe otherwise walks a 4 KiB page table entry per page);
- ``write_combined``: ``cuMemHostAlloc`` with CU_MEMHOSTALLOC_WRITECOMBINED (reads by the GPU need not snoop the
  CPU's caches; the CPU reads it slowly, so it is written once and read by the GPU only).

Each allocator returns a ``HostRegion`` (its uint8 CPU tensor and ``close()``), or None where the driver lacks
the call or refuses it, so that callers can fall back to ``cudaHostRegister``.
"""

from __future__ import annotations

import ctypes
import weakref
from dataclasses import dataclass, field
from typing import Callable

import torch

_PINNED = 1  # CU_MEM_ALLOCATION_TYPE_PINNED
_LOC_DEVICE, _LOC_HOST, _LOC_HOST_NUMA = 1, 2, 3  # CUmemLocationType
_READWRITE = 3  # CU_MEM_ACCESS_FLAGS_PROT_READWRITE
_GRANULARITY_RECOMMENDED = 1
_HOSTALLOC_PORTABLE, _HOSTALLOC_DEVICEMAP, _HOSTALLOC_WRITECOMBINED = 1, 2, 4


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AllocFlags(ctypes.Structure):
    _fields_ = [("compressionType", ctypes.c_ubyte), ("gpuDirectRDMACapable", ctypes.c_ubyte),
                ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]


class _AllocationProp(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int), ("location", _Location),
                ("win32HandleMetaData", ctypes.c_void_p), ("allocFlags", _AllocFlags)]


class _AccessDesc(ctypes.Structure):
    _fields_ = [("location", _Location), ("flags", ctypes.c_int)]


@dataclass
class HostRegion:
    """``nbytes`` of host memory the GPU reads in place: ``tensor`` (uint8, CPU) over it until ``close()``."""

    tensor: torch.Tensor
    kind: str
    _release: Callable[[], None] = field(repr=False)

    def __post_init__(self) -> None:
        self._finalizer = weakref.finalize(self, self._release)

    def close(self) -> None:
        self._finalizer()


def _driver() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None


last_failure = ""  # why the last allocation here returned None (for benchmarks' logs)


def _check(result: int, what: str) -> None:
    global last_failure
    if result != 0:
        last_failure = f"{what} failed with CUresult {result}"
        raise OSError(last_failure)


def _tensor_at(address: int, nbytes: int) -> torch.Tensor:
    return torch.frombuffer((ctypes.c_ubyte * nbytes).from_address(address), dtype=torch.uint8)


def vmm_host_empty(nbytes: int, device: torch.device) -> HostRegion | None:
    """``cuMemCreate`` on the host (any NUMA node), readable and writable by the CPU and by ``device``."""
    cu = _driver()
    if cu is None or nbytes <= 0 or not hasattr(cu, "cuMemCreate"):
        return None
    torch.zeros(1, device=device)  # the device's primary context, current on this thread
    for where in (_LOC_HOST, _LOC_HOST_NUMA):
        prop = _AllocationProp(type=_PINNED, location=_Location(where, 0))
        gran = ctypes.c_size_t()
        if cu.cuMemGetAllocationGranularity(ctypes.byref(gran), ctypes.byref(prop), _GRANULARITY_RECOMMENDED) == 0:
            region = _vmm_map(cu, prop, gran.value, nbytes, device)
            if region is not None:
                return region
    return None


def _vmm_map(cu: ctypes.CDLL, prop: _AllocationProp, gran: int, nbytes: int, device: torch.device
             ) -> HostRegion | None:
    """Create, reserve, map and grant access; everything undone on failure."""
    size = (nbytes + gran - 1) // gran * gran
    handle, va = ctypes.c_ulonglong(), ctypes.c_ulonglong()
    done: list[Callable[[], None]] = []

    def release() -> None:
        for undo in reversed(done):
            undo()
        done.clear()

    try:
        _check(cu.cuMemCreate(ctypes.byref(handle), ctypes.c_size_t(size), ctypes.byref(prop), ctypes.c_ulonglong(0)),
               "cuMemCreate(host)")
        done.append(lambda h=handle.value: cu.cuMemRelease(ctypes.c_ulonglong(h)))
        _check(cu.cuMemAddressReserve(ctypes.byref(va), ctypes.c_size_t(size), ctypes.c_size_t(gran),
                                      ctypes.c_ulonglong(0), ctypes.c_ulonglong(0)), "cuMemAddressReserve")
        done.append(lambda a=va.value: cu.cuMemAddressFree(ctypes.c_ulonglong(a), ctypes.c_size_t(size)))
        _check(cu.cuMemMap(ctypes.c_ulonglong(va.value), ctypes.c_size_t(size), ctypes.c_size_t(0), handle,
                           ctypes.c_ulonglong(0)), "cuMemMap")
        done.append(lambda a=va.value: cu.cuMemUnmap(ctypes.c_ulonglong(a), ctypes.c_size_t(size)))
        index = device.index if device.index is not None else torch.cuda.current_device()
        for cpu in (_LOC_HOST_NUMA, _LOC_HOST):  # the CPU's side: spelled either way by driver versions
            access = (_AccessDesc * 2)(_AccessDesc(_Location(_LOC_DEVICE, index), _READWRITE),
                                       _AccessDesc(_Location(cpu, 0), _READWRITE))
            if cu.cuMemSetAccess(ctypes.c_ulonglong(va.value), ctypes.c_size_t(size), access, ctypes.c_size_t(2)) == 0:
                break
        else:
            _check(-1, "cuMemSetAccess with CPU access")
    except OSError:
        release()
        return None
    return HostRegion(_tensor_at(va.value, size)[:nbytes], "vmm", release)


def write_combined_empty(nbytes: int) -> HostRegion | None:
    """``cuMemHostAlloc`` write-combined, mapped for every device."""
    cu = _driver()
    if cu is None or nbytes <= 0:
        return None
    torch.zeros(1, device="cuda")  # a current context
    ptr = ctypes.c_void_p()
    flags = _HOSTALLOC_PORTABLE | _HOSTALLOC_DEVICEMAP | _HOSTALLOC_WRITECOMBINED
    if cu.cuMemHostAlloc(ctypes.byref(ptr), ctypes.c_size_t(nbytes), ctypes.c_uint(flags)) != 0:
        return None
    return HostRegion(_tensor_at(ptr.value, nbytes), "write_combined", lambda p=ptr.value: cu.cuMemFreeHost(
        ctypes.c_void_p(p)))
