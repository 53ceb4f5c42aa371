"""Tile configurations of the fused-MoE kernels: tuned JSON tables per shape and device, and defaults by M.

A config is a dict with keys:
  path        "gemv" (one program per (token-slot, N-tile), for decode) or "tile" (expert-sorted grouped GEMM)
  BLOCK_M     rows of an M-block (tile path; also the alignment padding)
  BLOCK_N, BLOCK_K, num_warps, num_stages           first GEMM (w13, SiLU*up epilogue)
  BLOCK_N2, BLOCK_K2, num_warps2, num_stages2       second GEMM (w2); default to the first GEMM's values
  GROUP_M     M-blocks that share a band of N-tiles in the launch order (tile path)
  TAIL_M      tile path: 0, or a power of two (>= 16, < BLOCK_M): an M-block holding at most TAIL_M token-slots
              (the last, partly filled block of an expert's run) runs as a TAIL_M-row tile in both GEMMs
  tma         tile path: the weight tiles of both GEMMs come by the tensor memory accelerator (tensor descriptors;
              stacked weights on a Hopper-class GPU or in the interpreter, else ignored)
  reduce      "atomic" (fp32 atomic adds into [T, H], returned unrounded under fused_moe_triton's keep_float32;
              on the gemv path GEMM 1 zeroes it), "sum" (write [T*k, H] fp32, then sum the k slots), on the
              tile path "sum_out" (as "sum", the rows rounded to the output dtype: half the bytes to write and to
              read back in 16-bit models) or, on the gemv path only, "fused" (GEMM2 runs per (token, N-tile) and
              sums the k slots in registers)
Tables are keyed by M, the number of tokens; k is the model's experts per token. A folder named by the environment
variable MOERUN_MOE_CONFIG_DIR is searched for a shape's table before the shipped ones (tables of one's own tuning,
``benchmarks/tune_moe.py --out-dir``). A card with no table of its own for a shape reads those shipped for the
cards of its compute capability (SHIPPED_FOR_CAPABILITY: an H100 runs the H200's tables), then the defaults.
"""

from __future__ import annotations

import functools
import json
import math
import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, TypeVar

import torch

from moerun.kernels.interpreter import interpreting

CONFIG_DIR = Path(__file__).parent / "configs"
M_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
PATHS = ("gemv", "tile")
REDUCTIONS = ("atomic", "sum", "sum_out", "fused")
# The cards whose shipped tables (MoE, dense GEMV, quantized) serve every card of the same compute capability that has
# none of its own for a shape, first match first. The sm_90 tiles were tuned on an H200; on an H100 80GB they beat the
# untuned defaults end to end in all but one figure (Q4_K_M batch 1 +8%, bf16 prefill +15-21%; the Q4_K_M prefill of
# 2048 tokens -1.5%: benchmarks/RESULTS.md, forty-fourth sitting, "tables by architecture"). The H100's own tables
# cover what the H200's do not: the decode tiles of the second-tier K-quant types (forty-sixth sitting).
SHIPPED_FOR_CAPABILITY: dict[tuple[int, int], tuple[str, ...]] = {(9, 0): ("NVIDIA_H200", "NVIDIA_H100_80GB_HBM3")}
Found = TypeVar("Found")

Config = dict[str, Any]


def dtype_name(dtype: torch.dtype) -> str:
    """'bfloat16' for torch.bfloat16, as used in config file names."""
    return str(dtype).removeprefix("torch.")


def device_name(device: torch.device | int | None = None) -> str:
    """CUDA device name with spaces replaced, e.g. 'NVIDIA_H200'; 'cpu' without CUDA."""
    if not torch.cuda.is_available():
        return "cpu"
    return torch.cuda.get_device_name(device).replace(" ", "_")


def table_devices(device: str, capability: tuple[int, int] | None) -> tuple[str, ...]:
    """The devices whose tuned tables a card named ``device`` of that compute capability reads, first match first:
    its own, then the cards whose tables were shipped for its capability (each once)."""
    shipped = SHIPPED_FOR_CAPABILITY.get(capability, ()) if capability is not None else ()
    return (device,) + tuple(card for card in shipped if card != device)


@functools.cache
def cuda_table_devices(index: int) -> tuple[str, ...]:
    """table_devices of CUDA device ``index``."""
    return table_devices(device_name(index), torch.cuda.get_device_capability(index))


def current_table_devices() -> tuple[str, ...]:
    """table_devices of the current CUDA device; ('cpu',) without CUDA."""
    if not torch.cuda.is_available():
        return ("cpu",)
    return cuda_table_devices(torch.cuda.current_device())


def devices_with_tables(devices: Iterable[str]) -> list[str]:
    """Those of ``devices`` with a tuned table of any kind (MoE, dense GEMV, quantized) in the shipped folder or in
    the folders that MOERUN_MOE_CONFIG_DIR and MOERUN_GEMV_CONFIG_DIR name."""
    folders = [CONFIG_DIR] + [Path(os.environ[v]) for v in ("MOERUN_MOE_CONFIG_DIR", "MOERUN_GEMV_CONFIG_DIR")
                              if os.environ.get(v)]  # fmt: skip
    return [d for d in devices if any(next(f.glob(f"*{d}.json"), None) for f in folders if f.is_dir())]


def first_found(lookup: Callable[[str], Found | None], devices: Iterable[str]) -> Found | None:
    """lookup(device) for the first of ``devices`` where it finds something (neither None nor empty), else None."""
    for device in devices:
        found = lookup(device)
        if found:
            return found
    return None


def config_file_name(E: int, H: int, I: int, dtype: torch.dtype, device: str) -> str:  # noqa: E741
    """File name of the tuned table for one expert shape, dtype and device."""
    return f"E={E},H={H},I={I},dtype={dtype_name(dtype)},device={device}.json"


@functools.cache
def load_table(
    E: int, H: int, I: int, dtype: torch.dtype, device: str, user_dir: str | None = None  # noqa: E741
) -> dict[int, Config] | None:
    """Tuned {M: config} table for the shape from user_dir, else the shipped one; None when neither has it."""
    raw = read_table(config_file_name(E, H, I, dtype, device), CONFIG_DIR, user_dir)
    return None if raw is None else {m: normalize(cfg) for m, cfg in raw.items()}


def read_table(name: str, shipped: Path, user_dir: str | None = None) -> dict[int, Config] | None:
    """The {M: config} table in file ``name`` of user_dir (a folder of one's own tuning), else of the shipped
    folder, configs as written; None when neither has it."""
    path = Path(user_dir) / name if user_dir else None
    if path is None or not path.is_file():
        path = shipped / name
    if not path.is_file():
        return None
    with path.open() as f:
        return {int(m): cfg for m, cfg in json.load(f).items()}


def normalize(cfg: Config) -> Config:
    """Copy of cfg with the optional keys filled in and the values checked."""
    out = dict(cfg)
    out.setdefault("path", "tile")
    out.setdefault("BLOCK_M", 16)
    out.setdefault("GROUP_M", 1)
    out.setdefault("num_warps", 4)
    out.setdefault("num_stages", 2)
    out.setdefault("reduce", "atomic" if out["path"] == "tile" else "sum")
    out.setdefault("TAIL_M", 0)
    out.setdefault("tma", False)
    for key in ("BLOCK_N", "BLOCK_K", "num_warps", "num_stages"):
        out.setdefault(f"{key}2", out[key])
    if out["path"] not in PATHS:
        raise ValueError(f"unknown MoE kernel path {out['path']!r}; expected one of {PATHS}")
    if out["reduce"] not in REDUCTIONS:
        raise ValueError(f"unknown MoE slot reduction {out['reduce']!r}; expected one of {REDUCTIONS}")
    tail = out["TAIL_M"]
    if tail and (tail < 16 or tail & (tail - 1) or tail >= out["BLOCK_M"] or out["path"] != "tile"):
        raise ValueError(f"TAIL_M must be 0 or a power of two >= 16 below BLOCK_M on the tile path, got {out}")
    if out["tma"] and out["path"] != "tile":
        raise ValueError(f"tma needs the tile path, got {out}")
    if out["reduce"] == "sum_out" and out["path"] != "tile":
        raise ValueError(f"slot reduction 'sum_out' needs the tile path, got path {out['path']!r}")
    if out["reduce"] == "fused" and out["path"] != "gemv":
        raise ValueError(f"slot reduction 'fused' needs the gemv path, got path {out['path']!r}")
    return out


def nearest_bucket(keys: list[int] | tuple[int, ...], m: int) -> int:
    """Key closest to m on a log scale (ties go to the larger key)."""
    lm = math.log2(max(m, 1))
    return min(keys, key=lambda b: (abs(math.log2(b) - lm), -b))


def default_config(m: int, k: int, dtype: torch.dtype, interpret: bool | None = None) -> Config:
    """Hand-reasoned config for m tokens with k slots each, used when no tuned table covers the shape."""
    interpret = interpreting() if interpret is None else interpret
    pairs = m * k
    if interpret:
        # Few, small programs: the interpreter runs programs one after another.
        if pairs <= 16:
            return normalize({"path": "gemv", "BLOCK_N": 32, "BLOCK_K": 32, "reduce": "sum"})
        return normalize({"path": "tile", "BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 32, "reduce": "atomic"})
    # Shared memory per stage is (BLOCK_M + 2 * BLOCK_N) * BLOCK_K * 2 bytes; all below use <= 164 KB of 227 KB.
    if pairs <= 64:
        # Bandwidth-bound: thin N-tiles give >= 3 programs per SM on a 132-SM part even at one token.
        cfg: Config = {
            "path": "gemv", "BLOCK_N": 16, "BLOCK_K": 256, "num_warps": 4, "num_stages": 2,
            "BLOCK_N2": 32, "BLOCK_K2": 256, "reduce": "sum",
        }  # fmt: skip
        if m == 1:
            # One token (batch-1 decode): GEMM 2 adds into float32 sums that GEMM 1 zeroes, which the model hands
            # to the next norm unrounded; no ticket round trip, no memset or cast launch (measured in whole steps).
            cfg.update({"BLOCK_K2": 128, "reduce": "atomic"})
    elif m <= 32:
        cfg = {"path": "tile", "BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "GROUP_M": 1,
               "num_warps": 4, "num_stages": 4}  # fmt: skip
    elif m <= 128:
        cfg = {"path": "tile", "BLOCK_M": 16, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 1,
               "num_warps": 4, "num_stages": 4}  # fmt: skip
    elif m <= 512:
        cfg = {"path": "tile", "BLOCK_M": 32, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8,
               "num_warps": 4, "num_stages": 4}  # fmt: skip
    elif m <= 2048:
        cfg = {"path": "tile", "BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8,
               "num_warps": 4, "num_stages": 4}  # fmt: skip
    else:
        cfg = {"path": "tile", "BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8,
               "num_warps": 8, "num_stages": 3}  # fmt: skip
    if cfg["path"] == "tile":
        # Per-slot rows summed in a fixed order: the same inputs give the same bits (atomic adds land in whatever
        # order the programs run).
        cfg["reduce"] = "sum_out"
    if dtype == torch.float32:
        # Twice the bytes per element: halve the K-tile and the pipeline depth to stay within shared memory.
        cfg["BLOCK_K"] = max(16, cfg["BLOCK_K"] // 2)
        cfg["num_stages"] = min(cfg["num_stages"], 2)
        if "BLOCK_K2" in cfg:
            cfg["BLOCK_K2"] = max(16, cfg["BLOCK_K2"] // 2)
    return normalize(cfg)


def get_config(
    E: int,
    H: int,
    I: int,  # noqa: E741
    k: int,
    dtype: torch.dtype,
    m: int,
    device: str | None = None,
) -> Config:
    """Tuned config of the nearest M bucket for this shape and device (by default the current CUDA device, or the
    card shipped for its capability: table_devices), else the default for m."""
    # Tuned tables hold GPU-sized tiles, far too slow for the interpreter, which keeps its small defaults.
    if not interpreting():
        user_dir = os.environ.get("MOERUN_MOE_CONFIG_DIR")
        table = first_found(lambda name: load_table(E, H, I, dtype, name, user_dir),
                            (device,) if device else current_table_devices())  # fmt: skip
        if table:
            return dict(table[nearest_bucket(list(table), m)])
    return default_config(m, k, dtype)
