"""Quantized dense matmul (gemv and tile paths) against x @ dequantize(W).T, per quant type and for mixed parts."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from helpers import on_int8_grid

pytest.importorskip("triton")

from moerun.formats.quants import QuantizedTensor, QuantType  # noqa: E402
from moerun.kernels.quant.configs import default_matmul_config  # noqa: E402
from moerun.kernels.quant.matmul_quant import quant_matmul_triton  # noqa: E402
from moerun.kernels.quant.repack import PACKED_TYPES, pack  # noqa: E402
from moerun.kernels.quant.synthetic import random_quantized  # noqa: E402
from moerun.layers.quantized import QuantizedWeight, set_quantized  # noqa: E402
from moerun.ops.quant import pack_model, packed_parts, quant_matmul  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
ON_CUDA = DEVICE.type == "cuda"

if ON_CUDA:
    GEMV = {"path": "gemv", "BLOCK_N": 16, "BLOCK_K": 256, "num_warps": 4, "num_stages": 2}
    TILE = {"path": "tile", "BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 128, "GROUP_M": 2, "num_warps": 4,
            "num_stages": 2}  # fmt: skip
    TILE64 = {**TILE, "path": "tile64", "num_stages": 3}
else:
    # BLOCK_K = 512 unrolls two [64, 4, 32] tiles per step on 512-long rows.
    GEMV = {"path": "gemv", "BLOCK_N": 64, "BLOCK_K": 512, "num_warps": 4, "num_stages": 1}
    TILE = {"path": "tile", "BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 256, "GROUP_M": 2, "num_warps": 4,
            "num_stages": 1}  # fmt: skip
    TILE64 = {**TILE, "path": "tile64"}
CONFIGS = {"gemv": GEMV, "tile": TILE, "tile64": TILE64}  # tile64 decodes Q4_K/Q5_K/Q6_K/Q8_0, others take tile
TOLERANCE = {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 2e-2}


def k_for(qt: QuantType) -> int:
    """Two 256-element super-blocks for K-quants; a padded, uneven row for the 32-element types."""
    return 512 if qt.is_k_quant else 288


def reference(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ w.T in x's dtype from weights dequantised in float32 and rounded once."""
    return F.linear(x, w.to(x.dtype), bias)


def assert_matches(seed, out, ref, dtype, what) -> None:
    tol = TOLERANCE[dtype]
    scale = ref.float().abs().max().item() + 1e-6
    torch.testing.assert_close(
        out.float(), ref.float(), rtol=tol, atol=tol * scale, msg=lambda m: f"{what} seed={seed}: {m}"
    )


# On CUDA every type's decoder is already covered by the MoE and decoder tests; a subset bounds compile time.
TYPES = PACKED_TYPES if not ON_CUDA else (QuantType.Q4_K, QuantType.Q6_K, QuantType.Q3_K, QuantType.Q8_0,
                                          QuantType.Q5_0)  # fmt: skip


@pytest.mark.parametrize("path", ["gemv", "tile", "tile64"])
@pytest.mark.parametrize("qt", TYPES, ids=lambda t: t.name)
def test_each_type_matches_reference(seed, qt, path) -> None:
    N, K = 48, k_for(qt)  # N is not a multiple of BLOCK_N: wrapped rows are dropped
    M = 2 if path == "gemv" else 19  # 19 rows span two 16-row blocks
    t = random_quantized(qt, (N, K), DEVICE)
    x = torch.randn(M, K, device=DEVICE).bfloat16()
    out = quant_matmul_triton(x, pack(t), config=CONFIGS[path])
    assert out.shape == (M, N) and out.dtype == x.dtype
    assert_matches(seed, out, reference(x, t.dequantize()), x.dtype, f"{qt.name} {path}")


@pytest.mark.parametrize("path", ["gemv", "tile", "tile64"])
def test_qkv_parts_of_different_types_with_bias(seed, path) -> None:
    K = 256
    parts = [random_quantized(QuantType.Q4_K, (64, K), DEVICE), random_quantized(QuantType.Q6_K, (16, K), DEVICE),
             random_quantized(QuantType.Q8_0, (16, K), DEVICE)]  # fmt: skip
    w = QuantizedWeight(parts)
    assert [p.qtype for p in packed_parts(w)] == [QuantType.Q4_K, QuantType.Q6_K, QuantType.Q8_0]
    bias = torch.randn(96, device=DEVICE).bfloat16()
    M = 1 if path == "gemv" else 17
    x = torch.randn(M, K, device=DEVICE).bfloat16()
    out = quant_matmul_triton(x, packed_parts(w), bias, config=CONFIGS[path])
    assert_matches(seed, out, reference(x, w.dequantize(torch.float32), bias), x.dtype, path)


def test_same_type_parts_merge_into_one() -> None:
    parts = [random_quantized(QuantType.Q5_K, (n, 256), DEVICE) for n in (32, 8, 8)]
    packed = packed_parts(QuantizedWeight(parts))
    assert len(packed) == 1 and packed[0].shape == (48, 256)


@pytest.mark.parametrize("path", ["gemv", "tile", "tile64"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_activation_dtypes(seed, dtype, path) -> None:
    t = random_quantized(QuantType.Q4_K, (32, 256), DEVICE)
    x = torch.randn(2 if path == "gemv" else 5, 256, device=DEVICE).to(dtype)
    out = quant_matmul_triton(x, pack(t), config=CONFIGS[path])
    assert_matches(seed, out, reference(x, t.dequantize()), dtype, str(dtype))


@pytest.mark.parametrize("qt", PACKED_TYPES, ids=lambda t: t.name)
def test_tile64_decode_rounds_once(seed, qt) -> None:
    # tile64 decodes a value as f s - offset in one FMA (exact for Q8_0, Q6_K, Q3_K, Q4_0, Q5_0; the IQ4 level
    # exactly, then one product; for the others the offset rounded once): in float32 it stays at float32 accuracy
    # against a float64 reference, in the interpreter too, where a product rounded before the offset cancels it
    # would lose about 6 bits of a Q8_0 value
    t = random_quantized(qt, (64, 256), DEVICE)
    x = torch.randn(16, 256, device=DEVICE)
    out = quant_matmul_triton(x, pack(t), config=CONFIGS["tile64"])
    ref = x.double() @ t.dequantize(torch.float64).T  # [16, 64]
    err = (out.double() - ref).abs().max().item() / ref.abs().max().item()
    assert err < 1e-6, f"seed={seed} {qt.name}: {err:.2e}"


def test_float_part_uses_torch(seed) -> None:
    dense = torch.randn(8, 256).half()
    f16 = QuantizedTensor(dense.view(torch.uint8).reshape(-1), QuantType.F16, (8, 256)).to(DEVICE)
    w = QuantizedWeight([random_quantized(QuantType.Q8_0, (16, 256), DEVICE), f16])
    x = torch.randn(2, 256, device=DEVICE).bfloat16()
    out = quant_matmul_triton(x, packed_parts(w), config=GEMV)
    assert_matches(seed, out, reference(x, w.dequantize(torch.float32)), x.dtype, "f16 part")


def test_quant_linear_dispatch(seed) -> None:
    w = QuantizedWeight([random_quantized(QuantType.Q6_K, (40, 256), DEVICE)])
    # any leading dims; x on the int8 grid, which the GPU's decode default (x rounded to int8) keeps exact
    x = on_int8_grid(2, 256, torch.bfloat16, DEVICE).view(2, 1, 256)
    bias = torch.randn(40, device=DEVICE).bfloat16()
    out = quant_matmul(x, w, backend="triton", bias=bias)
    ref = quant_matmul(x, w, backend="torch", bias=bias)
    assert out.shape == (2, 1, 40)
    assert_matches(seed, out, ref, x.dtype, "dispatch")
    if ON_CUDA:
        assert torch.equal(quant_matmul(x, w, bias=bias), out)  # None picks Triton on CUDA


def test_pack_model_packs_each_weight_once() -> None:
    model = nn.Module()
    model.a, model.b = nn.Linear(4, 4), nn.Linear(4, 4)
    shared = QuantizedWeight([random_quantized(QuantType.Q4_0, (8, 64))])
    set_quantized(model.a, "weight", shared)
    set_quantized(model.b, "weight", shared)
    assert pack_model(model) == 1
    first = shared.packed
    packed_parts(shared)
    assert shared.packed is first


def test_default_config_paths() -> None:
    assert default_matmul_config(1, 4096, interpret=False)["path"] == "gemv"
    assert default_matmul_config(1, 4096, interpret=False, qtype="Q3_K")["x_q8"]  # every packed type: int8 x
    # decode of the types gemv_v2 reads: int8 x, as every H200 tuning picked (and the only x Q5_K is read with)
    assert default_matmul_config(1, 4096, interpret=False, qtype="Q4_K")["x_q8"]
    assert default_matmul_config(1, 4096, interpret=False, qtype="Q5_K")["x_q8"]
    assert default_matmul_config(512, 4096, interpret=False, qtype="Q4_K")["path"] == "tile64"
    assert default_matmul_config(512, 4096, interpret=False, qtype="Q3_K")["path"] == "tile64"
    assert default_matmul_config(512, 4096, interpret=False)["path"] == "tile"


def test_tuned_tables_cover_only_their_buckets(monkeypatch, tmp_path) -> None:
    # a part's tuned bucket serves M from a quarter of it up to it; past its largest bucket, below a quarter of its
    # smallest (and for other parts) the default does
    import json

    from moerun.kernels.quant import configs

    tuned = {"path": "gemv_v2", "BLOCK_N": 8, "BLOCK_K": 512, "num_warps": 4, "num_stages": 1}
    tile = {"path": "tile64", "BLOCK_M": 128, "BLOCK_N": 64, "BLOCK_K": 128, "GROUP_M": 8, "num_warps": 4,
            "num_stages": 3}  # fmt: skip
    (tmp_path / "quant_gemv_FAKE.json").write_text(json.dumps({configs.matmul_key("Q4_K", 64, 256): {"2": tuned},
                                                              configs.matmul_key("Q6_K", 64, 512): {"512": tile}}))
    monkeypatch.setattr(configs, "CONFIG_DIR", tmp_path)
    monkeypatch.setattr(configs, "interpreting", lambda: False)
    configs.clear_matmul_configs()
    try:
        assert configs.get_matmul_config("Q4_K", 64, 256, 1, "FAKE") == tuned
        assert configs.get_matmul_config("Q4_K", 64, 256, 2, "FAKE") == tuned
        assert configs.get_matmul_config("Q4_K", 64, 256, 3, "FAKE") == \
            configs.default_matmul_config(3, 64, False, "Q4_K")
        assert configs.get_matmul_config("Q6_K", 64, 256, 1, "FAKE") == \
            configs.default_matmul_config(1, 64, False, "Q6_K")
        for m in (128, 300, 512):
            assert configs.get_matmul_config("Q6_K", 64, 512, m, "FAKE") == tile
        for m in (1, 8, 127, 513):
            assert configs.get_matmul_config("Q6_K", 64, 512, m, "FAKE") == \
                configs.default_matmul_config(m, 64, False, "Q6_K")
        # a table of one's own in MOERUN_GEMV_CONFIG_DIR replaces the parts it holds, the others stay shipped
        mine = tmp_path / "mine"
        mine.mkdir()
        (mine / "quant_gemv_FAKE.json").write_text(json.dumps({configs.matmul_key("Q4_K", 64, 256): {"2": tile}}))
        monkeypatch.setenv("MOERUN_GEMV_CONFIG_DIR", str(mine))
        assert configs.get_matmul_config("Q4_K", 64, 256, 1, "FAKE") == tile
        assert configs.get_matmul_config("Q6_K", 64, 512, 300, "FAKE") == tile
        monkeypatch.delenv("MOERUN_GEMV_CONFIG_DIR")
        assert configs.get_matmul_config("Q4_K", 64, 256, 1, "FAKE") == tuned
        # the MoE table of decode buckets says nothing about prefill sizes
        moe = {"1": {**tuned, "BLOCK_N2": 4, "BLOCK_K2": 256}, "8": {**tuned, "BLOCK_N2": 8, "BLOCK_K2": 256}}
        (tmp_path / configs.moe_config_file_name("Q4_K", 4, 256, 64, "FAKE")).write_text(json.dumps(moe))
        configs.load_moe_table.cache_clear()
        assert configs.get_moe_config("Q4_K", 4, 256, 64, 8, 16, "FAKE")["BLOCK_N2"] == 8
        assert configs.get_moe_config("Q4_K", 4, 256, 64, 8, 2, "FAKE")["BLOCK_N2"] == 8  # the bucket above 2
        assert configs.get_moe_config("Q4_K", 4, 256, 64, 8, 17, "FAKE") == \
            configs.default_moe_config(17, 8, interpret=False, qtype="Q4_K")
        # a table of one's own in MOERUN_MOE_CONFIG_DIR comes first; without one there, the shipped table
        own = tmp_path / "own"
        own.mkdir()
        (own / configs.moe_config_file_name("Q4_K", 4, 256, 64, "FAKE")).write_text(json.dumps(
            {"8": {**tuned, "BLOCK_N2": 16, "BLOCK_K2": 256, "slots2": 4}}))
        monkeypatch.setenv("MOERUN_MOE_CONFIG_DIR", str(own))
        assert configs.get_moe_config("Q4_K", 4, 256, 64, 8, 2, "FAKE")["slots2"] == 4
        assert configs.get_moe_config("Q6_K", 4, 256, 64, 8, 2, "FAKE") == \
            configs.default_moe_config(2, 8, interpret=False, qtype="Q6_K")
        monkeypatch.delenv("MOERUN_MOE_CONFIG_DIR")
        assert configs.get_moe_config("Q4_K", 4, 256, 64, 8, 2, "FAKE")["BLOCK_N2"] == 8
    finally:
        configs.clear_matmul_configs()
        configs.load_moe_table.cache_clear()


def test_shipped_tables_round_every_batch_as_its_graph_bucket(monkeypatch, request) -> None:
    # A decode step of B sequences replays the graph of the smallest bucket >= B; run eagerly, the same B must
    # pick a config that rounds x and the intermediate to int8 exactly where the bucket's does.
    import json

    from moerun.engine.runner import BUCKETS
    from moerun.kernels.quant import configs

    monkeypatch.setattr(configs, "interpreting", lambda: False)
    configs.clear_matmul_configs()  # memoised: cleared before and after
    request.addfinalizer(configs.clear_matmul_configs)
    names = sorted(p.name for p in configs.CONFIG_DIR.glob("quant_Q*_E=*.json"))
    assert names, "no shipped quantized MoE tables"
    for name in names:
        qtype, rest = name[len("quant_"):].split("_E=")
        E, H, I = (int(v.split("=")[-1]) for v in rest.split(",")[:3])  # noqa: E741
        device = rest.split("device=")[1].removesuffix(".json")
        for B in range(1, BUCKETS[-1] + 1):
            bucket = next(b for b in BUCKETS if b >= B)
            a, b = (configs.get_moe_config(qtype, E, H, I, 8, m, device) for m in (B, bucket))
            assert (a["path"], a.get("x_q8"), a.get("inter_q8")) == (b["path"], b.get("x_q8"), b.get("inter_q8")), \
                f"{name}: batch {B} against its bucket {bucket}"
    for table in configs.CONFIG_DIR.glob("quant_gemv_*.json"):  # the dense projections' tables
        device = table.name.removeprefix("quant_gemv_").removesuffix(".json")
        for key in json.loads(table.read_text()):
            part = dict(kv.split("=") for kv in key.split(","))
            for B in range(1, BUCKETS[-1] + 1):
                bucket = next(b for b in BUCKETS if b >= B)
                a, b = (configs.get_matmul_config(part["type"], int(part["N"]), int(part["K"]), m, device)
                        for m in (B, bucket))  # fmt: skip
                assert (a["path"], a.get("x_q8")) == (b["path"], b.get("x_q8")), f"{key}: batch {B}, bucket {bucket}"


@pytest.mark.skipif(not ON_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("qt", [QuantType.Q4_K, QuantType.Q8_0], ids=lambda t: t.name)
@pytest.mark.parametrize("M", [1, 7, 300])
def test_attention_sized_projection_default_config(seed, qt, M) -> None:
    t = random_quantized(qt, (5120, 2048), DEVICE)  # Qwen3-30B-A3B q|k|v
    x = torch.randn(M, 2048, device=DEVICE, dtype=torch.bfloat16)
    out = quant_matmul_triton(x, pack(t))
    assert_matches(seed, out, reference(x, t.dequantize()), x.dtype, f"{qt.name} M={M}")
