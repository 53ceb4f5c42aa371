"""rms_norm (Triton, optionally fused with the residual add) against RMSNorm.forward_with_residual."""

from __future__ import annotations

import pytest
import torch

from helpers import assert_rare_flips, ulp_distance

pytest.importorskip("triton")

from moerun.kernels.rmsnorm import rms_norm_triton  # noqa: E402
from moerun.layers.norm import RMSNorm  # noqa: E402
from moerun.ops.norm import rms_norm, rms_norm_reference  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
EPS = 1e-6
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def assert_norm_close(out: torch.Tensor, ref: torch.Tensor, seed: int) -> None:
    """16-bit: bit-identical except rare 1-ulp flips; float32: a few ulps (see module docstring of the kernel)."""
    assert out.dtype == ref.dtype and out.shape == ref.shape, f"seed={seed}"
    if out.dtype == torch.float32:
        # the float32 sum of squares adds in another order than torch, moving the result by a few ulps
        torch.testing.assert_close(out, ref, rtol=2e-6, atol=1e-6, msg=lambda m: f"seed={seed}: {m}")
        return
    # 16-bit results round the same float32 values as torch; only a sum that lands one float32 ulp away from
    # torch's can flip a rounding, which happens to about one element in 2^15. The flip is one ulp of the normalised
    # value; its product with a weight above 1 can land two ulps of the output apart (seed 566970280: float16,
    # normalised 1.06884765625, exactly between two float16 values, times a weight of 1.277)
    ulps = ulp_distance(out, ref)
    assert ulps.max() <= 2, f"seed={seed}: {int(ulps.max())} ulps apart"
    assert_rare_flips(ulps > 0, seed)


def make_inputs(T: int, H: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x = (torch.randn(T, H) * 3).to(dtype).to(DEVICE)  # [T, H]
    residual = (torch.randn(T, H) * 3).to(dtype).to(DEVICE)  # [T, H]
    weight = (1 + 0.3 * torch.randn(H)).to(dtype).to(DEVICE)  # [H]
    return x, residual, weight


def module_forward(
    x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    norm = RMSNorm(x.shape[1], EPS).to(device=x.device, dtype=x.dtype)
    with torch.no_grad():
        norm.weight.copy_(weight)
        return norm.forward_with_residual(x, residual)


@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("T,H", [(1, 64), (5, 80)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_matches_module(seed: int, dtype: torch.dtype, T: int, H: int, with_residual: bool) -> None:
    x, residual, weight = make_inputs(T, H, dtype)
    residual = residual if with_residual else None
    out, new_residual = rms_norm_triton(x, weight, EPS, residual)
    ref_out, ref_residual = module_forward(x, weight, residual)
    # the residual sum rounds once in both, so it is always bit-identical
    assert torch.equal(new_residual, ref_residual), f"seed={seed}"
    assert_norm_close(out, ref_out, seed)


def test_rms_norm_model_width(seed: int) -> None:
    x, residual, weight = make_inputs(1, 2048, torch.bfloat16)
    out, new_residual = rms_norm_triton(x, weight, EPS, residual)
    ref_out, ref_residual = module_forward(x, weight, residual)
    assert torch.equal(new_residual, ref_residual), f"seed={seed}"
    assert_norm_close(out, ref_out, seed)


def test_rms_norm_strided_rows(seed: int) -> None:
    wide, residual, weight = make_inputs(3, 96, torch.bfloat16)
    x = wide[:, 16:80]  # [3, 64] rows 96 apart
    out, new_residual = rms_norm_triton(x, weight[:64], EPS, residual[:, :64])
    ref_out, ref_residual = module_forward(x, weight[:64], residual[:, :64])
    assert torch.equal(new_residual, ref_residual), f"seed={seed}"
    assert_norm_close(out, ref_out, seed)


def test_reference_matches_module(seed: int) -> None:
    x, residual, weight = make_inputs(4, 40, torch.bfloat16)
    for res in (None, residual):
        out, new_residual = rms_norm_reference(x, weight, EPS, res)
        ref_out, ref_residual = module_forward(x, weight, res)
        assert torch.equal(out, ref_out) and torch.equal(new_residual, ref_residual), f"seed={seed}"


def test_rms_norm_dispatch(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    x, residual, weight = make_inputs(2, 32, torch.float16)
    out, new_residual = rms_norm(x, weight, EPS, residual, backend="triton")
    assert_norm_close(out, rms_norm_reference(x, weight, EPS, residual)[0], seed)
    out, new_residual = rms_norm(x, weight, EPS, None, backend="torch")
    assert new_residual is x
    with pytest.raises(ValueError, match="unknown"):
        rms_norm(x, weight, EPS, backend="cuda")
    if DEVICE.type == "cpu":
        # the default on CPU is the torch reference, and Triton there needs the interpreter
        assert torch.equal(rms_norm(x, weight, EPS, residual)[0], rms_norm_reference(x, weight, EPS, residual)[0])
        monkeypatch.delenv("TRITON_INTERPRET")
        with pytest.raises(ValueError, match="TRITON_INTERPRET"):
            rms_norm(x, weight, EPS, backend="triton")


def test_rms_norm_rejects_mismatched_weight() -> None:
    x, _, weight = make_inputs(2, 32, torch.bfloat16)
    with pytest.raises(ValueError, match="weight"):
        rms_norm_triton(x, weight.float(), EPS)
    with pytest.raises(ValueError, match="weight"):
        rms_norm_triton(x, weight[:16], EPS)


@pytest.mark.parametrize("H,k_pad", [(64, 256), (2048, 2048), (2304, 2304)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "residual"])
def test_int8_output_is_the_quantized_norm(seed, H, k_pad, dtype, with_residual) -> None:
    # ops.rms_norm_int8: the same normed output and residual as rms_norm, and the int8 rows that quantize_x
    # gives for that output (the quantized decode kernels' input), bit for bit
    from moerun.kernels.quant.int8_dot import quantize_x
    from moerun.ops.norm import rms_norm_int8

    x = torch.randn(3, H, device=DEVICE).to(dtype)
    residual = torch.randn(3, H, device=DEVICE).to(dtype) if with_residual else None
    weight = (torch.rand(H, device=DEVICE) + 0.5).to(dtype)
    out, new_residual, rows = rms_norm_int8(x, weight, EPS, residual, k_pad)
    ref_out, ref_residual = rms_norm_triton(x, weight, EPS, residual)
    assert torch.equal(out, ref_out) and torch.equal(new_residual, ref_residual), f"seed={seed}"
    expected = quantize_x(out, k_pad)
    for got, want in zip(rows, expected):
        assert torch.equal(got, want), f"seed={seed}"


def test_int8_output_needs_a_whole_padded_row() -> None:
    from moerun.ops.norm import rms_norm_int8

    x = torch.randn(2, 300, device=DEVICE)
    with pytest.raises(ValueError, match="multiple of 256"):
        rms_norm_int8(x, torch.ones(300, device=DEVICE), EPS, None, 256)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_float32_sums_beside_a_16_bit_residual(seed, dtype) -> None:
    # An MoE's unrounded float32 slot sums (ops.fused_moe keep_float32) go to the next norm as they are: the norm,
    # its int8 rows and the torch reference round them to the residual's dtype first, so every output equals the
    # norm of the rounded sums, bit for bit
    from moerun.ops.norm import rms_norm_int8

    x32, residual, weight = make_inputs(3, 2048, torch.float32)
    residual, weight = residual.to(dtype), weight.to(dtype)
    rounded = x32.to(dtype)
    for got, want in zip(rms_norm_triton(x32, weight, EPS, residual), rms_norm_triton(rounded, weight, EPS, residual)):
        assert got.dtype == dtype and torch.equal(got, want), f"seed={seed}"
    got8, want8 = rms_norm_int8(x32, weight, EPS, residual, 2048), rms_norm_int8(rounded, weight, EPS, residual, 2048)
    for got, want in zip((*got8[:2], *got8[2]), (*want8[:2], *want8[2])):
        assert torch.equal(got, want), f"seed={seed}"
    for got, want in zip(rms_norm_reference(x32, weight, EPS, residual),
                         rms_norm_reference(rounded, weight, EPS, residual)):  # fmt: skip
        assert torch.equal(got, want), f"seed={seed}"
    with pytest.raises(ValueError, match="weight"):  # without a residual there is no dtype to round to
        rms_norm_triton(x32, weight, EPS)
