"""Tune the fused-MoE tile configs per M bucket on the current CUDA device.

For every M (tokens) it times each candidate config (path, block sizes, warps, stages, slot reduction) of
moerun.kernels.fused_moe.fused_moe_triton, replayed from a CUDA graph with triton.testing.do_bench (which
flushes L2 between runs), checks each candidate once against the torch reference, and writes the fastest per
M to src/moerun/kernels/configs/E=..,H=..,I=..,dtype=..,device=...json. The fastest few (--finalists) and the
config shipped now are first timed again in interleaved rounds (--rounds), and the shipped one stays unless beaten
by more than --min-gain. A log of every candidate goes to --log-dir.

    python benchmarks/tune_moe.py --shape qwen3-30b-a3b --shape qwen3-235b-a22b --quick --log-dir tune_logs
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from moerun.bench.timing import (
    add_tuner_arguments,
    graph_replay,
    interleaved_rounds,
    median_ms,
    pick_final,
    resolve_tuner_timing,
)
from moerun.kernels.fused_moe import fused_moe_triton
from moerun.kernels.interpreter import interpreting
from moerun.kernels.tile_configs import (
    CONFIG_DIR,
    M_BUCKETS,
    Config,
    config_file_name,
    default_config,
    device_name,
    load_table,
    normalize,
)
from moerun.ops.moe_reference import fused_moe_reference, route_reference

MODEL_SHAPES: dict[str, dict[str, int]] = {
    "qwen3-30b-a3b": {"E": 128, "H": 2048, "I": 768, "k": 8},
    "qwen3-235b-a22b": {"E": 128, "H": 4096, "I": 1536, "k": 8},
}
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}
# The gemv path is only tried while the token-slots are few enough for one program per slot to pay.
GEMV_MAX_PAIRS = 128
# Without CUDA the script can still be smoke-tested end to end in Triton's interpreter (TRITON_INTERPRET=1).
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


# GEMM2 tiles (BLOCK_N2, BLOCK_K2, warps) for the "fused" slot reduction, one program per (token, N-tile): k times
# fewer programs than per token-slot, so thin N-tiles, long K-steps and more warps keep enough loads in flight.
# Each won at some M in 1..8 on an H200 for Qwen3-30B-A3B (5-12% under the best "sum"); none won at every M.
FUSED_GEMM2_TILES = [(4, 1024, 8), (8, 1024, 4), (16, 1024, 4), (8, 256, 4), (16, 128, 8), (8, 512, 8)]


def gemv_candidates(quick: bool) -> list[Config]:
    """gemv-path configs: (BLOCK_N, BLOCK_K, warps, stages) of GEMM1 with a wider N-tile for GEMM2 (N = H) when
    GEMM2 runs per token-slot, and each of FUSED_GEMM2_TILES when it sums the k slots itself ("fused")."""
    if quick:
        rows = [(16, 256, 4, 2, 32, 256), (16, 256, 4, 2, 32, 128), (32, 256, 4, 2, 32, 256), (8, 512, 4, 2, 16, 512),
                (16, 128, 4, 3, 16, 256), (32, 128, 8, 3, 64, 128)]  # fmt: skip
        out = [
            normalize({"path": "gemv", "BLOCK_N": bn, "BLOCK_K": bk, "num_warps": w, "num_stages": s,
                       "BLOCK_N2": bn2, "BLOCK_K2": bk2, "reduce": red})
            for (bn, bk, w, s, bn2, bk2), red in itertools.product(rows, ("sum", "atomic"))
        ]  # fmt: skip
        return out + _fused_candidates([(16, 256, 4, 2), (16, 128, 4, 3)])
    out = []
    gemm1 = list(itertools.product((8, 16, 32), (128, 256, 512), (4, 8), (2, 3)))
    for (bn, bk, w, s), red in itertools.product(gemm1, ("sum", "atomic")):
        out.append(normalize({"path": "gemv", "BLOCK_N": bn, "BLOCK_K": bk, "num_warps": w, "num_stages": s,
                              "BLOCK_N2": 2 * bn, "BLOCK_K2": bk, "reduce": red}))  # fmt: skip
    return out + _fused_candidates(gemm1)


def _fused_candidates(gemm1: list[tuple[int, int, int, int]]) -> list[Config]:
    """gemv configs with the "fused" slot reduction: each GEMM1 (BLOCK_N, BLOCK_K, warps, stages) with each of
    FUSED_GEMM2_TILES."""
    return [
        normalize({"path": "gemv", "BLOCK_N": bn, "BLOCK_K": bk, "num_warps": w, "num_stages": s,
                   "BLOCK_N2": bn2, "BLOCK_K2": bk2, "num_warps2": w2, "num_stages2": 2, "reduce": "fused"})
        for (bn, bk, w, s), (bn2, bk2, w2) in itertools.product(gemm1, FUSED_GEMM2_TILES)
    ]  # fmt: skip


def tile_candidates(m: int, k: int, quick: bool) -> list[Config]:
    """tile-path configs (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, warps, stages) suited to m tokens."""
    pairs_per_expert_hint = m * k / 128
    if quick:
        # Shared memory per stage, (BLOCK_M + 2 * BLOCK_N) * BLOCK_K * 2 bytes, times stages stays <= 196 KB.
        if m <= 32:
            rows = [(16, 64, 128, 1, 4, 4), (16, 128, 64, 1, 4, 4), (16, 64, 256, 1, 4, 2), (16, 32, 256, 1, 4, 3)]
        elif m <= 256:
            rows = [(16, 128, 64, 1, 4, 4), (32, 128, 64, 8, 4, 4), (32, 64, 128, 8, 4, 3), (64, 128, 64, 8, 4, 4),
                    (16, 64, 128, 1, 4, 4)]  # fmt: skip
        else:
            rows = [(64, 128, 64, 8, 4, 4), (128, 128, 64, 8, 8, 3), (128, 128, 64, 8, 8, 4), (64, 128, 64, 8, 4, 3),
                    (128, 64, 64, 8, 4, 4)]  # fmt: skip
        configs = [_tile_config(*row, "atomic") for row in rows]
        if m >= 1024:
            # Where the atomics' traffic is largest, also try writing per-slot rows and summing them.
            configs += [_tile_config(*row, red) for row in rows[:2] for red in ("sum", "sum_out")]
        return configs
    else:
        block_ms = [bm for bm in (16, 32, 64, 128) if bm <= max(16, 2 * pairs_per_expert_hint)]
        rows = [
            (bm, bn, bk, g, w, s)
            for bm, bn, bk, g, w, s in itertools.product(block_ms, (64, 128, 256), (64, 128), (1, 8), (4, 8), (3, 4))
            # Two B tiles (gate, up) plus A per stage must fit in ~227 KB of shared memory.
            if (bm * bk + 2 * bk * bn) * 2 * s <= 220 * 1024 and not (bm == 16 and w == 8)
        ]
        return [_tile_config(*row, red) for row, red in itertools.product(rows, ("atomic", "sum", "sum_out"))]


def _tile_config(bm: int, bn: int, bk: int, g: int, w: int, s: int, red: str) -> Config:
    return normalize({"path": "tile", "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": g, "num_warps": w,
                      "num_stages": s, "reduce": red})  # fmt: skip


def candidates(m: int, k: int, dtype: torch.dtype, quick: bool) -> list[Config]:
    """All configs to try for m tokens, the default first."""
    out = [default_config(m, k, dtype, interpret=False)]
    if m * k <= GEMV_MAX_PAIRS:
        out += gemv_candidates(quick)
    out += tile_candidates(m, k, quick)
    unique: list[Config] = []
    for cfg in out:
        if cfg not in unique:
            unique.append(cfg)
    return unique


def time_candidate(m: int, cfg: Config, inputs: tuple, ref: torch.Tensor, scale: float,
                   args: argparse.Namespace) -> dict[str, Any]:
    """One log row: the candidate's error against the reference and, when correct, its median time."""
    row: dict[str, Any] = {"M": m, "config": cfg}
    try:
        out = fused_moe_triton(*inputs, cfg, keep_float32=True)
        err = (out.float() - ref).abs().max().item()
        row["max_err"] = err
        if not err <= 3e-2 * scale + 1e-3:
            row["error"] = f"mismatch {err:.3g} (scale {scale:.3g})"
        else:
            fn, mode = graph_replay(lambda: fused_moe_triton(*inputs, cfg, keep_float32=True))
            row["mode"] = mode
            row["us"] = 1e3 * median_ms(fn, args.warmup_ms, args.rep_ms)
    except Exception as exc:  # noqa: BLE001 - e.g. out of shared memory for this tile; skip it
        row["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
    return row


def gemm2_variants(base: Config) -> list[Config]:
    """The tile config ``base`` with GEMM 2's own tile varied (its K is I, short next to GEMM 1's H)."""
    out = []
    for bn2, bk2, w2, s2 in itertools.product((64, 128, 256), (32, 64, 128), (4, 8), (3, 4, 5)):
        # one B tile plus A per stage in ~220 KB of shared memory
        if (base["BLOCK_M"] * bk2 + bk2 * bn2) * 2 * s2 <= 220 * 1024:
            out.append(normalize({**base, "BLOCK_N2": bn2, "BLOCK_K2": bk2, "num_warps2": w2, "num_stages2": s2}))
    return [cfg for cfg in out if cfg != base]


def prefill_variants(base: Config) -> list[Config]:
    """The tile config ``base`` with its weights read by TMA, short tail tiles (half an M-block) and a deeper GEMM 1
    pipeline, alone and together, each with its own slot reduction and with per-slot rows in the output dtype
    ("sum_out"): at prefill sizes the M-blocks of an expert's last, mostly padding block, the operand loads and
    the slot reduction's traffic are what these change."""
    out = []
    tails = (0, base["BLOCK_M"] // 2) if base["BLOCK_M"] >= 32 else (0,)
    reduces = sorted({base["reduce"], "sum_out"})
    for tma, tail, stages, red in itertools.product((False, True), tails, sorted({base["num_stages"], 4}), reduces):
        cfg = normalize({**base, "tma": tma, "TAIL_M": tail, "num_stages": stages, "reduce": red})
        if cfg != base and cfg not in out:
            out.append(cfg)
    return out


def final_rounds(m: int, results: list[dict[str, Any]], shipped: Config | None, inputs: tuple,
                 args: argparse.Namespace) -> tuple[Config, dict[str, Any]] | None:
    """The fastest few of the search, and the config shipped now for m (searched too), timed again in interleaved
    rounds: (the winner, a log row), or None when nothing was timed. A single timing of each candidate is a few
    percent noisy on a GPU, as much as the gaps between the leading candidates; the rounds compare them under the
    same drift."""
    finalists: list[Config] = []
    for row in sorted((r for r in results if "us" in r), key=lambda r: r["us"]):
        if row["config"] not in finalists:
            finalists.append(row["config"])
    names = {f"#{i + 1}": cfg for i, cfg in enumerate(finalists[: args.finalists])}
    incumbent = None
    if shipped is not None:
        found = [name for name, cfg in names.items() if cfg == shipped]
        if found:
            incumbent = found[0]
        elif any(r["config"] == shipped and "us" in r for r in results):  # still correct and runs
            names["shipped"], incumbent = shipped, "shipped"
    if not names:
        return None
    fns = {name: graph_replay(lambda cfg=cfg: fused_moe_triton(*inputs, cfg, keep_float32=True))[0]
           for name, cfg in names.items()}
    times = interleaved_rounds(fns, args.rounds, args.warmup_ms, args.rep_ms)
    win = pick_final(times, incumbent, args.min_gain)
    row = {"M": m, "rounds_us": {name: [round(1e3 * t, 2) for t in ts] for name, ts in times.items()},
           "configs": names, "incumbent": incumbent, "picked": win}
    return names[win], row


def tune_shape(E: int, H: int, I: int, k: int, dtype: torch.dtype, ms: list[int], args) -> dict[int, Config]:  # noqa: E741
    """Best config per M for one shape; prints one line per M and appends every timing to the log."""
    w13 = torch.randn(E, 2 * I, H, device=DEVICE, dtype=dtype) / H**0.5  # [E, 2I, H]
    w2 = torch.randn(E, H, I, device=DEVICE, dtype=dtype) / I**0.5  # [E, H, I]
    best: dict[int, Config] = {}
    log_rows = []
    shipped_table = load_table(E, H, I, dtype, device_name()) or {}
    print(f"\nE={E} H={H} I={I} k={k} {dtype}")
    print(f"{'M':>6} {'best us':>9} {'default us':>10} {'tried':>5}  best config")
    for m in ms:
        hidden = torch.randn(m, H, device=DEVICE, dtype=dtype)  # [T, H]
        weights, ids = route_reference(torch.randn(m, E, device=DEVICE), k, True)  # [T, k]
        ref = fused_moe_reference(hidden, w13, w2, weights, ids).float()
        scale = ref.abs().max().item()
        inputs = (hidden, w13, w2, weights, ids)
        shipped = shipped_table.get(m)  # searched too: the final rounds weigh it against the new leaders
        search = candidates(m, k, dtype, args.quick)
        search += [shipped] if shipped is not None and shipped not in search else []
        results = [time_candidate(m, cfg, inputs, ref, scale, args) for cfg in search]
        first = [r for r in results if "us" in r]
        if args.gemm2 and first and min(first, key=lambda r: r["us"])["config"]["path"] == "tile":
            around = min(first, key=lambda r: r["us"])["config"]
            results += [time_candidate(m, cfg, inputs, ref, scale, args) for cfg in gemm2_variants(around)]
            around = min((r for r in results if "us" in r), key=lambda r: r["us"])["config"]
            results += [time_candidate(m, cfg, inputs, ref, scale, args) for cfg in prefill_variants(around)]
        log_rows.extend(results)
        timed = [r for r in results if "us" in r]
        if not timed:
            print(f"{m:>6} {'-':>9} {'-':>10} {len(results):>5}  (all candidates failed)")
            continue
        fastest = min(timed, key=lambda r: r["us"])
        win_cfg, win_us = fastest["config"], fastest["us"]
        final = final_rounds(m, results, shipped, inputs, args) if args.rounds else None
        if final is not None:
            win_cfg, row = final
            log_rows.append(row)
            win_us = statistics.median(row["rounds_us"][row["picked"]])
        default_us = results[0].get("us", float("nan"))
        best[m] = win_cfg
        print(f"{m:>6} {win_us:>9.1f} {default_us:>10.1f} {len(results):>5}  {compact(win_cfg)}")
    log_name = config_file_name(E, H, I, dtype, device_name()).removesuffix(".json")
    log_path = Path(args.log_dir) / f"tune_{log_name}.jsonl"
    with log_path.open("w") as f:
        for row in log_rows:
            f.write(json.dumps(row) + "\n")
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
    return best


def compact(cfg: Config) -> str:
    """Short one-line form of a config for the printed table."""
    if cfg["path"] == "gemv":
        return (f"gemv N{cfg['BLOCK_N']} K{cfg['BLOCK_K']} w{cfg['num_warps']} s{cfg['num_stages']} | "
                f"N{cfg['BLOCK_N2']} K{cfg['BLOCK_K2']} w{cfg['num_warps2']} {cfg['reduce']}")  # fmt: skip
    options = (f" tail{cfg['TAIL_M']}" if cfg["TAIL_M"] else "") + (" tma" if cfg["tma"] else "")
    return (f"tile M{cfg['BLOCK_M']} N{cfg['BLOCK_N']} K{cfg['BLOCK_K']} G{cfg['GROUP_M']} w{cfg['num_warps']} "
            f"s{cfg['num_stages']} | N{cfg['BLOCK_N2']} K{cfg['BLOCK_K2']} w{cfg['num_warps2']} "
            f"s{cfg['num_stages2']} {cfg['reduce']}{options}")  # fmt: skip


def write_table(E: int, H: int, I: int, dtype: torch.dtype, best: dict[int, Config], out_dir: Path) -> Path:  # noqa: E741
    """Merge best into the shape's JSON file (keeping M buckets not re-tuned) and return its path."""
    path = out_dir / config_file_name(E, H, I, dtype, device_name())
    table: dict[str, Config] = json.loads(path.read_text()) if path.is_file() else {}
    table.update({str(m): cfg for m, cfg in best.items()})
    ordered = {str(m): table[str(m)] for m in sorted(int(key) for key in table)}
    path.write_text(json.dumps(ordered, indent=2) + "\n")
    return path


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", action="append", choices=sorted(MODEL_SHAPES), help="model preset (repeatable)")
    p.add_argument("--E", type=int)
    p.add_argument("--H", type=int)
    p.add_argument("--I", type=int)
    p.add_argument("--k", type=int, default=8)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    p.add_argument("--m", type=int, nargs="+", default=list(M_BUCKETS), help="M buckets (tokens) to tune")
    p.add_argument("--quick", action="store_true", help="reduced search space (a few minutes for both presets)")
    p.add_argument("--gemm2", action="store_true",
                   help="then search GEMM 2's tile separately around the best tile config, then TMA weight loads, "
                        "short tail tiles and a deeper GEMM 1 pipeline around the best of those (prefill sizes)")
    p.add_argument("--rounds", type=int, default=3,
                   help="then time the fastest --finalists and the shipped config again in this many interleaved "
                        "rounds and pick by their medians (0: keep the single timing's winner)")
    p.add_argument("--finalists", type=int, default=4)
    p.add_argument("--min-gain", type=float, default=0.02,
                   help="the shipped config stays unless a finalist's median beats it by more than this fraction")
    add_tuner_arguments(p, str(CONFIG_DIR))
    return resolve_tuner_timing(p.parse_args(argv), quick_rep_ms=30)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if DEVICE != "cuda" and not interpreting():
        sys.exit("tune_moe.py needs a CUDA device (or TRITON_INTERPRET=1 for a smoke test on tiny shapes)")
    shapes = [MODEL_SHAPES[name] for name in (args.shape or [])]
    if args.E and args.H and args.I:
        shapes.append({"E": args.E, "H": args.H, "I": args.I, "k": args.k})
    if not shapes:
        sys.exit("give --shape NAME or --E/--H/--I")
    Path(args.log_dir).mkdir(parents=True, exist_ok=True)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    dtype = DTYPES[args.dtype]
    print(f"device {device_name()}  quick={args.quick}  M={args.m}")
    start = time.perf_counter()
    for shape in shapes:
        best = tune_shape(shape["E"], shape["H"], shape["I"], shape["k"], dtype, args.m, args)
        if best:
            path = write_table(shape["E"], shape["H"], shape["I"], dtype, best, out_dir)
            print(f"wrote {path}")
    print(f"tuning took {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
