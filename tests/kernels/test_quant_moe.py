"""Quantized fused MoE (gemv and tile paths) against dequantise + fused_moe_reference, per quant type."""

from __future__ import annotations

import pytest
import torch

from helpers import check_graphed_moe, on_int8_grid, reference_rounding

pytest.importorskip("triton")

from moerun.formats.quants import QuantType  # noqa: E402
from moerun.kernels.quant.configs import default_moe_config, normalize_config  # noqa: E402
from moerun.kernels.quant import fused_moe_quant as quant_module  # noqa: E402
from moerun.kernels.quant.fused_moe_quant import fused_moe_quant, register_cap  # noqa: E402
from moerun.kernels.quant.repack import PACKED_TYPES, pack  # noqa: E402
from moerun.kernels.quant.synthetic import random_quantized  # noqa: E402
from moerun.kernels.router import route_triton  # noqa: E402
from moerun.kernels.tickets import ticket_counters  # noqa: E402
from moerun.layers.quantized import QuantizedWeight  # noqa: E402
from moerun.ops import moe as moe_ops  # noqa: E402
from moerun.ops.moe_reference import fused_moe_reference, route_reference  # noqa: E402
from moerun.ops.quant import moe_tile_parts, packed_parts  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
ON_CUDA = DEVICE.type == "cuda"

# The interpreter runs programs one by one, so there one N-tile covers the tests' I and H; GPUs get real tiles.
if ON_CUDA:
    GEMV = {"path": "gemv", "BLOCK_N": 16, "BLOCK_K": 256, "BLOCK_N2": 32, "BLOCK_K2": 256, "reduce": "sum"}
    TILE = {"path": "tile", "BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "GROUP_M": 4, "reduce": "atomic"}
    TILE64 = {"path": "tile64", "BLOCK_M": 16, "BLOCK_N": 64, "GROUP_M": 4, "num_stages": 3, "reduce": "atomic"}
    GEMV_DOT = {"path": "gemv_dot", "BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 128, "reduce": "sum"}
else:
    # BLOCK_K = 512 unrolls two [256, 4, 32] tiles per step where a row has 512 inputs.
    GEMV = {"path": "gemv", "BLOCK_N": 256, "BLOCK_K": 512, "BLOCK_N2": 256, "BLOCK_K2": 256, "reduce": "sum"}
    TILE = {"path": "tile", "BLOCK_M": 16, "BLOCK_N": 256, "BLOCK_K": 256, "reduce": "atomic"}
    TILE64 = {"path": "tile64", "BLOCK_M": 16, "BLOCK_N": 256, "BLOCK_N2": 256, "reduce": "atomic"}
    GEMV_DOT = {"path": "gemv_dot", "BLOCK_M": 16, "BLOCK_N": 256, "BLOCK_K": 256, "reduce": "sum"}
CONFIGS = {"gemv": GEMV, "tile": TILE, "tile64": TILE64, "gemv_dot": GEMV_DOT,
           "gemv-atomic": {**GEMV, "reduce": "atomic"},
           "tile-sum": {**TILE, "reduce": "sum"}, "gemv_dot-atomic": {**GEMV_DOT, "reduce": "atomic"},
           "tile-sum_out": {**TILE, "reduce": "sum_out"}, "tile64-sum_out": {**TILE64, "reduce": "sum_out"},
           "tile64-sum": {**TILE64, "reduce": "sum"},
           # GEMM 2 in M-blocks of 4 (interpreter: 2) of GEMM 1's; GEMM 1 skips its blocks of padding alone
           "tile64-m2": {**TILE64, "BLOCK_M2": 64 if ON_CUDA else 32},
           # registers capped a thread (a launch option: on a GPU a compile of its own; the interpreter ignores it)
           "tile64-capped": {**TILE64, "maxnreg": 168, "maxnreg2": 160},
           "tile-m2": {**TILE, "BLOCK_M2": 32}}  # fmt: skip

# Error allowed relative to the largest reference magnitude: the reference rounds the dequantised weights and
# every GEMM output to the activation dtype; the kernels keep float32 longer.
TOLERANCE = {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 3e-2}


def dims(qt: QuantType) -> tuple[int, int]:
    """(H, I): multiples of 256 for K-quants; for 32-element types rows that need padding."""
    return (256, 256) if qt.is_k_quant else (96, 160)


def make_experts(E: int, H: int, I: int, gate_t, up_t=None, down_t=None):  # noqa: E741
    """QuantizedWeights w13 = [gate, up] parts [E, I, H] each and w2 [E, H, I]."""
    gate = random_quantized(gate_t, (E, I, H), DEVICE)
    up = random_quantized(up_t or gate_t, (E, I, H), DEVICE)
    down = random_quantized(down_t or gate_t, (E, H, I), DEVICE)
    return QuantizedWeight([gate, up]), QuantizedWeight([down])


def random_routing(T: int, E: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    weights, ids = route_reference(torch.randn(T, E), k, True)
    return weights.to(DEVICE), ids.to(DEVICE)


def check(seed, hidden, w13, w2, weights, ids, config) -> None:
    p13, p2 = packed_parts(w13), packed_parts(w2)[0]
    out = fused_moe_quant(hidden, p13, p2, weights, ids, config)
    ref = fused_moe_reference(hidden, w13, w2, weights, ids)
    assert out.dtype == hidden.dtype and out.shape == hidden.shape
    tol = TOLERANCE[hidden.dtype]
    scale = ref.float().abs().max().item() + 1e-6
    own = reference_rounding(ref, hidden, w13, w2, weights, ids)  # the 16-bit reference's own error, allowed on top
    torch.testing.assert_close(
        out.float(), ref.float(), rtol=tol, atol=tol * scale + own, msg=lambda m: f"seed={seed} config={config}: {m}"
    )


@pytest.mark.parametrize("path", ["gemv", "tile", "tile64"])
@pytest.mark.parametrize("qt", PACKED_TYPES, ids=lambda t: t.name)
def test_each_type_matches_reference(seed, qt, path) -> None:
    T, E, k = 3, 3, 2
    H, I = dims(qt)  # noqa: E741
    w13, w2 = make_experts(E, H, I, qt)
    weights, ids = random_routing(T, E, k)
    check(seed, torch.randn(T, H, device=DEVICE).bfloat16(), w13, w2, weights, ids, CONFIGS[path])


@pytest.mark.parametrize("path", ["gemv", "gemv_dot", "tile", "tile64", "tile64-m2"])
def test_mixed_types_gate_up_down(seed, path) -> None:
    # A Q4_K_M-like layer with distinct gate and up types: three pointer sets.
    T, E, H, I, k = 1, 8, 256, 256, 8  # noqa: E741
    w13, w2 = make_experts(E, H, I, QuantType.Q4_K, QuantType.Q5_K, QuantType.Q6_K)
    assert len(packed_parts(w13)) == 2
    weights, ids = random_routing(T, E, k)
    check(seed, torch.randn(T, H, device=DEVICE).bfloat16(), w13, w2, weights, ids, CONFIGS[path])


@pytest.mark.parametrize(
    "dtype,config",
    [(torch.float32, "gemv"), (torch.float32, "tile"), (torch.float32, "gemv_dot"),
     (torch.float16, "gemv-atomic"), (torch.float16, "tile-sum"), (torch.float16, "gemv_dot-atomic"),
     (torch.bfloat16, "tile-sum_out"), (torch.float32, "tile64"), (torch.float16, "tile64-sum"),
     (torch.bfloat16, "tile64-sum_out"), (torch.float16, "tile64-m2"), (torch.bfloat16, "tile64-capped")],
)  # fmt: skip
def test_hidden_dtypes_and_reductions(seed, dtype, config) -> None:
    T, E, H, I, k = 1, 3, 512, 256, 1  # noqa: E741
    w13, w2 = make_experts(E, H, I, QuantType.Q4_K)
    # One packed tensor holds gate and up: rows [0, I) and [I, 2I) of the same arrays.
    assert len(packed_parts(w13)) == 1
    weights, ids = random_routing(T, E, k)
    check(seed, torch.randn(T, H, device=DEVICE).to(dtype), w13, w2, weights, ids, CONFIGS[config])


@pytest.mark.parametrize("path", ["tile", "tile64", "tile-m2", "tile64-m2"])
def test_tile_path_many_blocks_and_empty_experts(seed, path) -> None:
    # 35 tokens on expert 4 span three 16-row blocks; the other 6 experts get nothing.
    T, E, H, I = 35, 7, 256, 256  # noqa: E741
    w13, w2 = make_experts(E, H, I, QuantType.Q8_0)
    ids = torch.full((T, 1), 4, dtype=torch.int32, device=DEVICE)
    weights = torch.rand(T, 1, device=DEVICE)
    check(seed, torch.randn(T, H, device=DEVICE).bfloat16(), w13, w2, weights, ids, CONFIGS[path])


# Blocks of 32 (GEMM 2: 64) token-slots; a block of at most 16 (GEMM 2: 32) runs as a tile of that many rows.
TAILS = {"tile64": {**TILE64, "BLOCK_M": 32, "TAIL_M": 16},
         "tile64-m2": {**TILE64, "BLOCK_M": 32, "TAIL_M": 16, "BLOCK_M2": 64, "TAIL_M2": 32, "reduce": "sum_out"},
         "tile-m2": {**TILE, "BLOCK_M": 32, "TAIL_M": 16, "BLOCK_M2": 64, "TAIL_M2": 16, "reduce": "sum"},
         "tile64-gemm2": {**TILE64, "BLOCK_M": 32, "TAIL_M2": 16}}  # fmt: skip


def tail_routing() -> torch.Tensor:
    """topk_ids [T, 1] (k = 1) giving experts 0..6 33, 48, 49, 16, 1, 65 and 96 token-slots in random order."""
    counts = [33, 48, 49, 16, 1, 65, 96]
    ids = torch.cat([torch.full((n,), e, dtype=torch.int32) for e, n in enumerate(counts)])
    return ids[torch.randperm(ids.numel())][:, None].to(DEVICE)


def nan_bfloat16_buffers(monkeypatch) -> None:
    """New bfloat16 buffers (intermediate, scratch) start as NaN, so an unwritten row that reached an output shows."""
    empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **kw: empty(*a, **kw).fill_(float("nan"))
                        if kw.get("dtype") == torch.bfloat16 else empty(*a, **kw))  # fmt: skip


@pytest.mark.parametrize("config", list(TAILS))
def test_short_tail_tiles(seed, monkeypatch, config) -> None:
    # k = 1, one token a slot. Experts 0..6 get 33, 48, 49, 16, 1, 65 and 96 token-slots (expert 7 none): GEMM 1's
    # last blocks of 1, 16 (= TAIL_M), 17 (> TAIL_M: the full tile), a lone 16 and a lone 1, then 1 and 32; with
    # GEMM 2 in blocks of 64, its last blocks of 33, 48, 49, 16, 1, 1 and 32 (= TAIL_M2). Padding rows that GEMM 1
    # skips stay unwritten (NaN here), and must not reach any output.
    ids = tail_routing()  # [T, 1]
    T, E, H, I = ids.shape[0], 8, 256, 256  # noqa: E741
    w13, w2 = make_experts(E, H, I, QuantType.Q4_K, QuantType.Q4_K, QuantType.Q6_K)
    weights = torch.rand(T, 1, device=DEVICE)
    nan_bfloat16_buffers(monkeypatch)
    check(seed, torch.randn(T, H, device=DEVICE).bfloat16(), w13, w2, weights, ids, TAILS[config])


# GEMM 1's gate and up in programs of their own (split13), in blocks twice as long as GEMM 1's usual
SPLITS = {"tile64": {**TILE64, "split13": True},
          "tile64-m2-tail": {**TILE64, "split13": True, "BLOCK_M": 32, "TAIL_M": 16, "BLOCK_M2": 64, "TAIL_M2": 32,
                             "reduce": "sum_out"}}  # fmt: skip


@pytest.mark.parametrize("config", list(SPLITS))
@pytest.mark.parametrize("up_t", [QuantType.Q4_K, QuantType.Q5_K], ids=["same-part", "Q5_K-up"])
def test_split_gate_and_up_programs(seed, monkeypatch, config, up_t) -> None:
    # Experts with 33, 48, 49, 16, 1, 65 and 96 token-slots (k = 1), as in the tail test. One part holds gate and
    # up (one loop over the half's pointers) or two parts of different types (a loop each). In float32 each half's
    # product is stored exactly, so the result is the unsplit kernel's to the bit; in bfloat16 against the reference.
    ids = tail_routing()  # [T, 1]
    T, E, H, I = ids.shape[0], 8, 256, 256  # noqa: E741
    w13, w2 = make_experts(E, H, I, QuantType.Q4_K, up_t, QuantType.Q6_K)
    weights = torch.rand(T, 1, device=DEVICE)
    x = torch.randn(T, H, device=DEVICE)
    p13, p2 = packed_parts(w13), packed_parts(w2)[0]
    unsplit = {key: v for key, v in SPLITS[config].items() if key != "split13"}
    got = fused_moe_quant(x, p13, p2, weights, ids, SPLITS[config])
    assert torch.equal(got, fused_moe_quant(x, p13, p2, weights, ids, unsplit)), f"seed={seed}"
    # every ticket counter is back to 0 for the next launch
    assert not ticket_counters(x.device, 1, "quant_moe_split13")._base.any(), f"seed={seed}"
    nan_bfloat16_buffers(monkeypatch)
    check(seed, x.bfloat16(), w13, w2, weights, ids, SPLITS[config])


def test_split_gate_and_up_combine_in_either_order(seed, monkeypatch) -> None:
    # The interpreter runs a tile's gate program before its up program, so the up program combines. Counters set to
    # 1 make the gate program the second to arrive instead, with the scratch of an identical launch before it
    # holding the up half: the same output, now written by the gate programs.
    T, E, H, I, k = 40, 4, 256, 256, 2  # noqa: E741
    w13, w2 = make_experts(E, H, I, QuantType.Q4_K, QuantType.Q4_K, QuantType.Q6_K)
    weights, ids = random_routing(T, E, k)
    x = torch.randn(T, H, device=DEVICE)
    p13, p2 = packed_parts(w13), packed_parts(w2)[0]
    config = {**TILE64, "split13": True}
    want = fused_moe_quant(x, p13, p2, weights, ids, config)
    kept, empty = {}, torch.empty  # the scratch [P, 2I], kept from one launch to the next

    def scratch_kept(*shape, **kw):
        return kept.setdefault(shape, empty(*shape, **kw)) if shape[-1] == 2 * I else empty(*shape, **kw)

    monkeypatch.setattr(torch, "empty", scratch_kept)
    fused_moe_quant(x, p13, p2, weights, ids, config)
    ones = torch.ones(1 << 12, dtype=torch.int32, device=DEVICE)
    monkeypatch.setattr(quant_module, "ticket_counters", lambda device, n, owner: ones[:n])
    assert torch.equal(fused_moe_quant(x, p13, p2, weights, ids, config), want), f"seed={seed}"


def test_split_gate_and_up_is_checked(seed) -> None:
    with pytest.raises(ValueError, match="split13"):
        normalize_config({**TILE, "split13": True})
    with pytest.raises(ValueError, match="split13"):
        normalize_config({**TILE64, "split13": "yes"})
    # grid types decode their groups on another step: no split of theirs
    T, E, H, I = 5, 2, 256, 256  # noqa: E741
    w13, w2 = make_experts(E, H, I, QuantType.IQ2_XXS, QuantType.IQ2_XXS, QuantType.Q4_K)
    weights, ids = random_routing(T, E, 1)
    with pytest.raises(ValueError, match="split13"):
        fused_moe_quant(torch.randn(T, H, device=DEVICE), *moe_tile_parts(w13, w2), weights, ids,
                        {**TILE64, "split13": True})  # fmt: skip


def test_tail_tile_config_is_checked() -> None:
    for key, tail in (("TAIL_M", 8), ("TAIL_M", 24), ("TAIL_M", 32), ("TAIL_M2", 64), ("TAIL_M2", 48)):
        with pytest.raises(ValueError, match=key):  # below 16, not a power of two, not below its M-block
            normalize_config({**TAILS["tile64-m2"], key: tail})
    for path in (GEMV, GEMV_DOT):  # no M-blocks to shorten
        with pytest.raises(ValueError, match="TAIL_M"):
            normalize_config({**path, "TAIL_M": 16})
    assert normalize_config(TAILS["tile64-m2"])["TAIL_M"] == 16


@pytest.mark.parametrize("config", ["tile64", "tile64-m2"])
@pytest.mark.parametrize("gate_t,H", [(QuantType.Q4_K, 256), (QuantType.Q8_0, 96)], ids=["Q4_K", "Q8_0"])
def test_tile64_rows_that_need_padding(seed, gate_t, H, config) -> None:  # noqa: N803
    # Q8_0 down rows of I = 160 inputs are padded to 256 (two pairs and a half with data, the rest zeros); so are
    # Q8_0 gate/up rows of H = 96.
    T, E, I, k = 9, 4, 160, 2  # noqa: E741
    w13, w2 = make_experts(E, H, I, gate_t, gate_t, QuantType.Q8_0)
    weights, ids = random_routing(T, E, k)
    check(seed, torch.randn(T, H, device=DEVICE).bfloat16(), w13, w2, weights, ids, CONFIGS[config])


def test_dispatch_through_fused_moe(seed) -> None:
    E, H, I, k = 4, 256, 256, 2  # noqa: E741
    w13, w2 = make_experts(E, H, I, QuantType.Q6_K)
    for T in (1, 9):  # the default config picks gemv, then tile
        logits = torch.randn(T, E, device=DEVICE)
        weights, ids = moe_ops.route(logits, k, True, backend="triton")
        hidden = torch.randn(T, H, device=DEVICE).bfloat16()
        out = moe_ops.fused_moe(hidden, w13, w2, weights, ids, backend="triton")
        ref = moe_ops.fused_moe(hidden, w13, w2, weights, ids, backend="torch")
        scale = ref.float().abs().max().item()
        tol = TOLERANCE[torch.bfloat16]
        torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol * scale, msg=lambda m: f"{seed}: {m}")
    assert w13.packed[0].device == w13.device  # packed once, cached on the weight


def test_empty_batch_and_shape_errors() -> None:
    w13, w2 = make_experts(3, 256, 256, QuantType.Q4_0)
    p13, p2 = packed_parts(w13), packed_parts(w2)[0]
    hidden = torch.zeros(0, 256, device=DEVICE)
    empty = torch.zeros(0, 2, device=DEVICE)
    assert fused_moe_quant(hidden, p13, p2, empty, empty.int()).shape == (0, 256)
    # Parts of 200 and 100 rows: the up rows [150, 300) straddle them.
    split = [pack(random_quantized(QuantType.Q4_0, (3, n, 256), DEVICE)) for n in (200, 100)]
    with pytest.raises(ValueError, match="straddle"):
        fused_moe_quant(hidden, split, p2, empty, empty.int())


def test_register_caps() -> None:
    assert register_cap({"maxnreg": 168, "maxnreg2": 128}, "") == {"maxnreg": 168}
    assert register_cap({"maxnreg": 168, "maxnreg2": 128}, "2") == {"maxnreg": 128}
    assert register_cap({"path": "tile64"}, "") == {}
    assert normalize_config({**CONFIGS["tile64"], "maxnreg": 168})["maxnreg"] == 168
    for bad in ({**CONFIGS["tile64"], "maxnreg": 300}, {**CONFIGS["tile"], "maxnreg2": 16.0},
                {**CONFIGS["gemv"], "maxnreg": 168}):
        with pytest.raises(ValueError, match="maxnreg"):
            normalize_config(bad)


def test_default_configs() -> None:
    assert default_moe_config(1, 8, interpret=False)["path"].startswith("gemv")
    assert default_moe_config(4096, 8, interpret=False)["path"] == "tile"
    assert default_moe_config(4096, 8, interpret=False)["reduce"] == "sum_out"  # a fixed summation order
    assert default_moe_config(4096, 8, interpret=False, qtype="Q4_K")["path"] == "tile64"
    assert default_moe_config(4096, 8, interpret=False, qtype="Q4_K")["reduce"] == "sum_out"
    assert default_moe_config(64, 8, interpret=False, qtype="Q4_K")["path"] == "tile64"
    assert default_moe_config(1, 2, interpret=True)["path"] == "gemv"
    # packed types above 512 tokens: short tail tiles, GEMM 2 in blocks of 256 up to 2048, split gate/up above
    assert default_moe_config(512, 8, interpret=False, qtype="Q4_K")["TAIL_M"] == 0
    assert default_moe_config(1024, 8, interpret=False, qtype="Q4_K")["TAIL_M"] == 64
    mid = default_moe_config(2048, 8, interpret=False, qtype="Q6_K")
    assert (mid["BLOCK_M"], mid["BLOCK_M2"], mid["TAIL_M"], mid["TAIL_M2"]) == (128, 256, 32, 128)
    assert not mid.get("split13")
    big = default_moe_config(4096, 8, interpret=False, qtype="Q8_0")
    assert (big["BLOCK_M"], big["TAIL_M"], big["TAIL_M2"], big["split13"]) == (256, 64, 64, True)
    assert "split13" not in default_moe_config(4096, 8, interpret=False, qtype="IQ2_XXS")  # grid types: not split


# ---------------------------------------------------------------------------------------------------------------
# CUDA only: the Qwen3-30B-A3B expert shape with the default/tuned configs, and CUDA-graph capture.


@pytest.mark.skipif(not ON_CUDA, reason="needs CUDA")
@pytest.mark.parametrize(
    "qt,T", [(QuantType.Q4_K, 1), (QuantType.Q4_K, 4), (QuantType.Q4_K, 64), (QuantType.Q4_K, 1024),
             (QuantType.Q6_K, 1), (QuantType.Q6_K, 1024)], ids=lambda v: getattr(v, "name", str(v))
)  # fmt: skip
def test_qwen3_30b_shape(seed, qt, T) -> None:
    E, H, I, k = 128, 2048, 768, 8  # noqa: E741
    w13, w2 = make_experts(E, H, I, qt)
    weights, ids = random_routing(T, E, k)
    check(seed, torch.randn(T, H, device=DEVICE, dtype=torch.bfloat16), w13, w2, weights, ids, None)


@pytest.mark.skipif(not ON_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("config", ["gemv", "gemv_dot", "tile", "default"])
@pytest.mark.parametrize("T", [2, 40])
def test_cuda_graph_capture_and_replay(seed, config, T) -> None:
    E, H, I, k = 16, 512, 256, 4  # noqa: E741
    w13, w2 = make_experts(E, H, I, QuantType.Q4_K, QuantType.Q4_K, QuantType.Q6_K)
    p13, p2 = packed_parts(w13), packed_parts(w2)[0]
    # on the int8 grid, which the decode default (x rounded to int8) keeps exact
    hidden = on_int8_grid(T, H, torch.bfloat16, DEVICE)
    logits = torch.randn(T, E, device=DEVICE)
    cfg = CONFIGS.get(config)

    def step() -> torch.Tensor:
        weights, ids = route_triton(logits, k, True)
        return fused_moe_quant(hidden, p13, p2, weights, ids, cfg)

    check_graphed_moe(step, hidden, logits, w13, w2, k, TOLERANCE[torch.bfloat16], seed, replays=3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dequant_path_is_the_dense_kernel_on_the_decoded_layer(seed, dtype) -> None:
    # path "dequant": the experts decoded in one launch per part (gate and up of different types, into one
    # scratch), then fused_moe_triton: bit for bit the dense kernel on the kernels' decoding of each part
    from moerun.kernels.fused_moe import fused_moe_triton
    from moerun.kernels.quant.decode import dequantize_triton

    T, E, k, H, I = 37, 5, 2, 256, 256  # noqa: E741
    w13, w2 = make_experts(E, H, I, QuantType.Q4_K, QuantType.Q6_K, QuantType.Q8_0)
    weights, ids = random_routing(T, E, k)
    hidden = torch.randn(T, H, device=DEVICE).to(dtype)
    p13, p2 = packed_parts(w13), packed_parts(w2)[0]
    out = fused_moe_quant(hidden, p13, p2, weights, ids, {"path": "dequant"})
    dense13 = torch.cat([dequantize_triton(p, dtype) for p in p13], dim=1)  # [E, 2I, H]
    ref = fused_moe_triton(hidden, dense13, dequantize_triton(p2, dtype), weights, ids)
    assert torch.equal(out, ref), f"seed={seed}"
    check(seed, hidden, w13, w2, weights, ids, {"path": "dequant"})


def test_dequant_path_falls_back_where_it_cannot_apply(seed, monkeypatch) -> None:
    # float32 partial sums asked of a bf16 batch (offloaded experts) and experts through address tables take the
    # default path for their size instead
    from moerun.kernels.quant import fused_moe_quant as module
    from moerun.kernels.quant.repack import expert_addresses

    T, E, k, H, I = 6, 4, 2, 256, 256  # noqa: E741
    w13, w2 = make_experts(E, H, I, QuantType.Q8_0)
    weights, ids = random_routing(T, E, k)
    hidden = torch.randn(T, H, device=DEVICE).to(torch.bfloat16)
    p13, p2 = packed_parts(w13), packed_parts(w2)[0]
    dequant = {"path": "dequant"}
    monkeypatch.setattr(module, "_dequant", lambda *args: pytest.fail("the dequant path ran"))
    out = fused_moe_quant(hidden, p13, p2, weights, ids, dequant, out_dtype=torch.float32)
    ref = fused_moe_quant(hidden, p13, p2, weights, ids, default_moe_config(T, k, qtype="Q8_0"),
                          out_dtype=torch.float32)  # fmt: skip
    assert out.dtype == torch.float32 and torch.equal(out, ref), f"seed={seed}"
    tables = ([expert_addresses(p).to(DEVICE) for p in p13], expert_addresses(p2).to(DEVICE))
    out = fused_moe_quant(hidden, p13, p2, weights, ids, dequant, tables=tables)
    ref = fused_moe_quant(hidden, p13, p2, weights, ids, default_moe_config(T, k, qtype="Q8_0"), tables=tables)
    torch.testing.assert_close(out, ref, rtol=0, atol=0, msg=lambda m: f"seed={seed}: {m}")
