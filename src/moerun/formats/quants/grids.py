"""The fixed value grids of the IQ1, IQ2 and IQ3 types, and the sign patterns of IQ2_XXS, IQ2_XS and IQ3_XXS.

A grid type's block stores, per group of 8 (IQ2, IQ1) or 4 (IQ3) elements, an index into a table of that many
small values, instead of one code per element. The tables are ggml's (iq2xxs_grid ... iq1s_grid); they are read
from the `gguf` package, which ships them, and checked against it by the tests.
"""

from __future__ import annotations

import functools

import gguf
import torch

from .types import QuantType

# The grid each type indexes: (table owner in gguf.quants, entries, values an entry).
GRID_OF: dict[QuantType, tuple[str, int, int]] = {
    QuantType.IQ2_XXS: ("IQ2_XXS", 256, 8),
    QuantType.IQ2_XS: ("IQ2_XS", 512, 8),
    QuantType.IQ2_S: ("IQ2_S", 1024, 8),
    QuantType.IQ3_XXS: ("IQ3_XXS", 256, 4),
    QuantType.IQ3_S: ("IQ3_S", 512, 4),
    QuantType.IQ1_S: ("IQ1_S", 2048, 8),
    QuantType.IQ1_M: ("IQ1_S", 2048, 8),
}


@functools.lru_cache(maxsize=None)
def _grid_cpu(owner: str) -> torch.Tensor:
    cls = getattr(gguf.quants, owner)
    cls.init_grid()
    values = torch.from_numpy(cls.grid.reshape(cls.grid_shape).copy())  # float32 [entries, width], small integers
    return values.to(torch.int8)


_ON_DEVICE: dict[tuple[str, torch.device], torch.Tensor] = {}


def grid_table(qtype: QuantType, device: torch.device | str = "cpu") -> torch.Tensor:
    """int8 [entries, width] grid of a grid type (IQ2: 8, 25, 43; IQ3_XXS: 4 ... 62; IQ3_S: 1 ... 15; IQ1: -1, 0,
    1), on `device` (copied there once and kept)."""
    owner, entries, width = GRID_OF[qtype]
    device = torch.device(device)
    key = (owner, device)
    table = _ON_DEVICE.get(key)
    if table is None:
        table = _grid_cpu(owner)
        assert table.shape == (entries, width), (qtype, table.shape)
        table = _ON_DEVICE[key] = table.to(device)
    return table


def sign_patterns(device: torch.device | str = "cpu") -> torch.Tensor:
    """uint8 [128]: ggml's ksigns_iq2xs. A 7-bit index gives the signs of 8 values (bit j set: value j negative);
    the eighth sign is implied, so that the count of negative values is even."""
    device = torch.device(device)
    key = ("ksigns", device)
    table = _ON_DEVICE.get(key)
    if table is None:
        i = torch.arange(128, dtype=torch.int32)
        parity = torch.zeros_like(i)
        for b in range(7):
            parity ^= (i >> b) & 1
        table = _ON_DEVICE[key] = (i | (parity << 7)).to(torch.uint8).to(device)
    return table
