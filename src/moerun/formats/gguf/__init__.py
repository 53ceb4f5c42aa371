"""GGUF files: a lazy memory-mapped reader, metadata and tensor-name mapping for qwen3moe, tokenizer, writer."""

from .metadata import gguf_metadata_for, model_config_from_file, model_config_from_gguf
from .names import gguf_to_hf, hf_to_gguf
from .reader import GGUFError, GGUFFile, TensorInfo
from .tokenizer import GGUFTokenizerSpec, tokenizer_from_file, tokenizer_from_gguf
from .type_mix import tensor_type

__all__ = [
    "GGUFError",
    "GGUFFile",
    "GGUFTokenizerSpec",
    "TensorInfo",
    "gguf_metadata_for",
    "gguf_to_hf",
    "hf_to_gguf",
    "model_config_from_file",
    "model_config_from_gguf",
    "tensor_type",
    "tokenizer_from_file",
    "tokenizer_from_gguf",
]
