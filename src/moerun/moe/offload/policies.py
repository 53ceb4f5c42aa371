"""Eviction policies of the expert cache behind one interface: LRU, LFU and activation-aware.

A policy only ranks: the slot table (cache.py) asks it which of a layer's evictable experts to drop and tells
it about routing, insertions and evictions. Lower rank = evicted first; ties go to the least recently used.
"""

from __future__ import annotations

import numpy as np

from moerun.moe.offload.activation import ActivationMatrix


class EvictionPolicy:
    """Base: keeps recency ticks [L, E]; subclasses define ``value`` (higher = keep)."""

    name = "base"

    def __init__(self, num_layers: int, num_experts: int) -> None:
        self.last_use = np.zeros((num_layers, num_experts), dtype=np.int64)  # [L, E] tick of last use
        self.tick = 0

    def touch(self, layer: int, experts: np.ndarray, counts: np.ndarray) -> None:
        """The layer's routing used ``experts`` (``counts`` tokens each) in one forward pass."""
        self.tick += 1
        self.last_use[layer, experts] = self.tick

    def touch_all(self, counts: np.ndarray) -> None:
        """``touch`` for every layer with routing in ``counts`` [L, E] (tokens per expert), in layer order."""
        used = counts > 0  # [L, E]
        layers = np.flatnonzero(used.any(axis=1))
        ticks = self.tick + 1 + np.arange(len(layers))  # one tick per layer, as consecutive touches give
        self.last_use[layers] = np.where(used[layers], ticks[:, None], self.last_use[layers])
        self.tick += len(layers)

    def inserted(self, layer: int, expert: int) -> None:
        self.tick += 1
        self.last_use[layer, expert] = self.tick

    def evicted(self, layer: int, expert: int) -> None:
        pass

    def new_request(self) -> None:
        pass

    def value(self, layer: int, experts: np.ndarray) -> np.ndarray:
        """How much keeping each expert is worth (float [n]); the base ranks by recency alone."""
        return self.last_use[layer, experts].astype(np.float64)

    def values(self) -> np.ndarray:
        """``value`` of every expert of every layer at once: float [L, E]."""
        L, E = self.last_use.shape
        return self.value(slice(None), slice(None)).astype(np.float64).reshape(L, E)

    def choose(self, layer: int, candidates: np.ndarray, n: int) -> np.ndarray:
        """The ``n`` candidates (expert ids of ``layer``) to evict: lowest value, then least recently used."""
        if n <= 0:
            return candidates[:0]
        order = np.lexsort((self.last_use[layer, candidates], self.value(layer, candidates)))
        return candidates[order[:n]]


class LRUPolicy(EvictionPolicy):
    """Evicts the expert whose last use is oldest."""

    name = "lru"


class LFUPolicy(EvictionPolicy):
    """Evicts the expert routed the fewest tokens so far (counts persist across evictions and requests)."""

    name = "lfu"

    def __init__(self, num_layers: int, num_experts: int) -> None:
        super().__init__(num_layers, num_experts)
        self.freq = np.zeros((num_layers, num_experts), dtype=np.float64)  # [L, E] tokens routed

    def touch(self, layer: int, experts: np.ndarray, counts: np.ndarray) -> None:
        super().touch(layer, experts, counts)
        self.freq[layer, experts] += counts

    def touch_all(self, counts: np.ndarray) -> None:
        super().touch_all(counts)
        self.freq += counts

    def value(self, layer: int, experts: np.ndarray) -> np.ndarray:
        return self.freq[layer, experts]


class ActivationAwarePolicy(EvictionPolicy):
    """Evicts the expert least likely to be routed to in the current request, as predicted from expert
    activation matrices recorded across requests (MoE-Infinity)."""

    name = "activation"

    def __init__(self, num_layers: int, num_experts: int, activations: ActivationMatrix | None = None) -> None:
        super().__init__(num_layers, num_experts)
        self.activations = activations or ActivationMatrix(num_layers, num_experts)

    def touch(self, layer: int, experts: np.ndarray, counts: np.ndarray) -> None:
        super().touch(layer, experts, counts)
        self.activations.record(layer, experts, counts)

    def touch_all(self, counts: np.ndarray) -> None:
        super().touch_all(counts)
        self.activations.record_all(counts)

    def new_request(self) -> None:
        self.activations.new_request()

    def value(self, layer: int, experts: np.ndarray) -> np.ndarray:
        return self.activations.predict()[layer, experts]


POLICY_CLASSES: dict[str, type[EvictionPolicy]] = {
    "lru": LRUPolicy, "lfu": LFUPolicy, "activation": ActivationAwarePolicy,
}


def make_policy(name: str, num_layers: int, num_experts: int) -> EvictionPolicy:
    if name not in POLICY_CLASSES:
        raise ValueError(f"unknown eviction policy {name!r}; expected one of {sorted(POLICY_CLASSES)}")
    return POLICY_CLASSES[name](num_layers, num_experts)
