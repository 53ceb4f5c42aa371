"""The end of a graphed decode step in one launch: logits [B, V] copied to float32 (the engine's logits buffer),
each row's greedy token (the first index of its largest value, as torch.argmax) written where the next step reads
its input ids, and, optionally, the rows' positions and sequence lengths advanced by one for that step.

A step that continues every row of the one before (steady greedy decode) then needs nothing from the host: no
metadata copy, no copies into the graph's inputs, no argmax launch of its own.

Grid (P, B): program (p, b) copies positions [p * BLOCK, (p + 1) * BLOCK) of row b, writes the block's (largest
value, first index of it) and takes a ticket from row b's counter; the last of the row's P programs to arrive reduces
the P partials in block order (the first index among equal maxima wins, as in one pass), writes the token and
advances the row, and resets the counter. NaN counts as +inf (torch.argmax would return the first NaN).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moerun.kernels.pdl import launch_dependents, launch_options, pdl_mode, wait_for_previous
from moerun.kernels.tickets import ticket_counters
from moerun.ops.pick import check_pick_operands

# Positions a program copies and reduces: 8 KB of bf16 logits, 32 a thread at 4 warps.
BLOCK = 4096


@triton.jit
def _greedy_pick_kernel(
    logits_ptr,  # [B, V] model dtype
    out_ptr,  # [B, V] float32
    part_val_ptr,  # [B, P] float32 (P > 1)
    part_idx_ptr,  # [B, P] int32 (P > 1)
    ticket_ptr,  # [B] int32, 0 between launches
    ids_ptr,  # [B] int64: the greedy tokens
    pos_ptr,  # [B] int64 positions (ADVANCE)
    len_ptr,  # [B] int64 sequence lengths (ADVANCE)
    V,
    stride_l,
    stride_o,
    max_len,  # ADVANCE: positions stay below it, lengths at most it
    P: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCK_P: tl.constexpr,
    ADVANCE: tl.constexpr,
    PDL: tl.constexpr,
):
    launch_dependents(PDL)
    wait_for_previous(PDL)
    p = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    offs = p * BLOCK + tl.arange(0, BLOCK)  # [BLOCK]
    mask = offs < V
    x = tl.load(logits_ptr + b * stride_l + offs, mask=mask, other=0.0).to(tl.float32)  # [BLOCK]
    tl.store(out_ptr + b * stride_o + offs, x, mask=mask)
    key = tl.where(x != x, float("inf"), x)  # NaN as +inf
    key = tl.where(mask, key, float("-inf"))
    best = tl.max(key, axis=0)
    first = tl.min(tl.where(mask & (key == best), offs, V), axis=0)  # V where the block holds only -inf padding
    if P == 1:
        _finish(ids_ptr, pos_ptr, len_ptr, b, first, max_len, ADVANCE)
    else:
        tl.store(part_val_ptr + b * P + p, best)
        tl.store(part_idx_ptr + b * P + p, first)
        tl.debug_barrier()  # the partial is written before the ticket is taken
        if tl.atomic_add(ticket_ptr + b, 1, sem="acq_rel", scope="gpu") == P - 1:
            tl.atomic_xchg(ticket_ptr + b, 0)  # every block of the row has arrived: reset for the next launch
            ps = tl.arange(0, BLOCK_P)  # [BLOCK_P]
            vals = tl.load(part_val_ptr + b * P + ps, mask=ps < P, other=float("-inf"), cache_modifier=".cg")
            idxs = tl.load(part_idx_ptr + b * P + ps, mask=ps < P, other=0, cache_modifier=".cg")
            top = tl.max(vals, axis=0)
            # blocks hold increasing positions, so the smallest index among the blocks at the maximum is the first
            winner = tl.min(tl.where((ps < P) & (vals == top), idxs, V), axis=0)
            _finish(ids_ptr, pos_ptr, len_ptr, b, winner, max_len, ADVANCE)


@triton.jit
def _finish(ids_ptr, pos_ptr, len_ptr, b, token, max_len, ADVANCE: tl.constexpr):
    """Row b's token; with ADVANCE its position and length one further (capped by the cache's length)."""
    tl.store(ids_ptr + b, token.to(tl.int64))
    if ADVANCE:
        pos = tl.load(pos_ptr + b)
        tl.store(pos_ptr + b, tl.minimum(pos + 1, max_len - 1))
        seq_len = tl.load(len_ptr + b)
        tl.store(len_ptr + b, tl.minimum(seq_len + 1, max_len))


def greedy_pick_triton(logits: torch.Tensor, out: torch.Tensor, ids: torch.Tensor,
                       positions: torch.Tensor | None = None, seq_lens: torch.Tensor | None = None,
                       max_len: int = 0) -> None:  # fmt: skip
    """out [B, V] float32 = logits [B, V]; ids [B] int64 = each row's argmax; with positions and seq_lens [B] int64,
    both advanced by one, positions kept below max_len and lengths at most max_len. One launch."""
    check_pick_operands(logits, out, ids, positions, seq_lens, max_len)
    B, V = logits.shape
    if B == 0:
        return
    P = triton.cdiv(V, BLOCK)
    part_val = torch.empty(B, P, dtype=torch.float32, device=logits.device)  # [B, P]
    part_idx = torch.empty(B, P, dtype=torch.int32, device=logits.device)  # [B, P]
    tickets = ticket_counters(logits.device, B, "greedy_pick")  # [B]
    advance = positions is not None
    pdl = pdl_mode(logits.device, B)
    _greedy_pick_kernel[(P, B)](
        logits, out, part_val, part_idx, tickets, ids, positions if advance else ids, seq_lens if advance else ids,
        V, logits.stride(0), out.stride(0), max_len, P=P, BLOCK=BLOCK, BLOCK_P=triton.next_power_of_2(P),
        ADVANCE=advance, PDL=pdl, num_warps=4, **launch_options(pdl),
    )  # fmt: skip
