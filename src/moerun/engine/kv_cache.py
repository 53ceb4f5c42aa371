"""The KV cache: one preallocated region per sequence slot.

Layout per layer: k, v [S, L, n_kv, D] (S slots, L max tokens per sequence). The cache is written by
``ops.qk_norm_rope_write`` at (token slot, position) and read by ``gather`` (prefill) and
``ops.decode_attention`` (slot ids, lengths): the places a paged layout (a block table per slot) would change.
"""

from __future__ import annotations

import torch


class KVCache:
    """Preallocated keys and values for ``num_slots`` sequences of up to ``max_len`` tokens each."""

    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        max_len: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        # one extra slot, never handed out, takes the writes of padding rows in a graphed decode batch
        shape = (num_layers, num_slots + 1, max_len, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.num_slots, self.max_len = num_slots, max_len
        self.pad_slot = num_slots
        self._free = list(range(num_slots - 1, -1, -1))

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    # ---- slot bookkeeping ----
    def allocate(self) -> int:
        if not self._free:
            raise RuntimeError("no free KV-cache slot")
        return self._free.pop()

    def release(self, slot: int) -> None:
        if slot in self._free or not 0 <= slot < self.num_slots:
            raise RuntimeError(f"KV-cache slot {slot} released twice or out of range")
        self._free.append(slot)

    @property
    def num_free(self) -> int:
        return len(self._free)

    # ---- data ----
    def gather(self, layer: int, slot_ids: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values [B, length, n_kv, D] of the given slots (positions past a sequence's end are stale)."""
        return self.k[layer, slot_ids, :length], self.v[layer, slot_ids, :length]
