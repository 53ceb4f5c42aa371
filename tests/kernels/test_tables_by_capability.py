"""Tuned tables by compute capability: a card with no table of its own for a shape reads those shipped for the cards
of its capability (an H100 the H200's, an H200 the H100's), for every kind of table; its own tables come first."""

import json

import pytest
import torch

pytest.importorskip("triton")

from moerun.bench.report import format_table  # noqa: E402
from moerun.kernels import gemv, tile_configs  # noqa: E402
from moerun.kernels.gemv import GemvConfig, table_key, table_path  # noqa: E402
from moerun.kernels.quant import configs as qconfigs  # noqa: E402

OWN, SIBLING = "FAKE_H100", "FAKE_H200"


def test_table_devices_follow_the_capability() -> None:
    h200, h100 = tile_configs.SHIPPED_FOR_CAPABILITY[(9, 0)]
    assert tile_configs.table_devices(h100, (9, 0)) == (h100, h200)
    assert tile_configs.table_devices(h200, (9, 0)) == (h200, h100)  # each card once
    assert tile_configs.table_devices("NVIDIA_GH200_480GB", (9, 0)) == ("NVIDIA_GH200_480GB", h200, h100)
    assert tile_configs.table_devices("NVIDIA_A100-SXM4-80GB", (8, 0)) == ("NVIDIA_A100-SXM4-80GB",)
    assert tile_configs.table_devices("cpu", None) == ("cpu",)


def test_every_capability_names_cards_with_shipped_tables() -> None:
    for capability, cards in tile_configs.SHIPPED_FOR_CAPABILITY.items():
        assert tile_configs.devices_with_tables(cards) == list(cards), capability
    assert tile_configs.devices_with_tables(["no-such-card"]) == []


def test_first_found_skips_empty_answers() -> None:
    answers = {"a": None, "b": {}, "c": {1: "x"}, "d": {2: "y"}}
    assert tile_configs.first_found(answers.get, "abcd") == {1: "x"}
    assert tile_configs.first_found(answers.get, "ab") is None


@pytest.fixture
def two_cards(monkeypatch):
    """The current card is OWN, whose capability's shipped tables are SIBLING's; the tuned tables are read."""
    monkeypatch.setattr(tile_configs, "current_table_devices", lambda: (OWN, SIBLING))
    monkeypatch.setattr(qconfigs, "current_table_devices", lambda: (OWN, SIBLING))
    for module in (tile_configs, qconfigs):
        monkeypatch.setattr(module, "interpreting", lambda: False)
    tile_configs.load_table.cache_clear()
    qconfigs.clear_matmul_configs()
    qconfigs.load_moe_table.cache_clear()
    yield
    tile_configs.load_table.cache_clear()
    qconfigs.clear_matmul_configs()
    qconfigs.load_moe_table.cache_clear()


def _write(path, table) -> None:
    path.write_text(json.dumps(table))


def test_bf16_moe_tables_fall_back_per_shape(tmp_path, monkeypatch, two_cards) -> None:
    monkeypatch.setattr(tile_configs, "CONFIG_DIR", tmp_path)
    sibling = {"1": {"path": "gemv", "BLOCK_N": 16, "BLOCK_K": 64, "reduce": "fused"}}
    own = {"1": {"path": "gemv", "BLOCK_N": 32, "BLOCK_K": 64, "reduce": "sum"}}
    for shape in ((13, 64, 32), (13, 64, 48)):
        _write(tmp_path / tile_configs.config_file_name(*shape, torch.bfloat16, SIBLING), sibling)
    assert tile_configs.get_config(13, 64, 32, 2, torch.bfloat16, 1)["reduce"] == "fused"
    _write(tmp_path / tile_configs.config_file_name(13, 64, 32, torch.bfloat16, OWN), own)
    tile_configs.load_table.cache_clear()
    assert tile_configs.get_config(13, 64, 32, 2, torch.bfloat16, 1)["reduce"] == "sum"  # its own first
    assert tile_configs.get_config(13, 64, 48, 2, torch.bfloat16, 1)["reduce"] == "fused"  # the other shape
    # a device named by the caller reads its own tables only
    assert tile_configs.get_config(13, 64, 48, 2, torch.bfloat16, 1, OWN) == \
        tile_configs.default_config(1, 2, torch.bfloat16, interpret=False)
    assert tile_configs.devices_with_tables([OWN, SIBLING, "FAKE_B200"]) == [OWN, SIBLING]


def test_quantized_tables_fall_back_per_shape_and_part(tmp_path, monkeypatch, two_cards) -> None:
    monkeypatch.setattr(qconfigs, "CONFIG_DIR", tmp_path)
    v2 = {"path": "gemv_v2", "BLOCK_N": 8, "BLOCK_K": 512, "num_warps": 4, "num_stages": 1}
    _write(tmp_path / qconfigs.moe_config_file_name("Q4_K", 4, 256, 64, SIBLING), {"1": {**v2, "BLOCK_N2": 8}})
    assert qconfigs.get_moe_config("Q4_K", 4, 256, 64, 8, 1)["BLOCK_N2"] == 8
    _write(tmp_path / qconfigs.moe_config_file_name("Q4_K", 4, 256, 64, OWN), {"1": {**v2, "BLOCK_N2": 16}})
    qconfigs.load_moe_table.cache_clear()
    assert qconfigs.get_moe_config("Q4_K", 4, 256, 64, 8, 1)["BLOCK_N2"] == 16
    assert qconfigs.get_moe_config("Q6_K", 4, 256, 64, 8, 1) == \
        qconfigs.default_moe_config(1, 8, interpret=False, qtype="Q6_K")  # neither card has it

    a, b = qconfigs.matmul_key("Q4_K", 64, 256), qconfigs.matmul_key("Q6_K", 64, 512)
    _write(qconfigs.matmul_table_path(SIBLING, tmp_path), {a: {"1": v2}, b: {"1": {**v2, "BLOCK_N": 4}}})
    _write(qconfigs.matmul_table_path(OWN, tmp_path), {a: {"1": {**v2, "BLOCK_K": 1024}}})
    assert qconfigs.get_matmul_config("Q4_K", 64, 256, 1)["BLOCK_K"] == 1024  # its own entry for the part
    assert qconfigs.get_matmul_config("Q6_K", 64, 512, 1)["BLOCK_N"] == 4  # the sibling's for the other part


def test_dense_gemv_table_falls_back_per_shape(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(gemv, "cuda_table_devices", lambda index: (OWN, SIBLING))
    monkeypatch.setattr(gemv, "_sm_count", lambda index: 132)
    a, b = table_key(5120, 2048, torch.bfloat16), table_key(2048, 4096, torch.bfloat16)
    mine, shipped = GemvConfig(block_n=8, block_k=256), GemvConfig(block_n=2, block_k=512)
    _write(table_path(SIBLING, tmp_path), {a: {"1": shipped.to_dict()}, b: {"1": shipped.to_dict()}})
    _write(table_path(OWN, tmp_path), {a: {"1": mine.to_dict()}})
    gemv.load_table.cache_clear()
    gemv._cuda_config.cache_clear()
    try:
        assert gemv._cuda_config(5120, 2048, 1, torch.bfloat16, 0, False, str(tmp_path)) == mine
        assert gemv._cuda_config(2048, 4096, 1, torch.bfloat16, 0, False, str(tmp_path)) == shipped
    finally:
        gemv.load_table.cache_clear()
        gemv._cuda_config.cache_clear()


def test_bench_report_names_the_tables() -> None:
    result = {"model": "m", "device": "NVIDIA H100 80GB HBM3", "dtype": "bfloat16", "prefill": {}, "decode": {},
              "tuned_tables": ["NVIDIA_H200"]}  # fmt: skip
    assert "tuned tables NVIDIA_H200" in format_table(result)
    assert "tuned tables none (untuned defaults)" in format_table({**result, "tuned_tables": []})
    assert "tuned tables" not in format_table({**result, "device": "cpu"})
