"""Random offloaded models for benchmarks: non-expert weights generated on the device, experts generated a
layer at a time on the device and copied into one pinned host arena, so the whole model never sits on the device.

``quant='Q4_K_M'`` gives the experts llama.cpp's Q4_K_M layout (gate/up Q4_K, down Q4_K or Q6_K by layer) filled
with random valid blocks (drawn from a bank of blocks quantized from random weights).
"""

from __future__ import annotations

import torch
from torch import nn

from moerun.config import ModelConfig
from moerun.formats.quants import QuantizedTensor
from moerun.formats.quants.types import as_quant_type, row_nbytes
from moerun.models.registry import get_model_class
from moerun.moe.offload.config import OffloadConfig
from moerun.moe.offload.offloaded_experts import OffloadedExperts
from moerun.moe.offload.placement import attach_offload
from moerun.moe.offload.store import HostExpertStore, PartSpec, pinned_empty

_CHUNK_BYTES = 512 * 2**20  # device scratch per generation step


def expert_specs(config: ModelConfig, quant: str | None = None) -> list[list[PartSpec]]:
    """The part layout of every MoE layer's experts: dense (config.dtype) or a GGUF type mix."""
    H, I = config.hidden_size, config.moe_intermediate_size  # noqa: E741
    layers = config.moe_layers
    if quant is None:
        return [[PartSpec("w13", (2 * I, H), config.dtype), PartSpec("w2", (H, I), config.dtype)] for _ in layers]
    if quant.upper() != "Q4_K_M":
        raise ValueError(f"random quantized experts support Q4_K_M, got {quant!r}")
    from moerun.formats.gguf.type_mix import use_more_bits

    specs = []
    for layer in layers:
        down = "Q6_K" if use_more_bits(layer, config.num_layers) else "Q4_K"
        parts = [("w13", "Q4_K", I, H, "gate"), ("w13", "Q4_K", I, H, "up"), ("w2", down, H, I, "down")]
        specs.append([PartSpec(which, (rows, row_nbytes(cols, qt)), torch.uint8, int(as_quant_type(qt)), cols,
                               f"blk.{layer}.ffn_{name}_exps.weight") for which, qt, rows, cols, name in parts])
    return specs


@torch.no_grad()
def random_expert_store(config: ModelConfig, device: torch.device, seed: int = 0, quant: str | None = None,
                        std: float = 0.02) -> HostExpertStore:
    """Every MoE layer's experts, random, in one host arena (pinned on CUDA)."""
    specs = expert_specs(config, quant)
    E = config.num_experts
    sizes = [[E * s.nbytes for s in layer] for layer in specs]
    total = sum(sum(layer) for layer in sizes)
    registry: list[int] = []
    arena = pinned_empty(total, registry) if device.type == "cuda" else torch.empty(total, dtype=torch.uint8)
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    banks: dict[int, torch.Tensor] = {}
    parts, offset = [], 0
    for layer_specs, layer_sizes in zip(specs, sizes):
        layer_parts = []
        for spec, n in zip(layer_specs, layer_sizes):
            view = arena[offset : offset + n].view(spec.dtype).view(E, *spec.shape)
            offset += n
            per = max(1, _CHUNK_BYTES // spec.nbytes)
            for a in range(0, E, per):
                b = min(E, a + per)
                if spec.qtype is None:
                    chunk = torch.empty((b - a, *spec.shape), dtype=spec.dtype, device=device).normal_(0, std,
                                                                                                         generator=g)
                else:
                    chunk = _random_blocks(banks, spec, b - a, device, g, std)
                view[a:b].copy_(chunk)
            layer_parts.append(view)
        parts.append(layer_parts)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return HostExpertStore(parts, specs, pinned=device.type == "cuda", registered=registry)


def _random_blocks(banks: dict[int, torch.Tensor], spec: PartSpec, n: int, device: torch.device,
                   g: torch.Generator, std: float) -> torch.Tensor:
    """uint8 [n, rows, row_bytes]: valid blocks of spec.qtype drawn at random from a bank."""
    if spec.qtype not in banks:
        q = QuantizedTensor.from_float(torch.randn(64, spec.cols) * std, spec.qtype)
        banks[spec.qtype] = q.raw.reshape(-1, q.qtype.block_bytes).to(device)  # [blocks, block_bytes]
    bank = banks[spec.qtype]
    rows, row_bytes = spec.shape
    per_row = row_bytes // bank.shape[1]
    idx = torch.randint(0, bank.shape[0], (n * rows * per_row,), device=device, generator=g)
    return bank[idx].view(n, rows, row_bytes)


@torch.no_grad()
def random_offloaded_model(config: ModelConfig, device: torch.device, slots_per_layer: int,
                           offload: OffloadConfig | None = None, seed: int = 0, moe_backend: str | None = None,
                           quant: str | None = None, kv_bytes: int | None = None,
                           store: HostExpertStore | None = None) -> nn.Module:
    """A random model whose non-expert weights are on ``device`` and experts in a (given or new) host store."""
    cls = get_model_class(config.architecture)
    with torch.device("meta"):
        model = cls(config, moe_backend=moe_backend)
    model = model.to(dtype=config.dtype)
    for i, b in enumerate(model.moe_blocks()):
        b.experts = OffloadedExperts(None, i, config.num_experts, config.hidden_size, config.moe_intermediate_size,
                                     moe_backend)
    model.to_empty(device=device)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    g = torch.Generator(device=device)
    g.manual_seed(seed + 1)
    for name, p in model.named_parameters():  # as models/random_init.py initialises a resident model
        if p.dim() == 1:
            p.fill_(1.0) if name.endswith("norm.weight") else p.normal_(0.0, 0.02, generator=g)
        elif name.endswith("mlp.gate.weight"):
            p.normal_(0.0, 1.0 / config.hidden_size**0.5, generator=g)
        else:
            p.normal_(0.0, 0.02, generator=g)
    store = store if store is not None else random_expert_store(config, device, seed, quant)
    attach_offload(model, store, slots_per_layer, device, offload or OffloadConfig(), kv_bytes)
    return model.eval()
