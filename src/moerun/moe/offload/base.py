"""What both offload managers (copy: manager.py, zero-copy: zero_copy.py) share: the engine hooks and the
configuration half of their statistics."""

from __future__ import annotations

import torch

from moerun.engine.kv_cache import KVCache
from moerun.engine.memory import available_bytes
from moerun.moe.offload.pool import SlotPool


def kv_slots_within(kv_bytes: int | None, device: torch.device, num_layers: int, num_kv_heads: int, head_dim: int,
                    dtype: torch.dtype, max_model_len: int, max_num_seqs: int) -> int:
    """How many sequences the KV cache holds within the placement's KV budget (None: 90% of free memory)."""
    per_seq = KVCache.bytes_per_token(num_layers, num_kv_heads, head_dim, dtype) * max_model_len
    budget = kv_bytes if kv_bytes is not None else int(available_bytes(device) * 0.9)
    slots = min(max_num_seqs, budget // per_seq)
    if slots < 1:
        raise ValueError(
            f"the KV cache for one sequence of max_model_len={max_model_len} tokens needs "
            f"{per_seq / 2**30:.3f} GiB but the offloading placement leaves {budget / 2**30:.3f} GiB for it; "
            "lower max_model_len or raise gpu_memory_gb"
        )
    return int(slots)


class OffloadManagerBase:
    """Engine hooks of a manager that has ``policy``, ``store``, ``device``, ``kv_bytes``, ``config``, ``mode``,
    ``slots_per_layer``, ``num_experts`` and ``num_layers``."""

    graphable = False  # a forward pass is device work only: decode steps are captured whole
    layer_graphable = False  # decode runs as CUDA graphs per layer with host work between (engine/layer_graphs.py)

    def new_request(self) -> None:
        """A request was added: the activation-aware policy starts a new activation matrix."""
        self.policy.new_request()

    def kv_slots(self, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, max_model_len: int,
                 max_num_seqs: int) -> int:
        """How many sequences the KV cache holds within the placement's KV budget (or free memory)."""
        return kv_slots_within(self.kv_bytes, self.device, num_layers, num_kv_heads, head_dim, dtype, max_model_len,
                               max_num_seqs)

    def config_stats(self) -> dict:
        """The cache's configuration, reported beside the counters."""
        S = self.slots_per_layer
        return dict(
            offloading=True, mode=self.mode, policy=self.config.policy, slots_per_layer=S,
            experts_per_layer=self.num_experts, num_moe_layers=self.num_layers,
            cache_bytes=SlotPool.nbytes(self.store.specs, S) if S else 0,
            host_bytes=self.store.total_bytes, pinned=self.store.pinned, expert_bytes=self.store.expert_bytes(0),
        )
