"""OffloadConfig: how experts are cached, prefetched and (optionally) computed on the CPU when offloaded."""

from __future__ import annotations

from dataclasses import dataclass

import torch

MODES = ("auto", "copy", "zero_copy")
POLICIES = ("lru", "lfu", "activation")
CPU_COMPUTE = ("off", "auto", "always")
PIN_MODES = ("all", "staged", "auto")


@dataclass(frozen=True)
class OffloadConfig:
    """Options of expert offloading; the cache size itself comes from the placement (planner.py).

    mode: how missed experts reach the GPU. 'copy' (manager.py): the host reads each layer's routing, copies the
        misses into slots (or computes them on the CPU), and decoding runs eagerly. 'zero_copy' (zero_copy.py):
        the kernels read missed experts straight from pinned host memory through per-layer address tables, so
        the whole step is device work captured in CUDA graphs; the cache is updated between steps from the
        routing the step recorded. 'auto': zero_copy on CUDA with the CPU compute off, for dense experts and for
        quantized ones that the fused quantized kernels read (Triton backend), else copy.
    admit_bytes_per_step: zero_copy mode, admissions between steps (admit_on_device off): bytes of experts copied
        into slots between two steps at most (None: a quarter of what the step read from host memory, at least one
        expert, plus the experts read from host memory at two step boundaries in a row; 0: the cache never
        changes).
    stage_experts: zero_copy mode on the Triton backend: a layer's missed experts are first copied by one kernel
        into this many device staging rows (None: top-k when one sequence runs at a time, else 2 x top-k; 0: never),
        then read from there; kernels reading host memory in place get about half the rate of a copy. Missed
        experts beyond the rows (and the spare slots) are read in place. Measured on an H200, bf16 at 8 GiB, batch
        8: 8 -> 16 rows 17.1 -> 18.0 tok/s (random routing), 27.7 -> 30.7 (skewed), at the same 9 slots a layer;
        32 rows cost a slot a layer, and batch 1 (random) 140 -> 100 tok/s.
    admit_on_device: zero_copy mode with staging: a layer's missed experts are staged straight into the cache slots
        the policy values least (skipping those the pass routes to), so every staged miss is admitted on the device
        by the copy that stages it and no admission reads host memory a second time; the host only ranks the slots
        between steps. None: on where staging applies, the cache has slots and no admit_bytes_per_step is given.
    admit_hold_passes: admit_on_device: for this many passes of its layer after it is admitted, an expert keeps its
        slot even when the host ranked the slot spare (under async scheduling the host ranks the next step's spare
        slots before it sees what the step in flight admitted, and would give those experts up at once); the host
        ranks top-k spare slots more for each pass held. 0: no hold. None: 2, or 1, where the held slots and as
        many spares stay within the cache (2 x top-k x (1 + hold) <= slots a layer), else 0. Measured on an
        H200: Q4_K_M at 61 slots, batch 8, 395 -> 558 -> 634 tok/s for 0 -> 1 -> 2 (3 and 4: no more); bf16 at 9
        slots, skewed batch 1, 38.4 -> 33.8 tok/s for 0 -> 1 (the held slots are most of the cache there).
    policy: eviction policy, 'lru', 'lfu' or 'activation' (routing statistics across requests).
    prefetch: copy the next layers' likely experts, predicted by applying their routers to the current hidden state
        (copy mode). None: on in copy mode; zero-copy mode does not prefetch, so True makes 'auto' choose copy mode
        and is an error with mode='zero_copy' (a zero-copy form, admitting the predicted experts on the device
        ahead of their layer, measured slower in every row of benchmarks/RESULTS.md's forty-seventh sitting).
    prefetch_depth: how many following MoE layers to prefetch for.
    prefetch_per_layer: at most this many experts per target layer and step (None: the model's top-k).
    prefetch_min_confidence: skip candidates whose mean router probability over the batch is below this.
    prefetch_min_accuracy: pause prefetching (for 32 forward passes, then probe again) when fewer than this share
        of the last 256 settled prefetches were routed to (0: never pause).
    cpu_compute: 'off'; 'auto' computes a missed expert on the CPU when the cost model says it beats the copy;
        'always' computes every missed expert on the CPU (llama.cpp's --n-cpu-moe, Fiddler).
    overlap: compute the resident experts of a layer while its missed ones are being copied (None: on CUDA only).
        Copy mode: a pass over the cached experts; zero-copy mode with staging (dense experts): GEMM 1 of the pairs
        on the device while a side stream stages the rest.
    pin: host memory of the experts: 'all' pinned (fastest copies), 'staged' through a ring of pinned buffers
        (for models larger than what may be pinned), 'auto' pins all unless they exceed half the host's memory.
    staging_buffers: size of the staging ring, in experts.
    pcie_gbps / cpu_expert_ms / cpu_token_ms: cost-model rates; None measures them when cpu_compute != 'off'.
    force: offload even when the whole model fits in the budget.
    """

    policy: str = "lru"
    prefetch: bool | None = None
    prefetch_depth: int = 1
    prefetch_per_layer: int | None = None
    prefetch_min_confidence: float = 0.0
    prefetch_min_accuracy: float = 0.25
    cpu_compute: str = "off"
    overlap: bool | None = None
    pin: str = "auto"
    staging_buffers: int = 16
    pcie_gbps: float | None = None
    cpu_expert_ms: float | None = None
    cpu_token_ms: float | None = None
    force: bool = False
    mode: str = "auto"
    admit_bytes_per_step: int | None = None
    stage_experts: int | None = None
    admit_on_device: bool | None = None
    admit_hold_passes: int | None = None

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"offload mode must be one of {MODES}, got {self.mode!r}")
        if self.admit_bytes_per_step is not None and self.admit_bytes_per_step < 0:
            raise ValueError(f"admit_bytes_per_step must be >= 0, got {self.admit_bytes_per_step}")
        if self.mode == "zero_copy" and self.cpu_compute != "off":
            raise ValueError("offload mode 'zero_copy' reads missed experts on the GPU: it needs cpu_compute='off'")
        if self.mode == "zero_copy" and self.prefetch:
            raise ValueError("offload mode 'zero_copy' does not prefetch: use mode='copy' for prefetch=True")
        if self.mode == "zero_copy" and self.pin == "staged":
            raise ValueError("offload mode 'zero_copy' reads experts from pinned host memory: it needs pin='all' "
                             "or 'auto', not 'staged'")
        if self.admit_on_device and self.admit_bytes_per_step is not None:
            raise ValueError("admit_on_device admits every staged miss: it takes no admit_bytes_per_step")
        if self.admit_hold_passes is not None and self.admit_hold_passes < 0:
            raise ValueError(f"admit_hold_passes must be >= 0, got {self.admit_hold_passes}")
        if self.stage_experts is not None and self.stage_experts < 0:
            raise ValueError(f"stage_experts must be >= 0, got {self.stage_experts}")
        if self.policy not in POLICIES:
            raise ValueError(f"offload policy must be one of {POLICIES}, got {self.policy!r}")
        if self.cpu_compute not in CPU_COMPUTE:
            raise ValueError(f"cpu_compute must be one of {CPU_COMPUTE}, got {self.cpu_compute!r}")
        if self.pin not in PIN_MODES:
            raise ValueError(f"pin must be one of {PIN_MODES}, got {self.pin!r}")
        if not 0.0 <= self.prefetch_min_accuracy <= 1.0:
            raise ValueError(f"prefetch_min_accuracy must be in [0, 1], got {self.prefetch_min_accuracy}")
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

    def stage_rows(self, top_k: int, max_num_seqs: int = 1) -> int:
        """Device rows a zero-copy layer stages its missed experts in: stage_experts, or for None its choice for a
        model routing to ``top_k`` experts and an engine running up to ``max_num_seqs`` sequences at a time."""
        if self.stage_experts is not None:
            return self.stage_experts
        return top_k if max_num_seqs <= 1 else 2 * top_k

    def hold_passes(self, top_k: int, slots: int) -> int:
        """admit_hold_passes, or for None its choice for ``slots`` slots a layer."""
        if self.admit_hold_passes is not None:
            return self.admit_hold_passes
        return next((h for h in (2, 1) if 2 * top_k * (1 + h) <= slots), 0)


def resolve_mode(config: OffloadConfig, device: torch.device, dense: bool, quantized_in_place: bool = False) -> str:
    """'copy' or 'zero_copy' for experts on ``device`` (dense: every expert part is a float tensor;
    quantized_in_place: quantized experts that the fused quantized kernels read through address tables); 'auto'
    takes zero_copy for those two kinds on CUDA. Measured on an H200 (benchmarks/RESULTS.md), Q4_K_M experts at
    63 slots a layer: zero-copy 127 tok/s at batch 1 against 113 in copy mode."""
    if config.mode != "auto":
        return config.mode
    in_place = dense or quantized_in_place
    zero_copy = (device.type == "cuda" and in_place and config.cpu_compute == "off" and config.pin != "staged"
                 and not config.prefetch)
    return "zero_copy" if zero_copy else "copy"
