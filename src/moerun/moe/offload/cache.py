"""The expert cache's slot table: which expert of each MoE layer sits in each of the layer's device slots.

Each MoE layer owns ``slots_per_layer`` slots of its own pool (pool.py), so a layer's misses and the prefetch for
another layer never evict each other, and a layer's weights may have their own (quantized) layout. The table is
kept twice: a host mirror (numpy) that decides admissions and evictions, and ``device_table`` [L, E] int32 (-1:
not cached) that the compute stream gathers from to turn routing ids into slot ids without asking the host.
Device updates are batched and applied in stream order by ``flush``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from moerun.moe.offload.policies import EvictionPolicy
from moerun.moe.offload.stats import OffloadStats


class CacheFull(RuntimeError):
    """More experts must be resident at once than a layer has slots free of pinned experts."""


@dataclass(frozen=True)
class Admission:
    layer: int
    expert: int
    slot: int
    evicted: int  # the expert that held the slot, -1 when it was free


class SlotTable:
    """(layer, expert) -> slot, with pinning (experts a pending computation reads are never evicted)."""

    def __init__(self, num_layers: int, num_experts: int, slots_per_layer: int, device: torch.device,
                 policy: EvictionPolicy, stats: OffloadStats | None = None) -> None:
        L, E, S = num_layers, num_experts, slots_per_layer
        self.num_layers, self.num_experts, self.slots_per_layer = L, E, S
        self.null_slot = S  # the pool's extra all-zero slot: masked (token, expert) pairs point there
        self.policy, self.stats = policy, stats
        self.slot_of = np.full((L, E), -1, dtype=np.int32)  # [L, E] slot of each expert or -1
        self.expert_in = np.full((L, S), -1, dtype=np.int32)  # [L, S] expert in each slot or -1
        self.pinned = np.zeros((L, E), dtype=bool)  # [L, E]
        self.prefetched = np.zeros((L, E), dtype=bool)  # [L, E] brought in by prefetch, not routed to since
        self.device_table = torch.full((L, E), -1, dtype=torch.int32, device=device)  # [L, E]
        self._updates: dict[int, int] = {}  # flat index into device_table -> new value, not yet applied

    # ---- queries ----
    def lookup(self, layer: int, experts: np.ndarray) -> np.ndarray:
        """Slots of ``experts`` in ``layer`` (-1 where not cached)."""
        return self.slot_of[layer, experts]

    def num_resident(self, layer: int) -> int:
        return int((self.expert_in[layer] >= 0).sum())

    def num_pinned(self, layer: int) -> int:
        return int(self.pinned[layer].sum())

    # ---- pinning ----
    def pin(self, layer: int, experts: np.ndarray) -> None:
        """Protects cached ``experts`` of ``layer`` from eviction until ``unpin``."""
        experts = np.asarray(experts, dtype=np.int64)
        if experts.size and (self.slot_of[layer, experts] < 0).any():
            missing = experts[self.slot_of[layer, experts] < 0].tolist()
            raise RuntimeError(f"layer {layer}: cannot pin experts {missing}: they are not cached")
        self.pinned[layer, experts] = True

    def unpin(self, layer: int) -> None:
        self.pinned[layer] = False

    # ---- routing outcome ----
    def routed(self, layer: int, experts: np.ndarray) -> None:
        """Settles the prefetches into ``layer``: those routed to now were useful, the others were not."""
        flagged = self.prefetched[layer]
        if not flagged.any():
            return
        used = np.zeros_like(flagged)
        used[experts] = True
        if self.stats is not None:
            self.stats.prefetch_useful += int((flagged & used).sum())
            self.stats.prefetch_wasted += int((flagged & ~used).sum())
        self.prefetched[layer] = False

    # ---- admission ----
    def admit(self, layer: int, experts: np.ndarray, prefetch: bool = False) -> list[Admission]:
        """Gives every uncached expert of ``experts`` a slot of ``layer``: free slots first, then the policy's
        victims among the layer's cached, unpinned experts that are not themselves in ``experts``."""
        experts = np.asarray(experts, dtype=np.int64)
        need = [int(e) for e in dict.fromkeys(experts.tolist()) if self.slot_of[layer, e] < 0]
        if not need:
            return []
        free = np.flatnonzero(self.expert_in[layer] < 0)
        slots = [int(s) for s in free[: len(need)]]
        evicted = [-1] * len(slots)
        short = len(need) - len(slots)
        if short > 0:
            keep = np.zeros(self.num_experts, dtype=bool)
            keep[experts] = True
            cached = self.expert_in[layer][self.expert_in[layer] >= 0].astype(np.int64)
            candidates = cached[~self.pinned[layer, cached] & ~keep[cached]]
            if len(candidates) < short:
                raise CacheFull(
                    f"layer {layer}: {len(need)} experts to admit but only {len(slots) + len(candidates)} of "
                    f"{self.slots_per_layer} slots are free or evictable ({self.num_pinned(layer)} pinned)"
                )
            for victim in self.policy.choose(layer, candidates, short).tolist():
                slot = int(self.slot_of[layer, victim])
                self._set(layer, victim, -1)
                self.expert_in[layer, slot] = -1
                if self.prefetched[layer, victim] and self.stats is not None:
                    self.stats.prefetch_wasted += 1
                self.prefetched[layer, victim] = False
                self.policy.evicted(layer, victim)
                slots.append(slot)
                evicted.append(victim)
            if self.stats is not None:
                self.stats.evictions += short
        out = []
        for e, slot, old in zip(need, slots, evicted):
            self._set(layer, e, slot)
            self.expert_in[layer, slot] = e
            self.prefetched[layer, e] = prefetch
            self.policy.inserted(layer, e)
            out.append(Admission(layer, e, slot, old))
        return out

    def _set(self, layer: int, expert: int, slot: int) -> None:
        self.slot_of[layer, expert] = slot
        self._updates[layer * self.num_experts + expert] = slot

    # ---- device table ----
    def flush(self, to_device: Callable[[np.ndarray], torch.Tensor] | None = None) -> None:
        """Applies the pending updates to ``device_table`` (in the current stream's order on CUDA).

        ``to_device`` moves an int64 host array to the table's device without blocking the host.
        """
        if not self._updates:
            return
        index = np.fromiter(self._updates.keys(), dtype=np.int64, count=len(self._updates))
        packed = np.stack([index, np.fromiter(self._updates.values(), dtype=np.int64, count=len(index))])  # [2, n]
        self._updates.clear()
        dev = to_device(packed) if to_device is not None else torch.from_numpy(packed)
        self.device_table.view(-1).index_copy_(0, dev[0], dev[1].to(torch.int32))

    # ---- invariants (tests) ----
    def check(self) -> None:
        """Raises AssertionError if the host mirror is inconsistent or differs from the device table."""
        L, S = self.num_layers, self.slots_per_layer
        for layer in range(L):
            occupied = self.expert_in[layer][self.expert_in[layer] >= 0]
            assert len(set(occupied.tolist())) == len(occupied), f"layer {layer}: an expert holds two slots"
            for s in range(S):
                e = self.expert_in[layer, s]
                if e >= 0:
                    assert self.slot_of[layer, e] == s, f"layer {layer}: slot {s} holds {e}, table says otherwise"
            cached = np.flatnonzero(self.slot_of[layer] >= 0)
            assert len(cached) == len(occupied), f"layer {layer}: {len(cached)} cached vs {len(occupied)} slots"
            for e in cached:
                assert self.expert_in[layer, self.slot_of[layer, e]] == e, f"layer {layer}: expert {e} misplaced"
            assert not (self.pinned[layer] & (self.slot_of[layer] < 0)).any(), f"layer {layer}: pinned not cached"
            assert not (self.prefetched[layer] & (self.slot_of[layer] < 0)).any(), f"layer {layer}: stale flag"
        assert not self._updates, "device table updates pending"
        device = self.device_table.cpu().numpy()
        assert (device == self.slot_of).all(), "device table differs from the host view"
