"""Tune the dense GEMV configs (moerun.kernels.gemv) per weight shape and token count on the current CUDA device.

For every (N, K) and T it checks each candidate config (fma or dot path, tiles, split-K, warps, stages) once
against a float32 reference, then times it: a CUDA graph runs the op over enough copies of the weight to
overflow L2 (as a decode step streams each weight once), replayed through triton.testing.do_bench, divided by
the copies. cuBLAS (F.linear, after the Triton rms_norm for the fused-norm shapes) is timed the same way; where
it wins, the entry says backend "torch" and the ops keep using it. The winners are merged into
src/moerun/kernels/configs/gemv_<device>.json; a log of every candidate goes to --log-dir. A chain of copies of
one op is not a decode step, where the op follows other kernels: a config can win the chain and lose the step.
--finalists N writes each case's N fastest configs (and the one shipped before) to folders that
bench_decode_variants.py compares in whole steps (MOERUN_GEMV_CONFIG_DIR), and prints that command.

    python benchmarks/tune_gemv.py --shape qwen3-30b-a3b --shape qwen3-235b-a22b --quick
    python benchmarks/tune_gemv.py --N 5120 --K 2048 --norm --t 1 2        # one shape, full search
    python benchmarks/tune_gemv.py --shape qwen3-30b-a3b --only qkv --t 1 --quick --finalists 3
                                     # and the 3 fastest to try in whole decode steps, one folder each
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from moerun.bench.timing import add_tuner_arguments, graph_replay, median_ms, merge_table, resolve_tuner_timing
from moerun.kernels.gemv import (
    MIN_DOT,
    GemvConfig,
    default_config,
    linear_triton,
    load_table,
    rms_norm_linear_triton,
    table_key,
    table_path,
)
from moerun.kernels.interpreter import interpreting
from moerun.kernels.tile_configs import CONFIG_DIR, device_name
from moerun.ops.norm import rms_norm, rms_norm_reference

# (N, K, fused norm in front) of the dense projections a decode step runs
MODEL_SHAPES: dict[str, dict[str, tuple[int, int, bool]]] = {
    "qwen3-30b-a3b": {"qkv": (5120, 2048, True), "o_proj": (2048, 4096, False), "lm_head": (151936, 2048, False),
                      "router": (128, 2048, False)},
    "qwen3-235b-a22b": {"qkv": ((64 + 2 * 4) * 128, 4096, True), "o_proj": (4096, 8192, False),
                        "lm_head": (151936, 4096, False)},
}  # fmt: skip
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
EPS = 1e-6
# Weight copies read per timed graph: together at least this many bytes, so L2 (50-60 MB) cannot hold them.
STREAM_BYTES = 3 * 64 * 2**20
MAX_COPIES = 32


@dataclass
class Case:
    """Operands of one (N, K, T) case: weight copies [C, N, K], x [T, K], residual [T, K], norm weight [K]."""

    weights: torch.Tensor
    x: torch.Tensor
    residual: torch.Tensor
    norm_w: torch.Tensor
    norm: bool

    def reference(self) -> torch.Tensor:
        """float32 y [T, N] of the first weight copy."""
        a = rms_norm_reference(self.x, self.norm_w, EPS, self.residual)[0] if self.norm else self.x
        return a.float() @ self.weights[0].float().T


def make_case(N: int, K: int, T: int, dtype: torch.dtype, norm: bool) -> Case:
    copies = max(1, min(MAX_COPIES, math.ceil(STREAM_BYTES / (N * K * dtype.itemsize)))) if DEVICE == "cuda" else 1
    weights = torch.randn(copies, N, K, device=DEVICE, dtype=dtype) / K**0.5  # [C, N, K]
    x = torch.randn(T, K, device=DEVICE, dtype=dtype)  # [T, K]
    residual = torch.randn(T, K, device=DEVICE, dtype=dtype)
    norm_w = (1 + 0.3 * torch.randn(K, device=DEVICE)).to(dtype)  # [K]
    return Case(weights, x, residual, norm_w, norm)


def triton_op(case: Case, cfg: GemvConfig) -> Callable[[int], torch.Tensor]:
    """The tuned op on weight copy i: the fused norm + GEMV, or the plain GEMV."""
    if case.norm:
        return lambda i: rms_norm_linear_triton(case.x, case.residual, case.norm_w, EPS, case.weights[i], None, cfg)[0]
    return lambda i: linear_triton(case.x, case.weights[i], None, cfg)


def torch_op(case: Case) -> Callable[[int], torch.Tensor]:
    """What the ops run without the GEMV: rms_norm (Triton on CUDA) then cuBLAS."""
    if case.norm:
        return lambda i: F.linear(rms_norm(case.x, case.norm_w, EPS, case.residual)[0], case.weights[i])
    return lambda i: F.linear(case.x, case.weights[i])


def candidates(N: int, K: int, T: int, dtype: torch.dtype, quick: bool, norm: bool = False) -> list[GemvConfig]:
    """Configs to try for T tokens, the default first; fma only while its [T, BLOCK_N, BLOCK_K] partial fits. With
    ``norm`` (the add + RMSNorm in front), each config of one K step over the whole row also with row_once."""
    if quick:
        fma = [(8, 256, 4, 2), (16, 256, 4, 2), (32, 256, 4, 2), (16, 256, 8, 3)]
        # few rows, long steps (up to the whole row in one): every program's weight loads issued at once
        fma += list(itertools.product((1, 2, 4, 8), (512, 1024, 2048), (2, 4, 8), (2,)))
        dot = [(16, 128, 4, 3), (16, 256, 4, 3), (32, 128, 4, 3), (32, 256, 4, 4), (64, 128, 4, 3)]
        splits = (1, 2, 4)
    else:
        fma = list(itertools.product((4, 8, 16, 32), (128, 256, 512), (2, 4, 8), (1, 2, 3)))
        # few rows, long steps (often the whole row in one): every program's weight loads issued at once
        fma += list(itertools.product((1, 2), (128, 256, 512), (2, 4, 8), (2,)))
        fma += list(itertools.product((1, 2, 4, 8, 16, 32), (1024, 2048), (2, 4, 8), (2,)))
        dot = list(itertools.product((16, 32, 64), (64, 128, 256), (4, 8), (2, 3, 4)))
        splits = (1, 2, 4, 8)
    block_t = 1 << (T - 1).bit_length()
    # the default's tiles, timed as a Triton config even where the default itself defers to cuBLAS
    out = [replace(default_config(N, K, T, dtype, interpret=False), backend="triton")]
    for (bn, bk, w, s), split in itertools.product(fma, splits):
        # the float32 partial [BLOCK_T, BLOCK_N, BLOCK_K] takes at most 128 registers a thread
        if block_t * bn * bk <= 128 * 32 * w and K >= split * bk:
            out.append(GemvConfig(block_n=bn, block_k=bk, split_k=split, num_warps=w, num_stages=s))
    if T > 1:
        for (bn, bk, w, s), split in itertools.product(dot, splits):
            if K >= 2 * split * bk and bn >= MIN_DOT:
                out.append(GemvConfig(block_n=bn, block_k=bk, split_k=split, dot=True, num_warps=w, num_stages=s))
    if norm:
        out += [replace(cfg, row_once=True) for cfg in out if cfg.split_k == 1 and cfg.block_k >= K]
    unique: list[GemvConfig] = []
    for cfg in out:
        if cfg not in unique:
            unique.append(cfg)
    return unique


def per_op_us(op: Callable[[int], Any], copies: int, args: argparse.Namespace) -> float:
    """Microseconds per op: one CUDA graph runs op over every weight copy, timed by do_bench (median)."""
    replay, _ = graph_replay(lambda: [op(i) for i in range(copies)])
    return 1e3 * median_ms(replay, args.warmup_ms, args.rep_ms) / copies


def tune_case(name: str, N: int, K: int, norm: bool, T: int, dtype: torch.dtype, args, log: list,
              ranked: list[GemvConfig] | None = None) -> GemvConfig | None:
    """The fastest correct config for one case (backend 'torch' when cuBLAS is faster); prints one line. ``ranked``,
    when given, receives every correct Triton config, fastest first."""
    case = make_case(N, K, T, dtype, norm)
    ref = case.reference()
    scale = ref.abs().max().item()
    copies = case.weights.shape[0]
    cublas_us = per_op_us(torch_op(case), copies, args)
    timed = []
    for cfg in candidates(N, K, T, dtype, args.quick, norm):
        row: dict[str, Any] = {"shape": name, "N": N, "K": K, "T": T, "norm": norm, "config": cfg.to_dict()}
        try:
            err = (triton_op(case, cfg)(0).float() - ref).abs().max().item()
            row["max_err"] = err
            if not err <= 1e-2 * scale + 1e-3:
                row["error"] = f"mismatch {err:.3g} (scale {scale:.3g})"
            else:
                row["us"] = per_op_us(triton_op(case, cfg), copies, args)
                timed.append((row["us"], cfg))
        except Exception as exc:  # noqa: BLE001 - e.g. out of registers or shared memory for this tile; skip it
            row["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
        log.append(row)
    log.append({"shape": name, "N": N, "K": K, "T": T, "norm": norm, "cublas_us": cublas_us})
    del case
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
    if not timed:
        print(f"{name:>8} {T:>3}  all candidates failed")
        return None
    best_us, best = min(timed, key=lambda r: r[0])
    if ranked is not None:
        ranked.extend(cfg for _, cfg in sorted(timed, key=lambda r: r[0]))
    default_tiles = replace(default_config(N, K, T, dtype, interpret=False), backend="triton")
    default_us = next((us for us, cfg in timed if cfg == default_tiles), math.nan)
    tb_s = N * K * dtype.itemsize / (best_us * 1e-6) / 1e12
    print(f"{name:>8} {T:>3} {best_us:>8.2f} {tb_s:>6.2f} {default_us:>10.2f} {cublas_us:>9.2f} {len(timed):>5}  "
          f"{compact(best)}")
    if args.allow_torch and cublas_us < best_us:
        return replace(best, backend="torch")  # the Triton tiles stay for the callers that keep Triton
    return best


def compact(cfg: GemvConfig) -> str:
    path = "dot" if cfg.dot else "fma"
    return (f"{path} N{cfg.block_n} K{cfg.block_k} split{cfg.split_k} w{cfg.num_warps} s{cfg.num_stages}")


def write_table(entries: dict[str, dict[int, GemvConfig]], out_dir: Path) -> Path:
    """Merge entries into the device's table (keeping shapes and T buckets not re-tuned); returns its path."""
    raw = {key: {t: cfg.to_dict() for t, cfg in by_t.items()} for key, by_t in entries.items()}
    path = merge_table(table_path(device_name(), out_dir), raw)
    load_table.cache_clear()
    return path


def write_finalists(finalists: dict[tuple[str, str, int], list[tuple[str, GemvConfig]]], out_dir: Path) -> list[str]:
    """Each case's labelled configs (its fastest by rank, and the one shipped before this run), one table of one
    entry per folder (out_dir/<shape>-t<T>-<label>), to try in whole decode steps through MOERUN_GEMV_CONFIG_DIR;
    returns the bench_decode_variants variants of T = 1.

    The tuner times each op in a chain of copies of itself; in a decode step it follows other kernels, and a
    config that wins the chain can lose the step (benchmarks/RESULTS.md, 2026-12-04), so the step decides."""
    variants = []
    for (name, key, T), configs in finalists.items():
        for label, cfg in configs:
            folder = out_dir / f"{name}-t{T}-{label}"
            folder.mkdir(parents=True, exist_ok=True)
            table_path(device_name(), folder).write_text(json.dumps({key: {str(T): cfg.to_dict()}}, indent=1) + "\n")
            if T == 1:
                variants.append(f"--variant {folder.name}:MOERUN_GEMV_CONFIG_DIR={folder}")
    return variants


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", action="append", choices=sorted(MODEL_SHAPES), help="model preset (repeatable)")
    p.add_argument("--only", nargs="+", help="projections of the presets to tune, e.g. qkv o_proj")
    p.add_argument("--N", type=int)
    p.add_argument("--K", type=int)
    p.add_argument("--norm", action="store_true", help="with --N/--K: tune the fused add + RMSNorm variant")
    p.add_argument("--t", type=int, nargs="+", default=[1, 2, 4, 8], help="token counts to tune")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    p.add_argument("--quick", action="store_true", help="reduced search space")
    p.add_argument("--finalists", type=int, default=0,
                   help="also write each case's N fastest configs, one folder each, to try in whole decode steps "
                        "(benchmarks/bench_decode_variants.py, MOERUN_GEMV_CONFIG_DIR)")
    p.add_argument("--finalists-dir", default="gemv_finalists", help="where --finalists writes its folders")
    p.add_argument("--no-torch", dest="allow_torch", action="store_false",
                   help="always record the best Triton config, even where cuBLAS is faster")
    add_tuner_arguments(p, str(CONFIG_DIR))
    return resolve_tuner_timing(p.parse_args(argv), quick_rep_ms=20)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if DEVICE != "cuda" and not interpreting():
        sys.exit("tune_gemv.py needs a CUDA device (or TRITON_INTERPRET=1 for a smoke test on tiny shapes)")
    shapes = [(f"{model}:{name}", *shape) for model in (args.shape or []) for name, shape in MODEL_SHAPES[model].items()
              if not args.only or name in args.only]  # fmt: skip
    if args.N and args.K:
        shapes.append((f"N{args.N}K{args.K}", args.N, args.K, args.norm))
    if not shapes:
        sys.exit("give --shape NAME or --N/--K")
    dtype = DTYPES[args.dtype]
    Path(args.log_dir).mkdir(parents=True, exist_ok=True)
    Path(args.out_dir).mkdir(parents=True, exist_ok=True)
    print(f"device {device_name()}  quick={args.quick}  T={args.t}  {args.dtype}")
    print(f"{'shape':>8} {'T':>3} {'best us':>8} {'TB/s':>6} {'default us':>10} {'cublas us':>9} {'tried':>5}  best")
    start = time.perf_counter()
    entries: dict[str, dict[int, GemvConfig]] = {}
    log: list[dict] = []
    finalists: dict[tuple[str, str, int], list[tuple[str, GemvConfig]]] = {}
    shipped = load_table(device_name())  # as it was before this run merges its winners into --out-dir
    for name, N, K, norm in shapes:
        short, key = name.split(":")[-1], table_key(N, K, dtype)
        for T in args.t:
            ranked: list[GemvConfig] = []
            best = tune_case(short, N, K, norm, T, dtype, args, log, ranked)
            if best is not None:
                entries.setdefault(key, {})[T] = best
                labelled = [(str(rank), cfg) for rank, cfg in enumerate(ranked[:args.finalists], 1)]
                before = shipped.get(key, {}).get(T)
                if before is not None:
                    labelled.append(("shipped", before))
                finalists[(short, key, T)] = labelled
    log_path = Path(args.log_dir) / f"tune_gemv_{device_name()}.jsonl"
    log_path.write_text("".join(json.dumps(row) + "\n" for row in log))
    if entries:
        print(f"wrote {write_table(entries, Path(args.out_dir))}")
    if args.finalists:
        variants = write_finalists(finalists, Path(args.finalists_dir))
        if variants:
            print("try them in whole batch-1 steps:\n  python benchmarks/bench_decode_variants.py --variant base "
                  + " ".join(variants) + " --variant base_again")
    print(f"tuning took {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
