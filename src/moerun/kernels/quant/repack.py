"""Load-time repacking of GGUF blocks into the row-contiguous arrays that the quantized Triton kernels read.

A logical weight [*lead, N, K] (N output rows of K inputs; lead = (E,) for stacked experts) becomes up to four
arrays, each [*lead, N, row_len] and contiguous, so BLOCK_N rows of a K-tile are BLOCK_N runs of contiguous
bytes. K is zero-padded to K_pad, a multiple of 256. Kernels walk a row in pairs of 64 elements: pair q holds
plane 0 = elements 64q + l and plane 1 = elements 64q + 32 + l, l = 0..31 (decoded by decode.py).

codes  uint8, the low code bits of every element
       8-bit (Q8_0)         [.., K_pad]      byte 64q + 32p + l: element 64q + 32p + l as q8 + 128 (unsigned)
       4-bit (Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS, MXFP4)
                            [.., K_pad / 2]  byte 32q + l: element 64q + l (low nibble), 64q + 32 + l (high)
       2-bit (Q2_K, Q3_K)   [.., K_pad / 4]  byte 32h + l: elements 128h + 32j + l at bits 2j (j = 0..3)
high   uint8, the top code bits
       1 bit (Q5_0, Q5_1, Q5_K, Q3_K)  [.., K_pad / 8]  byte 32b + l: elements 256b + 32j + l at bit j
       2 bits (Q6_K)                   [.., K_pad / 4]  laid out as the 2-bit codes
sub    int32 [.., K_pad / 64] (K-quants): pair q's sub-block scales as four little-endian bytes
       Q4_K, Q5_K  6-bit scales of the 32-element sub-blocks 2q, 2q + 1, then their 6-bit mins
       Q6_K, Q3_K  signed scales of the 16-element sub-blocks 4q .. 4q + 3 (Q3_K's already minus 32)
       Q2_K        (min << 4) | scale of the 16-element sub-blocks 4q .. 4q + 3
       IQ4_XS      signed scales (stored - 32) of the 32-element sub-blocks 2q, 2q + 1, then two zero bytes
scale  float16 block scales (MXFP4: bfloat16, which holds every E8M0 scale 2^(e - 128) exactly)
       K-quants          [.., K_pad / 256, C]  d (C = 1), or d, dmin (C = 2: Q2_K, Q4_K, Q5_K)
       32-element types  [.., K_pad / 32, C]   d (C = 1), or d, m (C = 2: Q4_1, Q5_1)

With c an element's unsigned code (low | high << low bits), sc and mn its sub-block's scale and min, every value
is, computed in float32 in this order, exactly what formats.quants.dequantize gives:
  Q8_0 (c - 128) d    Q4_0 (c - 8) d    Q5_0 (c - 16) d    Q4_1, Q5_1  c d + m
  Q4_K, Q5_K, Q2_K  c (d sc) - dmin mn    Q6_K (c - 32)(d sc)    Q3_K (c - 4)(d sc)
  IQ4_NL  level(c) d    IQ4_XS  level(c) (d sc)    (level: the 16 non-linear values IQ4_VALUES)
  MXFP4   level(c) d    (level: the doubled FP4 values FP4_VALUES; d = 2^(e - 128), half the E8M0 scale)
Bytes per 256 elements against GGUF's: Q4_K 148/144, Q5_K 180/176, Q3_K 114/110, IQ4_XS 146/136, MXFP4 144/136,
all others equal.
Float types (F32, F16, BF16) stay dense: `codes` is the [*lead, N, K] tensor in its own dtype.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from moerun.formats.quants import FP4_VALUES, IQ4_VALUES, QK_K, QuantizedTensor, QuantType

_F16 = torch.float16
# Rows are repacked in chunks of about this many elements, which bounds the temporaries on the GPU.
_CHUNK_ELEMS = 1 << 24


@dataclass(frozen=True)
class Layout:
    """Array geometry of one repacked type."""

    code_bits: int  # 8, 4 or 2 low bits in `codes`
    high_bits: int  # 0, 1 or 2 top bits in `high`
    has_sub: bool  # K-quants: 8-bit sub-block scales in `sub`
    scale_block: int  # elements per fp16 scale entry: 256 (K-quants) or 32
    scale_fields: int  # fp16 values per scale entry: 1 (d) or 2 (d, dmin / d, m)
    scale_dtype: torch.dtype = _F16  # of `scale`: float16, or bfloat16 (MXFP4's powers of two)


LAYOUTS: dict[QuantType, Layout] = {
    QuantType.Q8_0: Layout(8, 0, False, 32, 1),
    QuantType.Q4_0: Layout(4, 0, False, 32, 1),
    QuantType.Q4_1: Layout(4, 0, False, 32, 2),
    QuantType.Q5_0: Layout(4, 1, False, 32, 1),
    QuantType.Q5_1: Layout(4, 1, False, 32, 2),
    QuantType.Q2_K: Layout(2, 0, True, QK_K, 2),
    QuantType.Q3_K: Layout(2, 1, True, QK_K, 1),
    QuantType.Q4_K: Layout(4, 0, True, QK_K, 2),
    QuantType.Q5_K: Layout(4, 1, True, QK_K, 2),
    QuantType.Q6_K: Layout(4, 2, True, QK_K, 1),
    QuantType.IQ4_NL: Layout(4, 0, False, 32, 1),
    QuantType.IQ4_XS: Layout(4, 0, True, QK_K, 1),
    QuantType.MXFP4: Layout(4, 0, False, 32, 1, torch.bfloat16),
}
# 4-bit types whose code selects one of 16 levels (a table lookup), with one scale per 32 elements or sub-block.
LEVEL_TYPES: dict[QuantType, tuple[int, ...]] = {QuantType.IQ4_NL: IQ4_VALUES, QuantType.IQ4_XS: IQ4_VALUES,
                                                 QuantType.MXFP4: FP4_VALUES}  # fmt: skip
PACKED_TYPES: tuple[QuantType, ...] = tuple(LAYOUTS)
_DENSE_DTYPES = {QuantType.F32: torch.float32, QuantType.F16: torch.float16, QuantType.BF16: torch.bfloat16}


def padded_k(k: int) -> int:
    """Row length after padding to whole 256-element super-blocks."""
    return math.ceil(k / QK_K) * QK_K


class PackedWeight:
    """A weight [*lead, N, K] repacked for the kernels (module docstring); indexing the lead dim gives views."""

    __slots__ = ("qtype", "shape", "k_pad", "codes", "high", "sub", "scale")

    def __init__(
        self,
        qtype: QuantType,
        shape: Sequence[int],
        k_pad: int,
        codes: torch.Tensor,
        high: torch.Tensor | None = None,
        sub: torch.Tensor | None = None,
        scale: torch.Tensor | None = None,
    ) -> None:
        self.qtype = qtype
        self.shape = tuple(int(s) for s in shape)
        self.k_pad = int(k_pad)
        self.codes, self.high, self.sub, self.scale = codes, high, sub, scale

    @property
    def is_dense(self) -> bool:
        """True for float types, whose `codes` is the dense weight."""
        return not self.qtype.is_quantized

    @property
    def n(self) -> int:
        """Output rows (per expert)."""
        return self.shape[-2]

    @property
    def k(self) -> int:
        """Logical input length (before padding)."""
        return self.shape[-1]

    @property
    def kq(self) -> int:
        """64-element pairs per row (K_pad / 64)."""
        return self.k_pad // 64

    @property
    def device(self) -> torch.device:
        return self.codes.device

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors() if t is not None)

    def tensors(self) -> tuple[torch.Tensor | None, ...]:
        return self.codes, self.high, self.sub, self.scale

    def kernel_args(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(codes, high, sub, scale) with absent arrays replaced by `codes` (never read by that type's kernel)."""
        return tuple(self.codes if t is None else t for t in self.tensors())  # type: ignore[return-value]

    def __getitem__(self, index: int | slice) -> "PackedWeight":
        """Select along the leading (expert) dimension; the arrays are views."""
        if len(self.shape) < 3:
            raise IndexError(f"indexing needs a leading dim besides [N, K], shape is {self.shape}")
        parts = [None if t is None else t[index] for t in self.tensors()]
        lead = tuple(self.codes[index].shape[:-2])
        return type(self)(self.qtype, (*lead, *self.shape[-2:]), self.k_pad, *parts)

    def take_rows(self, ids: torch.Tensor) -> "PackedWeight":
        """Rows ids [T] of an [N, K] weight as a [T, K] PackedWeight (each array's rows gathered: copies)."""
        if len(self.shape) != 2:
            raise IndexError(f"row gathers need an [N, K] weight, shape is {self.shape}")
        parts = [None if t is None else t[ids] for t in self.tensors()]
        return type(self)(self.qtype, (ids.numel(), self.shape[1]), self.k_pad, *parts)

    def to(self, device: torch.device | str) -> "PackedWeight":
        parts = [None if t is None else t.to(device) for t in self.tensors()]
        return type(self)(self.qtype, self.shape, self.k_pad, *parts)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Reference decoding in torch: [*lead, N, K], bit-exact with formats.quants.dequantize in float32."""
        if self.is_dense:
            return self.codes.to(dtype)
        return unpack_reference(self).to(dtype)

    def __repr__(self) -> str:
        return f"PackedWeight({self.qtype.name}, shape={self.shape}, k_pad={self.k_pad}, device={self.device})"


def expert_addresses(p: PackedWeight) -> torch.Tensor:
    """[E, 4] int64 addresses of each expert's arrays (codes, high, sub, scale; an absent array gives the codes'
    address, never read) of a stacked PackedWeight [E, N, K]: the rows of an address table for the fused quantized
    kernels (fused_moe_quant.py)."""
    codes = p.codes
    rows = [[(codes if t is None else t)[e].data_ptr() for t in p.tensors()] for e in range(codes.shape[0])]
    return torch.tensor(rows, dtype=torch.int64)


def cat_rows(parts: Sequence[PackedWeight]) -> PackedWeight:
    """Parts of one type and K stacked along N (q|k|v, gate|up) into one PackedWeight."""
    first = parts[0]
    if len(parts) == 1:
        return first
    for p in parts:
        if p.qtype != first.qtype or p.shape[:-2] != first.shape[:-2] or p.shape[-1] != first.shape[-1]:
            raise ValueError(f"parts do not stack: {[(q.qtype.name, q.shape) for q in parts]}")
    dim = len(first.shape) - 2
    arrays = []
    for i, t in enumerate(first.tensors()):
        arrays.append(None if t is None else torch.cat([p.tensors()[i] for p in parts], dim=dim))
    shape = (*first.shape[:-2], sum(p.n for p in parts), first.k)
    return PackedWeight(first.qtype, shape, first.k_pad, *arrays)


# ------------------------------------------------------------------------------------------------- packing


def _f16(b: torch.Tensor, offset: int) -> torch.Tensor:
    """The fp16 at byte `offset` of each block b [r, nb, B] -> [r, nb, 1]."""
    return b[..., offset : offset + 2].contiguous().view(_F16)


def _nibbles(c: torch.Tensor) -> torch.Tensor:
    """4-bit codes c [r, K] (uint8 < 16) -> [r, K / 2]: byte 32q + l = elements 64q + l | (64q + 32 + l) << 4."""
    c = c.reshape(c.shape[0], -1, 2, 32)
    return (c[:, :, 0] | (c[:, :, 1] << 4)).reshape(c.shape[0], -1)


def _fields(c: torch.Tensor, bits: int) -> torch.Tensor:
    """bits-wide codes c [r, K] -> [r, K * bits / 8]: each byte 32g + l holds element (8 / bits) * 32g + 32j + l
    at bits `bits * j` (the 2-bit layout for bits = 2, the 1-bit high layout for bits = 1)."""
    per = 8 // bits
    c = c.reshape(c.shape[0], -1, per, 32)
    out = c[:, :, 0].clone()
    for j in range(1, per):
        out |= c[:, :, j] << (bits * j)
    return out.reshape(c.shape[0], -1)


def _bits_le(qh: torch.Tensor) -> torch.Tensor:
    """qh [r, nb, 4] (a little-endian uint32 per block) -> [r, nb, 32] uint8: bit j of the word."""
    shifts = torch.arange(8, device=qh.device, dtype=torch.uint8)
    return ((qh.unsqueeze(-1) >> shifts) & 1).reshape(*qh.shape[:-1], 32)


def _nibble_codes(qs: torch.Tensor) -> torch.Tensor:
    """GGUF 32-element nibbles qs [r, nb, 16] (element j low nibble of byte j, j + 16 high) -> [r, nb, 32]."""
    return torch.cat((qs & 0x0F, qs >> 4), dim=-1)


def _as_int32(b: torch.Tensor) -> torch.Tensor:
    """Bytes [r, nb, 4m] -> int32 [r, nb * m] (little-endian)."""
    return b.contiguous().view(torch.int32).reshape(b.shape[0], -1)


def _k4_sub(b: torch.Tensor) -> torch.Tensor:
    """Q4_K/Q5_K 12-byte packed 6-bit scales and mins -> int32 [r, nb * 4]: (sc 2q, sc 2q+1, mn 2q, mn 2q+1)."""
    r, nb = b.shape[:2]
    d, m, md = b[..., 4:8], b[..., 8:12], b[..., 12:16]
    sc = torch.cat((d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)), dim=-1)  # [r, nb, 8]
    mn = torch.cat((m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)), dim=-1)
    return _as_int32(torch.stack((sc.view(r, nb, 4, 2), mn.view(r, nb, 4, 2)), dim=3).reshape(r, nb, 16))


def _q3_k_sub(b: torch.Tensor) -> torch.Tensor:
    """Q3_K 12-byte packed 6-bit scales -> int32 [r, nb * 4] of signed bytes (scale - 32)."""
    packed = b[..., 96:108]
    low = torch.cat((packed[..., :8] & 0x0F, packed[..., :8] >> 4), dim=-1)  # [r, nb, 16]
    high = torch.cat([(packed[..., 8:] >> (2 * i)) & 3 for i in range(4)], dim=-1)
    sc = (low | (high << 4)).view(torch.int8) - 32
    return _as_int32(sc)


def _pack_q8_0(b):
    return {"codes": (b[..., 2:34] ^ 0x80).reshape(b.shape[0], -1), "scale": _f16(b, 0)}


def _pack_q4_0(b):
    return {"codes": _nibbles(_nibble_codes(b[..., 2:18])), "scale": _f16(b, 0)}


def _pack_q4_1(b):
    return {"codes": _nibbles(_nibble_codes(b[..., 4:20])), "scale": torch.cat((_f16(b, 0), _f16(b, 2)), -1)}


def _pack_q5(b, qh_at: int, qs_at: int, scale: torch.Tensor):
    high = _bits_le(b[..., qh_at : qh_at + 4])
    return {"codes": _nibbles(_nibble_codes(b[..., qs_at : qs_at + 16])), "high": _fields(high, 1), "scale": scale}


def _pack_q5_0(b):
    return _pack_q5(b, 2, 6, _f16(b, 0))


def _pack_q5_1(b):
    return _pack_q5(b, 4, 8, torch.cat((_f16(b, 0), _f16(b, 2)), -1))


def _pack_q2_k(b):
    r = b.shape[0]
    return {"codes": b[..., 16:80].reshape(r, -1), "sub": _as_int32(b[..., 0:16]),
            "scale": torch.cat((_f16(b, 80), _f16(b, 82)), -1)}  # fmt: skip


def _pack_q3_k(b):
    r = b.shape[0]
    # GGUF's Q3_K codes and high-bit mask already follow the 2-bit and 1-bit layouts.
    return {"codes": b[..., 32:96].reshape(r, -1), "high": b[..., 0:32].reshape(r, -1), "sub": _q3_k_sub(b),
            "scale": _f16(b, 108)}  # fmt: skip


def _pack_q4_k(b):
    # GGUF's Q4_K nibbles already follow the 4-bit layout: byte 32j + l = elements 64j + l, 64j + 32 + l.
    return {"codes": b[..., 16:144].reshape(b.shape[0], -1), "sub": _k4_sub(b),
            "scale": torch.cat((_f16(b, 0), _f16(b, 2)), -1)}  # fmt: skip


def _pack_q5_k(b):
    r = b.shape[0]
    return {"codes": b[..., 48:176].reshape(r, -1), "high": b[..., 16:48].reshape(r, -1), "sub": _k4_sub(b),
            "scale": torch.cat((_f16(b, 0), _f16(b, 2)), -1)}  # fmt: skip


def _pack_q6_k(b):
    r, nb = b.shape[:2]
    # GGUF byte 64h + 32w + l holds element 128h + 32w + l (low nibble) and 128h + 64 + 32w + l (high nibble);
    # pair 2h takes the low nibbles of w = 0, 1, pair 2h + 1 the high nibbles.
    ql = b[..., 0:128].reshape(r, nb, 2, 2, 32)
    lo_w, hi_w = ql[:, :, :, 0], ql[:, :, :, 1]  # [r, nb, 2, 32]
    pair0 = (lo_w & 0x0F) | ((hi_w & 0x0F) << 4)
    pair1 = (lo_w >> 4) | (hi_w & 0xF0)
    codes = torch.stack((pair0, pair1), dim=3).reshape(r, -1)
    return {"codes": codes, "high": b[..., 128:192].reshape(r, -1), "sub": _as_int32(b[..., 192:208]),
            "scale": _f16(b, 208)}  # fmt: skip


def _pack_iq4_nl(b):
    return {"codes": _nibbles(_nibble_codes(b[..., 2:18])), "scale": _f16(b, 0)}


def _pack_mxfp4(b):
    # E8M0 byte e -> 2^(e - 128) as bfloat16 bits: exponent field e - 1, or the subnormals 2^-128, 2^-127 for e < 2.
    e = b[..., 0:1].to(torch.int32)
    bits = torch.where(e < 2, 0x20 << e, (e - 1) << 7)
    return {"codes": _nibbles(_nibble_codes(b[..., 1:17])), "scale": bits.to(torch.int16).view(torch.bfloat16)}


def _pack_iq4_xs(b):
    r, nb = b.shape[:2]
    codes = _nibble_codes(b[..., 8:136].reshape(r, nb * 8, 16)).reshape(r, -1)  # [r, K] in element order
    high = b[..., 2].to(torch.int32) | (b[..., 3].to(torch.int32) << 8)  # [r, nb] the 2-bit fields
    low = torch.stack((b[..., 4:8] & 0x0F, b[..., 4:8] >> 4), dim=-1).reshape(r, nb, 8)  # [r, nb, 8]
    shifts = 2 * torch.arange(8, device=b.device, dtype=torch.int32)
    sc = (low.to(torch.int32) | (((high.unsqueeze(-1) >> shifts) & 3) << 4)) - 32  # [r, nb, 8] in [-32, 31]
    sub = torch.zeros(r, nb, 4, 4, dtype=torch.uint8, device=b.device)  # pair q: bytes (sc 2q, sc 2q + 1, 0, 0)
    sub[..., :2] = sc.to(torch.int8).view(torch.uint8).reshape(r, nb, 4, 2)
    return {"codes": _nibbles(codes), "sub": _as_int32(sub.reshape(r, nb, 16)), "scale": _f16(b, 0)}


_PACKERS: dict[QuantType, Callable[[torch.Tensor], dict[str, torch.Tensor]]] = {
    QuantType.Q8_0: _pack_q8_0,
    QuantType.Q4_0: _pack_q4_0,
    QuantType.Q4_1: _pack_q4_1,
    QuantType.Q5_0: _pack_q5_0,
    QuantType.Q5_1: _pack_q5_1,
    QuantType.Q2_K: _pack_q2_k,
    QuantType.Q3_K: _pack_q3_k,
    QuantType.Q4_K: _pack_q4_k,
    QuantType.Q5_K: _pack_q5_k,
    QuantType.Q6_K: _pack_q6_k,
    QuantType.IQ4_NL: _pack_iq4_nl,
    QuantType.IQ4_XS: _pack_iq4_xs,
    QuantType.MXFP4: _pack_mxfp4,
}


def _row_shapes(lay: Layout, k_pad: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Per-row shape and dtype of each array of a layout."""
    shapes = {"codes": ((k_pad * lay.code_bits // 8,), torch.uint8),
              "scale": ((k_pad // lay.scale_block, lay.scale_fields), lay.scale_dtype)}  # fmt: skip
    if lay.high_bits:
        shapes["high"] = ((k_pad * lay.high_bits // 8,), torch.uint8)
    if lay.has_sub:
        shapes["sub"] = ((k_pad // 64,), torch.int32)
    return shapes


def packed_nbytes(qtype: QuantType, shape: Sequence[int]) -> int:
    """Bytes of a weight [*lead, N, K] of this type once repacked by ``pack`` (a few percent above the GGUF blocks
    for some types: rows padded to whole super-blocks, 32-bit sub-block scales); float types keep their size."""
    if qtype in _DENSE_DTYPES:
        return math.prod(shape) * _DENSE_DTYPES[qtype].itemsize
    if qtype not in LAYOUTS:
        raise ValueError(f"no repacked layout for {qtype.name}")
    per_row = sum(math.prod(row) * dt.itemsize for row, dt in _row_shapes(LAYOUTS[qtype], padded_k(shape[-1])).values())
    return math.prod(shape[:-1]) * per_row


def pack(tensor: QuantizedTensor) -> PackedWeight:
    """Repack a GGUF tensor [*lead, N, K] on its own device (vectorised torch ops, rows in chunks)."""
    qt = tensor.qtype
    if len(tensor.shape) < 2:
        raise ValueError(f"tensor '{tensor.name}': expected a weight [*lead, N, K], got shape {tensor.shape}")
    k = tensor.shape[-1]
    if qt in _DENSE_DTYPES:
        dense = tensor.raw.contiguous().view(_DENSE_DTYPES[qt]).reshape(tensor.shape)
        return PackedWeight(qt, tensor.shape, k, dense)
    if qt not in LAYOUTS:
        raise ValueError(f"tensor '{tensor.name}': no repacked layout for {qt.name}")
    lay = LAYOUTS[qt]
    k_pad = padded_k(k)
    rows = math.prod(tensor.shape[:-1])
    nb, nb_pad = k // qt.block_elems, k_pad // qt.block_elems
    blocks = tensor.raw.reshape(rows, nb, qt.block_bytes)
    device = tensor.raw.device
    out = {name: torch.empty((rows, *shape), dtype=dt, device=device) for name, (shape, dt) in
           _row_shapes(lay, k_pad).items()}  # fmt: skip
    step = max(1, _CHUNK_ELEMS // k_pad)
    for r0 in range(0, rows, step):
        b = blocks[r0 : r0 + step]
        if nb_pad != nb:
            # Zero blocks decode to zero (their scales are zero), so padding never changes a product.
            b = torch.cat((b, b.new_zeros(b.shape[0], nb_pad - nb, qt.block_bytes)), dim=1)
        for name, arr in _PACKERS[qt](b).items():
            out[name][r0 : r0 + b.shape[0]].copy_(arr.reshape(b.shape[0], *out[name].shape[1:]))
    lead = tensor.shape[:-1]
    arrays = {name: t.reshape(*lead, *t.shape[1:]) for name, t in out.items()}
    return PackedWeight(qt, tensor.shape, k_pad, arrays["codes"], arrays.get("high"), arrays.get("sub"),
                        arrays["scale"])


# ------------------------------------------------------------------------------------------ reference decode


def _unnibble(codes: torch.Tensor) -> torch.Tensor:
    """Inverse of _nibbles: [r, K / 2] -> [r, K]."""
    c = codes.reshape(codes.shape[0], -1, 1, 32)
    return torch.cat((c & 0x0F, c >> 4), dim=2).reshape(codes.shape[0], -1)


def _unfields(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of _fields: [r, K * bits / 8] -> [r, K]."""
    per, mask = 8 // bits, (1 << bits) - 1
    c = packed.reshape(packed.shape[0], -1, 1, 32)
    return torch.cat([(c >> (bits * j)) & mask for j in range(per)], dim=2).reshape(packed.shape[0], -1)


def unpack_reference(pw: PackedWeight) -> torch.Tensor:
    """Float32 [*lead, N, K] from the repacked arrays, with the same float32 operations as the GGUF decoder."""
    lay = LAYOUTS[pw.qtype]
    rows = math.prod(pw.shape[:-1])
    k_pad = pw.k_pad
    codes = pw.codes.reshape(rows, -1)
    if lay.code_bits == 8:
        c = codes
    elif lay.code_bits == 4:
        c = _unnibble(codes)
    else:
        c = _unfields(codes, 2)
    if lay.high_bits:
        c = c | (_unfields(pw.high.reshape(rows, -1), lay.high_bits) << lay.code_bits)
    qt = pw.qtype
    if qt in LEVEL_TYPES:
        c = torch.tensor(LEVEL_TYPES[qt], dtype=torch.float32, device=c.device)[c.long()]  # the levels
    code = c.float()  # [rows, K_pad], exact small integers
    scale = pw.scale.reshape(rows, -1, lay.scale_fields).float()  # [rows, blocks, C]
    if qt in (QuantType.IQ4_NL, QuantType.MXFP4):
        out = code.view(rows, -1, 32) * scale
    elif qt == QuantType.IQ4_XS:
        sub = pw.sub.reshape(rows, -1).contiguous().view(torch.int8).reshape(rows, k_pad // QK_K, 4, 4)
        dl = scale * sub[..., :2].reshape(rows, -1, 8)  # [rows, SB, 8]
        out = code.view(rows, -1, 8, 32) * dl.unsqueeze(-1)
    elif not lay.has_sub:
        # 32-element blocks: one scale entry per block.
        v = code.view(rows, -1, 32)
        d = scale[:, :, 0:1]
        if qt in (QuantType.Q4_1, QuantType.Q5_1):
            out = v * d + scale[:, :, 1:2]
        else:
            bias = {QuantType.Q8_0: 128, QuantType.Q4_0: 8, QuantType.Q5_0: 16}[qt]
            out = (v - bias) * d
    else:
        sub = pw.sub.reshape(rows, -1).contiguous().view(torch.uint8).reshape(rows, k_pad // QK_K, 16)
        d = scale[:, :, 0:1]  # [rows, SB, 1]
        if qt in (QuantType.Q4_K, QuantType.Q5_K):
            s = sub.view(rows, -1, 4, 2, 2)  # [rows, SB, pair, sc/mn, sub-block]
            sc, mn = s[:, :, :, 0].reshape(rows, -1, 8), s[:, :, :, 1].reshape(rows, -1, 8)
            dl, ml = d * sc, scale[:, :, 1:2] * mn  # [rows, SB, 8]
            out = code.view(rows, -1, 8, 32) * dl.unsqueeze(-1) - ml.unsqueeze(-1)
        elif qt == QuantType.Q2_K:
            dl, ml = d * (sub & 0x0F), scale[:, :, 1:2] * (sub >> 4)  # [rows, SB, 16]
            out = code.view(rows, -1, 16, 16) * dl.unsqueeze(-1) - ml.unsqueeze(-1)
        else:
            dl = d * sub.view(torch.int8)  # [rows, SB, 16]
            bias = 32 if qt == QuantType.Q6_K else 4
            out = (code.view(rows, -1, 16, 16) - bias) * dl.unsqueeze(-1)
    return out.reshape(rows, k_pad)[:, : pw.k].reshape(pw.shape)
