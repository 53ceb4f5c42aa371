"""Write a ``qwen3moe`` GGUF file: metadata from a ModelConfig, the tokenizer of a Hugging Face folder, and
tensors quantized one at a time by the llama.cpp type mix.

Tensors arrive as an iterable of (canonical Hugging Face name, float array). GGUF puts every tensor's shape and
type before the data, so each tensor is quantized as it arrives and its bytes go to a scratch file next to the
output; the real file(s) are written once all tensors are known. Memory stays at about one tensor (one layer's
experts when they come one expert at a time), disk needs the output size twice while writing.
"""

from __future__ import annotations

import json
import mmap
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import torch
from gguf import GGUFWriter, SpecialVocab
from gguf.constants import GGML_QUANT_VERSION, GGMLQuantizationType, GGUFValueType, LlamaFileType, TokenType
from gguf.gguf_writer import GGUFValue
from tqdm import tqdm

from ...config import ModelConfig
from ..quants import quantize
from .metadata import gguf_metadata_for
from .names import gguf_layer, gguf_to_hf, hf_to_gguf, parse_expert_name, parse_fused_gate_up
from .reader import tensor_nbytes
from .tokenizer import QWEN2_PRE_REGEX
from .type_mix import file_type, tensor_type

ARCH = "qwen3moe"
_EXPS = {"gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps"}
# Hugging Face buffers that are not weights
_SKIP_SUFFIXES = ("rotary_emb.inv_freq",)


def quantize_tensor(array: np.ndarray, qtype: GGMLQuantizationType, name: str) -> np.ndarray:
    """The GGUF bytes of a float32 array [..., row] in ``qtype`` (the single quantization hook of the writer)."""
    return quantize(array, int(qtype), name).reshape(-1)


@dataclass
class _Planned:
    name: str
    shape: tuple[int, ...]
    qtype: GGMLQuantizationType
    offset: int  # in the scratch file
    nbytes: int


def write_gguf(path: str | os.PathLike[str], config: ModelConfig,
               tensors: Iterable[tuple[str, np.ndarray | torch.Tensor]], *, ftype: str | LlamaFileType = "Q8_0",
               tokenizer_dir: str | os.PathLike[str] | None = None, alignment: int = 32, split_max_size: int = 0,
               split_max_tensors: int = 0, name: str | None = None, progress: bool = True,
               tokenizer_kv: dict[str, tuple[Any, GGUFValueType, GGUFValueType | None]] | None = None) -> list[Path]:
    """Write a qwen3moe GGUF (split into ``-0000K-of-0000N.gguf`` parts past the split limits); returns the paths.

    The tokenizer comes from an HF folder (``tokenizer_dir``) or, when re-quantising a GGUF, from the source
    file's ``tokenizer.*`` keys given as ``tokenizer_kv`` (key -> (value, type, element type)).
    """
    path = Path(path)
    ft = file_type(ftype)
    writer = GGUFWriter(path, ARCH, split_max_tensors=split_max_tensors, split_max_size=split_max_size)
    if alignment != 32:
        writer.add_custom_alignment(alignment)
    for key, value in gguf_metadata(config, int(ft), name, tokenizer_dir).items():
        if tokenizer_kv and key.startswith("tokenizer."):
            continue
        writer.add_key_value(key, value.value, value.type, value.sub_type)
    for key, (value, vtype, etype) in (tokenizer_kv or {}).items():
        if isinstance(value, np.ndarray):
            value = value.tolist()
        writer.add_key_value(key, value, vtype, etype)
    scratch = path.with_name(path.name + ".tensors.tmp")
    paths: list[Path] = []
    try:
        plan = _quantize_all(scratch, config, tensors, ft, progress)
        for p in plan:
            writer.add_tensor_info(p.name, p.shape, np.dtype(np.float32), p.nbytes, raw_dtype=p.qtype)
        paths = writer.format_shard_names(path)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        _copy_data(writer, scratch, plan, progress)
    except BaseException:
        writer.close()
        for p in paths:  # no half-written model files
            p.unlink(missing_ok=True)
        raise
    finally:
        writer.close()
        scratch.unlink(missing_ok=True)
    return paths


def gguf_metadata(config: ModelConfig, ftype: int, name: str | None = None,
                  tokenizer_dir: str | os.PathLike[str] | None = None) -> dict[str, GGUFValue]:
    """Every metadata key/value of the file but ``general.architecture`` (written by GGUFWriter itself)."""
    rec = GGUFWriter(None, ARCH)  # used only as a typed key/value recorder
    for key, value in gguf_metadata_for(config).items():
        if key not in ("general.architecture", "general.file_type"):  # the writer's own values follow
            _add_typed(rec, key, value)
    rec.add_key_value("general.file_type", ftype, GGUFValueType.UINT32)
    rec.add_key_value("general.quantization_version", GGML_QUANT_VERSION, GGUFValueType.UINT32)
    if name:
        rec.add_key_value("general.name", name, GGUFValueType.STRING)
    md = dict(rec.kv_data[0])
    if tokenizer_dir is not None:
        tok = GGUFWriter(None, ARCH)
        add_hf_tokenizer(tok, tokenizer_dir, config.vocab_size)
        md.update(tok.kv_data[0])  # the tokenizer folder's special ids win, as in llama.cpp's converter
    md.pop("general.architecture", None)
    return md


def _add_typed(w: GGUFWriter, key: str, value: Any) -> None:
    # llama.cpp reads these keys as uint32 / float32 / bool / string
    if isinstance(value, bool):
        w.add_key_value(key, value, GGUFValueType.BOOL)
    elif isinstance(value, int):
        if not 0 <= value < 2**32:
            raise ValueError(f"metadata {key!r} = {value} does not fit a UINT32")
        w.add_key_value(key, value, GGUFValueType.UINT32)
    elif isinstance(value, float):
        w.add_key_value(key, value, GGUFValueType.FLOAT32)
    elif isinstance(value, str):
        w.add_key_value(key, value, GGUFValueType.STRING)
    else:
        raise TypeError(f"metadata {key!r}: cannot write a {type(value).__name__}")


# ---- tokenizer ----
def _looks_special(token: str) -> bool:
    # llama.cpp's does_token_look_special: added tokens some models forget to mark special
    return (token in ("<pad>", "<mask>", "<2mass>", "[@BOS@]")
            or (token.startswith("<|") and token.endswith("|>"))
            or (token.startswith("<｜") and token.endswith("｜>"))
            or (token.startswith("<unused") and token.endswith(">")))


def _vocab(tj: dict[str, Any], vocab_size: int | None, tokenizer_dir: Path) -> tuple[list[str], list[int]]:
    model = tj.get("model") or {}
    if model.get("type") != "BPE":
        raise ValueError(f"{tokenizer_dir}: tokenizer.json model is {model.get('type')!r}; expected BPE")
    by_id: dict[int, str] = {int(i): t for t, i in model["vocab"].items()}
    added: dict[int, bool] = {}
    for a in tj.get("added_tokens", []):
        by_id[int(a["id"])] = a["content"]
        added[int(a["id"])] = bool(a.get("special"))
    n = max(by_id) + 1
    if vocab_size is not None:
        if vocab_size < n:
            raise ValueError(f"{tokenizer_dir}: the tokenizer uses ids up to {n - 1} but the model has only "
                             f"{vocab_size} embedding rows")
        n = vocab_size
    tokens: list[str] = []
    types: list[int] = []
    for i in range(n):
        tok = by_id.get(i)
        if tok is None:
            tokens.append(f"[PAD{i}]")
            types.append(TokenType.UNUSED)
        elif i in added:
            special = added[i] or _looks_special(tok)
            tokens.append(tok if special else tok.replace("\u2581", " "))
            types.append(TokenType.CONTROL if special else TokenType.USER_DEFINED)
        else:
            tokens.append(tok)
            types.append(TokenType.NORMAL)
    return tokens, [int(t) for t in types]


def _tokenizer_json(d: Path) -> dict[str, Any]:
    f = d / "tokenizer.json"
    if not f.is_file():
        raise FileNotFoundError(f"no tokenizer.json in {d}")
    with open(f, encoding="utf-8") as fh:
        return json.load(fh)


def _pre_tokenizer_name(tj: dict[str, Any], where: Path) -> str:
    """'qwen2' when tokenizer.json splits with the Qwen2 regex; moerun writes no other pre-tokenizer."""
    pre = tj.get("pre_tokenizer") or {}
    for p in pre.get("pretokenizers", [pre]):
        if p.get("type") == "Split" and (p.get("pattern") or {}).get("Regex") == QWEN2_PRE_REGEX:
            return "qwen2"
    raise ValueError(f"{where}: the tokenizer.json pre-tokenizer is not the Qwen2 one; moerun writes only "
                     f"tokenizer.ggml.pre = 'qwen2'")


def add_hf_tokenizer(w: GGUFWriter, tokenizer_dir: str | os.PathLike[str], vocab_size: int | None = None) -> None:
    """Add ``tokenizer.ggml.*`` and the chat template from a Hugging Face tokenizer folder, as llama.cpp does."""
    d = Path(tokenizer_dir)
    tj = _tokenizer_json(d)
    tokens, types = _vocab(tj, vocab_size, d)
    w.add_key_value("tokenizer.ggml.model", "gpt2", GGUFValueType.STRING)
    w.add_key_value("tokenizer.ggml.pre", _pre_tokenizer_name(tj, d), GGUFValueType.STRING)
    w.add_key_value("tokenizer.ggml.tokens", tokens, GGUFValueType.ARRAY, GGUFValueType.STRING)
    w.add_key_value("tokenizer.ggml.token_type", types, GGUFValueType.ARRAY, GGUFValueType.INT32)
    # merges, special ids, add_bos/add_eos and the chat template, read the way the converter reads them
    SpecialVocab(d, load_merges=True, n_vocab=len(tokens)).add_to_gguf(w, quiet=True)


# ---- tensors ----
def _f32(x: np.ndarray | torch.Tensor) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        return x.detach().to(device="cpu", dtype=torch.float32).contiguous().numpy()
    return np.ascontiguousarray(x, dtype=np.float32)


class _Quantizer:
    """Turns canonical HF tensors into GGUF tensors, quantized and appended to a scratch file."""

    def __init__(self, out: BinaryIO, config: ModelConfig, ftype: LlamaFileType) -> None:
        self.out, self.config, self.ftype = out, config, ftype
        self.plan: list[_Planned] = []
        self.names: set[str] = set()
        self.pending: dict[tuple[int, str], dict[int, np.ndarray]] = {}
        self.expert_shape: dict[tuple[int, str], tuple[int, ...]] = {}

    def type_of(self, gguf_name: str, shape: tuple[int, ...]) -> GGMLQuantizationType:
        c = self.config
        return tensor_type(gguf_name, shape, self.ftype, gguf_layer(gguf_name), c.num_layers, c.num_experts,
                           n_gqa=c.num_heads // c.num_kv_heads, tied_embeddings=c.tie_word_embeddings)

    def emit(self, gguf_name: str, shape: tuple[int, ...], qtype: GGMLQuantizationType, data: np.ndarray) -> None:
        if gguf_name in self.names:
            raise ValueError(f"tensor {gguf_name} ({gguf_to_hf(gguf_name)}) was given more than once")
        self.names.add(gguf_name)
        nbytes = tensor_nbytes(shape, qtype)
        if data.nbytes != nbytes:
            raise AssertionError(f"{gguf_name}: quantized to {data.nbytes} bytes, expected {nbytes}")
        offset = self.out.tell()
        data.tofile(self.out)
        self.plan.append(_Planned(gguf_name, shape, qtype, offset, nbytes))

    def add(self, hf_name: str, value: np.ndarray | torch.Tensor) -> None:
        if hf_name.endswith(_SKIP_SUFFIXES):
            return
        c = self.config
        if hf_name == "lm_head.weight" and c.tie_word_embeddings:
            return  # tied: llama.cpp reuses token_embd
        if (expert := parse_expert_name(hf_name)) is not None:
            self.add_expert(*expert, _f32(value), hf_name)
            return
        if (layer := parse_fused_gate_up(hf_name)) is not None:
            x = _f32(value)
            if x.ndim != 3 or x.shape[1] % 2:
                raise ValueError(f"{hf_name}: expected [experts, 2*intermediate, hidden], got {list(x.shape)}")
            half = x.shape[1] // 2
            self.add_stacked(f"model.layers.{layer}.mlp.experts.gate_proj", x[:, :half])
            self.add_stacked(f"model.layers.{layer}.mlp.experts.up_proj", x[:, half:])
            return
        self.add_stacked(hf_name, _f32(value))

    def add_stacked(self, hf_name: str, x: np.ndarray) -> None:
        gguf_name = hf_to_gguf(hf_name)
        layer = gguf_layer(gguf_name)
        if layer is not None and layer >= self.config.num_layers:
            raise ValueError(f"{hf_name}: layer {layer} is out of range for a {self.config.num_layers}-layer model")
        if "_exps." in gguf_name and x.shape[0] != self.config.num_experts:
            raise ValueError(f"{hf_name}: {x.shape[0]} experts stacked, config has {self.config.num_experts}")
        shape = tuple(x.shape)
        qtype = self.type_of(gguf_name, shape)
        self.emit(gguf_name, shape, qtype, quantize_tensor(x, qtype, gguf_name))

    def add_expert(self, layer: int, expert: int, proj: str, x: np.ndarray, hf_name: str) -> None:
        c = self.config
        if layer >= c.num_layers or expert >= c.num_experts:
            raise ValueError(f"{hf_name}: layer {layer} / expert {expert} out of range for {c.num_layers} layers, "
                             f"{c.num_experts} experts")
        key = (layer, proj)
        shape = self.expert_shape.setdefault(key, tuple(x.shape))
        if tuple(x.shape) != shape or x.ndim != 2:
            raise ValueError(f"{hf_name}: shape {list(x.shape)} differs from the layer's other experts {list(shape)}")
        gguf_name = f"blk.{layer}.{_EXPS[proj]}.weight"
        stacked = (c.num_experts, *shape)
        qtype = self.type_of(gguf_name, stacked)
        # rows are quantized independently, so an expert's bytes are its slice of the stacked tensor's bytes
        group = self.pending.setdefault(key, {})
        if expert in group:
            raise ValueError(f"{hf_name}: given twice")
        group[expert] = quantize_tensor(x, qtype, gguf_name)
        if len(group) == c.num_experts:
            data = np.concatenate([group[e] for e in range(c.num_experts)])
            del self.pending[key]
            self.emit(gguf_name, stacked, qtype, data)

    def finish(self) -> list[_Planned]:
        if self.pending:
            (layer, proj), group = next(iter(self.pending.items()))
            missing = sorted(set(range(self.config.num_experts)) - set(group))
            raise ValueError(f"layer {layer} {proj}: experts {missing[:10]}{'...' if len(missing) > 10 else ''} "
                             f"were never given")
        names = self.names
        if not self.config.tie_word_embeddings and "output.weight" not in names and "token_embd.weight" in names:
            raise ValueError("the config has untied embeddings but no lm_head.weight was given")

        # llama.cpp's order: token_embd, then layer by layer, then output_norm / output
        def order(p: _Planned) -> tuple[int, str]:
            layer = gguf_layer(p.name)
            return (-1 if p.name == "token_embd.weight" else layer if layer is not None else 1 << 30, p.name)
        return sorted(self.plan, key=order)


def _quantize_all(scratch: Path, config: ModelConfig, tensors: Iterable[tuple[str, Any]], ftype: LlamaFileType,
                  progress: bool) -> list[_Planned]:
    with open(scratch, "wb") as out:
        q = _Quantizer(out, config, ftype)
        for hf_name, value in tqdm(tensors, desc="quantizing", unit="tensor", disable=not progress):
            q.add(hf_name, value)
        return q.finish()


def _copy_data(writer: GGUFWriter, scratch: Path, plan: list[_Planned], progress: bool) -> None:
    if not plan:
        return
    with open(scratch, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        bar = tqdm(total=sum(p.nbytes for p in plan), desc="writing", unit="B", unit_scale=True,
                   disable=not progress)
        for p in plan:
            view = np.frombuffer(mm, dtype=np.uint8, count=p.nbytes, offset=p.offset)
            try:
                writer.write_tensor_data(view)
            finally:
                del view  # the map cannot close while a view exports it
            bar.update(p.nbytes)
        bar.close()
