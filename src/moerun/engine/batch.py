"""The metadata of one forward pass over a batch of sequences (what attention and the KV cache need)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ForwardBatch:
    """Tokens of B sequences flattened to T rows.

    Prefill: each sequence contributes ``query_lens[i]`` tokens starting at position ``start_positions[i]``.
    Decode: each sequence contributes one token (T == B).
    """

    is_prefill: bool
    positions: torch.Tensor  # [T] int64, position of each token in its sequence
    slot_ids: torch.Tensor  # [B] int64, KV-cache slot of each sequence
    slots: list[int]  # host copy of slot_ids
    seq_lens: torch.Tensor  # [B] int32/int64, tokens in the cache for each sequence after this step
    query_lens: list[int]  # host copy: tokens of each sequence in this step
    start_positions: list[int]  # host copy: first position of each sequence's tokens in this step
    max_seq_len: int  # host copy: max(seq_lens)

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    def last_token_rows(self) -> torch.Tensor:
        """Row index [B] of each sequence's last token in the flattened batch (where logits are taken)."""
        ends = torch.tensor(self.query_lens, dtype=torch.int64).cumsum(0) - 1
        return ends.to(self.positions.device)

    @classmethod
    def build(
        cls, start_positions: list[int], query_lens: list[int], slots: list[int], device: torch.device
    ) -> "ForwardBatch":
        """Builds the batch for sequences whose new tokens start at start_positions (prefill or decode)."""
        is_prefill = any(n != 1 for n in query_lens) or any(p == 0 for p in start_positions)
        positions = torch.cat([torch.arange(p, p + n, dtype=torch.int64) for p, n in zip(start_positions, query_lens)])
        seq_lens = [p + n for p, n in zip(start_positions, query_lens)]
        return cls(
            is_prefill=is_prefill,
            positions=positions.to(device),
            slot_ids=torch.tensor(slots, dtype=torch.int64, device=device),
            slots=list(slots),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int64, device=device),
            query_lens=list(query_lens),
            start_positions=list(start_positions),
            max_seq_len=max(seq_lens),
        )
