"""Compiles the Triton kernels of the GPU paths for sm_90 (H100 / H200) without a GPU, launching nothing.

Triton's interpreter runs kernels on the CPU but skips the compiler, so a kernel can pass every interpreter test
and still fail to compile for the GPU (a `tl.static_range` bound that is not a compile-time constant, say). This
script calls the ops on small CPU tensors in compiled mode (TRITON_INTERPRET unset) with Triton's launch replaced
by a compile for an sm_90 target (Triton's own ptxas, no driver needed), so each launch is compiled with the
constexprs the GPU path would give it, PDL variants included, and its arguments specialised as a launch does (16-byte
aligned pointers, integers divisible by 16: without that, loads the GPU build vectorises and pipelines compile as
scalar loads, and the register and spill counts of --audit are not the GPU's). Outputs are never computed.

    python tests/kernels/sm90_compile.py        # prints one line per compiled kernel; exit code 1 on any failure
    python tests/kernels/sm90_compile.py --only "MXFP4" --audit   # the cases naming MXFP4, with each kernel's
                                                # registers, stack (spill) bytes, spill stores / loads, SASS count

tests/kernels/test_sm90_compile.py runs it in a subprocess (the other kernel tests run in the interpreter).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import traceback
from collections.abc import Callable
from dataclasses import replace

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.runtime import jit

TARGET = GPUTarget("cuda", 90, 32)
compiled: list[str] = []
cubins: list[bytes | None] = []  # with --audit: each compiled kernel's cubin (else None), in `compiled`'s order
keep_cubins = False
_pdl_override: int | None = None


def _compile_instead_of_launch(self, *args, grid, warmup=False, **kwargs):  # noqa: ARG001 - Triton's signature
    """JITFunction.run replacement: bind and specialise the call's arguments as a launch does (pointers aligned to
    16 bytes and integers divisible by 16 marked so, which decides vector widths and what the pipeliner copies
    ahead), compile for TARGET, record the kernel's name."""
    kwargs.pop("launch_pdl", None)
    if _pdl_override is not None and "PDL" in (p.name for p in self.params):
        kwargs["PDL"] = _pdl_override
    backend = make_backend(TARGET)
    binder = jit.create_function_from_signature(self.signature, self.params, backend)
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = self._pack_args(backend, kwargs, bound, specialization, options)
    kernel = triton.compile(ASTSource(self, signature, constexprs, attrs), target=TARGET, options=options.__dict__)
    compiled.append(self.fn.__name__)
    cubins.append(kernel.asm["cubin"] if keep_cubins else None)


def audit(cubin: bytes) -> str:
    """Registers, stack bytes (spills) with the spill stores and loads, and the SASS instruction count of one cubin,
    by the CUDA tools Triton ships."""
    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        usage = subprocess.run([os.path.join(tools, "cuobjdump"), "-res-usage", f.name], capture_output=True,
                               text=True).stdout  # fmt: skip
        sass = subprocess.run([os.path.join(tools, "nvdisasm"), f.name], capture_output=True, text=True).stdout
    regs, stack = re.search(r"REG:(\d+)", usage), re.search(r"STACK:(\d+)", usage)
    count = len(re.findall(r"^\s+/\*[0-9a-f]{4,}\*/[^;\n]*;", sass, flags=re.M))  # instructions, not data
    # Spilled registers live in the thread's stack frame (STACK; cuobjdump's LOCAL counts only local arrays),
    # stored by STL and read back by LDL.
    spills = len(re.findall(r"\bSTL(?:\.\w+)*\s", sass)), len(re.findall(r"\bLDL(?:\.\w+)*\s", sass))
    return (f"{regs.group(1) if regs else '?'} regs, {stack.group(1) if stack else '?'} B stack "
            f"({spills[0]} STL / {spills[1]} LDL), {count} SASS")


def _cases() -> dict[str, Callable[[], None]]:
    """name -> a call of one op on CPU tensors (imports inside: moerun reads TRITON_INTERPRET at import)."""
    from moerun.formats.quants import QuantType
    from moerun.kernels import gemv
    from moerun.kernels.decode_attention import (
        decode_attention_int8_triton, decode_attention_qk_triton, decode_attention_triton,
    )
    from moerun.kernels.fused_moe import fused_moe_triton
    from moerun.kernels.fused_moe_ptr import fused_moe_indirect_triton
    from moerun.kernels.greedy_pick import greedy_pick_triton
    from moerun.kernels.moe_parts import StagedPairs
    from moerun.kernels.qk_norm_rope import qk_norm_rope_write_triton
    from moerun.kernels.quant.from_blocks import BLOCK_TYPES, GroupBlocks, block_dequantize, block_gemv
    from moerun.layers.quantized import QuantizedWeight
    from moerun.ops.quant import _pair_products, fused_moe_quantized
    from moerun.kernels.quant.decode import dequantize_rows, dequantize_triton
    from moerun.kernels.quant.configs import default_moe_config
    from moerun.kernels.quant.fused_moe_quant import fused_moe_quant
    from moerun.kernels.quant.matmul_quant import quant_matmul_triton
    from moerun.kernels.quant.repack import expert_addresses, pack
    from moerun.kernels.quant.synthetic import random_quantized
    from moerun.kernels.rmsnorm import rms_norm_int8_triton, rms_norm_triton
    from moerun.kernels.router import route_triton
    from moerun.kernels.router_fused import (
        SINGLE_TOKEN_CONFIG, route_fused_int8_logits_triton, route_fused_int8_triton, route_fused_logits_triton,
        route_fused_triton,
    )
    from moerun.kernels.topk_select import TopkSelect
    from moerun.kernels.o_proj_router import o_proj_router_triton
    from moerun.kernels.stage_misses import (Admission, StagePlan, copy_clock, copy_misses_triton,
                                             stage_misses_triton)
    from moerun.kernels.tile_configs import normalize

    bf16 = torch.bfloat16
    H, I, E, k = 256, 256, 16, 4  # noqa: E741
    x1, x8 = torch.randn(1, H, dtype=bf16), torch.randn(8, H, dtype=bf16)
    norm_w = torch.ones(H, dtype=bf16)
    ids1 = torch.randint(0, E, (1, k), dtype=torch.int32)
    ids64 = torch.randint(0, E, (64, k), dtype=torch.int32)
    w1, w64 = torch.rand(1, k), torch.rand(64, k)
    w13, w2 = torch.randn(E, 2 * I, H, dtype=bf16), torch.randn(E, H, I, dtype=bf16)
    q4 = [pack(random_quantized(QuantType.Q4_K, (E, I, H), "cpu")) for _ in range(2)]
    q6_down = pack(random_quantized(QuantType.Q6_K, (E, H, I), "cpu"))
    qk, v = (pack(random_quantized(t, (n, H), "cpu")) for t, n in ((QuantType.Q4_K, 64), (QuantType.Q6_K, 32)))
    n_q, n_kv, D, L = 8, 2, 64, 64
    k_cache = torch.zeros(2, L, n_kv, D, dtype=bf16)
    v_cache = torch.zeros_like(k_cache)
    q = torch.randn(1, n_q, D, dtype=bf16)
    slots, lens = torch.zeros(1, dtype=torch.int32), torch.full((1,), 40, dtype=torch.int32)
    qkv = torch.randn(1, (n_q + 2 * n_kv) * D, dtype=bf16)
    cos, sin = torch.randn(L, D, dtype=bf16), torch.randn(L, D, dtype=bf16)
    v2 = {"path": "gemv_v2", "BLOCK_N": 4, "BLOCK_K": 256, "num_warps": 4, "num_stages": 1}
    P, W, R = 2, 1, k  # staging of missed experts: dense w13 | w2, one array each, top-k rows
    table = torch.zeros(P, E, W, dtype=torch.int64)
    words = torch.full((P * W,), 64, dtype=torch.int64)
    admission = Admission(torch.zeros(P, 4, W, dtype=torch.int64), table, torch.full((4,), -1), torch.arange(4),
                          *(torch.zeros(E, dtype=torch.int64) for _ in range(3)))
    q5 = [pack(random_quantized(QuantType.Q5_K, (E, I, H), "cpu")) for _ in range(2)]
    q8_down = pack(random_quantized(QuantType.Q8_0, (E, H, I), "cpu"))
    q4_0 = pack(random_quantized(QuantType.Q4_0, (64, H), "cpu"))
    iq4 = [pack(random_quantized(QuantType.IQ4_XS, (E, I, H), "cpu")) for _ in range(2)]
    iq4_down = pack(random_quantized(QuantType.IQ4_NL, (E, H, I), "cpu"))
    iq4_rows = pack(random_quantized(QuantType.IQ4_XS, (64, H), "cpu"))
    fp4 = [pack(random_quantized(QuantType.MXFP4, (E, I, H), "cpu")) for _ in range(2)]
    fp4_down = pack(random_quantized(QuantType.MXFP4, (E, H, I), "cpu"))
    low_bits = [[pack(random_quantized(t, (E, I, H), "cpu")) for _ in range(2)] for t in (QuantType.Q3_K,
                                                                                           QuantType.Q5_1)]
    low_down = [pack(random_quantized(t, (E, H, I), "cpu")) for t in (QuantType.Q2_K, QuantType.Q4_0)]
    x64 = torch.randn(64, H, dtype=bf16)
    tables = ([expert_addresses(p) for p in q4], expert_addresses(q6_down))  # zero-copy offloading's address tables
    dense_rows = (w13.view(E, -1), w2.view(E, -1))
    fused_gemm2 = normalize({"path": "gemv", "BLOCK_N": 16, "BLOCK_K": 256, "num_warps": 4, "num_stages": 2,
                             "BLOCK_N2": 8, "BLOCK_K2": 1024, "num_warps2": 4, "num_stages2": 2, "reduce": "fused"})
    v2_moe = {"path": "gemv_v2", "BLOCK_N": 16, "BLOCK_K": 256, "num_warps": 4, "BLOCK_N2": 8, "BLOCK_K2": 256,
              "num_warps2": 4}
    blocks = {t: random_quantized(t, (4, 64, 512)) for t in BLOCK_TYPES}
    grid_up = {t: random_quantized(t, (4, 256, 512)) for t in BLOCK_TYPES}
    grid_gate = random_quantized(QuantType.IQ2_XXS, (4, 256, 512))
    cases = {
        f"{t.name} experts dequantised from their blocks": lambda t=t: block_dequantize(
            blocks[t].raw, t, (4, 64, 512), bf16, torch.tensor([3, 0])) for t in BLOCK_TYPES}
    cases["IQ3_S weight dequantised from its blocks"] = lambda: block_dequantize(
        blocks[QuantType.IQ3_S].raw, QuantType.IQ3_S, (4, 64, 512), bf16)
    cases.update({
        f"{t.name} GEMV over the blocks of the pairs' experts": lambda t=t: block_gemv(
            blocks[t].raw, t, (4, 64, 512), torch.randn(1, 512, dtype=bf16), torch.tensor([3, 0]), 2)
        for t in BLOCK_TYPES})
    cases["IQ2_XXS GEMV over a weight's blocks"] = lambda: block_gemv(
        blocks[QuantType.IQ2_XXS].raw[0], QuantType.IQ2_XXS, (64, 512), torch.randn(2, 512, dtype=bf16))
    cases.update({
        f"{t.name} GEMV over the blocks of the pairs' experts, float x": lambda t=t: block_gemv(
            blocks[t].raw, t, (4, 64, 512), torch.randn(1, 512, dtype=bf16), torch.tensor([3, 0]), 2, x_q8=False)
        for t in (QuantType.IQ2_XXS, QuantType.IQ1_M)})
    cases["IQ2_XXS gate and up GEMV with SiLU, then a Q2_K down through gemv_v2's GEMM 2"] = lambda: (
        fused_moe_quantized(torch.randn(1, 512, dtype=bf16), QuantizedWeight([grid_gate] * 2),
                            QuantizedWeight([random_quantized(QuantType.Q2_K, (4, 512, 256))]), torch.rand(1, 2),
                            torch.tensor([[3, 0]])))
    cases["q|k|v of IQ2_S, IQ2_S, Q4_K parts at decode, x rounded once"] = lambda: _pair_products(
        QuantizedWeight([random_quantized(QuantType.IQ2_S, (n, 512)) for n in (256, 64)]
                        + [random_quantized(QuantType.Q4_K, (64, 512))]), torch.randn(1, 512, dtype=bf16), None, 1)
    cases["IQ2_S gate and up GEMV with SiLU, then the weighted down GEMV"] = lambda: (block_gemv(
        blocks[QuantType.IQ2_S].raw, QuantType.IQ2_S, (4, 64, 512), torch.randn(1, 512, dtype=bf16),
        torch.tensor([3, 0]), 2, up_raw=blocks[QuantType.IQ2_S].raw), block_gemv(
        blocks[QuantType.IQ3_S].raw, QuantType.IQ3_S, (4, 64, 512), torch.randn(2, 512, dtype=bf16),
        torch.tensor([3, 0]), weights=torch.rand(2), out_dtype=torch.float32))
    real = {t: random_quantized(t, (4, 256, 2048)) for t in (QuantType.IQ2_S, QuantType.IQ3_S)}
    real_down = random_quantized(QuantType.IQ2_S, (4, 256, 768))
    cases["IQ2_S, IQ3_S GEMVs at K = 2048: gate and up of a pair, a weight's rows"] = lambda: (block_gemv(
        real[QuantType.IQ2_S].raw, QuantType.IQ2_S, (4, 256, 2048), torch.randn(1, 2048, dtype=bf16),
        torch.tensor([3, 0]), 2, up_raw=real[QuantType.IQ2_S].raw), block_gemv(
        real[QuantType.IQ3_S].raw[0], QuantType.IQ3_S, (256, 2048), torch.randn(1, 2048, dtype=bf16)))
    gathered = {"BLOCK_N": 4, "GROUPS": 256, "num_warps": 4, "gather": 1}
    cases["IQ2_S, IQ3_S, IQ1_M GEMVs at K = 2048, the table gathered from registers"] = lambda: [block_gemv(
        w.raw[0], w.qtype, (256, 2048), torch.randn(1, 2048, dtype=bf16), config=gathered)
        for w in (*real.values(), random_quantized(QuantType.IQ1_M, (1, 256, 2048)))]
    cases["IQ2_S down at K = 768, a token's 2 slots summed"] = lambda: block_gemv(
        real_down.raw, QuantType.IQ2_S, (4, 256, 768), torch.randn(2, 768, dtype=bf16), torch.tensor([3, 0]),
        weights=torch.rand(2), sum_slots=2)
    grid_down = {t: random_quantized(t, (4, 512, 256)) for t in BLOCK_TYPES}
    ids_t, w_t = torch.randint(0, 4, (64, 2)), torch.rand(64, 2)
    cases.update({
        f"{t.name} gate and up, {d.name} down at prefill: the tile kernels over the blocks": lambda t=t, d=d: (
            fused_moe_quantized(torch.randn(64, 512, dtype=bf16), QuantizedWeight([grid_up[t], grid_up[t]]),
                                QuantizedWeight([grid_down[d]]), w_t, ids_t))
        for t, d in ((QuantType.IQ2_XXS, QuantType.IQ3_S), (QuantType.IQ2_XS, QuantType.IQ1_M),
                     (QuantType.IQ2_S, QuantType.IQ2_XXS), (QuantType.IQ3_XXS, QuantType.IQ2_S),
                     (QuantType.IQ3_S, QuantType.IQ1_S), (QuantType.IQ1_S, QuantType.IQ3_XXS),
                     (QuantType.IQ1_M, QuantType.IQ2_XS))})
    cases["IQ2_XXS gate and up, Q4_K down at prefill"] = lambda: fused_moe_quantized(
        torch.randn(64, 512, dtype=bf16), QuantizedWeight([grid_gate] * 2),
        QuantizedWeight([random_quantized(QuantType.Q4_K, (4, 512, 256))]), w_t, ids_t)
    cases["q|k|v of IQ3_S, IQ1_M, Q4_K parts at prefill: the tile kernels"] = lambda: quant_matmul_triton(
        torch.randn(64, 512, dtype=bf16), [GroupBlocks.of(random_quantized(t, (64, 512)))
                                           for t in (QuantType.IQ3_S, QuantType.IQ1_M)]
        + [pack(random_quantized(QuantType.Q4_K, (64, 512)))])
    return cases | {
        "fused_moe, decode, k slots summed in GEMM 2": lambda: fused_moe_triton(x8[:4], w13, w2, w1.repeat(4, 1),
                                                                                ids1.repeat(4, 1), fused_gemm2),
        "fused_moe through address tables (zero-copy)": lambda: fused_moe_indirect_triton(
            x1, *(torch.tensor([t.data_ptr() for t in rows]) for rows in dense_rows), I, bf16, w1, ids1, 16),
        "fused_moe through address tables, staged pairs after the others": lambda: fused_moe_indirect_triton(
            x1, *(torch.tensor([t.data_ptr() for t in rows]) for rows in dense_rows), I, bf16, w1, ids1, 16,
            staged=StagedPairs(torch.zeros(ids1.numel(), dtype=torch.int32), lambda: None)),
        "decode attention, two launches": lambda: decode_attention_triton(q, k_cache, v_cache, slots, lens, 0.125,
                                                                          single_launch=False),
        "quant MoE, decode, Q5_K gate/up and Q8_0 down (gemv path)": lambda: fused_moe_quant(
            x1, q5, q8_down, w1, ids1, {"path": "gemv", "BLOCK_N": 16, "BLOCK_K": 1024, "num_warps": 4,
                                        "num_stages": 2, "BLOCK_N2": 32, "BLOCK_K2": 768, "reduce": "sum"}),
        "quant MoE, decode, int8 x and intermediate": lambda: fused_moe_quant(
            x1, q4, q6_down, w1, ids1, {**v2_moe, "x_q8": True, "inter_q8": True}),
        "quant MoE, decode, x prepared": lambda: fused_moe_quant(x1, q4, q6_down, w1, ids1, {**v2_moe, "x_prep": True}),
        "quant MoE, decode, GEMM 2's intermediate in its rows' shape (x_tile2)": lambda: [fused_moe_quant(
            x1, q4, q6_down, w1, ids1, {**v2_moe, "x_q8": True, "inter_q8": q8, "x_tile2": True}) for q8 in (0, 1)],
        "quant MoE through address tables": lambda: fused_moe_quant(x1, q4, q6_down, w1, ids1, tables=tables),
        "quant MoE, decode, int8 x, the top-k picked in GEMM 1": lambda: fused_moe_quant(
            x1, q4, q6_down, torch.empty(1, k), torch.empty(1, k, dtype=torch.int32),
            {**v2_moe, "x_q8": True, "sum2": "atomic"}, select=TopkSelect(torch.randn(1, E), True)),
        "route_fused_int8_logits, one token (one-warp programs)": lambda: route_fused_int8_logits_triton(
            x1, x1, norm_w, 1e-6, torch.randn(E, H, dtype=bf16), H, SINGLE_TOKEN_CONFIG),
        "quant MoE, decode, GEMM 2 per pair with atomic sums (sum2), float and int8 intermediate": lambda: [
            fused_moe_quant(x1, q4, q6_down, w1, ids1, {**v2_moe, "x_q8": True, "inter_q8": q8, "sum2": "atomic"},
                            keep_float32=True) for q8 in (0, 1)],
        "quant MoE, prefill, Q5_K / Q8_0 tiles": lambda: fused_moe_quant(x64, q5, q8_down, w64, ids64),
        "quant MoE, prefill, tile64 (Q4_K / Q6_K, then Q5_K / Q8_0)": lambda: [fused_moe_quant(
            x64, gu, down, w64, ids64, {"path": "tile64", "BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4,
                                        "num_stages": 3}) for gu, down in ((q4, q6_down), (q5, q8_down))],
        "quant MoE, prefill, the default tiles at 512 tokens (Q3_K / Q2_K)": lambda: fused_moe_quant(
            x64, low_bits[0], low_down[0], w64, ids64, default_moe_config(512, k, interpret=False, qtype="Q3_K")),
        "quant MoE, prefill, tile64 with GEMM 2 in blocks of 4 of GEMM 1's": lambda: fused_moe_quant(
            x64, q4, q6_down, w64, ids64, {"path": "tile64", "BLOCK_M": 64, "BLOCK_M2": 256, "BLOCK_N": 64,
                                           "num_warps": 4, "num_stages": 4, "num_stages2": 3}),
        "quant MoE, prefill, tile64 with short tail tiles (TAIL_M, TAIL_M2)": lambda: fused_moe_quant(
            x64, q4, q6_down, w64, ids64, {"path": "tile64", "BLOCK_M": 128, "BLOCK_M2": 256, "BLOCK_N": 64,
                                           "GROUP_M": 8, "num_warps": 4, "num_stages": 4, "num_stages2": 3,
                                           "reduce": "sum_out", "TAIL_M": 32, "TAIL_M2": 128}),
        "quant MoE, prefill, tile64 with gate and up in programs of their own (split13), same and mixed types":
            lambda: [fused_moe_quant(x64, gu, q6_down, w64, ids64, {
                "path": "tile64", "BLOCK_M": 256, "BLOCK_N": 64, "GROUP_M": 8, "num_warps": 4, "num_stages": 3,
                "reduce": "sum_out", "split13": True, "TAIL_M": 128, "TAIL_M2": 128}) for gu in (q4, [q4[0], q5[1]])],
        "quant MoE, prefill, tile64 with registers capped (maxnreg)": lambda: fused_moe_quant(
            x64, q4, q6_down, w64, ids64, {"path": "tile64", "BLOCK_M": 64, "BLOCK_M2": 256, "BLOCK_N": 64,
                                           "num_warps": 4, "num_stages": 4, "num_stages2": 3, "maxnreg": 168,
                                           "maxnreg2": 168}),
        "quant matmul, prefill tiles": lambda: quant_matmul_triton(x64, [qk, v]),
        "quant matmul, tile64 tiles": lambda: quant_matmul_triton(
            x64, [qk, v], config={"path": "tile64", "BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 128, "GROUP_M": 8,
                                  "num_warps": 4, "num_stages": 3}),
        "quant matmul, Q4_0 (gemv path, and the int8 decode)": lambda: [quant_matmul_triton(
            x1, [q4_0], config={"path": "gemv", "BLOCK_N": 16, "BLOCK_K": 1024, "num_warps": 4, "num_stages": 2}),
            quant_matmul_triton(x1, [q4_0])],
        "quant MoE, IQ4_XS gate/up and IQ4_NL down: int8 decode, tile64 and two-plane tiles": lambda: [
            fused_moe_quant(x1, iq4, iq4_down, w1, ids1), fused_moe_quant(x64, iq4, iq4_down, w64, ids64),
            fused_moe_quant(x64, iq4, iq4_down, w64, ids64, {"path": "tile", "BLOCK_M": 64, "BLOCK_N": 64,
                                                             "BLOCK_K": 128, "num_warps": 4, "num_stages": 3})],
        "quant MoE, MXFP4 (bfloat16 scales): int8 decode, its int8 intermediate, and tile64": lambda: [
            fused_moe_quant(x1, fp4, fp4_down, w1, ids1), fused_moe_quant(x64, fp4, fp4_down, w64, ids64),
            fused_moe_quant(x1, fp4, fp4_down, w1, ids1, {**v2_moe, "x_q8": True, "inter_q8": True,
                                                          "BLOCK_N": 32})],
        "quant MoE, int8 decode and tile64 of Q3_K / Q2_K and Q5_1 / Q4_0": lambda: [
            fused_moe_quant(x, gu, down, w, ids) for gu, down in zip(low_bits, low_down)
            for x, w, ids in ((x1, w1, ids1), (x64, w64, ids64))],
        "quant matmul, IQ4_XS: int8 decode, tile64, and the gemv path": lambda: [
            quant_matmul_triton(x, [iq4_rows]) for x in (x1, x64)] + [quant_matmul_triton(
                x1, [iq4_rows], config={"path": "gemv", "BLOCK_N": 16, "BLOCK_K": 1024, "num_warps": 4,
                                         "num_stages": 2})],
        "gemv, one step": lambda: gemv.linear_triton(x1, torch.randn(64, H, dtype=bf16), None,
                                                     gemv.GemvConfig(block_n=4, block_k=256)),
        "gemv, split-K": lambda: gemv.linear_triton(x1, torch.randn(64, H, dtype=bf16), None,
                                                    gemv.GemvConfig(block_n=4, block_k=64, split_k=2)),
        "gemv, dot": lambda: gemv.linear_triton(x8, torch.randn(64, H, dtype=bf16), None,
                                                gemv.GemvConfig(block_n=16, block_k=64, dot=True, num_stages=3)),
        "gemv with add + RMSNorm": lambda: gemv.rms_norm_linear_triton(x1, x1, norm_w, 1e-6,
                                                                       torch.randn(64, H, dtype=bf16)),
        "gemv with add + RMSNorm on an MoE's float32 sums, the row read once": lambda: gemv.rms_norm_linear_triton(
            x1.float(), x1, norm_w, 1e-6, torch.randn(64, H, dtype=bf16), None,
            gemv.GemvConfig(block_n=2, block_k=H, row_once=True)),
        "rms_norm": lambda: rms_norm_triton(x8, norm_w, 1e-6, x8),
        "rms_norm_int8": lambda: rms_norm_int8_triton(x1, norm_w, 1e-6, x1, H),
        "route": lambda: route_triton(torch.randn(8, E), k, True),
        "route_fused": lambda: route_fused_triton(x1, x1, norm_w, 1e-6, torch.randn(E, H, dtype=bf16), k, True),
        "route_fused, one token (one-warp programs)": lambda: route_fused_triton(
            x1, x1, norm_w, 1e-6, torch.randn(E, H, dtype=bf16), k, True, SINGLE_TOKEN_CONFIG),
        "route_fused_int8, one token (one-warp programs)": lambda: route_fused_int8_triton(
            x1, x1, norm_w, 1e-6, torch.randn(E, H, dtype=bf16), k, True, H, SINGLE_TOKEN_CONFIG),
        "route_fused_int8": lambda: route_fused_int8_triton(x1, x1, norm_w, 1e-6, torch.randn(E, H, dtype=bf16), k,
                                                            True, H),
        "fused_moe, decode": lambda: fused_moe_triton(x1, w13, w2, w1, ids1),
        "route_fused_logits, one token (one-warp programs)": lambda: route_fused_logits_triton(
            x1, x1, norm_w, 1e-6, torch.randn(E, H, dtype=bf16), SINGLE_TOKEN_CONFIG),
        "fused_moe, decode, the top-k picked in GEMM 1": lambda: fused_moe_triton(
            x1, w13, w2, torch.empty(1, k), torch.empty(1, k, dtype=torch.int32),
            select=TopkSelect(torch.randn(1, E), True)),
        "fused_moe, decode, the top-k picked in GEMM 1 on rows it normalises": lambda: fused_moe_triton(
            x1, w13, w2, torch.empty(1, k), torch.empty(1, k, dtype=torch.int32),
            select=TopkSelect(torch.randn(1, E), True, norm_w, 1e-6)),
        "o_proj + the router's logits": lambda: o_proj_router_triton(
            torch.randn(1, 2 * H, dtype=bf16), x1, torch.randn(H, 2 * H, dtype=bf16),
            torch.randn(E, 3 * H, dtype=bf16)),
        "fused_moe, prefill tiles": lambda: fused_moe_triton(torch.randn(64, H, dtype=bf16), w13, w2, w64, ids64),
        "fused_moe, prefill tiles with short tail tiles": lambda: fused_moe_triton(
            torch.randn(64, H, dtype=bf16), w13, w2, w64, ids64, normalize(
                {"path": "tile", "BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 8,
                 "num_stages": 3, "BLOCK_N2": 256, "num_stages2": 4, "TAIL_M": 64})),
        "fused_moe, prefill tiles, weights by TMA": lambda: fused_moe_triton(
            torch.randn(64, H, dtype=bf16), w13, w2, w64, ids64, normalize(
                {"path": "tile", "BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 8,
                 "num_stages": 3, "BLOCK_N2": 256, "num_stages2": 4, "TAIL_M": 64, "tma": True})),
        "quant matmul, q|k and v in one launch, int8 x": lambda: quant_matmul_triton(
            x1, [qk, v], config={**v2, "x_q8": True}),
        "quant matmul, float x": lambda: quant_matmul_triton(x1, [qk], config=v2),
        "quant decode to bf16 (prefill path 'dequant')": lambda: dequantize_triton(q4[0], bf16),
        "quant embedding rows (Q4_K, Q6_K)": lambda: [dequantize_rows(pack(random_quantized(t, (64, H), "cpu")),
                                                                      torch.tensor([3, 0, 63]), bf16)
                                                      for t in (QuantType.Q4_K, QuantType.Q6_K)],
        "quant MoE, decode": lambda: fused_moe_quant(x1, q4, q6_down, w1, ids1),
        "quant MoE, prefill tiles": lambda: fused_moe_quant(torch.randn(64, H, dtype=bf16), q4, q6_down, w64,
                                                            ids64),
        "decode attention": lambda: decode_attention_triton(q, k_cache, v_cache, slots, lens, 0.125),
        "decode attention, int8 output": lambda: decode_attention_int8_triton(q, k_cache, v_cache, slots, lens, 0.125,
                                                                              n_q * D),
        "decode attention with the q/k norm, RoPE and cache write": lambda: decode_attention_qk_triton(
            qkv, torch.ones(D, dtype=bf16), torch.ones(D, dtype=bf16), 1e-6, cos, sin, lens.long() - 1, slots,
            k_cache, v_cache, slots, lens, 0.125, n_q, n_kv, n_q * D),
        "q/k norm + RoPE + cache write": lambda: qk_norm_rope_write_triton(
            qkv, torch.ones(D, dtype=bf16), torch.ones(D, dtype=bf16), 1e-6, cos, sin,
            torch.zeros(1, dtype=torch.int64), slots, k_cache, v_cache, n_q, n_kv),
        "greedy pick with the rows advanced": lambda: greedy_pick_triton(
            torch.randn(2, 9000, dtype=bf16), torch.empty(2, 9000), torch.zeros(2, dtype=torch.int64),
            torch.zeros(2, dtype=torch.int64), torch.ones(2, dtype=torch.int64), 64),
        "stage missed experts": lambda: stage_misses_triton(
            table, torch.ones(E, dtype=torch.int32), ids1.reshape(-1), words, torch.tensor([0, 64]), 64,
            torch.zeros(R, 128, dtype=torch.int64), torch.empty_like(table)),
        "stage missed experts, the copy timed": lambda: copy_misses_triton(
            StagePlan(torch.zeros(2, 2, dtype=torch.int64), torch.zeros(2, 2, dtype=torch.int64)), words, 64,
            torch.zeros(R, 128, dtype=torch.int64), copy_clock(torch.device("cpu"))),
        "stage missed experts, the copy 16-byte aligned and timed": lambda: copy_misses_triton(
            StagePlan(torch.zeros(2, 2, dtype=torch.int64), torch.zeros(2, 2, dtype=torch.int64)), words, 64,
            torch.zeros(R, 128, dtype=torch.int64), copy_clock(torch.device("cpu")), aligned=True),
        "stage missed experts, the copy 16-byte aligned, 4-byte words": lambda: copy_misses_triton(
            StagePlan(torch.zeros(2, 2, dtype=torch.int64), torch.zeros(2, 2, dtype=torch.int64)), words, 64,
            torch.zeros(R, 128, dtype=torch.int32), aligned=True),
        "stage missed experts, pairs counted": lambda: stage_misses_triton(
            table, torch.ones(E, dtype=torch.int32), ids1.reshape(-1), words, torch.tensor([0, 64]), 64,
            torch.zeros(R, 128, dtype=torch.int64), torch.empty_like(table), counts=torch.zeros(E, dtype=torch.int64)),
        "stage missed experts into cache slots": lambda: stage_misses_triton(
            table, torch.ones(E, dtype=torch.int32), ids1.reshape(-1), words, torch.tensor([0, 64]), 64,
            torch.zeros(R, 128, dtype=torch.int64), torch.empty_like(table), admission),
        "stage missed experts into cache slots, pairs counted": lambda: stage_misses_triton(
            table, torch.ones(E, dtype=torch.int32), ids1.reshape(-1), words, torch.tensor([0, 64]), 64,
            torch.zeros(R, 128, dtype=torch.int64), torch.empty_like(table), admission, admission.counts),
        "stage missed experts into cache slots, pairs counted, admitted slots held": lambda: stage_misses_triton(
            table, torch.ones(E, dtype=torch.int32), ids1.reshape(-1), words, torch.tensor([0, 64]), 64,
            torch.zeros(R, 128, dtype=torch.int64), torch.empty_like(table),
            replace(admission, hold=torch.zeros(4, dtype=torch.int32), hold_passes=1), admission.counts),
    }


def main() -> int:
    global _pdl_override, keep_cubins
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", help="compile only the cases whose name contains this text")
    parser.add_argument("--audit", action="store_true", help="print each kernel's registers, spills and SASS size")
    args = parser.parse_args()
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("run without TRITON_INTERPRET: the point is to compile")
    keep_cubins = args.audit
    jit.JITFunction.run = _compile_instead_of_launch
    failures = []
    for pdl in (None, 1, 2):  # as launched on the CPU (no PDL), then each PDL mode where a kernel takes one
        _pdl_override = pdl
        for name, call in _cases().items():
            if args.only and args.only not in name:
                continue
            before = len(compiled)
            try:
                call()
            except Exception:  # noqa: BLE001 - reported, then the other cases run
                failures.append(name)
                print(f"FAILED {name} (PDL {pdl}):\n{traceback.format_exc()}", flush=True)
                continue
            print(f"ok {name} (PDL {pdl}): {', '.join(compiled[before:]) or 'no launch'}", flush=True)
            if args.audit:
                for kernel, cubin in zip(compiled[before:], cubins[before:]):
                    print(f"    {kernel}: {audit(cubin)}", flush=True)
    print(f"{len(compiled)} compiles, {len(failures)} failed cases")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
