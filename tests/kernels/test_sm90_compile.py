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


# A folder holding the Triton release of the GPU machines (pip install --target DIR triton==X), which CI installs
# beside the current one: a release's compiler can reject what another's accepts (a default argument of a device
# function, say), and the GPU runs that release.
GPU_TRITON = os.environ.get("MOERUN_GPU_TRITON")


def _compile_all(extra_path: str | None = None) -> subprocess.CompletedProcess:
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    if extra_path:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [extra_path, env.get("PYTHONPATH")]))
    script = Path(__file__).with_name("sm90_compile.py")
    run = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=900)
    failed = [line for line in run.stdout.splitlines() if line.startswith("FAILED")]
    assert run.returncode == 0, f"{failed}\n{run.stdout[-6000:]}\n{run.stderr[-3000:]}"
    assert "0 failed cases" in run.stdout
    return run


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the kernel tests compile for the device itself")
def test_gpu_kernels_compile_for_sm90() -> None:
    pytest.importorskip("triton.backends.nvidia")
    _compile_all()


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the kernel tests compile for the device itself")
@pytest.mark.skipif(not GPU_TRITON, reason="MOERUN_GPU_TRITON names no folder with the GPU machines' Triton")
def test_gpu_kernels_compile_for_sm90_with_the_gpu_machines_triton() -> None:
    run = _compile_all(GPU_TRITON)
    version = subprocess.run([sys.executable, "-c", "import triton; print(triton.__version__)"], capture_output=True,
                             text=True, env={**os.environ, "PYTHONPATH": GPU_TRITON}).stdout.strip()  # fmt: skip
    assert version and version != triton.__version__, f"{GPU_TRITON} holds Triton {version!r}, the one in use"
    assert "compiles" in run.stdout
