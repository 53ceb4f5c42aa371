"""How much memory a device has free (to size the KV cache and plan offloading)."""

from __future__ import annotations

import os

import torch


def available_bytes(device: torch.device) -> int:
    """Free bytes on a CUDA device, or the host's available memory for CPU."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES"))
