"""Runs the model's forward passes: decode through CUDA graphs captured per batch bucket; prefill of a single
new prompt through graphs per token bucket (engine/prefill_graphs.py), other prefills eagerly.

A decode graph is captured for each bucket size (1, 2, 4, ... up to max_num_seqs) with static input buffers;
a batch of B sequences replays the smallest bucket >= B, padding rows pointing at the KV cache's scratch slot
so that they never touch a real sequence. Nothing in the graphed step reads device memory on the host.
"""

from __future__ import annotations

import torch
from torch import nn

from moerun.engine.batch import ForwardBatch
from moerun.engine.kv_cache import KVCache
from moerun.engine.prefill_graphs import PrefillGraphs

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class ModelRunner:
    """Owns the forward passes of one model over one KV cache."""

    def __init__(self, model: nn.Module, cache: KVCache, max_batch: int, use_graphs: bool) -> None:
        self.model, self.cache = model, cache
        self.device = cache.k.device
        self.use_graphs = use_graphs and self.device.type == "cuda"
        self.buckets = [b for b in BUCKETS if b < max_batch] + [max_batch]
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._static: dict[str, torch.Tensor] = {}
        self.prefill_graphs: PrefillGraphs | None = None

    def _between_steps(self, tokens: int) -> None:
        # expert offloading that updates its cache between forward passes, outside any graph (moe/offload)
        hook = getattr(self.model.__dict__.get("expert_offload"), "between_steps", None)
        if hook is not None:
            hook(tokens)

    def prefill(self, input_ids: torch.Tensor, batch: ForwardBatch, rows: torch.Tensor) -> torch.Tensor:
        """Runs the batch's tokens; returns float32 logits [len(rows), V] of the given rows."""
        self._between_steps(input_ids.numel())
        if self.prefill_graphs is not None and len(rows) == 1 and self.prefill_graphs.fits(batch):
            return self.prefill_graphs.run(input_ids, batch)
        hidden = self.model(input_ids, batch, self.cache)  # [T, H]
        return self.model.compute_logits(hidden[rows]).float()

    def decode(self, input_ids: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """One token per sequence -> float32 logits [B, V], through a graph when one fits."""
        B = batch.num_seqs
        self._between_steps(B)
        if not self.graphs or B > self.buckets[-1]:
            hidden = self.model(input_ids, batch, self.cache)
            return self.model.compute_logits(hidden).float()
        bucket = next(b for b in self.buckets if b >= B)
        s = self._static
        s["input_ids"][:B].copy_(input_ids)
        s["positions"][:B].copy_(batch.positions)
        s["slot_ids"][:B].copy_(batch.slot_ids)
        s["seq_lens"][:B].copy_(batch.seq_lens)
        # padding rows write to the scratch slot at position 0 and attend to that one position
        s["input_ids"][B:bucket].zero_()
        s["positions"][B:bucket].zero_()
        s["slot_ids"][B:bucket].fill_(self.cache.pad_slot)
        s["seq_lens"][B:bucket].fill_(1)
        self.graphs[bucket].replay()
        return s["logits"][:B]

    def _static_batch(self, b: int) -> ForwardBatch:
        s = self._static
        return ForwardBatch(
            is_prefill=False,
            positions=s["positions"][:b],
            token_slots=s["slot_ids"][:b],
            slot_ids=s["slot_ids"][:b],
            seq_lens=s["seq_lens"][:b],
            last_rows=torch.arange(b, device=self.device),
            slots=[self.cache.pad_slot] * b,
            query_lens=[1] * b,
            start_positions=[0] * b,
            max_seq_len=self.cache.max_len,
        )

    @torch.inference_mode()
    def capture(self, max_prefill_tokens: int = 8192) -> None:
        """Captures one decode graph per bucket, largest first, sharing one memory pool."""
        if not self.use_graphs:
            return
        self.prefill_graphs = PrefillGraphs(self.model, self.cache, max_prefill_tokens)
        n = self.buckets[-1]
        V = self.model.config.vocab_size
        dev = self.device
        self._static = {
            "input_ids": torch.zeros(n, dtype=torch.int64, device=dev),
            "positions": torch.zeros(n, dtype=torch.int64, device=dev),
            "slot_ids": torch.full((n,), self.cache.pad_slot, dtype=torch.int64, device=dev),
            "seq_lens": torch.ones(n, dtype=torch.int64, device=dev),
            "logits": torch.zeros(n, V, dtype=torch.float32, device=dev),
        }
        pool = torch.cuda.graph_pool_handle()
        for b in reversed(self.buckets):
            batch = self._static_batch(b)
            ids = self._static["input_ids"][:b]
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
        self._static["logits"][:b].copy_(self.model.compute_logits(hidden))
