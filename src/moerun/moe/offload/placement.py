"""Puts a model in offloaded form: experts into the host store, everything else onto the device, each MoE
layer's ``Experts`` replaced by ``OffloadedExperts`` served by one manager (model.expert_offload): an
ExpertOffload (mode 'copy') or a ZeroCopyOffload (mode 'zero_copy')."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from moerun.config import EngineConfig, ModelConfig
from moerun.engine.memory import available_bytes
from moerun.layers.quantized import QuantizedWeight, dense_or_dequantized
from moerun.moe.offload.config import OffloadConfig, resolve_mode
from moerun.moe.offload.manager import ExpertOffload
from moerun.moe.offload.offloaded_experts import OffloadedExperts
from moerun.moe.offload.packed_pool import host_copy_fits
from moerun.moe.offload.planner import Placement, footprint_of_config, footprint_of_gguf, plan_placement
from moerun.moe.offload.store import HostExpertStore
from moerun.moe.offload.zero_copy import ZeroCopyOffload, reads_quantized_in_place

if TYPE_CHECKING:
    from moerun.models.checkpoint import LoadedModel

logger = logging.getLogger("moerun")


def plan_for_checkpoint(path: str | Path, mc: ModelConfig, ec: EngineConfig, gpu_memory_gb: float | None,
                        expert_cache_gb: float | None, config: OffloadConfig) -> Placement:
    """The placement of a checkpoint folder or GGUF file on the engine's device (reads only metadata)."""
    from moerun.models.gguf_checkpoint import is_gguf

    fp = footprint_of_gguf(path, mc, ec.dtype) if is_gguf(path) else footprint_of_config(mc, ec.dtype)
    return plan_placement(fp, mc, ec.dtype, ec.max_model_len, ec.max_num_seqs, ec.max_num_batched_tokens,
                          int(available_bytes(ec.device) * 0.9), gpu_memory_gb, expert_cache_gb, config,
                          torch.device(ec.device))


def load_offloaded(path: str | Path, ec: EngineConfig, placement: Placement, config: OffloadConfig,
                   progress: bool = True) -> LoadedModel:
    """Loads a checkpoint into host memory, then offloads it onto the engine's device (a LoadedModel)."""
    from moerun.models.checkpoint import load_checkpoint

    loaded = load_checkpoint(path, torch.device("cpu"), ec.dtype, ec.moe_backend, progress=progress)
    offload_model(loaded.model, ec.device, placement.slots_per_layer, config, kv_bytes=placement.kv_bytes)
    logger.info("%s", placement.describe())
    return loaded


def _pin_all(config: OffloadConfig, nbytes: int, device: torch.device) -> bool:
    if device.type != "cuda" or config.pin == "staged":
        return False
    if config.pin == "all":
        return True
    return nbytes <= available_bytes(torch.device("cpu")) // 2


def offload_model(model: nn.Module, device: torch.device, slots_per_layer: int, config: OffloadConfig,
                  kv_bytes: int | None = None) -> ExpertOffload | ZeroCopyOffload:
    """Moves a model held in host memory to ``device`` except its experts, which the host store keeps."""
    blocks = model.moe_blocks()
    if not blocks:
        raise ValueError("the model has no MoE layers: there are no experts to offload")
    old = [b.experts for b in blocks]
    nbytes = sum(p.numel() * p.element_size() for ex in old for p in _expert_tensors(ex))
    dense = not any(ex.__dict__.get(f"q_{w}") is not None for ex in old for w in ("w13", "w2"))
    # zero-copy reads experts from pinned memory: asked for by name, the experts are pinned whatever their size
    wants_pinned = config.mode == "zero_copy" and resolve_mode(config, device, dense) == "zero_copy"
    pin = device.type == "cuda" and (wants_pinned or _pin_all(config, nbytes, device))
    store = HostExpertStore.from_experts(old, pin=pin)
    backend = old[0].backend
    for i, b in enumerate(blocks):
        b.experts = OffloadedExperts(None, i, old[i].num_experts, old[i].hidden_size, old[i].intermediate_size,
                                     backend)
    del old
    model.to(device)
    _move_quantized(model, device)
    return attach_offload(model, store, slots_per_layer, device, config, kv_bytes)


def store_mode(config: OffloadConfig, store: HostExpertStore, device: torch.device, backend: str | None = None) -> str:
    """'copy' or 'zero_copy' for this store: 'auto' takes zero_copy only when the kernels can read the experts in
    place (dense ones, or quantized ones under the fused quantized kernels of the Triton backend, whose repacked
    host copy must fit in half the free host memory) and, on CUDA, the store is pinned; zero_copy asked for by name
    on a store that cannot serve it is an error."""
    dense = all(s.qtype is None for layer in store.specs for s in layer)
    quantized_in_place = (not dense and config.mode == "auto" and device.type == "cuda"
                          and reads_quantized_in_place(store, device, backend)
                          and host_copy_fits(store.specs, store.num_experts))
    mode = resolve_mode(config, device, dense, quantized_in_place)
    if mode == "zero_copy" and device.type == "cuda" and not store.pinned:
        if config.mode == "zero_copy":
            raise ValueError("offload mode 'zero_copy' reads experts from pinned host memory, but they could not be "
                             "pinned; use mode='copy'")
        return "copy"
    return mode


def attach_offload(model: nn.Module, store: HostExpertStore, slots_per_layer: int, device: torch.device,
                   config: OffloadConfig, kv_bytes: int | None = None) -> ExpertOffload | ZeroCopyOffload:
    """Creates the manager (by the resolved mode) of a model whose MoE layers already hold OffloadedExperts."""
    blocks = model.moe_blocks()
    mc = model.config
    backend = blocks[0].experts.backend
    if store_mode(config, store, device, backend) == "zero_copy":
        manager = ZeroCopyOffload(store, slots_per_layer, device, mc.num_experts_per_tok, config, backend=backend,
                                  kv_bytes=kv_bytes)
    else:
        gates = [dense_or_dequantized(b.gate, "weight", mc.dtype) for b in blocks]
        manager = ExpertOffload(store, slots_per_layer, device, mc.dtype, mc.num_experts_per_tok, gates, config,
                                backend=backend, kv_bytes=kv_bytes)
    for b in blocks:
        if not isinstance(b.experts, OffloadedExperts):
            raise TypeError(f"layer {b.layer}: expected OffloadedExperts, found {type(b.experts).__name__}")
        b.experts.__dict__["manager"] = manager
    model.__dict__["expert_offload"] = manager
    return manager


def _expert_tensors(experts: nn.Module) -> list[torch.Tensor]:
    out = []
    for which in ("w13", "w2"):
        q = experts.__dict__.get(f"q_{which}")
        out.extend([p.raw for p in q.parts] if q is not None else [getattr(experts, which)])
    return out


def _move_quantized(model: nn.Module, device: torch.device, repack: bool | None = None) -> None:
    """Moves the QuantizedWeights that layers keep outside their parameters (GGUF models), sharing kept. With
    ``repack`` (the default on CUDA) they are then repacked for the kernels and their GGUF blocks dropped, as a
    GGUF model loaded onto the GPU is: the non-expert weights are held once, at about the size the planner
    counted (embedding tables too: their lookups decode rows of the repacked copy)."""
    from moerun.ops.quant import pack_model

    moved: dict[int, QuantizedWeight] = {}
    for module in model.modules():
        for key, value in list(module.__dict__.items()):
            if key.startswith("q_") and isinstance(value, QuantizedWeight):
                if id(value) not in moved:
                    moved[id(value)] = QuantizedWeight([p.to(device) for p in value.parts])
                module.__dict__[key] = moved[id(value)]
    if moved and (device.type == "cuda" if repack is None else repack):
        pack_model(model, release_blocks=True)


def offload_options(config: OffloadConfig | None, policy: str | None = None, mode: str | None = None,
                    top_k: int | None = None, max_num_seqs: int = 1) -> OffloadConfig:
    """The OffloadConfig with ``policy`` and ``mode`` (when given) overriding its own, and with ``top_k`` given, the
    staging rows it leaves to its own choice decided for an engine of ``max_num_seqs`` sequences."""
    config = config or OffloadConfig()
    if policy is not None:
        config = dataclasses.replace(config, policy=policy)
    if mode is not None:
        config = dataclasses.replace(config, mode=mode)
    if top_k is not None and config.stage_experts is None:
        config = dataclasses.replace(config, stage_experts=config.stage_rows(top_k, max_num_seqs))
    return config
