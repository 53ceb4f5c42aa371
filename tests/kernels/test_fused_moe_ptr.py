"""fused_moe_indirect (address tables) against fused_moe_reference on the weights the tables point at.

Each table mixes two memories: some experts point into a "pool" of slots, the others at their rows of a "store".
On CUDA the pool is device memory and the store pinned host memory (read over PCIe in place); in Triton's
interpreter both are host memory.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from moerun.ops.moe import fused_moe_indirect  # noqa: E402
from moerun.kernels.fused_moe import fused_moe_triton  # noqa: E402
from moerun.kernels.fused_moe_ptr import fused_moe_indirect_triton  # noqa: E402
from moerun.moe.offload.pointers import ExpertPointers, address_alignment, tensor_at  # noqa: E402
from moerun.ops.moe_reference import fused_moe_reference, route_reference  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")

GEMV = {"path": "gemv", "BLOCK_N": 32, "BLOCK_K": 32, "BLOCK_N2": 32, "BLOCK_K2": 32, "reduce": "sum"}
GEMV_ATOMIC = {**GEMV, "reduce": "atomic"}
GEMV_FUSED = {**GEMV, "reduce": "fused"}
TILE = {"path": "tile", "BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 32, "GROUP_M": 2, "reduce": "atomic"}
TILE_SUM = {**TILE, "GROUP_M": 1, "reduce": "sum"}
CONFIGS = {"gemv": GEMV, "gemv-atomic": GEMV_ATOMIC, "gemv-fused": GEMV_FUSED, "tile": TILE, "tile-sum": TILE_SUM}
TOLERANCE = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}


class Layer:
    """A layer's experts split between a pool of slots and a store; the tables say where each expert is."""

    def __init__(self, E: int, H: int, I: int, dtype: torch.dtype, g: torch.Generator) -> None:  # noqa: E741
        S = max(1, E // 2)
        self.store13 = (torch.randn(E, 2 * I, H, generator=g) / H**0.5).to(dtype)  # [E, 2I, H]
        self.store2 = (torch.randn(E, H, I, generator=g) / I**0.5).to(dtype)  # [E, H, I]
        self.pool13 = (torch.randn(S, 2 * I, H, generator=g) / H**0.5).to(dtype).to(DEVICE)  # [S, 2I, H]
        self.pool2 = (torch.randn(S, H, I, generator=g) / I**0.5).to(dtype).to(DEVICE)  # [S, H, I]
        if DEVICE.type == "cuda":
            self.store13, self.store2 = self.store13.pin_memory(), self.store2.pin_memory()
        # experts in a random half sit in distinct slots, the rest are read from the store
        order = torch.randperm(E, generator=g).tolist()
        self.slot = {e: s for s, e in enumerate(order[:S])}
        self.E, self.H, self.I, self.dtype = E, H, I, dtype

    def tables(self) -> ExpertPointers:
        w13 = [self.pool13[self.slot[e]] if e in self.slot else self.store13[e] for e in range(self.E)]
        w2 = [self.pool2[self.slot[e]] if e in self.slot else self.store2[e] for e in range(self.E)]
        addresses = [t.data_ptr() for t in w13 + w2]
        strides = [t[0].numel() * t.element_size() for t in (self.store13, self.store2)]
        return ExpertPointers(
            torch.tensor([t.data_ptr() for t in w13], dtype=torch.int64, device=DEVICE),
            torch.tensor([t.data_ptr() for t in w2], dtype=torch.int64, device=DEVICE),
            self.H, self.I, self.dtype, address_alignment(*addresses, *strides),
            (self.pool13, self.pool2, self.store13, self.store2),
        )

    def stacked(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The weights the tables point at, stacked [E, ...] on the device."""
        w13 = torch.stack([self.pool13[self.slot[e]] if e in self.slot else self.store13[e].to(DEVICE)
                           for e in range(self.E)])
        w2 = torch.stack([self.pool2[self.slot[e]] if e in self.slot else self.store2[e].to(DEVICE)
                          for e in range(self.E)])
        return w13, w2


def routing(T: int, E: int, k: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    weights, ids = route_reference(torch.randn(T, E, generator=g), k, True)
    return weights.to(DEVICE), ids.to(DEVICE)


def fp32_case(seed: int, T: int, E: int, H: int, I: int, k: int):  # noqa: E741
    """(generator, layer, routing weights, ids, hidden, pointer tables) of a float32 layer."""
    g = torch.Generator().manual_seed(seed)
    layer = Layer(E, H, I, torch.float32, g)
    weights, ids = routing(T, E, k, g)
    hidden = torch.randn(T, H, generator=g).to(DEVICE)
    return g, layer, weights, ids, hidden, layer.tables()


def check_close(seed: int, out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    tol = TOLERANCE[dtype]
    scale = ref.float().abs().max().item() + 1e-6
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol * scale,
                               msg=lambda m: f"seed={seed} {what}: {m}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("config", ["gemv", "tile"])
@pytest.mark.parametrize(
    "T,E,H,I,k",
    [(1, 7, 48, 40, 2), (3, 13, 33, 17, 8), (1, 5, 64, 32, 1), (35, 9, 32, 48, 2)],
    ids=["T1-E7-k2", "T3-E13-k8-oddHI", "T1-E5-k1", "T35-E9-k2-blocks"],
)
def test_indirect_kernel_matches_reference(seed, T, E, H, I, k, config, dtype) -> None:  # noqa: E741
    g = torch.Generator().manual_seed(seed)
    layer = Layer(E, H, I, dtype, g)
    weights, ids = routing(T, E, k, g)
    hidden = torch.randn(T, H, generator=g).to(dtype).to(DEVICE)
    ptrs = layer.tables()
    out = fused_moe_indirect_triton(hidden, ptrs.w13, ptrs.w2, I, dtype, weights, ids, ptrs.align,
                                    CONFIGS[config])
    ref = fused_moe_reference(hidden, *layer.stacked(), weights, ids)
    assert out.dtype == hidden.dtype and out.shape == hidden.shape
    check_close(seed, out, ref, dtype, f"config={config} align={ptrs.align}")


@pytest.mark.parametrize("config", ["gemv-atomic", "gemv-fused", "tile-sum"])
def test_other_slot_reductions(seed, config) -> None:
    I = 32  # noqa: E741
    _, layer, weights, ids, hidden, ptrs = fp32_case(seed, 3, 6, 32, I, 2)
    out = fused_moe_indirect_triton(hidden, ptrs.w13, ptrs.w2, I, torch.float32, weights, ids, ptrs.align,
                                    CONFIGS[config])
    check_close(seed, out, fused_moe_reference(hidden, *layer.stacked(), weights, ids), torch.float32, config)


def test_atomic_sums_kept_in_float32(seed) -> None:
    # the gemv path's atomic reduce through address tables: GEMM 1 zeroes the float32 sums, which keep_float32
    # hands on unrounded; they equal the stacked weights' (bit for bit where programs run in order: the CPU)
    g = torch.Generator().manual_seed(seed)
    T, E, H, I, k = 2, 7, 48, 40, 3  # noqa: E741
    layer = Layer(E, H, I, torch.bfloat16, g)
    weights, ids = routing(T, E, k, g)
    hidden = torch.randn(T, H, generator=g).to(torch.bfloat16).to(DEVICE)
    ptrs = layer.tables()
    out = fused_moe_indirect(hidden, ptrs, weights, ids, backend="triton", keep_float32=True)
    assert out.dtype == torch.bfloat16  # the default config (slots summed in a fixed order) rounds in its launch
    out = fused_moe_indirect_triton(hidden, ptrs.w13, ptrs.w2, I, torch.bfloat16, weights, ids, ptrs.align,
                                    GEMV_ATOMIC, keep_float32=True)
    want = fused_moe_triton(hidden, *layer.stacked(), weights, ids, GEMV_ATOMIC, keep_float32=True)
    assert out.dtype == want.dtype == torch.float32
    scale = want.abs().max().item()
    same = {"rtol": 1e-5, "atol": 1e-6 * scale} if DEVICE.type == "cuda" else {"rtol": 0, "atol": 0}
    torch.testing.assert_close(out, want, **same, msg=lambda m: f"seed={seed}: {m}")
    check_close(seed, out, fused_moe_reference(hidden, *layer.stacked(), weights, ids), torch.bfloat16, "kept")


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_op_dispatch_and_hidden_in_another_dtype(seed, backend) -> None:
    g = torch.Generator().manual_seed(seed)
    T, E, H, I, k = 2, 5, 32, 16, 2  # noqa: E741
    layer = Layer(E, H, I, torch.float32, g)
    weights, ids = routing(T, E, k, g)
    hidden = torch.randn(T, H, generator=g).to(torch.bfloat16).to(DEVICE)
    out = fused_moe_indirect(hidden, layer.tables(), weights, ids, backend=backend)
    ref = fused_moe_reference(hidden, *layer.stacked(), weights, ids)
    assert out.dtype == torch.bfloat16
    if backend == "torch":  # the reference on pointers computes exactly what it computes on stacked weights
        assert torch.equal(out, ref)
    else:
        torch.testing.assert_close(out.float(), ref.float(), rtol=1e-2, atol=2e-2)


def test_tables_can_change_between_calls(seed) -> None:
    # the same table tensors, re-pointed in place (as the expert cache does between decode steps)
    I = 32  # noqa: E741
    _, layer, weights, ids, hidden, ptrs = fp32_case(seed, 1, 4, 32, I, 2)
    before = fused_moe_indirect_triton(hidden, ptrs.w13, ptrs.w2, I, torch.float32, weights, ids, ptrs.align, GEMV)
    check_close(seed, before, fused_moe_reference(hidden, *layer.stacked(), weights, ids), torch.float32, "before")
    layer.slot = {}  # every expert back at its store row
    moved = layer.tables()
    ptrs.w13.copy_(moved.w13)
    ptrs.w2.copy_(moved.w2)
    after = fused_moe_indirect_triton(hidden, ptrs.w13, ptrs.w2, I, torch.float32, weights, ids, ptrs.align, GEMV)
    check_close(seed, after, fused_moe_reference(hidden, *layer.stacked(), weights, ids), torch.float32, "after")


def test_address_resolution_errors() -> None:
    a = torch.zeros(4, 8)
    assert torch.equal(tensor_at(a[2].data_ptr(), (8,), torch.float32, (a,)), a[2])
    with pytest.raises(ValueError, match="none of the 1 regions"):
        tensor_at(a[3].data_ptr(), (16,), torch.float32, (a,))
    with pytest.raises(ValueError, match="not aligned"):
        tensor_at(a.data_ptr() + 2, (2,), torch.float32, (a,))
    assert address_alignment(64, 4096) == 16 and address_alignment(64, 2244) == 4 and address_alignment(6) == 2


@pytest.mark.parametrize("config", ["gemv", "gemv-atomic", "gemv-fused", "tile"])
def test_staged_pairs_computed_after_the_wait(seed, config) -> None:
    # the pairs flagged as staged point at poisoned weights until wait() (standing in for the copy landing) points
    # them at the real ones, and the other pairs' w13 at poison from then on: the gemv path computes the other pairs
    # first, the flagged ones after the wait, and gives the same result, bit for bit, as one pass; the tile path
    # waits first
    from moerun.kernels.moe_parts import StagedPairs

    T, E, H, I, k = 3, 8, 32, 48, 3  # noqa: E741
    g, layer, weights, ids, hidden, ptrs = fp32_case(seed, T, E, H, I, k)
    want = fused_moe_indirect_triton(hidden, ptrs.w13, ptrs.w2, I, torch.float32, weights, ids, ptrs.align,
                                     CONFIGS[config])
    staged_experts = ids.reshape(-1)[torch.randperm(T * k, generator=g)[: T * k // 2].to(DEVICE)].unique()
    flags = torch.isin(ids.reshape(-1), staged_experts).to(torch.int32)  # [T*k]
    poison13 = torch.full((2 * I, H), float("nan"), device=DEVICE)
    poison2 = torch.full((H, I), float("nan"), device=DEVICE)
    w13, w2 = ptrs.w13.clone(), ptrs.w2.clone()
    ptrs.w13[staged_experts] = poison13.data_ptr()
    ptrs.w2[staged_experts] = poison2.data_ptr()
    waits = []

    def wait() -> None:
        waits.append(True)
        if config == "tile":  # it computes every pair after the wait
            ptrs.w13.copy_(w13)
        else:
            ptrs.w13.fill_(poison13.data_ptr())
            ptrs.w13[staged_experts] = w13[staged_experts]
        ptrs.w2.copy_(w2)

    got = fused_moe_indirect_triton(hidden, ptrs.w13, ptrs.w2, I, torch.float32, weights, ids, ptrs.align,
                                    CONFIGS[config], staged=StagedPairs(flags, wait))
    assert len(waits) == 1
    if config in ("tile", "gemv-atomic"):  # fp32 atomics: the slot sum's order may differ from run to run on a GPU
        check_close(seed, got, want, torch.float32, config)
    else:
        assert torch.equal(got, want), f"seed={seed}"
