"""Expert activation matrices (MoE-Infinity's EAM): routing counts [layers, experts] per request, kept across
requests, and a prediction of the current request's activations from the most similar past ones."""

from __future__ import annotations

from collections import deque

import numpy as np


def _row_normalise(m: np.ndarray) -> np.ndarray:
    """Each layer's counts as fractions (rows summing to 1; all-zero rows stay zero)."""
    sums = m.sum(axis=1, keepdims=True)
    return np.divide(m, sums, out=np.zeros_like(m), where=sums > 0)


class ActivationMatrix:
    """Routing counts of the request in progress plus a bounded history of finished requests' matrices."""

    def __init__(self, num_layers: int, num_experts: int, history: int = 64, neighbours: int = 8) -> None:
        self.current = np.zeros((num_layers, num_experts), dtype=np.float64)  # [L, E] tokens routed
        self.total = np.zeros((num_layers, num_experts), dtype=np.float64)  # [L, E] over all requests
        self.history: deque[np.ndarray] = deque(maxlen=history)  # row-normalised [L, E] per request
        self.neighbours = neighbours
        self._prediction: np.ndarray | None = None

    def record(self, layer: int, experts: np.ndarray, counts: np.ndarray) -> None:
        self.current[layer, experts] += counts
        self.total[layer, experts] += counts
        self._prediction = None

    def record_all(self, counts: np.ndarray) -> None:
        """``record`` for every layer at once: counts [L, E] tokens routed."""
        self.current += counts
        self.total += counts
        self._prediction = None

    def new_request(self) -> None:
        """Closes the current request's matrix (kept in the history when it saw any routing)."""
        if self.current.any():
            self.history.append(_row_normalise(self.current))
            self.current[:] = 0
            self._prediction = None

    def predict(self) -> np.ndarray:
        """[L, E] expected share of each layer's routing going to each expert in the current request.

        The current request's own counts so far are blended with the past requests whose matrices are most
        similar to it (cosine similarity), and with the all-time frequencies as a prior.
        """
        if self._prediction is not None:
            return self._prediction
        cur = _row_normalise(self.current)
        prior = _row_normalise(self.total)
        if not self.history:
            pred = 0.7 * cur + 0.3 * prior
        else:
            past = np.stack(self.history)  # [N, L, E]
            flat = past.reshape(len(past), -1)
            q = cur.reshape(-1)
            sims = flat @ q / (np.linalg.norm(flat, axis=1) * (np.linalg.norm(q) + 1e-12) + 1e-12)  # [N]
            if not q.any():
                sims = np.ones(len(past))  # nothing routed yet: all past requests count alike
            top = np.argsort(-sims)[: self.neighbours]
            w = np.clip(sims[top], 1e-6, None)
            matched = np.tensordot(w / w.sum(), past[top], axes=1)  # [L, E]
            pred = 0.45 * matched + 0.45 * cur + 0.1 * prior
        self._prediction = pred
        return pred
