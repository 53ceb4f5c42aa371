"""Missed experts computed on the CPU from host memory (llama.cpp's --n-cpu-moe, Fiddler), and the cost model
that decides, expert by expert, whether computing on the CPU beats copying the weights to the device."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from moerun.moe.offload.store import HostExpertStore


def _expert(w: object, e: int, dtype: torch.dtype) -> torch.Tensor:
    return w[e] if isinstance(w, torch.Tensor) else w.expert(e, dtype)


def cpu_partial(hidden: torch.Tensor, w13: object, w2: object, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                experts: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """float32 [T, H]: sum over the routing pairs whose expert is in ``experts`` of weight * expert(x).

    hidden [T, H], w13 [E, 2I, H], w2 [E, H, I] (host tensors or QuantizedWeights), topk_* [T, k]. Each expert's
    GEMMs run in the weights' dtype on the same rows as the reference (ops/moe_reference.py), so an expert gives
    the same values whether computed here or there.
    """
    T, H = hidden.shape
    k = topk_ids.shape[1]
    flat_ids = topk_ids.reshape(-1).long()  # [T*k]
    weights = topk_weights.reshape(-1).float()  # [T*k]
    per_slot = torch.zeros(T * k, H, dtype=torch.float32)  # [T*k, H]
    for e in experts:
        slots = torch.nonzero(flat_ids == int(e)).view(-1)  # [n] in increasing (token, slot) order
        if slots.numel() == 0:
            continue
        w13_e, w2_e = _expert(w13, int(e), dtype), _expert(w2, int(e), dtype)  # [2I, H], [H, I]
        inter = w13_e.shape[0] // 2
        x = hidden[slots // k].to(w13_e.dtype)  # [n, H]
        gate_up = x @ w13_e.t()  # [n, 2I]
        act = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]  # [n, I]
        per_slot[slots] = (act @ w2_e.t()).float() * weights[slots, None]
    return per_slot.view(T, k, H).sum(dim=1)


@dataclass(frozen=True)
class CostModel:
    """Seconds to copy an expert (bytes / host-to-device bandwidth) vs to compute it on the CPU
    (a fixed cost, dominated by reading the weights, plus a cost per routed token)."""

    h2d_bytes_per_s: float
    cpu_expert_s: float
    cpu_token_s: float

    def copy_s(self, nbytes: int) -> float:
        return nbytes / self.h2d_bytes_per_s

    def cpu_s(self, tokens: int) -> float:
        return self.cpu_expert_s + tokens * self.cpu_token_s

    def split(self, experts: np.ndarray, counts: np.ndarray, nbytes: int) -> tuple[list[int], list[int]]:
        """(experts for the CPU, experts to copy): each missed expert, most tokens first, goes where the work
        queued so far finishes earlier; copies and CPU compute run at the same time."""
        cpu, gpu = [], []
        cpu_busy = copy_busy = 0.0
        for i in np.argsort(-counts, kind="stable"):
            e, n = int(experts[i]), int(counts[i])
            if cpu_busy + self.cpu_s(n) < copy_busy + self.copy_s(nbytes):
                cpu.append(e)
                cpu_busy += self.cpu_s(n)
            else:
                gpu.append(e)
                copy_busy += self.copy_s(nbytes)
        return cpu, gpu

    def as_dict(self) -> dict[str, float]:
        return {"h2d_GBps": self.h2d_bytes_per_s / 1e9, "cpu_expert_ms": 1e3 * self.cpu_expert_s,
                "cpu_token_ms": 1e3 * self.cpu_token_s}


def _median_time(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def measure_h2d(store: HostExpertStore, device: torch.device, layer: int = 0) -> float:
    """Bytes per second of copying experts of one layer from the store to ``device`` (as the cache does)."""
    n = min(8, store.num_experts)
    srcs = [store.expert_parts(layer, e) for e in range(n)]
    dst = [torch.empty_like(t, device=device) for t in srcs[0]]
    nbytes = n * store.expert_bytes(layer)

    def run() -> None:
        for src in srcs:
            for d, s in zip(dst, src):
                d.copy_(s, non_blocking=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    run()
    return nbytes / max(_median_time(run, 5), 1e-9)


def measure_cpu(store: HostExpertStore, dtype: torch.dtype, layer: int = 0) -> tuple[float, float]:
    """(seconds per expert, seconds per token) of computing one expert on the CPU, from 1- and 8-token runs."""
    w13, w2 = store.weights(layer)
    H = w13.shape[-1]
    E = store.num_experts

    def run(tokens: int) -> float:
        x = torch.randn(tokens, H).to(dtype)
        ids = torch.zeros(tokens, 1, dtype=torch.int32) + (E - 1)
        w = torch.ones(tokens, 1)
        cpu_partial(x, w13, w2, w, ids, [E - 1], dtype)
        return _median_time(lambda: cpu_partial(x, w13, w2, w, ids, [E - 1], dtype), 3)

    t1, t8 = run(1), run(8)
    per_token = max(0.0, (t8 - t1) / 7)
    return max(t1 - per_token, 1e-7), per_token
