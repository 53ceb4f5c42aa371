"""Qwen3 attention: fused q|k|v projection, per-head RMSNorm of q and k, RoPE, GQA over the KV cache."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moerun.config import ModelConfig
from moerun.engine.batch import ForwardBatch
from moerun.engine.kv_cache import KVCache
from moerun.layers.linear import Linear, MergedLinear
from moerun.layers.norm import RMSNorm
from moerun.layers.rotary import RotaryEmbedding


class Qwen3Attention(nn.Module):
    """Self-attention of one layer. Shapes: T tokens, n_q query heads, n_kv key/value heads, D head dim."""

    def __init__(self, config: ModelConfig, layer: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.layer = layer
        self.n_q, self.n_kv, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        D = self.head_dim
        self.qkv_proj = MergedLinear(
            config.hidden_size, [self.n_q * D, self.n_kv * D, self.n_kv * D], ["q", "k", "v"], config.attention_bias
        )
        self.o_proj = Linear(self.n_q * D, config.hidden_size, config.attention_bias)
        self.q_norm = RMSNorm(D, config.rms_norm_eps)
        self.k_norm = RMSNorm(D, config.rms_norm_eps)
        self.rotary = rotary
        self.scale = D**-0.5

    def forward(self, x: torch.Tensor, batch: ForwardBatch, cache: KVCache) -> torch.Tensor:
        T = x.shape[0]
        q, k, v = self.qkv_proj.split(self.qkv_proj(x))  # [T, n_q*D], [T, n_kv*D], [T, n_kv*D]
        q = self.q_norm(q.view(T, self.n_q, self.head_dim))  # [T, n_q, D]
        k = self.k_norm(k.view(T, self.n_kv, self.head_dim))  # [T, n_kv, D]
        v = v.view(T, self.n_kv, self.head_dim)
        q, k = self.rotary(batch.positions, q, k)
        cache.write(self.layer, batch, k, v)
        if batch.is_prefill:
            out = self._prefill(q, k, v, batch, cache)
        else:
            out = self._decode(q, batch, cache)
        return self.o_proj(out.reshape(T, self.n_q * self.head_dim))

    def _prefill(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: ForwardBatch, cache: KVCache
    ) -> torch.Tensor:
        """Causal attention per sequence; a sequence that continues earlier tokens reads them from the cache."""
        outs, row = [], 0
        for i, (start, n) in enumerate(zip(batch.start_positions, batch.query_lens)):
            qi = q[row : row + n].transpose(0, 1)  # [n_q, n, D]
            if start == 0:
                ki, vi = k[row : row + n].transpose(0, 1), v[row : row + n].transpose(0, 1)  # [n_kv, n, D]
                oi = F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, scale=self.scale, enable_gqa=True)
            else:
                kc, vc = cache.gather(self.layer, batch.slot_ids[i : i + 1], start + n)  # [1, L, n_kv, D]
                ki, vi = kc[0].transpose(0, 1), vc[0].transpose(0, 1)  # [n_kv, L, D]
                q_pos = torch.arange(start, start + n, device=q.device)[:, None]
                mask = torch.arange(start + n, device=q.device)[None, :] <= q_pos  # [n, L]
                oi = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, scale=self.scale, enable_gqa=True)
            outs.append(oi.transpose(0, 1))  # [n, n_q, D]
            row += n
        return torch.cat(outs, dim=0)

    def _decode(self, q: torch.Tensor, batch: ForwardBatch, cache: KVCache) -> torch.Tensor:
        """One new token per sequence attends to its whole cached context; longer contexts of others are masked."""
        L = batch.max_seq_len
        kc, vc = cache.gather(self.layer, batch.slot_ids, L)  # [B, L, n_kv, D]
        mask = torch.arange(L, device=q.device)[None, :] < batch.seq_lens[:, None]  # [B, L]
        out = F.scaled_dot_product_attention(
            q.unsqueeze(2),  # [B, n_q, 1, D]
            kc.transpose(1, 2),  # [B, n_kv, L, D]
            vc.transpose(1, 2),
            attn_mask=mask[:, None, None, :],
            scale=self.scale,
            enable_gqa=True,
        )  # [B, n_q, 1, D]
        return out.squeeze(2)
