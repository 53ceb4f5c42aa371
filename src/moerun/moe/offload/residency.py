"""Which expert sits in which device slot in zero-copy mode, and which missed experts to admit between two steps.

Per MoE layer: ``slot_of`` [L, E] (slot or -1), ``expert_in`` [L, S] (expert or -1), ``ready`` [L, E] (the copy
completed and the expert's table entry points at its slot) and ``loading`` [L, E] (a copy into its slot is in
flight: the entry still points at the host copy, and the expert cannot be evicted). An expert with a slot is
exactly one of ready or loading.

``plan`` works on whole [L, E] arrays at once (numpy), so a step boundary costs little host time even when many
layers admit experts: each layer's missed experts, best first by the policy's values, take the free slots, then
replace the layer's resident experts the policy values least, as long as the policy values the newcomer more.
With admission on the device, ``ranked_slots`` orders each layer's slots for the device to give up and
``follow`` takes the occupants the device left.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np


class Plan(NamedTuple):
    """Admissions, one entry each: the expert of ``layers`` goes into ``slots``, evicting ``victims`` (-1: none)."""

    layers: np.ndarray
    experts: np.ndarray
    slots: np.ndarray
    victims: np.ndarray

    def __len__(self) -> int:
        return len(self.layers)


def _rank_within(groups: np.ndarray) -> np.ndarray:
    """Position of each element among the elements of its group (groups sorted ascending)."""
    starts = np.searchsorted(groups, groups, side="left")
    return np.arange(len(groups)) - starts


class Residency:
    """The host view of the slots of every layer (see the module docstring)."""

    def __init__(self, num_layers: int, num_experts: int, slots_per_layer: int) -> None:
        L, E, S = num_layers, num_experts, slots_per_layer
        self.num_layers, self.num_experts, self.slots_per_layer = L, E, S
        self.slot_of = np.full((L, E), -1, dtype=np.int64)  # [L, E]
        self.expert_in = np.full((L, S), -1, dtype=np.int64)  # [L, S]
        self.ready = np.zeros((L, E), dtype=bool)  # [L, E]
        self.loading = np.zeros((L, E), dtype=bool)  # [L, E]

    def plan(self, routed: np.ndarray, value: np.ndarray, recency: np.ndarray, nbytes: np.ndarray,
             budget: int) -> Plan:
        """Admissions for the routing counts ``routed`` [L, E] of the last step(s).

        value / recency [L, E]: the policy's ranking (higher = keep); nbytes [L]: one expert of each layer.
        Candidates are routed experts with no slot; within ``budget`` bytes they are taken a rank at a time across
        layers (every layer's best, then every layer's second, ...), more tokens first.
        """
        empty = np.zeros(0, dtype=np.int64)
        if self.slots_per_layer == 0:
            return Plan(empty, empty, empty, empty)
        L = self.num_layers
        cl, ce = np.nonzero((routed > 0) & (self.slot_of < 0))  # candidates
        if len(cl) == 0:
            return Plan(empty, empty, empty, empty)
        order = np.lexsort((-routed[cl, ce], -recency[cl, ce], -value[cl, ce], cl))  # each layer's best first
        cl, ce = cl[order], ce[order]
        rank = _rank_within(cl)
        wanted = np.zeros(L, dtype=bool)
        wanted[cl] = True
        vl, ve = np.nonzero(self.ready & wanted[:, None])  # evictable: resident, copy complete, in a layer that admits
        vorder = np.lexsort((recency[vl, ve], value[vl, ve], vl))  # each layer's least valued first
        vl, ve = vl[vorder], ve[vorder]
        fl, fs = np.nonzero(self.expert_in < 0)  # free slots, by layer then slot
        n_free = np.bincount(fl, minlength=L)[cl]
        n_victims = np.bincount(vl, minlength=L)[cl]
        free = rank < n_free
        victim_rank = rank - n_free
        has_victim = ~free & (victim_rank < n_victims)
        vpos = np.where(has_victim, np.searchsorted(vl, cl) + victim_rank, 0)
        victim = np.where(has_victim, ve[vpos] if len(ve) else 0, -1)
        v = np.maximum(victim, 0)
        mine, theirs = value[cl, ce], value[cl, v]
        better = (mine > theirs) | ((mine == theirs) & (recency[cl, ce] > recency[cl, v]))
        # candidates' keys fall and victims' rise with the rank, so the accepted ones are a prefix of each layer's
        ok = free | (has_victim & better)
        take = np.lexsort((-routed[cl, ce], rank))
        take = take[ok[take]]
        take = take[np.cumsum(nbytes[cl[take]]) <= budget]
        free_slot = fs[np.minimum(np.searchsorted(fl, cl[take]) + rank[take], max(len(fs) - 1, 0))] if len(fs) else 0
        slots = np.where(free[take], free_slot, self.slot_of[cl[take], v[take]])
        return Plan(cl[take], ce[take], slots.astype(np.int64), victim[take])

    def admit(self, plan: Plan) -> None:
        """Books the plan's slots: victims lose theirs, the admitted experts start loading."""
        evicted = plan.victims >= 0
        vl, ve = plan.layers[evicted], plan.victims[evicted]
        self.slot_of[vl, ve] = -1
        self.ready[vl, ve] = False
        self.slot_of[plan.layers, plan.experts] = plan.slots
        self.expert_in[plan.layers, plan.slots] = plan.experts
        self.loading[plan.layers, plan.experts] = True

    def follow(self, occupant: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Takes the occupant of every slot [L, S] (-1: free) from the device, which admits experts itself (no copy
        loading): the views are rebuilt whole, whatever order the experts moved in. Returns (layers, previous
        occupants, new occupants) of the slots that changed."""
        layers, slots = np.nonzero(occupant != self.expert_in)
        gone, new = self.expert_in[layers, slots], occupant[layers, slots]
        self.expert_in[:] = occupant
        self.slot_of[:] = -1
        held_l, held_s = np.nonzero(occupant >= 0)
        self.slot_of[held_l, occupant[held_l, held_s]] = held_s
        self.ready[:] = self.slot_of >= 0
        self.loading[:] = False
        return layers, gone, new

    def ranked_slots(self, value: np.ndarray, recency: np.ndarray, n: int) -> np.ndarray:
        """Each layer's first ``n`` slots to give up [L, n]: free ones, then by their experts' value and recency
        ([L, E], higher = keep), least first (the order ``plan`` takes victims in)."""
        held = self.expert_in >= 0  # [L, S]
        e = np.maximum(self.expert_in, 0)
        rows = np.arange(self.num_layers)[:, None]
        v = np.where(held, value[rows, e], -np.inf)  # [L, S]
        r = np.where(held, recency[rows, e], -1)  # [L, S]
        return np.lexsort((r, v))[:, :n]

    def settle(self, layers: np.ndarray, experts: np.ndarray) -> None:
        """The copies of these experts completed: they are resident from now on."""
        self.loading[layers, experts] = False
        self.ready[layers, experts] = True

    def check(self) -> None:
        """Raises AssertionError if the views disagree (tests)."""
        for layer in range(self.num_layers):
            held = self.expert_in[layer][self.expert_in[layer] >= 0]
            assert len(set(held.tolist())) == len(held), f"layer {layer}: an expert holds two slots"
            for s, e in enumerate(self.expert_in[layer]):
                assert e < 0 or self.slot_of[layer, e] == s, f"layer {layer}: slot {s} holds {e}, slot_of disagrees"
            cached = np.flatnonzero(self.slot_of[layer] >= 0)
            assert len(cached) == len(held), f"layer {layer}: {len(cached)} experts with slots, {len(held)} held"
        has_slot = self.slot_of >= 0
        assert not (self.ready & self.loading).any(), "an expert is both ready and loading"
        assert ((self.ready | self.loading) == has_slot).all(), "an expert's slot is neither ready nor loading"
