"""ZeroCopyOffload: offloaded experts served without the host inside a forward pass, so steps run in CUDA graphs.

Every offloaded MoE layer has a device table of int64 addresses, [P, E, W] of ``table`` [L, P, E, W] (dense
experts: w13 and w2, one address each, pointers.py): an entry points at the expert's slot in the device pool when
the expert is resident, else at its row of the pinned host store, which the fused kernels read in place over PCIe
(zero-copy; kernels/fused_moe_ptr.py). A layer's forward is
route -> (Triton backend) stage the missed experts -> table-based fused MoE, plus two counts accumulated on the
device: the (token, slot) pairs each expert received (``counts`` [L, E]) and the forward passes in which it received
any (``steps`` [L, E]; each pass reads a missed expert from host memory again), both copied (non-blocking, inside
the step) to a pinned host buffer after the last layer. Staging (kernels/stage_misses.py): one launch copies the
pass's first top-k missed experts (``is_host`` [L, E] says which entries point at host memory) into device rows and
hands the fused MoE a copy of the layer's table pointing at them, since a copy kernel reads PCIe at about twice the
rate of the fused kernels reading in place. With ``overlap`` (dense experts; on CUDA by default) that copy runs on a
side stream while GEMM 1 computes the pairs whose experts are already on the device; the pairs the plan flagged wait
for it (kernels/moe_parts.StagedPairs). On CUDA each copy launch adds its span on the GPU's clock to its layer's
``clock`` [L, 3], which comes back with the counts: the statistics' in-step copy time (``copy_in_step_s``).

Admission on the device (``OffloadConfig.admit_on_device``, on by default where staging applies): the staging
launch puts missed experts into the layer's spare slots, the slots the policy values least (ranked by the host
between steps; a slot whose expert the pass routes to is skipped, and so is a slot admitted into in the layer's
last few passes (``admit_hold_passes``, ``hold`` [L, S]), which a host ranking from a step-old view would give up),
and rewrites the layer's table, residency flags and slot occupants (``occupant`` [L, S]) itself; it also counts
the passes that read each expert from host memory (``host_passes`` [L, E]). So a missed expert crosses PCIe once,
where an admission between steps reads it a second time. The host takes the occupants with the routing counts
after each step and updates its view and the policy; it admits nothing itself.

Quantized experts ('auto' takes this mode for them on CUDA where ``reads_quantized_in_place``) work the same way
over their repacked arrays: the pool keeps slots and a pinned host copy repacked (packed_pool.py), the table holds
one row of W = 4 array addresses (codes, high, sub, scale) per packed part, and the fused quantized kernels read
through them (kernels/quant/fused_moe_quant.py, ``tables=``; the Triton backend, the interpreter on CPU).

Otherwise the cache changes only between steps (``between_steps``, called by the runner before each forward pass):
1. the routing counts of the steps finished since the last call give the statistics (per step: hits = routed
   experts whose entry points at a slot; misses = read from host; under async scheduling one call often takes two
   steps, and an expert routed in both counts twice) and feed the eviction policy (pairs); when the last step has
   not finished yet its counts are taken at a later call (they accumulate), so the host never waits;
2. admissions whose copy has completed (its event has fired) switch their entries to their slots;
3. the most-routed missed experts are admitted, within ``admit_bytes_per_step``, into free slots or in place of
   the policy's victim when the policy values them more. Ordering: the evicted experts' entries are pointed back
   at their host copies on the compute stream first; the copy stream then waits for the compute stream (no queued
   step reads the victims' slots through the tables any more) and copies the admitted experts; their entries stay
   on the host copies until a later call sees the copy's event complete. The compute stream never waits for a copy.
"""

from __future__ import annotations

import weakref
from dataclasses import replace
from typing import TYPE_CHECKING

import numpy as np
import torch

from moerun.device import to_device
from moerun.kernels.interpreter import interpreting
from moerun.kernels.quant.repack import expert_addresses
from moerun.moe.offload.config import OffloadConfig
from moerun.moe.offload.base import OffloadManagerBase
from moerun.moe.offload.packed_pool import PackedSlotPool
from moerun.moe.offload.policies import make_policy
from moerun.moe.offload.pointers import ExpertPointers, address_alignment
from moerun.moe.offload.pool import SlotPool
from moerun.moe.offload.residency import Plan, Residency
from moerun.moe.offload.stats import OffloadStats
from moerun.moe.offload.store import HostExpertStore, pinned_empty, unregister_all
from moerun.moe.offload.transfer import Copier
from moerun.ops.dispatch import pick_backend
from moerun.ops.moe import fused_moe_indirect
from moerun.ops.quant import fused_moe_quantized

# what _take_routing returns: routed, steps, host passes [L, E] each, occupants [L, S], staging-copy nanoseconds
Routing = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, int]

if TYPE_CHECKING:  # Triton: an optional dependency
    from moerun.kernels.moe_parts import StagedPairs
    from moerun.kernels.stage_misses import Admission


def reads_quantized_in_place(store: HostExpertStore, device: torch.device, backend: str | None) -> bool:
    """Whether the fused quantized kernels can read this store's quantized experts through address tables: the
    Triton backend on ``device`` and expert types those kernels take."""
    return pick_backend(backend, device, "MoE") == "triton" and PackedSlotPool.applies(store.specs)


def _dense_parts(store: HostExpertStore, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The layer's stacked host (w13 [E, 2I, H], w2 [E, H, I]); raises if they are not dense and contiguous."""
    specs = store.specs[layer]
    if [s.which for s in specs] != ["w13", "w2"] or any(s.qtype is not None for s in specs):
        raise ValueError(f"layer {layer}: zero-copy offloading needs dense w13 and w2 parts, got "
                         f"{[(s.which, s.qtype) for s in specs]}")
    w13, w2 = store.parts[layer]
    if not (w13.is_contiguous() and w2.is_contiguous()):
        raise ValueError(f"layer {layer}: the host store's expert parts must be contiguous")
    return w13, w2


class ZeroCopyOffload(OffloadManagerBase):
    """Address tables, device slot pools, pinned host store, routing counts, policy and statistics."""

    graphable = True  # a forward pass reads nothing back to the host
    mode = "zero_copy"

    def __init__(self, store: HostExpertStore, slots_per_layer: int, device: torch.device, top_k: int,
                 config: OffloadConfig | None = None, backend: str | None = None,
                 kv_bytes: int | None = None) -> None:
        config = config or OffloadConfig(mode="zero_copy")
        L, E, S = store.num_layers, store.num_experts, slots_per_layer
        if not 0 <= S <= E:
            raise ValueError(f"slots_per_layer must be in [0, {E}], got {S}")
        if device.type == "cuda" and not store.pinned:
            raise ValueError("zero-copy offloading reads experts from pinned host memory, but the store is not pinned")
        self.packed = any(spec.qtype is not None for layer in store.specs for spec in layer)
        self.store, self.config, self.device, self.backend, self.kv_bytes = store, config, device, backend, kv_bytes
        self.num_layers, self.num_experts, self.slots_per_layer, self.top_k = L, E, S, top_k
        self.expert_bytes = [store.expert_bytes(layer) for layer in range(L)]  # one expert, all parts, per layer
        self.stats = OffloadStats()
        self.policy = make_policy(config.policy, L, E)
        self.slots = Residency(L, E, S)  # host view: which expert is in which slot, ready or loading
        self.copier = Copier(device)
        if self.packed:
            self.pool, host, slot = self._packed_arrays(store, S, device, backend)
        else:
            parts = [_dense_parts(store, layer) for layer in range(L)]
            self.dtype = parts[0][0].dtype
            self.pool = SlotPool(store.specs, S, device) if S > 0 else None
            host = np.array([[[[t[e].data_ptr()] for e in range(E)] for t in layer] for layer in parts])
            pool = self.pool.parts if self.pool is not None else [[None, None]] * L
            slot = np.array([[[[t[s].data_ptr()] for s in range(S)] for t in layer] for layer in pool])
        # addresses [L, P, E, W] of each expert's host arrays and [L, P, S, W] of each slot's device arrays: P parts
        # (dense: w13, w2; packed: each w13 part and w2), W arrays each (dense: 1; packed: codes, high, sub, scale)
        self.host_addr = host.astype(np.int64).reshape(L, -1, E, host.shape[-1])
        self.slot_addr = slot.astype(np.int64).reshape(L, self.host_addr.shape[1], S, self.host_addr.shape[-1])
        self.table = torch.from_numpy(self.host_addr.copy()).to(device)  # [L, P, E, W] int64
        if self.packed:  # per layer: (one [E, 4] table per w13 part, one for w2), views of self.table
            P = self.table.shape[1]
            self.quant_tables = [([self.table[layer, p] for p in range(P - 1)], self.table[layer, P - 1])
                                 for layer in range(L)]
        else:
            self.pointers = [self._layer_pointers(layer, parts[layer], pool[layer]) for layer in range(L)]
        self.is_host = torch.ones(L, E, dtype=torch.int32, device=device)  # [L, E] 1: the table points at host memory
        self._make_staging()
        self.device_admission = self._device_admission()
        self._make_overlap()
        # what each step leaves for the host, one buffer: [3, L, E] cumulative tallies, pairs routed to each expert
        # (``counts``), forward passes that routed any (``steps``), passes that read it from host memory
        # (``host_passes``, counted by the staging launch with admission on the device), then the occupant of
        # each slot (``occupant`` [L, S], -1 free; kept by that launch, with admission on the device only), then
        # each layer's staging-copy clock (``clock`` [L, 3]: the copy launch's scratch, then its nanoseconds summed)
        self.record = torch.zeros(3 * L * E + L * S + 3 * L, dtype=torch.int64, device=device)
        self.tallies = self.record[: 3 * L * E].view(3, L, E)
        self.counts, self.steps, self.host_passes = self.tallies
        self.occupant = self.record[3 * L * E : 3 * L * E + L * S].view(L, S)
        self.clock = self.record[3 * L * E + L * S :].view(L, 3)
        # the staging copies are timed by the GPU's clock (CUDA; Triton's interpreter has none)
        self.copy_timed = self.staging is not None and device.type == "cuda" and not interpreting()
        if self.copy_timed:
            from moerun.kernels.stage_misses import copy_clock  # Triton: an optional dependency

            self.clock.copy_(copy_clock(device).expand(L, 3))  # no launch started yet
        self.pass_start = torch.zeros(L, E, dtype=torch.int64, device=device)  # [L, E] counts when this pass began
        # page-locked by registration, not by the caching pinned allocator: a step's graph copies into it
        self._registry: list[int] = []
        self.host_record = (pinned_empty(self.record.numel() * 8, self._registry).view(torch.int64)
                            if device.type == "cuda" else None)  # the record after the latest step
        weakref.finalize(self, unregister_all, self._registry)
        self.seen = np.zeros((3, L, E), dtype=np.int64)  # [3, L, E] tallies already taken into the statistics
        self.seen_copy_ns = 0  # staging-copy nanoseconds already taken into the statistics
        if self.device_admission:
            # top-k spare slots a pass (the held ones are skipped, so top-k more for each pass held)
            self.hold_passes = self.config.hold_passes(top_k, S)
            spares = min(S, top_k * (1 + self.hold_passes))
            self.spares = torch.full((L, spares), -1, dtype=torch.int64, device=device)  # [L, R_S] slots to give up
            self.spares_host = np.full((L, spares), -1, dtype=np.int64)  # as last written
            self.hold = torch.zeros(L, S, dtype=torch.int32, device=device)  # [L, S] passes left to keep the slot
            self.host_table = torch.from_numpy(self.host_addr).to(device)  # [L, P, E, W]
            self.slot_table = torch.from_numpy(self.slot_addr).to(device)  # [L, P, S, W]
        self._mark: torch.cuda.Event | None = None  # recorded at the previous between_steps (CUDA)
        self.pending: list[tuple[torch.cuda.Event | None, Plan]] = []  # copies in flight, oldest first
        self.carried: np.ndarray | None = None  # routing counted by stats_dict, not yet used for admissions
        self.missed_before = np.zeros((L, E), dtype=bool)  # [L, E] read from host memory at the previous boundary
        self.started = False
        self._fill()

    def _layer_pointers(self, layer: int, host: tuple[torch.Tensor, torch.Tensor],
                        pool: list[torch.Tensor | None]) -> ExpertPointers:
        w13, w2 = host
        I, H = w13.shape[1] // 2, w13.shape[2]  # noqa: E741
        regions = tuple(t for t in (*pool, w13, w2) if t is not None)
        align = address_alignment(*(t.data_ptr() for t in regions), w13[0].numel() * w13.element_size(),
                                  w2[0].numel() * w2.element_size())
        return ExpertPointers(self.table[layer, 0, :, 0], self.table[layer, 1, :, 0], H, I, self.dtype, align,
                              regions)

    def _array_bytes(self, layer: int) -> list[int]:
        """Bytes of each array of one expert of ``layer``, [P * W] in the table's order (0 for an absent one)."""
        if not self.packed:
            return [t[0].numel() * t.element_size() for t in self.store.parts[layer]]
        parts = [*self.pool.host_packed[layer][0], *self.pool.host_packed[layer][1]]
        return [0 if t is None else t[0].numel() * t.element_size() for p in parts for t in p.tensors()]

    def _make_staging(self) -> None:
        """The device rows missed experts are staged in (kernels/stage_misses.py), where they apply: the Triton
        backend, stage_experts > 0 and addresses and sizes that are whole words of 4 or 8 bytes; the copies move 16
        bytes a load where every host and slot address is a multiple of 16 (rows start at multiples of 256)."""
        rows = self.config.stage_rows(self.top_k)
        self.staging: torch.Tensor | None = None
        self.stage_aligned = False  # the copies move 16 bytes a load (set below where staging applies)
        if rows == 0 or pick_backend(self.backend, self.device, "MoE") != "triton":
            return
        L, P, E, W = self.table.shape
        sizes = np.array([self._array_bytes(layer) for layer in range(L)], dtype=np.int64)  # [L, P * W]
        addr_align = address_alignment(*self.host_addr.reshape(-1).tolist(), *self.slot_addr.reshape(-1).tolist())
        low = min(addr_align, address_alignment(*sizes.reshape(-1).tolist()))
        word = 8 if low % 8 == 0 else 4 if low % 4 == 0 else 0
        if word == 0:
            return
        self.stage_aligned = addr_align == 16
        aligned = (sizes + 255) // 256 * 256  # [L, P * W] each array starts 256-byte aligned in its row
        offsets = np.concatenate([np.zeros((L, 1), dtype=np.int64), np.cumsum(aligned, axis=1)[:, :-1]], axis=1)
        row_words = int(aligned.sum(axis=1).max()) // word
        dtype = torch.int64 if word == 8 else torch.int32
        self.staging = torch.zeros(rows, row_words, dtype=dtype, device=self.device)  # [rows, row words]
        self.stage_sizes = torch.from_numpy(sizes // word).to(self.device)  # [L, P * W] words
        self.stage_offsets = torch.from_numpy(offsets // word).to(self.device)  # [L, P * W] words
        self.stage_max_words = [int(m) // word for m in sizes.max(axis=1)]
        self.step_table = torch.empty_like(self.table[0])  # [P, E, W] the staged layer's addresses

    def _make_overlap(self) -> None:
        """With staging of dense experts (OffloadConfig.overlap, None: on CUDA), a layer's copy runs on a side
        stream while GEMM 1 computes the pairs whose experts are already on the device (at most SCAN_PAIRS pairs: a
        decode batch; larger passes wait for the copy). Where there is no CUDA the copy runs first, in order."""
        wanted = self.config.overlap if self.config.overlap is not None else self.device.type == "cuda"
        self.overlap = bool(wanted) and self.staging is not None and not self.packed
        if not self.overlap:
            return
        from moerun.kernels.stage_misses import SCAN_PAIRS  # Triton: an optional dependency

        self.scan_pairs = SCAN_PAIRS
        n = SCAN_PAIRS * self.table.shape[1] * self.table.shape[3]
        self.stage_buffers = tuple(torch.empty(n, dtype=torch.int64, device=self.device) for _ in range(2))
        self.pair_flags = torch.empty(SCAN_PAIRS, dtype=torch.int32, device=self.device)  # [pairs] 1: staged
        if self.device.type == "cuda":
            self.copy_stream = torch.cuda.Stream(self.device)
            self.copy_done = [torch.cuda.Event() for _ in range(self.num_layers)]

    def _device_admission(self) -> bool:
        """Whether missed experts are staged straight into slots (OffloadConfig.admit_on_device)."""
        applies = self.staging is not None and self.slots_per_layer > 0
        wanted = self.config.admit_on_device
        if wanted is None:
            return applies and self.config.admit_bytes_per_step is None
        if wanted and not applies:
            raise ValueError("admit_on_device stages missed experts into cache slots: it needs staging (the Triton "
                             "backend, stage_experts > 0) and at least one slot per layer")
        return wanted

    def _admission(self, layer: int) -> Admission | None:
        if not self.device_admission:
            return None
        from moerun.kernels.stage_misses import Admission  # Triton: an optional dependency

        return Admission(self.slot_table[layer], self.host_table[layer], self.occupant[layer], self.spares[layer],
                         self.counts[layer], self.pass_start[layer], self.host_passes[layer], self.hold[layer],
                         self.hold_passes)

    def _staged_tables(self, layer: int, topk_ids: torch.Tensor) -> tuple[torch.Tensor, StagedPairs | None]:
        """The layer's table for this pass ([P, E, W]), its missed experts staged on the device (the same launch adds
        the pass's pairs to the layer's routing counts), and, with overlap, the pairs that must wait for the copy
        running on the side stream and how to wait for it (None: nothing to wait for)."""
        from moerun.kernels.moe_parts import StagedPairs  # Triton: an optional dependency
        from moerun.kernels.stage_misses import copy_misses_triton, plan_misses_triton

        ids = topk_ids.reshape(-1)  # [T*k]
        overlap = self.overlap and ids.numel() <= self.scan_pairs
        flags = self.pair_flags[: ids.numel()] if overlap else None
        plan = plan_misses_triton(self.table[layer], self.is_host[layer], ids, self.stage_sizes[layer],
                                  self.stage_offsets[layer], self.staging, self.step_table, self._admission(layer),
                                  self.counts[layer], flags, self.stage_buffers if overlap else None)
        if plan is None:
            return self.step_table, None
        copy = (plan, self.stage_sizes[layer], self.stage_max_words[layer], self.staging,
                self.clock[layer] if self.copy_timed else None, self.stage_aligned)
        if not overlap or self.device.type != "cuda":
            copy_misses_triton(*copy)  # in order, before the fused MoE
            return self.step_table, StagedPairs(flags, lambda: None) if overlap else None
        main, side, done = torch.cuda.current_stream(self.device), self.copy_stream, self.copy_done[layer]
        side.wait_stream(main)
        with torch.cuda.stream(side):
            copy_misses_triton(*copy)
        done.record(side)
        return self.step_table, StagedPairs(flags, lambda: main.wait_event(done))

    @staticmethod
    def _packed_arrays(store: HostExpertStore, S: int, device: torch.device,
                       backend: str | None) -> tuple[PackedSlotPool, np.ndarray, np.ndarray]:
        """The packed pool (with its host copy) and the array addresses [L, P, E, 4] / [L, P, S, 4] of quantized
        experts."""
        if not reads_quantized_in_place(store, device, backend):
            raise ValueError("zero-copy offloading of quantized experts runs the fused quantized kernels: it needs "
                             "the Triton backend and expert types they read (else use mode='copy')")
        pool = PackedSlotPool(store.specs, S, device, store, host_copy=True)
        host, slot = [], []
        for layer in range(store.num_layers):
            parts = [*pool.host_packed[layer][0], *pool.host_packed[layer][1]]
            slots = [*pool.packed[layer][0], *pool.packed[layer][1]]
            host.append([expert_addresses(p).numpy() for p in parts])  # [P, E, 4]
            slot.append([expert_addresses(p).numpy()[:S] for p in slots])  # [P, S, 4]
        return pool, np.array(host), np.array(slot)

    def _fill(self) -> None:
        """Experts 0 .. S-1 of every layer start resident (copied now, before any step or graph capture)."""
        L, S = self.num_layers, self.slots_per_layer
        layers, slots = np.repeat(np.arange(L), S), np.tile(np.arange(S), L)
        self.slots.admit(Plan(layers, slots, slots, np.full(L * S, -1)))
        for layer, e in zip(layers.tolist(), slots.tolist()):
            for dst, src in zip(*self._copy_views(layer, e, e)):
                dst.copy_(src)
            self.policy.inserted(layer, e)
        self.slots.settle(layers, slots)
        self._write_tables(layers, slots)
        self.occupant.copy_(torch.from_numpy(self.slots.expert_in))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # ---- inside a forward pass (device work only; captured in CUDA graphs) ----
    def forward_layer(self, layer: int, x: torch.Tensor, topk_weights: torch.Tensor,
                      topk_ids: torch.Tensor, keep_float32: bool = False) -> torch.Tensor:  # fmt: skip
        """The experts of MoE layer ``layer`` on x [T, H] with routing [T, k] -> [T, H] in x's dtype (or, with
        ``keep_float32``, the kernels' float32 slot sums where they make them: ops.fused_moe's)."""
        if layer == 0:  # a new forward pass: the pair counts it starts from
            self.pass_start.copy_(self.counts)
        step, staged = None, None  # [P, E, W], pairs still being copied
        if self.staging is not None:
            step, staged = self._staged_tables(layer, topk_ids)  # its plan launch also counts the pairs
        else:
            ids = topk_ids.reshape(-1).long()  # [T*k]
            self.counts[layer].index_add_(0, ids, torch.ones_like(ids))
        if self.packed:
            w13, w2 = self.pool.weights(layer)  # types, shapes and pointer types; the tables say where
            tables = self.quant_tables[layer] if step is None else ([step[p] for p in range(step.shape[0] - 1)],
                                                                     step[-1])
            out = fused_moe_quantized(x, w13, w2, topk_weights, topk_ids, tables=tables, keep_float32=keep_float32)
        else:
            pointers = self.pointers[layer]
            if step is not None:
                # staged arrays start 256-byte aligned: the layer's alignment holds for them too
                pointers = replace(pointers, w13=step[0, :, 0], w2=step[1, :, 0],
                                   regions=(*pointers.regions, self.staging))
            out = fused_moe_indirect(x, pointers, topk_weights, topk_ids, backend=self.backend, staged=staged,
                                     keep_float32=keep_float32)  # fmt: skip
        if layer == self.num_layers - 1:
            self.steps.add_(self.counts > self.pass_start)  # the experts this pass routed any pair to
            if self.host_record is not None:
                self.host_record.copy_(self.record, non_blocking=True)
        return out

    # ---- between forward passes (host) ----
    def between_steps(self, tokens: int = 0) -> None:
        """Statistics and cache updates from the finished steps' routing; ``tokens`` the coming step's count."""
        if not self.started:  # routing recorded while warming up or capturing graphs is not a step's
            self.started = True
            self._take_routing(wait=True)
            if self.device_admission:  # but what those passes admitted on the device is in the slots now
                self._take_occupants(self.occupant.cpu().numpy())
        taken = self._take_routing(wait=False)
        routed = None
        if taken is not None:
            routed = self._absorb(taken)
        if self.carried is not None:
            routed = self.carried if routed is None else routed + self.carried
            self.carried = None
        self.stats.forward_passes += 1
        self.stats.tokens += tokens
        if self.device_admission:
            self._choose_spares()
            return
        switched = self._settle()
        plan = self._plan(routed) if routed is not None else None
        if plan is not None and len(plan):
            self._admit(plan)
            evicted = plan.victims >= 0
            switched = (np.concatenate([switched[0], plan.layers[evicted]]),
                        np.concatenate([switched[1], plan.victims[evicted]]))
        # evicted experts point at their host copies before the copies into their slots are queued
        self._write_tables(*switched)
        if plan is not None and len(plan):
            self._copy(plan)

    def _take_routing(self, wait: bool) -> Routing | None:
        """(pairs routed to each expert [L, E], forward passes that routed to it [L, E], passes that read it from
        host memory [L, E] (admission on the device), slot occupants [L, S], nanoseconds of staging copies) since
        the last call (the occupants: as the latest finished step left them), or None when no step finished since
        then.

        With async scheduling a step is always in flight when this runs; the mark recorded at the previous call
        tells whether the steps queued before it have finished. The pinned tallies are cumulative, so a copy from
        a later step landing meanwhile only moves its steps to this call from the next one.
        """
        if self.host_record is None:
            record = self.record.numpy().copy()
        else:
            mark = torch.cuda.Event()
            mark.record()
            previous, self._mark = self._mark, mark
            if wait:
                mark.synchronize()
            elif not (mark.query() or (previous is not None and previous.query())):
                return None
            record = self.host_record.numpy().copy()
        L, E, S = self.num_layers, self.num_experts, self.slots_per_layer
        now = record[: 3 * L * E].reshape(3, L, E)
        taken, self.seen = now - self.seen, now
        copy_ns = int(record[3 * L * E + L * S :].reshape(L, 3)[:, 2].sum())
        copied, self.seen_copy_ns = copy_ns - self.seen_copy_ns, copy_ns
        return taken[0], taken[1], taken[2], record[3 * L * E : 3 * L * E + L * S].reshape(L, S), copied

    def _absorb(self, taken: Routing) -> np.ndarray:
        """Statistics and policy from ``_take_routing``'s result (and the slots' new occupants, with admission on
        the device); returns the pairs routed [L, E]."""
        routed, steps, host_passes, occupant, copy_ns = taken
        self._record(routed, steps, host_passes if self.device_admission else None)
        self.stats.copy_in_step_s += copy_ns / 1e9
        if self.device_admission:
            self._take_occupants(occupant)
        return routed

    def _record(self, routed: np.ndarray, steps: np.ndarray, host_passes: np.ndarray | None = None) -> None:
        """Hits, misses and bytes read from host of the forward passes counted in ``steps`` [L, E]: an expert routed
        in n passes is n lookups, and n misses when it is not resident (each pass reads it from host memory), or
        ``host_passes`` [L, E] misses where the device counted them (it admits experts within a step). The policy
        sees the pairs ``routed`` [L, E]."""
        st = self.stats
        # [L, E] passes in which the kernels read the expert from host memory
        missed = np.where(self.slots.ready, 0, steps) if host_passes is None else host_passes
        misses = int(missed.sum())
        st.lookups += int(steps.sum())
        st.hits += int(steps.sum()) - misses
        st.misses += misses
        st.misses_host += misses
        nbytes = int((missed.sum(axis=1) * np.asarray(self.expert_bytes, dtype=np.int64)).sum())
        st.bytes_read_host += nbytes
        st.bytes_copied += nbytes
        self.policy.touch_all(routed)

    def _take_occupants(self, occupant: np.ndarray) -> None:
        """The slots' occupants [L, S] as the device left them (admission on the device): the host view and the
        policy follow; an expert that moved counts as evicted from one slot and admitted into another."""
        layers, gone, new = self.slots.follow(occupant)
        evicted = gone >= 0
        for layer, e in zip(layers[evicted].tolist(), gone[evicted].tolist()):
            self.policy.evicted(layer, e)
        for layer, e in zip(layers.tolist(), new.tolist()):
            self.policy.inserted(layer, e)
        self.stats.evictions += int(evicted.sum())
        self.stats.admissions_on_device += len(layers)

    def _choose_spares(self) -> None:
        """The next step's spare slots (the policy's least valued first), written to the device when they changed."""
        spares = self.slots.ranked_slots(self.policy.values(), self.policy.last_use, self.spares_host.shape[1])
        if not np.array_equal(spares, self.spares_host):
            self.spares_host = spares
            self.spares.copy_(to_device(spares, self.device))

    def _settle(self) -> tuple[np.ndarray, np.ndarray]:
        """(layers, experts) of the admissions whose copies completed: resident from now on."""
        done = []
        while self.pending:
            event, plan = self.pending[0]
            if event is not None and not event.query():
                break  # copies complete in the order they were issued (one stream)
            self.pending.pop(0)
            self.slots.settle(plan.layers, plan.experts)
            done.append(plan)
        layers = np.concatenate([p.layers for p in done]) if done else np.zeros(0, dtype=np.int64)
        experts = np.concatenate([p.experts for p in done]) if done else np.zeros(0, dtype=np.int64)
        return layers, experts

    def _plan(self, routed: np.ndarray) -> Plan:
        """The admissions of this boundary: missed experts the policy values above its victims, within the budget.

        The default budget: a quarter of what the kernels read from host memory (under routing that rarely comes
        back to an expert, most admissions would not be repaid), at least one expert, plus every expert without a
        slot that was read from host memory at two boundaries in a row (it is coming back). Without that second
        part, a steady trickle of c new experts a step leaves about 4c missing at every step."""
        budget = self.config.admit_bytes_per_step
        nbytes = np.asarray(self.expert_bytes, dtype=np.int64)
        missed = (routed > 0) & ~self.slots.ready  # [L, E]
        if budget is None:
            again = missed & self.missed_before & (self.slots.slot_of < 0)  # [L, E]
            read = int((missed.sum(axis=1) * nbytes).sum())
            budget = max(read // 4, int(nbytes.max())) + int((again.sum(axis=1) * nbytes).sum())
        self.missed_before = missed
        return self.slots.plan(routed, self.policy.values(), self.policy.last_use, nbytes, budget)

    def _admit(self, plan: Plan) -> None:
        self.slots.admit(plan)
        for layer, e, victim in zip(plan.layers.tolist(), plan.experts.tolist(), plan.victims.tolist()):
            if victim >= 0:
                self.policy.evicted(layer, victim)
            self.policy.inserted(layer, e)
        self.stats.evictions += int((plan.victims >= 0).sum())

    def _write_tables(self, layers: np.ndarray, experts: np.ndarray) -> None:
        """Points the table entries of these experts at their slots (ready) or their host copies, in the compute
        stream's order."""
        if len(layers) == 0:
            return
        ready = self.slots.ready[layers, experts]  # [n]
        slot = np.maximum(self.slots.slot_of[layers, experts], 0)
        L, P, E, W = self.table.shape
        host = self.host_addr[layers, :, experts]  # [n, P, W]
        at = self.slot_addr[layers, :, slot] if self.slots_per_layer else host
        values = np.where(ready[:, None, None], at, host)  # [n, P, W]
        flat = ((layers[:, None, None] * P + np.arange(P)[None, :, None]) * E + experts[:, None, None]) * W \
            + np.arange(W)[None, None, :]  # [n, P, W] indices into the flattened table
        m = flat.size
        # one transfer: (table index, address) pairs, then (is_host index, flag) pairs
        packed = to_device(np.stack([np.concatenate([flat.reshape(-1), layers * E + experts]),
                                     np.concatenate([values.reshape(-1), (~ready).astype(np.int64)])]),
                           self.device)  # [2, n P W + n]
        self.table.view(-1).index_copy_(0, packed[0, :m], packed[1, :m])
        self.is_host.view(-1).index_copy_(0, packed[0, m:], packed[1, m:].to(torch.int32))

    def _copy_views(self, layer: int, expert: int, slot: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(slot arrays, the expert's host arrays) that admitting ``expert`` into ``slot`` copies."""
        if self.packed:
            return self.pool.packed_copy(layer, slot, expert)
        return self.pool.slot_views(layer, slot), self.store.expert_parts(layer, expert)

    def _copy(self, plan: Plan) -> None:
        """Copies the admitted experts into their slots on the copy stream, after everything queued so far."""
        self.copier.after_compute()
        for layer, e, slot in zip(plan.layers.tolist(), plan.experts.tolist(), plan.slots.tolist()):
            self.copier.copy_expert(*self._copy_views(layer, e, slot))
        self.pending.append((self.copier.record(), plan))
        nbytes = int(sum(self.expert_bytes[layer] for layer in plan.layers.tolist()))
        self.stats.copies += len(plan)
        self.stats.admissions += len(plan)
        self.stats.bytes_admitted += nbytes
        self.stats.bytes_copied += nbytes

    # ---- statistics ----
    def stats_dict(self) -> dict:
        """Counters and rates (stats.py) of the steps so far (waits for the last one) and the configuration."""
        taken = self._take_routing(wait=True) if self.started else None
        if taken is not None:
            routed = self._absorb(taken)
            self.carried = routed if self.carried is None else self.carried + routed
        d = self.stats.as_dict()
        d.update(self.config_stats(), prefetch=False, prefetch_accuracy=None, cpu_compute="off", overlap=self.overlap,
                 admit_bytes_per_step=self.config.admit_bytes_per_step, admit_on_device=self.device_admission,
                 admit_hold_passes=self.hold_passes if self.device_admission else 0, copy_timed=self.copy_timed,
                 copies_in_flight=sum(len(plan) for _, plan in self.pending),
                 staging_rows=0 if self.staging is None else int(self.staging.shape[0]))
        return d

    def reset_stats(self) -> None:
        """Zeroes the counters; routing recorded so far is not counted."""
        if self.started:
            taken = self._take_routing(wait=True)
            if taken is not None and self.device_admission:
                self._take_occupants(taken[3])
        self.carried = None
        self.stats.reset()

    # ---- invariants (tests) ----
    def check(self) -> None:
        """Raises AssertionError if the tables, the slot bookkeeping and the copies in flight disagree."""
        self.slots.check()
        loading = np.zeros_like(self.slots.loading)
        for _, plan in self.pending:
            loading[plan.layers, plan.experts] = True
        assert (loading == self.slots.loading).all(), "the experts loading are not those with copies in flight"
        ready, slot = self.slots.ready, np.maximum(self.slots.slot_of, 0)  # [L, E]
        host = self.host_addr  # [L, P, E, W]
        if self.slots_per_layer:
            at_slot = np.take_along_axis(self.slot_addr, slot[:, None, :, None], axis=2)  # [L, P, E, W]
        else:
            at_slot = host
        expected = np.where(ready[:, None, :, None], at_slot, host)
        assert (self.table.cpu().numpy() == expected).all(), \
            "a table entry points at neither its slot nor its host copy"
        assert (self.is_host.cpu().numpy() == ~ready).all(), "the device residency flags disagree with the slots"
        if self.device_admission:
            assert (self.occupant.cpu().numpy() == self.slots.expert_in).all(), "the device occupants disagree"
