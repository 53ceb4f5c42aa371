"""The int8-x decode path (config keys "x_q8" and "inter_q8", kernels/quant/int8_dot.py): x's int8 quantization
against its torch reference, and the quantized matmul and MoE on it against dequantise + reference. The kernels
compute W x^ (x^ the int8-rounded x) to float32 rounding: on x already on an int8 grid (a power-of-two scale per 32
values, each block reaching 127) that is W x itself; on random x the reference multiplies the x^ the kernels'
quantization produced (whose codes are checked on their own)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from helpers import on_int8_grid

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

from moerun.formats.quants import IQ4_VALUES, QuantType  # noqa: E402
from moerun.kernels.quant.fused_moe_quant import fused_moe_quant  # noqa: E402
from moerun.kernels.quant.gemv_v2 import V2_TYPES  # noqa: E402
from moerun.kernels.quant.int8_dot import (  # noqa: E402
    dequantize_xq, emulate_dp4a, quantize_x, quantize_x_reference, unpack_xq,
)
from moerun.kernels.quant.iq4_levels import iq4_levels  # noqa: E402
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
    # sums of 16 of x^ = dx * codes, the kernel's own codes
    xs_own = dequantize_xq(xq, dx).view(3, -1, 16).sum(dim=2)
    torch.testing.assert_close(xs, xs_own, rtol=1e-5, atol=1e-5 * xs_own.abs().max().item())
    near = ((xs - xs_ref).abs() > 1e-5 * xs_ref.abs().max().item()).sum().item()
    assert near <= near_tie.sum().item()


@pytest.mark.parametrize("M", [1, 3])
@pytest.mark.parametrize("qt", V2_TYPES, ids=lambda t: t.name)
def test_matmul_exact_on_int8_grid(seed, qt, M) -> None:
    # N = 48 is not a multiple of BLOCK_N; Q8_0 rows of 288 need padding; K = 512 is two 256-input chunks.
    N, K = 48, 512 if qt.is_k_quant else 288
    t = random_quantized(qt, (N, K), DEVICE)
    x = on_int8_grid(M, K, torch.float32, DEVICE)
    out = quant_matmul_triton(x, pack(t), config=MATMUL)
    ref = F.linear(x, t.dequantize(torch.float32))
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item(),
                               msg=lambda m: f"{qt.name} seed={seed}: {m}")  # fmt: skip


def x_hat(x: torch.Tensor) -> torch.Tensor:
    """The int8-rounded x [T, K] that the kernels multiply (quantize_x's own codes and scales)."""
    xq, dx, _ = quantize_x(x, padded_k(x.shape[1]))
    return dequantize_xq(xq, dx)[:, : x.shape[1]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("qt", V2_TYPES, ids=lambda t: t.name)
def test_matmul_random_x_is_w_times_rounded_x(seed, qt, dtype) -> None:
    N, K = 64, 2048
    t = random_quantized(qt, (N, K), DEVICE)
    x = torch.randn(2, K, device=DEVICE).to(dtype)
    bias = torch.randn(N, device=DEVICE).to(dtype)
    out = quant_matmul_triton(x, pack(t), bias, config=MATMUL)
    ref = F.linear(x_hat(x), t.dequantize(torch.float32), bias.float())
    tol = 1e-4 if dtype == torch.float32 else 8e-3  # float32, or the bf16 output's rounding
    torch.testing.assert_close(out.float(), ref, rtol=tol, atol=tol * ref.abs().max().item(),
                               msg=lambda m: f"{qt.name} seed={seed}: {m}")  # fmt: skip


@pytest.mark.parametrize("T,k", [(1, 1), (3, 2), (8, 8)])
@pytest.mark.parametrize("qt", V2_TYPES, ids=lambda t: t.name)
def test_moe_exact_on_int8_grid(seed, qt, T, k) -> None:
    E, H, I = 9, 512, 256  # noqa: E741
    # a Q5_K or IQ4 down would take an int8 intermediate (test_q5_k_reads_int8_only); their gate / up are
    # checked here
    down_t = qt if qt in (QuantType.Q6_K, QuantType.Q8_0) else QuantType.Q6_K
    w13 = QuantizedWeight([random_quantized(qt, (E, I, H), DEVICE), random_quantized(qt, (E, I, H), DEVICE)])
    w2 = QuantizedWeight([random_quantized(down_t, (E, H, I), DEVICE)])
    weights, ids = route_reference(torch.randn(T, E), k, True)
    weights, ids = weights.to(DEVICE), ids.to(DEVICE)
    hidden = on_int8_grid(T, H, torch.float32, DEVICE)
    out = fused_moe_quant(hidden, packed_parts(w13), packed_parts(w2)[0], weights, ids, MOE)
    ref = fused_moe_reference(hidden, w13, w2, weights, ids)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item(),
                               msg=lambda m: f"seed={seed} {qt.name} T={T} k={k}: {m}")  # fmt: skip


def int8_moe_reference(hidden, w13, w2, weights, ids) -> torch.Tensor:
    """The MoE as the "inter_q8" kernels compute it, in float32: gate and up times x^, SiLU(gate) * up rounded to
    int8 per 32 values, down times that, weighted and summed over the k slots."""
    xh = x_hat(hidden)  # [T, H]
    gate_up = w13.dequantize(torch.float32)  # [E, 2I, H]
    down = w2.dequantize(torch.float32)  # [E, H, I]
    I = down.shape[2]  # noqa: E741
    out = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
    for t in range(hidden.shape[0]):
        g_u = gate_up[ids[t].long()] @ xh[t]  # [k, 2I]
        act = F.silu(g_u[:, :I]) * g_u[:, I:]  # [k, I]
        q, d, _ = quantize_x_reference(act, padded_k(I))
        act_hat = (q.float().view(q.shape[0], -1, 32) * d[..., None]).view(q.shape)[:, :I]
        out[t] = (weights[t, :, None] * (down[ids[t].long()] @ act_hat[..., None])[..., 0]).sum(dim=0)
    return out


@pytest.mark.parametrize("T,k", [(1, 2), (3, 8)])
@pytest.mark.parametrize("qt", V2_TYPES, ids=lambda t: t.name)
def test_moe_int8_intermediate_within_int8_error(seed, qt, T, k) -> None:
    # "inter_q8": GEMM 1 writes SiLU(gate) * up as int8 (words, scales per 32, sums of 16) and GEMM 2 takes dp4a
    # too. I = 160 pads to 256: the padded words must read as zeros.
    E, H = 9, 512
    for I in (256, 160):  # noqa: E741
        down_t = QuantType.Q6_K if qt == QuantType.Q4_K else qt
        w13 = QuantizedWeight([random_quantized(qt, (E, I, H), DEVICE), random_quantized(qt, (E, I, H), DEVICE)])
        # K-quant rows are whole 256-element super-blocks: down rows of 160 take Q8_0
        w2 = QuantizedWeight([random_quantized(down_t if I % 256 == 0 else QuantType.Q8_0, (E, H, I), DEVICE)])
        weights, ids = route_reference(torch.randn(T, E), k, True)
        weights, ids = weights.to(DEVICE), ids.to(DEVICE)
        hidden = torch.randn(T, H, device=DEVICE)
        out = fused_moe_quant(hidden, packed_parts(w13), packed_parts(w2)[0], weights, ids, {**MOE, "inter_q8": True})
        ref = int8_moe_reference(hidden, w13, w2, weights, ids)
        # An intermediate value within float32 rounding of a half step may round the other way than in the
        # reference: one step of one value, far below the int8 error itself (about 2% of the scale here).
        err = (out - ref).abs().max().item()
        assert err <= 2e-3 * ref.abs().max().item(), f"seed={seed} {qt.name} I={I}: max error {err}"


def test_matmul_reads_int8_rows_handed_over(seed) -> None:
    # x rounded by its producer (ops.rms_norm_int8) is what the parts that round x read: the same rows give the
    # same result bit for bit, other rows another result; parts on float x ignore them.
    K = 512
    parts = [pack(random_quantized(QuantType.Q4_K, (32, K), DEVICE)), pack(random_quantized(QuantType.Q6_K, (16, K),
                                                                                             DEVICE))]  # fmt: skip
    x = torch.randn(2, K, device=DEVICE)
    own = quant_matmul_triton(x, parts, config=MATMUL)
    rows = quantize_x(x, padded_k(K))
    assert torch.equal(quant_matmul_triton(x, parts, config=MATMUL, x_int8=rows), own), f"seed={seed}"
    other = quantize_x(torch.randn(2, K, device=DEVICE), padded_k(K))
    assert not torch.equal(quant_matmul_triton(x, parts, config=MATMUL, x_int8=other), own)
    float_x = {**MATMUL, "x_q8": False}
    assert torch.equal(quant_matmul_triton(x, parts, config=float_x, x_int8=other),
                       quant_matmul_triton(x, parts, config=float_x))  # fmt: skip


def test_q5_k_reads_int8_only(seed) -> None:
    # Q5_K has no float-x variant: a gemv_v2 config without x_q8 is refused (dense GEMV and MoE), and a Q5_K down
    # projection gets an int8 intermediate whether or not the config asks for one.
    E, H, I, T, k = 9, 512, 256, 3, 2  # noqa: E741
    q5 = QuantType.Q5_K
    w13 = QuantizedWeight([random_quantized(q5, (E, I, H), DEVICE), random_quantized(q5, (E, I, H), DEVICE)])
    w2 = QuantizedWeight([random_quantized(q5, (E, H, I), DEVICE)])
    p13, p2 = packed_parts(w13), packed_parts(w2)[0]
    weights, ids = route_reference(torch.randn(T, E), k, True)
    weights, ids = weights.to(DEVICE), ids.to(DEVICE)
    hidden = torch.randn(T, H, device=DEVICE)
    with pytest.raises(ValueError, match="Q5_K weights on the gemv_v2 path need int8 x"):
        fused_moe_quant(hidden, p13, p2, weights, ids, {**MOE, "x_q8": False})
    with pytest.raises(ValueError, match="need int8 x"):
        quant_matmul_triton(hidden, [pack(random_quantized(q5, (16, H), DEVICE))], config={**MATMUL, "x_q8": False})
    implied = fused_moe_quant(hidden, p13, p2, weights, ids, MOE)
    assert torch.equal(implied, fused_moe_quant(hidden, p13, p2, weights, ids, {**MOE, "inter_q8": True}))


@triton.jit
def _levels_kernel(w_ptr, lo_ptr, hi_ptr, UNSIGNED: tl.constexpr, EMULATE: tl.constexpr, N: tl.constexpr):
    offs = tl.arange(0, N)
    lo, hi = iq4_levels(tl.load(w_ptr + offs), UNSIGNED, EMULATE)
    tl.store(lo_ptr + offs, lo)
    tl.store(hi_ptr + offs, hi)


@pytest.mark.parametrize("unsigned", [False, True], ids=["signed", "plus_128"])
def test_iq4_levels_of_packed_codes(seed, unsigned) -> None:
    # byte b of a code word: low nibble a plane-0 code, high nibble a plane-1 code; each becomes its level
    # (IQ4_VALUES) in byte b of the plane's word. On the GPU through prmt, in the interpreter through its emulation.
    n = 512
    w = torch.randint(-(2**31), 2**31 - 1, (n,), dtype=torch.int64).to(torch.int32).to(DEVICE)
    lo, hi = torch.empty_like(w), torch.empty_like(w)
    _levels_kernel[(1,)](w, lo, hi, UNSIGNED=unsigned, EMULATE=emulate_dp4a(), N=n)
    codes = w.cpu().view(torch.uint8).view(n, 4).long()
    table = torch.tensor(IQ4_VALUES) + (128 if unsigned else 0)
    as_bytes = torch.uint8 if unsigned else torch.int8
    for got, nibbles in ((lo, codes & 15), (hi, codes >> 4)):
        assert torch.equal(got.cpu().view(as_bytes).view(n, 4).long(), table[nibbles]), f"seed={seed}"
