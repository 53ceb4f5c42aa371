"""Repacked GGUF weights: bit-exact reference decoding, slicing, stacking, and the kernels' in-register decoder."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from moerun.formats.quants import QuantizedTensor, QuantType  # noqa: E402
from moerun.kernels.quant.decode import dequantize_triton  # noqa: E402
from moerun.kernels.quant.repack import PACKED_TYPES, cat_rows, pack, packed_nbytes, padded_k  # noqa: E402
from moerun.kernels.quant.synthetic import random_quantized  # noqa: E402
from moerun.kernels.interpreter import interpreting  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def bits(t: torch.Tensor) -> torch.Tensor:
    """float32 as int32 bit patterns, so that equality is exact and NaN-free."""
    return t.contiguous().view(torch.int32)


def shapes_for(qt: QuantType) -> list[tuple[int, ...]]:
    if qt.is_k_quant:
        return [(3, 5, 512), (4, 256), (2, 3, 768)]
    # 32-element types: K not a multiple of 256 exercises the padding.
    return [(3, 5, 512), (4, 96), (2, 3, 288)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("qt", PACKED_TYPES, ids=lambda t: t.name)
def test_reference_decode_is_bit_exact(seed, qt: QuantType, device: str) -> None:
    for shape in shapes_for(qt):
        t = random_quantized(qt, shape, device, any_scales=True)
        pw = pack(t)
        assert pw.shape == shape and pw.k_pad == padded_k(shape[-1]) and pw.device.type == device
        for arr in pw.tensors():
            assert arr is None or (arr.is_contiguous() and arr.shape[:-1 if arr is not pw.scale else -2] == shape[:-1])
        got, ref = pw.dequantize(), t.dequantize()
        mismatch = (bits(got) != bits(ref)).nonzero()
        assert mismatch.numel() == 0, f"{qt.name} {shape} seed={seed}: first mismatches at {mismatch[:4].tolist()}"


@pytest.mark.parametrize("qt", [QuantType.Q4_K, QuantType.Q6_K, QuantType.Q8_0, QuantType.Q5_0], ids=lambda t: t.name)
def test_packed_bytes_close_to_gguf(qt: QuantType) -> None:
    t = random_quantized(qt, (4, 8, 2048))
    pw = pack(t)
    assert t.nbytes <= pw.nbytes <= t.nbytes * 1.03


@pytest.mark.parametrize("qt", PACKED_TYPES, ids=lambda t: t.name)
def test_packed_nbytes_predicts_the_packed_arrays(qt: QuantType) -> None:
    # what the offload planner budgets for a slot, before anything is packed; rows of 288 pad to 512
    k = 768 if qt.block_elems == 256 else 288
    shape = (3, 5, k)
    assert packed_nbytes(qt, shape) == pack(random_quantized(qt, shape)).nbytes
    assert packed_nbytes(QuantType.BF16, shape) == 3 * 5 * k * 2


def test_on_gpu_matches_cpu_packing() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    for qt in PACKED_TYPES:
        t = random_quantized(qt, (2, 3, 512), any_scales=True)
        a, b = pack(t), pack(t.to("cuda"))
        for x, y in zip(a.tensors(), b.tensors()):
            assert (x is None) == (y is None)
            assert x is None or torch.equal(x, y.cpu()), qt.name


def test_expert_slices_and_row_stacking() -> None:
    gate = random_quantized(QuantType.Q4_K, (3, 4, 256))
    up = random_quantized(QuantType.Q4_K, (3, 6, 256))
    pg, pu = pack(gate), pack(up)
    e1 = pg[1]
    assert e1.shape == (4, 256) and e1.codes.data_ptr() == pg.codes.data_ptr() + 4 * 128
    assert torch.equal(bits(e1.dequantize()), bits(gate[1].dequantize()))
    both = cat_rows([pg, pu])
    assert both.shape == (3, 10, 256)
    ref = torch.cat([gate.dequantize(), up.dequantize()], dim=1)
    assert torch.equal(bits(both.dequantize()), bits(ref))
    with pytest.raises(ValueError, match="do not stack"):
        cat_rows([pg, pack(random_quantized(QuantType.Q6_K, (3, 4, 256)))])


@pytest.mark.parametrize("qt", [QuantType.F16, QuantType.BF16, QuantType.F32], ids=lambda t: t.name)
def test_float_types_stay_dense(qt: QuantType) -> None:
    dtype = {QuantType.F16: torch.float16, QuantType.BF16: torch.bfloat16, QuantType.F32: torch.float32}[qt]
    w = torch.randn(5, 64).to(dtype)
    t = QuantizedTensor(w.contiguous().view(torch.uint8).reshape(-1), qt, (5, 64))
    pw = pack(t)
    assert pw.is_dense and torch.equal(pw.dequantize(torch.float32), w.float())


@pytest.mark.parametrize("qt", PACKED_TYPES, ids=lambda t: t.name)
def test_kernel_decoder_matches_reference(seed, qt: QuantType) -> None:
    # Two experts of 5 rows: the decoder indexes global rows expert * N + n.
    shape = (2, 5, 512) if qt.is_k_quant else (2, 5, 96)
    # Any fp16 scale bit patterns in the interpreter, which is bit-exact; on the GPU code * scale - min is one FMA
    # (one rounding fewer than the reference), so scales stay in a range where an absolute bound holds.
    t = random_quantized(qt, shape, DEVICE, any_scales=interpreting())
    pw = pack(t)
    got, ref = dequantize_triton(pw), pw.dequantize()
    if interpreting():
        assert torch.equal(bits(got), bits(ref)), f"{qt.name} seed={seed}"
    else:
        atol = 4e-7 * ref.abs().max().item()
        torch.testing.assert_close(got, ref, rtol=1e-6, atol=atol, msg=lambda m: f"{qt.name} seed={seed}: {m}")
    assert dequantize_triton(pw, torch.bfloat16).dtype == torch.bfloat16


@pytest.mark.parametrize("qt", [QuantType.Q4_K, QuantType.Q6_K, QuantType.Q8_0, QuantType.Q5_0], ids=lambda t: t.name)
def test_kernel_decoder_writes_into_a_slice(seed, qt: QuantType) -> None:
    # out= a row slice of a larger buffer [E, 2N, K] (w13's gate or up rows): the same values, nothing else touched
    E, N, K = 3, 5, 512 if qt.is_k_quant else 96
    pw = pack(random_quantized(qt, (E, N, K), DEVICE))
    buffer = torch.full((E, 2 * N, K), 7.0, dtype=torch.bfloat16, device=DEVICE)
    dequantize_triton(pw, torch.bfloat16, out=buffer[:, N:])
    assert torch.equal(buffer[:, N:], dequantize_triton(pw, torch.bfloat16)), f"{qt.name} seed={seed}"
    assert (buffer[:, :N] == 7.0).all()
    with pytest.raises(ValueError, match="unit stride"):
        dequantize_triton(pw, torch.bfloat16, out=buffer[:, :N].transpose(1, 2).contiguous().transpose(1, 2))
    with pytest.raises(ValueError, match="out must be"):
        dequantize_triton(pw, torch.float32, out=buffer[:, N:])


def test_kernel_sources_avoid_syntax_older_triton_rejects() -> None:
    # The GPU target runs an older Triton than CI's interpreter, whose front end rejects `A or B or C` chains,
    # which the interpreter (plain Python) would accept.
    import ast
    import inspect

    from moerun.kernels.quant import decode, fused_moe_quant, matmul_quant

    for module in (decode, fused_moe_quant, matmul_quant):
        tree = ast.parse(inspect.getsource(module))
        for fn in (n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)):
            if not any("jit" in ast.unparse(d) for d in fn.decorator_list):
                continue
            for node in ast.walk(fn):
                assert not (isinstance(node, ast.BoolOp) and len(node.values) > 2), f"{fn.name}: {ast.unparse(node)}"
                assert not isinstance(node, (ast.IfExp, ast.AnnAssign)), f"{fn.name}: {ast.unparse(node)}"
