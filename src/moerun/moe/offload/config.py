"""OffloadConfig: how experts are cached, prefetched and (optionally) computed on the CPU when offloaded."""

from __future__ import annotations

from dataclasses import dataclass

POLICIES = ("lru", "lfu", "activation")
CPU_COMPUTE = ("off", "auto", "always")
PIN_MODES = ("all", "staged", "auto")


@dataclass(frozen=True)
class OffloadConfig:
    """Options of expert offloading; the cache size itself comes from the placement (planner.py).

    policy: eviction policy, 'lru', 'lfu' or 'activation' (routing statistics across requests).
    prefetch: copy the next layers' likely experts, predicted by applying their routers to the current hidden state.
    prefetch_depth: how many following MoE layers to prefetch for.
    prefetch_per_layer: at most this many experts per target layer and step (None: the model's top-k).
    prefetch_min_confidence: skip candidates whose mean router probability over the batch is below this.
    cpu_compute: 'off'; 'auto' computes a missed expert on the CPU when the cost model says it beats the copy;
        'always' computes every missed expert on the CPU (llama.cpp's --n-cpu-moe, Fiddler).
    overlap: compute the resident experts of a layer while its missed ones are being copied (None: on CUDA only).
    pin: host memory of the experts: 'all' pinned (fastest copies), 'staged' through a ring of pinned buffers
        (for models larger than what may be pinned), 'auto' pins all unless they exceed half the host's memory.
    staging_buffers: size of the staging ring, in experts.
    pcie_gbps / cpu_expert_ms / cpu_token_ms: cost-model rates; None measures them when cpu_compute != 'off'.
    force: offload even when the whole model fits in the budget.
    """

    policy: str = "lru"
    prefetch: bool = True
    prefetch_depth: int = 1
    prefetch_per_layer: int | None = None
    prefetch_min_confidence: float = 0.0
    cpu_compute: str = "off"
    overlap: bool | None = None
    pin: str = "auto"
    staging_buffers: int = 16
    pcie_gbps: float | None = None
    cpu_expert_ms: float | None = None
    cpu_token_ms: float | None = None
    force: bool = False

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"offload policy must be one of {POLICIES}, got {self.policy!r}")
        if self.cpu_compute not in CPU_COMPUTE:
            raise ValueError(f"cpu_compute must be one of {CPU_COMPUTE}, got {self.cpu_compute!r}")
        if self.pin not in PIN_MODES:
            raise ValueError(f"pin must be one of {PIN_MODES}, got {self.pin!r}")
        if self.prefetch_depth < 1:
            raise ValueError(f"prefetch_depth must be >= 1, got {self.prefetch_depth}")
        if self.prefetch_per_layer is not None and self.prefetch_per_layer < 0:
            raise ValueError(f"prefetch_per_layer must be >= 0, got {self.prefetch_per_layer}")
        if self.staging_buffers < 2:
            raise ValueError(f"staging_buffers must be >= 2, got {self.staging_buffers}")
        for name in ("pcie_gbps", "cpu_expert_ms", "cpu_token_ms"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be positive, got {value}")
