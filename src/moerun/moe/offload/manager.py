"""ExpertOffload: serves every offloaded MoE layer from a device cache of expert slots.

Per layer and forward pass (T tokens routed to k experts each):

1. The routing ids (and the lookahead's candidates for the next layers, and x for CPU compute) start copying to
   pinned host buffers right after the router.
2. Speculative hit pass (overlap on, dense pool): ids are remapped to slots through the device table and the
   fused kernel computes every cached expert at once; uncached pairs point at the zero null slot with weight 0.
   Nothing in it waits for the host.
3. The host waits for the routing ids only, splits the layer's experts into hits and misses, and either copies
   each miss into a slot (copy stream; evicting per policy, never a pinned expert of the layer) or, by the cost
   model, computes it on the CPU. The miss pass waits on the copies' event; the hits are already computing.
   When more experts are needed at once than the layer has slots, they are served in rounds that reuse slots.
4. Prefetch: the lookahead's candidates for the next layers are copied behind the misses.
5. The partial results (float32 when there are several) are summed.

On CUDA the host waits once per MoE layer for the routing ids, so a whole decode step cannot be one CUDA graph in
this mode ('copy'). Steps 1-2 are the layer's device part (``_begin``) and 3-5 its host part (``_finish``): with
overlap on CUDA, decode replays one graph per decoder layer that ends with the device part, and the host part
runs after each replay (engine/layer_graphs.py); prefill runs eagerly. zero_copy.py serves experts without the
host's wait.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import torch

from moerun import ops
from moerun.device import to_device
from moerun.moe.offload.base import OffloadManagerBase
from moerun.moe.offload.cache import SlotTable
from moerun.moe.offload.config import OffloadConfig
from moerun.moe.offload.cpu_compute import CostModel, cpu_partial, measure_cpu, measure_h2d
from moerun.moe.offload.packed_pool import PackedSlotPool
from moerun.moe.offload.policies import make_policy
from moerun.moe.offload.pool import SlotPool
from moerun.moe.offload.prefetch import PrefetchGate, RouterLookahead
from moerun.moe.offload.stats import OffloadStats
from moerun.moe.offload.store import HostExpertStore
from moerun.moe.offload.transfer import Copier, HostTicket, StagingRing
from moerun.ops.dispatch import pick_backend
from moerun.ops.quant import fused_moe_quantized

logger = logging.getLogger("moerun")


def _resolve_backend(backend: str | None, device: torch.device) -> str:
    from moerun.ops.dispatch import pick_backend

    return pick_backend(backend, device, "MoE")


@dataclass
class _LayerStart:
    """What a layer's device part leaves for its host part."""

    layer: int
    x: torch.Tensor  # [T, H]
    topk_weights: torch.Tensor  # [T, k]
    topk_ids: torch.Tensor  # [T, k]
    ticket: HostTicket  # routing ids (+ lookahead, + x and weights for CPU compute) on their way to the host
    has_proposal: bool
    partials: list[torch.Tensor]  # the pass over the cached experts (overlap), float32 [T, H]


class ExpertOffload(OffloadManagerBase):
    """The cache (slot table + device pools), host store, copier, policy, lookahead and statistics."""

    graphable = False  # the host reads every layer's routing: forward passes cannot be captured whole
    mode = "copy"

    def __init__(self, store: HostExpertStore, slots_per_layer: int, device: torch.device, dtype: torch.dtype,
                 top_k: int, gates: list[torch.Tensor], config: OffloadConfig | None = None,
                 backend: str | None = None, kv_bytes: int | None = None) -> None:
        config = config or OffloadConfig()
        L, E, S = store.num_layers, store.num_experts, slots_per_layer
        if len(gates) != L:
            raise ValueError(f"expected one router per offloaded MoE layer ({L}), got {len(gates)}")
        if S == 0 and config.cpu_compute != "always":
            raise ValueError("an expert cache of 0 slots per layer needs cpu_compute='always'")
        if not 0 <= S <= E:
            raise ValueError(f"slots_per_layer must be in [0, {E}], got {S}")
        self.store, self.config, self.device, self.dtype = store, config, device, dtype
        self.num_layers, self.num_experts, self.slots_per_layer, self.top_k = L, E, S, top_k
        self.backend = backend
        self.kv_bytes = kv_bytes  # KV-cache budget of the placement; None: sized from free memory
        self.stats = OffloadStats()
        self.policy = make_policy(config.policy, L, E)
        self.table = SlotTable(L, E, S, device, self.policy, self.stats)
        resolved = _resolve_backend(backend, device)
        # Quantized slots on the Triton path stay repacked for the fused quantized kernels (packed_pool.py); where
        # those kernels do not take a layer's types, each pass dequantises the slots it computes ("compact").
        packed = S > 0 and resolved == "triton" and PackedSlotPool.applies(store.specs)
        self.pool: SlotPool | PackedSlotPool | None = None
        if S > 0:
            self.pool = PackedSlotPool(store.specs, S, device, store) if packed else SlotPool(store.specs, S, device)
        staging = None
        if device.type == "cuda" and not store.pinned:
            staging = StagingRing(max(store.expert_bytes(i) for i in range(L)) + 4096, config.staging_buffers)
        self.copier = Copier(device, staging)
        per_layer = top_k if config.prefetch_per_layer is None else config.prefetch_per_layer
        self.lookahead = (RouterLookahead([g.detach() for g in gates], config.prefetch_depth, per_layer)
                          if config.prefetch is not False and S > 0 and L > 1 else None)
        self.prefetch_gate = PrefetchGate(config.prefetch_min_accuracy, pause=32 * L)  # about 32 forward passes
        self.overlap = device.type == "cuda" if config.overlap is None else config.overlap
        self.compact = self.pool is not None and self.pool.quantized and resolved == "triton" and not packed
        self.speculative = self.overlap and self.pool is not None and not self.compact
        self._capture_bucket: int | None = None  # set while layer graphs are captured (engine/layer_graphs.py)
        self.captured: dict[tuple[int, int], _LayerStart] = {}  # (bucket, layer) -> its graph's device part
        self.split_capture: Callable[[], None] | None = None  # ends a layer graph after the routing's copy
        self.cost: CostModel | None = None
        if config.cpu_compute == "auto":
            self.cost = self._cost_model()

    # ---- per-layer forward ----
    def forward_layer(self, layer: int, x: torch.Tensor, topk_weights: torch.Tensor,
                      topk_ids: torch.Tensor, keep_float32: bool = False) -> torch.Tensor:  # fmt: skip
        """The experts of MoE layer ``layer`` on x [T, H] with routing [T, k] -> [T, H] in x's dtype.
        ``keep_float32`` (ops.fused_moe's: float32 sums are allowed, not asked for) changes nothing here.

        While a layer graph is captured (``capturing``), only the device part runs and its partial sum (float32,
        the cached experts) is returned; ``finish_replayed`` serves the rest after each replay.
        """
        start = self._begin(layer, x, topk_weights, topk_ids)
        if self._capture_bucket is not None:
            self.captured[(self._capture_bucket, layer)] = start
            return start.partials[0]
        return self._finish(start, x.shape[0])

    @property
    def layer_graphable(self) -> bool:
        """Whether decode can run as one CUDA graph per layer (engine/layer_graphs.py): the device part of a layer
        (speculative pass over the cached experts) exists and runs on CUDA."""
        return self.speculative and self.device.type == "cuda"

    @contextlib.contextmanager
    def capturing(self, bucket: int) -> Iterator[None]:
        """Layer graphs of ``bucket`` are being captured: forward_layer runs only the device part."""
        self._capture_bucket = bucket
        try:
            yield
        finally:
            self._capture_bucket = None

    def before_replay(self, layer: int) -> None:
        """Before the graph that computes ``layer``'s cached experts replays: the compute stream waits for
        prefetch copies into that layer still in flight (graphs cannot wait on events recorded outside them)."""
        self.copier.wait_layer(layer)

    def routing_replayed(self, bucket: int, layer: int) -> None:
        """After the graph that sends ``layer``'s routing of ``bucket`` to the host replayed: the routing is
        ready once the compute stream gets here."""
        ticket = self.captured[(bucket, layer)].ticket
        if ticket.event is None:  # one event per captured layer, recorded again at every replay
            ticket.event = torch.cuda.Event()
        ticket.event.record()

    def finish_replayed(self, bucket: int, layer: int, rows: int) -> torch.Tensor | None:
        """After ``layer``'s graphs of ``bucket`` replayed: its misses served for the first ``rows`` (real) rows.
        Returns the layer's output [bucket, H] with the misses added, or None when the graphed pass over the
        cached experts is the whole output."""
        return self._finish(self.captured[(bucket, layer)], rows, graphed=True)

    def _begin(self, layer: int, x: torch.Tensor, topk_weights: torch.Tensor,
               topk_ids: torch.Tensor) -> "_LayerStart":
        """Device part of a layer: lookahead, routing to the host, and (overlap) the pass over cached experts."""
        cpu_on = self.config.cpu_compute != "off"
        proposal = self.lookahead.propose(layer, x) if self.lookahead is not None else None
        sent = [topk_ids] + (list(proposal) if proposal is not None else []) + ([x, topk_weights] if cpu_on else [])
        ticket = self.copier.to_host(sent, record=self._capture_bucket is None)
        if self._capture_bucket is not None and self.split_capture is not None:
            self.split_capture()  # a layer graph ends here: the host may read the routing from now on
        partials: list[torch.Tensor] = []
        if self.speculative:
            if self._capture_bucket is None:  # a layer graph waits before its replay (before_replay)
                self.copier.wait_layer(layer)
            slots = self.table.device_table[layer][topk_ids.long()]  # [T, k], -1 where not cached
            hit = slots >= 0
            w = torch.where(hit, topk_weights, torch.zeros_like(topk_weights))
            partials.append(self._run(layer, x, self.pool.weights(layer),
                                      w, torch.where(hit, slots, self.table.null_slot), fp32=True))
        return _LayerStart(layer, x, topk_weights, topk_ids, ticket, proposal is not None, partials)

    def _finish(self, start: "_LayerStart", rows: int, graphed: bool = False) -> torch.Tensor | None:
        """Host part of a layer: the first ``rows`` tokens' routing decides hits, misses (copied or computed on
        the CPU) and prefetches; returns the sum of the passes in x's dtype (graphed: None when the pass over
        the cached experts, which the layer graph already wrote out, is the only one)."""
        layer, x, topk_weights, topk_ids = start.layer, start.x, start.topk_weights, start.topk_ids
        st = self.stats
        if layer == 0:
            st.forward_passes += 1
            st.tokens += rows
        partials = list(start.partials)
        t0 = time.perf_counter()
        host = start.ticket.wait()
        st.routing_wait_s += time.perf_counter() - t0
        ids_h = host[0].numpy()[:rows]
        routed = np.bincount(ids_h.reshape(-1), minlength=self.num_experts)  # [E] pairs per expert
        experts = np.flatnonzero(routed)  # ascending
        counts = routed[experts]
        cached = self.table.lookup(layer, experts) >= 0
        n_hits = int(np.count_nonzero(cached))
        st.lookups += len(experts)
        st.hits += n_hits
        st.misses += len(experts) - n_hits
        self.table.routed(layer, experts)
        self.policy.touch(layer, experts, counts)
        if self.speculative and n_hits == len(experts):
            # every routed expert was cached: the speculative pass is the layer's output; nothing to copy, so
            # nothing of this layer needs pinning (prefetch never targets the layer in flight)
            self._prefetch_next(start, host)
            return None if graphed else partials[0].to(x.dtype)
        resident = experts[cached]
        cpu_experts, gpu_experts = self._split(layer, experts[~cached], counts[~cached])
        st.misses_cpu += len(cpu_experts)
        st.misses_copied += len(gpu_experts)
        self.table.pin(layer, resident)
        if not self.speculative:
            self.copier.wait_layer(layer)
        rounds = self._rounds(resident, gpu_experts)
        n_passes = len(partials) + sum(1 for _, _, c in rounds if c) + (1 if cpu_experts else 0)
        fp32 = n_passes > 1 or bool(partials)
        routed_all = len(cpu_experts) == 0 and rows == x.shape[0]
        for reuse, admit, compute in rounds:
            if reuse:
                self.table.unpin(layer)
                self.copier.after_compute()
            self._admit(layer, admit, prefetch=False)
            self.table.pin(layer, np.asarray(admit, dtype=np.int64))
            if compute:
                everything = routed_all and len(compute) == len(experts)
                partials.append(self._pass(layer, x, topk_weights, topk_ids, compute, fp32, everything))
        if len(rounds) > 1 and any(r for r, _, _ in rounds):
            st.chunked_layers += 1
        self._prefetch_next(start, host)
        if cpu_experts:
            partials.append(self._cpu(layer, host[-2], host[-1], host[0].numpy(), cpu_experts))
        self.table.unpin(layer)
        if graphed and len(partials) == 1:
            return None
        if not partials:  # nothing routed (cannot happen with T > 0) or an empty batch
            return torch.zeros_like(x)
        out = partials[0]
        for p in partials[1:]:
            out = out + p
        return out if out.dtype == x.dtype else out.to(x.dtype)

    def _split(self, layer: int, missing: np.ndarray, counts: np.ndarray) -> tuple[list[int], list[int]]:
        """(missed experts for the CPU, missed experts to copy)."""
        mode = self.config.cpu_compute
        if mode == "off" or len(missing) == 0:
            order = np.argsort(-counts, kind="stable")
            return [], [int(e) for e in missing[order]]
        if mode == "always" or self.slots_per_layer == 0:
            return [int(e) for e in missing], []
        return self.cost.split(missing, counts, self.store.expert_bytes(layer))

    def _rounds(self, resident: np.ndarray, misses: list[int]) -> list[tuple[bool, list[int], list[int]]]:
        """(reuse slots, experts to admit, experts to compute) per pass of a layer.

        The first round only fills slots that no pinned expert holds; later rounds (more experts than slots)
        reuse every slot once the compute stream has finished with them. With overlap the cached experts are a
        pass of their own (the speculative pass, or the first pass here), so they compute while misses copy.
        """
        S = self.slots_per_layer
        res = [int(e) for e in resident]
        rounds: list[tuple[bool, list[int], list[int]]] = []
        carry = [] if self.speculative else res
        if self.overlap and carry:
            rounds.append((False, [], carry))
            carry = []
        room = S - len(res)
        first = misses[: max(room, 0)]
        if first or carry:
            rounds.append((False, first, carry + first))
        rest = misses[len(first):]
        for i in range(0, len(rest), max(S, 1)):
            chunk = rest[i : i + S]
            rounds.append((True, chunk, chunk))
        return rounds

    def _admit(self, layer: int, experts: list[int], prefetch: bool) -> None:
        """Gives ``experts`` slots of ``layer``, queues their copies and the table update; the compute stream
        waits for the copies (misses) or the layer's next pass does (prefetch)."""
        if not experts:
            return
        admitted = self.table.admit(layer, np.asarray(experts, dtype=np.int64), prefetch=prefetch)
        nbytes = self.store.expert_bytes(layer)
        if isinstance(self.pool, PackedSlotPool) and self.pool.host_packed is not None:  # packed already
            for a in admitted:
                self.copier.copy_expert(*self.pool.packed_copy(layer, a.slot, a.expert))
        elif isinstance(self.pool, PackedSlotPool):  # GGUF blocks into staging rows, repacked into slots per batch
            rows = self.pool.staging_rows
            for first in range(0, len(admitted), rows):
                batch = admitted[first : first + rows]
                for row, a in enumerate(batch):
                    parts = self.store.expert_parts(layer, a.expert)
                    self.copier.copy_expert(self.pool.staging_views(layer, row), parts)
                with self.copier.on_stream():  # after these copies, before the next batch's
                    self.pool.repack_staged(layer, [a.slot for a in batch])
        else:
            for a in admitted:
                self.copier.copy_expert(self.pool.slot_views(layer, a.slot), self.store.expert_parts(layer, a.expert))
        st = self.stats
        st.copies += len(admitted)
        st.bytes_copied += len(admitted) * nbytes
        if prefetch:
            st.prefetch_issued += len(admitted)
            st.bytes_copied_prefetch += len(admitted) * nbytes
        else:
            st.bytes_copied_miss += len(admitted) * nbytes
        self.table.flush(self._to_device)
        if admitted:
            event = self.copier.record()
            if prefetch:
                self.copier.prefetched(layer, event)
            else:
                self.copier.compute_wait(event)

    def _prefetch_next(self, start: "_LayerStart", host: list[torch.Tensor]) -> None:
        """Prefetch for the layers after ``start``'s from its lookahead (host[1], host[2]), unless the gate is shut."""
        if start.has_proposal and self.prefetch_gate.open(self.stats):
            self._prefetch(start.layer, host[1].numpy(), host[2].numpy())

    def _prefetch(self, layer: int, ids: np.ndarray, conf: np.ndarray) -> None:
        """Copies the lookahead's candidates [D, P] for the layers after ``layer`` (best first, bounded by the
        target layer's unpinned slots; the layer in flight is never a target)."""
        min_conf = self.config.prefetch_min_confidence
        for d, target in enumerate(self.lookahead.targets(layer)):
            want = (conf[d] >= min_conf) & (self.table.slot_of[target, ids[d]] < 0)  # [P] not cached yet
            if not want.any():
                continue
            room = self.slots_per_layer - self.table.num_pinned(target)
            self._admit(target, ids[d][want][: max(room, 0)].tolist(), prefetch=True)

    def _pass(self, layer: int, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
              compute: list[int], fp32: bool, everything: bool) -> torch.Tensor:
        """The fused kernel over the routing pairs whose expert is in ``compute`` (all cached now)."""
        E = self.num_experts
        idx = np.asarray(compute, dtype=np.int64)
        if self.compact:
            slots = self.table.slot_of[layer, idx].tolist()
            lut = np.full(E, len(slots), dtype=np.int32)
            lut[idx] = np.arange(len(slots), dtype=np.int32)
            weights = self.pool.dense_subset(layer, slots, self.dtype)
            null = len(slots)
        else:
            lut = np.full(E, self.table.null_slot, dtype=np.int32)
            lut[idx] = self.table.slot_of[layer, idx]
            weights = self.pool.weights(layer)
            null = self.table.null_slot
        sid = self._to_device(lut)[topk_ids.long()]  # [T, k] slot ids
        w = topk_weights if everything else torch.where(sid != null, topk_weights, torch.zeros_like(topk_weights))
        return self._run(layer, x, weights, w, sid, fp32)

    def _run(self, layer: int, x: torch.Tensor, weights: tuple[object, object], topk_weights: torch.Tensor,
             slot_ids: torch.Tensor, fp32: bool) -> torch.Tensor:
        w13, w2 = weights
        dense = isinstance(w13, torch.Tensor)
        # The weights stack the pool's slots: the layer's expert count, not theirs, picks the kernels' tuned tables.
        if fp32 and not dense and pick_backend(self.backend, x.device, "MoE") == "triton":
            # the quantized kernels compute in x's dtype and return the k-slot sum unrounded
            return fused_moe_quantized(x, w13, w2, topk_weights, slot_ids, out_dtype=torch.float32,
                                       num_experts=self.num_experts)  # fmt: skip
        h = x.float() if fp32 and dense else x  # the kernels cast x to the weights' dtype; the sum stays fp32
        out = ops.fused_moe(h, w13, w2, topk_weights, slot_ids, backend=self.backend, num_experts=self.num_experts)
        return out.float() if fp32 else out

    def _cpu(self, layer: int, x_h: torch.Tensor, w_h: torch.Tensor, ids_h: np.ndarray,
             experts: list[int]) -> torch.Tensor:
        t0 = time.perf_counter()
        w13, w2 = self.store.weights(layer)
        ids = torch.from_numpy(ids_h)
        y = cpu_partial(x_h, w13, w2, w_h, ids, experts, self.dtype)  # [T, H] float32 on the host
        self.stats.cpu_compute_s += time.perf_counter() - t0
        self.stats.cpu_pairs += int(np.isin(ids_h, experts).sum())
        if self.device.type == "cuda":
            return y.pin_memory().to(self.device, non_blocking=True)
        return y

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        return to_device(array, self.device)

    # ---- setup helpers ----
    def _cost_model(self) -> CostModel:
        c = self.config
        h2d = c.pcie_gbps * 1e9 if c.pcie_gbps else measure_h2d(self.store, self.device)
        if c.cpu_expert_ms is not None and c.cpu_token_ms is not None:
            per_expert, per_token = c.cpu_expert_ms / 1e3, c.cpu_token_ms / 1e3
        else:
            per_expert, per_token = measure_cpu(self.store, self.dtype)
            per_expert = c.cpu_expert_ms / 1e3 if c.cpu_expert_ms is not None else per_expert
            per_token = c.cpu_token_ms / 1e3 if c.cpu_token_ms is not None else per_token
        model = CostModel(h2d, per_expert, per_token)
        logger.info("expert cost model: copy %.3f ms per expert, CPU %.3f ms + %.3f ms per token",
                    1e3 * model.copy_s(self.store.expert_bytes(0)), 1e3 * per_expert, 1e3 * per_token)
        return model

    def stats_dict(self) -> dict:
        """Counters and rates (see stats.py) plus the cache's configuration."""
        self.stats.copy_stall_s = self.copier.stall_seconds()
        d = self.stats.as_dict()
        d.update(self.config_stats(), prefetch=self.lookahead is not None, prefetch_pauses=self.prefetch_gate.pauses,
                 cpu_compute=self.config.cpu_compute, overlap=self.overlap)
        if self.cost is not None:
            d["cost_model"] = self.cost.as_dict()
        return d

    def reset_stats(self) -> None:
        self.copier.stall_seconds()
        self.copier.stall_s = 0.0
        self.stats.reset()
        self.prefetch_gate.reset()
