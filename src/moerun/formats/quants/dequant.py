"""Vectorised torch dequantisation of GGUF blocks, bit-exact with gguf.quants.dequantize in float32."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from .types import IQ4_VALUES, QuantType, as_quant_type, tensor_nbytes

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
    table = torch.tensor(IQ4_VALUES, dtype=torch.float32, device=qs.device)
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
