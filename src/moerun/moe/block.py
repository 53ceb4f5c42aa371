"""The sparse MoE block: router (a linear layer + softmax/top-k) then the experts backend.

``forward_fused_norm`` also takes the residual add and RMSNorm in front of the block; for decode-sized batches on
the Triton backend these and the whole router run as one kernel (ops.route_fused). For a single token, unless
MOERUN_TOPK_IN_GEMM1=0 (read at each call, so at a graph's capture), resident experts (dense or quantized) take
the router's logits instead and their GEMM 1 picks the routing (ops.route_fused_logits, fused_moe's ``select``).
For a single token dense resident experts go one step further (``forward_from_attention``; MOERUN_ROUTER_IN_OPROJ=0
turns it off): the router's logits come out of the o_proj launch (ops.o_proj_router) and GEMM 1 normalises the rows
itself.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

from moerun import ops
from moerun.config import ModelConfig
from moerun.layers.linear import Linear
from moerun.layers.norm import RMSNorm
from moerun.moe.experts import Experts
from moerun.moe.offload.offloaded_experts import OffloadedExperts
from moerun.ops.dispatch import pick_backend
from moerun.ops.moe import (
    ROUTE_FUSED_MAX_TOKENS, o_proj_router, route_fused, route_fused_int8, route_fused_int8_logits,
    route_fused_logits,
)
from moerun.ops.moe_reference import router_rows

# Tokens up to which GEMM 1 picks the routing (_selects_in_experts). On an H100 (benchmarks/RESULTS.md) a batch-1
# step gained 0.03 ms (bf16) and 0.03-0.05 ms (Q4_K_M); batches of 4, 8 and 16 lost 1-2% (every GEMM 1 program
# of a token runs the top-k, where the router's last program ran it once a token).
TOPK_IN_GEMM1_MAX_TOKENS = 1


class SparseMoeBlock(nn.Module):
    """x [T, H] -> sum over the k routed experts of weight * expert(x)."""

    def __init__(self, config: ModelConfig, layer: int, backend: str | None = None) -> None:
        super().__init__()
        self.layer = layer
        self.top_k = config.num_experts_per_tok
        self.renormalize = config.norm_topk_prob
        self.gate = Linear(config.hidden_size, config.num_experts)  # router, weight [E, H]
        self.experts = Experts(config.num_experts, config.hidden_size, config.moe_intermediate_size, backend)

    def router_logits(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.gate.weight)  # [T, E], in the model dtype as transformers computes it

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.router_logits(x)
        topk_weights, topk_ids = ops.route(logits, self.top_k, self.renormalize, backend=self.experts.backend)
        return self.experts(x, topk_weights, topk_ids)

    def forward_fused_norm(
        self, x: torch.Tensor, residual: torch.Tensor | None, norm: RMSNorm
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The block on norm(x + residual) -> (block output [T, H], new residual [T, H]).

        Equal to ``norm.forward_with_residual(x, residual)`` followed by ``forward``; whatever the experts module
        is (plain, quantized, offloaded), it receives the normalised rows and the routing as usual.
        """
        if self._routes_fused(x, norm):
            # quantized experts whose kernels round x to int8 get it rounded by the router's kernel
            pad_of = getattr(self.experts, "int8_input_pad", None)
            pad = pad_of(x, self.top_k) if pad_of is not None else None
            # the output goes to the next RMSNorm (alone or in front of q|k|v), which rounds float32 slot sums as a
            # cast would
            keep = {"keep_float32": True} if isinstance(self.experts, (Experts, OffloadedExperts)) else {}
            if self._selects_in_experts(x.shape[0]):
                return self._experts_select(x, residual, norm, pad, keep)
            if pad is not None:
                x_normed, residual, topk_weights, topk_ids, x_int8 = route_fused_int8(
                    x, residual, norm.weight, norm.eps, self.gate.weight, self.top_k, self.renormalize, pad,
                )  # fmt: skip
                return self.experts(x_normed, topk_weights, topk_ids, x_int8=x_int8, **keep), residual
            x_normed, residual, topk_weights, topk_ids = route_fused(
                x, residual, norm.weight, norm.eps, self.gate.weight, self.top_k, self.renormalize,
                backend=self.experts.backend,
            )  # fmt: skip
            return self.experts(x_normed, topk_weights, topk_ids, **keep), residual
        h, residual = norm.forward_with_residual(x, residual)
        return self.forward(h), residual

    def _selects_in_experts(self, T: int) -> bool:
        """Whether the experts pick the routing of T tokens from the router's logits (resident experts, dense or
        quantized, up to TOPK_IN_GEMM1_MAX_TOKENS tokens; MOERUN_TOPK_IN_GEMM1=1 at any T the fused router takes,
        =0 never)."""
        flag = os.environ.get("MOERUN_TOPK_IN_GEMM1", "")
        if flag == "0" or type(self.experts) is not Experts:
            return False
        return flag == "1" or T <= TOPK_IN_GEMM1_MAX_TOKENS

    def _experts_select(self, x: torch.Tensor, residual: torch.Tensor | None, norm: RMSNorm, pad: int | None,
                        keep: dict) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """forward_fused_norm with the router stopping at its logits and the experts picking the routing (into
        buffers made here); with ``pad``, the router also rounds the normed rows to int8 for them."""
        from moerun.kernels.topk_select import TopkSelect

        x_int8 = None
        if pad is not None:
            x_normed, residual, logits, x_int8 = route_fused_int8_logits(x, residual, norm.weight, norm.eps,
                                                                         self.gate.weight, pad)  # fmt: skip
        else:
            x_normed, residual, logits = route_fused_logits(x, residual, norm.weight, norm.eps, self.gate.weight,
                                                            backend=self.experts.backend)  # fmt: skip
        topk_weights = torch.empty(x.shape[0], self.top_k, dtype=torch.float32, device=x.device)  # [T, k]
        topk_ids = torch.empty(x.shape[0], self.top_k, dtype=torch.int32, device=x.device)  # [T, k]
        select = TopkSelect(logits, self.renormalize, bf16=self.gate.weight.dtype == torch.bfloat16)  # (rounded)
        out = self.experts(x_normed, topk_weights, topk_ids, x_int8=x_int8, select=select, **keep)
        return out, residual

    def routes_in_o_proj(self, rows: torch.Tensor, o_proj: Linear, norm: RMSNorm) -> bool:
        """Whether the block takes the attention's output before o_proj (``forward_from_attention``) for a step of
        these rows [T, H] (the residual stream, in the model dtype): unless MOERUN_ROUTER_IN_OPROJ=0 (read at each
        call, so at a graph's capture), dense resident experts that pick the routing in GEMM 1, a dense o_proj without
        bias, and the fused router's conditions."""
        if os.environ.get("MOERUN_ROUTER_IN_OPROJ", "1") == "0" or not self._selects_in_experts(rows.shape[0]):
            return False
        if "q_w13" in self.experts.__dict__ or "q_weight" in o_proj.__dict__ or o_proj.bias is not None:
            return False
        return o_proj.weight.dtype == rows.dtype and self._routes_fused(rows, norm)

    def forward_from_attention(self, a: torch.Tensor, residual: torch.Tensor, o_proj: Linear,
                               norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """``forward_fused_norm(o_proj(a), residual, norm)`` for a [T, Q] the attention's output before o_proj
        (``routes_in_o_proj``): o_proj and the router's logits in one launch (ops.o_proj_router), the norm inside
        GEMM 1, which picks the routing (TopkSelect with the norm) -> (block output, new residual)."""
        rows = self.__dict__.get("_router_rows")  # [E, Q + H], made once (on the first call, outside any graph)
        if rows is None or rows.device != a.device:
            rows = self.__dict__["_router_rows"] = router_rows(self.gate.weight, norm.weight, o_proj.weight)
        from moerun.kernels.topk_select import TopkSelect

        h, logits = o_proj_router(a, residual, o_proj.weight, rows, backend=self.experts.backend)  # [T, H], [T, E]
        topk_weights = torch.empty(a.shape[0], self.top_k, dtype=torch.float32, device=a.device)  # [T, k]
        topk_ids = torch.empty(a.shape[0], self.top_k, dtype=torch.int32, device=a.device)  # [T, k]
        select = TopkSelect(logits, self.renormalize, norm.weight, norm.eps)
        return self.experts(h, topk_weights, topk_ids, select=select, keep_float32=True), h

    def _routes_fused(self, x: torch.Tensor, norm: RMSNorm) -> bool:
        """Whether routing runs as the one fused kernel: the Triton backend, few tokens, dense weights of x's dtype."""
        if x.dim() != 2 or x.shape[0] > ROUTE_FUSED_MAX_TOKENS:
            return False
        if pick_backend(self.experts.backend, x.device, "MoE") != "triton":
            return False
        gate = self.gate.weight
        return "q_weight" not in self.gate.__dict__ and gate.dtype == norm.weight.dtype == x.dtype
