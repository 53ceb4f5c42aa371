"""GGUF reader: a memory-mapped, lazy parser for GGUF v2/v3 files (little-endian), split files included.

Opening a file parses only the header, the metadata and the tensor infos; tensor data stay on disk until a
caller asks for them (``tensor_bytes`` / ``tensor`` return views of the memory map). Every length, count and
offset is checked against the file size before anything is allocated, so a damaged file raises
:class:`GGUFError` instead of crashing, hanging or exhausting memory.
"""

from __future__ import annotations

import mmap
import os
import re
import struct
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_NAME_BYTES = 63  # ggml stores names in char[GGML_MAX_NAME = 64], NUL included
MAX_ARRAY_NESTING = 8

Q = GGMLQuantizationType
SUPPORTED_TYPES: frozenset[GGMLQuantizationType] = frozenset({
    Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K,
    Q.IQ4_NL, Q.IQ4_XS, Q.IQ2_XXS, Q.IQ2_XS, Q.IQ2_S, Q.IQ3_XXS, Q.IQ3_S, Q.IQ1_S, Q.IQ1_M, Q.TQ1_0, Q.TQ2_0,
    Q.MXFP4, Q.NVFP4,
})
_FLOAT_TORCH = {Q.F32: torch.float32, Q.F16: torch.float16, Q.BF16: torch.bfloat16}

V = GGUFValueType
# struct format and size of each fixed-size value type
_SCALAR = {
    V.UINT8: struct.Struct("<B"), V.INT8: struct.Struct("<b"),
    V.UINT16: struct.Struct("<H"), V.INT16: struct.Struct("<h"),
    V.UINT32: struct.Struct("<I"), V.INT32: struct.Struct("<i"),
    V.UINT64: struct.Struct("<Q"), V.INT64: struct.Struct("<q"),
    V.FLOAT32: struct.Struct("<f"), V.FLOAT64: struct.Struct("<d"),
    V.BOOL: struct.Struct("<B"),
}
_NUMPY = {
    V.UINT8: "<u1", V.INT8: "<i1", V.UINT16: "<u2", V.INT16: "<i2", V.UINT32: "<u4", V.INT32: "<i4",
    V.UINT64: "<u8", V.INT64: "<i8", V.FLOAT32: "<f4", V.FLOAT64: "<f8",
}
# the fewest bytes one array element of each type can take: bounds counts before allocating
_MIN_ELEMENT_BYTES = {**{t: s.size for t, s in _SCALAR.items()}, V.STRING: 8, V.ARRAY: 12}
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")

_SPLIT_NAME = re.compile(r"^(?P<prefix>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")
SPLIT_COUNT_KEY = "split.count"
SPLIT_NO_KEY = "split.no"
SPLIT_TENSORS_KEY = "split.tensors.count"


class GGUFError(ValueError):
    """A GGUF file is malformed or uses something moerun does not support."""


@dataclass(frozen=True)
class TensorInfo:
    """One tensor: shape in row-major torch order (reversed ggml ``ne``), type, absolute data offset and size."""

    name: str
    shape: tuple[int, ...]
    ggml_type: GGMLQuantizationType
    offset: int  # absolute byte offset of the data in its file
    nbytes: int
    part: int = 0  # index of the split file holding the data

    @property
    def n_elements(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def type_name(self) -> str:
        return self.ggml_type.name


def tensor_nbytes(shape: tuple[int, ...], ggml_type: GGMLQuantizationType) -> int:
    """Bytes taken by a tensor of ``shape`` (torch order) in ``ggml_type``: rows of whole blocks."""
    block, type_size = GGML_QUANT_SIZES[ggml_type]
    n = 1
    for d in shape:
        n *= d
    return n // block * type_size


@dataclass
class _Part:
    path: Path
    mm: mmap.mmap | None
    version: int
    metadata: dict[str, Any]
    value_types: dict[str, tuple[GGUFValueType, GGUFValueType | None]]
    tensors: list[TensorInfo]
    alignment: int
    data_start: int


class _Parser:
    """Bounds-checked sequential reads from one memory-mapped GGUF file."""

    def __init__(self, path: Path, buf: mmap.mmap) -> None:
        self.path = path
        self.buf = buf
        self.size = len(buf)
        self.pos = 0

    def fail(self, msg: str) -> GGUFError:
        return GGUFError(f"{self.path}: {msg}")

    def need(self, n: int, what: str) -> None:
        if self.pos + n > self.size:
            raise self.fail(
                f"truncated file: {what} at byte {self.pos} needs {n} bytes but only {self.size - self.pos} remain "
                f"(file size {self.size})"
            )

    def u32(self, what: str) -> int:
        self.need(4, what)
        v = _U32.unpack_from(self.buf, self.pos)[0]
        self.pos += 4
        return v

    def u64(self, what: str) -> int:
        self.need(8, what)
        v = _U64.unpack_from(self.buf, self.pos)[0]
        self.pos += 8
        return v

    def string(self, what: str) -> str:
        start = self.pos
        n = self.u64(f"length of {what}")
        self.need(n, f"{what} ({n} bytes)")
        raw = self.buf[self.pos:self.pos + n]
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise self.fail(f"{what} at byte {start} is not valid UTF-8 ({exc.reason} at byte {exc.start})") from None

    def check_count(self, count: int, min_bytes: int, what: str) -> None:
        # a count is only plausible if that many minimal items fit in the rest of the file
        remaining = self.size - self.pos
        if count * min_bytes > remaining:
            raise self.fail(
                f"{what} is {count}, which cannot fit: at least {count * min_bytes} bytes are needed but only "
                f"{remaining} remain after byte {self.pos} (the file is truncated or the count is corrupt)"
            )

    def value_type(self, what: str) -> GGUFValueType:
        at = self.pos
        raw = self.u32(what)
        try:
            return GGUFValueType(raw)
        except ValueError:
            known = ", ".join(f"{t.value}={t.name}" for t in GGUFValueType)
            raise self.fail(f"{what} at byte {at} is {raw}, which is not a GGUF value type (expected one of {known})") \
                from None

    def value(self, vtype: GGUFValueType, what: str, depth: int = 0) -> tuple[Any, GGUFValueType | None]:
        """Read one value; returns it and, for arrays, the element type."""
        if vtype == V.STRING:
            return self.string(what), None
        if vtype == V.ARRAY:
            return self.array(what, depth)
        st = _SCALAR[vtype]
        self.need(st.size, f"{vtype.name} {what}")
        v = st.unpack_from(self.buf, self.pos)[0]
        if vtype == V.BOOL:
            if v > 1:
                raise self.fail(f"{what} at byte {self.pos} is a BOOL with byte value {v}; expected 0 or 1")
            v = bool(v)
        self.pos += st.size
        return v, None

    def array(self, what: str, depth: int) -> tuple[Any, GGUFValueType]:
        if depth >= MAX_ARRAY_NESTING:
            raise self.fail(f"{what}: arrays nested deeper than {MAX_ARRAY_NESTING} levels at byte {self.pos}")
        etype = self.value_type(f"element type of array {what}")
        count = self.u64(f"element count of array {what}")
        self.check_count(count, _MIN_ELEMENT_BYTES[etype], f"element count of array {what} ({etype.name})")
        if etype == V.STRING:
            return self.string_array(count, what), etype
        if etype == V.ARRAY:
            return [self.array(f"{what}[{i}]", depth + 1)[0] for i in range(count)], etype
        if etype == V.BOOL:
            raw = np.frombuffer(self.buf, dtype=np.uint8, count=count, offset=self.pos).copy()
            if count and int(raw.max()) > 1:
                bad = int(np.argmax(raw > 1))
                raise self.fail(f"{what}[{bad}] is a BOOL with byte value {int(raw[bad])}; expected 0 or 1")
            out: Any = raw.view(bool)
        else:
            out = np.frombuffer(self.buf, dtype=_NUMPY[etype], count=count, offset=self.pos).copy()
        self.pos += count * _SCALAR[etype].size
        return out, etype

    def string_array(self, count: int, what: str) -> list[str]:
        # the hot path for 150k-entry vocabularies and merge lists: keep the loop body minimal
        buf, pos, size = self.buf, self.pos, self.size
        unpack = _U64.unpack_from
        out: list[str] = []
        append = out.append
        n = -1
        try:
            for _ in range(count):
                n = -1
                n = unpack(buf, pos)[0]  # struct.error when fewer than 8 bytes remain
                pos += 8
                end = pos + n
                if end > size:
                    break
                append(buf[pos:end].decode("utf-8"))
                pos = end
        except struct.error:
            pass
        except UnicodeDecodeError as exc:
            raise self.fail(f"{what}[{len(out)}] at byte {pos} is not valid UTF-8 ({exc.reason})") from None
        self.pos = pos
        if len(out) < count:
            i = len(out)
            self.need(8 if n < 0 else n, f"length of {what}[{i}]" if n < 0 else f"{what}[{i}] ({n} bytes)")
        return out


def _parse_part(path: Path) -> _Part:
    """Parse the header, metadata and tensor infos of one GGUF file and validate the tensor layout."""
    try:
        with open(path, "rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            if size == 0:
                raise GGUFError(f"{path}: file is empty; expected a GGUF file starting with b'GGUF'")
            mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
    except FileNotFoundError:
        raise FileNotFoundError(f"no GGUF file at {path}") from None
    try:
        return _parse_mapped(path, mm)
    except BaseException:
        _close_map(mm)
        raise


def _close_map(mm: mmap.mmap) -> None:
    try:
        mm.close()
    except BufferError:
        pass  # numpy/torch views still export the buffer; it is unmapped when they are collected


def _parse_mapped(path: Path, mm: mmap.mmap) -> _Part:
    p = _Parser(path, mm)
    p.need(4, "magic")
    magic = bytes(mm[0:4])
    if magic != GGUF_MAGIC:
        raise p.fail(f"not a GGUF file: expected magic b'GGUF' at byte 0, found {magic!r}")
    p.pos = 4
    version = p.u32("version")
    if version not in SUPPORTED_VERSIONS:
        swapped = struct.unpack("<I", struct.pack(">I", version))[0]
        if swapped in SUPPORTED_VERSIONS:
            raise p.fail(f"big-endian GGUF (version {swapped} byte-swapped) is not supported; moerun reads "
                         f"little-endian files only")
        raise p.fail(f"unsupported GGUF version {version}; moerun reads versions {SUPPORTED_VERSIONS}")
    n_tensors = p.u64("tensor count")
    n_kv = p.u64("metadata key/value count")
    # minimal sizes: a KV is key length + value type + a 1-byte value; a tensor info is 8+4+8+4+8 bytes
    p.check_count(n_kv, 8 + 4 + 1, "metadata key/value count")

    metadata: dict[str, Any] = {}
    value_types: dict[str, tuple[GGUFValueType, GGUFValueType | None]] = {}
    for i in range(n_kv):
        at = p.pos
        key = p.string(f"metadata key #{i}")
        if key in metadata:
            raise p.fail(f"duplicate metadata key {key!r} (key #{i} at byte {at})")
        vtype = p.value_type(f"value type of metadata key {key!r}")
        metadata[key], etype = p.value(vtype, f"metadata value {key!r}")
        value_types[key] = (vtype, etype)

    alignment = _alignment(p, metadata, value_types)

    p.check_count(n_tensors, 8 + 4 + 8 + 4 + 8, "tensor count")
    raw_infos: list[tuple[str, tuple[int, ...], GGMLQuantizationType, int, int]] = []
    names: set[str] = set()
    for i in range(n_tensors):
        at = p.pos
        name = p.string(f"name of tensor info #{i}")
        if len(name.encode("utf-8")) > MAX_NAME_BYTES:
            raise p.fail(f"tensor info #{i} name {name[:80]!r} is {len(name.encode('utf-8'))} bytes; ggml allows at "
                         f"most {MAX_NAME_BYTES}")
        if name in names:
            raise p.fail(f"duplicate tensor name {name!r} (tensor info #{i} at byte {at})")
        names.add(name)
        where = f"tensor {name!r}"
        n_dims = p.u32(f"dimension count of {where}")
        if not 1 <= n_dims <= MAX_DIMS:
            raise p.fail(f"{where} has {n_dims} dimensions; expected 1 to {MAX_DIMS}")
        ne = [p.u64(f"dimension {d} of {where}") for d in range(n_dims)]
        type_at = p.pos
        raw_type = p.u32(f"ggml type of {where}")
        offset = p.u64(f"data offset of {where}")
        ggml_type = _ggml_type(p, raw_type, where, type_at)
        if any(d == 0 for d in ne):
            raise p.fail(f"{where} has a zero dimension (ggml ne={ne}); expected every dimension >= 1")
        block, _ = GGML_QUANT_SIZES[ggml_type]
        if ne[0] % block:
            raise p.fail(f"{where}: row length {ne[0]} is not a multiple of the {ggml_type.name} block size {block}")
        shape = tuple(reversed(ne))
        nbytes = tensor_nbytes(shape, ggml_type)
        if nbytes > p.size:
            raise p.fail(f"{where} with shape {list(shape)} and type {ggml_type.name} needs {nbytes} bytes, more than "
                         f"the whole file ({p.size} bytes)")
        raw_infos.append((name, shape, ggml_type, offset, nbytes))

    data_start = -(-p.pos // alignment) * alignment
    tensors = _place_tensors(p, raw_infos, data_start, alignment)
    return _Part(path, mm, version, metadata, value_types, tensors, alignment, data_start)


def _alignment(p: _Parser, metadata: dict[str, Any], types: dict[str, Any]) -> int:
    if "general.alignment" not in metadata:
        return DEFAULT_ALIGNMENT
    vtype, _ = types["general.alignment"]
    value = metadata["general.alignment"]
    if vtype != V.UINT32:
        raise p.fail(f"metadata 'general.alignment' has type {vtype.name}; expected UINT32")
    if value <= 0 or value & (value - 1):
        raise p.fail(f"metadata 'general.alignment' is {value}; expected a non-zero power of two")
    return value


def _ggml_type(p: _Parser, raw: int, where: str, at: int) -> GGMLQuantizationType:
    supported = ", ".join(t.name for t in sorted(SUPPORTED_TYPES))
    try:
        t = GGMLQuantizationType(raw)
    except ValueError:
        raise p.fail(f"{where} has unknown ggml type id {raw} (at byte {at}); supported types: {supported}") from None
    if t not in SUPPORTED_TYPES:
        raise p.fail(f"{where} has ggml type {t.name} (id {raw}), which moerun does not support; "
                     f"supported types: {supported}")
    return t


def _place_tensors(p: _Parser, infos: list[tuple[str, tuple[int, ...], GGMLQuantizationType, int, int]],
                   data_start: int, alignment: int) -> list[TensorInfo]:
    """Check every tensor's data lies aligned, inside the file and apart from the others."""
    out: list[TensorInfo] = []
    for name, shape, t, offset, nbytes in infos:
        if offset % alignment:
            raise p.fail(f"tensor {name!r} data offset {offset} is not a multiple of the alignment {alignment}")
        start = data_start + offset
        if start + nbytes > p.size:
            raise p.fail(f"tensor {name!r} data [{start}, {start + nbytes}) runs past the end of the file "
                         f"({p.size} bytes): the file is truncated or the offset is wrong")
        out.append(TensorInfo(name, shape, t, start, nbytes))
    by_offset = sorted(out, key=lambda ti: ti.offset)
    for a, b in zip(by_offset, by_offset[1:]):
        if a.offset + a.nbytes > b.offset:
            raise p.fail(f"tensors {a.name!r} [{a.offset}, {a.offset + a.nbytes}) and {b.name!r} "
                         f"[{b.offset}, {b.offset + b.nbytes}) overlap")
    return out


def split_paths(path: Path, count: int) -> list[Path]:
    """All part paths of a split model, from any one part's path (``name-0000K-of-0000N.gguf``)."""
    m = _SPLIT_NAME.match(path.name)
    if m is None:
        raise GGUFError(f"{path}: metadata says the model is split into {count} files, but the file name does not "
                        f"follow the '<name>-00001-of-{count:05d}.gguf' pattern, so the other parts cannot be found")
    if int(m["count"]) != count:
        raise GGUFError(f"{path}: file name says {int(m['count'])} parts but metadata {SPLIT_COUNT_KEY!r} says {count}")
    return [path.with_name(f"{m['prefix']}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]


def _int_key(part: _Part, key: str, lo: int, hi: int) -> int | None:
    if key not in part.metadata:
        return None
    v = part.metadata[key]
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise GGUFError(f"{part.path}: metadata {key!r} is {v!r}; expected an integer in [{lo}, {hi}]")
    return v


class GGUFFile:
    """An open GGUF model (one file or all parts of a split one): metadata, tensor infos and lazy tensor data.

    ``metadata`` maps keys to Python values (int, float, bool, str, list of str; numeric arrays are numpy arrays)
    and comes from the first part; ``value_types`` holds each key's GGUF type (and element type for arrays);
    ``tensors`` maps names to :class:`TensorInfo` across all parts.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._parts: list[_Part] = []
        try:
            self._open()
        except BaseException:
            self.close()
            raise

    def _open(self) -> None:
        first = _parse_part(self.path)
        self._parts = [first]
        count = _int_key(first, SPLIT_COUNT_KEY, 1, 65535) or 1
        if count > 1:
            paths = split_paths(self.path, count)
            parts: list[_Part] = []
            for i, p in enumerate(paths):
                if p.name == self.path.name:  # same folder by construction
                    parts.append(first)
                    continue
                if not p.exists():
                    raise GGUFError(f"{self.path}: split part {i + 1} of {count} is missing: expected {p}")
                parts.append(_parse_part(p))
                self._parts.append(parts[-1])
            self._parts = parts
        self._check_parts(count)
        head = self._parts[0]
        self.metadata: dict[str, Any] = head.metadata
        self.value_types = head.value_types
        self.version = head.version
        self.alignment = head.alignment
        self.tensors: dict[str, TensorInfo] = {}
        for i, part in enumerate(self._parts):
            for ti in part.tensors:
                if ti.name in self.tensors:
                    other = self._parts[self.tensors[ti.name].part].path
                    raise GGUFError(f"{part.path}: tensor {ti.name!r} is also in {other}")
                self.tensors[ti.name] = TensorInfo(ti.name, ti.shape, ti.ggml_type, ti.offset, ti.nbytes, i)
        expected = _int_key(head, SPLIT_TENSORS_KEY, 0, 2**31 - 1)
        if count > 1 and expected is not None and expected != len(self.tensors):
            raise GGUFError(f"{head.path}: metadata {SPLIT_TENSORS_KEY!r} says {expected} tensors but the "
                            f"{count} parts hold {len(self.tensors)}")

    def _check_parts(self, count: int) -> None:
        if count == 1:
            return
        for i, part in enumerate(self._parts):
            n = _int_key(part, SPLIT_COUNT_KEY, 1, 65535)
            no = _int_key(part, SPLIT_NO_KEY, 0, 65534)
            if n != count:
                raise GGUFError(f"{part.path}: metadata {SPLIT_COUNT_KEY!r} is {n}; expected {count} like the "
                                f"other parts")
            if no != i:
                raise GGUFError(f"{part.path}: metadata {SPLIT_NO_KEY!r} is {no}; expected {i} for part {i + 1} of "
                                f"{count}")

    # ---- metadata ----
    @property
    def architecture(self) -> str:
        arch = self.metadata.get("general.architecture")
        if not isinstance(arch, str):
            raise GGUFError(f"{self.path}: metadata 'general.architecture' is missing or not a string")
        return arch

    @property
    def paths(self) -> list[Path]:
        return [p.path for p in self._parts]

    # ---- tensor data ----
    def tensor_info(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise KeyError(f"{self.path}: no tensor named {name!r} (the file has {len(self.tensors)} tensors)") \
                from None

    def _map(self, part: int) -> mmap.mmap:
        mm = self._parts[part].mm if self._parts else None
        if mm is None or mm.closed:
            raise GGUFError(f"{self.path}: the file is closed")
        return mm

    def tensor_bytes(self, name: str) -> np.ndarray:
        """The raw bytes of a tensor as a read-only uint8 view of the memory map (no copy)."""
        ti = self.tensor_info(name)
        return np.frombuffer(self._map(ti.part), dtype=np.uint8, count=ti.nbytes, offset=ti.offset)

    def tensor(self, name: str, copy: bool = False) -> torch.Tensor:
        """An F32/F16/BF16 tensor in torch order; without ``copy`` it aliases the read-only map: do not write to it."""
        ti = self.tensor_info(name)
        dtype = _FLOAT_TORCH.get(ti.ggml_type)
        if dtype is None:
            raise GGUFError(f"{self.path}: tensor {name!r} is {ti.type_name}; tensor() returns only F32/F16/BF16 "
                            f"tensors, use tensor_bytes() and dequantize the blocks")
        mm = self._map(ti.part)
        itemsize = torch.empty((), dtype=dtype).element_size()
        if ti.offset % itemsize:
            # an unaligned start (alignment < element size) cannot be viewed safely
            raw = bytearray(mm[ti.offset:ti.offset + ti.nbytes])
            return torch.frombuffer(raw, dtype=dtype).view(ti.shape)
        with warnings.catch_warnings():
            # torch warns that the buffer is read-only; the view is documented as not writable
            warnings.simplefilter("ignore", UserWarning)
            t = torch.frombuffer(mm, dtype=dtype, count=ti.n_elements, offset=ti.offset).view(ti.shape)
        return t.clone() if copy else t

    # ---- lifetime ----
    def close(self) -> None:
        """Release the memory maps; views handed out earlier keep theirs alive until they are dropped."""
        for part in self._parts:
            if part.mm is not None:
                _close_map(part.mm)
            part.mm = None

    def __enter__(self) -> "GGUFFile":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        parts = f", {len(self._parts)} parts" if len(self._parts) > 1 else ""
        return (f"GGUFFile({str(self.path)!r}, v{self.version}, {len(self.metadata)} keys, "
                f"{len(self.tensors)} tensors{parts})")
