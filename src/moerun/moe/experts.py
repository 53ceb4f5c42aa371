"""The experts of one MoE layer, stacked: w13 [E, 2I, H] (gate rows, then up rows) and w2 [E, H, I].

This is the seam between the model and the experts backends: the model calls ``Experts.forward`` with the
routing result, and the backend (torch reference, Triton, quantized, offloaded) decides how to compute it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from moerun import ops
from moerun.layers.linear import ShardIndex, attach_shard_index
from moerun.ops.dispatch import pick_backend

if TYPE_CHECKING:
    from moerun.kernels.topk_select import TopkSelect
    from moerun.kernels.quant.int8_dot import Int8Rows


class Experts(nn.Module):
    """E experts of the SiLU-gated MLP; forward(x [T, H], weights [T, k], ids [T, k]) -> [T, H]."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, backend: str | None = None):
        super().__init__()
        E, H, I = num_experts, hidden_size, intermediate_size
        self.num_experts, self.hidden_size, self.intermediate_size = E, H, I
        self.w13 = nn.Parameter(torch.empty(E, 2 * I, H))
        self.w2 = nn.Parameter(torch.empty(E, H, I))
        attach_shard_index(self, "w13", self._w13_index)
        attach_shard_index(self, "w2", self._w2_index)
        self.backend = backend

    def _w13_index(self, shard_id: tuple[int | None, str]) -> ShardIndex:
        expert, part = shard_id
        e = slice(None) if expert is None else expert
        rows = {"gate": slice(0, self.intermediate_size), "up": slice(self.intermediate_size, None),
                "gate_up": slice(None)}[part]
        return (e, rows)

    def _w2_index(self, shard_id: tuple[int | None, str]) -> ShardIndex:
        expert, part = shard_id
        if part != "down":
            raise KeyError(f"unknown shard {part!r} for w2")
        return (slice(None) if expert is None else expert,)

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                x_int8: Int8Rows | None = None, keep_float32: bool = False,
                select: TopkSelect | None = None) -> torch.Tensor:  # fmt: skip
        """x_int8: x already rounded to int8 (ops.route_fused_int8), for quantized kernels that round x;
        keep_float32, select: ops.fused_moe's (the result may be float32 slot sums, for a consumer that rounds them;
        the routing may be picked from logits into topk_weights / topk_ids)."""
        w13 = self.__dict__.get("q_w13") or self.w13
        w2 = self.__dict__.get("q_w2") or self.w2
        return ops.fused_moe(x, w13, w2, topk_weights, topk_ids, backend=self.backend, x_int8=x_int8,
                             keep_float32=keep_float32, select=select)  # fmt: skip

    def int8_input_pad(self, x: torch.Tensor, k: int) -> int | None:
        """The padding at which forward would round x [T, H] to int8 (quantized experts on the Triton path whose
        kernels round x), else None."""
        q13, q2 = self.__dict__.get("q_w13"), self.__dict__.get("q_w2")
        if q13 is None or q2 is None or pick_backend(self.backend, x.device, "MoE") != "triton":
            return None
        from moerun.ops.quant import moe_int8_input_pad

        return moe_int8_input_pad(x, q13, q2, k)
