"""Counters of the expert cache: lookups, hits, misses, copies, prefetch outcome, stall and CPU time."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any


@dataclass
class OffloadStats:
    """Raw counters; ``as_dict`` adds the derived rates. A lookup is one (layer, expert) routed in one forward.

    bytes_copied counts every byte of experts that crossed to the device: miss and prefetch copies (copy mode),
    host reads by the kernels and admissions (zero-copy mode).
    """

    forward_passes: int = 0
    tokens: int = 0  # tokens through the first MoE layer, summed over forward passes
    lookups: int = 0
    hits: int = 0
    misses: int = 0
    misses_copied: int = 0
    misses_cpu: int = 0  # missed experts computed on the CPU instead of copied
    misses_host: int = 0  # zero-copy mode: missed experts read by the kernels from pinned host memory
    cpu_pairs: int = 0  # (token, expert) pairs computed on the CPU
    copies: int = 0
    bytes_copied: int = 0
    bytes_copied_miss: int = 0
    bytes_copied_prefetch: int = 0
    bytes_read_host: int = 0  # zero-copy mode: bytes of missed experts the kernels read over PCIe (once a pass)
    admissions: int = 0  # zero-copy mode: experts copied into slots between steps
    admissions_on_device: int = 0  # zero-copy mode: missed experts staged straight into slots (no bytes of their own)
    bytes_admitted: int = 0
    evictions: int = 0
    prefetch_issued: int = 0
    prefetch_useful: int = 0  # prefetched experts routed to at their layer's next forward
    prefetch_wasted: int = 0  # prefetched experts not routed to there
    chunked_layers: int = 0  # layers whose experts did not fit the cache at once
    copy_stall_s: float = 0.0  # copy mode: time the compute stream waited for expert copies
    # zero-copy mode: device time of the staging copies inside the steps (by the GPU's clock; CUDA only); the fused
    # MoE waits for them, except GEMM 1 of the pairs already on the device (overlap), which runs beside them
    copy_in_step_s: float = 0.0
    routing_wait_s: float = 0.0  # host time waiting for the routing ids of a layer
    cpu_compute_s: float = 0.0

    def reset(self) -> None:
        for f in fields(self):
            setattr(self, f.name, f.default)

    def as_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {f.name: getattr(self, f.name) for f in fields(self)}
        tokens = max(self.tokens, 1)
        d["hit_rate"] = self.hits / self.lookups if self.lookups else 0.0
        d["prefetch_pending"] = self.prefetch_issued - self.prefetch_useful - self.prefetch_wasted
        resolved = self.prefetch_useful + self.prefetch_wasted
        d["prefetch_accuracy"] = self.prefetch_useful / resolved if resolved else 0.0
        d["bytes_copied_per_token"] = self.bytes_copied / tokens
        d["missed_bytes_per_token"] = (self.bytes_copied_miss + self.bytes_read_host) / tokens
        d["bytes_read_host_per_token"] = self.bytes_read_host / tokens
        d["copy_stall_ms_per_token"] = 1e3 * self.copy_stall_s / tokens
        d["copy_in_step_ms_per_token"] = 1e3 * self.copy_in_step_s / tokens
        d["cpu_compute_ms_per_token"] = 1e3 * self.cpu_compute_s / tokens
        return d


def format_stats(stats: dict[str, Any]) -> str:
    """A few lines for a terminal (the CLI's --verbose)."""
    if not stats.get("offloading"):
        return "expert offloading: off (all experts on the device)"
    gib = 2**30
    mode = " (zero-copy)" if stats.get("mode") == "zero_copy" else ""
    head = (f"expert offloading{mode}: policy {stats['policy']}, {stats['slots_per_layer']} of "
            f"{stats['experts_per_layer']} experts per layer cached ({stats['cache_bytes'] / gib:.2f} GiB)")
    moved = f"({stats['bytes_copied_per_token'] / 2**20:.1f} MiB/token)"
    if stats.get("mode") == "zero_copy":
        return "\n".join([
            head,
            f"  hit rate {stats['hit_rate']:.1%} ({stats['hits']} of {stats['lookups']} lookups), "
            f"misses read from host memory {stats['misses_host']}",
            f"  over PCIe {stats['bytes_copied'] / gib:.2f} GiB {moved}: read by the kernels "
            f"{stats['bytes_read_host'] / gib:.2f} GiB, admitted into slots {stats['bytes_admitted'] / gib:.2f} GiB "
            f"({stats['admissions']} experts), staged into slots {stats['admissions_on_device']} experts",
            *([f"  staging copies {stats['copy_in_step_ms_per_token']:.2f} ms/token (device clock)"]
              if stats.get("copy_timed") else []),
        ])
    return "\n".join([
        f"{head}, prefetch {stats['prefetch']}, cpu compute {stats['cpu_compute']}",
        f"  hit rate {stats['hit_rate']:.1%} ({stats['hits']} of {stats['lookups']} lookups), "
        f"misses copied {stats['misses_copied']}, on CPU {stats['misses_cpu']}",
        f"  copied {stats['bytes_copied'] / gib:.2f} GiB {moved}, "
        f"copy stall {stats['copy_stall_ms_per_token']:.2f} ms/token",
        f"  prefetch: {stats['prefetch_issued']} issued, accuracy {stats['prefetch_accuracy']:.1%}",
    ])
