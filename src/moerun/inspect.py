"""``moerun inspect``: a checkpoint's architecture, parameter counts and bytes, read without loading weights."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from moerun.formats.safetensors_checkpoint import SafetensorsCheckpoint
from moerun.models.checkpoint import read_model_config


def _fmt_count(n: float) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f}{unit}"
    return str(int(n))


def _fmt_bytes(n: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


def describe(path: str | Path) -> str:
    """A human-readable summary of a Hugging Face checkpoint folder."""
    cfg = read_model_config(path)
    ckpt = SafetensorsCheckpoint(path)
    counts = cfg.param_counts()
    by_dtype: Counter[str] = Counter()
    for entry in ckpt.entries.values():
        by_dtype[entry.dtype] += entry.nbytes
    lines = [
        f"path                 {path}",
        f"architecture         {cfg.architecture}",
        f"layers               {cfg.num_layers} ({len(cfg.moe_layers)} MoE, {cfg.num_layers - len(cfg.moe_layers)} dense)",
        f"hidden size          {cfg.hidden_size}",
        f"attention            {cfg.num_heads} query heads, {cfg.num_kv_heads} KV heads, head dim {cfg.head_dim}",
        f"experts              {cfg.num_experts} per layer, {cfg.num_experts_per_tok} active, "
        f"intermediate {cfg.moe_intermediate_size}, norm_topk_prob={cfg.norm_topk_prob}",
        f"vocabulary           {cfg.vocab_size}, tied embeddings: {cfg.tie_word_embeddings}",
        f"context              {cfg.max_position_embeddings} positions, rope {cfg.rope.kind} theta={cfg.rope.theta:g}",
        f"parameters           {_fmt_count(counts['total'])} total, {_fmt_count(counts['experts'])} in experts, "
        f"{_fmt_count(counts['non_expert'])} outside experts",
        f"active per token     {_fmt_count(counts['active'])}",
        f"checkpoint           {len(ckpt.entries)} tensors, {_fmt_bytes(ckpt.total_bytes)}",
    ]
    for dtype, nbytes in sorted(by_dtype.items()):
        lines.append(f"  {dtype:<18} {_fmt_bytes(nbytes)}")
    return "\n".join(lines)
