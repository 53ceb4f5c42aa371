"""Hugging Face safetensors checkpoints, single-file or sharded, read lazily through memory maps.

Every shard's header is parsed and checked against its file size before any tensor is read, so a truncated or
corrupt file is reported up front, by name. Pickle-based files are never opened.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

_DTYPE_SIZES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
                "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}
_MAX_HEADER = 100 * 1024 * 1024


class CheckpointError(ValueError):
    """A checkpoint file is missing, truncated or malformed; the message names the file."""


@dataclass(frozen=True)
class TensorEntry:
    file: Path
    dtype: str
    shape: tuple[int, ...]
    nbytes: int


def _read_header(path: Path) -> dict[str, TensorEntry]:
    """Parses and validates one .safetensors header: tensor name -> entry."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw_len = f.read(8)
        if len(raw_len) < 8:
            raise CheckpointError(f"{path}: file too short for a safetensors header ({size} bytes)")
        (header_len,) = struct.unpack("<Q", raw_len)
        if header_len > min(_MAX_HEADER, size - 8):
            raise CheckpointError(
                f"{path}: header length {header_len} exceeds the file ({size} bytes): truncated or not safetensors"
            )
        try:
            header = json.loads(f.read(header_len))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise CheckpointError(f"{path}: corrupt safetensors header ({exc})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: corrupt safetensors header (not a JSON object)")
    data_size = size - 8 - header_len
    entries, end_max = {}, 0
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = info["dtype"], tuple(int(d) for d in info["shape"]), info["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{path}: malformed header entry for tensor {name!r}") from None
        if dtype not in _DTYPE_SIZES:
            raise CheckpointError(f"{path}: tensor {name!r} has unsupported dtype {dtype}")
        nbytes = _DTYPE_SIZES[dtype]
        for d in shape:
            nbytes *= d
        if not 0 <= begin <= end or end - begin != nbytes:
            raise CheckpointError(f"{path}: tensor {name!r} has inconsistent data offsets {[begin, end]}")
        if end > data_size:
            raise CheckpointError(
                f"{path}: tensor {name!r} ends at byte {end} of the data but the file holds only {data_size}: "
                "the file is truncated"
            )
        end_max = max(end_max, end)
        entries[name] = TensorEntry(path, dtype, shape, nbytes)
    return entries


class SafetensorsCheckpoint:
    """The tensors of a checkpoint folder (``model.safetensors`` or ``model.safetensors.index.json`` + shards)."""

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)
        files = self._shard_files()
        self.entries: dict[str, TensorEntry] = {}
        for path in files:
            for name, entry in _read_header(path).items():
                if name in self.entries:
                    raise CheckpointError(f"{path}: tensor {name!r} also appears in {self.entries[name].file}")
                self.entries[name] = entry
        self._check_index(files)

    def _shard_files(self) -> list[Path]:
        index = self.folder / "model.safetensors.index.json"
        if index.exists():
            try:
                self.weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as exc:
                raise CheckpointError(f"{index}: not a valid safetensors index ({exc})") from None
            files = sorted({self.folder / f for f in self.weight_map.values()})
            for f in files:
                if not f.exists():
                    raise CheckpointError(f"{index}: shard {f.name} is listed but missing")
            return files
        self.weight_map = {}
        single = self.folder / "model.safetensors"
        if single.exists():
            return [single]
        found = sorted(self.folder.glob("*.safetensors"))
        if found:
            return found
        if any(self.folder.glob("*.bin")) or any(self.folder.glob("*.pt")):
            raise CheckpointError(
                f"{self.folder}: only pickle-based weights (.bin/.pt) found; moerun reads safetensors only "
                "(convert with transformers' save_pretrained(safe_serialization=True))"
            )
        raise CheckpointError(f"{self.folder}: no .safetensors files found")

    def _check_index(self, files: list[Path]) -> None:
        for name, fname in self.weight_map.items():
            entry = self.entries.get(name)
            if entry is None:
                raise CheckpointError(f"{self.folder}: index lists tensor {name!r} in {fname}, which lacks it")
            if entry.file.name != Path(fname).name:
                raise CheckpointError(f"{self.folder}: index puts {name!r} in {fname}, found in {entry.file.name}")

    @property
    def total_bytes(self) -> int:
        return sum(e.nbytes for e in self.entries.values())

    def names(self) -> list[str]:
        return list(self.entries)

    def iter_tensors(self, progress: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
        """Yields (name, tensor) file by file; tensors are views of the memory map until copied."""
        by_file: dict[Path, list[str]] = {}
        for name, entry in self.entries.items():
            by_file.setdefault(entry.file, []).append(name)
        bar = None
        if progress:
            from tqdm import tqdm

            bar = tqdm(total=self.total_bytes, unit="B", unit_scale=True, desc="loading weights")
        try:
            for path, names in by_file.items():
                try:
                    handle = safe_open(str(path), framework="pt")
                except Exception as exc:  # safetensors raises its own error types
                    raise CheckpointError(f"{path}: cannot open ({exc})") from None
                for name in names:
                    try:
                        tensor = handle.get_tensor(name)
                    except Exception as exc:
                        raise CheckpointError(f"{path}: cannot read tensor {name!r} ({exc})") from None
                    yield name, tensor
                    if bar is not None:
                        bar.update(self.entries[name].nbytes)
        finally:
            if bar is not None:
                bar.close()
