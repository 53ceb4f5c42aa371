"""The GGUF reader against gguf's own GGUFReader: metadata of every type, tensors, split files, laziness."""

from __future__ import annotations

import struct
import time

import numpy as np
import pytest
import torch
from gguf import GGUFReader
from gguf.constants import GGMLQuantizationType, GGUFValueType

from gguf_testutil import assemble, info, kv_str, reference_tensors, write_reference
from moerun.formats.gguf.reader import GGUFError, GGUFFile

T = GGMLQuantizationType


def _reader_value(field):
    """A GGUFReader field as a plain Python value (lists for arrays)."""
    v = field.contents()
    return v.tolist() if isinstance(v, np.ndarray) else v


def _ours(v):
    return v.tolist() if isinstance(v, np.ndarray) else v


def _compare_with_gguf_reader(path, ours: GGUFFile, part_tensors: set[str] | None = None) -> None:
    ref = GGUFReader(path)
    for key, field in ref.fields.items():
        if key.startswith("GGUF."):
            continue
        assert key in ours.metadata, key
        if key != "split.no":  # each part numbers itself; ours reports the first part's metadata
            assert _ours(ours.metadata[key]) == _reader_value(field), key
            assert ours.value_types[key][0] == field.types[0], key
    for t in ref.tensors:
        ti = ours.tensors[t.name]
        assert ti.shape == tuple(int(d) for d in reversed(t.shape.tolist())), t.name
        assert ti.ggml_type == t.tensor_type
        assert ti.nbytes == t.n_bytes
        assert ti.offset == t.data_offset
        assert ours.tensor_bytes(t.name).tobytes() == t.data.tobytes()
        if part_tensors is not None:
            part_tensors.add(t.name)


def test_round_trip_matches_gguf_reader(tmp_path):
    (path,) = write_reference(tmp_path / "ref.gguf")
    with GGUFFile(path) as f:
        assert f.architecture == "qwen3moe"
        assert f.version == 3 and f.alignment == 32
        _compare_with_gguf_reader(path, f)
        md = f.metadata
        assert md["t.u64"] == 2**63 + 5 and md["t.i64"] == -(2**62)
        assert md["t.bool_true"] is True and md["t.bool_false"] is False
        assert md["t.str"] == "héllo wörld ✓ 世界"
        assert md["t.f32"] == 0.25 and md["t.f64"] == 1.0 / 3.0
        assert md["t.arr_str"] == ["a", "", "ü 😀", "x y"]
        assert md["t.arr_bool"].tolist() == [True, False, True]
        assert md["t.arr_u64"].tolist() == [2**64 - 1, 0]
        assert f.value_types["t.arr_str"] == (GGUFValueType.ARRAY, GGUFValueType.STRING)
        assert f.tensors["q4_k"].shape == (2, 3, 256) and f.tensors["q4_k"].nbytes == 2 * 3 * 144
        assert f.tensors["vec"].shape == (32,)


def test_float_tensors_are_zero_copy_views(tmp_path):
    (path,) = write_reference(tmp_path / "ref.gguf")
    src = reference_tensors(np.random.default_rng(0))
    with GGUFFile(path) as f:
        a = f.tensor("f32")
        assert a.dtype == torch.float32 and a.shape == (4, 64)
        assert torch.equal(a, torch.from_numpy(src["f32"][0]))
        assert torch.equal(f.tensor("f16"), torch.from_numpy(src["f16"][0]))
        bf = f.tensor("bf16")
        assert bf.dtype == torch.bfloat16
        assert torch.equal(bf.float(), torch.from_numpy(src["f32"][0]).bfloat16().float())
        # the view aliases the file's pages: same address as the raw bytes view
        raw = f.tensor_bytes("f32")
        assert raw.ctypes.data == a.data_ptr() and not raw.flags.writeable
        copied = f.tensor("f32", copy=True)
        copied += 1  # a copy is writable and independent of the file
        assert torch.equal(f.tensor("f32"), a)
        with pytest.raises(GGUFError, match="tensor 'q8_0' is Q8_0; tensor\\(\\) returns only F32/F16/BF16"):
            f.tensor("q8_0")
        with pytest.raises(KeyError, match="no tensor named 'nope'"):
            f.tensor_bytes("nope")
    with pytest.raises(GGUFError, match="the file is closed"):
        f.tensor_bytes("f32")
    del a, raw  # views handed out before close keep their mapping alive until here


@pytest.mark.parametrize("alignment", [64, 256])
def test_custom_alignment(tmp_path, alignment):
    (path,) = write_reference(tmp_path / "ref.gguf", alignment=alignment)
    with GGUFFile(path) as f:
        assert f.alignment == alignment
        assert all((ti.offset - f.tensors["f32"].offset) % alignment == 0 for ti in f.tensors.values())
        _compare_with_gguf_reader(path, f)


def test_version_2_is_read(tmp_path):
    (path,) = write_reference(tmp_path / "ref.gguf")
    raw = bytearray(path.read_bytes())
    raw[4:8] = struct.pack("<I", 2)  # v2 and v3 share the little-endian layout
    path.write_bytes(raw)
    with GGUFFile(path) as f:
        assert f.version == 2 and len(f.tensors) == 9


def test_split_files_open_from_any_part(tmp_path):
    paths = write_reference(tmp_path / "model.gguf", split_max_tensors=4)
    assert [p.name for p in paths] == [f"model-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
    seen: set[str] = set()
    for p in paths:
        with GGUFFile(p) as f:
            assert f.paths == paths and len(f.tensors) == 9
            assert f.metadata["split.count"] == 3 and f.metadata["split.no"] == 0
            assert f.metadata["t.str"] == "héllo wörld ✓ 世界"
            assert {ti.part for ti in f.tensors.values()} == {0, 1, 2}
    with GGUFFile(paths[0]) as f:
        for p in paths:
            _compare_with_gguf_reader(p, f, seen)
        assert seen == set(f.tensors)
        assert np.array_equal(f.tensor("vec").numpy(), reference_tensors(np.random.default_rng(0))["vec"][0])


def test_split_missing_part_and_bad_name(tmp_path):
    paths = write_reference(tmp_path / "model.gguf", split_max_tensors=4)
    paths[2].unlink()
    with pytest.raises(GGUFError, match="split part 3 of 3 is missing: expected .*model-00003-of-00003.gguf"):
        GGUFFile(paths[0])
    renamed = tmp_path / "model.gguf"
    paths[0].rename(renamed)
    with pytest.raises(GGUFError, match="split into 3 files, but the file name does not follow"):
        GGUFFile(renamed)


def test_open_reads_only_the_header_of_a_huge_sparse_file(tmp_path):
    # a 64 GiB tensor: the file is sparse, so reading any of its data would take ages and show in the timing
    n = 1 << 34
    raw = assemble([kv_str("general.architecture", "qwen3moe")], [info("big", [1 << 12, n >> 12], T.F32, 0)])
    path = tmp_path / "huge.gguf"
    with open(path, "wb") as fh:
        fh.write(raw)
        fh.truncate(len(raw) + 4 * n)
    t0 = time.perf_counter()
    with GGUFFile(path) as f:
        assert f.tensors["big"].nbytes == 4 * n and f.tensors["big"].shape == (n >> 12, 1 << 12)
        row = f.tensor("big")[0]  # a view; touching one row reads one page
        assert float(row.sum()) == 0.0
    assert time.perf_counter() - t0 < 2.0


def test_no_tensors_and_no_data_section(tmp_path):
    path = tmp_path / "vocab.gguf"
    path.write_bytes(assemble([kv_str("general.architecture", "qwen3moe")], []))
    with GGUFFile(path) as f:
        assert f.tensors == {} and f.metadata == {"general.architecture": "qwen3moe"}
