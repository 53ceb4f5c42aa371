"""Budget placement: what goes on the device (non-expert weights, KV cache, workspace, expert slots) and whether
experts are offloaded at all, decided from the model's shape before any weight is read or memory allocated."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from moerun.config import ModelConfig
from moerun.engine.kv_cache import KVCache
from moerun.moe.offload.config import OffloadConfig, resolve_mode

logger = logging.getLogger("moerun")
GiB = 2**30
_WORKSPACE_FIXED = 256 * 2**20  # allocator slack, kernels' scratch, small buffers


@dataclass(frozen=True)
class Footprint:
    """Bytes a model needs on the device: non-expert weights and one expert of each MoE layer."""

    non_expert_bytes: int
    expert_bytes: tuple[int, ...]  # per MoE layer, one expert (all its parts)
    num_experts: int
    top_k: int

    @property
    def experts_total(self) -> int:
        return sum(self.expert_bytes) * self.num_experts

    @property
    def slot_bytes(self) -> int:
        """One cache slot in every MoE layer."""
        return sum(self.expert_bytes)

    def pool_bytes(self, slots_per_layer: int) -> int:
        """Device bytes of the slot pools (each layer has one extra zero slot)."""
        return 0 if slots_per_layer == 0 else self.slot_bytes * (slots_per_layer + 1)


def _elem(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def footprint_of_config(mc: ModelConfig, dtype: torch.dtype) -> Footprint:
    """Dense weights of ``dtype``, as a Hugging Face checkpoint loads."""
    e = _elem(dtype)
    per_expert = 3 * mc.hidden_size * mc.moe_intermediate_size * e
    return Footprint(mc.param_counts()["non_expert"] * e, tuple(per_expert for _ in mc.moe_layers), mc.num_experts,
                     mc.num_experts_per_tok)


def footprint_of_gguf(path: str | Path, mc: ModelConfig, dtype: torch.dtype) -> Footprint:
    """From the GGUF's tensor table: float tensors at ``dtype``, quantized ones at the larger of their blocks and
    their repacked form (what the fused quantized kernels read), the token embedding at its blocks (looked up)."""
    from gguf.constants import GGMLQuantizationType as T

    from moerun.formats.gguf.names import gguf_layer
    from moerun.formats.gguf.reader import GGUFFile
    from moerun.formats.quants import QuantType
    from moerun.kernels.quant.repack import LAYOUTS, packed_nbytes

    floats = (T.F32, T.F16, T.BF16)
    repacked = {int(t) for t in LAYOUTS}
    layers = mc.moe_layers
    per_layer = {layer: 0 for layer in layers}
    non_expert = 0
    with GGUFFile(path) as f:
        for name, ti in f.tensors.items():
            size = ti.n_elements * _elem(dtype) if ti.ggml_type in floats else ti.nbytes
            if int(ti.ggml_type) in repacked and not name.startswith("token_embd."):
                size = max(size, packed_nbytes(QuantType(int(ti.ggml_type)), ti.shape))
            if "_exps." in name:
                per_layer[gguf_layer(name)] += size // mc.num_experts
            else:
                non_expert += size
    return Footprint(non_expert, tuple(per_layer[layer] for layer in layers), mc.num_experts, mc.num_experts_per_tok)


def workspace_bytes(mc: ModelConfig, dtype: torch.dtype, max_num_batched_tokens: int, max_num_seqs: int) -> int:
    """Activation memory of the largest forward pass (a rough upper bound) plus fixed slack."""
    e, T, k = _elem(dtype), max_num_batched_tokens, mc.num_experts_per_tok
    H, I, D = mc.hidden_size, mc.moe_intermediate_size, mc.head_dim
    qkv = (mc.num_heads + 2 * mc.num_kv_heads) * D
    per_token = k * 3 * I * e + k * H * 4 + 8 * H * e + 2 * qkv * e
    logits = 2 * max_num_seqs * mc.vocab_size * 4
    return T * per_token + logits + _WORKSPACE_FIXED


@dataclass(frozen=True)
class Placement:
    """The device budget split; ``offload`` False means the whole model goes on the device as usual."""

    offload: bool
    slots_per_layer: int
    non_expert_bytes: int
    workspace_bytes: int
    cache_bytes: int
    kv_bytes: int | None  # None: the KV cache is sized from free memory after loading
    budget_bytes: int | None
    reason: str

    def describe(self) -> str:
        kv = "from free memory" if self.kv_bytes is None else f"{self.kv_bytes / GiB:.2f} GiB"
        return (f"{self.reason}: non-expert weights {self.non_expert_bytes / GiB:.2f} GiB, KV cache {kv}, "
                f"workspace {self.workspace_bytes / GiB:.2f} GiB, expert cache {self.slots_per_layer} slots per "
                f"layer ({self.cache_bytes / GiB:.2f} GiB)")


def plan_placement(fp: Footprint, mc: ModelConfig, dtype: torch.dtype, max_model_len: int, max_num_seqs: int,
                   max_num_batched_tokens: int, free_bytes: int, gpu_memory_gb: float | None = None,
                   expert_cache_gb: float | None = None, config: OffloadConfig | None = None,
                   device: torch.device | None = None) -> Placement:
    """Decides the placement; raises ValueError (nothing allocated yet) when the budget cannot work.

    free_bytes: what the device can give (used when gpu_memory_gb is None); device: where the experts run (None:
    counts zero-copy's staging rows only when config.mode asks for zero-copy). Without gpu_memory_gb and
    expert_cache_gb a model that fits is not offloaded; one that does not fit is, with a warning.
    """
    config = config or OffloadConfig()
    if gpu_memory_gb is not None and gpu_memory_gb <= 0:
        raise ValueError(f"gpu_memory_gb must be positive, got {gpu_memory_gb}")
    if expert_cache_gb is not None and expert_cache_gb < 0:
        raise ValueError(f"expert_cache_gb must be >= 0, got {expert_cache_gb}")
    kv_seq = KVCache.bytes_per_token(mc.num_layers, mc.num_kv_heads, mc.head_dim, dtype) * max_model_len
    ws = workspace_bytes(mc, dtype, max_num_batched_tokens, max_num_seqs)
    budget = int(gpu_memory_gb * GiB) if gpu_memory_gb is not None else None
    limit = budget if budget is not None else free_bytes
    where = f"gpu_memory_gb={gpu_memory_gb:g} ({budget / GiB:.2f} GiB)" if budget is not None else \
        f"the device's free memory ({free_bytes / GiB:.2f} GiB)"
    E = fp.num_experts
    if expert_cache_gb is None and not config.force:
        if fp.non_expert_bytes + fp.experts_total + ws + kv_seq <= limit:
            kv = None if budget is None else limit - fp.non_expert_bytes - fp.experts_total - ws
            return Placement(False, E, fp.non_expert_bytes, ws, 0, kv, budget, "the whole model fits")
    # Copy mode needs a token's k experts resident at once; zero-copy kernels read missing ones from host memory.
    min_slots = 0 if config.cpu_compute == "always" or config.mode == "zero_copy" else min(fp.top_k, E)
    # zero-copy layers stage their missed experts in device rows (kernels/stage_misses.py); counted wherever 'auto'
    # could pick zero-copy (for dense experts: resolve_mode)
    mode = config.mode if device is None else resolve_mode(config, device, dense=True)
    stage = config.stage_rows(fp.top_k, max_num_seqs) * max(fp.expert_bytes) if mode == "zero_copy" else 0
    ws += stage
    minimum = fp.non_expert_bytes + ws + kv_seq + fp.pool_bytes(min_slots)
    if minimum > limit:
        raise ValueError(
            f"{where} is too small to offload this model's experts: non-expert weights need "
            f"{fp.non_expert_bytes / GiB:.3f} GiB, a KV cache for one sequence of max_model_len={max_model_len} "
            f"tokens {kv_seq / GiB:.3f} GiB, activation workspace{' with staging rows' if stage else ''} "
            f"{ws / GiB:.3f} GiB and the smallest expert cache "
            f"({min_slots} slots per layer x {len(fp.expert_bytes)} MoE layers) {fp.pool_bytes(min_slots) / GiB:.3f}"
            f" GiB: at least {minimum / GiB:.3f} GiB is needed; raise gpu_memory_gb, lower max_model_len or "
            "max_num_batched_tokens, or compute experts on the CPU (cpu_compute='always')"
        )
    if expert_cache_gb is not None:
        slots = min(E, max(0, int(expert_cache_gb * GiB) // fp.slot_bytes - 1))
        if slots < min_slots:
            raise ValueError(
                f"expert_cache_gb={expert_cache_gb:g} holds {slots} experts per layer, fewer than the {min_slots} "
                f"(top-k) a token needs: at least {fp.pool_bytes(min_slots) / GiB:.3f} GiB"
            )
        left = limit - fp.non_expert_bytes - ws - fp.pool_bytes(slots)
        if left < kv_seq:
            raise ValueError(
                f"expert_cache_gb={expert_cache_gb:g} does not fit {where} next to the non-expert weights "
                f"({fp.non_expert_bytes / GiB:.3f} GiB), workspace ({ws / GiB:.3f} GiB) and a KV cache for one "
                f"sequence ({kv_seq / GiB:.3f} GiB); lower expert_cache_gb to at most "
                f"{(limit - fp.non_expert_bytes - ws - kv_seq) / GiB:.3f}"
            )
        kv = min(left, kv_seq * max_num_seqs) if budget is not None else None
        reason = f"expert cache of {expert_cache_gb:g} GiB requested"
    else:
        room = limit - fp.non_expert_bytes - ws - fp.pool_bytes(min_slots)
        kv = max(kv_seq, min(room, kv_seq * max_num_seqs) // kv_seq * kv_seq)
        left = limit - fp.non_expert_bytes - ws - kv
        slots = max(min_slots, min(E, left // fp.slot_bytes - 1))
        needed = fp.non_expert_bytes + fp.experts_total + ws + kv_seq
        reason = f"the model needs {needed / GiB:.2f} GiB but {where} is available: offloading experts"
        if budget is None:
            logger.warning("%s; the device caches %d of %d experts per layer", reason, slots, E)
    return Placement(True, slots, fp.non_expert_bytes, ws, fp.pool_bytes(slots), kv, budget, reason)
