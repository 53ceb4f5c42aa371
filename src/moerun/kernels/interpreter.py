"""Whether Triton kernels run in Triton's CPU interpreter (TRITON_INTERPRET=1), as in CI."""

from __future__ import annotations

import os


def interpreting() -> bool:
    """Whether Triton runs kernels in its interpreter.

    The interpreter truncates float32 -> bfloat16 and multiplies bfloat16 dot operands as raw bits; kernels
    take this as a constexpr and work around both only there, never on the GPU path.
    """
    return os.environ.get("TRITON_INTERPRET") == "1"
