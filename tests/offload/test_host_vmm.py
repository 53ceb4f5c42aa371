"""Host memory from the CUDA driver (moe/offload/host_vmm.py): written by the CPU, read in place by a kernel, released
without leaking; without a CUDA driver the allocators answer None so that callers fall back."""

from __future__ import annotations

import pytest
import torch

from moerun.moe.offload import host_vmm

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the fallback where no CUDA driver is loaded")
def test_without_cuda_the_allocators_give_none() -> None:
    assert host_vmm.vmm_host_empty(1 << 20, torch.device("cuda")) is None
    assert host_vmm.write_combined_empty(1 << 20) is None


@cuda
@pytest.mark.parametrize("kind", ["vmm", "write_combined"])
def test_kernels_read_experts_in_place(kind: str) -> None:
    """Experts written into the region by the CPU, read over PCIe by the fused MoE through address tables, give
    the reference's output on the same weights."""
    from moerun.kernels.fused_moe_ptr import fused_moe_indirect_triton
    from moerun.ops.moe import route
    from moerun.ops.moe_reference import fused_moe_reference

    device = torch.device("cuda")
    E, H, I, k, T = 6, 256, 128, 2, 3  # noqa: E741
    w13 = torch.randn(E, 2 * I, H, dtype=torch.bfloat16) / 16
    w2 = torch.randn(E, H, I, dtype=torch.bfloat16) / 16
    nbytes = (w13.numel() + w2.numel()) * 2 + 12_345  # not a multiple of any page or granularity
    region = host_vmm.vmm_host_empty(nbytes, device) if kind == "vmm" else host_vmm.write_combined_empty(nbytes)
    if region is None:
        pytest.skip(f"the driver gives no {kind} host memory here: {host_vmm.last_failure}")
    assert region.tensor.numel() == nbytes and region.tensor.device.type == "cpu"
    host13 = region.tensor[: w13.numel() * 2].view(torch.bfloat16).view(w13.shape).copy_(w13)
    host2 = region.tensor[w13.numel() * 2 : (w13.numel() + w2.numel()) * 2].view(torch.bfloat16).view(w2.shape)
    host2.copy_(w2)
    table13 = torch.tensor([host13[e].data_ptr() for e in range(E)], dtype=torch.int64, device=device)
    table2 = torch.tensor([host2[e].data_ptr() for e in range(E)], dtype=torch.int64, device=device)
    x = torch.randn(T, H, dtype=torch.bfloat16, device=device)
    weights, ids = route(torch.randn(T, E, device=device), k, True)
    got = fused_moe_indirect_triton(x, table13, table2, I, torch.bfloat16, weights, ids, 16)
    want = fused_moe_reference(x, w13.to(device), w2.to(device), weights, ids)
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
    torch.cuda.synchronize()
    region.close()
    region.close()  # idempotent
