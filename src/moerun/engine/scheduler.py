"""Decides what each engine step runs: prefill chunks of waiting sequences first, else one decode step."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from moerun.engine.kv_cache import KVCache
from moerun.engine.sequence import Sequence, Status


@dataclass
class StepPlan:
    """One forward pass: the sequences in it and how many of their tokens each contributes."""

    seqs: list[Sequence]
    num_new_tokens: list[int]
    is_prefill: bool


class Scheduler:
    """Continuous batching over a fixed number of KV-cache slots, with chunked prefill."""

    def __init__(self, cache: KVCache, max_num_batched_tokens: int) -> None:
        self.cache = cache
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def plan(self) -> StepPlan | None:
        """Prefill (chunks of) prompts while slots and the token budget allow; otherwise decode all running."""
        seqs, counts, budget = [], [], self.max_num_batched_tokens
        for seq in self.running:  # prompts already started continue first
            remaining = len(seq.prompt_ids) - seq.num_computed
            if remaining > 0 and budget > 0:
                n = min(remaining, budget)
                seqs.append(seq), counts.append(n)
                budget -= n
        while self.waiting and budget > 0 and self.cache.num_free > 0:
            seq = self.waiting.popleft()
            seq.slot = self.cache.allocate()
            seq.status = Status.RUNNING
            self.running.append(seq)
            n = min(len(seq.prompt_ids), budget)
            seqs.append(seq), counts.append(n)
            budget -= n
        if seqs:
            return StepPlan(seqs, counts, is_prefill=True)
        decoding = [s for s in self.running if s.num_computed >= len(s.prompt_ids)]
        if not decoding:
            return None
        return StepPlan(decoding, [1] * len(decoding), is_prefill=False)

    def finish(self, seq: Sequence) -> None:
        """Frees a finished (or aborted) sequence's slot."""
        if seq in self.running:
            self.running.remove(seq)
        if seq in self.waiting:
            self.waiting.remove(seq)
        if seq.slot is not None:
            self.cache.release(seq.slot)
            seq.slot = None
        seq.status = Status.FINISHED
