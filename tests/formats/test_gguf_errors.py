"""Malformed GGUF files: each raises GGUFError naming the file and the problem, never another exception."""

from __future__ import annotations

import struct
import time
import tracemalloc

import numpy as np
import pytest
from gguf.constants import GGMLQuantizationType, GGUFValueType
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gguf_testutil import assemble, info, kv, kv_str, kv_u32, s, simple_file
from moerun.formats.gguf.reader import GGUFError, GGUFFile

V = GGUFValueType
T = GGMLQuantizationType
ARCH = kv_str("general.architecture", "qwen3moe")


def _open(tmp_path, raw: bytes, name: str = "bad.gguf") -> GGUFFile:
    path = tmp_path / name
    path.write_bytes(raw)
    return GGUFFile(path)


def _fails(tmp_path, raw: bytes, match: str) -> GGUFError:
    with pytest.raises(GGUFError, match=match) as exc:
        _open(tmp_path, raw).close()
    assert "bad.gguf" in str(exc.value)  # every message names the file
    return exc.value


def test_simple_file_is_valid(tmp_path):
    with _open(tmp_path, simple_file()) as f:
        assert f.tensor("a").tolist() == [[float(i) for i in range(8)], [float(i) for i in range(8, 16)]]
        assert f.metadata["x.count"] == 7


def test_header_errors(tmp_path):
    _fails(tmp_path, b"", "file is empty; expected a GGUF file")
    _fails(tmp_path, b"GGML" + simple_file()[4:], r"not a GGUF file: expected magic b'GGUF' at byte 0, found b'GGML'")
    _fails(tmp_path, assemble([ARCH], [], version=1), r"unsupported GGUF version 1; moerun reads versions \(2, 3\)")
    _fails(tmp_path, assemble([ARCH], [], version=4), "unsupported GGUF version 4")
    _fails(tmp_path, assemble([ARCH], [], version=3 << 24), "big-endian GGUF .* is not supported")


def test_truncation_at_every_byte_offset(tmp_path):
    raw = simple_file()
    path = tmp_path / "bad.gguf"
    for n in range(len(raw)):
        path.write_bytes(raw[:n])
        with pytest.raises(GGUFError) as exc:
            GGUFFile(path).close()
        msg = str(exc.value)
        assert str(path) in msg
        assert "truncated" in msg or "file is empty" in msg or "runs past the end of the file" in msg, (n, msg)
    path.write_bytes(raw)
    GGUFFile(path).close()


@pytest.mark.parametrize("n,expected", [
    (6, "truncated file: version at byte 4 needs 4 bytes but only 2 remain"),
    (12, "truncated file: tensor count at byte 8"),
    (20, "truncated file: metadata key/value count at byte 16"),
    (51, r"truncated file: metadata key #0 \(20 bytes\) at byte 32 needs 20 bytes but only 19 remain"),
    (60, "truncated file: length of metadata value 'general.architecture' at byte 56"),
    (120, "tensor count is 2, which cannot fit: at least 64 bytes are needed but only 25 remain after byte 95"),
    (160, "truncated file: ggml type of tensor 'b' at byte 157"),
    (200, r"tensor 'a' data \[192, 256\) runs past the end of the file \(200 bytes\)"),
])
def test_truncation_names_the_section(tmp_path, n, expected):
    _fails(tmp_path, simple_file()[:n], expected)


def test_tensor_layout_errors(tmp_path):
    data = bytes(128)
    _fails(tmp_path, assemble([ARCH], [info("a", [8], T.F32, 4096)], data),
           r"tensor 'a' data \[\d+, \d+\) runs past the end of the file \(\d+ bytes\)")
    _fails(tmp_path, assemble([ARCH], [info("a", [8], T.F32, 8)], data),
           "tensor 'a' data offset 8 is not a multiple of the alignment 32")
    _fails(tmp_path, assemble([ARCH], [info("a", [16], T.F32, 0), info("b", [8], T.F32, 32)], data),
           r"tensors 'a' \[\d+, \d+\) and 'b' \[\d+, \d+\) overlap")
    _fails(tmp_path, assemble([ARCH], [info("a", [8], T.F32, 0), info("a", [8], T.F32, 32)], data),
           "duplicate tensor name 'a'")
    _fails(tmp_path, assemble([ARCH], [info("x" * 64, [8], T.F32, 0)], data), "name 'x+' is 64 bytes; ggml allows")
    _fails(tmp_path, assemble([ARCH], [info("q", [48], T.Q8_0, 0)], data),
           "tensor 'q': row length 48 is not a multiple of the Q8_0 block size 32")


def test_tensor_type_errors(tmp_path):
    data = bytes(128)
    _fails(tmp_path, assemble([ARCH], [info("w", [256], T.Q8_K, 0)], data),
           "tensor 'w' has ggml type Q8_K \\(id 15\\), which moerun does not support; supported types: F32, F16")
    _fails(tmp_path, assemble([ARCH], [info("w", [8], 77, 0)], data),
           "tensor 'w' has unknown ggml type id 77 .*supported types: .*Q6_K")


def test_absurd_counts_and_dims_do_not_allocate(tmp_path):
    tracemalloc.start()
    try:
        _fails(tmp_path, assemble([ARCH], [], n_kv=2**60),
               "metadata key/value count is 1152921504606846976, which cannot fit")
        _fails(tmp_path, assemble([ARCH], [], n_tensors=2**63), "tensor count is 9223372036854775808, which cannot fit")
        huge_strings = kv("tok", V.ARRAY, struct.pack("<IQ", V.STRING, 2**60))
        _fails(tmp_path, assemble([huge_strings], []),
               r"element count of array metadata value 'tok' \(STRING\) is 1152921504606846976, which cannot fit")
        huge_u8 = kv("bytes", V.ARRAY, struct.pack("<IQ", V.UINT8, 2**40))
        _fails(tmp_path, assemble([huge_u8], []), "element count of array .* cannot fit")
        long_string = s("key") + struct.pack("<IQ", V.STRING, 2**62)
        _fails(tmp_path, assemble([long_string], []), r"truncated file: metadata value 'key' \(4611686018427387904 bytes\)")
        _fails(tmp_path, assemble([ARCH], [info("w", [2**40, 2**40], T.F32, 0)], bytes(64)),
               r"needs \d+ bytes, more than the whole file")
        _fails(tmp_path, assemble([ARCH], [info("w", [2**64 - 1] * 4, T.F32, 0)], bytes(64)),
               r"needs \d+ bytes, more than the whole file")
        _fails(tmp_path, assemble([ARCH], [s("w") + struct.pack("<I", 7)], bytes(64)), "tensor 'w' has 7 dimensions; expected 1 to 4")
        _fails(tmp_path, assemble([ARCH], [info("w", [0, 4], T.F32, 0)], bytes(64)), "tensor 'w' has a zero dimension")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 16 << 20


def test_value_errors(tmp_path):
    _fails(tmp_path, assemble([kv("k", 13, b"")], []), "value type of metadata key 'k' at byte 33 is 13, which is not a "
                                                      "GGUF value type")
    _fails(tmp_path, assemble([kv("k", V.ARRAY, struct.pack("<IQ", 99, 1))], []),
           "element type of array metadata value 'k' at byte 37 is 99, which is not a GGUF value type")
    _fails(tmp_path, assemble([ARCH, kv_u32("x", 1), kv_u32("x", 2)], []), "duplicate metadata key 'x'")
    _fails(tmp_path, assemble([kv(b"\xff\xfe", V.UINT8, b"\x01")], []), "metadata key #0 at byte 24 is not valid UTF-8")
    _fails(tmp_path, assemble([kv_str("k", b"ok\xc3")], []), "metadata value 'k' at byte 37 is not valid UTF-8")
    arr = kv("toks", V.ARRAY, struct.pack("<IQ", V.STRING, 2) + s("fine") + s(b"\x80bad"))
    _fails(tmp_path, assemble([arr], []), r"metadata value 'toks'\[1\] at byte \d+ is not valid UTF-8")
    _fails(tmp_path, assemble([ARCH], [info(b"w\xff", [8], T.F32, 0)], bytes(32)), "name of tensor info #0 .*UTF-8")
    _fails(tmp_path, assemble([kv("b", V.BOOL, b"\x02")], []), "'b' at byte 37 is a BOOL with byte value 2; expected 0 or 1")
    _fails(tmp_path, assemble([kv("b", V.ARRAY, struct.pack("<IQ", V.BOOL, 3) + b"\x00\x01\x05")], []),
           r"'b'\[2\] is a BOOL with byte value 5")
    nested = struct.pack("<IQ", V.ARRAY, 1) * 9 + struct.pack("<IQ", V.UINT8, 0)
    _fails(tmp_path, assemble([kv("deep", V.ARRAY, nested)], []), "arrays nested deeper than 8 levels")


def test_alignment_key_errors(tmp_path):
    _fails(tmp_path, assemble([kv("general.alignment", V.INT32, struct.pack("<i", 32))], []),
           "'general.alignment' has type INT32; expected UINT32")
    _fails(tmp_path, assemble([kv_u32("general.alignment", 48)], []), "'general.alignment' is 48; expected a non-zero "
                                                                      "power of two")
    _fails(tmp_path, assemble([kv_u32("general.alignment", 0)], []), "'general.alignment' is 0")


def test_split_metadata_errors(tmp_path):
    bad_count = assemble([ARCH, kv("split.count", V.UINT16, struct.pack("<H", 0))], [])
    _fails(tmp_path, bad_count, "metadata 'split.count' is 0; expected an integer in")


# ---- fuzzing ----
def _fuzz_base() -> bytes:
    kvs = [ARCH, kv_u32("general.alignment", 32),
           kv("toks", V.ARRAY, struct.pack("<IQ", V.STRING, 3) + s("a") + s("bc") + s("ü")),
           kv("nums", V.ARRAY, struct.pack("<IQ", V.INT32, 3) + np.arange(3, dtype="<i4").tobytes()),
           kv("nest", V.ARRAY, struct.pack("<IQ", V.ARRAY, 1) + struct.pack("<IQ", V.UINT16, 2) + b"\x01\x00\x02\x00"),
           kv("f", V.FLOAT64, struct.pack("<d", 0.5)), kv("b", V.BOOL, b"\x01")]
    infos = [info("a", [8, 2], T.F32, 0), info("q", [32], T.Q8_0, 64), info("h", [16], T.BF16, 128)]
    return assemble(kvs, infos, bytes(160))


_BASE = _fuzz_base()
_mutation = st.one_of(
    st.tuples(st.just("flip"), st.integers(0, len(_BASE) - 1), st.integers(1, 255)),
    st.tuples(st.just("truncate"), st.integers(0, len(_BASE) - 1), st.just(0)),
    st.tuples(st.just("insert"), st.integers(0, len(_BASE)), st.binary(min_size=1, max_size=9)),
    st.tuples(st.just("u64"), st.integers(0, len(_BASE) - 8), st.sampled_from([0, 1, 2**31, 2**32 - 1, 2**63, 2**64 - 1])),
)


def _mutate(raw: bytes, mutations) -> bytes:
    b = bytearray(raw)
    for kind, pos, arg in mutations:
        pos = min(pos, len(b))
        if kind == "flip" and pos < len(b):
            b[pos] ^= arg
        elif kind == "truncate":
            del b[pos:]
        elif kind == "insert":
            b[pos:pos] = arg
        elif kind == "u64" and pos + 8 <= len(b):
            b[pos:pos + 8] = struct.pack("<Q", arg)
    return bytes(b)


@settings(max_examples=80, deadline=None, database=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(mutations=st.lists(_mutation, min_size=1, max_size=3))
def test_fuzzed_files_open_or_raise_gguf_error(tmp_path, mutations):
    path = tmp_path / "fuzz.gguf"
    path.write_bytes(_mutate(_BASE, mutations))
    tracemalloc.start()
    t0 = time.perf_counter()
    try:
        with GGUFFile(path) as f:
            for name, ti in f.tensors.items():
                assert f.tensor_bytes(name).size == ti.nbytes
                if ti.ggml_type in (T.F32, T.F16, T.BF16):
                    assert f.tensor(name).numel() == ti.n_elements
    except GGUFError as exc:
        assert str(path) in str(exc)
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    assert time.perf_counter() - t0 < 1.0
    assert peak < 8 << 20
