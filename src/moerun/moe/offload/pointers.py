"""Expert pointer tables: where each expert of one MoE layer lives, as int64 addresses, and the torch reference of
the fused MoE over them.

A table entry is the address of a contiguous w13 [2I, H] (or w2 [H, I]) of the layer's dtype: a slot of the device
pool or the expert's row of the pinned host store. The Triton kernels (kernels/fused_moe_ptr.py) dereference the
addresses on the device; the reference resolves each address to a view of one of the ``regions`` (the tensors the
table may point into) and computes exactly what ``fused_moe_reference`` computes on the stacked weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moerun.ops.moe_reference import fused_moe_reference

MAX_ALIGN = 16  # bytes: the widest vector load the kernels can be told about


@dataclass(frozen=True)
class ExpertPointers:
    """The address tables of one MoE layer's experts (E experts, hidden H, intermediate I)."""

    w13: torch.Tensor  # [E] int64: address of expert e's w13 [2I, H]
    w2: torch.Tensor  # [E] int64: address of expert e's w2 [H, I]
    hidden_size: int
    intermediate_size: int
    dtype: torch.dtype
    align: int  # bytes (power of two <= 16) every address is a multiple of
    regions: tuple[torch.Tensor, ...] = ()  # contiguous tensors the addresses point into (for the reference)

    @property
    def num_experts(self) -> int:
        return int(self.w13.shape[0])

    @property
    def w13_shape(self) -> tuple[int, int]:
        return (2 * self.intermediate_size, self.hidden_size)

    @property
    def w2_shape(self) -> tuple[int, int]:
        return (self.hidden_size, self.intermediate_size)


def address_alignment(*values: int) -> int:
    """The largest power of two <= 16 that divides every value (addresses, strides in bytes)."""
    align = MAX_ALIGN
    for v in values:
        while v % align:
            align //= 2
    return align


def tensor_at(address: int, shape: tuple[int, ...], dtype: torch.dtype, regions: tuple[torch.Tensor, ...]
              ) -> torch.Tensor:
    """A view of ``shape`` and ``dtype`` starting at ``address`` inside one of ``regions`` (contiguous tensors)."""
    elem = torch.empty((), dtype=dtype).element_size()
    nbytes = elem
    for n in shape:
        nbytes *= n
    for region in regions:
        start = region.data_ptr()
        size = region.numel() * region.element_size()
        if start <= address and address + nbytes <= start + size:
            offset = address - start
            if offset % elem:
                raise ValueError(f"address {address:#x} is not aligned to {dtype} inside its region")
            flat = region.reshape(-1).view(torch.uint8)  # [size] bytes of the region
            return flat[offset : offset + nbytes].view(dtype).view(shape)
    raise ValueError(f"address {address:#x} ({nbytes} bytes) lies in none of the {len(regions)} regions given")


class _PointedExperts:
    """Stacked-weights look-alike (``shape``, ``expert(e, dtype)``) over an address table, for the reference."""

    def __init__(self, addresses: list[int], shape: tuple[int, int], ptrs: ExpertPointers,
                 device: torch.device) -> None:
        self.addresses, self.ptrs, self.device = addresses, ptrs, device
        self.shape = (len(addresses), *shape)

    def expert(self, e: int, dtype: torch.dtype) -> torch.Tensor:
        # the weights keep their own dtype, as a stacked dense tensor's rows do in the reference
        view = tensor_at(self.addresses[e], self.shape[1:], self.ptrs.dtype, self.ptrs.regions)
        return view if view.device == self.device else view.to(self.device)


def fused_moe_indirect_reference(hidden: torch.Tensor, ptrs: ExpertPointers, topk_weights: torch.Tensor,
                                 topk_ids: torch.Tensor) -> torch.Tensor:
    """``fused_moe_reference`` with expert e's weights read at the table's addresses: hidden [T, H],
    routing [T, k] -> [T, H] in hidden's dtype. Reads the tables on the host."""
    w13 = _PointedExperts(ptrs.w13.tolist(), ptrs.w13_shape, ptrs, hidden.device)
    w2 = _PointedExperts(ptrs.w2.tolist(), ptrs.w2_shape, ptrs, hidden.device)
    return fused_moe_reference(hidden, w13, w2, topk_weights, topk_ids)
