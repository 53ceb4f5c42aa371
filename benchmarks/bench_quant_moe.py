"""Benchmark (and optionally tune) the quantized fused-MoE kernels on one Qwen3-30B-A3B MoE layer.

For each quant type it times, per token count M: the quantized kernels (kernels/quant/fused_moe_quant.py) on
repacked GGUF weights; the former Triton path for quantized experts, dequantise the layer to bf16 then
fused_moe_triton; and fused_moe_triton on bf16 weights dequantised beforehand (the bf16 reference time).
Capturable implementations are replayed from CUDA graphs of several calls that rotate over weight copies and
routing sets, so the 60 MB L2 does not hold the touched experts between calls. Bandwidth counts the GGUF bytes
of the experts actually touched; the HBM read ceiling (bf16 sum over 2 GiB) is measured in the same run.
With --tune, a handful of configs per M bucket are timed first for the --tune-types (beside the default and the
shipped table; --tune-families x_q8 keeps to the int8-x decode configs) and the fastest written to
src/moerun/kernels/configs/quant_<TYPE>_E=..,H=..,I=..,device=....json (then used by the benchmark).

    python benchmarks/bench_quant_moe.py --tune --out bench_quant_out
    python benchmarks/bench_quant_moe.py --tune --tune-types Q4_K_M --types Q4_K_M --H 4096 --I 1536 --m 1 2 4 8

--compare times chosen configs of the tuning pool against the default instead (e.g. the gemv_v2 decode path):

    python benchmarks/bench_quant_moe.py --types Q4_K_M Q6_K Q8_0 --m 1 4 8 --compare g16 v16 v16k2 v16w8 v32
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_moe import DEVICE, empty_cache, measure_ceilings, timed_median  # noqa: E402

from moerun.formats.quants import QuantType  # noqa: E402
from moerun.kernels.fused_moe import fused_moe_triton  # noqa: E402
from moerun.kernels.quant import configs as qconfigs  # noqa: E402
from moerun.kernels.quant.fused_moe_quant import fused_moe_quant  # noqa: E402
from moerun.kernels.quant.gemv_v2 import FLOAT_X_TYPES  # noqa: E402
from moerun.kernels.quant.synthetic import random_quantized  # noqa: E402
from moerun.kernels.interpreter import interpreting  # noqa: E402
from moerun.kernels.tile_configs import CONFIG_DIR, Config, device_name  # noqa: E402
from moerun.layers.quantized import QuantizedWeight  # noqa: E402
from moerun.ops.moe_reference import route_reference  # noqa: E402
from moerun.ops.quant import fused_moe_quantized, has_kernel_layout, moe_tile_parts, packed_parts  # noqa: E402

DEFAULT_MS = tuple(2**i for i in range(13))  # 1 .. 4096
# Pseudo-types for mixed layers: (gate, up, down), as most layers of those files hold them.
MIXES = {"Q4_K_M": ("Q4_K", "Q4_K", "Q6_K"), "Q5_K_M": ("Q5_K", "Q5_K", "Q6_K"), "Q3_K_M": ("Q3_K", "Q3_K", "Q4_K")}
L2_BYTES = 60e6


# ------------------------------------------------------------------------------------------------- tuning


def _gemv(bn, bk, w, bn2, bk2) -> Config:
    return {"path": "gemv", "BLOCK_N": bn, "BLOCK_K": bk, "num_warps": w, "num_stages": 2, "BLOCK_N2": bn2,
            "BLOCK_K2": bk2, "num_warps2": w, "num_stages2": 2, "reduce": "sum"}  # fmt: skip


def _v2(bn, bk, w, bn2, bk2, w2, x_prep=False, x_q8=False, inter_q8=False, slots2=None) -> Config:
    """gemv_v2 (Q4_K, Q6_K, Q8_0; other types run these blocks on the gemv path): GEMM 1 BLOCK_N rows of
    gate/up in chunks of BLOCK_K inputs (x_prep: reading x prepared in the weights' layout by one more launch;
    x_q8: x quantized to int8 by one more launch, dp4a dot products); GEMM 2 BLOCK_N2 output rows of all k
    slots (slots2: that many at once), chunks of BLOCK_K2 (inter_q8: GEMM 1 writes its output as int8, GEMM 2
    takes dp4a too)."""
    cfg = {"path": "gemv_v2", "BLOCK_N": bn, "BLOCK_K": bk, "num_warps": w, "num_stages": 1, "BLOCK_N2": bn2,
           "BLOCK_K2": bk2, "num_warps2": w2, "num_stages2": 1, "x_prep": x_prep}  # fmt: skip
    if x_q8:
        cfg["x_q8"] = True
    if inter_q8:
        cfg["inter_q8"] = True
    if slots2:
        cfg["slots2"] = slots2
    return cfg


def _dot(path, bm, bn, bk, g, w, s, bn2=None, red="atomic") -> Config:
    cfg = {"path": path, "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": g, "num_warps": w,
           "num_stages": s, "reduce": red}  # fmt: skip
    if bn2:
        cfg["BLOCK_N2"] = bn2
    return cfg


# A small pool shared by the buckets, so each config compiles once per type.
POOL: dict[str, Config] = {
    "g16": _gemv(16, 1024, 4, 32, 768),
    "g16k256": _gemv(16, 256, 4, 32, 256),
    "g16w8": _gemv(16, 2048, 8, 32, 768),
    "g32": _gemv(32, 1024, 4, 64, 768),
    "d32": _dot("gemv_dot", 16, 32, 128, 1, 4, 2, 64, "sum"),
    "d32w2": _dot("gemv_dot", 16, 32, 256, 1, 2, 2, 64, "sum"),
    "d64": _dot("gemv_dot", 16, 64, 256, 1, 4, 2, 64, "sum"),
    "v16": _v2(16, 1024, 4, 8, 512, 4),
    "v16k2": _v2(16, 2048, 4, 8, 1024, 4),
    "v16w8": _v2(16, 2048, 8, 8, 512, 8),
    "v16w2": _v2(16, 512, 2, 4, 256, 2),
    "v32": _v2(32, 1024, 8, 16, 512, 8),
    "v16n4": _v2(16, 1024, 4, 4, 1024, 4),
    "v16n16": _v2(16, 1024, 4, 16, 256, 4),
    "v8": _v2(8, 1024, 2, 8, 512, 4),
    "v8k2": _v2(8, 2048, 4, 4, 1024, 2),
    "v16n2": _v2(16, 1024, 4, 2, 1024, 1),
    "v16n4w2": _v2(16, 1024, 4, 4, 1024, 2),
    "v32k2": _v2(32, 2048, 8, 8, 1024, 4),
    "v16p": _v2(16, 512, 2, 4, 256, 2, True),
    "v16k1p": _v2(16, 1024, 4, 8, 512, 4, True),
    "v8p": _v2(8, 1024, 2, 8, 512, 4, True),
    "v8k5p": _v2(8, 512, 2, 4, 256, 2, True),
    "v32p": _v2(32, 1024, 4, 8, 512, 4, True),
    "v4p": _v2(4, 512, 1, 4, 256, 2, True),
    "v8q": _v2(8, 512, 2, 4, 256, 2, x_q8=True),
    "v8k1q": _v2(8, 1024, 2, 4, 256, 2, x_q8=True),
    "v16q": _v2(16, 512, 2, 4, 256, 2, x_q8=True),
    "v16k1q": _v2(16, 1024, 4, 8, 512, 4, x_q8=True),
    "v16k2q": _v2(16, 2048, 4, 8, 512, 4, x_q8=True),
    "v32q": _v2(32, 1024, 4, 4, 256, 2, x_q8=True),
    "v32k2q": _v2(32, 2048, 8, 8, 512, 4, x_q8=True),
    "v4q": _v2(4, 1024, 1, 4, 256, 2, x_q8=True),
    "v32qq": _v2(32, 2048, 4, 8, 512, 4, x_q8=True, inter_q8=True),
    "v32qqk1": _v2(32, 1024, 4, 8, 768, 4, x_q8=True, inter_q8=True),
    "v32qqn4": _v2(32, 2048, 4, 4, 768, 2, x_q8=True, inter_q8=True),
    "v32qqn16": _v2(32, 2048, 8, 16, 768, 4, x_q8=True, inter_q8=True),
    "v32qqw2": _v2(32, 2048, 2, 8, 768, 2, x_q8=True, inter_q8=True),
    "v64qq": _v2(64, 2048, 8, 8, 768, 4, x_q8=True, inter_q8=True),
    # GEMM 2 holding 4 or 2 of the 8 slots at once: about half the registers (Q6_K down 246 -> 122 / 96 a thread
    # in an offline sm_90 compile of the 8-row tile), twice the programs an SM
    "v16k2qs4": _v2(16, 2048, 4, 8, 512, 4, x_q8=True, slots2=4),
    "v16k2qs2": _v2(16, 2048, 4, 8, 512, 4, x_q8=True, slots2=2),
    "v16k2qn16s2": _v2(16, 2048, 4, 16, 512, 4, x_q8=True, slots2=2),
    "v32qqs4": _v2(32, 2048, 4, 8, 768, 4, x_q8=True, inter_q8=True, slots2=4),
    # the tables' decode tiles (H200, 30B: M = 1 and M = 2 ... 8) with GEMM 2 reading the intermediate in its rows'
    # tile shape (x_tile2: no shared-memory moves of the intermediate; not yet timed)
    "v16k2qxt": {**_v2(16, 2048, 4, 8, 512, 4, x_q8=True), "x_tile2": True},
    "v32qqk1xt": {**_v2(32, 1024, 4, 8, 768, 4, x_q8=True, inter_q8=True), "x_tile2": True},
    "v32qqn16s2": _v2(32, 2048, 4, 16, 768, 4, x_q8=True, inter_q8=True, slots2=2),
    # GEMM 2 one program per (token, slot) pair, its rows added into a float32 output by atomics (sum2): the M = 1
    # and M = 4 tiles the 30B table took from an H100 (thirty-first sitting), and 16 rows at 2 warps
    "v16k2qp": {**_v2(16, 2048, 4, 8, 768, 1, x_q8=True), "sum2": "atomic"},
    "v32qqk1p": {**_v2(32, 1024, 4, 8, 768, 1, x_q8=True, inter_q8=True), "sum2": "atomic"},
    "v16k2qp16": {**_v2(16, 2048, 4, 16, 768, 2, x_q8=True), "sum2": "atomic"},
    "t16x64": _dot("tile", 16, 64, 128, 1, 4, 3),
    "t16x128": _dot("tile", 16, 128, 128, 1, 4, 3),
    "t32x128": _dot("tile", 32, 128, 128, 8, 4, 3),
    "t64x128": _dot("tile", 64, 128, 128, 8, 8, 3),
    "t128x64": _dot("tile", 128, 64, 128, 8, 8, 3, 128),
    "t128x128": _dot("tile", 128, 128, 128, 8, 8, 3),
    # per-slot rows in the output dtype, summed after (no atomics): what the bf16 tables take at M >= 1024
    "t64x128so": _dot("tile", 64, 128, 128, 8, 8, 3, red="sum_out"),
    "t128x128so": _dot("tile", 128, 128, 128, 8, 8, 3, red="sum_out"),
    "deq": {"path": "dequant"},  # the layer decoded to bf16, then the bf16 fused MoE with its own tables
    # tile64: one 64-input pair decoded a step, every load issued ahead by the pipeliner (Q4_K/Q5_K/Q6_K/Q8_0)
    "k16x64": _dot("tile64", 16, 64, 64, 1, 4, 3),
    "k16x128": _dot("tile64", 16, 128, 64, 1, 4, 3),
    "k32x64": _dot("tile64", 32, 64, 64, 8, 4, 4),
    "k32x128": _dot("tile64", 32, 128, 64, 8, 4, 3),
    "k64x64": _dot("tile64", 64, 64, 64, 8, 4, 4),
    "k64x128": _dot("tile64", 64, 128, 64, 8, 4, 3),
    "k128x64": _dot("tile64", 128, 64, 64, 8, 4, 4),
    "k128x64so": _dot("tile64", 128, 64, 64, 8, 4, 4, red="sum_out"),
    "k256x64": _dot("tile64", 256, 64, 64, 8, 8, 3),
    "k128x128": _dot("tile64", 128, 128, 64, 8, 8, 3),
    "k64x128so": _dot("tile64", 64, 128, 64, 8, 4, 3, red="sum_out"),
    "k128x128so": _dot("tile64", 128, 128, 64, 8, 8, 3, red="sum_out"),
    # GEMM 2 in M-blocks of 256 (BLOCK_M2): each down tile decoded once for up to 256 tokens
    "k128x64m256": {**_dot("tile64", 128, 64, 64, 8, 4, 4), "BLOCK_M2": 256, "num_stages2": 3},
    "k128x64m256so": {**_dot("tile64", 128, 64, 64, 8, 4, 4, red="sum_out"), "BLOCK_M2": 256, "num_stages2": 3},
    "k128x64m256s2": {**_dot("tile64", 128, 64, 64, 8, 4, 4), "BLOCK_M2": 256, "num_stages2": 2},
    "k64x64m128": {**_dot("tile64", 64, 64, 64, 8, 4, 4), "BLOCK_M2": 128},
    "k64x64m256": {**_dot("tile64", 64, 64, 64, 8, 4, 4), "BLOCK_M2": 256, "num_stages2": 3},
    # Short tail tiles (TAIL_M for GEMM 1's blocks of 128, TAIL_M2 for GEMM 2's of 256): an expert's last block with
    # few token-slots multiplies only that many rows; the decode of the weight tile stays the same. Under uniform
    # top-8 routing the products fall to 0.73x at M = 1024 (t64), 0.76x / 0.74x for GEMM 1 / 2 at 2048 (t32, t128)
    # and 0.86x / 0.76x at 4096 (t32, t64) of the untailed tiles' (benchmarks/RESULTS.md, fortieth sitting). On an
    # H100, sot64 at 1024 and m256sot32 at 2048 were the fastest forms for Q4_K, Q5_K, Q6_K and Q8_0 (forty-first).
    "k128x64m256sot32": {**_dot("tile64", 128, 64, 64, 8, 4, 4, red="sum_out"), "BLOCK_M2": 256, "num_stages2": 3,
                         "TAIL_M": 32, "TAIL_M2": 128},
    "k128x64m256sot64": {**_dot("tile64", 128, 64, 64, 8, 4, 4, red="sum_out"), "BLOCK_M2": 256, "num_stages2": 3,
                         "TAIL_M": 64, "TAIL_M2": 128},
    "k128x64m256sot32g1": {**_dot("tile64", 128, 64, 64, 8, 4, 4, red="sum_out"), "BLOCK_M2": 256,
                           "num_stages2": 3, "TAIL_M": 32},
    "k128x64m256sot128g2": {**_dot("tile64", 128, 64, 64, 8, 4, 4, red="sum_out"), "BLOCK_M2": 256,
                            "num_stages2": 3, "TAIL_M2": 128},
    "k128x64m256sot32t64": {**_dot("tile64", 128, 64, 64, 8, 4, 4, red="sum_out"), "BLOCK_M2": 256,
                            "num_stages2": 3, "TAIL_M": 32, "TAIL_M2": 64},
    "k128x64sot64": {**_dot("tile64", 128, 64, 64, 8, 4, 4, red="sum_out"), "TAIL_M": 64, "TAIL_M2": 64},
    # GEMM 1's gate and up in programs of their own (split13): one accumulator a program, so blocks of 256 token-slots
    # fit the registers of today's 128 and each decoded gate or up tile serves up to 256 (1.00 decodes a weight at
    # M = 2048 instead of 1.48, 1.48 at 4096 instead of 2.49 under uniform routing); tails as above. On an H100,
    # splt64 was the fastest form at 4096 for every K-quant type; without tails, split lost at 2048 (forty-first).
    "k256x64split": {**_dot("tile64", 256, 64, 64, 8, 4, 3, red="sum_out"), "split13": True},
    "k256x64splt128": {**_dot("tile64", 256, 64, 64, 8, 4, 3, red="sum_out"), "split13": True, "TAIL_M": 128,
                       "TAIL_M2": 128},
    "k256x64splt64": {**_dot("tile64", 256, 64, 64, 8, 4, 3, red="sum_out"), "split13": True, "TAIL_M": 64,
                      "TAIL_M2": 64},
    # Variants with fewer registers a thread, all slower on an H200 (us at M = 2048 / 4096 against k128x64m256so's
    # 733.6 / 1,214.0 for Q4_K_M, 777.5 / 1,260.5 for Q6_K; benchmarks/RESULTS.md, twenty-fourth sitting); for
    # --compare. The shipped tiles take 248-255 registers with no spill worth counting (sm_90, Triton 3.6, compiled
    # with a launch's argument specialisation; the twenty-sixth sitting corrects the earlier spill counts).
    # Both GEMMs at 8 warps (163 / 142 registers for Q4_K): 1,249.2 / 1,988.8 and 1,336.6 / 2,157.8.
    "k128x64w8m256": {**_dot("tile64", 128, 64, 64, 8, 8, 4), "BLOCK_M2": 256, "num_stages2": 3},
    "k128x64w8m256so": {**_dot("tile64", 128, 64, 64, 8, 8, 4, red="sum_out"), "BLOCK_M2": 256, "num_stages2": 3},
    # GEMM 2 alone at 8 warps (142 registers): 892.0 / 1,391.6, 939.5 / 1,497.0
    "k128x64m256sow2": {**_dot("tile64", 128, 64, 64, 8, 4, 4, red="sum_out"), "BLOCK_M2": 256, "num_stages2": 3,
                        "num_warps2": 8},
    # registers capped at 168 a thread, three programs an SM instead of two, with spills (33-60 stores a thread):
    # 1,090.1 / 1,711.5, 1,350.0 / 2,160.9
    "k128x64m256sor168": {**_dot("tile64", 128, 64, 64, 8, 4, 4, red="sum_out"), "BLOCK_M2": 256, "num_stages2": 3,
                          "maxnreg": 168, "maxnreg2": 168},
}


X_Q8 = ["v8q", "v8k1q", "v16q", "v16k1q", "v16k2q", "v32q", "v32k2q", "v4q", "v32qq", "v32qqk1", "v32qqn4", "v32qqn16",
        "v32qqw2", "v64qq", "v16k2qs4", "v16k2qs2", "v16k2qn16s2", "v32qqs4", "v32qqn16s2", "v16k2qxt", "v32qqk1xt",
        "v16k2qp", "v32qqk1p", "v16k2qp16"]


def tune_candidates(m: int, families: str = "all") -> list[str]:
    """Names of the POOL configs tried at m tokens (k = 8); families="x_q8": the int8-x decode configs only."""
    if families == "x_q8":
        return X_Q8 if m <= 8 else []
    v2 = ["v16", "v16k2", "v16w8", "v16w2", "v32", "v16n4", "v16n16", "v8", "v8k2", "v16n2", "v16n4w2", "v32k2",
          "v16p", "v16k1p", "v8p", "v8k5p", "v32p", "v4p"] + X_Q8
    if m <= 4:  # the gemv and gemv_dot decode paths never won against gemv_v2 on an H200: one of each
        return ["g16", "d32"] + v2
    if m <= 8:
        return ["g16", "d32", "t16x64"] + v2
    if m <= 32:
        return ["t16x64", "t16x128", "d32", "k16x64", "k16x128", "k32x64"]
    if m <= 128:
        return ["t16x64", "t16x128", "t32x128", "k16x64", "k32x64", "k32x128"]
    if m <= 512:
        return ["t32x128", "t64x128", "deq", "k32x64", "k32x128", "k64x64"]
    # (k64x64m128, k64x64m256 and the 8-warp and capped variants stay in the pool for --compare: they lost at
    # every M >= 1024 on the H200)
    return ["t64x128", "t128x64", "t128x128", "t64x128so", "t128x128so", "deq", "k64x64", "k128x64", "k128x128so",
            "k128x64m256", "k128x64m256so", "k128x64m256s2", "k128x64sot64", "k128x64m256sot32",
            "k128x64m256sot32t64", "k256x64splt128", "k256x64splt64"]


# ---------------------------------------------------------------------------------------------- workload


def build_layer(types: tuple[str, str, str], E: int, H: int, I: int, gen: torch.Generator):  # noqa: E741
    """(QuantizedWeight w13 = [gate, up], QuantizedWeight w2) with random valid blocks on the device."""
    g, u, d = (random_quantized(t, shape, DEVICE, gen) for t, shape in zip(types, ((E, I, H), (E, I, H), (E, H, I))))
    return QuantizedWeight([g, u]), QuantizedWeight([d])


def expert_gguf_bytes(w13: QuantizedWeight, w2: QuantizedWeight, E: int) -> float:
    return (w13.nbytes + w2.nbytes) / E


def make_sets(m: int, E: int, H: int, k: int, n_sets: int):
    """Routing sets: (hidden [m, H] bf16, topk_weights [m, k], topk_ids [m, k])."""
    sets = []
    for _ in range(n_sets):
        weights, ids = route_reference(torch.randn(m, E, device=DEVICE), k, True)
        sets.append((torch.randn(m, H, device=DEVICE, dtype=torch.bfloat16), weights, ids))
    return sets


def time_quant(layers, sets, cfg: Config | None, args) -> tuple[float, str]:
    """Median seconds per call of fused_moe_quant, rotating weight copies and routing sets."""
    per_graph = 8 if sets[0][0].shape[0] <= 256 else 4
    calls = []
    for i in range(per_graph):
        (p13, p2), (x, w, ids) = layers[i % len(layers)], sets[i % len(sets)]
        # keep_float32: configs summing the slots in float32 (sum2) hand them on as the model takes them, uncast
        calls.append(lambda p13=p13, p2=p2, x=x, w=w, ids=ids: fused_moe_quant(x, p13, p2, w, ids, cfg,
                                                                                keep_float32=True))  # fmt: skip
    return timed_median(calls, args.budget_s, args.max_runs)


def tune_type(name: str, qtype: str, layers, E: int, H: int, I: int,  # noqa: E741
              k: int, args) -> dict[int, Config]:  # fmt: skip
    """Fastest POOL config per M bucket (qtype: the gate type), each checked against the default config."""
    best: dict[int, Config] = {}
    print(f"\ntuning {name}: M, best us, default us, best config")
    for m in args.m:
        sets = make_sets(m, E, H, k, 4)
        (p13, p2) = layers[0]
        x, w, ids = sets[0]
        default = qconfigs.default_moe_config(m, k, interpret=False, qtype=qtype)
        ref = fused_moe_quant(x, p13, p2, w, ids, default).float()
        scale = ref.abs().max().item() + 1e-6
        timings = {}
        # the table shipped for this type and shape competes too
        shipped = qconfigs.load_moe_table(qtype, E, H, I, device_name()) or {}
        pool = {**POOL, "default": default, **({"shipped": shipped[m]} if m in shipped else {})}
        candidates = tune_candidates(m, args.tune_families)
        if QuantType[qtype] not in FLOAT_X_TYPES:  # read with int8 x only: the float-x decode configs do not apply
            candidates = [c for c in candidates if POOL[c]["path"] != "gemv_v2" or POOL[c].get("x_q8")]
        for cname in ["default", "shipped"][: 1 + (m in shipped)] + candidates:
            cfg = pool[cname]
            try:
                err = (fused_moe_quant(x, p13, p2, w, ids, cfg).float() - ref).abs().max().item()
                if not err <= 3e-2 * scale:
                    print(f"  M={m} {cname}: mismatch {err:.3g} (scale {scale:.3g})", file=sys.stderr)
                    continue
                timings[cname] = time_quant(layers, sets, cfg, args)[0]
            except Exception as exc:  # noqa: BLE001 - e.g. out of shared memory or registers: skip the candidate
                print(f"  M={m} {cname}: {type(exc).__name__}: {str(exc)[:160]}", file=sys.stderr)
        if not timings:
            continue
        win = min(timings, key=timings.get)
        best[m] = pool[win]
        print(f"  {m:>5} {1e6 * timings[win]:8.1f} {1e6 * timings.get('default', float('nan')):8.1f}  {win}")
    return best


def compare_configs(name: str, types: tuple[str, str, str], args, ceilings: dict[str, float]) -> list[dict]:
    """Times the named POOL configs (and the default) per M on one type, each checked against the default."""
    E, H, I, k = args.E, args.H, args.I, args.k  # noqa: E741
    qtype = types[0]
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    raw = [build_layer(types, E, H, I, gen) for _ in range(2)]
    # grid types (no repacked layout) as the tile kernels read them: their GGUF blocks
    layers = [moe_tile_parts(w13, w2) or (packed_parts(w13), packed_parts(w2)[0]) for w13, w2 in raw]
    per_expert = expert_gguf_bytes(*raw[0], E)
    # the bf16 fused kernel on the same routing, the yardstick of the prefill target (time / bf16)
    dense = [(w13.dequantize(torch.bfloat16), w2.dequantize(torch.bfloat16)) for w13, w2 in raw]
    rows = []
    for m in args.m:
        sets = make_sets(m, E, H, k, 4)
        touched = statistics.mean(len(torch.unique(s[2])) for s in sets)
        x, w, ids = sets[0]
        per_graph = 8 if m <= 256 else 4
        bf16_s = timed_median([(lambda s=s, d=d: fused_moe_triton(s[0], d[0], d[1], s[1], s[2]))
                               for s, d in zip((sets * per_graph)[:per_graph], dense * per_graph)],
                              args.budget_s, args.max_runs)[0]  # fmt: skip
        rows.append({"type": name, "M": m, "config": "bf16", "path": "bf16", "us": 1e6 * bf16_s})
        print(f"| {name} | {m} | bf16 kernel | bf16 | {1e6 * bf16_s:.1f} | | | | 1.00x |", flush=True)
        default = qconfigs.default_moe_config(m, k, interpret=False, qtype=qtype)
        ref = fused_moe_quant(x, *layers[0], w, ids, default).float()
        scale = ref.abs().max().item() + 1e-6
        for cname in ["default"] + args.compare:
            cfg = default if cname == "default" else POOL[cname]
            try:
                err = (fused_moe_quant(x, *layers[0], w, ids, cfg).float() - ref).abs().max().item() / scale
                sec = time_quant(layers, sets, cfg, args)[0]
            except Exception as exc:  # noqa: BLE001 - report and go on with the other candidates
                print(f"  {name} M={m} {cname}: {type(exc).__name__}: {str(exc)[:200]}", file=sys.stderr)
                continue
            gbps = touched * per_expert / sec / 1e9
            rows.append({"type": name, "M": m, "config": cname, "path": cfg["path"], "us": 1e6 * sec,
                         "GBps": gbps, "rel_err_vs_default": err, "vs_bf16": sec / bf16_s})  # fmt: skip
            print(f"| {name} | {m} | {cname} | {cfg['path']} | {1e6 * sec:.1f} | {gbps:.0f} | "
                  f"{100 * gbps / ceilings['read_GBps']:.0f}% | {err:.1e} | {sec / bf16_s:.2f}x |", flush=True)
    del layers, raw, dense
    empty_cache()
    return rows


# ------------------------------------------------------------------------------------------------- bench


def bench_type(name: str, types: tuple[str, str, str], args, ceilings: dict[str, float]) -> list[dict[str, Any]]:
    E, H, I, k = args.E, args.H, args.I, args.k  # noqa: E741
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    first = build_layer(types, E, H, I, gen)
    layer_bytes = first[0].nbytes + first[1].nbytes
    copies = max(2, min(args.max_copies, math.ceil(4 * L2_BYTES / layer_bytes)))
    raw_layers = [first] + [build_layer(types, E, H, I, gen) for _ in range(copies - 1)]
    # Types without a repacked layout run from their GGUF blocks (ops/quant.py: dequantised as the layer runs).
    blocks = not (has_kernel_layout(first[0]) and has_kernel_layout(first[1]))
    layers = [] if blocks else [(packed_parts(w13), packed_parts(w2)[0]) for w13, w2 in raw_layers]
    per_expert = expert_gguf_bytes(*first, E)

    if args.tune and name in args.tune_types and not blocks:
        table = tune_type(name, types[0], layers, E, H, I, k, args)
        if table and DEVICE == "cuda":
            path = CONFIG_DIR / qconfigs.moe_config_file_name(types[0], E, H, I, device_name())
            # the M buckets not tuned in this run keep their shipped entries
            merged = {**(qconfigs.load_moe_table(types[0], E, H, I, device_name()) or {}), **table}
            path.write_text(json.dumps({str(m): merged[m] for m in sorted(merged)}, indent=1) + "\n")
            print(f"  wrote {path}")
            qconfigs.load_moe_table.cache_clear()

    # bf16 weights dequantised once (two copies, rotated like the quantized ones).
    dense = [(w13.dequantize(torch.bfloat16), w2.dequantize(torch.bfloat16)) for w13, w2 in raw_layers[:2]]
    rows = []
    for m in args.m:
        sets = make_sets(m, E, H, k, args.routing_sets)
        touched = statistics.mean(len(torch.unique(s[2])) for s in sets)
        qbytes = touched * per_expert
        cfg = {"path": "blocks"} if blocks else qconfigs.get_moe_config(types[0], E, H, I, k, m)
        row: dict[str, Any] = {"type": name, "M": m, "experts_touched": touched, "gguf_bytes": qbytes,
                               "path": cfg["path"], "config": cfg}  # fmt: skip
        x, w, ids = sets[0]
        ref = fused_moe_triton(x, dense[0][0], dense[0][1], w, ids).float()
        out = (fused_moe_quantized(x, *raw_layers[0], w, ids) if blocks else fused_moe_quant(x, *layers[0], w, ids))
        row["max_rel_err_vs_bf16"] = (out.float() - ref).abs().max().item() / max(ref.abs().max().item(), 1e-6)

        if blocks:
            n = 8 if m <= 256 else 4
            calls = [(lambda s=s, lw=lw: fused_moe_quantized(s[0], lw[0], lw[1], s[1], s[2]))
                     for s, lw in zip((sets * n)[:n], (raw_layers * n)[:n])]  # fmt: skip
            sec, mode = timed_median(calls, args.budget_s, args.max_runs)
        else:
            sec, mode = time_quant(layers, sets, None, args)
        row["quant"] = {"us": 1e6 * sec, "mode": mode, "GBps": qbytes / sec / 1e9}
        per_graph = 8 if m <= 256 else 4
        calls = [(lambda s=s, d=d: fused_moe_triton(s[0], d[0], d[1], s[1], s[2]))
                 for s, d in zip((sets * per_graph)[:per_graph], dense * per_graph)]  # fmt: skip
        sec, mode = timed_median(calls, args.budget_s, args.max_runs)
        row["bf16"] = {"us": 1e6 * sec, "mode": mode}
        w13, w2 = raw_layers[0]

        def deq_then_bf16(s=sets[0], w13=w13, w2=w2):
            return fused_moe_triton(s[0], w13.dequantize(torch.bfloat16), w2.dequantize(torch.bfloat16), s[1], s[2])

        # The torch dequantiser allocates per call, so this one is timed eagerly.
        sec, mode = timed_median([deq_then_bf16], args.budget_s / 2, 20, capture=False)
        row["deq_bf16"] = {"us": 1e6 * sec, "mode": mode}
        rows.append(row)
        print(format_row(row, ceilings), flush=True)
    del layers, raw_layers, dense
    empty_cache()
    return rows


def header() -> str:
    cols = ["type", "M", "experts", "path", "quant us", "deq+bf16 us", "bf16 us", "quant GB/s", "%HBM-read",
            "quant/bf16", "vs deq+bf16", "rel err"]  # fmt: skip
    return "| " + " | ".join(cols) + " |\n|" + "---|" * len(cols)


def format_row(row: dict[str, Any], ceilings: dict[str, float]) -> str:
    q, b, d = row["quant"], row["bf16"], row["deq_bf16"]
    star = lambda r: "" if r["mode"] == "graph" else "*"  # noqa: E731
    cells = [row["type"], str(row["M"]), f"{row['experts_touched']:.0f}", row["path"],
             f"{q['us']:.1f}{star(q)}", f"{d['us']:.0f}{star(d)}", f"{b['us']:.1f}{star(b)}", f"{q['GBps']:.0f}",
             f"{100 * q['GBps'] / ceilings['read_GBps']:.0f}%", f"{q['us'] / b['us']:.2f}x",
             f"{d['us'] / q['us']:.1f}x", f"{row['max_rel_err_vs_bf16']:.1e}"]  # fmt: skip
    return "| " + " | ".join(cells) + " |"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--types", nargs="+", default=["Q4_K", "Q5_K", "Q6_K", "Q8_0"],
                   help=f"quant types (any of {[t.name for t in QuantType if t.is_quantized]}) or {list(MIXES)}")
    p.add_argument("--m", type=int, nargs="+", default=list(DEFAULT_MS))
    p.add_argument("--E", type=int, default=128)
    p.add_argument("--H", type=int, default=2048)
    p.add_argument("--I", type=int, default=768)
    p.add_argument("--k", type=int, default=8)
    p.add_argument("--tune", action="store_true", help="quick tuning of --tune-types first; writes config tables")
    p.add_argument("--tune-types", nargs="+", default=["Q4_K"])
    p.add_argument("--tune-families", choices=("all", "x_q8"), default="all",
                   help="x_q8: only the int8-x decode configs against the default and the shipped table")
    p.add_argument("--compare", nargs="+", metavar="CONFIG", choices=sorted(POOL),
                   help="only time these tuning-pool configs against the default per type and M (no tuning)")
    p.add_argument("--out", default="bench_quant_out", help="directory for bench_quant_moe.json / .md")
    p.add_argument("--routing-sets", type=int, default=8)
    p.add_argument("--max-copies", type=int, default=4)
    p.add_argument("--budget-s", type=float, default=0.1, help="timing budget per (M, implementation)")
    p.add_argument("--max-runs", type=int, default=100)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if DEVICE != "cuda" and not interpreting():
        sys.exit("bench_quant_moe.py needs a CUDA device (or TRITON_INTERPRET=1 with tiny --E/--H/--I/--m)")
    start = time.perf_counter()
    budget = (args.budget_s, args.max_runs)
    ceilings = measure_ceilings(*budget) if DEVICE == "cuda" else measure_ceilings(*budget, 1 << 20, 256)
    print(f"device {device_name()}  torch {torch.__version__}  E={args.E} H={args.H} I={args.I} k={args.k}")
    print(f"HBM read ceiling {ceilings['read_GBps']:.0f} GB/s (bf16 sum over 2 GiB); %HBM-read = GGUF bytes of the "
          f"touched experts / time / ceiling; * = eager timing\n")  # fmt: skip
    if args.compare:
        print("| type | M | config | path | us | GB/s | %HBM-read | rel err vs default | / bf16 |\n" + "|---" * 9 + "|")
        rows = [r for name in args.types for r in compare_configs(name, MIXES.get(name, (name,) * 3), args, ceilings)]
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "compare.json").write_text(json.dumps(rows, indent=1) + "\n")
        return
    print(header())
    rows = []
    for name in args.types:
        types = MIXES.get(name, (name, name, name))
        rows += bench_type(name, types, args, ceilings)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"device": device_name(), "torch": torch.__version__, "ceilings": ceilings,
            "shape": {"E": args.E, "H": args.H, "I": args.I, "k": args.k}}  # fmt: skip
    try:
        import triton

        meta["triton"] = triton.__version__
    except ImportError:
        pass
    (out / "bench_quant_moe.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1, default=str) + "\n")
    notes = (
        f"device {meta['device']}, torch {meta['torch']}, triton {meta.get('triton')}; one MoE layer E={args.E} "
        f"H={args.H} I={args.I} k={args.k}, bf16 activations.\n\nHBM read ceiling {ceilings['read_GBps']:.0f} GB/s. "
        "quant = fused dequantising kernels; deq+bf16 = dequantise the layer to bf16 then fused_moe_triton (the "
        "former quantized path); bf16 = fused_moe_triton on bf16 weights. GB/s and %HBM-read count the GGUF bytes "
        "of the touched experts. Times in us per layer; * = eager timing.\n\n"
    )
    (out / "bench_quant_moe.md").write_text(notes + header() + "\n" + "\n".join(format_row(r, ceilings) for r in rows)
                                            + "\n")  # fmt: skip
    took = time.perf_counter() - start
    print(f"\nwrote {out / 'bench_quant_moe.json'} and {out / 'bench_quant_moe.md'} in {took:.0f} s")


if __name__ == "__main__":
    main()
