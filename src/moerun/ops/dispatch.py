"""Backend choice shared by every op: the Triton kernel on CUDA, the torch reference elsewhere."""

from __future__ import annotations

import functools
import torch

from moerun.kernels.interpreter import interpreting

BACKENDS = ("torch", "triton")


@functools.cache
def triton_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("triton") is not None


def pick_backend(backend: str | None, device: torch.device, op: str) -> str:
    """None picks Triton on CUDA and the torch reference elsewhere; 'triton' on CPU needs the interpreter."""
    if backend is None:
        return "triton" if device.type == "cuda" and triton_available() else "torch"
    if backend not in BACKENDS:
        raise ValueError(f"unknown {op} backend {backend!r}; expected one of {BACKENDS} or None")
    if backend == "triton" and not triton_available():
        raise ValueError(f"{op} backend 'triton' needs the triton package, which is not installed")
    if backend == "triton" and device.type == "cpu" and not interpreting():
        raise ValueError(f"{op} backend 'triton' on CPU tensors needs TRITON_INTERPRET=1 (Triton's interpreter)")
    return backend
