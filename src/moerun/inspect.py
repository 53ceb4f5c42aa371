"""``moerun inspect``: a checkpoint's architecture, parameter counts and bytes (HF folder or GGUF), no weights read."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from moerun.formats.safetensors_checkpoint import SafetensorsCheckpoint
from moerun.formats.gguf.metadata import model_config_from_file
from moerun.formats.gguf.reader import GGUFFile
from moerun.models.checkpoint import read_model_config
from moerun.models.gguf_checkpoint import is_gguf


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
    """A human-readable summary of a Hugging Face checkpoint folder or a GGUF file."""
    if is_gguf(path):
        return describe_gguf(path)
    cfg = read_model_config(path)
    ckpt = SafetensorsCheckpoint(path)
    by_dtype: Counter[str] = Counter()
    for entry in ckpt.entries.values():
        by_dtype[entry.dtype] += entry.nbytes
    lines = _model_lines(path, cfg)
    lines.append(f"checkpoint           {len(ckpt.entries)} tensors, {_fmt_bytes(ckpt.total_bytes)}")
    for dtype, nbytes in sorted(by_dtype.items()):
        lines.append(f"  {dtype:<18} {_fmt_bytes(nbytes)}")
    return "\n".join(lines)


def describe_gguf(path: str | Path) -> str:
    """Metadata, model shape, and tensor count and bytes per quant type of a GGUF file."""
    with GGUFFile(path) as f:
        cfg = model_config_from_file(f)
        lines = _model_lines(path, cfg)
        count: Counter[str] = Counter()
        nbytes: Counter[str] = Counter()
        for ti in f.tensors.values():
            count[ti.type_name] += 1
            nbytes[ti.type_name] += ti.nbytes
        total = sum(nbytes.values())
        lines.append(f"file                 GGUF v{f.version}, {len(f.paths)} part(s), {len(f.tensors)} tensors, "
                     f"{_fmt_bytes(total)} of tensor data")
        lines.append("tensor types         " + "  ".join(f"{t}: {count[t]} ({_fmt_bytes(nbytes[t])})"
                                                      for t in sorted(nbytes, key=lambda t: -nbytes[t])))
        lines.append("metadata")
        for key, value in f.metadata.items():
            lines.append(f"  {key:<44} {_short(value)}")
    return "\n".join(lines)


def _short(value: object) -> str:
    if isinstance(value, (list, tuple)) or hasattr(value, "shape"):
        n = len(value)
        return f"[{n} items]" if n > 8 else str(list(value))
    text = str(value)
    return text if len(text) <= 80 else text[:77].replace("\n", " ") + "..."


def _model_lines(path: str | Path, cfg) -> list[str]:
    counts = cfg.param_counts()
    return [
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
    ]
