"""Static input buffers of graphed decode steps: a batch of B sequences is copied into the first B rows of a
bucket; padding rows point at the KV cache's scratch slot, position 0, so that they never touch a real sequence."""

from __future__ import annotations

import torch

from moerun.engine.batch import ForwardBatch
from moerun.engine.kv_cache import KVCache


class StaticInputs:
    """input_ids, positions, token_slots, slot_ids, seq_lens [n] on the device, and the decode batch over their
    first rows. The last four are the rows of one [4, n] tensor laid out as ForwardBatch.build packs a decode
    batch, so that a step's metadata arrives in one copy."""

    def __init__(self, n: int, cache: KVCache) -> None:
        dev = cache.k.device
        self.cache = cache
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=dev)
        self.meta = torch.zeros(4, n, dtype=torch.int64, device=dev)  # [4, n]
        self.meta[1:3] = cache.pad_slot
        self.meta[3] = 1
        self.positions, self.token_slots, self.slot_ids, self.seq_lens = self.meta.unbind(0)

    def fill(self, input_ids: torch.Tensor, batch: ForwardBatch, bucket: int) -> None:
        """Rows [0, B) from the batch, rows [B, bucket) padding."""
        B = batch.num_seqs
        self.input_ids[:B].copy_(input_ids)
        packed = batch.packed
        if packed is not None and packed.numel() == 5 * B:  # decode: positions, token_slots, slot_ids, seq_lens
            self.meta[:, :B].copy_(packed[: 4 * B].view(4, B))
        else:
            for row, values in zip(self.meta, (batch.positions, batch.token_slots, batch.slot_ids, batch.seq_lens)):
                row[:B].copy_(values)
        if bucket > B:  # padding rows write to the scratch slot at position 0 and attend to that one position
            self.input_ids[B:bucket].zero_()
            self.positions[B:bucket].zero_()
            self.meta[1:3, B:bucket].fill_(self.cache.pad_slot)
            self.seq_lens[B:bucket].fill_(1)

    def batch(self, b: int) -> ForwardBatch:
        """The decode batch of the first b rows."""
        return ForwardBatch(
            is_prefill=False,
            positions=self.positions[:b],
            token_slots=self.token_slots[:b],
            slot_ids=self.slot_ids[:b],
            seq_lens=self.seq_lens[:b],
            last_rows=torch.arange(b, device=self.input_ids.device),
            slots=[self.cache.pad_slot] * b,
            query_lens=[1] * b,
            start_positions=[0] * b,
            max_seq_len=self.cache.max_len,
        )
