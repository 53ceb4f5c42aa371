"""Block geometry, torch dequantisation (bit-exact vs gguf) and QuantizedTensor."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from moerun.formats.quants import (
    FP16_FIELDS,
    SUPPORTED_TYPES,
    QuantizedTensor,
    QuantType,
    as_quant_type,
    dequantize,
    quantize,
    tensor_nbytes,
)

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def finite_half_bits(rng: np.random.Generator, n: int, exp_mask: int = 0x7C00) -> np.ndarray:
    """n random 16-bit patterns with the all-ones exponent (inf/NaN) cleared: [n] uint16."""
    bits = rng.integers(0, 1 << 16, n, dtype=np.uint16)
    return np.where((bits & exp_mask) == exp_mask, bits & ~np.uint16(0x4000), bits).astype(np.uint16)


def random_blocks(rng: np.random.Generator, qt: QuantType, n_elems: int) -> np.ndarray:
    """Valid random encoded data for n_elems values: random code bits, finite fp16 scales. [nbytes] uint8."""
    if qt == QuantType.F32:
        return (rng.standard_normal(n_elems) * 10.0 ** rng.uniform(-30, 30, n_elems)).astype(np.float32).view(np.uint8)
    if qt == QuantType.F16:
        return finite_half_bits(rng, n_elems).view(np.uint8)
    if qt == QuantType.BF16:
        return finite_half_bits(rng, n_elems, exp_mask=0x7F80).view(np.uint8)
    n_blocks = n_elems // qt.block_elems
    raw = rng.integers(0, 256, (n_blocks, qt.block_bytes), dtype=np.uint8)
    for off in FP16_FIELDS[qt]:
        raw[:, off : off + 2] = finite_half_bits(rng, n_blocks).view(np.uint8).reshape(n_blocks, 2)
    if qt == QuantType.IQ1_M:  # d's bits 12-15 are the top nibble of the last scale word: keep its exponent finite
        raw[:, 55] &= np.uint8(0xBF)
    return raw.reshape(-1)


def test_geometry_matches_gguf() -> None:
    assert len(SUPPORTED_TYPES) == 26
    for qt in SUPPORTED_TYPES:
        gt = gguf.GGMLQuantizationType(int(qt))
        assert gt.name == qt.name
        assert gguf.GGML_QUANT_SIZES[gt] == (qt.block_elems, qt.block_bytes)


def test_tensor_nbytes() -> None:
    assert tensor_nbytes((128, 768, 2048), QuantType.Q4_K) == 128 * 768 * 8 * 144
    assert tensor_nbytes((4, 64), "q8_0") == 4 * 2 * 34
    assert tensor_nbytes((3, 5), gguf.GGMLQuantizationType.F16) == 30
    assert tensor_nbytes((7,), 0) == 28


@pytest.mark.parametrize("bad", [gguf.GGMLQuantizationType.Q8_1, gguf.GGMLQuantizationType.Q8_K,
                                 gguf.GGMLQuantizationType.I8, gguf.GGMLQuantizationType.Q1_0])
def test_unsupported_type_is_named(bad: gguf.GGMLQuantizationType) -> None:
    with pytest.raises(ValueError, match=rf"blk\.3\.ffn_up_exps\.weight.*{bad.name}.*not supported"):
        tensor_nbytes((16, 256), bad, "blk.3.ffn_up_exps.weight")
    with pytest.raises(ValueError, match=bad.name):
        as_quant_type(int(bad))
    with pytest.raises(ValueError, match="id 99"):
        as_quant_type(99, "x")


def test_bad_row_length_message() -> None:
    with pytest.raises(ValueError, match=r"output\.weight.*row length 1000 .* Q4_K block size 256"):
        tensor_nbytes((8, 1000), QuantType.Q4_K, "output.weight")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("qt", SUPPORTED_TYPES, ids=lambda t: t.name)
def test_dequant_bit_exact_vs_gguf(qt: QuantType, device: str) -> None:
    seed = int(np.random.SeedSequence().entropy % (1 << 32))
    rng = np.random.default_rng(seed)
    for n_blocks in (1, 3, 64, 1000):
        row = n_blocks * max(qt.block_elems, 32)
        shape = (2, row)
        raw = random_blocks(rng, qt, shape[0] * row)
        ref = gguf.quants.dequantize(raw.reshape(shape[0], -1), gguf.GGMLQuantizationType(int(qt)))
        got = dequantize(torch.from_numpy(raw).to(device), qt, shape).cpu().numpy()
        assert got.dtype == np.float32 and got.shape == shape
        mismatch = np.nonzero(ref.view(np.uint32) != got.view(np.uint32))
        assert mismatch[0].size == 0, f"{qt.name} seed={seed} n_blocks={n_blocks}: first mismatch at {mismatch}"


@pytest.mark.parametrize("qt", [QuantType.Q4_K, QuantType.Q6_K, QuantType.Q8_0], ids=lambda t: t.name)
def test_dequant_other_dtypes_round_once(qt: QuantType) -> None:
    rng = np.random.default_rng()
    raw = torch.from_numpy(random_blocks(rng, qt, 4 * 512))
    full = dequantize(raw, qt, (4, 512))
    for dtype in (torch.bfloat16, torch.float16):
        assert torch.equal(dequantize(raw, qt, (4, 512), dtype=dtype), full.to(dtype))


def test_dequant_chunking_covers_large_tensors() -> None:
    # More blocks than one CPU chunk, so the chunk loop and its tail are exercised.
    qt = QuantType.Q4_0
    shape = (70, 1024)
    raw = random_blocks(np.random.default_rng(), qt, shape[0] * shape[1])
    ref = gguf.quants.dequantize(raw.reshape(shape[0], -1), gguf.GGMLQuantizationType.Q4_0)
    got = dequantize(torch.from_numpy(raw), qt, shape, dtype=torch.bfloat16)
    assert torch.equal(got, torch.from_numpy(ref).to(torch.bfloat16))


def test_dequant_into_out_buffer() -> None:
    qt = QuantType.Q6_K
    raw = torch.from_numpy(random_blocks(np.random.default_rng(), qt, 3 * 512))
    expected = dequantize(raw, qt, (3, 512))
    buf = torch.full((3, 512), float("nan"))
    assert dequantize(raw, qt, (3, 512), out=buf) is buf
    assert torch.equal(buf, expected)
    half = torch.empty((3, 512), dtype=torch.bfloat16)
    dequantize(raw, qt, (3, 512), out=half)
    assert torch.equal(half, expected.to(torch.bfloat16))
    with pytest.raises(ValueError, match=r"out tensor of shape \(3, 512\)"):
        dequantize(raw, qt, (3, 512), out=torch.empty(512, 3).t())


def test_dequant_rejects_wrong_sizes() -> None:
    raw = torch.zeros(144 * 3, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"blk\.0\.x.*needs 576 bytes, got 432"):
        dequantize(raw, QuantType.Q4_K, (2, 512), tensor_name="blk.0.x")
    with pytest.raises(TypeError, match="uint8"):
        dequantize(raw.float(), QuantType.Q4_K, (1, 768))


def make_experts(
    qt: QuantType = QuantType.Q4_K, shape: tuple[int, ...] = (4, 8, 512)
) -> tuple[QuantizedTensor, np.ndarray]:
    w = (np.random.default_rng(0).standard_normal(shape) * 0.02).astype(np.float32)
    return QuantizedTensor.from_float(w, qt, name="blk.0.ffn_down_exps.weight"), w


def test_quantized_tensor_layout_and_dequant() -> None:
    qtensor, w = make_experts()
    assert qtensor.raw.shape == (4, 8, 2 * 144) and qtensor.raw.dtype == torch.uint8
    assert qtensor.nbytes == 4 * 8 * 2 * 144
    assert qtensor.shape == (4, 8, 512) and len(qtensor) == 4 and qtensor.numel() == w.size
    assert np.array_equal(qtensor.raw.numpy(), quantize(w, QuantType.Q4_K))
    full = qtensor.dequantize()
    assert full.shape == (4, 8, 512) and full.dtype == torch.float32
    assert qtensor.dequantize(torch.bfloat16).dtype == torch.bfloat16
    buf = torch.empty(4, 8, 512)
    assert qtensor.dequantize(out=buf) is buf and torch.equal(buf, full)
    from_torch = QuantizedTensor.from_float(torch.from_numpy(w), "Q4_K")
    assert torch.equal(from_torch.raw, qtensor.raw)
    rel = float(torch.linalg.norm(full - torch.from_numpy(w)) / torch.linalg.norm(torch.from_numpy(w)))
    assert rel < 0.1


def test_quantized_tensor_expert_slices_are_views() -> None:
    qtensor, _ = make_experts()
    full = qtensor.dequantize()
    e2 = qtensor[2]
    assert e2.shape == (8, 512) and e2.qtype == QuantType.Q4_K
    assert e2.raw.untyped_storage().data_ptr() == qtensor.raw.untyped_storage().data_ptr()
    assert e2.raw.data_ptr() == qtensor.raw.data_ptr() + 2 * 8 * 288
    assert torch.equal(e2.dequantize(), full[2])
    assert torch.equal(qtensor[-1].dequantize(), full[3])
    part = qtensor[1:3]
    assert part.shape == (2, 8, 512) and part.raw.is_contiguous()
    assert torch.equal(part.dequantize(), full[1:3])
    assert torch.equal(e2[5].dequantize(), full[2, 5])
    with pytest.raises(IndexError, match="out of range"):
        qtensor[4]
    with pytest.raises(IndexError, match="step"):
        qtensor[::2]
    with pytest.raises(IndexError, match="at least 2 dims"):
        e2[5][0]


def test_quantized_tensor_to_and_repr() -> None:
    qtensor, _ = make_experts(QuantType.Q8_0, (2, 4, 64))
    moved = qtensor.to("cpu")
    assert moved.device.type == "cpu" and torch.equal(moved.raw, qtensor.raw)
    text = repr(qtensor)
    assert "Q8_0" in text and "(2, 4, 64)" in text and "blk.0.ffn_down_exps.weight" in text
    if torch.cuda.is_available():
        on_gpu = qtensor.to("cuda")
        assert torch.equal(on_gpu.dequantize().cpu(), qtensor.dequantize())
        assert qtensor.dequantize(device="cuda").is_cuda


def test_quantized_tensor_validates() -> None:
    with pytest.raises(ValueError, match=r"needs 288 bytes"):
        QuantizedTensor(torch.zeros(100, dtype=torch.uint8), QuantType.Q4_K, (1, 512))
    with pytest.raises(ValueError, match="row length 100"):
        QuantizedTensor(torch.zeros(100, dtype=torch.uint8), QuantType.Q4_K, (1, 100))
    with pytest.raises(ValueError, match="Q8_K"):
        QuantizedTensor(torch.zeros(292, dtype=torch.uint8), gguf.GGMLQuantizationType.Q8_K, (1, 256))
    assert QuantizedTensor(torch.zeros(74, dtype=torch.uint8), gguf.GGMLQuantizationType.IQ2_XS, (1, 256)).nbytes == 74
    flat = QuantizedTensor(torch.zeros(2 * 34, dtype=torch.uint8), "Q8_0", (2, 32))
    assert flat.raw.shape == (2, 34)


def test_grids_and_sign_patterns_match_gguf() -> None:
    from moerun.formats.quants.grids import GRID_OF, grid_table, sign_patterns

    for qt, (owner, entries, width) in GRID_OF.items():
        cls = getattr(gguf.quants, owner)
        cls.init_grid()
        assert torch.equal(grid_table(qt).float(), torch.from_numpy(cls.grid.reshape(entries, width)))
    ksigns = np.frombuffer(gguf.quants.IQ2_XXS.ksigns, dtype=np.uint8)
    assert torch.equal(sign_patterns(), torch.from_numpy(ksigns.copy()))


def test_read_only_types_are_listed() -> None:
    from moerun.formats.quants import QUANTIZABLE_TYPES

    assert QuantType.Q4_K in QUANTIZABLE_TYPES and QuantType.IQ4_XS in QUANTIZABLE_TYPES
    assert QuantType.MXFP4 in QUANTIZABLE_TYPES and QuantType.TQ1_0 in QUANTIZABLE_TYPES
    assert QuantType.IQ3_S in QUANTIZABLE_TYPES and QuantType.IQ3_XXS in QUANTIZABLE_TYPES
    assert QuantType.IQ2_XXS not in QUANTIZABLE_TYPES and QuantType.NVFP4 not in QUANTIZABLE_TYPES
