"""PackedSlotPool: experts admitted together are repacked in one batch into their slots, bit for bit what repacking
each expert alone gives, and layers with one part layout share a staging area."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")

from moerun.formats.quants import QuantType, row_nbytes  # noqa: E402
from moerun.kernels.quant.synthetic import random_quantized  # noqa: E402
from moerun.moe.offload.packed_pool import PackedSlotPool, packed_part_bytes  # noqa: E402
from moerun.moe.offload.store import PartSpec, weights_from_parts  # noqa: E402
from moerun.ops.quant import packed_parts  # noqa: E402

H, I = 256, 256  # noqa: E741


@pytest.fixture
def seed() -> int:
    """Fresh random blocks each run; the seed goes into failure messages."""
    return int.from_bytes(os.urandom(4), "little")


def specs(down: QuantType, gate: QuantType = QuantType.Q4_K) -> list[PartSpec]:
    """A Q4_K_M-like layer: gate and up Q4_K (or ``gate``), down of type ``down``."""
    return [PartSpec("w13", (I, row_nbytes(H, gate)), torch.uint8, gate, H, "gate"),
            PartSpec("w13", (I, row_nbytes(H, gate)), torch.uint8, gate, H, "up"),
            PartSpec("w2", (H, row_nbytes(I, down)), torch.uint8, down, I, "down")]  # fmt: skip


def expert_blocks(layer: list[PartSpec], n: int, gen: torch.Generator) -> list[torch.Tensor]:
    """Raw GGUF blocks of n random experts, one [n, rows, row bytes] tensor per part."""
    return [random_quantized(s.qtype, (n, s.shape[0], s.cols), "cpu", gen).raw.view(n, *s.shape) for s in layer]


def test_batched_repack_is_per_expert_repack(seed) -> None:
    gen = torch.Generator().manual_seed(seed)
    mxfp4 = specs(QuantType.MXFP4, QuantType.MXFP4)  # an MXFP4_MOE layer: bfloat16 scales in its slots
    layers = [specs(QuantType.Q6_K), specs(QuantType.Q4_K), specs(QuantType.Q6_K), mxfp4]
    pool = PackedSlotPool(layers, slots_per_layer=5, device=torch.device("cpu"))
    assert pool.staging_rows == 5 and pool.staging[0] is pool.staging[2] and pool.staging[0] is not pool.staging[1]
    for layer, slots in ((0, [3, 0, 4]), (1, [1]), (2, [2, 1, 0, 3, 4]), (0, [1, 2]), (3, [4, 0])):
        blocks = expert_blocks(layers[layer], len(slots), gen)
        for row in range(len(slots)):
            for view, part in zip(pool.staging_views(layer, row), blocks):
                view.copy_(part[row])
        pool.repack_staged(layer, slots)
        for row, slot in enumerate(slots):  # each slot holds exactly its expert, repacked alone
            w13, w2 = weights_from_parts([part[row : row + 1] for part in blocks], layers[layer])
            pooled = pool.weights(layer)[0] + pool.weights(layer)[1]
            for ours, alone in zip(pooled, packed_parts(w13) + packed_parts(w2)):
                for d, s in zip(ours.tensors(), alone.tensors()):
                    if d is not None:
                        assert torch.equal(d[slot], s[0]), f"seed={seed} layer={layer} slot={slot}"
    for layer in range(4):  # the null slot still decodes to zeros
        for p in pool.weights(layer)[0] + pool.weights(layer)[1]:
            assert p.dequantize(torch.float32)[pool.null_slot].abs().max() == 0


def test_batch_limits() -> None:
    pool = PackedSlotPool([specs(QuantType.Q6_K)], slots_per_layer=3, device=torch.device("cpu"))
    with pytest.raises(IndexError):
        pool.staging_views(0, 3)
    with pytest.raises(ValueError, match="1 to 3"):
        pool.repack_staged(0, [0, 1, 2, 0])
    with pytest.raises(IndexError, match="slot 3"):
        pool.repack_staged(0, [3])


@pytest.mark.parametrize("down", [QuantType.Q6_K, QuantType.Q4_K, QuantType.Q8_0, QuantType.MXFP4],
                         ids=lambda t: t.name)
def test_slot_bytes_as_the_planner_counts_them(down) -> None:
    # the planner budgets each slot by packed_part_bytes; a slot of the pool holds exactly that
    layer = specs(down, down if down == QuantType.MXFP4 else QuantType.Q4_K)
    pool = PackedSlotPool([layer], slots_per_layer=2, device=torch.device("cpu"))
    held = sum(t[0].numel() * t.element_size() for parts in pool.weights(0) for p in parts for t in p.tensors()
               if t is not None)
    assert held == sum(packed_part_bytes(s) for s in layer)


def test_host_copy_replaces_the_staging_area(seed) -> None:
    from moerun.moe.offload.store import HostExpertStore

    gen = torch.Generator().manual_seed(seed)
    layers = [specs(QuantType.Q6_K), specs(QuantType.Q4_K)]
    store = HostExpertStore([expert_blocks(layer, 4, gen) for layer in layers], layers)
    pool = PackedSlotPool(layers, slots_per_layer=2, device=torch.device("cpu"), store=store, host_copy=True)
    assert pool.host_packed is not None and not pool.staging
    with pytest.raises(ValueError, match="no staging area"):
        pool.staging_views(0, 0)
    with pytest.raises(ValueError, match="no staging area"):
        pool.repack_staged(0, [0])
    for d, s in zip(*pool.packed_copy(1, 1, 3)):
        d.copy_(s)
    w13, w2 = weights_from_parts([part[3:4] for part in store.parts[1]], layers[1])
    for ours, alone in zip(pool.weights(1)[0] + pool.weights(1)[1], packed_parts(w13) + packed_parts(w2)):
        for d, s in zip(ours.tensors(), alone.tensors()):
            if d is not None:
                assert torch.equal(d[1], s[0]), f"seed={seed}"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (a pinned host store)")
def test_admission_copies_the_pinned_packed_copy(seed) -> None:
    from moerun.moe.offload.store import HostExpertStore

    gen = torch.Generator().manual_seed(seed)
    layers = [specs(QuantType.Q6_K), specs(QuantType.Q4_K)]
    E = 6
    store = HostExpertStore([expert_blocks(layer, E, gen) for layer in layers], layers)
    store.pin()
    pool = PackedSlotPool(layers, slots_per_layer=3, device=torch.device("cuda"), store=store)
    assert pool.host_packed is not None
    for layer, slot, expert in ((0, 2, 5), (1, 0, 3), (0, 0, 1)):
        for d, s in zip(*pool.packed_copy(layer, slot, expert)):
            assert s.is_pinned()
            d.copy_(s)
        w13, w2 = weights_from_parts([part[expert : expert + 1] for part in store.parts[layer]], layers[layer])
        pooled = pool.weights(layer)[0] + pool.weights(layer)[1]
        for ours, alone in zip(pooled, packed_parts(w13) + packed_parts(w2)):
            for d, s in zip(ours.tensors(), alone.tensors()):
                if d is not None:
                    assert torch.equal(d[slot].cpu(), s[0]), f"seed={seed} layer={layer} slot={slot}"
    with pytest.raises(IndexError, match="slot 3"):
        pool.packed_copy(0, 3, 0)
