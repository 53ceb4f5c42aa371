"""Opens a model from disk: a Hugging Face folder (config.json + safetensors + tokenizer) or a GGUF file."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from moerun.config import ModelConfig
from moerun.formats.safetensors_checkpoint import SafetensorsCheckpoint
from moerun.models.gguf_checkpoint import is_gguf, load_gguf, read_gguf_config
from moerun.models.loading import build_empty_model, load_weights
from moerun.tokenizer import Tokenizer

_PROGRESS_MIN_BYTES = 256 * 2**20


@dataclass
class LoadedModel:
    model: nn.Module
    tokenizer: Tokenizer
    config: ModelConfig


def resolve_dtype(config_dtype: torch.dtype, requested: torch.dtype | None, device: torch.device) -> torch.dtype:
    """The requested dtype, else the checkpoint's on CUDA and float32 on CPU."""
    if requested is not None:
        return requested
    return config_dtype if device.type == "cuda" else torch.float32


def read_model_config(path: str | Path) -> ModelConfig:
    """The model config of a checkpoint folder or GGUF file, read without touching the weights."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"model path {path} does not exist")
    if is_gguf(path):
        return read_gguf_config(path)
    if path.is_file():
        raise ValueError(f"{path}: expected a GGUF file or a Hugging Face checkpoint folder "
                         "(config.json + *.safetensors)")
    return ModelConfig.from_json_file(path / "config.json")


def load_checkpoint(
    path: str | Path,
    device: torch.device,
    dtype: torch.dtype | None = None,
    moe_backend: str | None = None,
    progress: bool = True,
) -> LoadedModel:
    """Reads config, tokenizer and weights; raises a clear error and returns nothing if any part is wrong."""
    path = Path(path)
    config = read_model_config(path)
    if is_gguf(path):
        return load_gguf(path, device, resolve_dtype(config.dtype, dtype, device), moe_backend)
    config = config.with_dtype(resolve_dtype(config.dtype, dtype, device))
    tokenizer = Tokenizer.from_folder(path)
    checkpoint = SafetensorsCheckpoint(path)
    model = build_empty_model(config, device, moe_backend)
    show = progress and checkpoint.total_bytes >= _PROGRESS_MIN_BYTES
    load_weights(model, checkpoint.iter_tensors(progress=show), source=str(path))
    return LoadedModel(model, tokenizer, config)
