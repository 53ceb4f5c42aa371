"""Which token counts a model's quantized kernels round alike: ops.quant.int8_roundings, memoised per count.

GGUF kernels round x (and an MoE's intermediate) to int8 at a few tokens, as llama.cpp's decode kernels do, and
multiply float x at many. A CUDA graph captured for a bucket of B tokens replays a step of n < B tokens only when
the two round in the same places; then graphs change a result by float summation order at most, as they do for a
float model.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn


class RoundingMatch:
    """int8_roundings of one model by token count, and the bucket that rounds as a count does."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self._of: dict[int, tuple[bool, ...]] = {}
        self._bucket_of: dict[tuple[int, tuple[int, ...]], int | None] = {}  # each decode step asks: memoised

    def roundings(self, rows: int) -> tuple[bool, ...]:
        if rows not in self._of:
            from moerun.ops.quant import int8_roundings

            self._of[rows] = int8_roundings(self.model.model.layers, rows, self.model.config.num_experts_per_tok)
        return self._of[rows]

    def bucket(self, n: int, buckets: Sequence[int]) -> int | None:
        """The smallest of the (ascending) buckets >= n whose kernels round as those of n tokens, else None."""
        key = (n, tuple(buckets))
        if key not in self._bucket_of:
            self._bucket_of[key] = next((b for b in buckets if b >= n and self.roundings(b) == self.roundings(n)), None)
        return self._bucket_of[key]
