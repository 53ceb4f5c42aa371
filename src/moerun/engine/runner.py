"""Runs the model's forward passes: decode through CUDA graphs captured per batch bucket; prefill of a single
new prompt through graphs per token bucket (engine/prefill_graphs.py), other prefills eagerly.

A decode graph is captured for each bucket size (1, 2, 4, ... up to max_num_seqs) with static input buffers;
a batch of B sequences replays the smallest bucket >= B whose quantized kernels round to int8 as B rows' do
(engine/roundings.py; else it runs eagerly), padding rows pointing at the KV cache's scratch slot so that they
never touch a real sequence. Nothing in the graphed step reads device memory on the host.
Experts offloaded in copy mode read each layer's routing on the host: their decode replays one graph per layer
instead (engine/layer_graphs.py), and prefill runs eagerly.

Each decode graph ends in ops.greedy_pick (unless MOERUN_GRAPH_PICKS=0, read at capture): the float32 logits, each
row's greedy token written into the graph's own input ids, and the rows' positions and lengths advanced by one.
A greedy step that continues every row of the graph's last replay (``can_continue``) then replays it as it is
(``continue_decode``): no metadata copy, no copies into the inputs, no argmax launch. Any other replay's greedy
tokens are there too (``greedy_picks``), so that a greedy step needs no second argmax.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from moerun import ops
from moerun.engine.batch import ForwardBatch
from moerun.engine.kv_cache import KVCache
from moerun.engine.layer_graphs import LayerGraphs
from moerun.engine.prefill_graphs import PrefillGraphs
from moerun.engine.roundings import RoundingMatch
from moerun.engine.static_inputs import StaticInputs

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class ModelRunner:
    """Owns the forward passes of one model over one KV cache."""

    def __init__(self, model: nn.Module, cache: KVCache, max_batch: int, use_graphs: bool) -> None:
        self.model, self.cache = model, cache
        self.device = cache.k.device
        self.use_graphs = use_graphs and self.device.type == "cuda"
        self.buckets = [b for b in BUCKETS if b < max_batch] + [max_batch]
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._inputs: StaticInputs | None = None
        self._logits: torch.Tensor | None = None
        self.prefill_graphs: PrefillGraphs | None = None
        self.layer_graphs: LayerGraphs | None = None
        self.rounding = RoundingMatch(model)
        self.picks_in_graph = False  # the decode graphs end in ops.greedy_pick (set at capture)
        self._continues: int | None = None  # B when the static inputs hold the continuation of B rows just replayed
        self._picked: int | None = None  # B when the last replay wrote B rows' greedy tokens into the static inputs

    def _between_steps(self, tokens: int) -> None:
        # expert offloading that updates its cache between forward passes, outside any graph (moe/offload)
        hook = getattr(self.model.__dict__.get("expert_offload"), "between_steps", None)
        if hook is not None:
            hook(tokens)

    def prefill(self, input_ids: torch.Tensor, batch: ForwardBatch, rows: torch.Tensor) -> torch.Tensor:
        """Runs the batch's tokens; returns float32 logits [len(rows), V] of the given rows."""
        self._continues = self._picked = None
        self._between_steps(input_ids.numel())
        if self.prefill_graphs is not None and len(rows) == 1 and self.prefill_graphs.fits(batch):
            return self.prefill_graphs.run(input_ids, batch)
        hidden = self.model(input_ids, batch, self.cache)  # [T, H]
        return self.model.compute_logits(hidden[rows]).float()

    def decode(self, input_ids: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """One token per sequence -> float32 logits [B, V], through a graph when one fits."""
        B = batch.num_seqs
        self._continues = self._picked = None
        self._between_steps(B)
        if self.layer_graphs is not None and B <= self.buckets[-1]:
            return self.layer_graphs.run(input_ids, batch)
        bucket = self.rounding.bucket(B, self.buckets) if self.graphs else None
        if bucket is None:  # no graphs, too many rows, or no bucket whose kernels round to int8 as B rows' do
            hidden = self.model(input_ids, batch, self.cache)
            return self.model.compute_logits(hidden).float()
        self._inputs.fill(input_ids, batch, bucket)
        self.graphs[bucket].replay()
        if self.picks_in_graph:
            self._picked = B
            if bucket == B:  # no padding rows, whose positions would grow too
                self._continues = B
        return self._logits[:B]

    def greedy_picks(self, B: int) -> torch.Tensor | None:
        """The greedy tokens [B] int64 on the device of the decode just replayed, where its graph picked them
        (ops.greedy_pick: the first largest of each row's float32 logits, as their argmax), else None. A view of the
        graph's inputs that the next replay overwrites (copy it out before)."""
        return self._inputs.input_ids[:B] if self._picked == B else None

    def can_continue(self, B: int) -> bool:
        """Whether the graph of B rows can replay as it is for the next greedy step of the same B sequences in the
        same order: its last replay was the step before and left their next inputs in place (graphs ending in
        ops.greedy_pick)."""
        return self._continues == B

    def continue_decode(self, B: int) -> torch.Tensor:
        """The next greedy step of the B rows just replayed (``can_continue``): their tokens [B] int64 on the device,
        a view of the graph's inputs that the next replay overwrites (copy it out before)."""
        if not self.can_continue(B):
            raise RuntimeError(f"no graph of {B} rows left its next inputs in place")
        self._between_steps(B)
        self.graphs[B].replay()
        self._picked = B
        return self._inputs.input_ids[:B]

    @torch.inference_mode()
    def capture(self, max_prefill_tokens: int = 8192) -> None:
        """Captures one decode graph per bucket, largest first, sharing one memory pool (or, with copy-mode
        expert offloading, the layer graphs)."""
        if not self.use_graphs:
            return
        offload = self.model.__dict__.get("expert_offload")
        if offload is not None and not offload.graphable:
            if offload.layer_graphable:
                self.layer_graphs = LayerGraphs(self.model, self.cache, offload, self.buckets)
                self.layer_graphs.capture()
            return
        self.picks_in_graph = os.environ.get("MOERUN_GRAPH_PICKS", "1") != "0"
        self._continues = None
        self.prefill_graphs = PrefillGraphs(self.model, self.cache, max_prefill_tokens, self.rounding)
        n = self.buckets[-1]
        self._inputs = StaticInputs(n, self.cache)
        self._logits = torch.zeros(n, self.model.config.vocab_size, dtype=torch.float32, device=self.device)
        pool = torch.cuda.graph_pool_handle()
        for b in reversed(self.buckets):
            batch = self._inputs.batch(b)
            ids = self._inputs.input_ids[:b]
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):  # warm up: autotuning and lazy initialisation happen outside the graph
                    self._forward_into_logits(ids, batch, b)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._forward_into_logits(ids, batch, b)
            self.graphs[b] = graph
        torch.cuda.synchronize()

    def _forward_into_logits(self, ids: torch.Tensor, batch: ForwardBatch, b: int) -> None:
        hidden = self.model(ids, batch, self.cache)
        logits = self.model.compute_logits(hidden)  # [b, V]
        if self.picks_in_graph:  # the greedy tokens become the next inputs; positions and lengths move on
            inputs = self._inputs
            ops.greedy_pick(logits, self._logits[:b], inputs.input_ids[:b], inputs.positions[:b], inputs.seq_lens[:b],
                            self.cache.max_len)  # fmt: skip
        else:
            self._logits[:b].copy_(logits)
