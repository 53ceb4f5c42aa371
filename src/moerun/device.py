"""Small host -> device copies that never wait for work queued on the device (through pinned memory on CUDA).

A pageable host-to-device copy waits for the stream, which async scheduling (a decode step always queued) and the
expert offloading (copies and passes in flight) must avoid.
"""

from __future__ import annotations

import numpy as np
import torch


def to_device(values: list | np.ndarray, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """values (a list, or a numpy array keeping its dtype when dtype is None) as a tensor on device."""
    t = torch.from_numpy(np.ascontiguousarray(values)) if isinstance(values, np.ndarray) else torch.tensor(values)
    if dtype is not None:
        t = t.to(dtype)
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)
