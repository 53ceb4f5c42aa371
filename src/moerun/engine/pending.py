"""Tokens of a launched decode step that the host has not read yet (async scheduling, engine/engine.py).

With async scheduling the engine launches decode step N+1 before it reads step N's tokens: step N+1 takes its input
ids from step N's device-side picks (``next_input_ids``), and the host reads step N's tokens (``PendingTokens.read``)
while the GPU runs step N+1, so the host's per-step work (scheduling, batch metadata, detokenising, stop checks)
no longer leaves the GPU idle between steps.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moerun.device import to_device
from moerun.engine.sequence import Sequence


@dataclass
class PendingTokens:
    """One launched decode step: its sequences and their picks, on the device and on their way to the host."""

    seqs: list[Sequence]
    device_ids: torch.Tensor  # [B] int64 on the device: the picks, read by the next launch
    host_ids: torch.Tensor  # [B] int64 (pinned on CUDA): the same, copied without blocking the host
    done: torch.cuda.Event | None  # fires when host_ids holds the picks (None on CPU: already there)

    @classmethod
    def launch(cls, seqs: list[Sequence], picks: torch.Tensor, host_buffer: torch.Tensor) -> "PendingTokens":
        """The step's picks [B] int64 on the device, copied into host_buffer [>= B] without waiting for them."""
        host = host_buffer[: len(seqs)]
        host.copy_(picks, non_blocking=host.is_pinned())
        done = None
        if picks.device.type == "cuda":
            done = torch.cuda.Event()
            done.record()
        return cls(seqs, picks, host, done)

    def read(self) -> list[int]:
        """The picks as host ints (waits for this step only)."""
        if self.done is not None:
            self.done.synchronize()
        return self.host_ids.tolist()

    def rows(self) -> dict[int, int]:
        """Row of each of the step's sequences (by id()) in ``device_ids``."""
        return {id(seq): row for row, seq in enumerate(self.seqs)}


def next_input_ids(host_ids: list[int], source_rows: list[int], pending: PendingTokens | None,
                   device: torch.device) -> torch.Tensor:
    """Input ids [B] int64 on device of the next decode launch: row i is pending.device_ids[source_rows[i]] where
    source_rows[i] >= 0 (a token the host has not read yet), else host_ids[i]. One host-to-device copy; none when
    every row is the pending step's row of the same index (the steady state: the picks themselves)."""
    if pending is None or all(r < 0 for r in source_rows):
        return to_device(host_ids, device, torch.int64)
    if source_rows == list(range(pending.device_ids.shape[0])):
        return pending.device_ids
    meta = to_device([host_ids, source_rows], device, torch.int64)  # [2, B]
    known, rows = meta[0], meta[1]
    from_device = pending.device_ids.index_select(0, rows.clamp(min=0))  # [B]
    return torch.where(rows >= 0, from_device, known)

