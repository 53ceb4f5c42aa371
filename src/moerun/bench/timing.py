"""Timing helpers and the device ceilings (HBM read bandwidth, bf16 matmul rate) measured in the same run."""

from __future__ import annotations

import time
from collections.abc import Callable

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
