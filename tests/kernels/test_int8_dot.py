"""The int8-x decode path (config key "x_q8", kernels/quant/int8_dot.py): x's int8 quantization against its torch
reference, and the quantized matmul and MoE on it against dequantise + reference. With x already on an int8 grid
(a power-of-two scale per 32 values, each block reaching 127) the quantization is exact and so must the result be,
to float32 rounding; on plain random x within the error that x's rounding to int8 allows."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from moerun.formats.quants import QuantType  # noqa: E402
from moerun.kernels.quant.fused_moe_quant import fused_moe_quant  # noqa: E402
from moerun.kernels.quant.gemv_v2 import V2_TYPES  # noqa: E402
from moerun.kernels.quant.int8_dot import quantize_x, quantize_x_reference, unpack_xq  # noqa: E402
from moerun.kernels.quant.matmul_quant import quant_matmul_triton  # noqa: E402
from moerun.kernels.quant.repack import pack, padded_k  # noqa: E402
from moerun.kernels.quant.synthetic import random_quantized  # noqa: E402
from moerun.layers.quantized import QuantizedWeight  # noqa: E402
from moerun.ops.moe_reference import fused_moe_reference, route_reference  # noqa: E402
from moerun.ops.quant import packed_parts  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
ON_CUDA = DEVICE.type == "cuda"
MATMUL = {"path": "gemv_v2", "BLOCK_N": 16 if ON_CUDA else 64, "BLOCK_K": 256, "num_warps": 4, "num_stages": 1,
          "x_q8": True}  # fmt: skip
if ON_CUDA:
    MOE = {"path": "gemv_v2", "BLOCK_N": 16, "BLOCK_K": 512, "num_warps": 4, "BLOCK_N2": 8, "BLOCK_K2": 256,
           "num_warps2": 4, "x_q8": True}  # fmt: skip
else:  # the interpreter runs programs one by one: few, large ones
    MOE = {"path": "gemv_v2", "BLOCK_N": 256, "BLOCK_K": 4096, "BLOCK_N2": 256, "BLOCK_K2": 4096, "x_q8": True}


def on_int8_grid(T: int, K: int, dtype: torch.dtype) -> torch.Tensor:
    """x [T, K] that int8 quantization represents exactly: integer codes in [-127, 127] with 127 in every
    32-value block (as the block's largest magnitude), times a power of two per block."""
    q = torch.randint(-127, 128, (T, K))
    q[:, ::32] = 127 * (torch.randint(0, 2, q[:, ::32].shape) * 2 - 1)
    scale = torch.pow(2.0, torch.randint(-8, -3, (T, (K + 31) // 32)).float()).repeat_interleave(32, dim=1)[:, :K]
    return (q * scale).to(dtype).to(DEVICE)


@pytest.mark.parametrize("K", [256, 288, 2048])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_quantize_x_matches_reference(seed, K, dtype) -> None:
    x = (torch.randn(3, K) * torch.rand(3, 1) * 4).to(dtype).to(DEVICE)
    x[1, 32:64] = 0  # an all-zero block: scale 0, codes 0
    k_pad = padded_k(K)
    xq, dx, xs = quantize_x(x, k_pad)
    q_ref, dx_ref, xs_ref = quantize_x_reference(x, k_pad)
    q = unpack_xq(xq).int()
    # Codes agree except where x / dx lies within rounding of a half (then by one): the kernel's division may
    # round differently from torch's.
    scaled = torch.zeros(3, k_pad, device=DEVICE)
    scaled[:, :K] = x.float() / dx_ref.repeat_interleave(32, dim=1)[:, :K].clamp_min(1e-30)
    near_tie = ((scaled.abs() % 1) - 0.5).abs() < 1e-4
    diff = (q - q_ref.int()).abs()
    assert diff.max().item() <= 1 and bool(((diff == 0) | near_tie).all()), f"seed={seed}"
    torch.testing.assert_close(dx, dx_ref, rtol=1e-6, atol=0)
    torch.testing.assert_close(xs, xs_ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("M", [1, 3])
@pytest.mark.parametrize("qt", V2_TYPES, ids=lambda t: t.name)
def test_matmul_exact_on_int8_grid(seed, qt, M) -> None:
    # N = 48 is not a multiple of BLOCK_N; Q8_0 rows of 288 need padding; K = 512 is two 256-input chunks.
    N, K = 48, 512 if qt.is_k_quant else 288
    t = random_quantized(qt, (N, K), DEVICE)
    x = on_int8_grid(M, K, torch.float32)
    out = quant_matmul_triton(x, pack(t), config=MATMUL)
    ref = F.linear(x, t.dequantize(torch.float32))
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item(),
                               msg=lambda m: f"{qt.name} seed={seed}: {m}")  # fmt: skip


@pytest.mark.parametrize("qt", V2_TYPES, ids=lambda t: t.name)
def test_matmul_random_x_within_int8_error(seed, qt) -> None:
    N, K = 64, 2048
    t = random_quantized(qt, (N, K), DEVICE)
    x = torch.randn(2, K, device=DEVICE).bfloat16()
    bias = torch.randn(N, device=DEVICE).bfloat16()
    out = quant_matmul_triton(x, pack(t), bias, config=MATMUL)
    ref = F.linear(x.float(), t.dequantize(torch.float32), bias.float())
    # x's rounding to int8 moves each product by up to 1/254 of its block's largest |x|; over K random terms that
    # is about 0.3% of the output's scale, then the bf16 output rounds.
    err = (out.float() - ref).abs().max().item()
    assert err <= 2e-2 * ref.abs().max().item(), f"{qt.name} seed={seed}: max error {err}"


@pytest.mark.parametrize("T,k", [(1, 1), (3, 2), (8, 8)])
@pytest.mark.parametrize("qt", V2_TYPES, ids=lambda t: t.name)
def test_moe_exact_on_int8_grid(seed, qt, T, k) -> None:
    E, H, I = 9, 512, 256  # noqa: E741
    down_t = QuantType.Q6_K if qt == QuantType.Q4_K else qt
    w13 = QuantizedWeight([random_quantized(qt, (E, I, H), DEVICE), random_quantized(qt, (E, I, H), DEVICE)])
    w2 = QuantizedWeight([random_quantized(down_t, (E, H, I), DEVICE)])
    weights, ids = route_reference(torch.randn(T, E), k, True)
    weights, ids = weights.to(DEVICE), ids.to(DEVICE)
    hidden = on_int8_grid(T, H, torch.float32)
    out = fused_moe_quant(hidden, packed_parts(w13), packed_parts(w2)[0], weights, ids, MOE)
    ref = fused_moe_reference(hidden, w13, w2, weights, ids)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item(),
                               msg=lambda m: f"seed={seed} {qt.name} T={T} k={k}: {m}")  # fmt: skip
