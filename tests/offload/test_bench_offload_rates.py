"""benchmarks/bench_offload.py's rate measurements: the staging copy kernel's warm and first-pass rates come back
positive from memory page-locked as the store's is (GPU only), and are zeros where there is no CUDA."""

from __future__ import annotations

import math
import runpy
from pathlib import Path

import pytest
import torch

from moerun.config import ModelConfig
from moerun.models.presets import preset_config

SCRIPT = Path(__file__).parents[2] / "benchmarks" / "bench_offload.py"


def test_stage_copy_rates() -> None:
    bench = runpy.run_path(str(SCRIPT))
    mc = ModelConfig.from_hf_dict(preset_config("qwen3-30b-a3b", layers=1))
    assert bench["measure_stage_copy"](torch.device("cpu"), mc) == (0.0, 0.0)
    if not torch.cuda.is_available():
        pytest.skip("the staging copy kernel's rates need CUDA")
    warm, first = bench["measure_stage_copy"](torch.device("cuda"), mc, launches=4, pool_bytes=2**28)
    assert all(math.isfinite(r) and 0 < r < 1000 for r in (warm, first))  # GB/s of a PCIe read
