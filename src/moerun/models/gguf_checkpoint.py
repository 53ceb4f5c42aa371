"""Opens a model from a GGUF file: config, tokenizer and weights all come from the file itself.

Float tensors (F32/F16/BF16) are copied into dense parameters; block-quantised tensors stay in their GGUF
blocks as QuantizedWeights inside the layers (see layers/quantized.py), read zero-copy from the memory map on
CPU and copied as blocks to a GPU.
"""

from __future__ import annotations

import warnings
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from moerun.config import ModelConfig
from moerun.formats.gguf.metadata import model_config_from_file
from moerun.formats.gguf.names import gguf_to_hf
from moerun.formats.gguf.reader import GGUFError, GGUFFile
from moerun.formats.gguf.tokenizer import tokenizer_from_file
from moerun.formats.quants import QuantizedTensor, QuantType
from moerun.layers.linear import shard_index_fn
from moerun.layers.quantized import QuantizedWeight, set_quantized
from moerun.models.loading import WeightLoadError, load_weights
from moerun.models.registry import get_model_class
from moerun.tokenizer import Tokenizer

if TYPE_CHECKING:
    from moerun.models.checkpoint import LoadedModel

_FLOAT_TYPES = {QuantType.F32, QuantType.F16, QuantType.BF16}


def is_gguf(path: str | Path) -> bool:
    path = Path(path)
    if path.is_file():
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    return False


def read_gguf_config(path: str | Path) -> ModelConfig:
    with GGUFFile(path) as f:
        return model_config_from_file(f)


def gguf_tokenizer(f: GGUFFile) -> Tokenizer:
    spec = tokenizer_from_file(f)
    backend = spec.tokenizer
    special = {"bos_token": _token(backend, spec.bos_token_id), "pad_token": _token(backend, spec.pad_token_id),
               "eos_token": _token(backend, spec.eos_token_ids[0] if spec.eos_token_ids else None)}
    return Tokenizer(backend=backend, eos_token_ids=tuple(spec.eos_token_ids), bos_token_id=spec.bos_token_id,
                     pad_token_id=spec.pad_token_id, add_bos=spec.add_bos, chat_template=spec.chat_template,
                     special_tokens=special)


def _token(backend, token_id: int | None) -> str | None:
    return backend.id_to_token(token_id) if token_id is not None else None


def load_gguf(path: str | Path, device: torch.device, dtype: torch.dtype, moe_backend: str | None) -> LoadedModel:
    """(model, tokenizer, config) of a GGUF file; quantised weights stay quantised."""
    from moerun.models.checkpoint import LoadedModel

    f = GGUFFile(path)
    try:
        config = model_config_from_file(f).with_dtype(dtype)
        tokenizer = gguf_tokenizer(f)
        model = _build(f, config, device, moe_backend)
    except BaseException:
        f.close()
        raise
    model.gguf_file = f  # CPU quantised weights view its memory map
    return LoadedModel(model, tokenizer, config)


def _build(f: GGUFFile, config: ModelConfig, device: torch.device, moe_backend: str | None) -> nn.Module:
    cls = get_model_class(config.architecture)
    with torch.device("meta"):
        model = cls(config, moe_backend=moe_backend)
    model = model.to(dtype=config.dtype)
    sources: dict[str, list[tuple[object, str]]] = defaultdict(list)  # param -> [(shard id, gguf name)]
    for name in f.tensors:
        target = model.map_checkpoint_name(gguf_to_hf(name))
        if target is None:
            continue
        sources[target[0]].append((target[1], name))
    params = dict(model.named_parameters())
    unknown = [n for p, lst in sources.items() if p not in params for _, n in lst]
    if unknown:
        raise WeightLoadError(f"{f.path}: tensors {unknown[:5]} match no parameter of {config.architecture}")
    quantized = {p for p, lst in sources.items()
                 if any(f.tensors[n].ggml_type not in _FLOAT_TYPES for _, n in lst)}
    for pname, param in params.items():
        module_name, _, attr = pname.rpartition(".")
        module = model.get_submodule(module_name)
        if pname in quantized:
            set_quantized(module, attr, _quantized_weight(f, model, pname, param, sources[pname], device))
            module.__dict__["compute_dtype"] = config.dtype
        else:
            setattr(module, attr, nn.Parameter(torch.empty(param.shape, dtype=config.dtype, device=device),
                                               requires_grad=False))
    if config.tie_word_embeddings:
        q = model.model.embed_tokens.__dict__.get("q_weight")
        if q is not None:
            set_quantized(model.lm_head, "weight", q)
        else:
            model.lm_head.weight = model.model.embed_tokens.weight
    dense = [(gguf_to_hf(n), n) for p, lst in sources.items() if p not in quantized for _, n in lst]
    load_weights(model, _float_tensors(f, dense), source=str(f.path))
    if device.type == "cuda":
        from moerun.ops.quant import pack_model

        # The kernels' layout, made once before any CUDA graph is captured; the GGUF blocks are then dropped
        # (embedding tables' too: their lookups decode rows of the repacked copy), so the weights take about the
        # file's size on the GPU.
        pack_model(model, release_blocks=True)
    return model.eval()


def _float_tensors(f: GGUFFile, names: list[tuple[str, str]]) -> Iterator[tuple[str, torch.Tensor]]:
    for hf_name, gguf_name in names:
        yield hf_name, f.tensor(gguf_name)


def _quantized_weight(f: GGUFFile, model: nn.Module, pname: str, param: torch.Tensor,
                      parts: list[tuple[object, str]], device: torch.device) -> QuantizedWeight:
    """Orders a parameter's GGUF tensors by the rows they fill and checks that they cover it exactly."""
    module_name, _, attr = pname.rpartition(".")
    index_of = shard_index_fn(model.get_submodule(module_name), attr)
    placed = []
    for shard, name in parts:
        rows = index_of(shard)
        row_slice = rows[-1] if rows else slice(None)  # the rows this tensor fills
        start = row_slice.start or 0
        ti = f.tensors[name]
        expected = tuple(param[rows].shape) if rows else tuple(param.shape)
        if ti.shape != expected:
            raise WeightLoadError(f"{f.path}: tensor {name!r} has shape {list(ti.shape)}, expected {list(expected)}")
        placed.append((start, name, ti))
    placed.sort()
    covered = sum(ti.shape[-2] if len(ti.shape) > 1 else ti.shape[0] for _, _, ti in placed)
    rows_needed = param.shape[-2] if param.dim() > 1 else param.shape[0]
    if covered != rows_needed or len({s for s, _, _ in placed}) != len(placed):
        raise WeightLoadError(f"{f.path}: tensors {[n for _, n, _ in placed]} do not fill {pname} exactly "
                              f"(rows {covered} of {rows_needed})")
    qparts = []
    for _, name, ti in placed:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # the map is read-only; the blocks are never written
            raw = torch.from_numpy(f.tensor_bytes(name))
        if device.type != "cpu":
            raw = raw.to(device)
        try:
            qparts.append(QuantizedTensor(raw, int(ti.ggml_type), ti.shape, name))
        except ValueError as exc:
            raise GGUFError(f"{f.path}: {exc}") from None
    return QuantizedWeight(qparts)
