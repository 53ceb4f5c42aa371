"""Kernels for the types without a repacked layout (grid, ternary and NVFP4 types) that read their GGUF blocks
directly: dequantisation in one launch (a whole stacked weight, or the experts of given ids, repeats allowed), and
a GEMV for a few rows of x (each row against the expert its id names: the MoE's (token, slot) pairs at decode).

The grid types decode a group of 8 values a thread (from_groups.py); on the GPU their GEMV reads x rounded to int8
and multiplies four values an instruction (dp4a), as llama.cpp's CUDA decode of these types does. The ternary and
NVFP4 types (TQ1_0, TQ2_0, NVFP4) decode up to 256 elements of BLOCK_N rows a step, each element's bytes read
from its block (loads of one address by many lanes are one transaction), FP4 levels from a 16-entry table.
Every value is a product of exact factors, so the dequantised float32 values are formats.quants.dequantize's bit
for bit (the torch reference the tests compare with); the float GEMV sums their products with x in float32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moerun.formats.quants import FP4_VALUES, QuantizedTensor, QuantType, dequantize
from moerun.formats.quants.grids import grid_table
from moerun.kernels.interpreter import interpreting
from moerun.kernels.pdl import launch_options, quant_pdl_mode
from moerun.kernels.quant.from_groups import GROUP_TYPES, _group_dequant_kernel, _group_gemv_kernel, _half, _u8, _u16
from moerun.kernels.quant.int8_dot import Int8Rows, emulate_dp4a, quantize_x
from moerun.kernels.quant.repack import PackedWeight
from moerun.kernels.rmsnorm import round_to

BLOCK_TYPES: tuple[QuantType, ...] = (
    QuantType.IQ2_XXS, QuantType.IQ2_XS, QuantType.IQ2_S, QuantType.IQ3_XXS, QuantType.IQ3_S, QuantType.IQ1_S,
    QuantType.IQ1_M, QuantType.TQ1_0, QuantType.TQ2_0, QuantType.NVFP4,
)  # fmt: skip
_TABLES: dict[tuple[str, torch.device], torch.Tensor] = {}


@triton.jit
def _block_values(QTYPE: tl.constexpr, blk, j, levels):
    """float32 values of elements j (of their block; [1, S]) of the blocks at blk ([BN, 1] or [BN, S])."""
    if QTYPE == 34:  # TQ1_0: base-3 digits, five a byte (bytes 0-47), four a byte (48-51); fp16 d at 52
        in0 = j < 160
        in1 = j < 240
        byte = tl.where(in0, j % 32, tl.where(in1, 32 + (j - 160) % 16, 48 + (j - 240) % 4))
        digit = tl.where(in0, j // 32, tl.where(in1, (j - 160) // 16, (j - 240) // 4))
        p3 = tl.where(digit == 0, 1, tl.where(digit == 1, 3, tl.where(digit == 2, 9, tl.where(digit == 3, 27, 81))))
        gv = ((((_u8(blk, byte) * p3) & 255) * 3) >> 8).to(tl.float32) - 1.0
        neg = j * 0
        mult = 1.0
        d = _half(_u16(blk, j * 0 + 52))
    elif QTYPE == 35:  # TQ2_0: 2-bit codes (element 128h + 32k + l at bits 2k of byte 32h + l); fp16 d at 64
        gv = ((_u8(blk, 32 * (j // 128) + j % 32) >> (2 * ((j % 128) // 32))) & 3).to(tl.float32) - 1.0
        neg = j * 0
        mult = 1.0
        d = _half(_u16(blk, j * 0 + 64))
    else:  # NVFP4: UE4M3 scale byte per 16 (halved), FP4 nibbles
        tl.static_assert(QTYPE == 40, "from_blocks: unsupported type")
        gv = tl.load(levels + ((_u8(blk, 4 + 8 * (j // 16) + j % 8) >> (4 * ((j % 16) // 8))) & 15)).to(tl.float32)
        neg = j * 0
        mult = 1.0
        x = _u8(blk, j // 16)
        ex = (x >> 3) & 15
        man = (x & 7).to(tl.float32)
        # (8 + man) 2^(ex - 11), subnormal man 2^-10 (2^(ex - 11) built from its exponent bits)
        d = tl.where(ex == 0, man * 0.0009765625, (man + 8.0) * ((ex + 116) << 23).to(tl.float32, bitcast=True))
        d = tl.where((x == 0) | (x == 0x7F), 0.0, d)
    return tl.where(neg != 0, -gv, gv) * (d * mult)


@triton.jit
def _row_blocks(raw, e, N, row_bytes, BLOCK_N: tl.constexpr, SB: tl.constexpr, STEP: tl.constexpr,
                BLOCK_BYTES: tl.constexpr):  # fmt: skip
    """This program's rows of expert e: (row indices [BN, 1] int64, clamped to N - 1; element columns [1, STEP];
    each element's block in the first step [BN, STEP])."""
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)[:, None]
    rows_c = tl.minimum(rows, N - 1).to(tl.int64)
    col = tl.arange(0, STEP)[None, :]
    return rows_c, col, raw + (e * N + rows_c) * row_bytes + (col // SB) * BLOCK_BYTES


@triton.jit
def _block_dequant_kernel(
    out_ptr,  # [P, N, K] (unit stride along K)
    raw,  # uint8 GGUF blocks of the stacked weight [E, N, row_bytes]
    ids,  # int64 [P]: which expert each output matrix holds (HAS_IDS), else p itself
    levels,
    N,
    K,
    row_bytes,
    stride_op,
    stride_on,
    QTYPE: tl.constexpr,
    SB: tl.constexpr,  # elements per GGUF block
    STEP: tl.constexpr,  # elements a loop step: a multiple of SB dividing K
    BLOCK_BYTES: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_IDS: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    p = tl.program_id(0)
    e = tl.load(ids + p).to(tl.int64) if HAS_IDS else p.to(tl.int64)
    rows_c, col, blk = _row_blocks(raw, e, N, row_bytes, BLOCK_N, SB, STEP, BLOCK_BYTES)
    ok = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)[:, None] < N  # [BN, 1]
    dst = out_ptr + p.to(tl.int64) * stride_op + rows_c * stride_on  # [BN, 1]
    for b in range(0, K // STEP):
        v = _block_values(QTYPE, blk + b * (STEP // SB * BLOCK_BYTES), col % SB, levels)
        tl.store(dst + b * STEP + col, round_to(v, out_ptr.dtype.element_ty, INTERPRET), mask=ok)


def _levels(device: torch.device) -> torch.Tensor:
    """The FP4 levels (int8 [16]) on device, made once."""
    key = ("fp4", device)
    if key not in _TABLES:
        _TABLES[key] = torch.tensor(FP4_VALUES, dtype=torch.int8, device=device)
    return _TABLES[key]


def _check_blocks(raw: torch.Tensor) -> None:
    """The kernels read 16-bit fields in one load: the blocks must start at an even address."""
    if raw.data_ptr() % 2:
        raise ValueError("GGUF blocks must start at an even address (a view at an odd byte offset was given)")


def _grid_words(qtype: QuantType, device: torch.device) -> torch.Tensor:
    """A grid type's table as int32 words of four entries' values (from_groups.group_words reads it so)."""
    return grid_table(qtype, device).view(torch.int32)


class GroupBlocks(PackedWeight):
    """A grid-type weight [*lead, N, K] as the tile kernels of fused_moe_quant.py read it: `codes` its GGUF blocks
    [*lead, N, row_bytes] as they are (no copy), `high` the type's table (_grid_words); k_pad = K."""

    __slots__ = ()

    @classmethod
    def of(cls, part: QuantizedTensor) -> "GroupBlocks":
        if part.qtype not in GROUP_TYPES:
            raise ValueError(f"GroupBlocks holds the grid types {[t.name for t in GROUP_TYPES]}, not {part.qtype.name}")
        _check_blocks(part.raw)
        return cls(part.qtype, part.shape, part.shape[-1], part.raw, _grid_words(part.qtype, part.raw.device))

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight decoded by the GGUF reference decoder: [*lead, N, K]."""
        return dequantize(self.codes, self.qtype, self.shape).to(dtype)


def _step(qtype: QuantType, K: int) -> int:
    """Elements a loop step: 256 where K allows, else the largest power of two of whole blocks dividing K."""
    return next(s for s in (256, 128, 64, 32) if s >= qtype.block_elems and K % s == 0)


def block_dequantize(raw: torch.Tensor, qtype: QuantType, shape: tuple[int, ...], dtype: torch.dtype,
                     ids: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """Dense [E, N, K] (or [len(ids), N, K]: experts ids, repeats allowed) `dtype` tensor of the blocks raw of a
    weight of logical shape [E, N, K] or [N, K] of a BLOCK_TYPES type; [N, K] in, [N, K] out without ids."""
    if qtype not in BLOCK_TYPES:
        raise ValueError(f"block_dequantize decodes {[t.name for t in BLOCK_TYPES]}, not {qtype.name}")
    _check_blocks(raw)
    lead = shape[:-2]
    N, K = shape[-2:]
    E = 1 if not lead else lead[0]
    P = E if ids is None else ids.numel()
    out = torch.empty((P, N, K), dtype=dtype, device=raw.device)
    row_bytes = K // qtype.block_elems * qtype.block_bytes
    if P and N and qtype in GROUP_TYPES:
        block_n = 16
        _group_dequant_kernel[(P, triton.cdiv(N, block_n))](
            out, raw, raw if ids is None else ids, _grid_words(qtype, raw.device), N, K, row_bytes, out.stride(0),
            out.stride(1), QTYPE=int(qtype), BLOCK_BYTES=qtype.block_bytes, BLOCK_N=block_n, HAS_IDS=ids is not None,
            INTERPRET=interpreting(), num_warps=4,
        )  # fmt: skip
    elif P and N:
        block_n = 32
        step = _step(qtype, K)
        launch = (P, triton.cdiv(N, block_n))
        _block_dequant_kernel[launch](
            out, raw, raw if ids is None else ids, _levels(raw.device), N, K, row_bytes, out.stride(0), out.stride(1),
            QTYPE=int(qtype), SB=qtype.block_elems, STEP=step, BLOCK_BYTES=qtype.block_bytes, BLOCK_N=block_n,
            HAS_IDS=ids is not None, INTERPRET=interpreting(), num_warps=4,
        )  # fmt: skip
    return out if lead or ids is not None else out[0]


@triton.jit
def _block_gemv_kernel(
    out_ptr,  # [P, N]
    raw,  # uint8 GGUF blocks [E, N, row_bytes]
    ids,  # int64 [P]: the expert row p multiplies (HAS_IDS), else expert 0
    x_ptr,  # [P // X_DIV, K]: row p reads x row p // X_DIV
    levels,
    N,
    K,
    row_bytes,
    stride_x,
    stride_o,
    QTYPE: tl.constexpr,
    SB: tl.constexpr,
    STEP: tl.constexpr,
    BLOCK_BYTES: tl.constexpr,
    BLOCK_N: tl.constexpr,
    X_DIV: tl.constexpr,
    HAS_IDS: tl.constexpr,
):
    p = tl.program_id(0)
    e = tl.load(ids + p).to(tl.int64) if HAS_IDS else 0
    rows_c, col, blk = _row_blocks(raw, e, N, row_bytes, BLOCK_N, SB, STEP, BLOCK_BYTES)
    xrow = x_ptr + (p // X_DIV).to(tl.int64) * stride_x
    acc = tl.zeros((BLOCK_N, STEP), dtype=tl.float32)
    for b in range(0, K // STEP):
        v = _block_values(QTYPE, blk + b * (STEP // SB * BLOCK_BYTES), col % SB, levels)
        xs = tl.load(xrow + b * STEP + col).to(tl.float32)  # [1, STEP]
        acc += v * xs
    y = tl.sum(acc, axis=1)  # [BN]
    offs = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    tl.store(out_ptr + p.to(tl.int64) * stride_o + offs, y.to(out_ptr.dtype.element_ty), mask=offs < N)


def grid_rounds_x() -> bool:
    """Whether the grid types' GEMV rounds x to int8 by default (dp4a): on a GPU, not in Triton's interpreter
    (whose float path is quicker). Producers of x hand it over rounded where this holds (ops.quant's
    int8_input_pad and moe_int8_input_pad)."""
    return not interpreting()


def grid_gemv_config(N: int, K: int, gate_up: bool = False, slots: int = 1) -> dict[str, int]:
    """Tiles of the grid types' GEMV for rows of K values (N rows, gate and up together, `slots` pairs summed a
    program): BLOCK_N rows a program, GROUPS groups of 8 values of each row a loop step (all of a row's blocks in
    flight at once where the row has at most 256 groups), num_warps, gather (the table gathered from registers),
    unroll (the step loop unrolled). The interpreter takes few, big programs."""
    groups = min(256, triton.next_power_of_2(max(K // 8, 1)))
    if interpreting():
        return {"BLOCK_N": 64, "GROUPS": min(groups, 64), "num_warps": 4, "gather": 0}
    if gate_up or slots > 1:
        # The MoE parts with the step loop unrolled (H100, IQ2_M at the 30B shape, benchmarks/RESULTS.md, twenty-sixth
        # sitting): down with its 8 slots summed 20.2 -> 14.8 us at one token (the slots' loads in flight together,
        # not one slot after the other), gate and up 16.7 -> 15.9 us.
        return {"BLOCK_N": 4, "GROUPS": min(groups, 128), "num_warps": 4, "gather": 1, "unroll": 1}
    return {"BLOCK_N": 2 if N < 2048 else 4, "GROUPS": groups, "num_warps": 4, "gather": 1}


def block_gemv(raw: torch.Tensor, qtype: QuantType, shape: tuple[int, ...], x: torch.Tensor,
               ids: torch.Tensor | None = None, x_div: int = 1, x_q8: bool | None = None,
               up_raw: torch.Tensor | None = None, weights: torch.Tensor | None = None,
               out_dtype: torch.dtype | None = None, x_int8: Int8Rows | None = None, sum_slots: int = 1,
               config: dict[str, int] | None = None, out: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """y [P, N] (in out_dtype, default x's): row p of y is W_e x_(p // x_div) for a weight of logical shape
    [E, N, K] (e = ids[p]) or [N, K] (no ids), from its GGUF blocks raw; x [P / x_div, K]. P = len(ids) or, without
    ids, x's rows. Grid types only:
      x_q8      x rounded to int8 per 32 values first (int8_dot.quantize_x), the result W x^ for that x^ (default:
                on a GPU, not in Triton's interpreter);
      up_raw    blocks of a second weight of the same type and shape (an MoE's up projection beside its gate):
                row p is then silu(W x) * (U x), both in one launch;
      weights   [P]: row p is multiplied by weights[p] (the routing weight of a (token, slot) pair);
      x_int8    x already rounded (quantize_x(x, K)), read instead of rounding it again when x_q8;
      sum_slots the sum of each run of sum_slots consecutive rows (an MoE token's slots) instead: [P / sum_slots, N];
      config    grid_gemv_config's keys (default: its choice);
      out       where to write y (a view with unit stride along N, e.g. columns of a wider output)."""
    if qtype not in BLOCK_TYPES:
        raise ValueError(f"block_gemv reads {[t.name for t in BLOCK_TYPES]}, not {qtype.name}")
    _check_blocks(raw)
    N, K = shape[-2:]
    if x.shape[-1] != K or x.stride(-1) != 1:
        raise ValueError(f"x must be [rows, {K}] with unit stride along K, got {tuple(x.shape)} {x.stride()}")
    if (up_raw is not None or weights is not None or sum_slots != 1) and qtype not in GROUP_TYPES:
        raise ValueError(f"block_gemv fuses gate with up, routing weights and slot sums for the grid types only, not "
                         f"{qtype.name}")  # fmt: skip
    if up_raw is not None and up_raw.shape != raw.shape:
        raise ValueError(f"up blocks of shape {tuple(up_raw.shape)} do not match the gate's {tuple(raw.shape)}")
    P = x.shape[0] * x_div if ids is None else ids.numel()
    if sum_slots < 1 or P % sum_slots:
        raise ValueError(f"sum_slots must be a positive divisor of the {P} rows, got {sum_slots}")
    dtype = out_dtype or x.dtype
    if out is not None and (tuple(out.shape) != (P // sum_slots, N) or out.stride(-1) != 1 or out.dtype != dtype):
        raise ValueError(f"out must be [{P // sum_slots}, {N}] {dtype} with unit stride along N, got "
                         f"{tuple(out.shape)} {out.dtype} {out.stride()}")  # fmt: skip
    out = torch.empty((P // sum_slots, N), dtype=dtype, device=x.device) if out is None else out
    row_bytes = K // qtype.block_elems * qtype.block_bytes
    if P and N and qtype in GROUP_TYPES:
        q8 = grid_rounds_x() if x_q8 is None else x_q8
        xq = (x_int8 if x_int8 is not None else quantize_x(x, K)) if q8 else None
        cfg = config or grid_gemv_config(N, K, up_raw is not None, sum_slots)
        pdl = quant_pdl_mode(x.device, P)
        table = grid_table(qtype, raw.device)  # [entries, width]
        _group_gemv_kernel[(P // sum_slots, triton.cdiv(N, cfg["BLOCK_N"]))](
            out, raw, raw if up_raw is None else up_raw, raw if ids is None else ids, x if xq is None else xq.xq,
            x if xq is None else xq.dx, x if weights is None else weights, table.view(torch.int32), N, K,
            row_bytes, x.stride(0) if xq is None else xq.xq.stride(0), 0 if xq is None else xq.dx.stride(0),
            out.stride(0), QTYPE=int(qtype), BLOCK_BYTES=qtype.block_bytes, BLOCK_N=cfg["BLOCK_N"],
            GROUPS=cfg["GROUPS"], X_DIV=x_div, SLOTS=sum_slots, HAS_IDS=ids is not None, X_Q8=q8,
            GATE_UP=up_raw is not None, WEIGHTED=weights is not None, EMULATE_DP4A=emulate_dp4a(),
            GATHER=bool(cfg.get("gather", 0)), TABLE_ENTRIES=table.shape[0], PDL=pdl,
            STATIC_NG=K // 8 if cfg.get("unroll", 0) else 0, X_TILE=up_raw is not None or sum_slots > 1,
            num_warps=cfg["num_warps"], **launch_options(pdl),
        )  # fmt: skip
    elif P and N:
        block_n = 16
        step = _step(qtype, K)
        _block_gemv_kernel[(P, triton.cdiv(N, block_n))](
            out, raw, raw if ids is None else ids, x, _levels(raw.device), N, K, row_bytes, x.stride(0),
            out.stride(0), QTYPE=int(qtype), SB=qtype.block_elems, STEP=step, BLOCK_BYTES=qtype.block_bytes,
            BLOCK_N=block_n, X_DIV=x_div, HAS_IDS=ids is not None, num_warps=4,
        )  # fmt: skip
    return out
