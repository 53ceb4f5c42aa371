"""Programmatic dependent launch (PDL, Hopper and later) for the kernels of a decode step.

A decode step is a chain of a few hundred short kernels, and each one pays for its launch and for the ramp-up of
its first loads while the previous kernel drains. A kernel launched with PDL may start as soon as every program of
the previous kernel has started (each calls ``launch_dependents`` first thing); it then does what does not depend
on the previous kernel (loading weights) and waits (``wait_for_previous``) before it reads the previous kernel's
outputs or writes anything. The wait returns once the previous kernel has finished and its writes are visible,
so the order of results is the same as without PDL; kernels launched without it (cuBLAS, torch ops) keep the
ordinary stream order.

Rules for a kernel taking ``PDL`` (its mode, see ``pdl_mode``): before ``wait_for_previous`` only loads of data
that no kernel of the step writes (weights, shapes), no stores and no atomics. Used on CUDA devices of compute
capability 9.0 and later unless ``MOERUN_PDL=0``; the interpreter never uses it. Measured on an H200
(benchmarks/RESULTS.md): batch-1 decode of the Qwen3-30B-A3B shape 3.04 -> 2.93 ms per step. The quantized kernels
(kernels/quant/) always let the next kernel launch only once their own wait has returned (mode 2,
``quant_pdl_mode``; ``MOERUN_PDL_QUANT=0`` launches them without PDL). A Q4_K_M batch-1 step without PDL for them
took 2.572 ms, with them in mode 1 2.515 ms (4.7 against 3.8 ms in an older build), and with every kernel in mode 2
(``MOERUN_PDL_TRIGGER=after_wait``) 2.347 ms. The other kernels stay in mode 1: with q|k and v in one launch the
Q4_K_M step gains only 0.012 ms more from mode 2 everywhere, and bf16 decode loses 0.05 ms (benchmarks/RESULTS.md).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from moerun.kernels.interpreter import interpreting

DEFAULT = "1"
# The largest decode batch bucket (engine/runner.py); prefill-sized launches keep the plain stream order.
MAX_ROWS = 256


def pdl_enabled(device: torch.device, rows: int = 1) -> bool:
    """Whether a kernel over ``rows`` tokens on ``device`` launches with PDL (a compile-time flag and a launch
    option). Only decode-sized launches (rows <= MAX_ROWS) do: larger ones are not launch-bound."""
    if device.type != "cuda" or interpreting() or os.environ.get("MOERUN_PDL", DEFAULT) == "0" or rows > MAX_ROWS:
        return False
    return _capability(device.index if device.index is not None else torch.cuda.current_device()) >= (9, 0)


def pdl_mode(device: torch.device, rows: int = 1) -> int:
    """The ``PDL`` argument of a kernel launch: 0 plain launch; 1 PDL, the next kernel may launch as soon as every
    program of this one has started; 2 PDL, once every program of this one is past its wait
    (``MOERUN_PDL_TRIGGER=after_wait``)."""
    if not pdl_enabled(device, rows):
        return 0
    return 2 if os.environ.get("MOERUN_PDL_TRIGGER", "start") == "after_wait" else 1


def quant_pdl_mode(device: torch.device, rows: int = 1) -> int:
    """The ``PDL`` argument of the quantized decode kernels (kernels/quant/): mode 2 where PDL is on, unless
    ``MOERUN_PDL_QUANT=0``."""
    if os.environ.get("MOERUN_PDL_QUANT", "1") == "0" or not pdl_enabled(device, rows):
        return 0
    return 2


def launch_options(pdl: int) -> dict:
    """Keyword arguments for a Triton launch: ``launch_pdl`` only where it is used (the interpreter lacks it)."""
    return {"launch_pdl": True} if pdl else {}


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


@triton.jit
def launch_dependents(PDL: tl.constexpr):
    """First thing in a kernel: lets the next kernel of the stream start (mode 1)."""
    if PDL == 1:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def wait_for_previous(PDL: tl.constexpr):
    """Waits until the previous kernel has finished and its writes are visible; in mode 2 then lets the next
    kernel start."""
    if PDL != 0:
        tl.extra.cuda.gdc_wait()
    if PDL == 2:
        tl.extra.cuda.gdc_launch_dependents()
