"""The GPU paths' Triton kernels compile for sm_90 (tests/kernels/sm90_compile.py), checked without a GPU.

The other kernel tests run in Triton's interpreter, which never compiles: a kernel can pass them all and still be
rejected by the compiler. On a CUDA machine the kernel tests compile every kernel for the real device instead.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

triton = pytest.importorskip("triton")


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the kernel tests compile for the device itself")
def test_gpu_kernels_compile_for_sm90() -> None:
    pytest.importorskip("triton.backends.nvidia")
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    script = Path(__file__).with_name("sm90_compile.py")
    run = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=900)
    failed = [line for line in run.stdout.splitlines() if line.startswith("FAILED")]
    assert run.returncode == 0, f"{failed}\n{run.stdout[-6000:]}\n{run.stderr[-3000:]}"
    assert "0 failed cases" in run.stdout
