"""benchmarks/bench_offload_host.py runs on a few tiny layers: the host part of a copy-mode layer is timed with the
experts' compute apart, and zero-copy's work between steps is timed."""

from __future__ import annotations

import runpy
from pathlib import Path

SCRIPT = Path(__file__).parents[2] / "benchmarks" / "bench_offload_host.py"


def test_bench_offload_host_times_the_experts_compute_apart(capsys) -> None:
    bench = runpy.run_path(str(SCRIPT))
    args = bench["parse_args"](["--layers", "3", "--experts", "16", "--top-k", "4", "--slots", "6", "--steps", "4",
                                "--churn", "0.5"])
    total, experts, hit = bench["time_finish"](args, prefetch=False)
    assert 0 < experts < total  # the passes ran inside the host part and are a part of it
    assert 0 < hit < 1  # churn over 16 experts with 6 slots: some hits, some misses
    assert bench["main"](["--layers", "2", "--experts", "16", "--top-k", "4", "--slots", "6", "--steps", "2"]) == 0
    out = capsys.readouterr().out
    assert out.count("of which the tiny experts' compute") == 2 and "zero-copy: between steps" in out
