"""Random valid GGUF blocks (random code bytes, finite fp16 scales) for the kernel tests and benchmarks."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from moerun.formats.quants import FP16_FIELDS, QuantizedTensor, QuantType

# Largest |code x sub-block scale| of each type (and of its min term), so that d = 1 / (that * sqrt(K))
# gives weights of order 1 / sqrt(K) and activations of order one.
_CODE_RANGE = {QuantType.Q8_0: 128, QuantType.Q4_0: 8, QuantType.Q4_1: 16, QuantType.Q5_0: 16, QuantType.Q5_1: 32,
               QuantType.Q2_K: 45, QuantType.Q3_K: 128, QuantType.Q4_K: 945, QuantType.Q5_K: 1953,
               QuantType.Q6_K: 4096, QuantType.IQ4_NL: 127, QuantType.IQ4_XS: 4064, QuantType.IQ2_XXS: 167,
               QuantType.IQ2_XS: 167, QuantType.IQ2_S: 167, QuantType.IQ3_XXS: 481, QuantType.IQ3_S: 465,
               QuantType.IQ1_S: 17, QuantType.IQ1_M: 17, QuantType.TQ1_0: 1, QuantType.TQ2_0: 2, QuantType.MXFP4: 12,
               QuantType.NVFP4: 12}  # fmt: skip
_MIN_RANGE = {QuantType.Q4_1: 1, QuantType.Q5_1: 1, QuantType.Q2_K: 15, QuantType.Q4_K: 63, QuantType.Q5_K: 63}
_CHUNK_BLOCK_BYTES = 64 * 2**20


def _finite_half_bits(n: int, generator: torch.Generator | None, device: torch.device) -> torch.Tensor:
    """n random fp16 bit patterns with inf/NaN exponents cleared, as an fp16 tensor."""
    bits = torch.randint(0, 1 << 16, (n,), generator=generator, device=device, dtype=torch.int32)
    bits = torch.where((bits & 0x7C00) == 0x7C00, bits & ~0x4000, bits)
    return bits.to(torch.int16).view(torch.float16)


def random_quantized(
    qtype: QuantType | str,
    shape: Sequence[int],
    device: torch.device | str = "cpu",
    generator: torch.Generator | None = None,
    any_scales: bool = False,
) -> QuantizedTensor:
    """A QuantizedTensor of logical `shape` with random code bytes; fp16 scales small (weights ~ 1/sqrt(K),
    either sign), or any finite fp16 bit pattern with any_scales (for bit-exactness tests).

    Blocks are drawn in chunks of about _CHUNK_BLOCK_BYTES, so the temporaries stay small next to the tensor."""
    qt = qtype if isinstance(qtype, QuantType) else QuantType[qtype]
    device = torch.device(device)
    shape = tuple(int(s) for s in shape)
    n_blocks = math.prod(shape) // qt.block_elems
    raw = torch.empty(n_blocks, qt.block_bytes, dtype=torch.uint8, device=device)  # [blocks, block bytes]
    step = max(1, _CHUNK_BLOCK_BYTES // qt.block_bytes)
    for b0 in range(0, n_blocks, step):
        _fill_blocks(raw[b0 : b0 + step], qt, shape[-1], generator, any_scales)
    return QuantizedTensor(raw.reshape(-1), qt, shape)


def _fill_blocks(raw: torch.Tensor, qt: QuantType, k: int, generator: torch.Generator | None,
                 any_scales: bool) -> None:
    """Random blocks into raw [n, block bytes] (uint8) in place: random bytes, then the fp16 fields."""
    n, device = raw.shape[0], raw.device
    raw.copy_(torch.randint(0, 256, raw.shape, generator=generator, device=device, dtype=torch.int32))
    for i, off in enumerate(FP16_FIELDS[qt]):
        if any_scales:
            half = _finite_half_bits(n, generator, device)
        else:
            mag = torch.rand(n, generator=generator, device=device) * 0.5 + 0.5
            sign = torch.randint(0, 2, (n,), generator=generator, device=device) * 2 - 1
            rng = _CODE_RANGE[qt] if i == 0 else _MIN_RANGE[qt]
            half = (mag * sign / (rng * math.sqrt(k))).to(torch.float16)
        raw[:, off : off + 2] = half.view(torch.uint8).view(n, 2)
    if qt == QuantType.IQ1_M:
        _iq1_m_scale(raw, generator, any_scales, k)
    elif not any_scales and qt in (QuantType.MXFP4, QuantType.NVFP4):
        _fp4_scales(raw, qt, generator, k)


def _iq1_m_scale(raw: torch.Tensor, generator: torch.Generator | None, any_scales: bool, k: int) -> None:
    """IQ1_M's fp16 d into the top nibbles of its four scale words (bytes 49, 51, 53, 55), low nibble first."""
    n, device = raw.shape[0], raw.device
    if any_scales:
        bits = _finite_half_bits(n, generator, device).view(torch.int16).to(torch.int32)
    else:
        mag = torch.rand(n, generator=generator, device=device) * 0.5 + 0.5
        bits = (mag / (_CODE_RANGE[QuantType.IQ1_M] * math.sqrt(k))).to(torch.float16).view(torch.int16)
        bits = bits.to(torch.int32)
    for i in range(4):
        nibble = ((bits >> (4 * i)) & 0xF).to(torch.uint8)
        raw[:, 49 + 2 * i] = (raw[:, 49 + 2 * i] & 0x0F) | (nibble << 4)


def _fp4_scales(raw: torch.Tensor, qt: QuantType, generator: torch.Generator | None, k: int) -> None:
    """Power-of-two (MXFP4: E8M0, 2^(e - 128)) or UE4M3 (NVFP4, halved) scales near 1 / (12 sqrt(K))."""
    n, device = raw.shape[0], raw.device
    target = math.log2(1.0 / (_CODE_RANGE[qt] * math.sqrt(k)))
    if qt == QuantType.MXFP4:
        e = torch.randint(-1, 1, (n,), generator=generator, device=device) + round(target) + 128
        raw[:, 0] = e.clamp(2, 254).to(torch.uint8)
    elif round(target) + 8 >= 1:  # normal: (8 + man) 2^(exp - 11), about 2^(exp - 8)
        exp = (torch.randint(-1, 1, (n, 4), generator=generator, device=device) + round(target) + 8).clamp(1, 14)
        man = torch.randint(0, 8, (n, 4), generator=generator, device=device)
        raw[:, 0:4] = ((exp << 3) | man).to(torch.uint8)
    else:  # subnormal: man 2^-10
        raw[:, 0:4] = torch.randint(1, 8, (n, 4), generator=generator, device=device).to(torch.uint8)
