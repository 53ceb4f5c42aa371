"""GGML tensor types supported by moerun and their block geometry."""

from __future__ import annotations

import enum
from typing import Sequence

import gguf

QK_K = 256  # elements per K-quant super-block


class QuantType(enum.IntEnum):
    """The GGML types moerun reads and writes; values are the GGUF type ids."""

    F32 = 0
    F16 = 1
    Q4_0 = 2
    Q4_1 = 3
    Q5_0 = 6
    Q5_1 = 7
    Q8_0 = 8
    Q2_K = 10
    Q3_K = 11
    Q4_K = 12
    Q5_K = 13
    Q6_K = 14
    IQ2_XXS = 16
    IQ2_XS = 17
    IQ3_XXS = 18
    IQ1_S = 19
    IQ4_NL = 20
    IQ3_S = 21
    IQ2_S = 22
    IQ4_XS = 23
    IQ1_M = 29
    BF16 = 30
    TQ1_0 = 34
    TQ2_0 = 35
    MXFP4 = 39
    NVFP4 = 40

    @property
    def block_elems(self) -> int:
        """Logical elements per block (1 for the plain float types)."""
        return _GEOMETRY[self][0]

    @property
    def block_bytes(self) -> int:
        """Bytes per block in the GGUF layout."""
        return _GEOMETRY[self][1]

    @property
    def is_quantized(self) -> bool:
        """True for the block-quantised types (not F32/F16/BF16)."""
        return self.block_elems > 1

    @property
    def is_k_quant(self) -> bool:
        """True for the 256-element super-block types (Q2_K..Q6_K, the IQ types but IQ4_NL, TQ1_0, TQ2_0)."""
        return self.block_elems == QK_K


# (elements per block, bytes per block), checked against gguf's own table below.
_GEOMETRY: dict[QuantType, tuple[int, int]] = {
    QuantType.F32: (1, 4),
    QuantType.F16: (1, 2),
    QuantType.BF16: (1, 2),
    QuantType.Q8_0: (32, 34),  # fp16 d + 32 x int8
    QuantType.Q4_0: (32, 18),  # fp16 d + 16 bytes of nibbles
    QuantType.Q4_1: (32, 20),  # fp16 d, fp16 m + nibbles
    QuantType.Q5_0: (32, 22),  # fp16 d + 4 bytes high bits + nibbles
    QuantType.Q5_1: (32, 24),  # fp16 d, fp16 m + high bits + nibbles
    QuantType.Q2_K: (QK_K, 84),  # 16 scale bytes, 64 bytes 2-bit codes, fp16 d, fp16 dmin
    QuantType.Q3_K: (QK_K, 110),  # 32 bytes high-bit mask, 64 bytes 2-bit codes, 12 scale bytes, fp16 d
    QuantType.Q4_K: (QK_K, 144),  # fp16 d, fp16 dmin, 12 scale bytes, 128 bytes nibbles
    QuantType.Q5_K: (QK_K, 176),  # fp16 d, fp16 dmin, 12 scale bytes, 32 bytes high bits, 128 bytes nibbles
    QuantType.Q6_K: (QK_K, 210),  # 128 bytes low nibbles, 64 bytes high 2 bits, 16 int8 scales, fp16 d
    QuantType.IQ4_NL: (32, 18),  # fp16 d + 16 bytes of nibbles indexing IQ4_VALUES
    QuantType.IQ4_XS: (QK_K, 136),  # fp16 d, 16 bits of scale high bits, 4 bytes scale low bits, 128 bytes nibbles
    # The grid types: an index selects 8 (IQ2, IQ1) or 4 (IQ3) values of a fixed table (formats/quants/grids.py).
    QuantType.IQ2_XXS: (QK_K, 66),  # fp16 d, per 32 elements 4 x 8-bit grid index + 4 x 7-bit signs + 4-bit scale
    QuantType.IQ2_XS: (QK_K, 74),  # fp16 d, 32 x (9-bit grid index | 7-bit signs), 8 bytes of 4-bit scales
    QuantType.IQ2_S: (QK_K, 82),  # fp16 d, 32 index low bytes, 32 sign bytes, 8 bytes index high bits, 8 scales
    QuantType.IQ3_XXS: (QK_K, 98),  # fp16 d, 64 x 8-bit grid index, per 32 elements 4 x 7-bit signs + 4-bit scale
    QuantType.IQ3_S: (QK_K, 110),  # fp16 d, 64 index low bytes, 8 bytes index high bits, 32 sign bytes, 4 scales
    QuantType.IQ1_S: (QK_K, 50),  # fp16 d, 32 index low bytes, 8 x uint16 (index high bits, scale, delta sign)
    QuantType.IQ1_M: (QK_K, 56),  # 32 index low bytes, 16 bytes index high bits + delta signs, 8 bytes scales + d
    QuantType.TQ1_0: (QK_K, 54),  # 48 bytes of five base-3 digits, 4 bytes of four, fp16 d
    QuantType.TQ2_0: (QK_K, 66),  # 64 bytes of 2-bit codes, fp16 d
    QuantType.MXFP4: (32, 17),  # e8m0 scale byte, 16 bytes of FP4 (E2M1) nibbles
    QuantType.NVFP4: (64, 36),  # 4 x UE4M3 scale bytes (one per 16 elements), 32 bytes of FP4 nibbles
}

for _t, _geo in _GEOMETRY.items():
    # A mismatch here means the installed gguf disagrees with the layouts coded in this package.
    assert gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(int(_t))] == _geo, _t

SUPPORTED_TYPES: tuple[QuantType, ...] = tuple(_GEOMETRY)

# The 16 non-linear levels a 4-bit code of IQ4_NL and IQ4_XS selects (ggml's kvalues_iq4nl), ascending.
IQ4_VALUES: tuple[int, ...] = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)

# The 16 levels of an FP4 (E2M1) code of MXFP4 and NVFP4, doubled (ggml's kvalues_mxfp4; the scales are halved).
FP4_VALUES: tuple[int, ...] = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)

# Byte offsets of the fp16 fields inside one block: the scale d, then dmin (K-quants) or m (Q4_1, Q5_1).
FP16_FIELDS: dict[QuantType, tuple[int, ...]] = {
    QuantType.Q8_0: (0,),
    QuantType.Q4_0: (0,),
    QuantType.Q4_1: (0, 2),
    QuantType.Q5_0: (0,),
    QuantType.Q5_1: (0, 2),
    QuantType.Q2_K: (80, 82),
    QuantType.Q3_K: (108,),
    QuantType.Q4_K: (0, 2),
    QuantType.Q5_K: (0, 2),
    QuantType.Q6_K: (208,),
    QuantType.IQ4_NL: (0,),
    QuantType.IQ4_XS: (0,),
    QuantType.IQ2_XXS: (0,),
    QuantType.IQ2_XS: (0,),
    QuantType.IQ2_S: (0,),
    QuantType.IQ3_XXS: (0,),
    QuantType.IQ3_S: (0,),
    QuantType.IQ1_S: (0,),
    QuantType.IQ1_M: (),  # its fp16 d is spread over the top nibbles of the four scale words
    QuantType.TQ1_0: (52,),
    QuantType.TQ2_0: (64,),
    QuantType.MXFP4: (),  # power-of-two scale byte
    QuantType.NVFP4: (),  # FP8 scale bytes
}


def _where(tensor_name: str) -> str:
    return f"tensor '{tensor_name}': " if tensor_name else ""


def as_quant_type(qtype: int | str | enum.Enum, tensor_name: str = "") -> QuantType:
    """Normalise a GGML type (id, name, gguf enum or QuantType) to a supported QuantType."""
    if isinstance(qtype, QuantType):
        return qtype
    if isinstance(qtype, str):
        name = qtype.upper()
        if name in QuantType.__members__:
            return QuantType[name]
        raise ValueError(
            f"{_where(tensor_name)}GGML type {qtype!r} is not supported; "
            f"expected one of {', '.join(t.name for t in SUPPORTED_TYPES)}"
        )
    type_id = int(qtype)
    try:
        return QuantType(type_id)
    except ValueError:
        pass
    try:
        name = gguf.GGMLQuantizationType(type_id).name
    except ValueError:
        name = "unknown"
    raise ValueError(
        f"{_where(tensor_name)}GGML type {name} (id {type_id}) is not supported; "
        f"expected one of {', '.join(t.name for t in SUPPORTED_TYPES)}"
    )


def check_row_length(row_len: int, qtype: QuantType, tensor_name: str = "") -> None:
    """Raise ValueError unless a row of `row_len` elements is a whole number of blocks."""
    if row_len % qtype.block_elems != 0:
        raise ValueError(
            f"{_where(tensor_name)}row length {row_len} is not a multiple of the "
            f"{qtype.name} block size {qtype.block_elems}"
        )


def row_nbytes(row_len: int, qtype: int | str | enum.Enum, tensor_name: str = "") -> int:
    """Bytes taken by one row of `row_len` elements of type `qtype`."""
    qt = as_quant_type(qtype, tensor_name)
    check_row_length(row_len, qt, tensor_name)
    return row_len // qt.block_elems * qt.block_bytes


def tensor_nbytes(shape: Sequence[int], qtype: int | str | enum.Enum, tensor_name: str = "") -> int:
    """Bytes taken by a tensor of logical `shape` (rows along the last dim) in type `qtype`."""
    if len(shape) == 0:
        raise ValueError(f"{_where(tensor_name)}expected a shape with at least one dimension, got ()")
    n_rows = 1
    for dim in shape[:-1]:
        n_rows *= int(dim)
    return n_rows * row_nbytes(int(shape[-1]), qtype, tensor_name)
