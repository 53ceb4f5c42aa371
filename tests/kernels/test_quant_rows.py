"""Embedding lookups of quantized tables: the one-launch row decoder against the GGUF reference decode, and the
embedding layer reading the repacked copy once the blocks are gone."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from moerun.formats.quants import QuantType  # noqa: E402
from moerun.kernels.interpreter import interpreting  # noqa: E402
from moerun.kernels.quant.decode import dequantize_rows  # noqa: E402
from moerun.kernels.quant.repack import PACKED_TYPES, pack  # noqa: E402
from moerun.kernels.quant.synthetic import random_quantized  # noqa: E402
from moerun.layers.embedding import Embedding  # noqa: E402
from moerun.layers.quantized import QuantizedWeight, set_quantized  # noqa: E402
from moerun.ops.quant import pack_model, quantized_rows  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _ids(n: int, rows: int) -> torch.Tensor:
    """rows ids in [0, n) with a repeat, the first and the last row among them."""
    ids = torch.randint(0, n, (rows,))
    ids[:3] = torch.tensor([0, n - 1, 0])
    return ids.to(DEVICE)


@pytest.mark.parametrize("qt", PACKED_TYPES, ids=lambda t: t.name)
def test_rows_match_the_gguf_decode(seed, qt: QuantType) -> None:
    # K = 4,608 for the K-quants: 72 pairs a row, so two programs a row, the second with masked pairs; the 32-element
    # types also at a K that is not a multiple of 64 (padding inside the last pair)
    shapes = [(7, 4608), (5, 512)] if qt.is_k_quant else [(7, 4608), (5, 96)]
    for n, k in shapes:
        t = random_quantized(qt, (n, k), DEVICE, any_scales=interpreting())
        ids = _ids(n, 6)
        ref = t.dequantize()[ids]  # [6, K] float32, the GGUF reference
        got = dequantize_rows(pack(t), ids, torch.float32)
        if interpreting():
            assert torch.equal(got.view(torch.int32), ref.view(torch.int32)), f"{qt.name} {k} seed={seed}"
        else:  # code * scale - min may be one FMA on the GPU (one rounding fewer)
            atol = 4e-7 * ref.abs().max().item()
            torch.testing.assert_close(got, ref, rtol=1e-6, atol=atol, msg=lambda m: f"{qt.name} seed={seed}: {m}")
        assert torch.equal(pack(t).take_rows(ids).dequantize(), t.dequantize()[ids]), f"{qt.name} {k} seed={seed}"


def test_rows_in_bf16_and_no_rows(seed) -> None:
    t = random_quantized(QuantType.Q4_K, (9, 256), DEVICE)
    pw, ids = pack(t), _ids(9, 4)
    assert torch.equal(dequantize_rows(pw, ids, torch.bfloat16), dequantize_rows(pw, ids, torch.float32).bfloat16())
    assert dequantize_rows(pw, ids[:0], torch.bfloat16).shape == (0, 256)
    with pytest.raises(ValueError, match=r"\[N, K\]"):
        dequantize_rows(pack(random_quantized(QuantType.Q4_K, (2, 3, 256), DEVICE)), ids, torch.float32)


@pytest.mark.parametrize("qt", [QuantType.Q4_K, QuantType.Q6_K, QuantType.Q8_0], ids=lambda t: t.name)
def test_embedding_reads_the_repacked_table_once_its_blocks_are_gone(seed, qt: QuantType) -> None:
    emb = torch.nn.Module()
    emb.embed = Embedding(11, 512)
    emb.embed.__dict__["compute_dtype"] = torch.bfloat16
    weight = QuantizedWeight([random_quantized(qt, (11, 512), DEVICE)])
    set_quantized(emb.embed, "weight", weight)
    ids = _ids(11, 7)
    before = emb.embed(ids)  # [7, 512] from the GGUF blocks
    assert pack_model(emb, release_blocks=True) == 1 and weight.released
    after = emb.embed(ids)
    assert after.dtype == torch.bfloat16 and after.shape == (7, 512)
    if interpreting() or DEVICE.type == "cpu":
        assert torch.equal(after, before), f"{qt.name} seed={seed}"
    else:
        torch.testing.assert_close(after, before, rtol=8e-3, atol=0)  # a bf16 ulp where the GPU's FMA rounds once
    assert torch.equal(quantized_rows(weight, ids, torch.bfloat16), after)


def test_a_table_of_several_parts_keeps_its_blocks(seed) -> None:
    emb = torch.nn.Module()
    emb.embed = Embedding(12, 256)
    emb.embed.__dict__["compute_dtype"] = torch.float32
    parts = [random_quantized(QuantType.Q4_K, (5, 256), DEVICE), random_quantized(QuantType.Q8_0, (7, 256), DEVICE)]
    weight = QuantizedWeight(parts)
    set_quantized(emb.embed, "weight", weight)
    ids = _ids(12, 5)
    before = emb.embed(ids)
    pack_model(emb, release_blocks=True)
    assert not weight.released  # lookups still read the blocks
    assert torch.equal(emb.embed(ids), before)
