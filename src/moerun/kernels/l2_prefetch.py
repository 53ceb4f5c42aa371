"""Weights brought into L2 ahead of the kernel that reads them, by a kernel that would leave the memory idle.

At batch 1 a decode layer alternates kernels that stream weights (the GEMVs, the MoE GEMMs) with kernels bound by
the latency of a few dependent steps (the q/k norm + RoPE, decode attention): while the latter run, HBM has
nothing to do. A kernel of the second kind can take ``L2Regions``, the byte ranges of the weights the next
streaming kernel will read, and have its programs issue Hopper's bulk L2 prefetch over them
(``cp.async.bulk.prefetch.L2``: one instruction a 64 KiB chunk, nothing waited for, nothing written), so that
the GEMV after it reads them from L2. Results never change; only where the bytes come from.

Three users: the q/k norm launch brings o_proj's weight into L2 during the attention ("o_proj"; decode of up to
16 tokens), the int8 RMSNorm in front of a quantized q|k|v brings q|k|v's weight while the last MoE GEMM runs
("qkv"), and at one token GEMM 1 brings its expert's GEMM 2 weights, each program a share ("w2"). Only on CUDA
devices of compute capability 9.0 and later, outside the interpreter, for what ``MOERUN_L2_PREFETCH`` names
("o_proj,qkv,w2"; read at each launch, so at a graph's capture; off by default until measured).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from moerun.kernels.interpreter import interpreting
from moerun.kernels.pdl import hopper_or_later

# The regions a launch takes (the largest tensors of a weight), and the bytes one prefetch instruction covers.
MAX_REGIONS = 2
CHUNK = tl.constexpr(65536)
# Tokens up to which GEMM 1 prefetches GEMM 2's experts (more tokens touch more experts than L2 holds).
EXPERT_PREFETCH_MAX_TOKENS = 1
# Regions' start and length must be multiples of this many bytes (the instruction's rule).
ALIGN = 16


@triton.jit
def prefetch_to_l2(ptr, nbytes, part, parts, BLOCK: tl.constexpr):
    """Issues the bulk L2 prefetches of part ``part`` of ``parts`` of the bytes [ptr, ptr + nbytes): chunks of
    CHUNK bytes dealt round-robin, BLOCK a step. ptr (uint8) and nbytes must be multiples of ALIGN."""
    chunks = tl.cdiv(nbytes, CHUNK)
    for c0 in range(part * BLOCK, chunks, parts * BLOCK):
        off = (c0 + tl.arange(0, BLOCK)).to(tl.int64) * CHUNK  # [BLOCK] byte offsets
        size = tl.minimum(tl.maximum(nbytes - off, 0), CHUNK).to(tl.int32)  # 0 past the end: skipped
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.gt.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
            "=r,l,r", [ptr + off, size], dtype=tl.int32, is_pure=False, pack=1,
        )  # fmt: skip


@triton.jit
def prefetch_regions(pf0_ptr, pf0_bytes, pf1_ptr, pf1_bytes, part, parts, PREFETCH: tl.constexpr):
    """The first PREFETCH (0-2) regions of an L2Regions, part ``part`` of ``parts`` of each."""
    if PREFETCH > 0:
        prefetch_to_l2(pf0_ptr, pf0_bytes, part, parts, 8)
    if PREFETCH > 1:
        prefetch_to_l2(pf1_ptr, pf1_bytes, part, parts, 8)


@triton.jit
def prefetch_expert(pf, expert, part, parts, PFE: tl.constexpr):
    """Part ``part`` of ``parts`` of expert ``expert``'s byte ranges in the first PFE (0-2) of an ExpertRegions."""
    if PFE > 0:
        prefetch_to_l2(pf[0] + expert * pf[1], pf[2], part, parts, 1)
    if PFE > 1:
        prefetch_to_l2(pf[3] + expert * pf[4], pf[5], part, parts, 1)


class ExpertRegions(NamedTuple):
    """Each expert's bytes in up to two stacked [E, ...] tensors (uint8 views of the whole tensors), passed to a
    kernel as one argument beside the constexpr PFE (how many are used): GEMM 1 brings its expert's GEMM 2
    weights into L2."""

    ptr0: torch.Tensor
    stride0: int  # bytes from one expert to the next
    bytes0: int  # bytes of one expert (a multiple of ALIGN)
    ptr1: torch.Tensor
    stride1: int
    bytes1: int

    def kernel_args(self, count: int) -> dict:
        return {"pfe": self, "PFE": count}


def expert_regions(tensors: Sequence[torch.Tensor], what: str = "w2") -> dict:
    """The kernel arguments (``pfe``, ``PFE``) that prefetch each expert's part of the MAX_REGIONS largest of the
    stacked ``tensors`` (contiguous, [E, ...], on ALIGN bytes, per-expert strides multiples of ALIGN); {} when none
    qualifies or ``what`` is not enabled (prefetch_enabled)."""
    usable = [t for t in tensors if t.dim() > 1 and t.is_contiguous() and t.numel() and t.data_ptr() % ALIGN == 0
              and t.stride(0) * t.element_size() % ALIGN == 0]  # fmt: skip
    if not usable or not prefetch_enabled(usable[0].device, what):
        return {}
    usable.sort(key=lambda t: t.numel() * t.element_size(), reverse=True)
    fields: list = []
    for t in usable[:MAX_REGIONS]:
        per_expert = t.stride(0) * t.element_size()
        fields += [t.reshape(-1).view(torch.uint8), per_expert, per_expert - per_expert % ALIGN]
    count = len(fields) // 3
    fields += fields[:3] * (MAX_REGIONS - count)
    return ExpertRegions(*fields).kernel_args(count)


class L2Regions(NamedTuple):
    """Up to MAX_REGIONS byte ranges, as uint8 tensors (each one a whole contiguous tensor's bytes, trimmed to a
    multiple of ALIGN)."""

    regions: tuple[torch.Tensor, ...]

    def kernel_args(self) -> dict:
        """prefetch_regions' arguments: pf{i}_ptr, pf{i}_bytes and PREFETCH."""
        args: dict = {"PREFETCH": len(self.regions)}
        for i in range(MAX_REGIONS):
            r = self.regions[i] if i < len(self.regions) else self.regions[0]
            args[f"pf{i}_ptr"], args[f"pf{i}_bytes"] = r, r.numel()
        return args


def l2_regions(tensors: Sequence[torch.Tensor], what: str = "o_proj") -> L2Regions | None:
    """The MAX_REGIONS largest of ``tensors`` (contiguous, starting on ALIGN bytes) as L2Regions, or None when none
    qualifies or ``what`` is not enabled (prefetch_enabled)."""
    usable = [t for t in tensors if t.is_contiguous() and t.numel() and t.data_ptr() % ALIGN == 0]
    if not usable or not prefetch_enabled(usable[0].device, what):
        return None
    usable.sort(key=lambda t: t.numel() * t.element_size(), reverse=True)
    regions = []
    for t in usable[:MAX_REGIONS]:
        raw = t.reshape(-1).view(torch.uint8)
        regions.append(raw[: raw.numel() - raw.numel() % ALIGN])
    kept = tuple(r for r in regions if r.numel())
    return L2Regions(kept) if kept else None


def prefetch_enabled(device: torch.device, what: str) -> bool:
    """Whether launches on ``device`` prefetch ``what`` ("o_proj", "qkv", "w2": see the module's docstring): CUDA,
    sm_90 or later, not interpreted, ``what`` named in MOERUN_L2_PREFETCH (separated by commas or "+")."""
    named = os.environ.get("MOERUN_L2_PREFETCH", "").replace("+", ",").split(",")
    return device.type == "cuda" and not interpreting() and what in named and hopper_or_later(device)

