"""Times the grid types' decode GEMV (kernels/quant/from_groups.py) on the parts of a file type's mix at a model
shape: the attention projections and an MoE layer's gate and up (one launch, SiLU fused) and down (the slots'
routing weights and sum fused), at a few decode batch sizes, for a list of tile configs against the default.

    python benchmarks/bench_grid_gemv.py --quant IQ2_M --m 1 8 --sweep
    python benchmarks/bench_grid_gemv.py --quant IQ2_XXS --m 1 --configs 16x32w4 4x256w4

Configs are named <BLOCK_N>x<GROUPS>w<num_warps>[g][u] (rows a program, groups of 8 values of a row a loop step,
warps; g: the grid table gathered from registers through shared memory, not loaded per lane; u: the step loop
unrolled, so that the slots a program sums have their loads in flight together); "16x32w4" is the
layout of the kernel before whole rows went in flight a step (one block a step).
Each part is timed in a CUDA graph over enough copies of its weight to overflow L2, x already rounded to int8
(its rounding launch is not counted), and checked against the GGUF decoder's values times the rounded x first.
Prints one table row per (part, M, config); writes the rows as JSON with --out.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

from moerun.bench.timing import graph_replay, median_ms
from moerun.formats.gguf.type_mix import tensor_type
from moerun.formats.quants import QuantType
from moerun.kernels.quant.from_blocks import block_gemv, grid_gemv_config
from moerun.kernels.quant.from_groups import GROUP_TYPES
from moerun.kernels.quant.int8_dot import dequantize_xq, quantize_x
from moerun.kernels.quant.synthetic import random_quantized

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
STREAM_BYTES = 256 << 20  # weight copies a timing walks through (the H200's L2 is 50 MB)
SHAPES = {  # hidden, q|k heads x head_dim, kv heads x head_dim, experts, moe_intermediate, top-k
    "qwen3-30b-a3b": dict(H=2048, Q=4096, KV=512, E=128, I=768, k=8),
    "tiny": dict(H=256, Q=256, KV=64, E=8, I=256, k=2),
}
SWEEP = ["16x32w4", "4x256w4", "2x256w4", "8x128w4", "4x256w4g", "2x256w4g", "8x256w4g", "4x128w4g", "8x128w4g",
         "2x128w4g", "1x256w2g", "2x256w2g"]


def parse_config(name: str) -> dict[str, int]:
    """"<rows>x<groups>w<warps>", then "g" for the table gathered from registers (config key gather) and "u" for
    the step loop unrolled (config key unroll)."""
    unroll = name.endswith("u")
    name = name.removesuffix("u")
    gather = name.endswith("g")
    rows, rest = name.removesuffix("g").split("x")
    groups, warps = rest.split("w")
    cfg = {"BLOCK_N": int(rows), "GROUPS": int(groups), "num_warps": int(warps), "gather": int(gather)}
    return {**cfg, "unroll": 1} if unroll else cfg


def grid_parts(quant: str, shape: dict[str, int], layer: int = 5) -> list[tuple[str, QuantType, tuple, int]]:
    """(name, type, weight shape, pairs a token: 0 dense, k MoE) of the grid-type parts of one layer's mix."""
    s = shape
    mix = [("attn_q", (s["Q"], s["H"]), 0), ("attn_k", (s["KV"], s["H"]), 0), ("attn_output", (s["H"], s["Q"]), 0),
           ("ffn_gate_up_exps", (s["E"], s["I"], s["H"]), s["k"]), ("ffn_down_exps", (s["E"], s["H"], s["I"]), s["k"])]
    parts = []
    for name, shp, pairs in mix:
        gguf_name = f"blk.{layer}.{name.replace('gate_up', 'gate')}.weight"
        t = QuantType(int(tensor_type(gguf_name, shp, quant, layer, 48, s["E"], n_gqa=s["Q"] // s["KV"])))
        if t in GROUP_TYPES:
            parts.append((name, t, shp, pairs))
    return parts


def time_part(name: str, qt: QuantType, shp: tuple, pairs: int, m: int, configs: list[str], gen, warmup_ms: int,
              rep_ms: int) -> list[dict]:  # fmt: skip
    """Rows of one part at m tokens, one a config ("default": grid_gemv_config's choice)."""
    gate_up, down = name.endswith("gate_up_exps"), name.endswith("down_exps")
    one = random_quantized(qt, shp, DEVICE, gen)
    nbytes = one.raw.numel()
    copies = max(1, min(64, math.ceil(STREAM_BYTES / nbytes))) if DEVICE == "cuda" else 1
    weights = [one] + [random_quantized(qt, shp, DEVICE, gen) for _ in range(copies - 1)]
    ups = [random_quantized(qt, shp, DEVICE, gen) for _ in range(copies)] if gate_up else [None] * copies
    N, K = shp[-2:]
    rows = m * pairs if pairs else m
    pick = torch.Generator().manual_seed(m)  # each token's k distinct experts
    ids = torch.stack([torch.randperm(shp[0], generator=pick)[:pairs] for _ in range(m)]).reshape(-1).to(DEVICE) \
        if pairs else None
    x = torch.randn(rows if down else m, K, device=DEVICE, dtype=torch.bfloat16)
    x_int8 = quantize_x(x, K)
    rw = torch.rand(rows, device=DEVICE) if down else None
    touched = nbytes / (shp[0] if pairs else 1) * (len(set(ids.tolist())) if pairs else 1) * (2 if gate_up else 1)
    kw = dict(x_q8=True, x_int8=x_int8, weights=rw, sum_slots=pairs if down else 1)
    x_div = pairs if (pairs and not down) else 1
    # reference: the decoder's values times the rounded x
    x_hat = dequantize_xq(x_int8.xq, x_int8.dx)  # [rows or m, K]
    dense = one.dequantize(torch.float32)
    if pairs:
        xs = x_hat if down else x_hat.repeat_interleave(pairs, 0)
        ref = torch.einsum("pnk,pk->pn", dense[ids], xs)  # [rows, N]
        if gate_up:
            ref = torch.nn.functional.silu(ref) * torch.einsum("pnk,pk->pn", ups[0].dequantize(torch.float32)[ids], xs)
        if down:
            ref = (ref * rw[:, None]).view(m, pairs, N).sum(dim=1)
    else:
        ref = x_hat @ dense.t()
    del dense
    scale = ref.abs().max().item()
    out = []
    for cname in ["default"] + [c for c in configs if c != "default"]:
        cfg = grid_gemv_config(N, K, gate_up, pairs if down else 1) if cname == "default" else parse_config(cname)
        row = {"part": name, "type": qt.name, "M": m, "config": cname, "cfg": cfg, "bytes": touched}
        try:
            def call(w, u, cfg=cfg):
                return block_gemv(w.raw, qt, shp, x, ids, x_div, up_raw=None if u is None else u.raw, config=cfg,
                                  out_dtype=torch.float32, **kw)  # fmt: skip

            err = (call(weights[0], ups[0]) - ref).abs().max().item()
            row["max_err"] = err
            if not err <= 1e-4 * scale + 1e-5:
                row["error"] = f"mismatch {err:.3g} (scale {scale:.3g})"
            else:
                replay, _ = graph_replay(lambda: [call(w, u) for w, u in zip(weights, ups)])
                row["us"] = 1e3 * median_ms(replay, warmup_ms, rep_ms) / copies
                row["GB/s"] = touched / (row["us"] * 1e-6) / 1e9
        except Exception as exc:  # noqa: BLE001 - a tile that does not compile: reported, not fatal
            row["error"] = f"{type(exc).__name__}: {str(exc)[:160]}"
        out.append(row)
        us = f"{row['us']:.2f}" if "us" in row else row.get("error", "")
        print(f"| {name} | {qt.name} | {m} | {cname} {compact(cfg)} | {us} | {row.get('GB/s', 0):.0f} |", flush=True)
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
    return out


def compact(cfg: dict[str, int]) -> str:
    return (f"({cfg['BLOCK_N']}x{cfg['GROUPS']}w{cfg['num_warps']}{'g' if cfg.get('gather') else ''}"
            f"{'u' if cfg.get('unroll') else ''})")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quant", default="IQ2_M", help="a file type whose mix has grid-type parts (IQ2_M, IQ2_XXS ...)")
    p.add_argument("--shape", default="qwen3-30b-a3b", choices=sorted(SHAPES))
    p.add_argument("--m", type=int, nargs="+", default=[1], help="tokens (decode batch sizes)")
    p.add_argument("--configs", nargs="*", default=[], help="configs <rows>x<groups>w<warps> besides the default")
    p.add_argument("--sweep", action="store_true", help="time the sweep's configs as well")
    p.add_argument("--only", nargs="*", default=None, help="parts to time (attn_q, attn_k, attn_output, ...)")
    p.add_argument("--warmup-ms", type=int, default=25)
    p.add_argument("--rep-ms", type=int, default=100)
    p.add_argument("--out", type=Path, default=None, help="write the rows as JSON here")
    args = p.parse_args(argv)
    configs = args.configs + (SWEEP if args.sweep else [])
    parts = [q for q in grid_parts(args.quant, SHAPES[args.shape]) if args.only is None or q[0] in args.only]
    if not parts:
        sys.exit(f"{args.quant} has no grid-type parts at this shape")
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    print(f"device: {torch.cuda.get_device_name() if DEVICE == 'cuda' else 'cpu'}")
    print("| part | type | M | config | us | GB/s |\n|---|---|---|---|---|---|")
    rows = [r for m in args.m for part in parts for r in time_part(*part, m, configs, gen, args.warmup_ms,
                                                                   args.rep_ms)]  # fmt: skip
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
