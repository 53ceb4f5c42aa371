"""Linear layers whose parameters know where each checkpoint tensor goes (their ``shard_index``).

A checkpoint tensor is copied into ``param[shard_index(shard_id)]``; the loader tracks which rows were filled
so that a missing piece is an error, never silently uninitialised memory.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn

from moerun import ops

if TYPE_CHECKING:
    from moerun.kernels.quant.int8_dot import Int8Rows

ShardIndex = tuple  # an index into a parameter's leading dimensions (all but the last)


def whole(_shard_id: object = None) -> ShardIndex:
    return ()


def attach_shard_index(module: nn.Module, param_name: str, fn: Callable[[object], ShardIndex]) -> None:
    """Records, on the module, the function that maps a shard id of its parameter to destination rows.

    Kept on the module rather than the tensor because materialising or casting a model replaces its tensors.
    """
    if "_shard_fns" not in module.__dict__:
        module.__dict__["_shard_fns"] = {}
    module.__dict__["_shard_fns"][param_name] = fn


def shard_index_fn(module: nn.Module, param_name: str) -> Callable[[object], ShardIndex]:
    """The shard-index function of a module's parameter (the whole tensor unless one was attached)."""
    return module.__dict__.get("_shard_fns", {}).get(param_name, whole)


class Linear(nn.Module):
    """y = x @ W^T (+ b), W [out, in]: ``ops.linear`` for a dense weight (a Triton GEMV for a few tokens on
    CUDA), ``quant_matmul`` for GGUF blocks."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    def forward(self, x: torch.Tensor, x_int8: Int8Rows | None = None) -> torch.Tensor:
        """x_int8: x already rounded to int8 (ops.rms_norm_int8), for GGUF blocks whose kernels round x."""
        q = self.__dict__.get("q_weight")
        if q is not None:
            from moerun.ops.quant import quant_matmul

            return quant_matmul(x, q, bias=self.bias, x_int8=x_int8)
        return ops.linear(x, self.weight, self.bias)

    def int8_input_pad(self, x: torch.Tensor, backend: str | None = None) -> int | None:
        """The padding at which forward would round x to int8 (GGUF blocks on the Triton path), else None."""
        q = self.__dict__.get("q_weight")
        if q is None:
            return None
        from moerun.ops.quant import int8_input_pad

        return int8_input_pad(x, q, backend)


class MergedLinear(Linear):
    """Several projections of the same input stored as one weight (q|k|v, gate|up): one GEMM instead of many."""

    def __init__(self, in_features: int, out_sizes: Sequence[int], shard_names: Sequence[str], bias: bool = False):
        super().__init__(in_features, sum(out_sizes), bias)
        self.out_sizes = list(out_sizes)
        offsets = [sum(out_sizes[:i]) for i in range(len(out_sizes))]
        self._rows = {name: slice(o, o + n) for name, o, n in zip(shard_names, offsets, out_sizes)}
        attach_shard_index(self, "weight", self._shard_index)
        attach_shard_index(self, "bias", self._shard_index)

    def _shard_index(self, shard_id: object) -> ShardIndex:
        if shard_id not in self._rows:
            raise KeyError(f"unknown shard {shard_id!r}; expected one of {list(self._rows)}")
        return (self._rows[shard_id],)

    def split(self, y: torch.Tensor) -> list[torch.Tensor]:
        return list(torch.split(y, self.out_sizes, dim=-1))
