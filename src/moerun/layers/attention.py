"""Qwen3 attention: fused q|k|v projection, per-head RMSNorm of q and k, RoPE, GQA over the KV cache."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from moerun import ops
from moerun.config import ModelConfig
from moerun.engine.batch import ForwardBatch
from moerun.engine.kv_cache import KVCache
from moerun.layers.linear import Linear, MergedLinear
from moerun.layers.norm import RMSNorm
from moerun.layers.rotary import RotaryEmbedding
from moerun.ops.linear import gemv_applies

if TYPE_CHECKING:
    from moerun.kernels.quant.int8_dot import Int8Rows


def decode_qk_in_attention() -> bool:
    """Whether decode on CUDA runs the q/k norm, RoPE and cache write inside the attention kernel
    (``ops.decode_attention_qk``, one launch fewer a layer) instead of their own kernel in front of it:
    ``MOERUN_DECODE_QK_FUSED=1``; read at each forward, so a recaptured graph follows it. Off by default: on an
    H200 it made batch-1 steps 0.02-0.03 ms slower (benchmarks/RESULTS.md)."""
    return os.environ.get("MOERUN_DECODE_QK_FUSED", "0") == "1"


# Whether SDPA gets the kv heads as they are (enable_gqa) or repeated to the query heads first. PyTorch picks a
# flash kernel for either on sm_90 (cuDNN's, measured in benchmarks/RESULTS.md); without CUDA the repeat is kept.
GQA_IN_SDPA = True


def sdpa_gqa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
             scale: float) -> torch.Tensor:
    """SDPA of q [B, n_q, n, D] over k, v [B, n_kv, L, D] (n_q a multiple of n_kv): causal when mask is None
    (n == L), else under the boolean mask [n, L] -> [B, n_q, n, D]."""
    group = q.shape[1] // k.shape[1]
    if group > 1 and not (GQA_IN_SDPA and q.device.type == "cuda"):
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # [B, n_q, L, D]
    gqa = group > 1 and k.shape[1] != q.shape[1]
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)


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
        return self._attend(self.qkv_proj(x), batch, cache)

    def forward_fused_norm(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        norm: RMSNorm,
        batch: ForwardBatch,
        cache: KVCache,
        backend: str | None = None,
        project: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``norm.forward_with_residual(x, residual)`` then ``forward``: (attention output [T, H], new residual);
        without ``project``, the output before o_proj [T, n_q * D] (for a consumer that applies it).

        At decode with a dense q|k|v weight the residual add and the norm run inside the q|k|v GEMV
        (``ops.rms_norm_linear``): on CUDA when few enough tokens, or anywhere with backend="triton". With GGUF
        blocks whose decode kernels round x to int8, the norm's kernel rounds it (``ops.rms_norm_int8``).
        """
        if self._fuse_norm(x, residual, batch, backend):
            qkv, residual = ops.rms_norm_linear(
                x, residual, norm.weight, norm.eps, self.qkv_proj.weight, self.qkv_proj.bias, backend=backend
            )  # [T, (n_q + 2 n_kv) D], [T, H]
            return self._attend(qkv, batch, cache, project), residual
        pad = None if batch.is_prefill else self.qkv_proj.int8_input_pad(x, backend)
        if pad is not None:  # GGUF q|k|v whose decode kernels round x to int8: the norm hands it over rounded
            h, residual, h_int8 = ops.rms_norm_int8(x, norm.weight, norm.eps, residual, pad)
            return self._attend(self.qkv_proj(h, x_int8=h_int8), batch, cache, project), residual
        h, residual = norm.forward_with_residual(x, residual)
        return self._attend(self.qkv_proj(h), batch, cache, project), residual

    def _fuse_norm(self, x: torch.Tensor, residual: torch.Tensor | None, batch: ForwardBatch,
                   backend: str | None) -> bool:  # fmt: skip
        """Whether forward_fused_norm runs the fused norm + q|k|v GEMV (never for GGUF-block weights)."""
        if batch.is_prefill or "q_weight" in self.qkv_proj.__dict__ or backend == "torch":
            return False
        if backend == "triton":
            return True
        # the residual has the model's dtype where x may be an MoE's float32 sums
        return gemv_applies(x if residual is None else residual, self.qkv_proj.weight, x.shape[0])

    def _attend(self, qkv: torch.Tensor, batch: ForwardBatch, cache: KVCache, project: bool = True) -> torch.Tensor:
        """q|k|v [T, (n_q + 2 n_kv) D] -> q/k norm, rotary, cache write, attention, o_proj -> [T, H] (without
        ``project``: the attention's output [T, n_q * D], o_proj left to the caller)."""
        T, D = qkv.shape[0], self.head_dim
        cos, sin = self.rotary.cos_sin(qkv.device, qkv.dtype)
        if not batch.is_prefill and qkv.device.type == "cuda" and decode_qk_in_attention():
            pad = self.o_proj.int8_input_pad(qkv[:, : self.n_q * D])  # a GGUF o_proj's int8 rows, made in the launch
            out, out_int8 = ops.decode_attention_qk(
                qkv, self.q_norm.weight, self.k_norm.weight, self.q_norm.eps, cos, sin, batch.positions,
                batch.token_slots, cache.k[self.layer], cache.v[self.layer], batch.slot_ids, batch.seq_lens,
                self.scale, self.n_q, self.n_kv, k_pad=pad,
            )  # [T, n_q, D]
            return self._project(out.reshape(T, self.n_q * D), out_int8, project)
        # a prompt's normed, rotated k also comes back, so that its attention need not read the cache
        k_new = torch.empty(T, self.n_kv, D, dtype=qkv.dtype, device=qkv.device) if batch.is_prefill else None
        # per-head q/k norm, rotary, and the k/v write into the cache, in one op
        q = ops.qk_norm_rope_write(
            qkv, self.q_norm.weight, self.k_norm.weight, self.q_norm.eps, cos, sin, batch.positions,
            batch.token_slots, cache.k[self.layer], cache.v[self.layer], self.n_q, self.n_kv, k_out=k_new,
        )  # [T, n_q, D]
        if batch.is_prefill:
            v_new = qkv[:, (self.n_q + self.n_kv) * D :].unflatten(-1, (self.n_kv, D))  # [T, n_kv, D] view
            out = self._prefill(q, k_new, v_new, batch, cache)
        elif q.device.type == "cuda":
            pad = self.o_proj.int8_input_pad(q.reshape(T, self.n_q * D))
            if pad is not None:  # GGUF o_proj whose decode kernel rounds x to int8: attention hands it over rounded
                out, out_int8 = ops.decode_attention_int8(q, cache.k[self.layer], cache.v[self.layer], batch.slot_ids,
                                                          batch.seq_lens, self.scale, pad)  # fmt: skip
                return self._project(out.reshape(T, self.n_q * D), out_int8, project)
            out = ops.decode_attention(q, cache.k[self.layer], cache.v[self.layer], batch.slot_ids, batch.seq_lens,
                                       self.scale)
        else:
            out = self._decode_eager(q, batch, cache)
        return self._project(out.reshape(T, self.n_q * D), None, project)

    def _project(self, out: torch.Tensor, out_int8: Int8Rows | None, project: bool) -> torch.Tensor:
        """o_proj of the attention's output [T, n_q * D] (its int8 rows beside it for a GGUF o_proj), or the output
        itself without ``project``."""
        return self.o_proj(out, x_int8=out_int8) if project else out

    def _prefill(self, q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, batch: ForwardBatch,
                 cache: KVCache) -> torch.Tensor:
        """Causal attention per sequence: q [T, n_q, D] over this step's k/v [T, n_kv, D] for a sequence that starts
        at position 0, else over its cached keys (this step's were just written) -> [T, n_q, D]."""
        outs, row = [], 0
        for i, (start, n) in enumerate(zip(batch.start_positions, batch.query_lens)):
            qi = q[row : row + n].transpose(0, 1).unsqueeze(0)  # [1, n_q, n, D]
            if start == 0:
                ki = k_new[row : row + n].transpose(0, 1).unsqueeze(0)  # [1, n_kv, n, D]
                vi = v_new[row : row + n].transpose(0, 1).unsqueeze(0)
                oi = sdpa_gqa(qi, ki, vi, None, self.scale)
            else:
                kc, vc = cache.gather(self.layer, batch.slot_ids[i : i + 1], start + n)  # [1, L, n_kv, D]
                q_pos = torch.arange(start, start + n, device=q.device)[:, None]
                mask = torch.arange(start + n, device=q.device)[None, :] <= q_pos  # [n, L]
                oi = sdpa_gqa(qi, kc.transpose(1, 2), vc.transpose(1, 2), mask, self.scale)
            outs.append(oi[0].transpose(0, 1))  # [n, n_q, D]
            row += n
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=0)

    def _decode_eager(self, q: torch.Tensor, batch: ForwardBatch, cache: KVCache) -> torch.Tensor:
        """One new token per sequence over its cached context, reading only up to the batch's longest (CPU)."""
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
