"""Properties of the expert cache over random routing sequences, for every policy: slot accounting never leaks
or double-books, the device table always equals the host view, pinned experts are never evicted, and the
offloaded layer computes what the resident experts compute."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moerun.moe.offload import OffloadConfig
from moerun.moe.offload.cache import CacheFull, SlotTable
from moerun.moe.offload.manager import ExpertOffload
from moerun.moe.offload.policies import make_policy
from moerun.moe.offload.stats import OffloadStats
from moerun.moe.offload.store import HostExpertStore, PartSpec
from moerun.ops.moe_reference import fused_moe_reference

POLICIES = ["lru", "lfu", "activation"]
L, E = 3, 8

# one step: (layer, routed experts, prefetch candidates for the next layer, a new request starts)
step = st.tuples(st.integers(0, L - 1), st.lists(st.integers(0, E - 1), min_size=1, max_size=E),
                 st.lists(st.integers(0, E - 1), max_size=4), st.booleans())


@settings(max_examples=60, deadline=None)
@given(policy=st.sampled_from(POLICIES), slots=st.integers(1, E), steps=st.lists(step, min_size=1, max_size=40))
def test_slot_table_invariants(policy, slots, steps):
    stats = OffloadStats()
    pol = make_policy(policy, L, E)
    table = SlotTable(L, E, slots, torch.device("cpu"), pol, stats)
    for layer, routed, candidates, new_request in steps:
        if new_request:
            pol.new_request()
        experts, counts = np.unique(np.asarray(routed), return_counts=True)
        table.routed(layer, experts)
        pol.touch(layer, experts, counts)
        resident = experts[table.lookup(layer, experts) >= 0]
        table.pin(layer, resident)
        missing = [int(e) for e in experts if table.slot_of[layer, e] < 0]
        room = slots - len(resident)
        chunks = [missing[: max(room, 0)]] + [missing[max(room, 0):][i : i + slots]
                                              for i in range(0, len(missing) - max(room, 0), slots)]
        for i, chunk in enumerate(chunks):
            if i > 0:
                table.unpin(layer)
            pinned = {int(e): int(table.slot_of[layer, e]) for e in np.flatnonzero(table.pinned[layer])}
            admitted = table.admit(layer, np.asarray(chunk, dtype=np.int64))
            table.pin(layer, np.asarray(chunk, dtype=np.int64))
            assert {a.expert for a in admitted} == set(chunk)
            assert not {a.evicted for a in admitted} & set(pinned), "a pinned expert was evicted"
            assert all(table.slot_of[layer, e] == s for e, s in pinned.items()), "a pinned expert moved"
            table.flush()
            table.check()
        # more experts than the unpinned slots can take is refused without changing anything
        if table.num_pinned(layer) == slots and slots < E:
            outside = [e for e in range(E) if table.slot_of[layer, e] < 0][:1]
            before = table.slot_of.copy()
            with pytest.raises(CacheFull):
                table.admit(layer, np.asarray(outside, dtype=np.int64))
            assert (table.slot_of == before).all()
        if layer + 1 < L and candidates:
            target = layer + 1
            cands = [c for c in dict.fromkeys(candidates) if table.slot_of[target, c] < 0]
            cands = cands[: slots - table.num_pinned(target)]
            admitted = table.admit(target, np.asarray(cands, dtype=np.int64), prefetch=True)
            stats.prefetch_issued += len(admitted)
        table.unpin(layer)
        table.flush()
        table.check()
        assert table.num_resident(layer) <= slots
        assert stats.prefetch_issued == stats.prefetch_useful + stats.prefetch_wasted + int(table.prefetched.sum())


def _toy_store(seed: int, H: int = 8, I: int = 4) -> tuple[HostExpertStore, list[torch.Tensor]]:  # noqa: E741
    g = torch.Generator().manual_seed(seed)
    w13 = [torch.randn(E, 2 * I, H, generator=g) / H**0.5 for _ in range(L)]
    w2 = [torch.randn(E, H, I, generator=g) / I**0.5 for _ in range(L)]
    specs = [[PartSpec("w13", (2 * I, H), torch.float32), PartSpec("w2", (H, I), torch.float32)] for _ in range(L)]
    gates = [torch.randn(E, H, generator=g) for _ in range(L)]
    return HostExpertStore([[a, b] for a, b in zip(w13, w2)], specs), gates


@settings(max_examples=40, deadline=None)
@given(policy=st.sampled_from(POLICIES), k=st.integers(1, 3), extra=st.integers(0, E),
       prefetch=st.booleans(), overlap=st.booleans(), cpu=st.sampled_from(["off", "always", "auto"]),
       seed=st.integers(0, 2**16), zipf=st.floats(0.0, 2.0),
       sizes=st.lists(st.integers(1, 6), min_size=1, max_size=6))
def test_offloaded_layers_compute_the_resident_result(policy, k, extra, prefetch, overlap, cpu, seed, zipf, sizes):
    slots = 0 if cpu == "always" and extra == 0 else min(E, k + extra)
    store, gates = _toy_store(seed)
    config = OffloadConfig(policy=policy, prefetch=prefetch, overlap=overlap, cpu_compute=cpu, pcie_gbps=1.0,
                           cpu_expert_ms=1e-3, cpu_token_ms=1e-3)
    manager = ExpertOffload(store, slots, torch.device("cpu"), torch.float32, k, gates, config, backend="torch")
    rng = np.random.default_rng(seed)
    popularity = 1.0 / np.arange(1, E + 1) ** zipf
    for T in sizes:
        if rng.random() < 0.3:
            manager.new_request()
        for layer in range(L):
            ids = np.stack([rng.choice(E, k, replace=False, p=popularity / popularity.sum()) for _ in range(T)])
            topk_ids = torch.from_numpy(ids.astype(np.int32))
            topk_weights = torch.from_numpy(rng.random((T, k)).astype(np.float32))
            x = torch.from_numpy(rng.standard_normal((T, 8)).astype(np.float32))
            out = manager.forward_layer(layer, x, topk_weights, topk_ids)
            w13, w2 = store.weights(layer)
            expected = fused_moe_reference(x, w13, w2, topk_weights, topk_ids)
            torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
            assert not manager.table.pinned.any(), "pins outlive the layer"
            manager.table.check()
    s = manager.stats_dict()
    assert s["hits"] + s["misses"] == s["lookups"]
    assert s["misses"] == s["misses_copied"] + s["misses_cpu"]
    assert s["tokens"] == sum(sizes)
