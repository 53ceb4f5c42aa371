"""Static input buffers of graphed decode steps: a batch of B sequences is copied into the first B rows of a
bucket; padding rows point at the KV cache's scratch slot, position 0, so that they never touch a real sequence."""

from __future__ import annotations

import torch

from moerun.engine.batch import ForwardBatch
from moerun.engine.kv_cache import KVCache


class StaticInputs:
    """input_ids, positions, slot_ids, seq_lens [n] on the device, and the decode batch over their first rows."""

    def __init__(self, n: int, cache: KVCache) -> None:
        dev = cache.k.device
        self.cache = cache
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(n, dtype=torch.int64, device=dev)
        self.slot_ids = torch.full((n,), cache.pad_slot, dtype=torch.int64, device=dev)
        self.seq_lens = torch.ones(n, dtype=torch.int64, device=dev)

    def fill(self, input_ids: torch.Tensor, batch: ForwardBatch, bucket: int) -> None:
        """Rows [0, B) from the batch, rows [B, bucket) padding."""
        B = batch.num_seqs
        self.input_ids[:B].copy_(input_ids)
        self.positions[:B].copy_(batch.positions)
        self.slot_ids[:B].copy_(batch.slot_ids)
        self.seq_lens[:B].copy_(batch.seq_lens)
        # padding rows write to the scratch slot at position 0 and attend to that one position
        self.input_ids[B:bucket].zero_()
        self.positions[B:bucket].zero_()
        self.slot_ids[B:bucket].fill_(self.cache.pad_slot)
        self.seq_lens[B:bucket].fill_(1)

    def batch(self, b: int) -> ForwardBatch:
        """The decode batch of the first b rows."""
        return ForwardBatch(
            is_prefill=False,
            positions=self.positions[:b],
            token_slots=self.slot_ids[:b],
            slot_ids=self.slot_ids[:b],
            seq_lens=self.seq_lens[:b],
            last_rows=torch.arange(b, device=self.input_ids.device),
            slots=[self.cache.pad_slot] * b,
            query_lens=[1] * b,
            start_positions=[0] * b,
            max_seq_len=self.cache.max_len,
        )
