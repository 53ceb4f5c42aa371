"""Quantized fused MoE through address tables: each expert's packed arrays read where a table points (a slot of a
small pool, or its row of the stacked store), bit for bit what the kernels compute on the stacked store."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from moerun.formats.quants import QuantType  # noqa: E402
from moerun.kernels.quant.fused_moe_quant import fused_moe_quant  # noqa: E402
from moerun.kernels.quant.repack import PackedWeight, expert_addresses  # noqa: E402
from moerun.kernels.quant.synthetic import random_quantized  # noqa: E402
from moerun.layers.quantized import QuantizedWeight  # noqa: E402
from moerun.ops.moe_reference import route_reference  # noqa: E402
from moerun.ops.quant import packed_parts  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
if DEVICE.type == "cuda":
    CONFIGS = {
        "gemv_v2": {"path": "gemv_v2", "BLOCK_N": 16, "BLOCK_K": 512, "BLOCK_N2": 8, "BLOCK_K2": 256},
        "gemv_v2_int8": {"path": "gemv_v2", "BLOCK_N": 32, "BLOCK_K": 512, "BLOCK_N2": 8, "BLOCK_K2": 256, "x_q8": True,
                         "inter_q8": True},
        "gemv": {"path": "gemv", "BLOCK_N": 16, "BLOCK_K": 256, "BLOCK_N2": 32, "BLOCK_K2": 256, "reduce": "sum"},
        "gemv_dot": {"path": "gemv_dot", "BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 128, "reduce": "sum"},
        "tile": {"path": "tile", "BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "GROUP_M": 4, "reduce": "atomic"},
        "tile-m2": {"path": "tile", "BLOCK_M": 16, "BLOCK_M2": 32, "BLOCK_N": 64, "BLOCK_K": 128, "GROUP_M": 4,
                    "reduce": "atomic"},  # GEMM 2 in blocks of two of GEMM 1's
    }
else:  # the interpreter runs programs one by one: one N-tile covers the test's rows
    CONFIGS = {
        "gemv_v2": {"path": "gemv_v2", "BLOCK_N": 256, "BLOCK_K": 4096, "BLOCK_N2": 256, "BLOCK_K2": 4096},
        "gemv_v2_int8": {"path": "gemv_v2", "BLOCK_N": 256, "BLOCK_K": 4096, "BLOCK_N2": 256, "BLOCK_K2": 4096,
                         "x_q8": True, "inter_q8": True},
        "gemv": {"path": "gemv", "BLOCK_N": 256, "BLOCK_K": 512, "BLOCK_N2": 256, "BLOCK_K2": 256, "reduce": "sum"},
        "gemv_dot": {"path": "gemv_dot", "BLOCK_M": 16, "BLOCK_N": 256, "BLOCK_K": 256, "reduce": "sum"},
        "tile": {"path": "tile", "BLOCK_M": 16, "BLOCK_N": 256, "BLOCK_K": 256, "reduce": "atomic"},
        "tile-m2": {"path": "tile", "BLOCK_M": 16, "BLOCK_M2": 32, "BLOCK_N": 256, "BLOCK_K": 256, "reduce": "atomic"},
    }
E, H, I, K = 5, 256, 256, 2  # noqa: E741
SLOTS = {3: 0, 1: 1}  # expert -> pool slot; the other experts are read from the store


def pooled(p: PackedWeight) -> PackedWeight:
    """A pool of len(SLOTS) + 1 slots holding copies of the SLOTS experts (the last slot zero)."""
    arrays = []
    for t in p.tensors():
        if t is None:
            arrays.append(None)
            continue
        pool = torch.zeros((len(SLOTS) + 1, *t.shape[1:]), dtype=t.dtype, device=t.device)
        for expert, slot in SLOTS.items():
            pool[slot].copy_(t[expert])
        arrays.append(pool)
    return PackedWeight(p.qtype, (len(SLOTS) + 1, *p.shape[1:]), p.k_pad, *arrays)


def table(store: PackedWeight, pool: PackedWeight) -> torch.Tensor:
    """[E, 4] addresses: the pool slot of a SLOTS expert, else the expert's row of the store."""
    rows = expert_addresses(store)
    in_pool = expert_addresses(pool)
    for expert, slot in SLOTS.items():
        rows[expert] = in_pool[slot]
    return rows.to(DEVICE)


@pytest.mark.parametrize("path,T", [("gemv_v2", 3), ("gemv_v2_int8", 3), ("gemv", 2), ("gemv_dot", 2), ("tile", 9),
                                    ("tile-m2", 9)])
@pytest.mark.parametrize("types", [("Q4_K", "Q6_K"), ("Q8_0", "Q8_0"), ("Q5_K", "Q5_K"), ("MXFP4", "MXFP4")],
                         ids=lambda t: "-".join(t))  # MXFP4: scales in bfloat16
def test_indirect_matches_stacked(seed, types, path, T) -> None:
    from moerun.kernels.quant.gemv_v2 import FLOAT_X_TYPES

    gate_t, down_t = (QuantType[t] for t in types)
    int8_only = gate_t not in FLOAT_X_TYPES
    if path == "gemv_v2" and int8_only:
        pytest.skip(f"gemv_v2 reads {gate_t.name} with int8 x only")
    w13 = QuantizedWeight([random_quantized(gate_t, (E, I, H), DEVICE), random_quantized(gate_t, (E, I, H), DEVICE)])
    w2 = QuantizedWeight([random_quantized(down_t, (E, H, I), DEVICE)])
    p13, p2 = packed_parts(w13), packed_parts(w2)[0]
    pool13, pool2 = [pooled(p) for p in p13], pooled(p2)
    tables = ([table(s, p) for s, p in zip(p13, pool13)], table(p2, pool2))
    hidden = torch.randn(T, H, device=DEVICE)
    weights, ids = (t.to(DEVICE) for t in route_reference(torch.randn(T, E), K, True))
    ids[0] = torch.tensor([3, 1])  # both pooled experts, and the others through the store
    cfg = CONFIGS[path]
    out = fused_moe_quant(hidden, pool13, pool2, weights, ids, cfg, tables=tables)
    if path != "gemv":
        ref_cfg = cfg
    elif int8_only:  # the gemv path takes no tables: gemv_v2 runs, with the only x the type takes
        ref_cfg = {**cfg, "path": "gemv_v2", "x_q8": True}
    else:
        ref_cfg = CONFIGS["gemv_v2"]
    ref = fused_moe_quant(hidden, p13, p2, weights, ids, ref_cfg)
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6, msg=lambda m: f"seed={seed} {types} {path}: {m}")


def test_tables_are_checked() -> None:
    w13 = QuantizedWeight([random_quantized(QuantType.Q8_0, (E, I, H), DEVICE)] * 2)
    w2 = QuantizedWeight([random_quantized(QuantType.Q8_0, (E, H, I), DEVICE)])
    p13, p2 = packed_parts(w13), packed_parts(w2)[0]
    weights, ids = (t.to(DEVICE) for t in route_reference(torch.randn(1, E), K, True))
    bad = ([expert_addresses(p13[0])[:2].to(DEVICE)], expert_addresses(p2).to(DEVICE))
    with pytest.raises(ValueError, match="one \\[E, 4\\] int64 table per w13 part"):
        fused_moe_quant(torch.randn(1, H, device=DEVICE), p13, p2, weights, ids, tables=bad)
