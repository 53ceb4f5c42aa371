"""Types without a repacked layout (grid, ternary, FP4) on the Triton path: dequantised from their GGUF blocks on
each call, checked against dequantise + the torch references."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from moerun.formats.quants import QuantType  # noqa: E402
from moerun.kernels.quant.from_blocks import grid_rounds_x  # noqa: E402
from moerun.kernels.quant.from_groups import group_values64, group_words64  # noqa: E402
from moerun.kernels.quant.int8_dot import quantize_x  # noqa: E402
from moerun.kernels.quant.repack import LAYOUTS  # noqa: E402
from moerun.kernels.quant.synthetic import random_quantized  # noqa: E402
from moerun.layers.quantized import QuantizedWeight  # noqa: E402
from moerun.ops import moe as moe_ops  # noqa: E402
from moerun.ops.moe_reference import fused_moe_reference, route_reference  # noqa: E402
from moerun.ops.quant import has_kernel_layout, int8_input_pad, pack_model, pack_weight, quant_matmul  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
BLOCK_TYPES = [t for t in QuantType if t.is_quantized and t not in LAYOUTS]
GROUP_TYPES = [t for t in BLOCK_TYPES if t.name.startswith(("IQ1", "IQ2", "IQ3"))]
# Error allowed relative to the largest reference magnitude (both round the weights to bfloat16; the GEMM
# outputs are rounded at different points; on a GPU the decode kernels also round x and the MoE's intermediate
# to int8 per 32 values).
TOL = 4e-2 if DEVICE.type == "cuda" else 2e-2
# The MoE's few-pairs path rounds its intermediate to int8 per 32 values before a repacked down projection
# (gemv_v2's GEMM 2) in the interpreter too: up to 2.8% of the largest output over 150 seeds.
TOL_INT8_DOWN = 4e-2


def test_every_read_only_type_is_covered() -> None:
    names = {t.name for t in BLOCK_TYPES}
    assert names == {"IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ1_S", "IQ1_M", "TQ1_0", "TQ2_0", "NVFP4"}


@pytest.mark.parametrize("qt", BLOCK_TYPES, ids=lambda t: t.name)
def test_linear_reads_the_blocks(seed, qt: QuantType) -> None:
    w = QuantizedWeight([random_quantized(qt, (48, 256), DEVICE), random_quantized(QuantType.Q8_0, (16, 256), DEVICE)])
    assert not has_kernel_layout(w)
    dense = w.dequantize(torch.bfloat16)
    few = torch.randn(3, 256, device=DEVICE).bfloat16()  # a GEMV over the blocks
    rounds = qt in GROUP_TYPES and grid_rounds_x()  # on a GPU: x rounded to int8, which a producer may hand over
    assert int8_input_pad(few, w, backend="triton") == (256 if rounds else None)
    ref = F.linear(few.float(), dense.float())
    out = quant_matmul(few, w, backend="triton")
    assert out.dtype == few.dtype and out.shape == (3, 64)
    torch.testing.assert_close(out.float(), ref, rtol=1e-2, atol=1e-2 * ref.abs().max().item(),
                               msg=lambda m: f"seed={seed}: {m}")  # fmt: skip
    assert torch.equal(quant_matmul(few, w, backend="triton", x_int8=quantize_x(few, 256)), out)  # rounded alike
    many = torch.randn(2, 6, 256, device=DEVICE).bfloat16()
    out = quant_matmul(many, w, backend="triton")
    if qt in GROUP_TYPES:  # the tile kernels decode the blocks as they multiply
        ref = F.linear(many.float(), dense.float())
        torch.testing.assert_close(out.float(), ref, rtol=1e-2, atol=1e-2 * ref.abs().max().item(),
                                   msg=lambda m: f"seed={seed}: {m}")  # fmt: skip
    else:  # dequantised once, then one matmul
        assert torch.equal(out, F.linear(many, dense))
    assert w.parts, "the blocks stay"


def _experts(qt: QuantType, E: int, H: int, I: int, down_qt: QuantType | None = None):  # noqa: E741
    gate = random_quantized(qt, (E, I, H), DEVICE)
    up = random_quantized(qt, (E, I, H), DEVICE)
    down_qt = down_qt or (QuantType.Q4_K if qt != QuantType.NVFP4 else qt)
    down = random_quantized(down_qt, (E, H, I), DEVICE)
    return QuantizedWeight([gate, up]), QuantizedWeight([down])


@pytest.mark.parametrize("T", [1, 3, 5], ids=lambda t: f"T{t}")  # few pairs: gathered experts; else the layer
@pytest.mark.parametrize("qt", [QuantType.IQ2_XXS, QuantType.IQ3_S, QuantType.IQ1_M, QuantType.NVFP4],
                         ids=lambda t: t.name)
def test_moe_matches_reference(seed, qt: QuantType, T: int) -> None:
    E, H, I, k = 8, 256, 256, 2  # noqa: E741
    w13, w2 = _experts(qt, E, H, I)
    weights, ids = route_reference(torch.randn(T, E), k, True)
    weights, ids = weights.to(DEVICE), ids.to(DEVICE)
    hidden = torch.randn(T, H, device=DEVICE).bfloat16()
    out = moe_ops.fused_moe(hidden, w13, w2, weights, ids, backend="triton")
    ref = fused_moe_reference(hidden, w13, w2, weights, ids)
    assert out.dtype == hidden.dtype and out.shape == hidden.shape
    scale = ref.float().abs().max().item()
    tol = TOL_INT8_DOWN if has_kernel_layout(w2) else TOL  # a Q4_K down: the intermediate rounded to int8
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol * scale, msg=lambda m: f"seed={seed}: {m}")
    if T == 3 and has_kernel_layout(w2):  # the down projection repacked and its blocks dropped, as on CUDA
        pack_weight(w2, release_blocks=True)
        again = moe_ops.fused_moe(hidden, w13, w2, weights, ids, backend="triton")
        torch.testing.assert_close(again.float(), ref.float(), rtol=tol, atol=tol * scale,
                                   msg=lambda m: f"seed={seed}, repacked w2: {m}")  # fmt: skip


@pytest.mark.parametrize("types", [(QuantType.IQ2_XXS, QuantType.IQ3_S), (QuantType.IQ1_M, QuantType.IQ2_S)],
                         ids=lambda t: f"{t[0].name}-{t[1].name}")
def test_grid_experts_in_two_launches_match_reference(seed, types) -> None:
    # gate, up and down all grid types: silu(gate) * up in one GEMV, the routing weights in the other
    E, H, I, k = 8, 256, 256, 2  # noqa: E741
    w13, w2 = _experts(types[0], E, H, I, down_qt=types[1])
    weights, ids = route_reference(torch.randn(3, E), k, True)
    hidden = torch.randn(3, H, device=DEVICE).bfloat16()
    out = moe_ops.fused_moe(hidden, w13, w2, weights.to(DEVICE), ids.to(DEVICE), backend="triton")
    ref = fused_moe_reference(hidden, w13, w2, weights.to(DEVICE), ids.to(DEVICE))
    scale = ref.float().abs().max().item()
    torch.testing.assert_close(out.float(), ref.float(), rtol=TOL, atol=TOL * scale, msg=lambda m: f"seed={seed}: {m}")


@pytest.mark.parametrize("x_q8", [False, True], ids=["float_x", "int8_x"])
def test_block_gemv_fuses_gate_up_and_routing_weights(seed, x_q8: bool) -> None:
    from moerun.kernels.quant.from_blocks import block_gemv

    qt = QuantType.IQ2_S
    (E, N, K, k), gate, _, x, ids = _pairs_case(qt)
    up = random_quantized(qt, (E, N, K), DEVICE)
    shape = (E, N, K)
    act = block_gemv(gate.raw, qt, shape, x, ids, k, x_q8=x_q8, up_raw=up.raw)  # [6, N]
    ref = F.silu(block_gemv(gate.raw, qt, shape, x, ids, k, x_q8=x_q8)) * block_gemv(up.raw, qt, shape, x, ids, k,
                                                                                      x_q8=x_q8)  # fmt: skip
    torch.testing.assert_close(act, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item(), msg=lambda m: f"{seed}: {m}")
    w = torch.rand(ids.numel(), device=DEVICE)
    got = block_gemv(gate.raw, qt, shape, x, ids, k, x_q8=x_q8, weights=w, out_dtype=torch.float64)
    ref = block_gemv(gate.raw, qt, shape, x, ids, k, x_q8=x_q8).double() * w.double()[:, None]
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item(), msg=lambda m: f"{seed}: {m}")
    summed = block_gemv(gate.raw, qt, shape, x, ids, k, x_q8=x_q8, weights=w, out_dtype=torch.float64, sum_slots=k)
    ref = ref.view(-1, k, N).sum(dim=1)  # [3, N]: each token's slots
    torch.testing.assert_close(summed, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item(), msg=lambda m: f"{seed}: {m}")
    # the step loop unrolled (config key unroll): the slots' steps follow each other with no loop between them
    unrolled = block_gemv(gate.raw, qt, shape, x, ids, k, x_q8=x_q8, weights=w, out_dtype=torch.float64, sum_slots=k,
                          config={"BLOCK_N": 8, "GROUPS": 16, "num_warps": 2, "unroll": 1})  # fmt: skip
    torch.testing.assert_close(unrolled, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item(),
                               msg=lambda m: f"{seed}: {m}")  # fmt: skip
    with pytest.raises(ValueError, match="do not match"):
        block_gemv(gate.raw, qt, shape, x, ids, k, up_raw=up.raw[:2])
    with pytest.raises(ValueError, match="sum_slots"):
        block_gemv(gate.raw, qt, shape, x, ids, k, sum_slots=4)  # 6 pairs


@pytest.mark.parametrize("qt", [QuantType.IQ3_S, QuantType.IQ1_M, QuantType.IQ2_XS], ids=lambda t: t.name)
@pytest.mark.parametrize("cfg", [{"BLOCK_N": 8, "GROUPS": 64, "num_warps": 2},
                                 {"BLOCK_N": 2, "GROUPS": 128, "num_warps": 4, "gather": 1},
                                 {"BLOCK_N": 8, "GROUPS": 64, "num_warps": 2, "gather": 1, "unroll": 1}],
                         ids=["2_steps", "1_step_gathered", "2_steps_unrolled"])  # fmt: skip
def test_block_gemv_steps_past_the_row_count_nothing(seed, qt: QuantType, cfg) -> None:
    # K = 768: 96 groups a row, so the last step of 64 (and the one step of 128) holds 32 groups past the row; the
    # table read per lane from global memory, or gathered from the program's copy in registers
    from moerun.kernels.quant.from_blocks import block_gemv
    from moerun.kernels.quant.int8_dot import dequantize_xq, quantize_x

    E, N, K, k = 3, 20, 768, 2
    w = random_quantized(qt, (E, N, K), DEVICE)
    dense = w.dequantize(torch.float32)
    x = torch.randn(2, K, device=DEVICE)
    ids = torch.tensor([2, 0, 1, 2], device=DEVICE)
    x_hat = dequantize_xq(*quantize_x(x, K)[:2])
    for q8, xs in ((False, x), (True, x_hat)):
        got = block_gemv(w.raw, qt, (E, N, K), x, ids, x_div=k, x_q8=q8, config=cfg)  # [4, N]
        ref = torch.einsum("pnk,pk->pn", dense[ids], xs.repeat_interleave(k, 0))
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item(),
                                   msg=lambda m: f"seed={seed} q8={q8}: {m}")  # fmt: skip


def test_gathered_experts_equal_stacked_ones() -> None:
    w13, _ = _experts(QuantType.IQ3_XXS, 6, 256, 256)
    ids = torch.tensor([4, 0, 4, 5], device=DEVICE)
    got = w13.experts(ids, torch.float32)  # [4, 512, 256]
    assert torch.equal(got, torch.stack([w13.expert(int(e), torch.float32) for e in ids.tolist()]))


def test_pack_model_keeps_the_blocks_of_read_only_types() -> None:
    module = torch.nn.Module()
    module.__dict__["q_a"] = QuantizedWeight([random_quantized(QuantType.IQ2_S, (8, 256), DEVICE)])
    module.__dict__["q_b"] = QuantizedWeight([random_quantized(QuantType.Q4_K, (8, 256), DEVICE)])
    assert pack_model(module, release_blocks=True) == 1
    assert module.__dict__["q_a"].parts and "packed" not in module.__dict__["q_a"].__dict__
    assert module.__dict__["q_b"].released


@pytest.mark.parametrize("qt", BLOCK_TYPES, ids=lambda t: t.name)
def test_block_dequant_kernel_is_bit_exact(seed, qt: QuantType) -> None:
    from moerun.kernels.quant.from_blocks import block_dequantize

    E, N, K = 3, 40, 512  # N: one full and one partial program of 32 rows
    w = random_quantized(qt, (E, N, K), DEVICE, any_scales=True)
    ref = w.dequantize(torch.float32)
    got = block_dequantize(w.raw, qt, (E, N, K), torch.float32)
    mismatch = (got.view(torch.int32) != ref.view(torch.int32)).nonzero()
    assert mismatch.numel() == 0, f"seed={seed}: first mismatches at {mismatch[:4].tolist()}"
    # Weights of the usual size (the interpreter's emulated bf16 rounding does not cover float32 subnormals)
    w = random_quantized(qt, (E, N, K), DEVICE)
    ids = torch.tensor([2, 0, 2], device=DEVICE)
    picked = block_dequantize(w.raw, qt, (E, N, K), torch.bfloat16, ids=ids)
    assert torch.equal(picked, w.dequantize(torch.float32)[ids].to(torch.bfloat16))
    K = 544 if qt.block_elems == 32 else K  # a 32-element type's blocks one a step
    flat = random_quantized(qt, (N, K), DEVICE, any_scales=True)
    assert torch.equal(block_dequantize(flat.raw, qt, (N, K), torch.float32), flat.dequantize(torch.float32))


def _pairs_case(qt: QuantType):
    """A stacked weight of 4 experts [40, 512], 3 tokens of x and the experts of their 2 slots each."""
    E, N, K, k = 4, 40, 512, 2
    w = random_quantized(qt, (E, N, K), DEVICE)
    x = torch.randn(3, K, device=DEVICE)
    ids = torch.tensor([3, 1, 0, 3, 2, 2], device=DEVICE)  # pairs (token p // k, expert ids[p])
    return (E, N, K, k), w, w.dequantize(torch.float32), x, ids


@pytest.mark.parametrize("qt", BLOCK_TYPES, ids=lambda t: t.name)
def test_block_gemv_matches_dequantised_product(seed, qt: QuantType) -> None:
    from moerun.kernels.quant.from_blocks import block_gemv

    (E, N, K, k), w, dense, x, ids = _pairs_case(qt)
    got = block_gemv(w.raw, qt, (E, N, K), x, ids, x_div=k, x_q8=False)  # [6, N], float x (the GPU rounds it)
    ref = torch.einsum("pnk,pk->pn", dense[ids], x.repeat_interleave(k, 0))
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item(), msg=lambda m: f"{seed}: {m}")
    flat = random_quantized(qt, (N, K), DEVICE)
    got = block_gemv(flat.raw, qt, (N, K), x, x_q8=False)  # [3, N]
    ref = x @ flat.dequantize(torch.float32).t()
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item(), msg=lambda m: f"{seed}: {m}")


@pytest.mark.parametrize("qt", GROUP_TYPES, ids=lambda t: t.name)
def test_block_gemv_with_int8_x_matches_the_product_of_rounded_x(seed, qt: QuantType) -> None:
    # the GPU's default for the grid types: x rounded to int8 per 32 values, four products a dp4a
    from moerun.kernels.quant.from_blocks import block_gemv
    from moerun.kernels.quant.int8_dot import dequantize_xq, quantize_x

    (E, N, K, k), w, dense, x, ids = _pairs_case(qt)
    rounded = quantize_x(x, K)
    x_hat = dequantize_xq(rounded.xq, rounded.dx)  # [3, K]: the values the kernel multiplies
    got = block_gemv(w.raw, qt, (E, N, K), x, ids, x_div=k, x_q8=True)  # [6, N]
    ref = torch.einsum("pnk,pk->pn", dense[ids], x_hat.repeat_interleave(k, 0))
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item(), msg=lambda m: f"{seed}: {m}")
    assert (got - torch.einsum("pnk,pk->pn", dense[ids], x.repeat_interleave(k, 0))).abs().max() > 0  # x rounded


def test_block_scratch_counts_the_largest_dense_copy() -> None:
    from moerun.ops.quant import block_scratch_bytes

    model = torch.nn.Module()
    model.a, model.b, model.c = torch.nn.Module(), torch.nn.Module(), torch.nn.Module()
    model.a.__dict__["q_w13"] = QuantizedWeight([random_quantized(QuantType.NVFP4, (4, 64, 256), DEVICE)])
    model.a.__dict__["q_w2"] = QuantizedWeight([random_quantized(QuantType.IQ3_S, (4, 256, 256), DEVICE)])
    model.b.__dict__["q_weight"] = QuantizedWeight([random_quantized(QuantType.Q4_K, (512, 256), DEVICE)])  # packed
    # read by the tile kernels as they are: no dense copy
    model.c.__dict__["q_w13"] = QuantizedWeight([random_quantized(QuantType.IQ2_XXS, (4, 512, 256), DEVICE)])
    model.c.__dict__["q_w2"] = QuantizedWeight([random_quantized(QuantType.Q4_K, (4, 256, 256), DEVICE)])
    model.c.__dict__["q_weight"] = QuantizedWeight([random_quantized(QuantType.IQ1_S, (64, 256), DEVICE)])
    assert block_scratch_bytes(model, torch.bfloat16) == 2 * 4 * (64 * 256 + 256 * 256)
    model.c.__dict__["q_weight"] = QuantizedWeight([random_quantized(QuantType.TQ2_0, (2048, 256), DEVICE)])
    assert block_scratch_bytes(model, torch.bfloat16) == 2 * 2048 * 256
    # a repacked gate/up beside an NVFP4 down: the layer is dequantised whole, both count
    model.c.__dict__["q_w13"] = QuantizedWeight([random_quantized(QuantType.Q4_K, (4, 2048, 256), DEVICE)])
    model.c.__dict__["q_w2"] = QuantizedWeight([random_quantized(QuantType.NVFP4, (4, 256, 1024), DEVICE)])
    assert block_scratch_bytes(model, torch.bfloat16) == 2 * (2048 * 256 + 4 * (2048 * 256 + 256 * 1024))


@triton.jit
def _decode_pairs_kernel(out_ptr, raw, grid, KQ, QTYPE: tl.constexpr, INTERPRET: tl.constexpr):
    """from_groups' tile decode as the tile kernels run it (each step's words loaded the step before)."""
    rows = (tl.program_id(0) * 16 + tl.arange(0, 16)).to(tl.int64)[:, None]  # [16, 1]
    cols = tl.arange(0, 64)[None, :]
    w0, w1, sc, dl = group_words64(QTYPE, raw, grid, rows, 0, KQ)
    for q in range(0, KQ):
        v = group_values64(QTYPE, w0, w1, sc, dl, INTERPRET)  # [16, 64]
        w0, w1, sc, dl = group_words64(QTYPE, raw, grid, rows, tl.minimum(q + 1, KQ - 1), KQ)
        tl.store(out_ptr + rows * (KQ * 64) + q * 64 + cols, v)


@pytest.mark.parametrize("qt", GROUP_TYPES, ids=lambda t: t.name)
def test_tile_decode_of_grid_types_is_bit_exact(seed, qt: QuantType) -> None:
    from moerun.kernels.interpreter import interpreting
    from moerun.kernels.quant.from_blocks import GroupBlocks

    N, K = 32, 512
    w = GroupBlocks.of(random_quantized(qt, (N, K), DEVICE, any_scales=True))
    out = torch.empty(N, K, device=DEVICE)
    _decode_pairs_kernel[(N // 16,)](out, w.codes, w.high, K // 64, QTYPE=int(qt), INTERPRET=interpreting())
    ref = w.dequantize(torch.float32)
    # equal as floats: where a block's d is zero the FMA gives +0 and the decoder's product may give -0
    mismatch = (out != ref).nonzero()
    assert mismatch.numel() == 0, f"seed={seed}: first mismatches at {mismatch[:4].tolist()}"


# gate/up type, down type: every grid type once as gate/up, downs of grid and repacked types
TILE_CASES = [(QuantType.IQ2_XXS, QuantType.Q4_K), (QuantType.IQ2_XS, QuantType.IQ3_XXS),
              (QuantType.IQ2_S, QuantType.Q6_K), (QuantType.IQ3_XXS, QuantType.IQ1_S),
              (QuantType.IQ3_S, QuantType.IQ2_S), (QuantType.IQ1_S, QuantType.IQ1_M),
              (QuantType.IQ1_M, QuantType.IQ3_S)]  # fmt: skip


@pytest.mark.parametrize("types", TILE_CASES, ids=lambda t: f"{t[0].name}-{t[1].name}")
def test_grid_experts_at_prefill_sizes_run_the_tile_kernels(seed, types) -> None:
    from moerun.kernels.quant.fused_moe_quant import fused_moe_quant
    from moerun.ops.quant import moe_tile_parts

    E, H, I, k, T = 8, 256, 256, 2, 12  # noqa: E741
    w13, w2 = _experts(types[0], E, H, I, down_qt=types[1])
    weights, ids = route_reference(torch.randn(T, E), k, True)
    weights, ids = weights.to(DEVICE), ids.to(DEVICE)
    hidden = torch.randn(T, H, device=DEVICE)
    ref = fused_moe_reference(hidden, w13, w2, weights, ids)
    p13, p2 = moe_tile_parts(w13, w2)
    out = fused_moe_quant(hidden, p13, p2, weights, ids)  # float32: the decode is exact, the sums reordered
    scale = ref.abs().max().item()
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4 * scale, msg=lambda m: f"seed={seed}: {m}")
    if types[1] == QuantType.Q4_K:  # through the op, in bfloat16, as a model runs it
        out = moe_ops.fused_moe(hidden.bfloat16(), w13, w2, weights, ids, backend="triton")
        ref = fused_moe_reference(hidden.bfloat16(), w13, w2, weights, ids).float()
        torch.testing.assert_close(out.float(), ref, rtol=TOL, atol=TOL * scale, msg=lambda m: f"seed={seed}: {m}")


def test_tile_kernels_take_grid_experts_only_as_they_can() -> None:
    from moerun.kernels.quant.fused_moe_quant import fused_moe_quant
    from moerun.kernels.quant.repack import PackedWeight
    from moerun.ops.quant import moe_tile_parts

    E, H, I = 4, 256, 256  # noqa: E741
    mixed = QuantizedWeight([random_quantized(QuantType.IQ2_XXS, (E, I, H), DEVICE),
                             random_quantized(QuantType.Q4_K, (E, I, H), DEVICE)])  # fmt: skip
    down = QuantizedWeight([random_quantized(QuantType.Q4_K, (E, H, I), DEVICE)])
    assert moe_tile_parts(mixed, down) is None  # gate a grid type, up not: dequantised instead
    fp4 = QuantizedWeight([random_quantized(QuantType.NVFP4, (E, H, I), DEVICE)])
    w13, _ = _experts(QuantType.IQ3_S, E, H, I)
    assert moe_tile_parts(w13, fp4) is None
    p13, p2 = moe_tile_parts(w13, down)
    hidden = torch.randn(3, H, device=DEVICE)
    weights, ids = route_reference(torch.randn(3, E), 2, True)
    with pytest.raises(ValueError, match="tile64 path alone"):
        fused_moe_quant(hidden, p13, p2, weights.to(DEVICE), ids.to(DEVICE),
                        config={"path": "gemv", "BLOCK_N": 16, "BLOCK_K": 256})
    raw = [PackedWeight(p.qtype, p.shape, p.k_pad, p.codes, p.high) for p in p13]  # not read as blocks
    with pytest.raises(ValueError, match="GGUF blocks"):
        fused_moe_quant(hidden, raw, p2, weights.to(DEVICE), ids.to(DEVICE))
