"""The host store's memory: arenas start on a 2 MiB boundary (so transparent huge pages can back them) and hold
exactly what is written into them; on CUDA they come back page-locked and unlock through their registry."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from moerun.moe.offload.store import HUGE_PAGE, huge_page_empty, pinned_empty, unregister_all


@pytest.mark.parametrize("nbytes", [1, 4096, HUGE_PAGE - 1, 3 * HUGE_PAGE + 12345])
def test_huge_page_empty_is_aligned_and_exact(nbytes: int) -> None:
    t = huge_page_empty(nbytes)
    assert t.dtype == torch.uint8 and t.numel() == nbytes
    assert t.data_ptr() % HUGE_PAGE == 0 and t.untyped_storage().data_ptr() == t.data_ptr()
    data = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    t.copy_(data)
    assert torch.equal(t, data)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="page-locking needs CUDA")
def test_pinned_empty_is_locked_and_released() -> None:
    registry: list[int] = []
    nbytes = 2 * HUGE_PAGE + 7
    t = pinned_empty(nbytes, registry)
    assert t.numel() == nbytes and t.is_pinned() and t[HUGE_PAGE:].is_pinned()
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    t.copy_(src)
    assert torch.equal(t.to("cuda", non_blocking=True).cpu(), src)
    unregister_all(registry)
    assert registry == []


def _vm_flags(address: int) -> list[str]:
    """The VmFlags of the mapping holding ``address`` in this process (Linux's /proc/self/smaps)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and head == "VmFlags:":
            return line.split()[1:]
    return []


@pytest.mark.skipif(not Path("/sys/kernel/mm/transparent_hugepage/enabled").exists(),
                    reason="no transparent huge pages here")
def test_huge_page_empty_is_advised() -> None:
    t = huge_page_empty(4 * HUGE_PAGE)
    assert "hg" in _vm_flags(t.data_ptr())  # MADV_HUGEPAGE took
