"""The gemv_v2 decode path of the quantized fused MoE against dequantise + fused_moe_reference (Q4_K, Q6_K,
Q8_0), its fallback for other types, its chunking of K, and (CUDA only) CUDA-graph capture; the same path of the
quantized matmul against x @ dequantize(W)^T."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from helpers import check_graphed_moe, reference_rounding

pytest.importorskip("triton")

from moerun.formats.quants import QuantizedTensor, QuantType  # noqa: E402
from moerun.kernels.quant.configs import default_moe_config, normalize_config  # noqa: E402
from moerun.kernels.quant.fused_moe_quant import fused_moe_quant  # noqa: E402
from moerun.kernels.quant.gemv_v2 import FLOAT_X_TYPES, chunking  # noqa: E402
from moerun.kernels.quant.matmul_quant import quant_matmul_triton  # noqa: E402
from moerun.kernels.quant.repack import expert_addresses, pack  # noqa: E402
from moerun.kernels.quant.synthetic import random_quantized  # noqa: E402
from moerun.kernels.router import route_triton  # noqa: E402
from moerun.layers.quantized import QuantizedWeight  # noqa: E402
from moerun.ops.moe_reference import fused_moe_reference, route_reference  # noqa: E402
from moerun.ops.quant import packed_parts  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
ON_CUDA = DEVICE.type == "cuda"

# The interpreter runs programs one by one: one program covers the tests' I (GEMM 1) and H (GEMM 2) there.
if ON_CUDA:
    V2 = {"path": "gemv_v2", "BLOCK_N": 16, "BLOCK_K": 512, "num_warps": 4, "BLOCK_N2": 8, "BLOCK_K2": 256,
          "num_warps2": 4}  # fmt: skip
else:
    V2 = {"path": "gemv_v2", "BLOCK_N": 256, "BLOCK_K": 4096, "BLOCK_N2": 256, "BLOCK_K2": 4096}
# GEMM 1 in many small chunks; GEMM 2's 24 (Q8_0: 48) groups as a remainder of two chunks (16 + 8, 32 + 16).
V2_CHUNKED = {**V2, "BLOCK_K": 128, "BLOCK_K2": 1024}
V2_PREP = {**V2, "x_prep": True}  # GEMM 1 reads x prepared once in the weights' position-major layout
TOLERANCE = {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 3e-2}


def make_experts(E: int, H: int, I: int, gate_t, down_t=None):  # noqa: E741
    """QuantizedWeights w13 = [gate, up] [E, I, H] each (one type) and w2 [E, H, I]."""
    gate = random_quantized(gate_t, (E, I, H), DEVICE)
    up = random_quantized(gate_t, (E, I, H), DEVICE)
    down = random_quantized(down_t or gate_t, (E, H, I), DEVICE)
    return QuantizedWeight([gate, up]), QuantizedWeight([down])


def check(seed, T, E, H, I, k, gate_t, down_t, dtype, config) -> None:  # noqa: E741
    w13, w2 = make_experts(E, H, I, gate_t, down_t)
    weights, ids = route_reference(torch.randn(T, E), k, True)
    weights, ids = weights.to(DEVICE), ids.to(DEVICE)
    hidden = torch.randn(T, H, device=DEVICE).to(dtype)
    out = fused_moe_quant(hidden, packed_parts(w13), packed_parts(w2)[0], weights, ids, config)
    ref = fused_moe_reference(hidden, w13, w2, weights, ids)
    assert out.dtype == dtype and out.shape == (T, H)
    tol = TOLERANCE[dtype]
    scale = ref.float().abs().max().item() + 1e-6
    own = reference_rounding(ref, hidden, w13, w2, weights, ids)  # the 16-bit reference's own error, allowed on top
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol * scale + own,
                               msg=lambda m: f"seed={seed} {gate_t}/{down_t} T={T} k={k} {dtype}: {m}")  # fmt: skip


@pytest.mark.parametrize("T,k", [(1, 1), (3, 2), (8, 8)])
@pytest.mark.parametrize("qt", FLOAT_X_TYPES, ids=lambda t: t.name)
def test_each_type_bf16(seed, qt, T, k) -> None:
    check(seed, T, 9, 256, 256, k, qt, None, torch.bfloat16, V2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("qt", FLOAT_X_TYPES, ids=lambda t: t.name)
def test_each_type_fp32_fp16(seed, qt, dtype) -> None:
    check(seed, 3, 5, 256, 256, 2, qt, None, dtype, V2)


@pytest.mark.parametrize("down", [QuantType.Q6_K, QuantType.Q8_0], ids=lambda t: t.name)
def test_q4_k_m_layer_mixed_down_type(seed, down) -> None:
    # Q4_K_M: gate/up Q4_K, down Q6_K on some layers; GEMM 1 lays the intermediate out for down's type.
    check(seed, 1, 9, 512, 256, 8, QuantType.Q4_K, down, torch.bfloat16, V2)


@pytest.mark.parametrize("qt", FLOAT_X_TYPES, ids=lambda t: t.name)
def test_k_in_several_chunks_and_remainder(seed, qt) -> None:
    check(seed, 2, 3, 768, 768, 2, qt, None, torch.float32, V2_CHUNKED)


@pytest.mark.parametrize("slots2", [1, 2, 4])
@pytest.mark.parametrize("inter_q8", [False, True], ids=["float_inter", "int8_inter"])
def test_gemm2_slots_in_steps(seed, slots2, inter_q8) -> None:
    # GEMM 2 holding slots2 of the k = 6 slots (8 rounded up) at once: the sum of all slots at once (the default) up
    # to the float32 order of the slot sum, and (float intermediate) the reference; k = 6 leaves the last step of
    # slots2 = 4 half empty.
    T, E, H, I, k = 3, 9, 256, 256, 6  # noqa: E741
    w13, w2 = make_experts(E, H, I, QuantType.Q4_K, QuantType.Q6_K)
    weights, ids = route_reference(torch.randn(T, E), k, True)
    weights, ids = weights.to(DEVICE), ids.to(DEVICE)
    hidden = torch.randn(T, H, device=DEVICE)
    cfg = {**V2, "x_q8": inter_q8, "inter_q8": inter_q8}
    p13, p2 = packed_parts(w13), packed_parts(w2)[0]
    out = fused_moe_quant(hidden, p13, p2, weights, ids, {**cfg, "slots2": slots2})
    ref = fused_moe_quant(hidden, p13, p2, weights, ids, cfg)
    assert torch.equal(fused_moe_quant(hidden, p13, p2, weights, ids, {**cfg, "slots2": 8}), ref)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6 * ref.abs().max().item(),
                               msg=lambda m: f"seed={seed}: {m}")  # fmt: skip
    if not inter_q8:
        check(seed, T, E, H, I, k, QuantType.Q4_K, QuantType.Q6_K, torch.float32, {**cfg, "slots2": slots2})
    with pytest.raises(ValueError, match="power of two"):
        fused_moe_quant(hidden, p13, p2, weights, ids, {**cfg, "slots2": 3})


def int8_layer(T: int, E: int, H: int, I: int, k: int, down: QuantType, inter_q8: bool):  # noqa: E741
    """A random layer (Q4_K gate / up, `down` down) as packed parts, a routing of T random rows, and the V2 config
    with x (and, inter_q8, the intermediate) rounded to int8: (p13, p2, weights, ids, hidden, cfg)."""
    w13, w2 = make_experts(E, H, I, QuantType.Q4_K, down)
    weights, ids = route_reference(torch.randn(T, E), k, True)
    hidden = torch.randn(T, H, device=DEVICE)
    cfg = {**V2, "x_q8": inter_q8, "inter_q8": inter_q8}
    return packed_parts(w13), packed_parts(w2)[0], weights.to(DEVICE), ids.to(DEVICE), hidden, cfg


@pytest.mark.parametrize("down", [QuantType.Q6_K, QuantType.Q4_K, QuantType.Q8_0], ids=lambda t: t.name)
@pytest.mark.parametrize("inter_q8", [False, True], ids=["float_inter", "int8_inter"])
def test_gemm2_intermediate_in_the_rows_shape(seed, down, inter_q8) -> None:
    # Config key x_tile2: GEMM 2 loads the intermediate in its rows' tile shape instead of as one row tile shared by
    # the rows; the same products in the same order.
    T, E, H, I, k = 2, 5, 256, 256, 4  # noqa: E741
    p13, p2, weights, ids, hidden, cfg = int8_layer(T, E, H, I, k, down, inter_q8)
    ref = fused_moe_quant(hidden, p13, p2, weights, ids, cfg)
    out = fused_moe_quant(hidden, p13, p2, weights, ids, {**cfg, "x_tile2": True})
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6 * ref.abs().max().item(),
                               msg=lambda m: f"seed={seed}: {m}")  # fmt: skip
    if not inter_q8:
        check(seed, T, E, H, I, k, QuantType.Q4_K, down, torch.float32, {**cfg, "x_tile2": True})


@pytest.mark.parametrize("down", [QuantType.Q6_K, QuantType.Q4_K, QuantType.Q8_0], ids=lambda t: t.name)
@pytest.mark.parametrize("inter_q8", [False, True], ids=["float_inter", "int8_inter"])
def test_gemm2_per_pair_with_atomic_sums(seed, down, inter_q8) -> None:
    # Config key sum2 = "atomic": GEMM 1 zeroes a float32 output that GEMM 2's programs, one per (token, slot) pair,
    # add their weighted rows into: the slot sum of the default up to its float32 order, and in float32 or (cast)
    # bf16 as asked; through address tables too. T = 3 with k = 3: padding of the zeroing's last program.
    T, E, H, I, k = 3, 6, 256, 256, 3  # noqa: E741
    p13, p2, weights, ids, hidden, cfg = int8_layer(T, E, H, I, k, down, inter_q8)
    ref = fused_moe_quant(hidden, p13, p2, weights, ids, cfg, out_dtype=torch.float32)
    pairs = {**cfg, "sum2": "atomic"}
    out = fused_moe_quant(hidden, p13, p2, weights, ids, pairs, out_dtype=torch.float32)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6 * ref.abs().max().item(),
                               msg=lambda m: f"seed={seed}: {m}")  # fmt: skip
    # on a GPU the atomics add a value's k terms in any order: runs agree to float32 rounding, not bit for bit
    same = {"rtol": 1e-5, "atol": 1e-6 * ref.abs().max().item()} if ON_CUDA else {"rtol": 0, "atol": 0}
    again = fused_moe_quant(hidden, p13, p2, weights, ids, pairs, out_dtype=torch.float32)  # zeroed again
    torch.testing.assert_close(again, out, **same)
    tables = ([expert_addresses(p).to(DEVICE) for p in p13], expert_addresses(p2).to(DEVICE))
    through = fused_moe_quant(hidden, p13, p2, weights, ids, pairs, out_dtype=torch.float32, tables=tables)
    torch.testing.assert_close(through, out, **same)
    bf16 = fused_moe_quant(hidden.to(torch.bfloat16), p13, p2, weights, ids, pairs)
    assert bf16.dtype == torch.bfloat16
    kept = fused_moe_quant(hidden.to(torch.bfloat16), p13, p2, weights, ids, pairs, keep_float32=True)
    assert kept.dtype == torch.float32
    torch.testing.assert_close(kept.to(torch.bfloat16), bf16, **({"rtol": 8e-3, "atol": 1e-5} if ON_CUDA else same))
    # without sum2 the output stays in the asked dtype
    assert fused_moe_quant(hidden.to(torch.bfloat16), p13, p2, weights, ids, cfg, keep_float32=True).dtype == \
        torch.bfloat16
    with pytest.raises(ValueError, match="sum2"):
        fused_moe_quant(hidden, p13, p2, weights, ids, {**cfg, "sum2": "tree"})
    # parts gemv_v2 does not read together (gate and up of two types) fall back to the gemv path, sum2 dropped
    mixed = [pack(random_quantized(t, (E, I, H), DEVICE)) for t in (QuantType.Q4_K, QuantType.Q5_K)]
    assert fused_moe_quant(hidden, mixed, p2, weights, ids, pairs).shape == (T, H)


def test_q8_0_padded_rows(seed) -> None:
    # 32-element blocks: H and I that need padding to 256 (masked inputs, zero-initialised intermediate).
    check(seed, 3, 5, 96, 160, 3, QuantType.Q8_0, None, torch.float32, V2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("qt", FLOAT_X_TYPES, ids=lambda t: t.name)
def test_prepared_x_each_type(seed, qt, dtype) -> None:
    check(seed, 3, 5, 512, 256, 2, qt, QuantType.Q6_K, dtype, V2_PREP)
    check(seed, 2, 3, 768, 256, 2, qt, None, dtype, {**V2_CHUNKED, "x_prep": True})


def test_prepared_x_padded_rows(seed) -> None:
    check(seed, 3, 5, 96, 160, 3, QuantType.Q8_0, None, torch.float32, V2_PREP)


def test_int8_only_types_refuse_float_x(seed) -> None:
    # Q3_K, like every type outside FLOAT_X_TYPES, is read with int8 x only (test_int8_dot.py checks its values): a
    # float-x config is refused with the reason, the same config with int8 x runs
    with pytest.raises(ValueError, match="Q3_K weights on the gemv_v2 path need int8 x"):
        check(seed, 2, 3, 256, 256, 2, QuantType.Q3_K, None, torch.bfloat16, V2)
    check(seed, 2, 3, 256, 256, 2, QuantType.Q3_K, None, torch.bfloat16, {**V2, "x_q8": True})


def test_chunking_covers_every_group() -> None:
    for groups in (1, 3, 8, 24, 48, 64, 96, 128):
        for block_k in (16, 64, 512, 4096):
            c = chunking(groups, block_k, QuantType.Q4_K)
            bg = c["BLOCK_G"]
            assert bg & (bg - 1) == 0 and c["REM"] < bg == 1 << c["LOG_BG"]
            assert c["FULL"] * bg + c["REM"] == groups
    assert normalize_config({"path": "gemv_v2", "BLOCK_N": 16, "BLOCK_K": 512})["path"] == "gemv_v2"
    assert normalize_config({"path": "tile64", "BLOCK_M": 128, "BLOCK_M2": 256, "BLOCK_N": 64})["BLOCK_M2"] == 256
    for bad in ({"path": "tile64", "BLOCK_M": 128, "BLOCK_M2": 384}, {"path": "tile", "BLOCK_M": 64, "BLOCK_M2": 32},
                {"path": "gemv_v2", "BLOCK_M2": 32}):  # fmt: skip
        bad = {"BLOCK_N": 64, "BLOCK_K": 64, **bad}
        with pytest.raises(ValueError, match="BLOCK_M2"):
            normalize_config(bad)


def test_decode_default_by_gate_type() -> None:
    # On the GPU, decode takes gemv_v2 with int8 x for every packed type, the gemv path when the type is not given.
    for qtype in ("Q4_K", "Q5_K", "Q6_K", "Q8_0", "Q3_K", "Q2_K", "Q4_0", "Q5_1", "IQ4_XS"):
        cfg = default_moe_config(1, 8, interpret=False, qtype=qtype)
        assert cfg["path"] == "gemv_v2" and cfg["x_q8"], qtype
    assert default_moe_config(1, 8, interpret=False)["path"] == "gemv"
    # up to 8 pairs a token's tiles; up to 64 (M = 8 at top-8) wider ones writing an int8 intermediate
    assert not default_moe_config(1, 8, interpret=False, qtype="Q5_K").get("inter_q8")
    assert default_moe_config(8, 8, interpret=False, qtype="Q5_K")["inter_q8"]
    assert default_moe_config(8, 8, interpret=False, qtype="Q3_K")["inter_q8"]
    # beyond, prefill tiles: tile64 for the types it decodes
    assert default_moe_config(16, 8, interpret=False, qtype="Q4_K")["path"] == "tile64"
    assert default_moe_config(512, 8, interpret=False, qtype="Q4_K")["path"] == "tile64"
    assert default_moe_config(512, 8, interpret=False, qtype="Q3_K")["path"] == "tile64"
    assert default_moe_config(512, 8, interpret=False)["path"] == "tile"


# ----------------------------------------------------------------------------------------------- matmul


MATMUL_V2 = {"path": "gemv_v2", "BLOCK_N": 16 if ON_CUDA else 64, "BLOCK_K": 256, "num_warps": 4, "num_stages": 1}


@pytest.mark.parametrize("x_prep", [False, True], ids=["x", "prepared_x"])
@pytest.mark.parametrize("M", [1, 3])
@pytest.mark.parametrize("qt", FLOAT_X_TYPES, ids=lambda t: t.name)
def test_matmul_v2_each_type(seed, qt, M, x_prep) -> None:
    # N = 48 is not a multiple of BLOCK_N; Q8_0 rows of 288 need padding; K = 512 is two 256-input chunks.
    N, K = 48, 512 if qt.is_k_quant else 288
    t = random_quantized(qt, (N, K), DEVICE)
    x = torch.randn(M, K, device=DEVICE).bfloat16()
    bias = torch.randn(N, device=DEVICE).bfloat16()
    out = quant_matmul_triton(x, pack(t), bias, config={**MATMUL_V2, "x_prep": x_prep})
    ref = F.linear(x, t.dequantize().to(x.dtype), bias)
    tol = TOLERANCE[torch.bfloat16]
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol * ref.float().abs().max().item(),
                               msg=lambda m: f"{qt.name} seed={seed}: {m}")  # fmt: skip


def test_matmul_v2_parts_with_fallback_type(seed) -> None:
    # q | k | v of three types: Q4_K and Q6_K on gemv_v2, an F16 part in torch, each into its own columns.
    K = 256
    dense = torch.randn(16, K).half()
    parts = [random_quantized(QuantType.Q4_K, (64, K), DEVICE), random_quantized(QuantType.Q6_K, (16, K), DEVICE),
             QuantizedTensor(dense.view(torch.uint8).reshape(-1), QuantType.F16, (16, K)).to(DEVICE)]  # fmt: skip
    w = QuantizedWeight(parts)
    x = torch.randn(2, K, device=DEVICE, dtype=torch.float32)
    out = quant_matmul_triton(x, packed_parts(w), config=MATMUL_V2)
    ref = F.linear(x, w.dequantize(torch.float32))
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item(), msg=lambda m: f"{seed}: {m}")


# ---------------------------------------------------------------------------------------------------- CUDA


@pytest.mark.skipif(not ON_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("qt", FLOAT_X_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("cfg", [V2, V2_PREP], ids=["x", "prepared_x"])
@pytest.mark.parametrize("T", [1, 8])
def test_qwen3_30b_shape_cuda_graph(seed, qt, T, cfg) -> None:
    E, H, I, k = 128, 2048, 768, 8  # noqa: E741
    w13, w2 = make_experts(E, H, I, qt, QuantType.Q6_K if qt == QuantType.Q4_K else None)
    p13, p2 = packed_parts(w13), packed_parts(w2)[0]
    hidden = torch.randn(T, H, device=DEVICE, dtype=torch.bfloat16)
    logits = torch.randn(T, E, device=DEVICE)

    def step() -> torch.Tensor:
        weights, ids = route_triton(logits, k, True)
        return fused_moe_quant(hidden, p13, p2, weights, ids, cfg)

    check_graphed_moe(step, hidden, logits, w13, w2, k, TOLERANCE[torch.bfloat16], seed, replays=2)


@pytest.mark.parametrize("x_q8", [False, True], ids=["x", "int8_x"])
def test_matmul_v2_two_parts_in_one_launch(seed, monkeypatch, x_q8) -> None:
    # Consecutive parts of the types gemv_v2 reads (q|k Q4_K, v Q6_K) run as one launch, bit for bit the separate
    # launches (MOERUN_QUANT_JOINT=0) under the same config; then Q8_0 alone, its successor being an F16 part
    # (torch). N = 40 and 24 end inside a program's rows.
    from moerun.kernels.quant import matmul_v2

    K = 512
    dense = torch.randn(16, K).half()
    parts = [random_quantized(qt, (n, K), DEVICE) for qt, n in
             ((QuantType.Q4_K, 48), (QuantType.Q6_K, 40), (QuantType.Q8_0, 24))]  # fmt: skip
    parts.append(QuantizedTensor(dense.view(torch.uint8).reshape(-1), QuantType.F16, (16, K)).to(DEVICE))
    packed = packed_parts(QuantizedWeight(parts))
    x = torch.randn(2, K, device=DEVICE).bfloat16()
    bias = torch.randn(sum(p.shape[0] for p in parts), device=DEVICE).bfloat16()
    cfg = {**MATMUL_V2, "BLOCK_N": 16, "x_q8": x_q8}
    launches = []
    kernel = matmul_v2._matmul_v2_kernel

    class Counting:
        def __getitem__(self, grid):
            launches.append(grid)
            return kernel[grid]

    monkeypatch.setattr(matmul_v2, "_matmul_v2_kernel", Counting())
    monkeypatch.setenv("MOERUN_QUANT_JOINT", "0")
    separate = quant_matmul_triton(x, packed, bias, config=cfg)
    assert [g[0] for g in launches] == [3, 3, 2]
    monkeypatch.delenv("MOERUN_QUANT_JOINT")
    joint = quant_matmul_triton(x, packed, bias, config=cfg)
    assert [g[0] for g in launches[3:]] == [6, 2], "q|k and v in one launch, then Q8_0 alone"
    assert torch.equal(joint, separate), f"seed={seed}"
