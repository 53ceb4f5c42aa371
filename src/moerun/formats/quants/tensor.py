"""QuantizedTensor: raw GGUF block bytes plus the type and logical shape needed to decode them."""

from __future__ import annotations

import enum
from typing import Sequence

import numpy as np
import torch

from .dequant import dequantize
from .quantize import quantize
from .types import as_quant_type, row_nbytes


class QuantizedTensor:
    """A weight kept in its GGUF encoding (not an nn.Parameter).

    `raw` is a contiguous uint8 tensor [*shape[:-1], row_bytes] holding exactly GGUF's block
    bytes, one logical row after the other, e.g. [out, in] -> [out, in / block_elems * block_bytes]
    and stacked experts [E, out, in] -> [E, out, row_bytes]. Kernels may read `raw` directly.
    """

    __slots__ = ("raw", "qtype", "shape", "name")

    def __init__(
        self, raw: torch.Tensor, qtype: int | str | enum.Enum, shape: Sequence[int], name: str = ""
    ) -> None:
        qt = as_quant_type(qtype, name)
        shape = tuple(int(s) for s in shape)
        where = f"tensor '{name}': " if name else ""
        if raw.dtype != torch.uint8:
            raise TypeError(f"{where}expected raw blocks as a uint8 tensor, got {raw.dtype}")
        if len(shape) == 0:
            raise ValueError(f"{where}expected a logical shape with at least one dimension, got ()")
        byte_shape = (*shape[:-1], row_nbytes(shape[-1], qt, name))
        if raw.numel() != int(np.prod(byte_shape)):
            raise ValueError(
                f"{where}{qt.name} tensor of shape {shape} needs {int(np.prod(byte_shape))} bytes "
                f"laid out as {byte_shape}, got {raw.numel()} bytes of shape {tuple(raw.shape)}"
            )
        if tuple(raw.shape) != byte_shape:
            raw = raw.reshape(byte_shape)
        if not raw.is_contiguous():
            raw = raw.contiguous()  # kernels index rows by offset, so the bytes must be dense
        self.raw = raw
        self.qtype = qt
        self.shape = shape
        self.name = name

    @classmethod
    def from_float(
        cls, weight: torch.Tensor | np.ndarray, qtype: int | str | enum.Enum, name: str = ""
    ) -> "QuantizedTensor":
        """Quantise a float weight (rows along the last dim) on CPU into type `qtype`."""
        if isinstance(weight, torch.Tensor):
            weight = weight.detach().to("cpu", torch.float32).numpy()
        raw = quantize(np.asarray(weight, dtype=np.float32), qtype, name)
        return cls(torch.from_numpy(raw), qtype, weight.shape, name)

    @property
    def device(self) -> torch.device:
        return self.raw.device

    @property
    def nbytes(self) -> int:
        """Bytes of encoded data."""
        return self.raw.numel()

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def numel(self) -> int:
        """Logical element count."""
        return int(np.prod(self.shape))

    def dequantize(
        self,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Decode to a dense `dtype` tensor of the logical shape, on `device` (default: where the bytes are).

        `out` (contiguous, logical shape, on that device) is filled instead of allocating.
        """
        raw = self.raw if device is None else self.raw.to(device)
        return dequantize(raw, self.qtype, self.shape, dtype=dtype, tensor_name=self.name, out=out)

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "QuantizedTensor":
        """The same encoded bytes on another device."""
        return QuantizedTensor(self.raw.to(device, non_blocking=non_blocking), self.qtype, self.shape, self.name)

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, index: int | slice) -> "QuantizedTensor":
        """Select along the leading (expert) dimension; the result views the same bytes."""
        if self.ndim < 2:
            raise IndexError(
                f"tensor '{self.name}': indexing needs at least 2 dims so rows stay whole, shape is {self.shape}"
            )
        if isinstance(index, slice):
            start, stop, step = index.indices(self.shape[0])
            if step != 1:
                raise IndexError(f"tensor '{self.name}': only step-1 slices keep rows contiguous, got step {step}")
            stop = max(stop, start)
            return QuantizedTensor(self.raw[start:stop], self.qtype, (stop - start, *self.shape[1:]), self.name)
        i = int(index)
        if not -self.shape[0] <= i < self.shape[0]:
            raise IndexError(f"tensor '{self.name}': index {i} out of range for leading dim {self.shape[0]}")
        return QuantizedTensor(self.raw[i], self.qtype, self.shape[1:], self.name)

    def __repr__(self) -> str:
        name = f"name={self.name!r}, " if self.name else ""
        return (
            f"QuantizedTensor({name}shape={self.shape}, qtype={self.qtype.name}, "
            f"nbytes={self.nbytes}, device={self.device})"
        )

