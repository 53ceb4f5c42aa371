"""Rotary position embedding (NeoX style: the two halves of each head rotate together), plain and YaRN."""

from __future__ import annotations

import math

import torch
from torch import nn

from moerun.config import RopeConfig, yarn_mscale


def rope_inv_freq(rope: RopeConfig, head_dim: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [head_dim/2] and the attention scaling applied to cos/sin."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim  # [D/2]
    pos_freqs = rope.theta**exponents
    if rope.kind == "default":
        return 1.0 / pos_freqs, 1.0
    factor = rope.factor
    if rope.attention_factor is not None:
        attention_factor = float(rope.attention_factor)
    elif rope.mscale and rope.mscale_all_dim:
        attention_factor = yarn_mscale(factor, rope.mscale) / yarn_mscale(factor, rope.mscale_all_dim)
    else:
        attention_factor = yarn_mscale(factor)
    original = rope.original_max_position

    def correction_dim(rotations: float) -> float:
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(rope.theta))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)).clamp(0, 1)
    extrapolation_weight = 1 - ramp  # 1 keeps the original frequency, 0 interpolates it
    inv_extra = 1.0 / pos_freqs
    inv_inter = 1.0 / (factor * pos_freqs)
    inv_freq = inv_inter * (1 - extrapolation_weight) + inv_extra * extrapolation_weight
    return inv_freq, float(attention_factor)


class RotaryEmbedding(nn.Module):
    """Applies rotary embeddings to q [T, n_q, D] and k [T, n_kv, D] at integer positions [T]."""

    def __init__(self, rope: RopeConfig, head_dim: int, max_position: int) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.max_position = max_position
        # computed on the CPU even when the model is built on the meta device
        self.inv_freq, self.scaling = rope_inv_freq(rope, head_dim)
        self._cache: dict[tuple[torch.device, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = {}

    def cos_sin(self, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin tables [max_position, D] in dtype, built once per device and dtype."""
        key = (device, dtype)
        if key not in self._cache:
            pos = torch.arange(self.max_position, dtype=torch.int64, device=device).float()
            freqs = pos[:, None] * self.inv_freq.to(device)[None, :]  # [P, D/2]
            emb = torch.cat((freqs, freqs), dim=-1)  # [P, D]
            self._cache[key] = ((emb.cos() * self.scaling).to(dtype), (emb.sin() * self.scaling).to(dtype))
        return self._cache[key]

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        cos_table, sin_table = self.cos_sin(q.device, q.dtype)
        cos = cos_table[positions].unsqueeze(1)  # [T, 1, D]
        sin = sin_table[positions].unsqueeze(1)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
