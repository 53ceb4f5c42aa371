"""fused_moe_triton (gemv and tile paths, every slot reduction) against fused_moe_reference."""

from __future__ import annotations

import json

import pytest
import torch

from helpers import check_graphed_moe

pytest.importorskip("triton")

from moerun.kernels import tile_configs  # noqa: E402
from moerun.kernels.fused_moe import fused_moe_triton  # noqa: E402
from moerun.kernels.router import route_triton  # noqa: E402
from moerun.kernels.tile_configs import default_config  # noqa: E402
from moerun.ops import moe as moe_ops  # noqa: E402
from moerun.ops.moe_reference import fused_moe_reference, route_reference  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
ON_CUDA = DEVICE.type == "cuda"

# Small tiles (tl.dot needs >= 16 on GPUs); one N-tile covers the test's I so the interpreter runs few programs.
GEMV_SUM = {"path": "gemv", "BLOCK_N": 64, "BLOCK_K": 32, "BLOCK_N2": 64, "BLOCK_K2": 32, "reduce": "sum"}
GEMV_ATOMIC = {**GEMV_SUM, "reduce": "atomic"}
# Narrow GEMM2 tiles so that a program loops over several K-steps per slot and the grid has several N-tiles.
GEMV_FUSED = {**GEMV_SUM, "BLOCK_N2": 16, "BLOCK_K2": 16, "reduce": "fused"}
TILE_ATOMIC = {"path": "tile", "BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 32, "GROUP_M": 4, "reduce": "atomic"}
TILE_SUM = {**TILE_ATOMIC, "BLOCK_N2": 64, "BLOCK_K2": 16, "GROUP_M": 1, "reduce": "sum"}
# Per-slot rows in the output dtype, then the fp32 sum.
TILE_SUM_OUT = {**TILE_SUM, "reduce": "sum_out"}
# 32-row blocks; a block of at most 16 token-slots (an expert's last) runs as a 16-row tile in both GEMMs.
TILE_TAIL = {**TILE_ATOMIC, "BLOCK_M": 32, "TAIL_M": 16}
# Weight tiles by tensor descriptors; GEMM 2's N-tile (32) does not divide the tests' odd H, nor K-tiles their I.
TILE_TMA = {**TILE_ATOMIC, "tma": True}
CONFIGS = {
    "gemv-sum": GEMV_SUM,
    "gemv-atomic": GEMV_ATOMIC,
    "gemv-fused": GEMV_FUSED,
    "tile-atomic": TILE_ATOMIC,
    "tile-sum": TILE_SUM,
    "tile-sum-out": TILE_SUM_OUT,
    "tile-tail": TILE_TAIL,
    "tile-tma": TILE_TMA,
}

# Error allowed relative to the largest reference magnitude; the reference rounds each expert's output to the
# weights' dtype before the weighted sum, the kernels keep fp32 there.
TOLERANCE = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def make_weights(E: int, H: int, I: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:  # noqa: E741
    """w13 [E, 2I, H] and w2 [E, H, I] scaled so activations stay of order one."""
    w13 = (torch.randn(E, 2 * I, H) / H**0.5).to(dtype).to(DEVICE)
    w2 = (torch.randn(E, H, I) / I**0.5).to(dtype).to(DEVICE)
    return w13, w2


def random_routing(T: int, E: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Renormalised top-k of random logits: weights [T, k] float32, ids [T, k] int32."""
    weights, ids = route_reference(torch.randn(T, E), k, True)
    return weights.to(DEVICE), ids.to(DEVICE)


def check(
    seed: int,
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    config: dict | None,
) -> None:
    out = fused_moe_triton(hidden, w13, w2, weights, ids, config)
    ref = fused_moe_reference(hidden, w13, w2, weights, ids)
    assert out.dtype == hidden.dtype and out.shape == hidden.shape
    tol = TOLERANCE[w13.dtype]
    scale = ref.float().abs().max().item() + 1e-6
    torch.testing.assert_close(
        out.float(), ref.float(), rtol=tol, atol=tol * scale, msg=lambda m: f"seed={seed} config={config}: {m}"
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("config", ["gemv-sum", "tile-atomic", "tile-tma"])
@pytest.mark.parametrize(
    "T,E,H,I,k",
    [(1, 7, 48, 40, 2), (5, 13, 64, 32, 8), (19, 13, 32, 64, 1)],
    ids=["T1-E7-k2-oddHI", "T5-E13-k8", "T19-E13-k1"],
)
def test_fused_moe_matches_reference(seed, T, E, H, I, k, config, dtype) -> None:  # noqa: E741
    w13, w2 = make_weights(E, H, I, dtype)
    weights, ids = random_routing(T, E, k)
    hidden = torch.randn(T, H).to(dtype).to(DEVICE)
    check(seed, hidden, w13, w2, weights, ids, CONFIGS[config])


@pytest.mark.parametrize("config", ["gemv-atomic", "tile-sum", "tile-sum-out"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_other_slot_reduction(seed, config, dtype) -> None:
    T, E, H, I, k = 3, 13, 48, 64, 8  # noqa: E741
    w13, w2 = make_weights(E, H, I, dtype)
    weights, ids = random_routing(T, E, k)
    check(seed, torch.randn(T, H).to(dtype).to(DEVICE), w13, w2, weights, ids, CONFIGS[config])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("T,H,k", [(1, 48, 8), (3, 33, 3), (5, 200, 2)], ids=["T1-k8", "T3-oddH", "T5-k2-zeroed4"])
def test_gemv_atomic_keeps_float32_sums(seed, T, H, k, dtype) -> None:
    # The gemv path's atomic reduce: GEMM 1 zeroes the float32 [T, H] that GEMM 2 adds into (no memset launch);
    # keep_float32 hands it on unrounded, else it is rounded to the output dtype. T5-k2: 1,000 outputs zeroed by
    # 60 GEMM 1 programs, several elements each; T3-oddH: the last program's slice is partly past the end.
    E, I = 9, 80  # noqa: E741
    w13, w2 = make_weights(E, H, I, dtype)
    weights, ids = random_routing(T, E, k)
    hidden = torch.randn(T, H).to(dtype).to(DEVICE)
    cfg = {**GEMV_ATOMIC, "BLOCK_N": 4, "BLOCK_N2": 32}
    kept = fused_moe_triton(hidden, w13, w2, weights, ids, cfg, keep_float32=True)
    assert kept.dtype == torch.float32 and kept.shape == (T, H)
    ref = fused_moe_reference(hidden, w13, w2, weights, ids)
    scale = ref.float().abs().max().item() + 1e-6
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(kept, ref.float(), rtol=tol, atol=tol * scale, msg=lambda m: f"seed={seed}: {m}")
    # the buffer is zeroed again on every call; on a GPU the atomics add in any order (float32 rounding apart)
    same = {"rtol": 1e-5, "atol": 1e-6 * scale} if ON_CUDA else {"rtol": 0, "atol": 0}
    for _ in range(2):
        again = fused_moe_triton(hidden, w13, w2, weights, ids, cfg, keep_float32=True)
        torch.testing.assert_close(again, kept, **same, msg=lambda m: f"seed={seed}: {m}")
    rounded = fused_moe_triton(hidden, w13, w2, weights, ids, cfg)
    assert rounded.dtype == dtype
    torch.testing.assert_close(rounded, kept.to(dtype), **({"rtol": 8e-3, "atol": 1e-5} if ON_CUDA else same))
    # the tile path's atomic sums (zeroed by a memset there) are kept too; other reductions ignore keep_float32:
    # their sums are rounded in the launch that makes them
    tile = fused_moe_triton(hidden, w13, w2, weights, ids, TILE_ATOMIC, keep_float32=True)
    assert tile.dtype == torch.float32
    torch.testing.assert_close(tile.to(dtype), fused_moe_triton(hidden, w13, w2, weights, ids, TILE_ATOMIC),
                               **({"rtol": 8e-3, "atol": 1e-5} if ON_CUDA else same))  # fmt: skip
    assert fused_moe_triton(hidden, w13, w2, weights, ids, GEMV_SUM, keep_float32=True).dtype == dtype


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    "T,E,H,I,k",
    [(1, 7, 48, 40, 2), (3, 13, 33, 23, 8), (8, 9, 40, 24, 1)],
    ids=["T1-E7-k2", "T3-E13-k8-oddHI", "T8-E9-k1"],
)
def test_gemv_fused_slot_reduction(seed, T, E, H, I, k, dtype) -> None:  # noqa: E741
    w13, w2 = make_weights(E, H, I, dtype)
    weights, ids = random_routing(T, E, k)
    hidden = torch.randn(T, H).to(dtype).to(DEVICE)
    check(seed, hidden, w13, w2, weights, ids, GEMV_FUSED)


def test_fused_slot_reduction_needs_gemv_path() -> None:
    assert tile_configs.normalize(GEMV_FUSED)["reduce"] == "fused"
    with pytest.raises(ValueError, match="gemv"):
        tile_configs.normalize({**TILE_ATOMIC, "reduce": "fused"})
    with pytest.raises(ValueError, match="tile"):
        tile_configs.normalize({**GEMV_SUM, "reduce": "sum_out"})


@pytest.mark.parametrize("config", ["gemv-sum", "tile-atomic"])
def test_one_expert_takes_all_tokens(seed, config) -> None:
    # 35 tokens on expert 4 span three 16-row blocks; the other 12 experts get nothing.
    T, E, H, I = 35, 13, 32, 64  # noqa: E741
    w13, w2 = make_weights(E, H, I, torch.float32)
    ids = torch.full((T, 1), 4, dtype=torch.int32, device=DEVICE)
    weights = torch.rand(T, 1, device=DEVICE)
    check(seed, torch.randn(T, H, device=DEVICE), w13, w2, weights, ids, CONFIGS[config])


def test_tile_path_with_empty_experts_and_many_blocks(seed) -> None:
    T, E, H, I, k = 61, 16, 32, 32, 2  # noqa: E741
    w13, w2 = make_weights(E, H, I, torch.bfloat16)
    # Only experts 1, 2, 9 are used, so each gets several blocks and 13 experts none.
    pool = torch.tensor([1, 2, 9], dtype=torch.int32)
    ids = torch.stack([pool[torch.randperm(3)[:k]] for _ in range(T)]).to(DEVICE)  # [T, k]
    weights = torch.softmax(torch.randn(T, k), dim=-1).to(DEVICE)
    check(seed, torch.randn(T, H).to(torch.bfloat16).to(DEVICE), w13, w2, weights, ids, TILE_ATOMIC)


@pytest.mark.parametrize("reduce", ["atomic", "sum"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_short_tail_tiles(seed, reduce, dtype) -> None:
    # Experts 0..4 get 33, 48, 49, 16 and 1 token-slots: last blocks of 1, 16 (= TAIL_M) and 17 (> TAIL_M: the
    # full tile), a lone 16 and a lone 1; the 32-row blocks before them are full. k = 1, so one token per slot.
    counts = [33, 48, 49, 16, 1]
    ids = torch.cat([torch.full((n,), e, dtype=torch.int32) for e, n in enumerate(counts)])
    ids = ids[torch.randperm(ids.numel())][:, None].to(DEVICE)  # [T, 1]
    T, E, H, I = ids.shape[0], 7, 32, 64  # noqa: E741
    w13, w2 = make_weights(E, H, I, dtype)
    weights = torch.rand(T, 1, device=DEVICE)
    check(seed, torch.randn(T, H).to(dtype).to(DEVICE), w13, w2, weights, ids, {**TILE_TAIL, "reduce": reduce})


@pytest.mark.parametrize("tail", [0, 16])
def test_tma_weight_tiles(seed, tail) -> None:
    # N-tiles past the gate rows (I = 40 in 32-wide tiles) and K-tiles past the end of the row (H = 40, I = 40 in
    # 32-wide steps); tiles of the last expert's rows run off the end of the tensor
    T, E, H, I, k = 37, 5, 40, 40, 2  # noqa: E741
    w13, w2 = make_weights(E, H, I, torch.bfloat16)
    weights, ids = random_routing(T, E, k)
    check(seed, torch.randn(T, H).to(torch.bfloat16).to(DEVICE), w13, w2, weights, ids,
          {**TILE_TAIL, "tma": True, "TAIL_M": tail})  # fmt: skip


def test_tail_tile_config_is_checked() -> None:
    for tail in (8, 24, 32):  # below 16, not a power of two, not below BLOCK_M
        with pytest.raises(ValueError, match="TAIL_M"):
            tile_configs.normalize({**TILE_TAIL, "TAIL_M": tail})
    with pytest.raises(ValueError, match="TAIL_M"):
        tile_configs.normalize({**GEMV_SUM, "TAIL_M": 16})


def test_hidden_dtype_differs_from_weights(seed) -> None:
    T, E, H, I, k = 4, 7, 32, 32, 2  # noqa: E741
    w13, w2 = make_weights(E, H, I, torch.float32)
    weights, ids = random_routing(T, E, k)
    hidden = torch.randn(T, H).to(torch.bfloat16).to(DEVICE)
    out = fused_moe_triton(hidden, w13, w2, weights, ids, GEMV_SUM)
    ref = fused_moe_reference(hidden, w13, w2, weights, ids)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref.float(), rtol=1e-2, atol=2e-2, msg=lambda m: f"seed={seed}: {m}")


@pytest.mark.parametrize("T", [1, 6])
def test_dispatch_with_default_config(seed, T) -> None:
    E, H, I, k = 13, 64, 32, 2  # noqa: E741
    w13, w2 = make_weights(E, H, I, torch.float16)
    logits = torch.randn(T, E, device=DEVICE)
    weights, ids = moe_ops.route(logits, k, True, backend="triton")
    hidden = torch.randn(T, H).to(torch.float16).to(DEVICE)
    out = moe_ops.fused_moe(hidden, w13, w2, weights, ids, backend="triton")
    ref = fused_moe_reference(hidden, w13, w2, *route_reference(logits, k, True))
    tol = TOLERANCE[torch.float16]
    scale = ref.float().abs().max().item()
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol * scale, msg=lambda m: f"seed={seed}: {m}")


def test_default_config_paths() -> None:
    assert default_config(1, 8, torch.bfloat16, interpret=False)["path"] == "gemv"
    assert default_config(4096, 8, torch.bfloat16, interpret=False)["path"] == "tile"
    # untuned shapes on a GPU sum the slots in a fixed order (no atomics): the same inputs give the same bits;
    # but for one token, whose float32 atomic sums go to the next norm unrounded
    assert default_config(64, 8, torch.bfloat16, interpret=False)["reduce"] == "sum_out"
    assert default_config(2, 8, torch.bfloat16, interpret=False)["reduce"] == "sum"
    assert default_config(1, 8, torch.bfloat16, interpret=False)["reduce"] == "atomic"
    assert default_config(1, 2, torch.float32, interpret=True)["path"] == "gemv"


def test_config_table_lookup(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(tile_configs, "CONFIG_DIR", tmp_path)
    tile_configs.load_table.cache_clear()
    name = tile_configs.config_file_name(13, 64, 32, torch.bfloat16, "Fake_GPU")
    assert name == "E=13,H=64,I=32,dtype=bfloat16,device=Fake_GPU.json"
    (tmp_path / name).write_text(
        '{"1": {"path": "gemv", "BLOCK_N": 16, "BLOCK_K": 64}, "64": ' + json.dumps(TILE_ATOMIC) + "}"
    )
    table = tile_configs.load_table(13, 64, 32, torch.bfloat16, "Fake_GPU")
    tile_configs.load_table.cache_clear()
    assert table is not None and set(table) == {1, 64}
    assert table[1]["reduce"] == "sum" and table[1]["BLOCK_N2"] == 16
    assert table[64]["path"] == "tile" and table[64]["BLOCK_M"] == 16
    assert tile_configs.nearest_bucket(list(table), 5) == 1
    assert tile_configs.nearest_bucket(list(table), 16) == 64
    assert tile_configs.nearest_bucket(list(table), 4096) == 64


def test_user_config_dir_comes_first(tmp_path, monkeypatch) -> None:
    shipped, user = tmp_path / "shipped", tmp_path / "user"
    shipped.mkdir(), user.mkdir()
    monkeypatch.setattr(tile_configs, "CONFIG_DIR", shipped)
    name = tile_configs.config_file_name(13, 64, 32, torch.bfloat16, "Fake_GPU")
    (shipped / name).write_text(json.dumps({"1": GEMV_SUM}))
    (user / name).write_text(json.dumps({"1": GEMV_FUSED}))
    tile_configs.load_table.cache_clear()
    try:
        assert tile_configs.load_table(13, 64, 32, torch.bfloat16, "Fake_GPU")[1]["reduce"] == "sum"
        assert tile_configs.load_table(13, 64, 32, torch.bfloat16, "Fake_GPU", str(user))[1]["reduce"] == "fused"
        # a user folder without the shape's table falls back to the shipped one
        assert tile_configs.load_table(13, 64, 32, torch.bfloat16, "Fake_GPU", str(tmp_path))[1]["reduce"] == "sum"
    finally:
        tile_configs.load_table.cache_clear()


# ---------------------------------------------------------------------------------------------------------------
# CUDA only: real Qwen3-30B-A3B expert shape with the shipped/default configs, and CUDA-graph capture.

QWEN3_30B = (128, 2048, 768, 8)  # E, H, I, k


@pytest.mark.skipif(not ON_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("T", [1, 3, 8, 16, 64, 256, 1024, 4096])
def test_qwen3_30b_shape_default_config(seed, T) -> None:
    E, H, I, k = QWEN3_30B  # noqa: E741
    w13, w2 = make_weights(E, H, I, torch.bfloat16)
    weights, ids = random_routing(T, E, k)
    check(seed, torch.randn(T, H, device=DEVICE, dtype=torch.bfloat16), w13, w2, weights, ids, None)


@pytest.mark.skipif(not ON_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("config", [*CONFIGS, "default"])
@pytest.mark.parametrize("T", [4, 100])
def test_cuda_graph_capture_and_replay(seed, config, T) -> None:
    E, H, I, k = 16, 256, 128, 4  # noqa: E741
    w13, w2 = make_weights(E, H, I, torch.bfloat16)
    hidden = torch.randn(T, H, device=DEVICE, dtype=torch.bfloat16)
    logits = torch.randn(T, E, device=DEVICE)
    cfg = CONFIGS.get(config)  # None: the tuned table or the default by M

    def step() -> torch.Tensor:
        weights, ids = route_triton(logits, k, True)
        return fused_moe_triton(hidden, w13, w2, weights, ids, cfg)

    check_graphed_moe(step, hidden, logits, w13, w2, k, TOLERANCE[torch.bfloat16], seed)
