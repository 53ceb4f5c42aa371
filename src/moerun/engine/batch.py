"""The metadata of one forward pass over a batch of sequences (what attention and the KV cache need)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moerun.device import to_device


@dataclass
class ForwardBatch:
    """Tokens of B sequences flattened to T rows.

    Prefill: sequence i contributes ``query_lens[i]`` tokens starting at position ``start_positions[i]``.
    Decode: each sequence contributes one token (T == B). Device tensors are what kernels read; the host
    lists are for the eager prefill path only, so a graphed decode step never reads them.
    """

    is_prefill: bool
    positions: torch.Tensor  # [T] int64, position of each token in its sequence
    token_slots: torch.Tensor  # [T] int64, KV-cache slot of each token's sequence
    slot_ids: torch.Tensor  # [B] int64, KV-cache slot of each sequence
    seq_lens: torch.Tensor  # [B] int64, tokens in the cache for each sequence after this step
    last_rows: torch.Tensor  # [B] int64, row of each sequence's last token in the flattened batch
    slots: list[int]  # host copies
    query_lens: list[int]
    start_positions: list[int]
    max_seq_len: int
    # build()'s one device tensor [positions | token_slots | slot_ids | seq_lens | last_rows] that the fields above
    # view (None where they were made otherwise): a decode step's inputs copied in one launch (StaticInputs.fill)
    packed: torch.Tensor | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @classmethod
    def build(
        cls, start_positions: list[int], query_lens: list[int], slots: list[int], device: torch.device
    ) -> "ForwardBatch":
        """Builds the batch for sequences whose new tokens start at start_positions (prefill or decode)."""
        is_prefill = any(n != 1 for n in query_lens) or any(p == 0 for p in start_positions)
        positions, token_slots = [], []
        for p, n, s in zip(start_positions, query_lens, slots):
            positions.extend(range(p, p + n))
            token_slots.extend([s] * n)
        seq_lens = [p + n for p, n in zip(start_positions, query_lens)]
        last_rows, row = [], -1
        for n in query_lens:
            row += n
            last_rows.append(row)
        T, B = len(positions), len(slots)
        # one host-to-device copy for all the metadata
        dev = to_device(positions + token_slots + list(slots) + seq_lens + last_rows, device, torch.int64)
        return cls(
            is_prefill=is_prefill,
            positions=dev[:T],
            token_slots=dev[T : 2 * T],
            slot_ids=dev[2 * T : 2 * T + B],
            seq_lens=dev[2 * T + B : 2 * T + 2 * B],
            last_rows=dev[2 * T + 2 * B :],
            slots=list(slots),
            query_lens=list(query_lens),
            start_positions=list(start_positions),
            max_seq_len=max(seq_lens),
            packed=dev,
        )

