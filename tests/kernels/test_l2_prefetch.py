"""The L2 prefetch arguments (kernels/l2_prefetch.py): which byte ranges a launch is given. The prefetch itself
changes no result and runs only on sm_90 GPUs (compiled by tests/kernels/sm90_compile.py; the GPU tests of CUDA
graphs compare tokens with it on and off)."""

from __future__ import annotations

import pytest
import torch

from moerun.kernels import l2_prefetch
from moerun.layers.linear import Linear


@pytest.fixture
def enabled(monkeypatch):
    monkeypatch.setattr(l2_prefetch, "prefetch_enabled", lambda device, what: True)


def test_off_unless_named(monkeypatch) -> None:
    monkeypatch.setenv("MOERUN_L2_PREFETCH", "o_proj,w2")
    assert not l2_prefetch.prefetch_enabled(torch.device("cpu"), "o_proj")  # CUDA only
    assert l2_prefetch.l2_regions([torch.empty(64)]) is None
    assert l2_prefetch.expert_regions([torch.empty(4, 64)]) == {}


def test_regions_are_the_largest_tensors_whole(enabled) -> None:
    big, mid, small = torch.empty(1000, dtype=torch.float16), torch.empty(300), torch.empty(10)
    regions = l2_prefetch.l2_regions([small, big, mid])
    assert len(regions.regions) == l2_prefetch.MAX_REGIONS == 2
    first, second = regions.regions
    assert first.data_ptr() == big.data_ptr() and first.numel() == 2000 and first.dtype == torch.uint8
    assert second.data_ptr() == mid.data_ptr() and second.numel() == 1200
    args = regions.kernel_args()
    assert args["PREFETCH"] == 2 and args["pf0_bytes"] == 2000 and args["pf1_bytes"] == 1200
    # lengths trimmed to the instruction's 16-byte multiples; a start off 16 bytes is left out
    odd = torch.empty(1001, dtype=torch.uint8)
    assert l2_prefetch.l2_regions([odd]).regions[0].numel() == 992
    assert l2_prefetch.l2_regions([odd[1:]]) is None
    one = l2_prefetch.l2_regions([big]).kernel_args()
    assert one["PREFETCH"] == 1 and one["pf1_ptr"] is one["pf0_ptr"]


def test_expert_regions_step_by_expert(enabled) -> None:
    codes, scales = torch.empty(8, 64, 48, dtype=torch.uint8), torch.empty(8, 64, 2, dtype=torch.float16)
    args = l2_prefetch.expert_regions([scales, codes])
    pf = args["pfe"]
    assert args["PFE"] == 2
    assert (pf.ptr0.data_ptr(), pf.stride0, pf.bytes0) == (codes.data_ptr(), 64 * 48, 64 * 48)
    assert (pf.ptr1.data_ptr(), pf.stride1, pf.bytes1) == (scales.data_ptr(), 256, 256)
    assert l2_prefetch.expert_regions([torch.empty(8, 3, dtype=torch.uint8)]) == {}  # 3-byte expert stride


def test_linear_stored_tensors() -> None:
    # what the o_proj / q|k|v prefetch is given: the dense weight, or a GGUF weight's repacked arrays once they
    # exist (none before: the prefetch never makes them)
    from moerun.formats.quants import QuantizedTensor
    from moerun.layers.quantized import QuantizedWeight, set_quantized
    from moerun.ops.quant import packed_parts

    layer = Linear(256, 16)
    assert layer.stored_tensors() == [layer.weight]
    set_quantized(layer, "weight", QuantizedWeight([QuantizedTensor.from_float(torch.randn(16, 256), "Q4_K")]))
    assert layer.stored_tensors() == []
    (packed,) = packed_parts(layer.__dict__["q_weight"])
    stored = layer.stored_tensors()
    assert len(stored) == len(packed.arrays) >= 2 and all(a is b for a, b in zip(stored, packed.arrays))
    assert stored[0] is packed.codes
