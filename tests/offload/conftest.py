"""Fixtures of the offloading tests: small seeded checkpoints (HF float32 and GGUF) with a small tokenizer. Their
shapes and the prompts live in offload_common.py, which the test modules import (every test folder's conftest is a
module named "conftest", so which one ``from conftest import`` finds depends on the folders a run collects).

Without CUDA, Triton kernels (zero-copy offloading on the Triton backend) run in Triton's interpreter, which must be
switched on before triton is imported.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from helpers import build_checkpoint, write_small_tokenizer  # noqa: E402
from moerun.config import ModelConfig  # noqa: E402
from moerun.formats.gguf.writer import write_gguf  # noqa: E402
from moerun.formats.safetensors_checkpoint import SafetensorsCheckpoint  # noqa: E402
from offload_common import GGUF_SHAPE, SHAPE  # noqa: E402


@pytest.fixture(scope="session")
def hf_model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("offload-hf")
    build_checkpoint(folder, seed=11, **SHAPE)
    write_small_tokenizer(folder)
    return folder


@pytest.fixture(scope="session")
def gguf_model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("offload-gguf")
    build_checkpoint(folder, seed=12, **GGUF_SHAPE)
    write_small_tokenizer(folder)
    config = ModelConfig.from_json_file(folder / "config.json")
    return write_gguf(folder / "m.gguf", config, SafetensorsCheckpoint(folder).iter_tensors(), ftype="Q4_K_M",
                      tokenizer_dir=folder, progress=False)[0]
