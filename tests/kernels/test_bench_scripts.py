"""The per-layer benchmark scripts (benchmarks/bench_moe.py, bench_quant_moe.py, bench_grid_gemv.py) run end to end
on tiny shapes in Triton's interpreter and write their JSON: the timings are meaningless there, the code paths are
not."""

from __future__ import annotations

import json
import runpy
from pathlib import Path

import pytest

pytest.importorskip("triton")

SCRIPTS = Path(__file__).parents[2] / "benchmarks"


def _main(name: str):
    return runpy.run_path(str(SCRIPTS / name))["main"]


def test_bench_quant_moe_tiny(tmp_path) -> None:
    _main("bench_quant_moe.py")(["--types", "Q4_K", "--E", "4", "--H", "256", "--I", "256", "--k", "2", "--m", "1",
                                 "--budget-s", "0.01", "--max-runs", "2", "--routing-sets", "1", "--max-copies", "1",
                                 "--out", str(tmp_path)])  # fmt: skip
    rows = json.loads((tmp_path / "bench_quant_moe.json").read_text())["rows"]
    assert [(r["type"], r["M"]) for r in rows] == [("Q4_K", 1)]
    assert rows[0]["quant"]["us"] > 0 and rows[0]["max_rel_err_vs_bf16"] < 3e-2
    assert (tmp_path / "bench_quant_moe.md").read_text().count("| Q4_K | 1 |") == 1


def test_bench_grid_gemv_tiny(tmp_path) -> None:
    # the default tiles and a named config (the table gathered from registers) on the q projection and the experts
    out = tmp_path / "grid.json"
    _main("bench_grid_gemv.py")(["--shape", "tiny", "--quant", "IQ2_M", "--m", "1", "--only", "attn_q",
                                 "ffn_down_exps", "--configs", "4x64w2g", "--rep-ms", "1",
                                 "--out", str(out)])  # fmt: skip
    rows = json.loads(out.read_text())
    assert [(r["part"], r["config"]) for r in rows] == [("attn_q", "default"), ("attn_q", "4x64w2g"),
                                                        ("ffn_down_exps", "default"), ("ffn_down_exps", "4x64w2g")]
    assert all("error" not in r and r["us"] > 0 for r in rows), rows
    assert rows[1]["cfg"] == {"BLOCK_N": 4, "GROUPS": 64, "num_warps": 2, "gather": 1}


def test_bench_quant_moe_compare_grid_type(tmp_path) -> None:
    # --compare on a grid type (no repacked layout): the tile configs read its GGUF blocks
    _main("bench_quant_moe.py")(["--types", "IQ2_XXS", "--E", "2", "--H", "256", "--I", "256", "--k", "1", "--m", "16",
                                 "--compare", "k16x64", "--budget-s", "0.01", "--max-runs", "1", "--out",
                                 str(tmp_path)])  # fmt: skip
    rows = json.loads((tmp_path / "compare.json").read_text())
    assert [(r["type"], r["config"], r["path"]) for r in rows] == [("IQ2_XXS", "bf16", "bf16"),
                                                                   ("IQ2_XXS", "default", "tile64"),
                                                                   ("IQ2_XXS", "k16x64", "tile64")]
    # each config's time against the bf16 kernel's on the same routing (the prefill target's measure)
    assert all(r["vs_bf16"] == pytest.approx(r["us"] / rows[0]["us"]) for r in rows[1:]), rows


def test_bench_moe_tiny(tmp_path) -> None:
    _main("bench_moe.py")(["--E", "4", "--H", "64", "--I", "64", "--k", "2", "--m", "1", "4", "--impl",
                           "triton,torch_ref", "--budget-s", "0.01", "--max-runs", "2", "--routing-sets", "1",
                           "--max-copies", "1", "--out", str(tmp_path)])  # fmt: skip
    rows = json.loads((tmp_path / "bench_moe.json").read_text())["rows"]
    assert sorted({r["M"] for r in rows}) == [1, 4]
    assert (tmp_path / "bench_moe.md").exists()


@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K", "Q5_K", "IQ4_XS", "Q3_K", "F16"])
def test_quant_gemv_tuner_families(qtype) -> None:
    # each family tries what it names: "tiles" prefill tiles only, "x_q8" int8-x decode configs only (beside the
    # default and the shipped config), and no type gets a float-x config the kernels refuse for it
    candidates = runpy.run_path(str(SCRIPTS / "tune_quant_gemv.py"))["candidates"]
    tiles = candidates(qtype, 4608, 2048, 512, True, "tiles")
    assert tiles and all(c["path"] in ("tile", "tile64") for c in tiles)
    for family in ("x_q8", "all"):
        decode = candidates(qtype, 4608, 2048, 1, True, family)[1:]  # past the default
        v2 = [c for c in decode if c["path"] == "gemv_v2"]
        if qtype in ("Q5_K", "IQ4_XS", "Q3_K"):  # int8 x only
            assert v2 and all(c.get("x_q8") for c in v2)
        if family == "x_q8":
            assert all(c.get("x_q8") for c in v2) and all(c["path"] == "gemv_v2" for c in decode)
    if qtype == "F16":  # a float part: no gemv_v2 decode for it
        assert not [c for c in candidates(qtype, 4608, 2048, 1, True, "all") if c["path"] == "gemv_v2"]
