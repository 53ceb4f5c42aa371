"""Timing helpers and the device ceilings (HBM read bandwidth, bf16 matmul rate) measured in the same run."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_call(fn: Callable[[], object], device: torch.device, repeat: int = 5, warmup: int = 1) -> float:
    """Median wall time in seconds of fn() (synchronised on CUDA)."""
    for _ in range(warmup):
        fn()
    synchronize(device)
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2]


def measure_ceilings(device: torch.device) -> dict[str, float]:
    """HBM read bandwidth (a sum over 4 GiB) and bf16 matmul rate (8192^3) on a CUDA device."""
    if device.type != "cuda":
        return {}
    x = torch.empty(2**31, dtype=torch.bfloat16, device=device).normal_()  # 4 GiB
    t_read = time_call(lambda x=x: x.sum(dtype=torch.float32), device, repeat=7, warmup=2)
    y = torch.empty_like(x)
    t_copy = time_call(lambda x=x, y=y: y.copy_(x), device, repeat=7, warmup=2)
    del x, y
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device=device)
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device=device)
    t_mm = time_call(lambda a=a, b=b: a @ b, device, repeat=10, warmup=3)
    del a, b
    torch.cuda.empty_cache()
    nbytes = 2**31 * 2
    return {
        "hbm_read_GBps": nbytes / t_read / 1e9,
        "hbm_copy_read_plus_write_GBps": 2 * nbytes / t_copy / 1e9,
        "bf16_matmul_TFLOPs": 2 * 8192**3 / t_mm / 1e12,
    }


# ---- kernel tuners (benchmarks/tune_*.py) ----
def graph_replay(fn: Callable[[], object]) -> tuple[Callable[[], object], str]:
    """(fn captured in a CUDA graph, warmed up on a side stream first, as its replay, "graph"), so timings exclude
    launch overhead; (fn, "eager") on the CPU or if the capture fails (said on stderr)."""
    if not torch.cuda.is_available():
        return fn, "eager"
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()  # compiles and allocates outside the capture
    torch.cuda.current_stream().wait_stream(side)
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        return graph.replay, "graph"
    except Exception as exc:  # noqa: BLE001 - any capture failure falls back to eager timing
        print(f"    capture failed ({type(exc).__name__}: {exc}); timing eagerly", file=sys.stderr)
        torch.cuda.synchronize()
        return fn, "eager"


def median_ms(fn: Callable[[], object], warmup_ms: int, rep_ms: int) -> float:
    """Median milliseconds of fn: triton's do_bench (L2 flushed between runs) on CUDA, wall time otherwise."""
    if torch.cuda.is_available():
        from triton.testing import do_bench

        return do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median")
    times = []
    for _ in range(2):
        start = time.perf_counter()
        fn()
        times.append(1e3 * (time.perf_counter() - start))
    return statistics.median(times)


def interleaved_rounds(fns: dict[str, Callable[[], object]], rounds: int, warmup_ms: int,
                       rep_ms: int) -> dict[str, list[float]]:
    """{name: [median ms of each round]}: every fn timed once per round, in turn, ``rounds`` times over, so that
    drift during the run (clocks, temperature, a neighbour on the host) touches all of them alike."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            times[name].append(median_ms(fn, warmup_ms, rep_ms))
    return times


def pick_final(times: dict[str, list[float]], incumbent: str | None, min_gain: float) -> str:
    """The name with the lowest median over its rounds; the incumbent (the config shipped now) stays unless that
    median beats the incumbent's by more than the fraction min_gain, so that noise does not churn the tables."""
    medians = {name: statistics.median(t) for name, t in times.items() if t}
    best = min(medians, key=medians.__getitem__)
    if incumbent in medians and medians[best] > medians[incumbent] * (1 - min_gain):
        return incumbent
    return best


def add_tuner_arguments(p: argparse.ArgumentParser, config_dir: str) -> None:
    """The options every tuner takes: where its table and log go, and how long each candidate is timed."""
    p.add_argument("--out-dir", default=config_dir, help="where the JSON table goes")
    p.add_argument("--log-dir", default="tune_logs", help="where the per-candidate log goes")
    p.add_argument("--warmup-ms", type=int, default=None, help="default: 5 with --quick, else 25")
    p.add_argument("--rep-ms", type=int, default=None, help="default: --quick-rep-ms with --quick, else 100")


def resolve_tuner_timing(args: argparse.Namespace, quick_rep_ms: int) -> argparse.Namespace:
    """Fills --warmup-ms / --rep-ms left unset from --quick."""
    if args.warmup_ms is None:
        args.warmup_ms = 5 if args.quick else 25
    if args.rep_ms is None:
        args.rep_ms = quick_rep_ms if args.quick else 100
    return args


def merge_table(path: Path, entries: dict[str, dict[int, dict]]) -> Path:
    """Merges tuned entries {key: {bucket: config}} into the JSON table at path, keeping the keys and buckets not
    re-tuned, sorted; returns path."""
    table: dict[str, dict[str, dict]] = json.loads(path.read_text()) if path.is_file() else {}
    for key, by_bucket in entries.items():
        row = table.setdefault(key, {})
        row.update({str(b): cfg for b, cfg in by_bucket.items()})
        table[key] = {b: row[b] for b in sorted(row, key=int)}
    path.write_text(json.dumps(dict(sorted(table.items())), indent=2) + "\n")
    return path
