"""Fused experts of one MoE layer whose experts are found through tables of addresses, not one stacked tensor.

The fused MoE's kernels (kernels/fused_moe.py, fused_moe_gemv.py) run with INDIRECT set (same gemv and tile
paths, tile configs and reductions): expert e's weights start at ``w13_table[e]`` / ``w2_table[e]``, int64
addresses of a contiguous w13 [2I, H] and w2 [H, I]. An address may point into device memory or into pinned host
memory, which the GPU reads over PCIe under unified addressing (zero-copy), so one launch serves an expert cache
and its host store together, with nothing decided on the host. ``align`` is the largest power of two (bytes, at
most 16) that every address is a multiple of: a hint that lets the compiler vectorise the loads. In Triton's
interpreter the addresses are host addresses.
"""

from __future__ import annotations

import torch

from moerun.kernels.fused_moe import run_fused_moe
from moerun.kernels.moe_parts import SUPPORTED_DTYPES, ExpertWeights, StagedPairs
from moerun.kernels.tile_configs import Config, get_config, normalize


def fused_moe_indirect_triton(
    hidden: torch.Tensor,
    w13_table: torch.Tensor,
    w2_table: torch.Tensor,
    intermediate_size: int,
    dtype: torch.dtype,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    align: int,
    config: Config | None = None,
    staged: StagedPairs | None = None,
    keep_float32: bool = False,
) -> torch.Tensor:
    """Experts of one MoE layer through address tables: hidden [T, H], w13_table / w2_table [E] int64 (expert e's
    w13 [2I, H] / w2 [H, I], contiguous, of ``dtype``), routing [T, k] -> [T, H] in hidden's dtype.

    ``align``: bytes (a power of two <= 16) that every address is a multiple of. Nothing is read back to the
    host, so the call can be captured in a CUDA graph; the tables may change between replays. ``staged``: pairs
    whose experts another stream is still copying (moe_parts.StagedPairs), computed after the others.
    ``keep_float32``: fused_moe_triton's.
    """
    T, H = hidden.shape
    E = w13_table.shape[0]
    I = intermediate_size  # noqa: E741
    k = topk_ids.shape[1]
    if tuple(w2_table.shape) != (E,) or w13_table.dtype != torch.int64 or w2_table.dtype != torch.int64:
        raise ValueError(f"address tables must be int64 [E]; got w13 {tuple(w13_table.shape)} {w13_table.dtype}, "
                         f"w2 {tuple(w2_table.shape)} {w2_table.dtype}")
    if tuple(topk_weights.shape) != (T, k):
        raise ValueError(f"topk_weights {tuple(topk_weights.shape)} must match topk_ids {tuple(topk_ids.shape)}")
    if dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"unsupported weight dtype {dtype}; expected one of {SUPPORTED_DTYPES}")
    if align not in (1, 2, 4, 8, 16):
        raise ValueError(f"align must be a power of two <= 16, got {align}")
    if T == 0:
        if staged is not None:
            staged.wait()
        return torch.empty(0, H, dtype=hidden.dtype, device=hidden.device)
    # The kernels take the weights' element type from the activations: hidden is cast to the weights' dtype.
    x = hidden if hidden.dtype == dtype else hidden.to(dtype)
    x = x if x.stride(1) == 1 else x.contiguous()
    ids = (topk_ids if topk_ids.dtype == torch.int32 else topk_ids.to(torch.int32)).contiguous()
    weights = topk_weights.contiguous()
    cfg = normalize(config) if config is not None else get_config(E, H, I, k, dtype, T)
    w13 = ExpertWeights.addresses(w13_table.contiguous(), H, align)
    w2 = ExpertWeights.addresses(w2_table.contiguous(), I, align)
    return run_fused_moe(x, w13, w2, I, weights, ids, cfg, hidden.dtype, staged, keep_float32)
