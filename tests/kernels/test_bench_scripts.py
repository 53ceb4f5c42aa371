"""The per-layer benchmark scripts (benchmarks/bench_moe.py, bench_quant_moe.py) run end to end on tiny shapes in
Triton's interpreter and write their JSON: the timings are meaningless there, the code paths are not."""

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


def test_bench_moe_tiny(tmp_path) -> None:
    _main("bench_moe.py")(["--E", "4", "--H", "64", "--I", "64", "--k", "2", "--m", "1", "4", "--impl",
                           "triton,torch_ref", "--budget-s", "0.01", "--max-runs", "2", "--routing-sets", "1",
                           "--max-copies", "1", "--out", str(tmp_path)])  # fmt: skip
    rows = json.loads((tmp_path / "bench_moe.json").read_text())["rows"]
    assert sorted({r["M"] for r in rows}) == [1, 4]
    assert (tmp_path / "bench_moe.md").exists()
