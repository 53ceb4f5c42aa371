"""The residual add + RMSNorm inside the quantized q|k|v GEMV (gemv_v2's NORM, ops.quant.rms_norm_quant_linear):
the same int8 rows, residual and product as the norm's own launch (ops.rms_norm_int8) followed by the GEMV, and
the product against the torch reference on those rows. In the attention layer: test_gemv.py."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from moerun.formats.quants import QuantType  # noqa: E402
from moerun.kernels.quant import matmul_quant  # noqa: E402
from moerun.kernels.quant.int8_dot import dequantize_xq  # noqa: E402
from moerun.kernels.quant.matmul_quant import (  # noqa: E402
    norm_in_front_applies, quant_matmul_triton, rms_norm_quant_matmul_triton,
)
from moerun.kernels.quant.repack import pack, padded_k  # noqa: E402
from moerun.kernels.quant.synthetic import random_quantized  # noqa: E402
from moerun.ops.norm import rms_norm_int8  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
ON_CUDA = DEVICE.type == "cuda"
INT8 = {"path": "gemv_v2", "BLOCK_N": 16, "BLOCK_K": 256, "num_warps": 4, "num_stages": 1, "x_q8": True}
EPS = 1e-6


@pytest.fixture
def int8_config(monkeypatch):
    """Every part's default GEMV config: gemv_v2 on int8 x (the shipped tables' choice at decode on a GPU)."""
    monkeypatch.setattr(matmul_quant, "get_matmul_config", lambda *args: INT8)


def _parts(types: tuple[QuantType, ...], rows: tuple[int, ...], K: int) -> list:
    return [pack(random_quantized(t, (n, K), DEVICE)) for t, n in zip(types, rows)]


@pytest.mark.parametrize("with_residual", [True, False], ids=["residual", "no_residual"])
@pytest.mark.parametrize("types,K", [((QuantType.Q4_K, QuantType.Q6_K), 512), ((QuantType.Q8_0,), 320),
                                     ((QuantType.Q5_K, QuantType.Q4_K), 768)],
                         ids=["q4k_q6k", "q8_0_k320", "q5k_q4k_k768"])  # fmt: skip
def test_norm_in_front_equals_the_two_launches(seed, int8_config, types, K: int, with_residual: bool) -> None:
    parts = _parts(types, (48, 16)[: len(types)], K)
    M = 2
    x = torch.randn(M, K, device=DEVICE).bfloat16()
    residual = torch.randn(M, K, device=DEVICE).bfloat16() if with_residual else None
    weight = (1 + 0.1 * torch.randn(K, device=DEVICE)).bfloat16()
    bias = torch.randn(64, device=DEVICE).bfloat16() if len(types) == 2 else None
    assert norm_in_front_applies(parts, M)
    h, ref_residual, rows = rms_norm_int8(x, weight, EPS, residual, padded_k(K))
    ref = quant_matmul_triton(h, parts, bias, x_int8=rows)  # [M, N]
    x_before = x.clone()
    out, new_residual = rms_norm_quant_matmul_triton(x, residual, weight, EPS, parts, bias)
    assert torch.equal(x, x_before), "x is read, never written"
    assert out.shape == ref.shape and out.dtype == x.dtype
    assert torch.equal(new_residual, ref_residual), f"seed={seed}"
    if not ON_CUDA:  # the interpreter fuses no float operations: the same values bit for bit
        assert torch.equal(out, ref), f"seed={seed}"
    else:  # the fused launch keeps the norm's roundings (no FMA) for the GEMV's scales too
        torch.testing.assert_close(out, ref, rtol=1e-2, atol=1e-2 * ref.abs().max().item(),
                                   msg=lambda m: f"seed={seed}: {m}")  # fmt: skip
    # against the torch reference: dequantised weights times the int8-rounded normed rows
    dense = torch.cat([p.dequantize(torch.float32) for p in parts])  # [N, K]
    expect = dequantize_xq(rows.xq, rows.dx)[:, :K] @ dense.T + (0 if bias is None else bias.float())
    torch.testing.assert_close(out.float(), expect, rtol=1e-2, atol=1e-2 * expect.abs().max().item(),
                               msg=lambda m: f"seed={seed}: {m}")  # fmt: skip


def test_norm_in_front_refuses_what_is_not_one_int8_launch(seed, int8_config, monkeypatch) -> None:
    K = 256
    three = _parts((QuantType.Q4_K, QuantType.Q6_K, QuantType.Q4_K), (16, 16, 16), K)
    assert not norm_in_front_applies(three, 1)  # two launches: the second would read rows nobody wrote
    x, weight = torch.randn(1, K, device=DEVICE).bfloat16(), torch.ones(K, device=DEVICE).bfloat16()
    with pytest.raises(ValueError, match="one gemv_v2 launch of int8 x"):
        rms_norm_quant_matmul_triton(x, None, weight, EPS, three)
    one = three[:1]
    with pytest.raises(ValueError, match="weight must be"):
        rms_norm_quant_matmul_triton(x, None, weight.float(), EPS, one)
    with pytest.raises(ValueError, match="residual must match"):
        rms_norm_quant_matmul_triton(x, x[:, :128], weight, EPS, one)
    monkeypatch.setattr(matmul_quant, "get_matmul_config", lambda *args: {**INT8, "x_q8": False})
    assert not norm_in_front_applies(one, 1)  # float x: nothing to round in front
