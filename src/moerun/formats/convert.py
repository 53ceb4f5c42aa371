"""``moerun quantize``: an HF checkpoint or a GGUF file -> a qwen3moe GGUF of the chosen type mix."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from moerun.config import ModelConfig
from moerun.formats.gguf.metadata import model_config_from_file
from moerun.formats.gguf.names import gguf_to_hf
from moerun.formats.gguf.reader import GGUFFile
from moerun.formats.gguf.writer import write_gguf
from moerun.formats.quants import QuantType, dequantize
from moerun.formats.safetensors_checkpoint import SafetensorsCheckpoint

QUANTIZE_TYPES = ("Q8_0", "Q6_K", "Q5_K_M", "Q4_K_M", "Q3_K_M", "Q2_K", "Q4_0", "IQ4_XS", "IQ4_NL", "IQ3_M",
                  "IQ3_S", "IQ3_XS", "MXFP4_MOE", "TQ2_0", "TQ1_0", "F16", "BF16", "F32")


def quantize_model(src: str | Path, out: str | Path, ftype: str, progress: bool = True) -> list[Path]:
    """Writes ``out`` from ``src`` (HF folder or GGUF); returns the written file paths."""
    from moerun.models.gguf_checkpoint import is_gguf

    if ftype not in QUANTIZE_TYPES:
        raise ValueError(f"unknown type {ftype!r}; choose one of {', '.join(QUANTIZE_TYPES)}")
    src, out = Path(src), Path(out)
    if not src.exists():
        raise FileNotFoundError(f"model path {src} does not exist")
    if out.exists() and out.resolve() == src.resolve():
        raise ValueError(f"{out}: the output would overwrite the source")
    if is_gguf(src):
        with GGUFFile(src) as f:
            config = model_config_from_file(f)
            kv = {k: (v, *f.value_types[k]) for k, v in f.metadata.items() if k.startswith("tokenizer.")}
            return write_gguf(out, config, _dequantized(f), ftype=ftype, tokenizer_kv=kv, progress=progress)
    config = ModelConfig.from_json_file(src / "config.json")
    tensors = SafetensorsCheckpoint(src).iter_tensors()
    return write_gguf(out, config, tensors, ftype=ftype, tokenizer_dir=src, progress=progress)


def _dequantized(f: GGUFFile) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of a GGUF as float32 under its HF name (re-quantising starts from the decoded values)."""
    for name, ti in f.tensors.items():
        raw = torch.from_numpy(np.array(f.tensor_bytes(name)))
        yield gguf_to_hf(name), dequantize(raw, QuantType(int(ti.ggml_type)), ti.shape)
