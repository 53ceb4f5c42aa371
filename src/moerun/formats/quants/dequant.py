"""Vectorised torch dequantisation of GGUF blocks, bit-exact with gguf.quants.dequantize in float32."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from .grids import grid_table, sign_patterns
from .types import FP4_VALUES, IQ4_VALUES, QuantType, as_quant_type, tensor_nbytes

# Every decoder reproduces the float32 operation order of the reference (ggml's
# dequantize_row_* and gguf.quants): fp16 scales are widened exactly, per-sub-block
# scale products are rounded to float32 first, then each value is code * scale
# (minus/plus an offset). Each torch op rounds once and eager torch never fuses them
# into an FMA, so CPU and CUDA agree bit for bit.
#
# Decoding runs in two phases: the per-sub-block float scales of the whole tensor are
# computed first (a few small ops), then the codes are expanded chunk by chunk straight
# into the output as exact small integers and scaled in place. Chunks keep the uint8
# temporaries and the in-place passes inside the CPU caches.

_CPU_CHUNK_ELEMS = 1 << 20
_CUDA_CHUNK_ELEMS = 1 << 25  # bounds the float32 scratch of non-float32 outputs to 128 MiB


@dataclass(frozen=True)
class _Decoder:
    """How to decode one type: per-block scales, then codes written into the output."""

    # blocks [N, block_bytes] -> float32 tensors with leading dim N that broadcast against
    # the view returned by `codes`: (scale,) or (scale, offset); () for the plain float types.
    scales: Callable[[torch.Tensor], tuple[torch.Tensor, ...]]
    # (blocks [n, block_bytes], out [n, block_elems] float32) -> out viewed per sub-block,
    # filled with the integer codes (or with the final values for the plain float types).
    codes: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    add_offset: bool = False  # value = code * scale + offset (Q4_1, Q5_1) instead of - offset


def _words(blocks: torch.Tensor) -> torch.Tensor:
    """blocks [N, B] viewed as int16 [N, B / 2] (all block sizes and fp16 field offsets are even)."""
    try:
        return blocks.view(torch.int16)
    except RuntimeError:  # odd storage offset of a sliced buffer: realign with one copy
        return blocks.clone().view(torch.int16)


def _f16(blocks: torch.Tensor, offset: int) -> torch.Tensor:
    """The fp16 stored at byte `offset` of each block, widened to float32: [N]."""
    # A single strided column is one long loop for torch, unlike a narrow [N, 2] slice.
    return _words(blocks)[:, offset // 2].contiguous().view(torch.float16).float()


def _bytes_t(blocks: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """Bytes start:stop of every block, transposed to [stop - start, N] (contiguous).

    The per-block scale fields are narrow; gathering them column by column and working on
    them transposed gives torch long inner loops instead of a loop call per block.
    """
    return torch.stack([blocks[:, j] for j in range(start, stop)])


_TABLES: dict[tuple[tuple[int, ...], torch.device], torch.Tensor] = {}


def _table(values: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """A small float32 lookup table on `device`, copied there once (no host copy inside a captured CUDA graph)."""
    key = (values, device)
    if key not in _TABLES:
        _TABLES[key] = torch.tensor(values, dtype=torch.float32, device=device)
    return _TABLES[key]


def _steps(n: int, step: int, device: torch.device) -> torch.Tensor:
    """int32 [n]: 0, step, 2 step, ... (shift amounts; made by a kernel, never copied from the host)."""
    return torch.arange(0, n * step, step, device=device, dtype=torch.int32)


def _nibble_pair(src: torch.Tensor, lo_dst: torch.Tensor, hi_dst: torch.Tensor) -> None:
    """Low nibbles of `src` into lo_dst and high nibbles into hi_dst (float32 views, exact)."""
    lo_dst.copy_(torch.bitwise_and(src, 0x0F))
    hi_dst.copy_(torch.bitwise_right_shift(src, 4))


# ----------------------------------------------------------------------------- 32-element types


def _scale_d(blocks: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return (_f16(blocks, 0).view(-1, 1, 1),)  # [N, 1, 1]


def _scale_dm(blocks: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return (_f16(blocks, 0).view(-1, 1, 1), _f16(blocks, 2).view(-1, 1, 1))  # [N, 1, 1] each


def _codes_q8_0(blocks: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    o = out.view(-1, 1, 32)
    o.copy_(blocks[:, 2:].view(torch.int8).unsqueeze(1))
    return o


def _codes_q4_0(blocks: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    # Element j sits in the low nibble of byte j, element j + 16 in its high nibble.
    qs = blocks[:, 2:]  # [n, 16]
    o = out.view(-1, 2, 16)
    o[:, 0].copy_(torch.bitwise_and(qs, 0x0F).view(torch.int8).sub_(8))
    o[:, 1].copy_(torch.bitwise_right_shift(qs, 4).view(torch.int8).sub_(8))
    return o


def _codes_q4_1(blocks: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    o = out.view(-1, 2, 16)
    _nibble_pair(blocks[:, 4:], o[:, 0], o[:, 1])
    return o


def _q5_codes(qh: torch.Tensor, qs: torch.Tensor) -> torch.Tensor:
    """5-bit codes [n, 32] (uint8) from 4 bytes of high bits (a little-endian uint32) and 16 bytes of nibbles."""
    n = qs.shape[0]
    codes = torch.empty((n, 2, 16), dtype=torch.uint8, device=qs.device)
    torch.bitwise_and(qs, 0x0F, out=codes[:, 0])
    torch.bitwise_right_shift(qs, 4, out=codes[:, 1])
    shifts = torch.arange(8, device=qs.device, dtype=torch.uint8)
    high = ((qh.unsqueeze(-1) >> shifts) & 1).view(n, 32)  # bit j of the uint32 -> element j
    return codes.view(n, 32).bitwise_or_(high << 4)


def _codes_q5_0(blocks: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    o = out.view(-1, 1, 32)
    o.copy_(_q5_codes(blocks[:, 2:6], blocks[:, 6:]).view(torch.int8).sub_(16).unsqueeze(1))
    return o


def _codes_q5_1(blocks: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    o = out.view(-1, 1, 32)
    o.copy_(_q5_codes(blocks[:, 4:8], blocks[:, 8:]).unsqueeze(1))
    return o


# ----------------------------------------------------------------------------- K-quants
#
# Scale tensors are built in the transposed [k, N] layout and handed out as [N, k, 1] views.
# The 2-bit code bytes of Q2_K/Q3_K/Q6_K pack element 128h + 32k + l at bits 2k of byte 32h + l.


def _crumb(qs: torch.Tensor, k: int) -> torch.Tensor:
    """Field k (bits 2k, 2k+1) of the code bytes qs [n, 2, 32] -> [n, 2, 32] uint8."""
    return torch.bitwise_right_shift(qs, 2 * k).bitwise_and_(3) if k else torch.bitwise_and(qs, 3)


def _scales_q2_k(blocks: torch.Tensor) -> tuple[torch.Tensor, ...]:
    sc = _bytes_t(blocks, 0, 16)  # [16, N]: low nibble scale, high nibble min of each 16-element sub-block
    d = _f16(blocks, 80).view(1, -1)  # [1, N]
    dmin = _f16(blocks, 82).view(1, -1)
    dl = d * torch.bitwise_and(sc, 0x0F)
    ml = dmin * torch.bitwise_right_shift(sc, 4)
    return dl.t().unsqueeze(-1), ml.t().unsqueeze(-1)  # [N, 16, 1]


def _codes_q2_k(blocks: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    qs = blocks[:, 16:80].view(n, 2, 32)
    o = out.view(n, 2, 4, 32)
    for k in range(4):
        o[:, :, k].copy_(_crumb(qs, k))
    return out.view(n, 16, 16)


def _scales_q3_k(blocks: torch.Tensor) -> tuple[torch.Tensor, ...]:
    # 16 signed 6-bit scales: bytes 96-103 hold the low 4 bits (scales 0-7 in the low nibbles,
    # 8-15 in the high); bytes 104-107 the top 2 bits, scale j at bits 2*(j // 4) of byte 104 + j % 4.
    packed = _bytes_t(blocks, 96, 108)  # [12, N]
    low = torch.cat((torch.bitwise_and(packed[:8], 0x0F), torch.bitwise_right_shift(packed[:8], 4)))  # [16, N]
    high = torch.cat([torch.bitwise_right_shift(packed[8:], 2 * i).bitwise_and_(3) for i in range(4)])
    sc = low.bitwise_or_(high << 4).view(torch.int8) - 32
    dl = _f16(blocks, 108).view(1, -1) * sc  # [16, N]
    return (dl.t().unsqueeze(-1),)  # [N, 16, 1]


def _codes_q3_k(blocks: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    hmask = blocks[:, :32]  # bit 4h + k of byte l: third bit of element 128h + 32k + l
    qs = blocks[:, 32:96].view(n, 2, 32)
    o = out.view(n, 2, 4, 32)
    for k in range(4):
        code = _crumb(qs, k)  # [n, 2, 32]
        for h in range(2):
            # The stored value is code - 4 when the mask bit is clear, code when it is set.
            hbit = torch.bitwise_right_shift(hmask, 4 * h + k).bitwise_and_(1)
            code[:, h].bitwise_or_(hbit << 2)
        o[:, :, k].copy_(code.view(torch.int8).sub_(4))
    return out.view(n, 16, 16)


def _scales_k4(blocks: torch.Tensor) -> tuple[torch.Tensor, ...]:
    # Eight 6-bit scales and mins: bytes 4-7 hold scales 0-3 (low 6 bits) plus the top bits of
    # scales 4-7, bytes 8-11 the same for the mins, and bytes 12-15 the low 4 bits of scales 4-7
    # (low nibble) and mins 4-7 (high nibble).
    h = _bytes_t(blocks, 4, 16)  # [12, N]
    d, m, md = h[0:4], h[4:8], h[8:12]
    sc = torch.cat((d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)))  # [8, N]
    mn = torch.cat((m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)))
    dl = _f16(blocks, 0).view(1, -1) * sc
    ml = _f16(blocks, 2).view(1, -1) * mn
    return dl.t().reshape(-1, 4, 2, 1), ml.t().reshape(-1, 4, 2, 1)  # [N, pair, low/high nibble, 1] views


def _codes_q4_k(blocks: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    # 4 groups of 32 bytes; the low nibbles are sub-block 2g, the high nibbles 2g + 1.
    o = out.view(-1, 4, 2, 32)
    _nibble_pair(blocks[:, 16:].view(-1, 4, 32), o[:, :, 0], o[:, :, 1])
    return o


def _codes_q5_k(blocks: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    qh, qs = blocks[:, 16:48], blocks[:, 48:].view(n, 4, 32)
    o = out.view(n, 4, 2, 32)
    for s in range(8):
        # Sub-block s: nibble s % 2 of byte group s // 2, fifth bit from bit s of qh[l].
        g, nib = divmod(s, 2)
        code = torch.bitwise_right_shift(qs[:, g], 4) if nib else torch.bitwise_and(qs[:, g], 0x0F)
        high = torch.bitwise_right_shift(qh, s).bitwise_and_(1) if s else torch.bitwise_and(qh, 1)
        o[:, g, nib].copy_(code.bitwise_or_(high << 4))
    return o


def _scales_q6_k(blocks: torch.Tensor) -> tuple[torch.Tensor, ...]:
    sc = _bytes_t(blocks, 192, 208).view(torch.int8)  # [16, N] signed 8-bit scales
    dl = _f16(blocks, 208).view(1, -1) * sc
    return (dl.t().unsqueeze(-1),)  # [N, 16, 1]


def _codes_q6_k(blocks: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    # Per 128-element half h: byte 64h + 32w + l of ql holds element 128h + 32w + l in its low
    # nibble and element 128h + 64 + 32w + l in its high nibble; qh byte 32h + l carries the top
    # two bits of element 128h + 32k + l at bits 2k.
    ql = blocks[:, :128].view(n, 2, 2, 32)
    qh = blocks[:, 128:192].view(n, 2, 32)
    o = out.view(n, 2, 4, 32)
    for k in range(4):
        nib, w = divmod(k, 2)
        code = torch.bitwise_right_shift(ql[:, :, w], 4) if nib else torch.bitwise_and(ql[:, :, w], 0x0F)
        code.bitwise_or_(_crumb(qh, k) << 4)
        o[:, :, k].copy_(code.view(torch.int8).sub_(32))
    return out.view(n, 16, 16)


# ----------------------------------------------------------------------------- non-linear 4-bit types
#
# A 4-bit code selects one of the 16 levels IQ4_VALUES; in each 32-element (sub-)block, element j sits in the
# low nibble of byte j and element j + 16 in its high nibble, as in Q4_0.


def _iq4_levels(qs: torch.Tensor, out: torch.Tensor) -> None:
    """The levels of the nibbles qs [..., 16] into out [..., 2, 16] (float32 views, exact)."""
    table = _table(IQ4_VALUES, qs.device)
    out[..., 0, :].copy_(table[torch.bitwise_and(qs, 0x0F).long()])
    out[..., 1, :].copy_(table[torch.bitwise_right_shift(qs, 4).long()])


def _codes_iq4_nl(blocks: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    o = out.view(-1, 2, 16)
    _iq4_levels(blocks[:, 2:], o)
    return o.view(-1, 1, 32)


def _scales_iq4_xs(blocks: torch.Tensor) -> tuple[torch.Tensor, ...]:
    # Eight 6-bit scales (stored + 32) of the 32-element sub-blocks: low 4 bits in nibble j % 2 of byte 4 + j // 2,
    # top 2 bits at bits 2j of the little-endian uint16 in bytes 2-3.
    low = _bytes_t(blocks, 4, 8)  # [4, N]
    low = torch.stack((torch.bitwise_and(low, 0x0F), torch.bitwise_right_shift(low, 4)), dim=1).reshape(8, -1)
    high_word = _bytes_t(blocks, 2, 4).to(torch.int32)  # [2, N]
    high_word = high_word[0] | (high_word[1] << 8)  # [N]
    high = torch.stack([torch.bitwise_right_shift(high_word, 2 * j).bitwise_and_(3) for j in range(8)])  # [8, N]
    sc = (low.to(torch.int32) | (high << 4)) - 32
    dl = _f16(blocks, 0).view(1, -1) * sc  # [8, N]
    return (dl.t().unsqueeze(-1),)  # [N, 8, 1]


def _codes_iq4_xs(blocks: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    o = out.view(-1, 8, 2, 16)
    _iq4_levels(blocks[:, 8:].view(-1, 8, 16), o)
    return o.view(-1, 8, 32)


# ----------------------------------------------------------------------------- grid types (IQ3, IQ2, IQ1)
#
# Every value is d x (a small odd integer from the sub-block scale) x a grid value x a sign, times a power of two:
# each factor is exact and so is every product in float32 (at most 22 significant bits), so the values equal
# gguf's whatever the order of the products. The codes written are the signed grid values (for IQ1, 8 x the grid
# value +- 1, the delta being +-1/8); the scales carry d, the sub-block factor and the power of two.


def _u32(blocks: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """Bytes start:stop of every block as little-endian int32 words: [N, (stop - start) / 4]."""
    return blocks[:, start:stop].clone().view(torch.int32)  # a fresh copy, so the words are aligned


def _u16(blocks: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """Bytes start:stop of every block as little-endian uint16 words widened to int32: [N, (stop - start) / 2]."""
    return blocks[:, start:stop].clone().view(torch.int16).to(torch.int32) & 0xFFFF


def _nibbles_t(packed: torch.Tensor) -> torch.Tensor:
    """Bytes [n, m] -> [n, 2m] int32: low nibble of byte i at 2i, high nibble at 2i + 1."""
    return torch.stack((packed & 0x0F, packed >> 4), dim=-1).reshape(packed.shape[0], -1).to(torch.int32)


def _signed_grid(qtype: QuantType, index: torch.Tensor, negative: torch.Tensor) -> torch.Tensor:
    """Grid entries of `index` [...] with the sign bits `negative` [..., width] (bool) applied: [..., width] int8."""
    g = grid_table(qtype, index.device)[index.long()]
    return torch.where(negative, -g, g)


def _sign_bits(signs: torch.Tensor) -> torch.Tensor:
    """Sign bytes [...] -> [..., 8] bool: bit j set means value j is negative."""
    shifts = torch.arange(8, device=signs.device, dtype=torch.int32)
    return ((signs.to(torch.int32).unsqueeze(-1) >> shifts) & 1).bool()


def _pattern_bits(fields: torch.Tensor) -> torch.Tensor:
    """7-bit sign-pattern indices [...] -> [..., 8] bool through ksigns (the eighth sign keeps the parity even)."""
    return _sign_bits(sign_patterns(fields.device)[fields.long()])


def _odd_scale(blocks: torch.Tensor, odd: torch.Tensor, mult: float) -> tuple[torch.Tensor, ...]:
    """d (fp16 at byte 0) x odd [N, S] x mult -> ([N, S, 1],): the scale of each of the S sub-blocks."""
    return ((_f16(blocks, 0).view(-1, 1) * odd * mult).unsqueeze(-1),)


def _scales_iq2_xxs(blocks: torch.Tensor) -> tuple[torch.Tensor, ...]:
    # Per 32 elements: d (0.5 + ls) / 4 = d (2 ls + 1) / 8, ls the top 4 bits of the group's second word.
    ls = _u32(blocks, 2, 66)[:, 1::2] >> 28 & 15  # [N, 8]
    return _odd_scale(blocks, 2 * ls + 1, 0.125)


def _codes_iq2_xxs(blocks: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    # Per 32 elements two words: four grid indices (bytes), then four 7-bit sign patterns and the scale.
    n = blocks.shape[0]
    idx = blocks[:, 2:66].reshape(n, 8, 2, 4)[:, :, 0]  # [n, 8, 4]
    signs = _u32(blocks, 2, 66)[:, 1::2].unsqueeze(-1) >> _steps(4, 7, blocks.device) & 127
    o = out.view(n, 8, 4, 8)
    o.copy_(_signed_grid(QuantType.IQ2_XXS, idx, _pattern_bits(signs)))
    return out.view(n, 8, 32)


def _scales_iq2_16(blocks: torch.Tensor, at: int) -> tuple[torch.Tensor, ...]:
    """IQ2_XS, IQ2_S: 4-bit scales of the 16-element sub-blocks in the nibbles of bytes at:at + 8 -> d (2 s + 1) / 8."""
    return _odd_scale(blocks, 2 * _nibbles_t(blocks[:, at : at + 8]) + 1, 0.125)  # [N, 16, 1]


def _codes_iq2_xs(blocks: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    # 32 uint16: a 9-bit grid index and a 7-bit sign pattern for each 8 elements.
    n = blocks.shape[0]
    q = _u16(blocks, 2, 66)  # [n, 32]
    o = out.view(n, 32, 8)
    o.copy_(_signed_grid(QuantType.IQ2_XS, q & 511, _pattern_bits(q >> 9)))
    return out.view(n, 16, 16)


def _codes_iq2_s(blocks: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    # 32 low index bytes, 32 sign bytes (one per 8 elements), 8 bytes of 2-bit index tops (four a byte).
    n = blocks.shape[0]
    qh = blocks[:, 66:74].to(torch.int32).unsqueeze(-1) >> _steps(4, 2, blocks.device) & 3
    idx = blocks[:, 2:34].to(torch.int32) | (qh.reshape(n, 32) << 8)  # [n, 32]
    o = out.view(n, 32, 8)
    o.copy_(_signed_grid(QuantType.IQ2_S, idx, _sign_bits(blocks[:, 34:66])))
    return out.view(n, 16, 16)


def _scales_iq3_xxs(blocks: torch.Tensor) -> tuple[torch.Tensor, ...]:
    # Per 32 elements: d (0.5 + ls) / 2 = d (2 ls + 1) / 4, ls the top 4 bits of the group's word.
    return _odd_scale(blocks, 2 * (_u32(blocks, 66, 98) >> 28 & 15) + 1, 0.25)


def _codes_iq3_xxs(blocks: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    # 64 grid indices (4 values each), then per 32 elements a word of four 7-bit sign patterns (8 values each).
    n = blocks.shape[0]
    words = _u32(blocks, 66, 98)  # [n, 8]
    signs = words.unsqueeze(-1) >> _steps(4, 7, blocks.device) & 127  # [n, 8, 4]
    negative = _pattern_bits(signs).view(n, 8, 4, 2, 4)
    o = out.view(n, 8, 4, 2, 4)
    o.copy_(_signed_grid(QuantType.IQ3_XXS, blocks[:, 2:66].reshape(n, 8, 4, 2), negative))
    return out.view(n, 8, 32)


def _scales_iq3_s(blocks: torch.Tensor) -> tuple[torch.Tensor, ...]:
    # 4-bit scales of the 32-element sub-blocks in the nibbles of the last 4 bytes: d (1 + 2 s).
    return _odd_scale(blocks, 2 * _nibbles_t(blocks[:, 106:110]) + 1, 1.0)  # [N, 8, 1]


def _codes_iq3_s(blocks: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    # 64 low index bytes, 8 bytes of index top bits (bit k % 8 of byte k // 8), 32 sign bytes (8 values each).
    n = blocks.shape[0]
    qh = blocks[:, 66:74].to(torch.int32).unsqueeze(-1) >> torch.arange(8, device=blocks.device) & 1
    idx = (blocks[:, 2:66].to(torch.int32) | (qh.reshape(n, 64) << 8)).view(n, 32, 2)  # [n, 32, 2]
    negative = _sign_bits(blocks[:, 74:106]).view(n, 32, 2, 4)
    o = out.view(n, 32, 2, 4)
    o.copy_(_signed_grid(QuantType.IQ3_S, idx, negative))
    return out.view(n, 8, 32)


def _scales_iq1_s(blocks: torch.Tensor) -> tuple[torch.Tensor, ...]:
    # Per 32 elements: d (2 s + 1), s bits 12-14 of the group's uint16; the codes hold 8 (grid +- 1/8), so / 8.
    return _odd_scale(blocks, 2 * (_u16(blocks, 34, 50) >> 12 & 7) + 1, 0.125)  # [N, 8, 1]


def _iq1_levels(index: torch.Tensor, minus: torch.Tensor) -> torch.Tensor:
    """8 x (grid value + delta) of IQ1 groups: index [...], minus [...] (delta -1/8, else +1/8) -> [..., 8] int8."""
    g = grid_table(QuantType.IQ1_S, index.device)[index.long()] * 8
    return g + torch.where(minus, -1, 1).to(torch.int8).unsqueeze(-1)


def _codes_iq1_s(blocks: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    # 32 low index bytes; per 32 elements a uint16: four 3-bit index tops, the scale, the delta's sign (bit 15).
    n = blocks.shape[0]
    qh = _u16(blocks, 34, 50)  # [n, 8]
    tops = qh.unsqueeze(-1) >> _steps(4, 3, blocks.device) & 7  # [n, 8, 4]
    idx = blocks[:, 2:34].to(torch.int32).view(n, 8, 4) | (tops << 8)
    minus = (qh & 0x8000).bool().unsqueeze(-1).expand(n, 8, 4)
    o = out.view(n, 8, 4, 8)
    o.copy_(_iq1_levels(idx, minus))
    return out.view(n, 8, 32)


def _iq1_m_d(blocks: torch.Tensor) -> torch.Tensor:
    """IQ1_M's fp16 d, stored in the top nibbles of its four scale words (low bits first): [N] float32."""
    sc = _u16(blocks, 48, 56)  # [N, 4]
    bits = (sc[:, 0] >> 12) | (sc[:, 1] >> 8 & 0xF0) | (sc[:, 2] >> 4 & 0xF00) | (sc[:, 3] & 0xF000)
    return bits.to(torch.int16).view(torch.float16).float()


def _scales_iq1_m(blocks: torch.Tensor) -> tuple[torch.Tensor, ...]:
    # Sixteen 3-bit scales (bits 0, 3, 6, 9 of each word), one per 16 elements: d (2 s + 1), then / 8 as IQ1_S.
    sc = _u16(blocks, 48, 56).unsqueeze(-1) >> _steps(4, 3, blocks.device) & 7
    odd = 2 * sc.reshape(-1, 16) + 1  # [N, 16]
    return ((_iq1_m_d(blocks).view(-1, 1) * odd * 0.125).unsqueeze(-1),)  # [N, 16, 1]


def _codes_iq1_m(blocks: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    # 32 low index bytes; 16 bytes of a nibble per 8 elements: the index's top 3 bits, the delta's sign (bit 3).
    n = blocks.shape[0]
    nib = _nibbles_t(blocks[:, 32:48])  # [n, 32]
    idx = blocks[:, 0:32].to(torch.int32) | ((nib & 7) << 8)
    o = out.view(n, 32, 8)
    o.copy_(_iq1_levels(idx, (nib & 8).bool()))
    return out.view(n, 16, 16)


# ----------------------------------------------------------------------------- ternary and FP4 types


def _scales_tq(at: int) -> Callable[[torch.Tensor], tuple[torch.Tensor, ...]]:
    return lambda blocks: (_f16(blocks, at).view(-1, 1),)  # [N, 1]


def _codes_tq1_0(blocks: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    # Bytes hold base-3 numbers scaled to 0..255; digit k is ((byte x 3^k mod 256) x 3) >> 8. Bytes 0-31 give
    # five digits (elements 32k + l), bytes 32-47 five (160 + 16k + l), bytes 48-51 four (240 + 4k + l).
    n = blocks.shape[0]
    parts = []
    for start, stop, digits in ((0, 32, 5), (32, 48, 5), (48, 52, 4)):
        q = blocks[:, start:stop].to(torch.int32).unsqueeze(1)  # [n, 1, w]
        pow3 = torch.pow(3, torch.arange(digits, device=blocks.device, dtype=torch.int32)).view(1, -1, 1)
        parts.append(((q * pow3 & 0xFF) * 3 >> 8).reshape(n, -1))
    out.copy_(torch.cat(parts, dim=1) - 1)
    return out


def _codes_tq2_0(blocks: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    # Element 128h + 32k + l at bits 2k of byte 32h + l, stored as value + 1.
    n = blocks.shape[0]
    qs = blocks[:, 0:64].view(n, 2, 1, 32).to(torch.int32)
    shifts = _steps(4, 2, blocks.device).view(1, 1, 4, 1)
    out.view(n, 2, 4, 32).copy_((qs >> shifts & 3) - 1)
    return out


def _fp4(qs: torch.Tensor, out: torch.Tensor) -> None:
    """FP4 nibbles qs [..., m] into out [..., 2, m]: low nibbles first, then high (float32 views, exact)."""
    table = _table(FP4_VALUES, qs.device)
    out[..., 0, :].copy_(table[torch.bitwise_and(qs, 0x0F).long()])
    out[..., 1, :].copy_(table[torch.bitwise_right_shift(qs, 4).long()])


def _scales_mxfp4(blocks: torch.Tensor) -> tuple[torch.Tensor, ...]:
    # E8M0 exponent e -> 2^(e - 128) as float32 bits (ggml_e8m0_to_fp32_half; e < 2 gives subnormals).
    e = blocks[:, 0].to(torch.int32)
    bits = torch.where(e < 2, 0x00200000 << e, (e - 1) << 23)
    return (bits.view(torch.float32).view(-1, 1, 1),)  # [N, 1, 1]


def _codes_mxfp4(blocks: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    o = out.view(-1, 2, 16)
    _fp4(blocks[:, 1:17], o)
    return o


def _scales_nvfp4(blocks: torch.Tensor) -> tuple[torch.Tensor, ...]:
    # Unsigned E4M3 (bias 7) per 16 elements, halved: (8 + man) 2^(exp - 11), subnormal man 2^-10; 0 and 0x7F
    # (NaN) give 0. Bit 7 is ignored.
    x = blocks[:, 0:4].to(torch.int32)  # [N, 4]
    exp, man = x >> 3 & 15, (x & 7).float()
    value = torch.where(exp == 0, man * 2.0**-10, torch.ldexp(man + 8, exp - 11))
    value = torch.where((x == 0) | (x == 0x7F), torch.zeros_like(value), value)
    return (value.unsqueeze(-1).unsqueeze(-1),)  # [N, 4, 1, 1]


def _codes_nvfp4(blocks: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    # Per 16 elements 8 bytes: element j in the low nibble of byte j, element 8 + j in its high nibble.
    o = out.view(-1, 4, 2, 8)
    _fp4(blocks[:, 4:36].reshape(-1, 4, 8), o)
    return o


# ----------------------------------------------------------------------------- plain floats


def _no_scales(blocks: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return ()


def _into(out: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    o = out.view(values.shape)
    o.copy_(values)
    return o


def _values_bf16(blocks: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    # Widen by bit shift so that every bit pattern (NaN payloads included) matches gguf.
    bits = blocks.contiguous().view(torch.int16).to(torch.int32) << 16  # [n, 1]
    return _into(out, bits.view(torch.float32))


def _values_f16(blocks: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    return _into(out, blocks.contiguous().view(torch.float16))


def _values_f32(blocks: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    return _into(out, blocks.contiguous().view(torch.float32))


_DECODERS: dict[QuantType, _Decoder] = {
    QuantType.F32: _Decoder(_no_scales, _values_f32),
    QuantType.F16: _Decoder(_no_scales, _values_f16),
    QuantType.BF16: _Decoder(_no_scales, _values_bf16),
    QuantType.Q8_0: _Decoder(_scale_d, _codes_q8_0),
    QuantType.Q4_0: _Decoder(_scale_d, _codes_q4_0),
    QuantType.Q4_1: _Decoder(_scale_dm, _codes_q4_1, add_offset=True),
    QuantType.Q5_0: _Decoder(_scale_d, _codes_q5_0),
    QuantType.Q5_1: _Decoder(_scale_dm, _codes_q5_1, add_offset=True),
    QuantType.Q2_K: _Decoder(_scales_q2_k, _codes_q2_k),
    QuantType.Q3_K: _Decoder(_scales_q3_k, _codes_q3_k),
    QuantType.Q4_K: _Decoder(_scales_k4, _codes_q4_k),
    QuantType.Q5_K: _Decoder(_scales_k4, _codes_q5_k),
    QuantType.Q6_K: _Decoder(_scales_q6_k, _codes_q6_k),
    QuantType.IQ4_NL: _Decoder(_scale_d, _codes_iq4_nl),
    QuantType.IQ4_XS: _Decoder(_scales_iq4_xs, _codes_iq4_xs),
    QuantType.IQ2_XXS: _Decoder(_scales_iq2_xxs, _codes_iq2_xxs),
    QuantType.IQ2_XS: _Decoder(lambda b: _scales_iq2_16(b, 66), _codes_iq2_xs),
    QuantType.IQ2_S: _Decoder(lambda b: _scales_iq2_16(b, 74), _codes_iq2_s),
    QuantType.IQ3_XXS: _Decoder(_scales_iq3_xxs, _codes_iq3_xxs),
    QuantType.IQ3_S: _Decoder(_scales_iq3_s, _codes_iq3_s),
    QuantType.IQ1_S: _Decoder(_scales_iq1_s, _codes_iq1_s),
    QuantType.IQ1_M: _Decoder(_scales_iq1_m, _codes_iq1_m),
    QuantType.TQ1_0: _Decoder(_scales_tq(52), _codes_tq1_0),
    QuantType.TQ2_0: _Decoder(_scales_tq(64), _codes_tq2_0),
    QuantType.MXFP4: _Decoder(_scales_mxfp4, _codes_mxfp4),
    QuantType.NVFP4: _Decoder(_scales_nvfp4, _codes_nvfp4),
}


def _decode_chunk(dec: _Decoder, blocks: torch.Tensor, out: torch.Tensor, scales: Sequence[torch.Tensor]) -> None:
    """Decode blocks [n, B] into float32 out [n, E] given their slices of the precomputed scales."""
    o = dec.codes(blocks, out)
    if scales:
        o.mul_(scales[0])
    if len(scales) > 1:
        if dec.add_offset:
            o.add_(scales[1])
        else:
            o.sub_(scales[1])


def dequantize(
    raw: torch.Tensor,
    qtype: int | str | enum.Enum,
    shape: Sequence[int],
    dtype: torch.dtype = torch.float32,
    tensor_name: str = "",
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode raw GGUF blocks (uint8, any shape, CPU or CUDA) into a `dtype` tensor of logical `shape`.

    `out` (contiguous, `shape`, on raw's device) receives the result instead of a new tensor;
    its dtype wins over `dtype`. Reusing it skips the page faults of a fresh allocation.
    """
    qt = as_quant_type(qtype, tensor_name)
    where = f"tensor '{tensor_name}': " if tensor_name else ""
    if raw.dtype != torch.uint8:
        raise TypeError(f"{where}expected raw blocks as a uint8 tensor, got {raw.dtype}")
    shape = tuple(int(s) for s in shape)
    expected = tensor_nbytes(shape, qt, tensor_name)
    if raw.numel() != expected:
        raise ValueError(f"{where}{qt.name} tensor of shape {shape} needs {expected} bytes, got {raw.numel()}")
    if out is None:
        out = torch.empty(shape, dtype=dtype, device=raw.device)
    elif tuple(out.shape) != shape or out.device != raw.device or not out.is_contiguous():
        raise ValueError(
            f"{where}expected a contiguous out tensor of shape {shape} on {raw.device}, "
            f"got shape {tuple(out.shape)} on {out.device} (contiguous={out.is_contiguous()})"
        )
    dec = _DECODERS[qt]
    blocks = raw.reshape(-1, qt.block_bytes)  # [N, block_bytes]; copies only if raw was strided
    n_blocks = blocks.shape[0]
    flat = out.view(n_blocks, qt.block_elems)  # [N, block_elems]
    scales = dec.scales(blocks)

    chunk_elems = _CUDA_CHUNK_ELEMS if raw.is_cuda else _CPU_CHUNK_ELEMS
    step = max(1, chunk_elems // qt.block_elems)
    scratch = None
    if out.dtype != torch.float32:
        scratch = torch.empty((min(step, n_blocks), qt.block_elems), dtype=torch.float32, device=raw.device)
    for start in range(0, n_blocks, step):
        stop = min(start + step, n_blocks)
        part = flat[start:stop] if scratch is None else scratch[: stop - start]
        _decode_chunk(dec, blocks[start:stop], part, [s[start:stop] for s in scales])
        if scratch is not None:
            flat[start:stop].copy_(part)  # rounds the exact float32 values once to the output dtype
    return out
