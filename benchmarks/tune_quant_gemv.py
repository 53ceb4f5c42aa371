"""Tune the dense quantized matmul (moerun.kernels.quant.matmul_quant) at a few rows of x on the current CUDA device.

For every (GGUF type, N, K) part that a model's quantized attention projections and lm_head produce, and every M
asked for, it checks each candidate config (the gemv path, the gemv_v2 path with its tiles and warps, x read as it
is, prepared in the weights' layout or quantized to int8; the shipped config too) once against dequantise +
float32 matmul, then times it: a CUDA graph runs the part over enough copies of the weight to
overflow L2 (as a decode step streams each weight once), replayed through triton.testing.do_bench, divided by
the copies. Each winner is merged into src/moerun/kernels/configs/quant_gemv_<device>.json as its part and M
finish (so a run cut short keeps what it found), which configs.get_matmul_config reads; the log of every
candidate goes to --log-dir as it is measured. --families tiles tunes prefill-sized M on the tl.dot tiles (a
tuned bucket serves M from a quarter of it up to it).

    python benchmarks/tune_quant_gemv.py --preset qwen3-30b-a3b-q4_k_m --quick [--families x_q8]
    python benchmarks/tune_quant_gemv.py --part Q4_K 4608 2048 --m 128 512 2048 8192 --families tiles --quick
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import torch

from moerun.bench.timing import add_tuner_arguments, graph_replay, median_ms, merge_table, resolve_tuner_timing
from moerun.formats.quants import QuantType
from moerun.kernels.interpreter import interpreting
from moerun.kernels.quant.configs import (
    clear_matmul_configs,
    default_matmul_config,
    load_matmul_table,
    matmul_key,
    matmul_table_path,
)
from moerun.kernels.quant.gemv_v2 import FLOAT_X_TYPES, V2_TYPES
from moerun.kernels.quant.matmul_quant import quant_matmul_triton
from moerun.kernels.quant.repack import pack
from moerun.kernels.quant.synthetic import random_quantized
from moerun.kernels.quant.tile64 import tile64_supported
from moerun.kernels.tile_configs import CONFIG_DIR, Config, device_name

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# (name, type, N, K) of the quantized parts of a decode step. Qwen3-30B-A3B in llama.cpp's Q4_K_M mix: q|k in
# Q4_K; v in Q6_K on the layers that get more bits (else Q4_K, merged into q|k|v); o_proj in Q4_K; lm_head Q6_K.
# Q5_K_M is the same mix with Q5_K in place of Q4_K; Qwen3-235B-A22B has hidden 4096 and 64 query heads. IQ4_XS:
# q|k and o_proj in IQ4_XS, v in Q5_K (n_head / n_head_kv >= 4), lm_head Q6_K. Q3_K_M (the mix that fits the 235B
# model on one H200): q|k in Q3_K, v (Q4_K after the first two layers) and o_proj in Q4_K, lm_head Q6_K.
PRESETS: dict[str, list[tuple[str, str, int, int]]] = {
    "qwen3-30b-a3b-q4_k_m": [("q|k", "Q4_K", 4608, 2048), ("q|k|v", "Q4_K", 5120, 2048), ("v", "Q6_K", 512, 2048),
                             ("o_proj", "Q4_K", 2048, 4096), ("lm_head", "Q6_K", 151936, 2048)],
    "qwen3-30b-a3b-q5_k_m": [("q|k", "Q5_K", 4608, 2048), ("q|k|v", "Q5_K", 5120, 2048), ("v", "Q6_K", 512, 2048),
                             ("o_proj", "Q5_K", 2048, 4096), ("lm_head", "Q6_K", 151936, 2048)],
    "qwen3-235b-a22b-q4_k_m": [("q|k", "Q4_K", 8704, 4096), ("q|k|v", "Q4_K", 9216, 4096), ("v", "Q6_K", 512, 4096),
                               ("o_proj", "Q4_K", 4096, 8192), ("lm_head", "Q6_K", 151936, 4096)],
    "qwen3-30b-a3b-q3_k_m": [("q|k", "Q3_K", 4608, 2048), ("v", "Q4_K", 512, 2048), ("o_proj", "Q4_K", 2048, 4096),
                             ("lm_head", "Q6_K", 151936, 2048)],
    "qwen3-235b-a22b-q3_k_m": [("q|k", "Q3_K", 8704, 4096), ("v", "Q4_K", 512, 4096),
                               ("o_proj", "Q4_K", 4096, 8192), ("lm_head", "Q6_K", 151936, 4096)],
    "qwen3-30b-a3b-iq4_xs": [("q|k", "IQ4_XS", 4608, 2048), ("v", "Q5_K", 512, 2048), ("o_proj", "IQ4_XS", 2048, 4096),
                             ("lm_head", "Q6_K", 151936, 2048)],
    "qwen3-30b-a3b-q8_0": [("q|k|v", "Q8_0", 5120, 2048), ("o_proj", "Q8_0", 2048, 4096),
                           ("lm_head", "Q8_0", 151936, 2048)],
    "qwen3-30b-a3b-q6_k": [("q|k|v", "Q6_K", 5120, 2048), ("o_proj", "Q6_K", 2048, 4096),
                           ("lm_head", "Q6_K", 151936, 2048)],
}  # fmt: skip
# Types the gemv_v2 path reads with float x, and with int8 x.
FLOAT_X = tuple(t.name for t in FLOAT_X_TYPES)
INT8_X = tuple(t.name for t in V2_TYPES)
# Weight copies read per timed graph: together at least this many bytes, so L2 (50-60 MB) cannot hold them.
STREAM_BYTES = 3 * 64 * 2**20
MAX_COPIES = 32


def _gemv(bn: int, bk: int, w: int) -> Config:
    return {"path": "gemv", "BLOCK_N": bn, "BLOCK_K": bk, "num_warps": w, "num_stages": 2}


def _v2(bn: int, bk: int, w: int, x_prep: bool = False, x_q8: bool = False) -> Config:
    cfg = {"path": "gemv_v2", "BLOCK_N": bn, "BLOCK_K": bk, "num_warps": w, "num_stages": 1, "x_prep": x_prep}
    if x_q8:
        cfg["x_q8"] = True
    return cfg


def _tiles(path: str, stages: int) -> list[Config]:
    """tl.dot tiles (BLOCK_M, BLOCK_N, warps) for prefill-sized M, on the tile or the tile64 path."""
    shapes = ((16, 64, 4), (32, 128, 4), (64, 64, 4), (64, 128, 8), (128, 64, 4), (128, 128, 8))
    return [{"path": path, "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": 128, "GROUP_M": 8, "num_warps": w,
             "num_stages": stages} for bm, bn, w in shapes]  # fmt: skip


def candidates(qtype: str, N: int, K: int, M: int, quick: bool, families: str = "all") -> list[Config]:
    """Configs to try, the default first, then the shipped one; gemv_v2 only for the types it reads.
    families="x_q8": only the int8-x gemv_v2 configs beside those two; "tiles": only the tile and tile64 paths."""
    out = [default_matmul_config(M, N, interpret=False, qtype=qtype)]
    shipped = load_matmul_table(device_name()).get(matmul_key(qtype, N, K), {}).get(M)
    if shipped:
        out.append(dict(shipped))
    if families == "tiles":  # the two-plane tile step never beat tile64 on the types tile64 decodes
        out += [] if tile64_supported(QuantType[qtype]) else _tiles("tile", 3)
        out += _tiles("tile64", 3) + _tiles("tile64", 4)
    elif families == "all":
        out += [_gemv(16, 1024, 4), _gemv(32, 1024, 4)]
    bns, bks, ws = ((4, 8, 16, 32), (512, 1024, 2048), (2, 4)) if quick else \
        ((2, 4, 8, 16, 32, 64), (256, 512, 1024, 2048, 4096), (1, 2, 4, 8))
    if families == "all" and qtype in FLOAT_X:
        out += [_v2(bn, bk, w) for bn, bk, w in itertools.product(bns, bks, ws) if bk <= K]
        out.append(_v2(8, min(K, 4096), 8))
        # x read in the weights' layout, prepared by one more launch (pays where x is reloaded a lot: long N)
        out += [_v2(bn, bk, 4, True) for bn, bk in itertools.product(bns, bks[:2]) if bk <= K]
    if families in ("all", "x_q8") and qtype in INT8_X:
        # x quantized to int8 by one more launch, dp4a dot products (int8_dot.py)
        out += [_v2(bn, bk, w, x_q8=True) for bn, bk, w in itertools.product(bns, bks, ws) if bk <= K]
    unique: list[Config] = []
    for cfg in out:
        if cfg not in unique:
            unique.append(cfg)
    return unique


def tune_part(name: str, qtype: str, N: int, K: int, M: int, args, log: list) -> Config | None:
    """The fastest correct config of one part at M rows; prints one line."""
    gen = torch.Generator(device=DEVICE).manual_seed(N + K)
    first = random_quantized(qtype, (N, K), DEVICE, gen)
    ref_w = first.dequantize(torch.float32)  # [N, K]
    nbytes = first.nbytes
    copies = max(1, min(MAX_COPIES, math.ceil(STREAM_BYTES / nbytes))) if DEVICE == "cuda" else 1
    parts = [pack(first)] + [pack(random_quantized(qtype, (N, K), DEVICE, gen)) for _ in range(copies - 1)]
    x = torch.randn(M, K, device=DEVICE, dtype=torch.bfloat16)  # [M, K]
    ref = x.float() @ ref_w.T  # [M, N]
    del ref_w
    scale = ref.abs().max().item()
    timed = []
    for cfg in candidates(qtype, N, K, M, args.quick, args.families):
        row: dict[str, Any] = {"part": name, "type": qtype, "N": N, "K": K, "M": M, "config": cfg}
        try:
            err = (quant_matmul_triton(x, parts[0], config=cfg).float() - ref).abs().max().item()
            row["max_err"] = err
            if not err <= 2e-2 * scale + 1e-3:
                row["error"] = f"mismatch {err:.3g} (scale {scale:.3g})"
            else:
                calls = [lambda p=p, cfg=cfg: quant_matmul_triton(x, p, config=cfg) for p in parts]
                replay, _ = graph_replay(lambda calls=calls: [call() for call in calls])
                row["us"] = 1e3 * median_ms(replay, args.warmup_ms, args.rep_ms) / copies
                timed.append((row["us"], cfg))
        except Exception as exc:  # noqa: BLE001 - e.g. out of registers for this tile: skip it
            row["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
        log.append(row)
    del parts
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
    if not timed:
        print(f"{name:>8} {qtype:>5} {M:>3}  all candidates failed")
        return None
    best_us, best = min(timed, key=lambda r: r[0])
    default_us = timed[0][0] if timed[0][1] == candidates(qtype, N, K, M, args.quick, args.families)[0] else math.nan
    tb_s = nbytes / (best_us * 1e-6) / 1e12
    print(f"{name:>8} {qtype:>5} {M:>3} {best_us:>8.2f} {tb_s:>6.2f} {default_us:>10.2f} {len(timed):>5}  "
          f"{compact(best)}", flush=True)
    return best


def compact(cfg: Config) -> str:
    prep = " x_q8" if cfg.get("x_q8") else " x_prep" if cfg.get("x_prep") else ""
    m = f" M{cfg['BLOCK_M']}" if "BLOCK_M" in cfg else ""
    return f"{cfg['path']}{m} N{cfg['BLOCK_N']} K{cfg['BLOCK_K']} w{cfg['num_warps']} s{cfg['num_stages']}{prep}"


def write_table(entries: dict[str, dict[int, Config]], out_dir: Path) -> Path:
    """Merge entries into the device's table (keeping parts and M buckets not re-tuned); returns its path."""
    path = merge_table(matmul_table_path(device_name(), out_dir), entries)
    clear_matmul_configs()
    return path


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", action="append", choices=sorted(PRESETS), help="model and quant mix (repeatable)")
    p.add_argument("--part", nargs=3, action="append", metavar=("TYPE", "N", "K"), help="one more part to tune")
    p.add_argument("--m", type=int, nargs="+", default=[1], help="rows of x to tune")
    p.add_argument("--quick", action="store_true", help="reduced search space")
    p.add_argument("--families", choices=("all", "x_q8", "tiles"), default="all",
                   help="x_q8: only int8-x gemv_v2 configs against the default and the shipped config; tiles: the "
                        "tile and tile64 paths (prefill-sized M)")
    add_tuner_arguments(p, str(CONFIG_DIR))
    return resolve_tuner_timing(p.parse_args(argv), quick_rep_ms=20)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if DEVICE != "cuda" and not interpreting():
        sys.exit("tune_quant_gemv.py needs a CUDA device (or TRITON_INTERPRET=1 for a smoke test on tiny parts)")
    parts = [row for preset in (args.preset or []) for row in PRESETS[preset]]
    parts += [(f"{t}:{n}x{k}", QuantType[t].name, int(n), int(k)) for t, n, k in (args.part or [])]
    if not parts:
        sys.exit("give --preset NAME or --part TYPE N K")
    Path(args.log_dir).mkdir(parents=True, exist_ok=True)
    Path(args.out_dir).mkdir(parents=True, exist_ok=True)
    print(f"device {device_name()}  quick={args.quick}  M={args.m}")
    print(f"{'part':>8} {'type':>5} {'M':>3} {'best us':>8} {'TB/s':>6} {'default us':>10} {'tried':>5}  best")
    start = time.perf_counter()
    tuned = 0
    log: list[dict] = []
    log_path = Path(args.log_dir) / f"tune_quant_gemv_{device_name()}.jsonl"
    log_path.write_text("")
    seen = set()
    for name, qtype, N, K in parts:
        if (qtype, N, K) in seen:
            continue
        seen.add((qtype, N, K))
        for M in args.m:
            logged = len(log)
            best = tune_part(name, qtype, N, K, M, args, log)
            with log_path.open("a") as f:  # every candidate, as each part and M finishes
                f.write("".join(json.dumps(row) + "\n" for row in log[logged:]))
            if best is not None and DEVICE == "cuda":  # merged as each part and M finishes: a run cut short
                write_table({matmul_key(qtype, N, K): {M: best}}, Path(args.out_dir))  # keeps what it found
                tuned += 1
    if tuned:
        print(f"wrote {matmul_table_path(device_name(), Path(args.out_dir))}")
    print(f"tuning took {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
