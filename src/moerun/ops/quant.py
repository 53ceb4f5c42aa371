"""Entry points for GGUF-quantized weights: repacking once per weight, quantized linear layers and MoE experts.

A QuantizedWeight (layers/quantized.py) is repacked on first use, on its own device, into PackedWeights
(kernels/quant/repack.py) cached on it as the attribute `packed`: consecutive parts of one type are merged
along the rows, so gate|up or q|k|v of one type become one tensor. `pack_model` does this up front (call it
after loading a GGUF model on CUDA, before capturing CUDA graphs); with release_blocks it also drops the GGUF
blocks, so each weight is held once (an embedding table's lookups decode its rows from the repacked copy:
quantized_rows). The torch backend (CPU) dequantises.

Types without a repacked layout (the grid types IQ1 ... IQ3, TQ1_0, TQ2_0, NVFP4: `has_kernel_layout`)
keep their GGUF blocks on the Triton path too, read by kernels/quant/from_blocks.py as each call runs: a GEMV over
the blocks for a few rows of x (a linear layer's tokens; an MoE's (token, slot) pairs when the step routes fewer
pairs than the layer has experts). At more rows the tile64 kernels decode the grid types' blocks as they multiply
(kernels/quant/from_groups.py), beside the repacked parts of other types (``MOERUN_GRID_TILES=0``: dequantised
instead, the former path); weights with a part of the other types are dequantised in one launch a part for the
dense kernels. No host synchronisation either way, so CUDA graphs still capture them.
"""

from __future__ import annotations

import itertools
import math
import os
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from moerun.formats.quants import QuantType
from moerun.kernels.interpreter import interpreting
from moerun.kernels.quant.repack import LAYOUTS, PackedWeight, cat_rows, pack
from moerun.layers.quantized import QuantizedWeight
from moerun.ops.dispatch import pick_backend

if TYPE_CHECKING:
    from moerun.kernels.topk_select import TopkSelect
    from moerun.kernels.quant.int8_dot import Int8Rows

# Up to this many rows of x, a weight without a repacked layout is multiplied by the GEMV over its GGUF blocks.
_BLOCK_GEMV_ROWS = 8
# a list: parts already repacked (row-stacked), as an offloaded layer's repacked slot pool holds them
Weight = QuantizedWeight | PackedWeight | list[PackedWeight]


def packed_parts(weight: Weight) -> list[PackedWeight]:
    """The repacked parts of a weight (row-stacked), created once and cached on the QuantizedWeight."""
    if isinstance(weight, PackedWeight):
        return [weight]
    if isinstance(weight, list):
        return weight
    cached = weight.__dict__.get("packed")
    if cached is not None and cached[0].device == weight.device:
        return cached
    packed = []
    for _, run in itertools.groupby(weight.parts, key=lambda p: p.qtype):
        packed.append(cat_rows([pack(p) for p in run]))
    weight.packed = packed
    return packed


def has_kernel_layout(weight: Weight) -> bool:
    """Whether the quantized kernels read this weight (every part a float type or one with a repacked layout)."""
    if not isinstance(weight, QuantizedWeight) or weight.__dict__.get("packed") is not None:
        return True
    return all(p.qtype in LAYOUTS or not p.qtype.is_quantized for p in weight.parts)


def pack_weight(weight: QuantizedWeight, release_blocks: bool = False) -> list[PackedWeight]:
    """Repack one weight now (packed_parts); release_blocks then drops its GGUF blocks (pack_model keeps those of
    an embedding table whose lookups cannot read the repacked copy). A weight without a repacked layout keeps its
    blocks: -> []."""
    if not has_kernel_layout(weight):
        return []
    parts = packed_parts(weight)
    if release_blocks and not weight.released:
        weight.release_blocks()
    return parts


def block_scratch_bytes(model: nn.Module, dtype: torch.dtype) -> int:
    """The largest dense copy a forward pass makes of weights without a repacked layout that the tile kernels do not
    read either (dequantised for the dense kernels at prefill sizes): the most any one module's such weights take
    in ``dtype``; 0 when there are none."""
    elem = dtype.itemsize
    need = 0
    for module in model.modules():
        weights = {k: v for k, v in module.__dict__.items()
                   if k.startswith("q_") and isinstance(v, QuantizedWeight) and not has_kernel_layout(v)}  # fmt: skip
        # a linear layer's weight the tile kernels read as it is takes no copy
        weights = {k: v for k, v in weights.items() if k in ("q_w13", "q_w2") or _tile_types(v) is None}
        q13, q2 = module.__dict__.get("q_w13"), module.__dict__.get("q_w2")
        if "q_w13" in weights or "q_w2" in weights:  # an MoE's experts: both read by the tile kernels, or both copied
            moe = {"q_w13": q13, "q_w2": q2}
            weights = {k: v for k, v in weights.items() if k not in moe}
            if not _moe_tiles_apply(q13, q2):
                weights.update({k: v for k, v in moe.items() if isinstance(v, QuantizedWeight)})
        need = max(need, sum(math.prod(w.shape) for w in weights.values()) * elem)
    return need


def pack_model(model: nn.Module, release_blocks: bool = False) -> int:
    """Repack every QuantizedWeight of the model (module.q_<attr>) now, embedding tables included; returns how
    many were repacked (a weight without a repacked layout keeps its blocks and is not counted). An embedding
    table keeps its blocks only where its lookups cannot read the repacked copy (quantized_rows)."""
    from moerun.layers.embedding import Embedding

    looked_up = {id(m.__dict__.get("q_weight")) for m in model.modules() if isinstance(m, Embedding)}
    seen: set[int] = set()
    packed = 0
    for module in model.modules():
        for name, value in list(module.__dict__.items()):
            if name.startswith("q_") and isinstance(value, QuantizedWeight) and id(value) not in seen:
                seen.add(id(value))
                if pack_weight(value):
                    packed += 1
                    if release_blocks and not value.released and (id(value) not in looked_up
                                                                  or rows_from_packed(value)):  # fmt: skip
                        value.release_blocks()
    return packed


def rows_from_packed(weight: QuantizedWeight) -> bool:
    """Whether quantized_rows reads this [rows, cols] weight's repacked copy (one part, repacked on its device)."""
    packed = weight.__dict__.get("packed")
    return packed is not None and len(packed) == 1 and packed[0].device == weight.device and len(weight.shape) == 2


def quantized_rows(weight: QuantizedWeight, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows ids [T] of a quantized [rows, cols] table, dense [T, cols] in ``dtype`` (an embedding lookup). From the
    repacked copy where there is one: in one launch where the kernels run (CUDA, or Triton's interpreter:
    kernels/quant/decode.dequantize_rows), else its rows gathered and decoded in torch (the reference); without
    one, from the GGUF blocks in torch (QuantizedWeight.rows)."""
    if not rows_from_packed(weight):
        return weight.rows(ids, dtype)
    packed = weight.__dict__["packed"][0]
    if ids.is_cuda or interpreting():
        from moerun.kernels.quant.decode import dequantize_rows

        return dequantize_rows(packed, ids, dtype)
    return packed.take_rows(ids).dequantize(dtype)


def quant_matmul(
    x: torch.Tensor, weight: Weight, backend: str | None = None, bias: torch.Tensor | None = None,
    x_int8: Int8Rows | None = None,
) -> torch.Tensor:
    """x [..., K] @ W^T (+ bias) for a quantized W [N, K] -> [..., N] in x's dtype (Triton on CUDA or in the
    interpreter with backend="triton"; dequantise + F.linear with the torch backend). ``x_int8``: x already
    rounded to int8 (rows of x [T, K], int8_input_pad's padding), read by the parts whose config rounds x."""
    if pick_backend(backend, x.device, "quantized matmul") == "torch":
        return F.linear(x, weight.dequantize(x.dtype), bias)
    if not has_kernel_layout(weight):
        x2 = x.reshape(-1, x.shape[-1])  # [T, K]
        # a few rows: a GEMV over the blocks; more: the tile kernels over grid-type blocks (tile64), else the
        # weight dequantised once for cuBLAS
        if x2.shape[0] <= _BLOCK_GEMV_ROWS:
            y = _pair_products(weight, x2, None, 1, x_int8)
        elif (tiles := _tile_parts(weight)) is not None:
            from moerun.kernels.quant.matmul_quant import quant_matmul_triton

            y = quant_matmul_triton(x2, tiles)
        else:
            y = F.linear(x2, dense_weight(weight, x.dtype))
        y = y if bias is None else y + bias
        return y.reshape(*x.shape[:-1], y.shape[-1])
    from moerun.kernels.quant.matmul_quant import quant_matmul_triton

    K = x.shape[-1]
    y = quant_matmul_triton(x.reshape(-1, K), packed_parts(weight), bias, x_int8=x_int8)
    return y.reshape(*x.shape[:-1], y.shape[-1])


def int8_input_pad(x: torch.Tensor, weight: Weight, backend: str | None = None) -> int | None:
    """The padded row length at which quant_matmul's Triton path rounds x [..., K] to int8 for some part of
    weight (its tuned or default config says so), else None: a producer of x may then hand it over already
    rounded (ops.rms_norm_int8)."""
    if pick_backend(backend, x.device, "quantized matmul") == "torch":
        return None
    if not has_kernel_layout(weight):  # the GEMV over the blocks: grid-type parts round x, at their row length
        rows, K = x.numel() // x.shape[-1], x.shape[-1]
        return K if rows <= _BLOCK_GEMV_ROWS and K % 256 == 0 and _grid_rounds(weight) else None
    from moerun.kernels.quant.matmul_quant import int8_input_pad as pad_of

    return pad_of(packed_parts(weight), x.numel() // x.shape[-1])


def fused_moe_quantized(
    hidden: torch.Tensor,
    w13: Weight,
    w2: Weight,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    out_dtype: torch.dtype | None = None,
    tables: tuple[list[torch.Tensor], torch.Tensor] | None = None,
    x_int8: Int8Rows | None = None,
    num_experts: int | None = None,
    keep_float32: bool = False,
    select: TopkSelect | None = None,
) -> torch.Tensor:
    """Triton path of ops.fused_moe for quantized experts: the fused dequantising kernels when every part has
    one (else dequantise the layer and run the dense kernels). -> [T, H] in out_dtype (default hidden's).
    ``tables``: each expert's arrays found through address tables (fused_moe_quant's ``tables``). ``x_int8``:
    hidden already rounded to int8, read if the chosen config rounds it. ``num_experts``: the layer's expert count
    where the weights stack a slot pool (fused_moe_quant's). ``keep_float32``, ``select``: fused_moe_quant's (the
    picks are written first where its kernels do not run)."""
    from moerun.kernels.quant.fused_moe_quant import fused_moe_quant

    if not (has_kernel_layout(w13) and has_kernel_layout(w2)):
        if select is not None:
            select.fill(topk_weights, topk_ids)
        if tables is not None:
            raise ValueError("experts through address tables need the fused quantized kernels")
        out = _moe_from_blocks(hidden, w13, w2, topk_weights, topk_ids, x_int8)
        return out if out_dtype is None else out.to(out_dtype)
    p13, p2 = packed_parts(w13), packed_parts(w2)
    if fused_kernels_apply(p13, p2):
        return fused_moe_quant(hidden, p13, p2[0], topk_weights, topk_ids, out_dtype=out_dtype, tables=tables,
                               x_int8=x_int8, num_experts=num_experts, keep_float32=keep_float32,
                               select=select)  # fmt: skip
    if select is not None:
        select.fill(topk_weights, topk_ids)
    if tables is not None:
        raise ValueError("experts through address tables need the fused quantized kernels")
    if isinstance(w13, list) or isinstance(w2, list):
        raise ValueError("repacked expert parts without a fused quantized kernel: "
                         f"{[p.qtype.name for p in p13]} / {[p.qtype.name for p in p2]}")
    from moerun.kernels.fused_moe import fused_moe_triton

    out = fused_moe_triton(hidden, w13.dequantize(hidden.dtype), w2.dequantize(hidden.dtype), topk_weights, topk_ids)
    return out if out_dtype is None else out.to(out_dtype)


def _moe_from_blocks(hidden: torch.Tensor, w13: Weight, w2: Weight, topk_weights: torch.Tensor,
                     topk_ids: torch.Tensor, x_int8: Int8Rows | None = None) -> torch.Tensor:  # fmt: skip
    """The MoE of experts without a repacked layout, from their GGUF blocks as it runs: -> [T, H]. x_int8: hidden
    already rounded to int8 (moe_int8_input_pad), read by the pairs' GEMV over grid-type gate and up blocks.

    Few (token, slot) pairs (_pairs_by_gemv): each pair multiplies its expert's blocks. Gate and up of one grid type
    are one GEMV launch that also applies silu(gate) * up, a grid-type down one that also applies the routing
    weights and sums each token's slots; parts of other types take a GEMV over their blocks, or their experts
    dequantised and a batched GEMV.
    Otherwise the tile kernels of the fused quantized MoE decode the grid types' blocks as they multiply
    (moe_tile_parts), or, for the types they do not read, the whole layer is dequantised for the dense kernels."""
    from moerun.kernels.fused_moe import fused_moe_triton

    T, k = topk_ids.shape
    if not _pairs_by_gemv(T, k, w13.shape[0]):
        tiles = moe_tile_parts(w13, w2)
        if tiles is not None:
            from moerun.kernels.quant.fused_moe_quant import fused_moe_quant

            return fused_moe_quant(hidden, tiles[0], tiles[1], topk_weights, topk_ids)
        return fused_moe_triton(hidden, dense_weight(w13, hidden.dtype), dense_weight(w2, hidden.dtype), topk_weights,
                                topk_ids)  # fmt: skip
    ids = topk_ids.reshape(-1)  # [T*k] (the kernels and index_select read int32 ids as they are)
    act = _grid_gate_up(hidden, w13, ids, k, x_int8)  # [T*k, I]
    if act is None:
        gate_up = _pair_products(w13, hidden, ids, k, x_int8)  # [T*k, 2I]
        inter = gate_up.shape[-1] // 2
        act = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
    packed = _packed_down(act, w2, topk_ids, topk_weights, hidden.dtype)
    if packed is not None:
        return packed
    out = _grid_down(act, w2, ids, topk_weights, hidden.dtype)  # [T, H]
    if out is not None:
        return out
    y = _pair_products(w2, act, ids, 1).float() * topk_weights.reshape(-1, 1).float()  # [T*k, H]
    return y.view(T, k, -1).sum(dim=1).to(hidden.dtype)


def moe_tile_parts(w13: Weight, w2: Weight) -> tuple[list[PackedWeight], PackedWeight] | None:
    """(w13's parts, w2) as the fused quantized MoE's tile64 kernels read experts of which some part has no repacked
    layout: grid-type parts as their GGUF blocks (GroupBlocks), the others repacked; None when some part is of
    another type without a layout (ternary, NVFP4), a float type, or gate and up are not both grid types or both
    not (those experts are dequantised for the dense kernels at prefill sizes)."""
    if not _moe_tiles_apply(w13, w2):
        return None
    return _tile_parts(w13), _tile_parts(w2)[0]


def _moe_tiles_apply(w13: Weight | torch.Tensor | None, w2: Weight | torch.Tensor | None) -> bool:
    """Whether moe_tile_parts takes these experts (decided from the parts' types and rows: nothing is repacked)."""
    from moerun.kernels.quant.fused_moe_quant import gate_up_parts
    from moerun.kernels.quant.from_groups import GROUP_TYPES

    t13, t2 = _tile_types(w13), _tile_types(w2)
    if t13 is None or t2 is None or len(t2) != 1:
        return False
    try:
        (g, _), (u, _) = gate_up_parts([n for _, n in t13])
    except ValueError:  # a part straddles the gate/up boundary
        return False
    return (t13[g][0] in GROUP_TYPES) == (t13[u][0] in GROUP_TYPES)


def _tile_types(weight: Weight | torch.Tensor | None) -> list[tuple[QuantType, int]] | None:
    """(type, rows) of each part of a weight the tile64 kernels read (grid types from their blocks, repacked
    quantized types), or None when some part is neither."""
    from moerun.kernels.quant.from_groups import GROUP_TYPES

    if weight is None or isinstance(weight, torch.Tensor):  # a dense weight beside a quantized one
        return None
    if not isinstance(weight, QuantizedWeight) or weight.released:
        parts = packed_parts(weight)
        return None if any(p.is_dense for p in parts) else [(p.qtype, p.n) for p in parts]
    if os.environ.get("MOERUN_GRID_TILES", "1") == "0":  # the former path, for A/B measurements: dequantised
        return None
    ok = all(p.qtype in GROUP_TYPES or (p.qtype in LAYOUTS and p.qtype.is_quantized) for p in weight.parts)
    return [(p.qtype, p.shape[-2]) for p in weight.parts] if ok else None


def _tile_parts(weight: Weight) -> list[PackedWeight] | None:
    """A weight's parts as the tile64 kernels read them (grid types as GroupBlocks, the others repacked), or None
    when _tile_types says they do not; made once and kept on the weight (every prefill asks), so
    ``MOERUN_GRID_TILES`` counts when they are first made."""
    from moerun.kernels.quant.from_blocks import GroupBlocks
    from moerun.kernels.quant.from_groups import GROUP_TYPES

    if not isinstance(weight, QuantizedWeight) or weight.released:
        return None if _tile_types(weight) is None else packed_parts(weight)
    cached = weight.__dict__.get("tile_parts")
    if cached is not None and cached[0].device == weight.device:
        return cached
    if _tile_types(weight) is None:
        return None
    weight.tile_parts = [GroupBlocks.of(p) if p.qtype in GROUP_TYPES else _part_pack(weight, i)
                         for i, p in enumerate(weight.parts)]  # fmt: skip
    return weight.tile_parts


def _pairs_by_gemv(T: int, k: int, E: int) -> bool:
    """_moe_from_blocks' choice for T tokens, k slots each, E experts: a GEMV per (token, slot) pair while the
    pairs of T rounded up to a power of two are at most E (so that a CUDA-graph bucket holding T chooses alike),
    else the layer dequantised for the dense kernels."""
    return (1 << max(T - 1, 0).bit_length()) * k <= E


def _grid_parts(weight: Weight, n: int) -> list | None:
    """The n GGUF parts of a weight when they are all of one grid type (from_groups.GROUP_TYPES), else None."""
    from moerun.kernels.quant.from_groups import GROUP_TYPES

    if not isinstance(weight, QuantizedWeight) or weight.released or len(weight.parts) != n:
        return None
    parts = weight.parts
    same = all(p.qtype == parts[0].qtype and p.shape == parts[0].shape for p in parts)
    return parts if same and parts[0].qtype in GROUP_TYPES else None


def _grid_gate_up_parts(T: int, k: int, w13: Weight) -> list | None:
    """Gate and up when _moe_from_blocks reads them with one GEMV launch for T tokens' k slots (few pairs, one grid
    type: _grid_gate_up), else None."""
    return _grid_parts(w13, 2) if _pairs_by_gemv(T, k, w13.shape[0]) else None


def _grid_gate_up(hidden: torch.Tensor, w13: Weight, ids: torch.Tensor, k: int,
                  x_int8: Int8Rows | None = None) -> torch.Tensor | None:  # fmt: skip
    """silu(gate) * up of every (token, slot) pair [T*k, I] in one GEMV launch, when gate and up are one grid type
    and the pairs few; else None."""
    from moerun.kernels.quant.from_blocks import block_gemv

    parts = _grid_gate_up_parts(hidden.shape[0], k, w13)
    if parts is None:
        return None
    gate, up = parts
    return block_gemv(gate.raw, gate.qtype, gate.shape, hidden.contiguous(), ids, k, up_raw=up.raw, x_int8=x_int8)


def _grid_down(act: torch.Tensor, w2: Weight, ids: torch.Tensor, topk_weights: torch.Tensor,
               out_dtype: torch.dtype) -> torch.Tensor | None:  # fmt: skip
    """The pairs' down projections times their routing weights, summed over each token's slots: [T, H] in
    out_dtype from one GEMV launch, when down is a grid type; else None."""
    from moerun.kernels.quant.from_blocks import block_gemv

    parts = _grid_parts(w2, 1)
    if parts is None:
        return None
    down = parts[0]
    return block_gemv(down.raw, down.qtype, down.shape, act.contiguous(), ids, 1, weights=topk_weights.reshape(-1),
                      out_dtype=out_dtype, sum_slots=topk_weights.shape[1])  # fmt: skip


def _packed_down(act: torch.Tensor, w2: Weight, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                 out_dtype: torch.dtype) -> torch.Tensor | None:  # fmt: skip
    """-> [T, H]: the pairs' down projections weighted and summed by the gemv_v2 path's GEMM 2 (act [T*k, I]
    rounded to int8 first), when down is one repacked part of a type it reads (the Q2_K / Q3_K / Q4_K down beside
    grid-type gate and up in IQ1, IQ2_XXS and IQ3_XXS files); else None."""
    from moerun.kernels.quant.configs import SLOT_SUM_TILES
    from moerun.kernels.quant.gemv_v2 import V2_TYPES, moe_down_v2
    from moerun.kernels.quant.int8_dot import quantize_x

    if not has_kernel_layout(w2):
        return None
    parts = packed_parts(w2)
    if len(parts) != 1 or parts[0].is_dense or parts[0].qtype not in V2_TYPES:
        return None
    down = parts[0]
    return moe_down_v2(quantize_x(act, down.k_pad), topk_ids, topk_weights, down, SLOT_SUM_TILES, out_dtype)


def _grid_rounds(weight: Weight) -> bool:
    """Whether the GEMV over a weight's blocks rounds x to int8 (some part of a grid type, on a GPU)."""
    from moerun.kernels.quant.from_blocks import grid_rounds_x
    from moerun.kernels.quant.from_groups import GROUP_TYPES

    parts = weight.parts if isinstance(weight, QuantizedWeight) and not weight.released else []
    return grid_rounds_x() and any(p.qtype in GROUP_TYPES for p in parts)


def _pair_products(weight: Weight, x: torch.Tensor, ids: torch.Tensor | None, x_div: int,
                   x_int8: Int8Rows | None = None) -> torch.Tensor:  # fmt: skip
    """Row p of the result is W_e x_(p // x_div), e = ids[p] (a stacked weight) or the weight itself (ids None):
    [P, N] in x's dtype. Parts of the types without a layout are read from their blocks by one GEMV launch each.
    x_int8: x already rounded to int8 at its row length (int8_input_pad), read where a part rounds x."""
    from moerun.kernels.quant.from_blocks import BLOCK_TYPES, block_gemv, grid_rounds_x
    from moerun.kernels.quant.from_groups import GROUP_TYPES
    from moerun.kernels.quant.int8_dot import quantize_x

    if not isinstance(weight, QuantizedWeight) or weight.released:
        w = dense_weight(weight, x.dtype, ids)  # [P, N, K] or [N, K]
        return F.linear(x, w) if ids is None else torch.bmm(w, x.repeat_interleave(x_div, 0).unsqueeze(-1))[..., 0]
    out, x = [], x.contiguous()
    grid = any(p.qtype in GROUP_TYPES for p in weight.parts)
    # x rounded to int8 once for every part that reads it so (a q|k|v of IQ2_S, IQ2_S and Q4_K parts at decode)
    if x_int8 is None and grid and len(weight.parts) > 1 and grid_rounds_x():
        x_int8 = quantize_x(x, x.shape[-1])
    if ids is None:  # each launch writes its columns of one output (a q|k|v of parts of several types)
        from moerun.kernels.quant.matmul_quant import quant_matmul_triton

        y = torch.empty(x.shape[0] * x_div, sum(p.shape[-2] for p in weight.parts), dtype=x.dtype, device=x.device)
        col = 0
        for i, p in enumerate(weight.parts):
            cols = y[:, col : col + p.shape[-2]]
            if p.qtype in BLOCK_TYPES:
                block_gemv(p.raw, p.qtype, p.shape, x, None, x_div, x_int8=x_int8, out=cols)
            else:  # e.g. the Q4_K attn_v beside IQ2_S attn_q / attn_k: the fused kernels
                pack = _part_pack(weight, i)
                quant_matmul_triton(x, [pack], x_int8=x_int8 if pack.k_pad == x.shape[-1] else None, out=cols)
            col += p.shape[-2]
        return y
    for p in weight.parts:
        if p.qtype in BLOCK_TYPES:
            out.append(block_gemv(p.raw, p.qtype, p.shape, x, ids, x_div, x_int8=x_int8))
        else:
            w = QuantizedWeight([p]).experts(ids, x.dtype)  # [P, n, K]
            out.append(torch.bmm(w, x.repeat_interleave(x_div, 0).unsqueeze(-1))[..., 0])
    return out[0] if len(out) == 1 else torch.cat(out, dim=-1)  # one part: no copy


def dense_weight(weight: Weight, dtype: torch.dtype, ids: torch.Tensor | None = None) -> torch.Tensor:
    """The weight dense in ``dtype`` on the Triton path ([N, K] / [E, N, K]; with ids [n] the stacked weight's
    experts ids, [n, N, K]): GGUF parts of the types without a layout by one block-dequantising launch, other GGUF
    parts by torch, repacked parts by the kernels' decoder."""
    from moerun.kernels.quant.decode import dequantize_triton
    from moerun.kernels.quant.from_blocks import BLOCK_TYPES, block_dequantize

    if isinstance(weight, QuantizedWeight) and not weight.released:
        dense = []
        for i, p in enumerate(weight.parts):
            if p.qtype in BLOCK_TYPES:
                dense.append(block_dequantize(p.raw, p.qtype, p.shape, dtype, ids))
            elif ids is None:
                dense.append(dequantize_triton(_part_pack(weight, i), dtype))
            else:
                dense.append(QuantizedWeight([p]).experts(ids, dtype))
        return torch.cat(dense, dim=-2)
    return torch.cat([dequantize_triton(p if ids is None else p[ids], dtype) for p in packed_parts(weight)], dim=-2)


def _part_pack(weight: QuantizedWeight, i: int) -> PackedWeight:
    """Part i (a type with a repacked layout) of a weight that also holds parts without one, repacked once and
    kept beside its blocks (such parts are small: an attn_v in a q|k|v)."""
    cache = weight.__dict__.setdefault("part_packs", {})
    if i not in cache or cache[i].device != weight.device:
        cache[i] = pack(weight.parts[i])
    return cache[i]


def moe_int8_input_pad(hidden: torch.Tensor, w13: Weight, w2: Weight, k: int) -> int | None:
    """The padded row length at which the fused quantized MoE rounds hidden [T, H] to int8 (the config it picks
    for T tokens, k slots says so), else None: the router may then hand hidden over rounded (ops.route_fused_int8).
    Triton path only."""
    from moerun.kernels.quant.fused_moe_quant import int8_input_pad as pad_of

    if not has_kernel_layout(w13):  # a GEMV a pair over the blocks: gate and up of a grid type round hidden
        T, H = hidden.shape
        gemv = _grid_gate_up_parts(T, k, w13) is not None
        return H if gemv and H % 256 == 0 and _grid_rounds(w13) else None
    if not has_kernel_layout(w2):
        return None
    p13, p2 = packed_parts(w13), packed_parts(w2)
    if not fused_kernels_apply(p13, p2):
        return None
    return pad_of(p13, p2[0], k, hidden.shape[0])


def int8_roundings(layers: nn.Module, rows: int, k: int) -> tuple[bool, ...]:
    """Where the Triton kernels picked for `rows` tokens (k experts each) round x, or an MoE's intermediate, to
    int8: one flag per repacked part of the quantized linear layers and per GEMM of the quantized MoE layers in
    `layers`, in module order. Two token counts with equal answers round alike, so their outputs differ by float
    summation order alone (a prefill padded to a graph's bucket replays it only then)."""
    from moerun.kernels.quant.fused_moe_quant import int8_roundings as moe_roundings
    from moerun.kernels.quant.matmul_quant import int8_roundings as matmul_roundings

    flags: list[bool] = []
    for module in layers.modules():
        q = module.__dict__.get("q_weight")
        if isinstance(q, QuantizedWeight) and has_kernel_layout(q):
            flags += matmul_roundings(packed_parts(q), rows)
        elif isinstance(q, QuantizedWeight):
            flags += _block_roundings(q, rows <= _BLOCK_GEMV_ROWS, rows)
        q13, q2 = module.__dict__.get("q_w13"), module.__dict__.get("q_w2")
        if q13 is None or q2 is None:
            continue
        if has_kernel_layout(q13) and has_kernel_layout(q2):
            p13, p2 = packed_parts(q13), packed_parts(q2)
            if fused_kernels_apply(p13, p2):
                flags += moe_roundings(p13, p2[0], k, rows)
        else:
            gemv = _pairs_by_gemv(rows, k, q13.shape[0])
            down = [gemv] if has_kernel_layout(q2) else _block_roundings(q2, gemv, rows)  # _packed_down rounds
            flags += _block_roundings(q13, gemv, rows) + down
    return tuple(flags)


def _block_roundings(weight: Weight, gemv: bool, rows: int) -> list[bool]:
    """int8_roundings' flags for a weight without a repacked layout, one a part: its GEMV over the blocks (``gemv``)
    rounds x to int8 for the grid types on a GPU (from_blocks.block_gemv); parts of other types follow their
    kernels."""
    from moerun.kernels.quant.from_blocks import BLOCK_TYPES, grid_rounds_x
    from moerun.kernels.quant.from_groups import GROUP_TYPES
    from moerun.kernels.quant.matmul_quant import int8_roundings as matmul_roundings

    if not isinstance(weight, QuantizedWeight) or weight.released:
        return []
    flags = []
    for i, p in enumerate(weight.parts):
        if p.qtype in BLOCK_TYPES:
            flags.append(gemv and p.qtype in GROUP_TYPES and grid_rounds_x())
        else:
            flags += matmul_roundings([_part_pack(weight, i)], rows) if gemv and len(p.shape) == 2 else [False]
    return flags


def fused_kernels_apply(p13: list[PackedWeight], p2: list[PackedWeight]) -> bool:
    """Whether the fused quantized MoE kernels take these repacked experts: one down part, every part of a type
    they decode, and no part straddling the gate/up boundary."""
    from moerun.kernels.quant.decode import supported
    from moerun.kernels.quant.fused_moe_quant import split_gate_up

    if len(p2) != 1 or not all(not p.is_dense and supported(p.qtype) for p in p13 + p2):
        return False
    try:
        split_gate_up(p13)
    except ValueError:  # a part straddles the gate/up boundary
        return False
    return True
