"""CUDA graphs for the prefill of one new prompt, captured per token bucket (128 ... 8192) on first use.

An eager prefill launches a few dozen kernels per layer; below a few thousand tokens the host cannot issue
them as fast as the GPU runs them. A prompt of n tokens replays the smallest bucket >= n: the padding tokens
sit after the prompt, so causal attention hides them from it; their keys land in the sequence's own slot past
its end, where decoding overwrites them before any read. A GGUF model's kernels round x to int8 at a few tokens
(as llama.cpp's do) and not at a bucket's many: a prompt whose kernels would round differently from every bucket
that holds it prefills eagerly, so that graphs never change a result beyond float summation order.
"""

from __future__ import annotations

import torch
from torch import nn

from moerun.engine.batch import ForwardBatch
from moerun.engine.kv_cache import KVCache
from moerun.engine.roundings import RoundingMatch

PREFILL_BUCKETS = (128, 256, 512, 1024, 2048, 4096, 8192)


class PrefillGraphs:
    """Graphed single-sequence prefills from position 0, returning the last prompt token's logits."""

    def __init__(self, model: nn.Module, cache: KVCache, max_tokens: int,
                 rounding: RoundingMatch | None = None) -> None:  # fmt: skip
        self.model, self.cache = model, cache
        self.buckets = [b for b in PREFILL_BUCKETS if b <= min(max_tokens, cache.max_len)]
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.pool = torch.cuda.graph_pool_handle() if self.buckets else None
        self._static: dict[str, torch.Tensor] = {}
        self.rounding = rounding or RoundingMatch(model)  # the runner's, shared with its decode buckets

    def fits(self, batch: ForwardBatch) -> bool:
        return (bool(self.buckets) and batch.num_seqs == 1 and batch.start_positions[0] == 0
                and self.rounding.bucket(batch.query_lens[0], self.buckets) is not None)

    @torch.inference_mode()
    def run(self, input_ids: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """Logits [1, V] float32 of the prompt's last token."""
        n = batch.query_lens[0]
        bucket = self.rounding.bucket(n, self.buckets)
        if bucket is None:
            raise ValueError(f"no prefill graph takes {n} tokens (PrefillGraphs.fits says which do)")
        if not self._static:
            self._allocate()
        s = self._static
        s["input_ids"][:n].copy_(input_ids)
        s["input_ids"][n:bucket].zero_()
        s["token_slots"].copy_(batch.slot_ids[0].expand(s["token_slots"].shape[0]))
        s["slot_ids"].copy_(batch.slot_ids[:1])
        s["last_row"].fill_(n - 1)
        if bucket not in self.graphs:
            self.graphs[bucket] = self._capture(bucket)
        self.graphs[bucket].replay()
        return s["logits"]

    def _allocate(self) -> None:
        dev, T = self.cache.k.device, self.buckets[-1]
        self._static = {
            "input_ids": torch.zeros(T, dtype=torch.int64, device=dev),
            "positions": torch.arange(T, dtype=torch.int64, device=dev),
            "token_slots": torch.zeros(T, dtype=torch.int64, device=dev),
            "slot_ids": torch.zeros(1, dtype=torch.int64, device=dev),
            "seq_lens": torch.zeros(1, dtype=torch.int64, device=dev),
            "last_row": torch.zeros(1, dtype=torch.int64, device=dev),
            "logits": torch.zeros(1, self.model.config.vocab_size, dtype=torch.float32, device=dev),
        }

    def _batch(self, bucket: int) -> ForwardBatch:
        s = self._static
        s["seq_lens"].fill_(bucket)
        return ForwardBatch(
            is_prefill=True,
            positions=s["positions"][:bucket],
            token_slots=s["token_slots"][:bucket],
            slot_ids=s["slot_ids"],
            seq_lens=s["seq_lens"],
            last_rows=s["last_row"],
            slots=[-1],  # host copies are not read on this path
            query_lens=[bucket],
            start_positions=[0],
            max_seq_len=bucket,
        )

    def _forward(self, bucket: int, batch: ForwardBatch) -> None:
        hidden = self.model(self._static["input_ids"][:bucket], batch, self.cache)  # [bucket, H]
        self._static["logits"].copy_(self.model.compute_logits(hidden[self._static["last_row"]]))

    def _capture(self, bucket: int) -> torch.cuda.CUDAGraph:
        batch = self._batch(bucket)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self._forward(bucket, batch)  # compiles the kernels of this size outside the graph
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            self._forward(bucket, batch)
        return graph
