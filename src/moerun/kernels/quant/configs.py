"""Tile configs of the quantized kernels: tuned JSON tables per (type, MoE shape, device) and defaults by M.

Keys are those of kernels/tile_configs.py, plus the paths "gemv_dot" (fused_moe_quant.py), "gemv_v2"
(gemv_v2.py) and "dequant" (the layer decoded to the activation dtype, then the dense fused MoE; no keys).
BLOCK_K / BLOCK_K2 count K elements per loop step (multiples of 64, lowered to divide the padded row). In the
tl.dot paths BLOCK_N is the number of weight rows per program (the decoded weight is the left operand) and
BLOCK_M the number of token rows. In gemv_v2, BLOCK_N is rows of gate/up per program (a multiple
of 16), BLOCK_N2 output rows of down per program and token (all k slots at once), BLOCK_K / BLOCK_K2 inputs per
unrolled chunk, `x_prep` / `x_q8` how GEMM 1 and the dense GEMV read x (prepared in the weights' layout / as
int8, int8_dot.py), `inter_q8` GEMM 1's output written as int8 for GEMM 2, `slots2` how many of a token's k
slots GEMM 2 holds at once (a power of two; default all), `sum2` = "atomic" GEMM 2 as one program per (token,
slot) pair and BLOCK_N2 rows instead, its rows added by float32 atomics into an output GEMM 1 zeroes (float32 sums
in no fixed order), and `reduce` does not apply (GEMM 2 sums the slots).
On the tile paths `BLOCK_M2` (default BLOCK_M) gives GEMM 2 M-blocks a power-of-two multiple of GEMM 1's: each
expert's run is padded to it, so GEMM 2 decodes a weight tile once for up to BLOCK_M2 tokens. `TAIL_M` (GEMM 1)
and `TAIL_M2` (GEMM 2; 0 or a power of two >= 16 below that GEMM's M-block, default 0) run a block holding at
most that many token-slots as a tile of that many rows (moe_tiles.py). `split13` (tile64 only) runs GEMM 1's gate
and up rows in programs of their own, one accumulator each, so its M-blocks can be twice as long in the same
registers; the second of a tile's two programs to finish writes silu(gate) * up.
Tables live in kernels/configs as quant_<TYPE>_E=..,H=..,I=..,device=....json, keyed by M, TYPE being the type of
the gate projection.
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path

from moerun.kernels.interpreter import interpreting
from moerun.kernels.quant.from_groups import GROUP_TYPES
from moerun.kernels.quant.repack import PACKED_TYPES
from moerun.kernels.tile_configs import (
    CONFIG_DIR,
    Config,
    current_table_devices,
    first_found,
    normalize,
    read_table,
)


PATHS = ("dequant", "gemv", "gemv_dot", "gemv_v2", "tile", "tile64")
# Gate types whose decode default is gemv_v2 with int8 x and whose prefill default is tile64: every packed type.
PACKED_TYPE_NAMES = tuple(t.name for t in PACKED_TYPES)
# Grid types, which fused_moe_quant multiplies at prefill sizes only, on the tile64 path (from_groups.py).
GROUP_TYPE_NAMES = tuple(t.name for t in GROUP_TYPES)


def normalize_config(cfg: Config) -> Config:
    """tile_configs.normalize, also accepting the gemv_dot path (tile-kernel keys, slot reduction by sum), the
    gemv_v2 path (gemv keys; its GEMM 2 sums the slots itself) and the dequant path (no keys: the bf16 fused MoE
    runs with its own tables)."""
    path = cfg.get("path", "tile")
    if path not in PATHS:
        raise ValueError(f"unknown quantized MoE kernel path {path!r}; expected one of {PATHS}")
    m2 = cfg.get("BLOCK_M2")
    if m2 is not None:
        m1 = cfg.get("BLOCK_M", 16)
        if path not in ("tile", "tile64") or m2 < m1 or m2 % m1 or (m2 // m1) & (m2 // m1 - 1):
            raise ValueError(f"BLOCK_M2 must be a power-of-two multiple of BLOCK_M on the tile paths, got {cfg}")
    for key, block in (("TAIL_M", cfg.get("BLOCK_M", 16)), ("TAIL_M2", m2 or cfg.get("BLOCK_M", 16))):
        tail = cfg.get(key, 0)
        if tail and (path not in ("tile", "tile64") or not isinstance(tail, int) or tail < 16 or tail & (tail - 1)
                     or tail >= block):  # fmt: skip
            raise ValueError(f"{key} must be 0 or a power of two >= 16 below its GEMM's M-block on the tile paths, "
                             f"got {tail!r} on path {path!r} (M-block {block})")
    if cfg.get("split13") not in (None, False, True) or (cfg.get("split13") and path != "tile64"):
        raise ValueError(f"split13 takes True or False on the tile64 path, got {cfg.get('split13')!r} on {path!r}")
    if cfg.get("sum2") not in (None, "atomic") or (cfg.get("sum2") and path != "gemv_v2"):
        raise ValueError(f"sum2 takes 'atomic' on the gemv_v2 path, got {cfg.get('sum2')!r} on path {path!r}")
    for key in ("maxnreg", "maxnreg2"):
        cap = cfg.get(key)
        if cap is not None and (path not in ("tile", "tile64") or not isinstance(cap, int) or not 32 <= cap <= 255):
            raise ValueError(f"{key} caps a tile kernel's registers a thread: an int in [32, 255] on the tile paths, "
                             f"got {cap!r} on path {path!r}")
    if path == "dequant":
        return {"path": path}
    if path == "gemv_dot":
        out = normalize({"reduce": "sum", **cfg, "path": "tile"})
        out["path"] = path
        return out
    if path == "gemv_v2":
        out = normalize({**cfg, "path": "gemv", "reduce": "sum"})
        out["path"] = path
        return out
    if path == "tile64":  # tile keys; BLOCK_K is one pair (64 inputs) a step
        out = normalize({**cfg, "path": "tile", "BLOCK_K": 64, "BLOCK_K2": 64})
        out["path"] = path
        return out
    return normalize(cfg)


def moe_config_file_name(qtype: str, E: int, H: int, I: int, device: str) -> str:  # noqa: E741
    """File name of the tuned table of one quant type, expert shape and device."""
    return f"quant_{qtype}_E={E},H={H},I={I},device={device}.json"


@functools.cache
def load_moe_table(qtype: str, E: int, H: int, I: int, device: str,  # noqa: E741
                   user_dir: str | None = None) -> dict[int, Config] | None:  # fmt: skip
    """Tuned {M: config} table from user_dir (MOERUN_MOE_CONFIG_DIR, as for the bf16 tables), else the shipped one;
    None when neither has it."""
    raw = read_table(moe_config_file_name(qtype, E, H, I, device), CONFIG_DIR, user_dir)
    return None if raw is None else {m: normalize_config(cfg) for m, cfg in raw.items()}


# GEMM 2 tiles of gemv_v2 with the k slots summed in registers (256 programs of 8 rows at one token, 30B shape): what
# a down projection run through that GEMM 2 alone takes (ops/quant.py's _packed_down, beside grid-type gate and up),
# where no GEMM 1 of the same path zeroes a float32 output for the per-pair form of the decode default.
SLOT_SUM_TILES: Config = {"BLOCK_N2": 8, "BLOCK_K2": 512, "num_warps2": 4, "num_stages2": 1}


def default_moe_config(m: int, k: int, interpret: bool | None = None, qtype: str | None = None) -> Config:
    """Hand-reasoned config for m tokens with k slots each whose gate projection has type qtype (the decode path
    depends on it: gemv_v2 for the types it reads, gemv otherwise or when the type is not given)."""
    interpret = interpreting() if interpret is None else interpret
    pairs = m * k
    if qtype in GROUP_TYPE_NAMES:
        # Not tuned per type: the packed types' prefill tiles (below), 4 warps also for blocks of 128 tokens (on the
        # H200 at 1024 and 2048 tokens 20-23% faster than 8 warps for IQ2_XXS and IQ3_S, spills and all:
        # benchmarks/RESULTS.md, twenty-fifth sitting). The interpreter runs programs one by one, each op at a fixed
        # cost: 16 tokens by 256 rows a program (a 5-token prefill of IQ3_XXS experts 4x faster than 64 rows).
        bm, s = (16, 3) if m <= 64 or interpret else (32, 4) if m <= 512 else (128, 4)
        return normalize_config({"path": "tile64", "BLOCK_M": bm, "BLOCK_N": 256 if interpret else 64,
                                 "GROUP_M": 1 if bm == 16 else 8, "num_warps": 4, "num_stages": s,
                                 "reduce": "sum_out"})  # fmt: skip
    if interpret:
        # The interpreter runs programs one by one: few programs with big tiles.
        # (256 rows against 128: a quantized tiny-model generation 1.5x faster)
        if pairs <= 16:
            return normalize_config({"path": "gemv", "BLOCK_N": 256, "BLOCK_K": 256, "reduce": "sum"})
        return normalize_config({"path": "tile", "BLOCK_M": 16, "BLOCK_N": 256, "BLOCK_K": 256, "reduce": "atomic"})
    if pairs <= 8 and qtype in PACKED_TYPE_NAMES:
        # Decode, gemv_v2 with x rounded to int8 (dp4a): GEMM 1 at one token is 384 programs of (slot, 16 rows);
        # GEMM 2 256 programs of (token, 8 rows x 8 slots), the slot sum inside. Every H200 table tuned so far
        # (Q4_K_M, Q6_K, Q8_0 at the 30B shape, Q4_K_M at the 235B shape) picked int8 x at M = 1, 1.3-1.6x
        # faster than float x with these tiles.
        # GEMM 2 one program per (token, slot) pair and 8 rows, one warp each (2,048 programs at one token), its rows
        # added by float32 atomics into an output GEMM 1 zeroes ("sum2"): on an H100 a Q4_K_M layer 17.6 -> 14.9 us
        # (Q4_K down), 19.0 -> 18.2 (Q6_K down) against 256 programs of 8 rows x 8 slots (benchmarks/RESULTS.md,
        # thirty-first sitting).
        cfg: Config = {"path": "gemv_v2", "BLOCK_N": 16, "BLOCK_K": 1024, "num_warps": 4, "num_stages": 1,
                       "BLOCK_N2": 8, "BLOCK_K2": 768, "num_warps2": 1, "num_stages2": 1, "x_q8": True,
                       "sum2": "atomic"}  # fmt: skip
    elif pairs <= 64 and qtype in PACKED_TYPE_NAMES:
        # A few tokens: three of those four tables picked this tile at M = 4 and 8 (GEMM 1 writing its output as
        # int8 for GEMM 2), the fourth (Q6_K) int8 x with a float intermediate; at M = 8 they ran 1.5-2.1x faster
        # than the tile path, the default there before.
        cfg = {"path": "gemv_v2", "BLOCK_N": 32, "BLOCK_K": 1024, "num_warps": 4, "num_stages": 1, "BLOCK_N2": 8,
               "BLOCK_K2": 768, "num_warps2": 4, "num_stages2": 1, "x_q8": True, "inter_q8": True}  # fmt: skip
    elif pairs <= 32:
        # Decode: one program per (slot, 16 rows) is 384 programs for GEMM 1 at one token, ~3 per SM. A step
        # covers 1024 inputs (four [16, 4, 32] tiles unrolled: 64 B of 4-bit codes per thread and matrix) so
        # enough loads are in flight per SM; GEMM 2 takes a 768-long row (I) in one step.
        cfg = {"path": "gemv", "BLOCK_N": 16, "BLOCK_K": 1024, "num_warps": 4, "num_stages": 2,
               "BLOCK_N2": 32, "BLOCK_K2": 768, "reduce": "sum"}  # fmt: skip
    elif qtype in PACKED_TYPE_NAMES:
        # Prefill of the types tile64 decodes: its fastest tiles in the H200 measurements of Q4_K_M, Q5_K_M, Q6_K
        # and Q8_0 layers at the 30B shape (blocks of 16 tokens at M <= 64, 32 at M <= 512, 128 above; 1.2-2.4x
        # faster than the tile path's defaults); a fixed summation order, as below. From 385 to 512 tokens (a
        # graphed prefill of 257-512 tokens runs at 512) blocks of 64: on an H100 the layer 8-12% faster at 512 for
        # Q2_K, Q3_K, Q4_0, Q5_0 and Q4_K (15-22% slower at 384), a Q3_K_M prefill of 384 / 512 tokens 16-17%
        # faster (benchmarks/RESULTS.md, forty-sixth and forty-seventh sittings).
        bm, s = (16, 3) if m <= 64 else (32, 4) if m <= 384 else (64, 4) if m <= 512 else (128, 4)
        cfg = {"path": "tile64", "BLOCK_M": bm, "BLOCK_N": 64, "GROUP_M": 1 if bm == 16 else 8, "num_warps": 4,
               "num_stages": s, "reduce": "sum_out"}  # fmt: skip
        # Above 512 tokens, an expert's last M-block as a short tile (TAIL_M, TAIL_M2), GEMM 2 in blocks of 256 up
        # to 2048 tokens, and above 2048 gate and up in programs of their own on blocks of 256 (split13): the
        # fastest forms for each of Q4_K, Q5_K, Q6_K and Q8_0 on an H100 without tables, 5-13% faster than these
        # tiles alone at 1024, 2048 and 4096 tokens (benchmarks/RESULTS.md, forty-first sitting).
        if 512 < m <= 1024:
            cfg |= {"TAIL_M": 64, "TAIL_M2": 64}
        elif 1024 < m <= 2048:
            cfg |= {"BLOCK_M2": 256, "num_stages2": 3, "TAIL_M": 32, "TAIL_M2": 128}
        elif m > 2048:
            cfg |= {"BLOCK_M": 256, "num_stages": 3, "split13": True, "TAIL_M": 64, "TAIL_M2": 64}
    elif m <= 64:
        cfg = {"path": "tile", "BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "GROUP_M": 1,
               "num_warps": 4, "num_stages": 3}  # fmt: skip
    elif m <= 512:
        cfg = {"path": "tile", "BLOCK_M": 32, "BLOCK_N": 128, "BLOCK_K": 128, "GROUP_M": 8,
               "num_warps": 4, "num_stages": 3}  # fmt: skip
    elif m <= 2048:
        cfg = {"path": "tile", "BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 128, "GROUP_M": 8,
               "num_warps": 8, "num_stages": 3}  # fmt: skip
    else:
        cfg = {"path": "tile", "BLOCK_M": 128, "BLOCK_N": 64, "BLOCK_K": 128, "GROUP_M": 8,
               "num_warps": 8, "num_stages": 3, "BLOCK_N2": 128}  # fmt: skip
    if cfg["path"] == "tile":
        cfg["reduce"] = "sum_out"  # a fixed summation order, as the bf16 defaults (tile_configs.default_config)
    return normalize_config(cfg)


def get_moe_config(
    qtype: str, E: int, H: int, I: int, k: int, m: int, device: str | None = None  # noqa: E741
) -> Config:
    """Tuned config of the smallest tuned M >= m for this type, shape and device (the largest up to twice it; by
    default the current CUDA device's table, else those shipped for its capability: tile_configs.table_devices),
    else the default for m (a table tuned for decode says nothing about prefill). Taking the bucket above m, not
    the nearest, gives m tokens the config of the power-of-two CUDA-graph bucket that holds them whenever the
    tuned Ms are powers of two, so that eager and graphed steps round x to int8 alike."""
    if not interpreting():
        user_dir = os.environ.get("MOERUN_MOE_CONFIG_DIR")
        table = first_found(lambda name: load_moe_table(qtype, E, H, I, name, user_dir),
                            (device,) if device else current_table_devices())  # fmt: skip
        if table and m <= 2 * max(table):
            return dict(table[min((b for b in table if b >= m), default=max(table))])
    return default_moe_config(m, k, qtype=qtype)


# gemv_v2 for y = x @ W^T at a few rows of x (Q4_K / Q5_K / Q6_K / Q8_0 parts): x rounded to int8, 4 rows per program,
# rows of up to 2048 inputs in one chunk, what the H200 tuning picked for q|k, q|k|v, o_proj and lm_head of a
# Qwen3-30B-A3B Q4_K_M (5.9-6.2 us and 91 us against 7.4-8.8 and 140 with float x).
MATMUL_V2_DECODE: Config = {"path": "gemv_v2", "BLOCK_N": 4, "BLOCK_K": 2048, "num_warps": 4, "num_stages": 1,
                            "x_q8": True}  # fmt: skip


def matmul_table_path(device: str, config_dir: Path | None = None) -> Path:
    """The tuned table of the dense quantized matmul on a device: {matmul_key: {M: config}}."""
    return (config_dir or CONFIG_DIR) / f"quant_gemv_{device}.json"


def matmul_key(qtype: str, n: int, k: int) -> str:
    """Table key of one weight part: its GGUF type and shape [n, k]."""
    return f"type={qtype},N={n},K={k}"


@functools.cache
def load_matmul_table(device: str, user_dir: str | None = None) -> dict[str, dict[int, Config]]:
    """The device's tuned dense quantized matmul table ({} when none was shipped); with user_dir, the parts its
    table holds replace the shipped entries (MOERUN_GEMV_CONFIG_DIR, the folder of the dense GEMV tables)."""
    table: dict[str, dict[int, Config]] = {}
    for path in [matmul_table_path(device)] + ([matmul_table_path(device, Path(user_dir))] if user_dir else []):
        if path.is_file():
            with path.open() as f:
                raw = json.load(f)
            table.update({key: {int(m): dict(cfg) for m, cfg in by_m.items()} for key, by_m in raw.items()})
    return table


def get_matmul_config(qtype: str, n: int, k: int, m: int, device: str | None = None) -> Config:
    """Tuned config of one weight part [n, k] of type qtype at m rows of x: the smallest tuned M bucket >= m when
    it is at most 4 m (so a prefill bucket never serves a few decode rows), else default_matmul_config. A table
    in the folder MOERUN_GEMV_CONFIG_DIR names comes first; a device without an entry for the part reads the table
    shipped for its compute capability (tile_configs.table_devices)."""
    return _matmul_config(qtype, n, k, m, device, os.environ.get("MOERUN_GEMV_CONFIG_DIR"))


def clear_matmul_configs() -> None:
    """Forgets the memoised matmul tables and configs (after a table was written, e.g. by the tuner)."""
    load_matmul_table.cache_clear()
    _matmul_config.cache_clear()


@functools.cache
def _matmul_config(qtype: str, n: int, k: int, m: int, device: str | None, user_dir: str | None) -> Config:
    """get_matmul_config, memoised: every quantized projection asks on every call."""
    if not interpreting():
        key = matmul_key(qtype, n, k)
        by_m = first_found(lambda name: load_matmul_table(name, user_dir).get(key),
                           (device,) if device else current_table_devices()) or {}  # fmt: skip
        fits = [b for b in by_m if m <= b <= 4 * m]
        if fits:
            return by_m[min(fits)]
    return default_matmul_config(m, n, qtype=qtype)


def default_matmul_config(m: int, n: int, interpret: bool | None = None, qtype: str | None = None) -> Config:
    """Config of y = x @ W^T for m rows of x and n output features of type qtype (decode takes gemv_v2 for the
    types it reads, the gemv path otherwise or when the type is not given; the grid types tile64 at any m)."""
    interpret = interpreting() if interpret is None else interpret
    if interpret and qtype in GROUP_TYPE_NAMES:  # the grid types take tile64 alone
        return {"path": "tile64", "BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 1, "num_warps": 4,
                "num_stages": 1}
    if interpret:
        if m <= 2:
            return {"path": "gemv", "BLOCK_N": 128, "BLOCK_K": 256, "num_warps": 4, "num_stages": 1}
        return {"path": "tile", "BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 256, "GROUP_M": 1, "num_warps": 4,
                "num_stages": 1}  # fmt: skip
    if m <= 4 and qtype not in GROUP_TYPE_NAMES:
        if qtype in PACKED_TYPE_NAMES:
            return dict(MATMUL_V2_DECODE)
        return {"path": "gemv", "BLOCK_N": 16, "BLOCK_K": 1024, "num_warps": 4, "num_stages": 2}
    if m <= 16:
        cfg = {"BLOCK_M": 16, "BLOCK_N": 64, "GROUP_M": 1, "num_warps": 4}
    elif m <= 64:
        cfg = {"BLOCK_M": 32, "BLOCK_N": 128, "GROUP_M": 4, "num_warps": 4}
    elif m <= 256:
        cfg = {"BLOCK_M": 64, "BLOCK_N": 128, "GROUP_M": 8, "num_warps": 8}
    else:
        cfg = {"BLOCK_M": 128, "BLOCK_N": 128, "GROUP_M": 8, "num_warps": 8}
    if qtype in PACKED_TYPE_NAMES or qtype in GROUP_TYPE_NAMES:  # tile64 decodes these (BLOCK_K: the tile path's)
        return {"path": "tile64", "BLOCK_K": 128, "num_stages": 3, **cfg}
    return {"path": "tile", "BLOCK_K": 128, "num_stages": 3, **cfg}


def gemv_steps(block_k: int, kq: int, max_pairs: int = 4) -> tuple[int, int]:
    """(pairs decoded together as one [.., pairs, 32] tile, such tiles unrolled per loop step) of the GEMV
    kernels for about block_k elements per step; both divide the kq pairs of a row, pairs is a power of two.

    The tile, hence the accumulator, stays at most max_pairs wide; longer steps unroll instead."""
    n = max(1, block_k // 64)
    p = 1 << (min(n, max_pairs).bit_length() - 1)
    while kq % p:
        p //= 2
    u = max(1, n // p)
    while (kq // p) % u:
        u -= 1
    return p, u


def dot_steps(block_k: int, kq: int) -> int:
    """Pairs per loop step of the tl.dot kernels: block_k / 64 lowered to a divisor of kq."""
    n = max(1, min(block_k // 64, kq))
    while kq % n:
        n -= 1
    return n
