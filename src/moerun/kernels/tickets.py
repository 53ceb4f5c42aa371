"""Ticket counters for last-arriving reductions: the programs of a kernel that share an output each take a ticket
(an atomic add on one int32 counter) once their partial is written; the program that draws the last ticket sums
the partials and resets the counter to 0 for the next launch or CUDA-graph replay (gemv split-K, the fused MoE
slot sum, decode attention's merge, the fused router's top-k)."""

from __future__ import annotations

import torch
import triton

_COUNTERS: dict[tuple[str, torch.device], list[torch.Tensor]] = {}
_MIN_COUNTERS = 1 << 14


def ticket_counters(device: torch.device, n: int, owner: str) -> torch.Tensor:
    """n int32 counters on device that are 0 between launches (each kernel resets the ones it used).

    One buffer per owner (op name), never freed: a captured CUDA graph keeps its address. Launches that share an
    owner must not overlap in time (same stream, as in a decode step). A buffer is made outside any capture (a
    warm-up call); asked for more counters during a capture, it returns a zeroed tensor of the call's own, whose
    zeroing the graph records and replays.
    """
    key = (owner, device)
    buffers = _COUNTERS.setdefault(key, [])
    if buffers and buffers[-1].numel() >= n:
        return buffers[-1][:n]
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return torch.zeros(n, dtype=torch.int32, device=device)  # [n]
    size = max(_MIN_COUNTERS, triton.next_power_of_2(n))
    buffers.append(torch.zeros(size, dtype=torch.int32, device=device))  # earlier ones stay alive for graphs
    return buffers[-1][:n]
