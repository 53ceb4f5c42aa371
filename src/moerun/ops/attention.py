"""Public decode-step attention entry points, torch reference or Triton kernels.

``qk_norm_rope_write``: split q|k|v, per-head RMSNorm of q and k, NeoX rotary, k/v into the cache.
``decode_attention``: one new query token per sequence against its cached keys and values (GQA);
``decode_attention_int8`` also rounds its output to int8 for a quantized o_proj.
``decode_attention_qk``: both in one launch at decode (the q|k|v row in, the attention output out).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from moerun.layers.rotary import _rotate
from moerun.ops.dispatch import pick_backend
from moerun.ops.norm import rms_norm_reference

if TYPE_CHECKING:
    from moerun.kernels.quant.int8_dot import Int8Rows


def qk_norm_rope_write_reference(
    qkv: torch.Tensor,
    q_norm_w: torch.Tensor,
    k_norm_w: torch.Tensor,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    token_slots: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    n_q: int,
    n_kv: int,
    k_out: torch.Tensor | None = None,
) -> torch.Tensor:
    """What Qwen3Attention does between the qkv projection and attention, as separate torch ops."""
    T, D = qkv.shape[0], cos.shape[-1]
    q, k, v = qkv.split([n_q * D, n_kv * D, n_kv * D], dim=-1)
    q, _ = rms_norm_reference(q.unflatten(-1, (n_q, D)), q_norm_w, eps)  # [T, n_q, D]
    k, _ = rms_norm_reference(k.unflatten(-1, (n_kv, D)), k_norm_w, eps)  # [T, n_kv, D]
    cos_t = cos[positions].unsqueeze(1)  # [T, 1, D]
    sin_t = sin[positions].unsqueeze(1)
    q, k = _rotate(q, cos_t, sin_t), _rotate(k, cos_t, sin_t)
    k_cache[token_slots, positions] = k
    v_cache[token_slots, positions] = v.reshape(T, n_kv, D)
    if k_out is not None:
        k_out.copy_(k)
    return q


def qk_norm_rope_write(
    qkv: torch.Tensor,
    q_norm_w: torch.Tensor,
    k_norm_w: torch.Tensor,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    token_slots: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    n_q: int,
    n_kv: int,
    backend: str | None = None,
    k_out: torch.Tensor | None = None,
) -> torch.Tensor:
    """qkv [T, (n_q + 2 n_kv) D] -> q [T, n_q, D] normed and rotated at positions [T]; k (normed, rotated) and v go
    to k_cache, v_cache [S, L, n_kv, D] at [token_slots[t], positions[t]], and k also to ``k_out`` [T, n_kv, D]
    when given (prefill attends to it without reading the cache back). cos, sin: [P, D] tables in qkv's dtype.
    """
    if pick_backend(backend, qkv.device, "qk-norm-rope") == "torch":
        return qk_norm_rope_write_reference(
            qkv, q_norm_w, k_norm_w, eps, cos, sin, positions, token_slots, k_cache, v_cache, n_q, n_kv, k_out
        )
    from moerun.kernels.qk_norm_rope import qk_norm_rope_write_triton

    return qk_norm_rope_write_triton(
        qkv, q_norm_w, k_norm_w, eps, cos, sin, positions, token_slots, k_cache, v_cache, n_q, n_kv, k_out
    )


def decode_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_ids: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """SDPA of q [B, n_q, D] over each slot's whole cache [L], positions >= seq_lens[b] masked (no host reads)."""
    L = k_cache.shape[1]
    kc, vc = k_cache[slot_ids], v_cache[slot_ids]  # [B, L, n_kv, D]
    mask = torch.arange(L, device=q.device)[None, :] < seq_lens[:, None]  # [B, L]
    out = F.scaled_dot_product_attention(
        q.unsqueeze(2),  # [B, n_q, 1, D]
        kc.transpose(1, 2),  # [B, n_kv, L, D]
        vc.transpose(1, 2),
        attn_mask=mask[:, None, None, :],
        scale=scale,
        enable_gqa=True,
    )  # [B, n_q, 1, D]
    return out.squeeze(2)


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_ids: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    backend: str | None = None,
    num_splits: int | None = None,
) -> torch.Tensor:
    """q [B, n_q, D] attends to positions [0, seq_lens[b]) of slot slot_ids[b] of k_cache, v_cache [S, L, n_kv, D].

    Query head h reads kv head h // (n_q // n_kv). num_splits (Triton only) defaults from B, n_kv and L.
    """
    if pick_backend(backend, q.device, "decode-attention") == "torch":
        return decode_attention_reference(q, k_cache, v_cache, slot_ids, seq_lens, scale)
    from moerun.kernels.decode_attention import decode_attention_triton

    return decode_attention_triton(q, k_cache, v_cache, slot_ids, seq_lens, scale, num_splits=num_splits)


def decode_attention_int8(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_ids: torch.Tensor, seq_lens: torch.Tensor,
    scale: float, k_pad: int,
) -> tuple[torch.Tensor, Int8Rows]:
    """decode_attention on the Triton path, plus its output [B, n_q * D] rounded to int8 for a quantized o_proj whose
    kernel rounds x (kernels/quant/int8_dot.py, K padded to k_pad), in the same launch where the kernel can."""
    from moerun.kernels.decode_attention import decode_attention_int8_triton

    return decode_attention_int8_triton(q, k_cache, v_cache, slot_ids, seq_lens, scale, k_pad)


def decode_attention_qk(
    qkv: torch.Tensor, q_norm_w: torch.Tensor, k_norm_w: torch.Tensor, eps: float, cos: torch.Tensor,
    sin: torch.Tensor, positions: torch.Tensor, token_slots: torch.Tensor, k_cache: torch.Tensor,
    v_cache: torch.Tensor, slot_ids: torch.Tensor, seq_lens: torch.Tensor, scale: float, n_q: int, n_kv: int,
    k_pad: int | None = None, backend: str | None = None,
) -> tuple[torch.Tensor, Int8Rows | None]:
    """qk_norm_rope_write then decode_attention for one new token per sequence (qkv [B, (n_q + 2 n_kv) D]), in one
    launch on the Triton path: (out [B, n_q, D], with k_pad its int8 rows for a quantized o_proj, else None; the
    torch reference never rounds them)."""
    if pick_backend(backend, qkv.device, "decode-attention") == "torch":
        q = qk_norm_rope_write_reference(qkv, q_norm_w, k_norm_w, eps, cos, sin, positions, token_slots, k_cache,
                                         v_cache, n_q, n_kv)  # fmt: skip
        return decode_attention_reference(q, k_cache, v_cache, slot_ids, seq_lens, scale), None
    from moerun.kernels.decode_attention import decode_attention_qk_triton

    return decode_attention_qk_triton(qkv, q_norm_w, k_norm_w, eps, cos, sin, positions, token_slots, k_cache,
                                      v_cache, slot_ids, seq_lens, scale, n_q, n_kv, k_pad)  # fmt: skip
