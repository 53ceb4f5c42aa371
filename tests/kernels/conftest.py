"""Kernel tests run on CUDA when present, else in Triton's interpreter on CPU.

The interpreter must be switched on before triton is imported, so this happens at import time.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"


@pytest.fixture
def seed() -> int:
    """A fresh seed per test, applied to torch's generators; tests put it in failure messages.

    ``MOERUN_TEST_SEED=<n>`` replays a failure with the seed it printed.
    """
    value = int(os.environ.get("MOERUN_TEST_SEED") or int.from_bytes(os.urandom(4), "little"))
    torch.manual_seed(value)
    return value
