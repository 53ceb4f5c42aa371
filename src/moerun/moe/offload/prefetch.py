"""Router lookahead: the next MoE layers' routers applied to the current layer's input predict their experts.

Consecutive layers' inputs are close (the residual stream changes little per layer), so the next router on the
current hidden state ranks the next layer's experts well without any retraining. Candidates are ranked by their
router probability averaged over the batch (the confidence); the caller bounds how many it copies.

Where the prediction fails (routers that do not agree across layers, as in a model with random weights), every
prefetch is a wasted copy and host time: ``PrefetchGate`` pauses prefetching while its measured accuracy is low.
"""

from __future__ import annotations

import torch

from moerun.moe.offload.stats import OffloadStats


class RouterLookahead:
    """For each MoE layer, the stacked router weights of the ``depth`` layers after it."""

    def __init__(self, gates: list[torch.Tensor], depth: int, per_layer: int) -> None:
        self.num_layers, self.depth, self.per_layer = len(gates), depth, per_layer
        self.num_experts = gates[0].shape[0]
        # [D_l * E, H] per layer: one GEMM scores every target layer at once
        self._stacked = [torch.cat(gates[i + 1 : i + 1 + depth]) if i + 1 < len(gates) else None
                         for i in range(len(gates))]

    def targets(self, layer: int) -> list[int]:
        """The MoE layers prefetched for while ``layer`` runs (none past the last layer)."""
        return list(range(layer + 1, min(layer + 1 + self.depth, self.num_layers)))

    @torch.no_grad()
    def propose(self, layer: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(expert ids [D, P] int32, confidence [D, P] float32) best first, for each target layer."""
        w = self._stacked[layer]
        if w is None or self.per_layer <= 0:
            return None
        D, E = w.shape[0] // self.num_experts, self.num_experts
        logits = torch.nn.functional.linear(x, w.to(x.dtype))  # [T, D * E]
        probs = torch.softmax(logits.float().view(-1, D, E), dim=-1).mean(dim=0)  # [D, E]
        conf, ids = torch.topk(probs, min(self.per_layer, E), dim=-1)  # [D, P]
        return ids.to(torch.int32), conf


class PrefetchGate:
    """Prefetch only while it pays: after every ``window`` settled prefetches (useful + wasted), an accuracy
    below ``min_accuracy`` over that window pauses prefetching for the next ``pause`` prefetch opportunities (one
    per MoE layer and forward pass); then it probes again."""

    def __init__(self, min_accuracy: float, window: int = 256, pause: int = 32) -> None:
        self.min_accuracy, self.window, self.pause = min_accuracy, window, pause
        self.calls = 0  # prefetch opportunities so far
        self.paused_until = 0  # opportunity from which prefetching resumes
        self._useful = self._settled = 0  # counters at the start of the current window
        self.pauses = 0

    def reset(self) -> None:
        """The statistics were reset: the current window restarts from zero (a pause in progress stands)."""
        self._useful = self._settled = 0

    def open(self, stats: OffloadStats) -> bool:
        """Whether this opportunity may prefetch."""
        self.calls += 1
        if self.min_accuracy <= 0:
            return True
        if self.calls <= self.paused_until:
            return False
        settled = stats.prefetch_useful + stats.prefetch_wasted
        if settled - self._settled >= self.window:
            accuracy = (stats.prefetch_useful - self._useful) / (settled - self._settled)
            self._useful, self._settled = stats.prefetch_useful, settled
            if accuracy < self.min_accuracy:
                self.paused_until = self.calls + self.pause
                self.pauses += 1
                return False
        return True
