"""Decode with experts offloaded in copy mode: one CUDA graph per decoder layer and batch bucket.

The copy-mode manager (moe/offload/manager.py) reads each MoE layer's routing on the host to copy the experts it
misses, so a whole decode step cannot be one graph; run eagerly, a step pays the host's launch cost for every
kernel (hundreds per step), which is far more than the GPU time. Here each decoder layer is two graphs, captured
with the manager in capture mode, where a layer's experts run only their device part: the first graph ends once
the routing ids (and the router lookahead) are on their way to pinned host buffers, the second runs the pass over
the experts already cached (slot ids from the device table) and writes the next layer's input. While the second
replays, the host reads the routing, copies the misses, computes them and, if there were any, overwrites the next
layer's input with the sum (``ExpertOffload.finish_replayed``).

    layer i, graph a:  (embed ->) attention, router, routing -> host      host: hits / misses of MoE layer i,
    layer i, graph b:  cached experts -> x_{i+1}                          copies, miss pass, x_{i+1} = sum
    final graph:       norm -> lm_head -> logits

Padding rows of a bucket route like any token, but the host serves only the batch's real rows (their misses
and their statistics); a padding row's missed experts contribute nothing to its (discarded) output.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from moerun.engine.batch import ForwardBatch
from moerun.engine.kv_cache import KVCache
from moerun.engine.static_inputs import StaticInputs

if TYPE_CHECKING:
    from moerun.moe.offload.manager import ExpertOffload


class _BucketGraphs:
    """The graphs of one bucket and the static tensors that connect them."""

    def __init__(self) -> None:
        # per decoder layer: [one graph], or [routing graph, cached-experts graph] around the host's routing read
        self.layers: list[list[torch.cuda.CUDAGraph]] = []
        self.moe_layer: list[int | None] = []  # manager layer begun inside each decoder layer's graphs
        self.inputs: list[torch.Tensor] = []  # [b, H] x fed to each decoder layer's graph (from graph 1 on)
        self.final: torch.cuda.CUDAGraph | None = None


class LayerGraphs:
    """Captures and replays the per-layer decode graphs of every bucket."""

    def __init__(self, model: nn.Module, cache: KVCache, manager: "ExpertOffload", buckets: list[int]) -> None:
        self.model, self.cache, self.manager, self.buckets = model, cache, manager, buckets
        self.inputs = StaticInputs(buckets[-1], cache)
        self.logits = torch.zeros(buckets[-1], model.config.vocab_size, dtype=torch.float32, device=cache.k.device)
        self.graphs: dict[int, _BucketGraphs] = {}
        self.replays = 0  # decode steps served through the graphs

    @torch.inference_mode()
    def capture(self) -> None:
        """Warms each bucket up eagerly, then captures its graphs (largest bucket first, one memory pool)."""
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        for b in reversed(self.buckets):
            batch = self.inputs.batch(b)
            ids = self.inputs.input_ids[:b]
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):  # warm up: autotuning and lazy initialisation happen outside the graphs
                    self.model.compute_logits(self.model(ids, batch, self.cache))
            torch.cuda.current_stream().wait_stream(stream)
            torch.cuda.synchronize()
            with torch.cuda.stream(stream):
                self.graphs[b] = self._capture_bucket(b, ids, batch, pool)
            torch.cuda.synchronize()

    def _capture_bucket(self, b: int, ids: torch.Tensor, batch: ForwardBatch, pool: tuple) -> _BucketGraphs:
        inner = self.model.model
        g = _BucketGraphs()
        x, residual = None, None
        with self.manager.capturing(b):
            for i, layer in enumerate(inner.layers):
                graphs = [_begin_capture(pool)]

                def split() -> None:  # the manager calls it once the routing is on its way to the host
                    graphs[-1].capture_end()
                    graphs.append(_begin_capture(pool))

                begun = len(self.manager.captured)
                self.manager.split_capture = split
                h = inner.embed_tokens(ids) if i == 0 else x  # [b, H]
                out, residual = layer(h, residual, batch, self.cache)
                nxt = torch.empty_like(h)  # the next layer's input: this output, to which the host adds misses
                nxt.copy_(out)
                graphs[-1].capture_end()
                self.manager.split_capture = None
                g.layers.append(graphs)  # a MoE layer adds its (bucket, layer) key, the newest of the dict
                g.moe_layer.append(next(reversed(self.manager.captured))[1] if len(self.manager.captured) > begun
                                   else None)
                x = nxt
                g.inputs.append(x)
            final = _begin_capture(pool)
            h, _ = inner.norm.forward_with_residual(x, residual)
            self.logits[:b].copy_(self.model.compute_logits(h))
            final.capture_end()
            g.final = final
        return g

    def run(self, input_ids: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """One decode step of B <= the largest bucket sequences -> float32 logits [B, V]."""
        B = batch.num_seqs
        bucket = next(b for b in self.buckets if b >= B)
        g = self.graphs[bucket]
        manager = self.manager
        self.inputs.fill(input_ids, batch, bucket)
        for graphs, moe_layer, nxt in zip(g.layers, g.moe_layer, g.inputs):
            if moe_layer is None:
                graphs[0].replay()
                continue
            manager.before_replay(moe_layer)
            graphs[0].replay()  # up to the routing's copy to the host
            manager.routing_replayed(bucket, moe_layer)
            for graph in graphs[1:]:
                graph.replay()  # the cached experts compute while the host reads the routing
            out = manager.finish_replayed(bucket, moe_layer, B)
            if out is not None:  # misses were added: the sum replaces the cached experts' output
                nxt.copy_(out)
        g.final.replay()
        self.replays += 1
        return self.logits[:B]


def _begin_capture(pool: tuple) -> torch.cuda.CUDAGraph:
    """A graph capturing the current stream from now on (relaxed: the routing's pinned host buffers are
    allocated while capturing)."""
    graph = torch.cuda.CUDAGraph()
    graph.capture_begin(pool=pool, capture_error_mode="relaxed")
    return graph
