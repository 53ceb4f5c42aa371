"""Missed experts staged in device memory before the fused MoE of a zero-copy layer reads them; optionally
admitted into the cache on the way (the staging copy lands in a cache slot).

A fused MoE kernel reading an expert in place from pinned host memory over PCIe gets about 29 GB/s on an H200;
a kernel that only copies reaches about 51 GB/s, near the copy engine's 53 for copies of this size
(benchmarks/RESULTS.md). So for a layer whose routed experts are not all cached, two launches:

1. plan (one program): adds the pass's pairs to the layer's routing counts (when given, before anything reads
   them), then picks the missed experts to stage, those of the first SCAN_PAIRS pairs in order of their
   first pair, and where each goes; writes the step's address table (the layer's table with those experts'
   entries pointing where they go) and a (source, destination) address pair per array of each staged expert.
   With admission (``admit``): the layer's spare slots (cache slots the host ranked least valued, between
   steps) are taken first, skipping a slot whose expert this pass routes to (any pair, from the routing counts);
   an expert staged into a slot is admitted there. The plan then also rewrites the layer's own table, residency
   flags and slot occupants (the evicted expert points back at its host copy), and counts the passes that read
   each expert from host memory (the routing counts against the pass's start). With a hold (``hold_passes``), a
   slot the plan admitted into is skipped by the next ``hold_passes`` passes of the layer even when the host ranks
   it spare: under async scheduling the host ranks the next step's spares before it has seen what the step in
   flight admitted, and would give up those experts at once. The remaining misses take the staging rows.
2. copy: grid (pairs scanned, arrays, chunks); each program copies one chunk of one planned array, issuing all of
   its loads before its first store (with 16-byte loads where the caller vouches for the alignment: 2.5% faster
   than eight rounds of 8-byte loads then stores, on an H100 host, benchmarks/RESULTS.md). The two are
   separate functions too, so that the copy may run on another stream while the experts already on the device are
   computed (the plan flags the pairs that must wait for it).

The fused MoE then reads the step's table. Graph-safe: routing, flags, occupants and addresses are read on the
device. Missed experts beyond the slots and rows, or first routed after the scanned pairs, stay where the table
points (read in place: correct, slower). An admitted expert replaces the host copy only in this layer's table: the
host learns the new occupants from the device after the step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import globaltimer  # the GPU's nanosecond clock (no interpreter form)

from moerun.kernels.interpreter import interpreting

CHUNK_WORDS = 8192  # words a program copies, all loaded before any is stored (64 KiB of int64 words)
SCAN_PAIRS = 64  # pairs looked at (a batch of 8 tokens at top-8); the experts of later pairs are not staged
NO_START = 2**63 - 1  # a clock's earliest start while no program of the launch has copied (int64's largest)
INT64_MAX = tl.constexpr(NO_START)


def copy_clock(device: torch.device) -> torch.Tensor:
    """A fresh clock for ``copy_misses_triton``: [3] int64 (earliest start, programs arrived, nanoseconds)."""
    return torch.tensor([NO_START, 0, 0], dtype=torch.int64, device=device)


@dataclass
class Admission:
    """A layer's device state for staging into cache slots (all on the device, int64).

    slot_table [P, S, W]: the slots' array addresses; host_table [P, E, W]: the host copies' addresses; occupant
    [S]: the expert in each slot (-1: free), rewritten; spares [R_S]: slots in the order they are given up (-1:
    none); counts / pass_start [E]: pairs routed to each expert so far and when this pass began; host_passes [E]:
    passes that read the expert from host memory, incremented; hold [S] int32: passes left during which the slot is
    not given up (None: no hold), set to ``hold_passes`` where the plan admits."""

    slot_table: torch.Tensor
    host_table: torch.Tensor
    occupant: torch.Tensor
    spares: torch.Tensor
    counts: torch.Tensor
    pass_start: torch.Tensor
    host_passes: torch.Tensor
    hold: torch.Tensor | None = None
    hold_passes: int = 0


@triton.jit
def _plan_kernel(
    table_ptr,  # [P * E * W] int64: the layer's addresses (expert e's array a = p * W + w at (p * E + e) * W + w)
    host_ptr,  # [P * E * W] int64: the experts' host addresses (ADMIT) or a dummy
    slot_ptr,  # [P * S * W] int64: the slots' addresses (ADMIT) or a dummy
    is_host_ptr,  # [E] int32: 1 where the expert's entries point at host memory
    occupant_ptr,  # [S] int64 (ADMIT)
    spare_ptr,  # [R_S] int64 (ADMIT)
    hold_ptr,  # [S] int32 (HOLD > 0): passes left during which the slot is not given up
    counts_ptr,  # [E] int64 (ADMIT or COUNT)
    start_ptr,  # [E] int64 (ADMIT)
    host_passes_ptr,  # [E] int64 (ADMIT)
    ids_ptr,  # [>= N] int32 or int64: the expert of each (token, slot) pair
    sizes_ptr,  # [P * W] int64: words of each array of one expert (0: no such array)
    offsets_ptr,  # [P * W] int64: word offset of each array inside a staging row
    staging_ptr,  # [R, ROW_WORDS] words
    out_ptr,  # [P * E * W] int64: the step's table, written whole
    src_ptr,  # [SCAN, P * W] int64: source address of each planned copy
    dst_ptr,  # [SCAN, P * W] int64: its destination, 0 where the pair copies nothing
    flags_ptr,  # [N] int32 (FLAGS): 1 where the pair's expert is copied by this pass
    N,  # pairs scanned
    NT,  # pairs in all (COUNT)
    E,
    S,
    R,  # staging rows
    R_S,  # spare slots
    ROW_WORDS,
    TABLE,  # P * E * W
    A,  # P * W
    W: tl.constexpr,
    WORD: tl.constexpr,  # bytes of a word
    ADMIT: tl.constexpr,
    HOLD: tl.constexpr,  # passes an admitted slot is held (ADMIT; 0: none)
    COUNT: tl.constexpr,  # add one to counts[e] for each of the NT pairs first
    FLAGS: tl.constexpr,  # write flags (N == NT: every pair scanned)
    BLOCK_N: tl.constexpr,  # >= N, a power of two
    BLOCK_A: tl.constexpr,  # >= A
    BLOCK_S: tl.constexpr,  # >= R_S
    BLOCK_E: tl.constexpr,  # >= E
    BLOCK_H: tl.constexpr,  # >= S (HOLD > 0)
    BLOCK_T: tl.constexpr,  # table entries copied a step
    BLOCK_C: tl.constexpr,  # pairs counted a step
):
    # every load that the pass's counting leaves alone is issued first, so that their latencies overlap
    scan = tl.arange(0, BLOCK_N)  # [BLOCK_N]
    valid = scan < N
    ids = tl.load(ids_ptr + scan, mask=valid, other=0).to(tl.int64)  # [BLOCK_N]
    host = tl.load(is_host_ptr + ids, mask=valid, other=0) != 0  # [BLOCK_N]
    a = tl.arange(0, BLOCK_A)  # [BLOCK_A] arrays
    a_ok = a < A
    p, w = a // W, a % W
    size = tl.load(sizes_ptr + a, mask=a_ok, other=0)  # [BLOCK_A]
    offset = tl.load(offsets_ptr + a, mask=a_ok, other=0)  # [BLOCK_A]
    entry = (p[None, :] * E + ids[:, None]) * W + w[None, :]  # [BLOCK_N, BLOCK_A]
    # source: the host copy, which the table holds for every missed expert
    src = tl.load(table_ptr + entry, mask=valid[:, None] & a_ok[None, :], other=0)  # [BLOCK_N, BLOCK_A]
    if ADMIT:
        j = tl.arange(0, BLOCK_S)  # [BLOCK_S]
        spare = tl.load(spare_ptr + j, mask=j < R_S, other=-1)  # [BLOCK_S] slots
        occ = tl.load(occupant_ptr + spare, mask=spare >= 0, other=-1)  # [BLOCK_S] their experts
        occ_start = tl.load(start_ptr + occ, mask=occ >= 0, other=0)  # [BLOCK_S]
        e = tl.arange(0, BLOCK_E)
        e_ok = e < E
        e_start = tl.load(start_ptr + e, mask=e_ok, other=0)  # [BLOCK_E]
        was_host = tl.load(is_host_ptr + e, mask=e_ok, other=0) != 0  # [BLOCK_E]
        passes = tl.load(host_passes_ptr + e, mask=e_ok, other=0)  # [BLOCK_E]
        if HOLD > 0:
            h = tl.arange(0, BLOCK_H)  # [BLOCK_H] slots
            held_before = tl.load(hold_ptr + h, mask=h < S, other=0)  # [BLOCK_H]
            spare_held = tl.load(hold_ptr + spare, mask=spare >= 0, other=0) > 0  # [BLOCK_S]
    for t0 in range(0, TABLE, BLOCK_T):  # the step's table starts as the layer's
        t = t0 + tl.arange(0, BLOCK_T)
        tl.store(out_ptr + t, tl.load(table_ptr + t, mask=t < TABLE), mask=t < TABLE)
    if COUNT:
        for c0 in range(0, NT, BLOCK_C):
            c = c0 + tl.arange(0, BLOCK_C)
            e_c = tl.load(ids_ptr + c, mask=c < NT, other=0).to(tl.int64)
            tl.atomic_add(counts_ptr + e_c, tl.full([BLOCK_C], 1, dtype=tl.int64), mask=c < NT)
    # the counts read below include this pass's pairs; every thread copied the table to out and read every flag,
    # entry and occupant above before any is rewritten
    tl.debug_barrier()
    repeats = (ids[:, None] == ids[None, :]) & (scan[None, :] < scan[:, None]) & valid[None, :]
    first = tl.sum(repeats.to(tl.int32), axis=1) == 0  # [BLOCK_N] the expert's first pair
    staged = first & host & valid  # [BLOCK_N]
    rank = tl.sum(((scan[None, :] < scan[:, None]) & staged[None, :]).to(tl.int32), axis=1)  # [BLOCK_N]
    if ADMIT:
        routed_now = tl.load(counts_ptr + occ, mask=occ >= 0, other=0, cache_modifier=".cg") > occ_start  # [BLOCK_S]
        # the pass's reads from host memory: experts routed now that were not cached when it began
        now = tl.load(counts_ptr + e, mask=e_ok, other=0, cache_modifier=".cg") > e_start  # [BLOCK_E]
        usable = (spare >= 0) & ~routed_now  # [BLOCK_S]
        if HOLD > 0:
            usable = usable & ~spare_held
        urank = tl.sum(((j[None, :] < j[:, None]) & usable[None, :]).to(tl.int32), axis=1)  # [BLOCK_S]
        n_usable = tl.sum(usable.to(tl.int32), axis=0)
        match = (rank[:, None] == urank[None, :]) & usable[None, :] & staged[:, None]  # [BLOCK_N, BLOCK_S]
        to_slot = tl.sum(match.to(tl.int32), axis=1) > 0  # [BLOCK_N]
        slot = tl.sum(tl.where(match, spare[None, :], 0), axis=1)  # [BLOCK_N]
        evicted = tl.sum(tl.where(match, occ[None, :], 0), axis=1)  # [BLOCK_N] (-1: a free slot)
        row = rank - n_usable
        slot_dst = tl.load(slot_ptr + (p[None, :] * S + slot[:, None]) * W + w[None, :],
                           mask=to_slot[:, None] & a_ok[None, :], other=0)  # [BLOCK_N, BLOCK_A]
        gone = to_slot & (evicted >= 0)
        old = (p[None, :] * E + tl.maximum(evicted, 0)[:, None]) * W + w[None, :]  # [BLOCK_N, BLOCK_A]
        home = tl.load(host_ptr + old, mask=gone[:, None] & a_ok[None, :])  # [BLOCK_N, BLOCK_A]
    else:
        to_slot = scan < 0
        row = rank
        slot_dst = tl.zeros([BLOCK_N, BLOCK_A], dtype=tl.int64)
    to_row = staged & ~to_slot & (row < R)  # [BLOCK_N]
    row_dst = staging_ptr.to(tl.int64) + (row.to(tl.int64)[:, None] * ROW_WORDS + offset[None, :]) * WORD
    dst = tl.where(to_slot[:, None], slot_dst, tl.where(to_row[:, None], row_dst, 0))  # [BLOCK_N, BLOCK_A]
    copies = (to_slot | to_row)[:, None] & a_ok[None, :] & (size > 0)[None, :]
    plan = scan[:, None] * A + a[None, :]
    tl.store(src_ptr + plan, src, mask=valid[:, None] & a_ok[None, :])
    tl.store(dst_ptr + plan, tl.where(copies, dst, 0), mask=valid[:, None] & a_ok[None, :])
    if FLAGS:  # a pair waits for the copy if its expert's first pair copies it
        copied = to_slot | to_row  # [BLOCK_N]
        same = (ids[:, None] == ids[None, :]) & copied[None, :] & valid[None, :]  # [BLOCK_N, BLOCK_N]
        tl.store(flags_ptr + scan, (tl.sum(same.to(tl.int32), axis=1) > 0).to(tl.int32), mask=valid)
    tl.store(out_ptr + entry, dst, mask=copies)
    if ADMIT:
        tl.store(host_passes_ptr + e, passes + (now & was_host).to(tl.int64), mask=e_ok)
        # the admitted experts point at their slots (every array), the evicted ones back at their host copies
        tl.store(table_ptr + entry, slot_dst, mask=to_slot[:, None] & a_ok[None, :])
        tl.store(table_ptr + old, home, mask=gone[:, None] & a_ok[None, :])
        tl.store(is_host_ptr + ids, tl.zeros([BLOCK_N], dtype=tl.int32), mask=to_slot)
        tl.store(is_host_ptr + tl.maximum(evicted, 0), tl.full([BLOCK_N], 1, dtype=tl.int32), mask=gone)
        tl.store(occupant_ptr + slot, ids, mask=to_slot)
        if HOLD > 0:  # the slots admitted into now held; every other hold one pass shorter
            admitted = tl.sum(((h[:, None] == slot[None, :]) & to_slot[None, :]).to(tl.int32), axis=1) > 0
            tl.store(hold_ptr + h, tl.where(admitted, HOLD, tl.maximum(held_before - 1, 0)), mask=h < S)


@triton.jit(do_not_specialize=["PROGRAMS"])  # one compiled variant whatever the grid's size
def _copy_kernel(
    src_ptr,  # [SCAN, A] int64 addresses
    dst_ptr,  # [SCAN, A] int64 addresses, 0: nothing to copy
    sizes_ptr,  # [A] int64 words
    base_ptr,  # any word pointer: addresses are turned into word offsets from it
    clock_ptr,  # [3] int64 (TIMED): earliest start (ns), programs arrived, nanoseconds copying (cumulative)
    A,
    PROGRAMS,  # programs in the grid (TIMED)
    WORD: tl.constexpr,
    CHUNK: tl.constexpr,
    ALIGN: tl.constexpr,  # words every address is a multiple of (16 bytes: 16-byte loads and stores)
    TIMED: tl.constexpr,  # the launch adds its span (first copying program's start to last end) to clock_ptr[2]
):
    pair = tl.program_id(0)
    a = tl.program_id(1)
    c = tl.program_id(2)
    if TIMED:
        began = globaltimer()
    dst = tl.load(dst_ptr + pair * A + a)
    size = tl.load(sizes_ptr + a)
    if (dst != 0) & (c * CHUNK < size):
        if TIMED:  # the span starts with the first program that copies
            tl.atomic_min(clock_ptr, began)
        base = base_ptr.to(tl.int64)
        src_words = tl.multiple_of((tl.load(src_ptr + pair * A + a) - base) // WORD, ALIGN)
        dst_words = tl.multiple_of((dst - base) // WORD, ALIGN)
        o = c * CHUNK + tl.max_contiguous(tl.multiple_of(tl.arange(0, CHUNK), CHUNK), CHUNK)  # [CHUNK] words
        if (c + 1) * CHUNK <= size:  # a whole chunk: every load issued before the first store, unmasked
            v = tl.load(base_ptr + src_words + o, cache_modifier=".cg")
            tl.store(base_ptr + dst_words + o, v)
        else:
            ok = o < size
            v = tl.load(base_ptr + src_words + o, mask=ok, cache_modifier=".cg")
            tl.store(base_ptr + dst_words + o, v, mask=ok)
    if TIMED:  # the last program to arrive closes the span (none: nothing copied) and readies the clock
        if tl.atomic_add(clock_ptr + 1, 1) == PROGRAMS - 1:
            start = tl.atomic_xchg(clock_ptr, INT64_MAX)
            if start != INT64_MAX:
                tl.atomic_add(clock_ptr + 2, globaltimer() - start)
            tl.atomic_xchg(clock_ptr + 1, 0)


@dataclass
class StagePlan:
    """What the plan launch left for the copy launch: the (source, destination) address of each array of each pair
    scanned ([n, A] int64 each; destination 0: nothing to copy)."""

    src: torch.Tensor
    dst: torch.Tensor


def plan_misses_triton(table: torch.Tensor, is_host: torch.Tensor, ids: torch.Tensor, sizes: torch.Tensor,
                       offsets: torch.Tensor, staging: torch.Tensor, out: torch.Tensor, admit: Admission | None = None,
                       counts: torch.Tensor | None = None, flags: torch.Tensor | None = None,
                       buffers: tuple[torch.Tensor, torch.Tensor] | None = None) -> StagePlan | None:
    """The plan launch of ``stage_misses_triton`` (same arguments): writes ``out`` and applies the admission and
    the counting; returns what the copy launch needs, or None when nothing can be staged (``out`` is then the
    table). ``flags`` [N] int32, when given (N <= SCAN_PAIRS), gets 1 for each pair whose expert this pass copies
    (it must wait for the copy) and 0 for the others. ``buffers``: two int64 tensors of at least SCAN_PAIRS * P * W
    entries for the addresses (kept by a caller whose copy runs on another stream), else allocated here."""
    P, E, W = table.shape
    if counts is not None and admit is not None and counts.data_ptr() != admit.counts.data_ptr():
        raise ValueError("counts must be the admission's counts")
    if flags is not None and (ids.numel() > SCAN_PAIRS or flags.numel() != ids.numel()):
        raise ValueError(f"flags need one entry per pair and at most {SCAN_PAIRS} pairs, got {flags.numel()} for "
                         f"{ids.numel()}")
    word = staging.element_size()
    n = min(ids.numel(), SCAN_PAIRS)
    spares = 0 if admit is None else admit.spares.numel()
    if n == 0 or staging.shape[0] + spares == 0:
        if counts is not None:
            counts.index_add_(0, ids.long(), torch.ones_like(ids, dtype=torch.int64))
        if flags is not None:
            flags.zero_()
        out.copy_(table)
        return None
    A = P * W
    if buffers is None:
        src = torch.empty(n, A, dtype=torch.int64, device=table.device)  # [n, A]
        dst = torch.empty(n, A, dtype=torch.int64, device=table.device)  # [n, A]
    else:
        src, dst = (b[: n * A].view(n, A) for b in buffers)
    if admit is None:
        S, host_table, slot_table, occupant, spare, start, host_passes = (0, table, table, table, table, table,
                                                                          table)
        hold, held = is_host, 0
    else:
        S = admit.occupant.numel()
        host_table, slot_table, occupant, spare = admit.host_table, admit.slot_table, admit.occupant, admit.spares
        start, host_passes = admit.pass_start, admit.host_passes
        hold, held = (admit.hold, admit.hold_passes) if admit.hold is not None else (is_host, 0)
    counted = counts if counts is not None else admit.counts if admit is not None else table
    _plan_kernel[(1,)](
        table, host_table, slot_table, is_host, occupant, spare, hold, counted, start, host_passes, ids, sizes,
        offsets, staging, out, src, dst, flags if flags is not None else is_host, n, ids.numel(), E, S,
        staging.shape[0], spares, staging.shape[1], P * E * W, A, W=W, WORD=word, ADMIT=admit is not None, HOLD=held,
        COUNT=counts is not None, FLAGS=flags is not None, BLOCK_N=triton.next_power_of_2(n),
        BLOCK_A=triton.next_power_of_2(A), BLOCK_S=triton.next_power_of_2(max(spares, 1)),
        BLOCK_E=triton.next_power_of_2(E), BLOCK_H=triton.next_power_of_2(max(S, 1)), BLOCK_T=1024, BLOCK_C=1024,
        num_warps=4,
    )  # fmt: skip
    return StagePlan(src, dst)


def copy_misses_triton(plan: StagePlan, sizes: torch.Tensor, max_words: int, staging: torch.Tensor,
                       clock: torch.Tensor | None = None, aligned: bool = False) -> None:
    """The copy launch of ``stage_misses_triton``: moves the planned arrays' bytes (on the current stream). With
    ``clock`` (``copy_clock``; on the GPU only, the interpreter has no clock), the launch adds the nanoseconds from the
    start of its first program that copies to the end of its last program to clock[2] (nothing when it copies
    nothing). ``aligned``: the caller vouches that every address of the plan (and staging's) is a multiple of 16
    bytes, which lets the copy move 16 bytes a load (else an address that is not faults the launch)."""
    n, A = plan.src.shape
    chunks = triton.cdiv(max_words, CHUNK_WORDS)
    timed = clock is not None
    if timed and interpreting():
        raise ValueError("the copy launch is timed by the GPU's clock, which Triton's interpreter does not have")
    word = staging.element_size()
    _copy_kernel[(n, A, chunks)](plan.src, plan.dst, sizes, staging, clock if timed else sizes, A, n * A * chunks,
                                 WORD=word, CHUNK=CHUNK_WORDS, ALIGN=16 // word if aligned else 1, TIMED=timed,
                                 num_warps=8)


def stage_misses_triton(table: torch.Tensor, is_host: torch.Tensor, ids: torch.Tensor, sizes: torch.Tensor,
                        offsets: torch.Tensor, max_words: int, staging: torch.Tensor, out: torch.Tensor,
                        admit: Admission | None = None, counts: torch.Tensor | None = None,
                        flags: torch.Tensor | None = None, aligned: bool = False) -> torch.Tensor:
    """Writes into ``out`` [P, E, W] (int64) the layer's ``table`` [P, E, W] with the missed experts of the first
    SCAN_PAIRS pairs of ``ids`` [N] (in order of their first pair) copied to the device and pointed at: into the
    spare slots of ``admit`` first (then admitted: ``table``, ``is_host`` and the occupants rewritten), then into
    the R rows of ``staging`` [R, row words].

    is_host [E] int32 (1: the table points at host memory), sizes / offsets [P * W] int64 in words of staging's
    element type, max_words the largest size; every address a multiple of that word. ``counts`` [E] int64, when
    given, gets one added per pair of ids (all N) before the plan reads it; with ``admit`` it must be admit.counts,
    which the caller has otherwise counted the pass into already. ``flags``: see ``plan_misses_triton``;
    ``aligned``: see ``copy_misses_triton``. Returns out."""
    plan = plan_misses_triton(table, is_host, ids, sizes, offsets, staging, out, admit, counts, flags)
    if plan is not None:
        copy_misses_triton(plan, sizes, max_words, staging, aligned=aligned)
    return out


def stage_misses_reference(table: torch.Tensor, is_host: torch.Tensor, ids: torch.Tensor, rows: int,
                           admit: Admission | None = None,
                           counts: torch.Tensor | None = None) -> dict[tuple[int, int], tuple[str, int]]:
    """The plan of ``stage_misses_triton`` in plain torch, applying the same counting to ``counts`` and admission
    to ``table``, ``is_host`` and ``admit`` (its occupants and host-pass counts) in place: {(pair, expert): ('slot'
    | 'row', index)} of the staged experts. The caller checks the step's table and the bytes against it."""
    P, E, W = table.shape
    if counts is not None:
        counts.index_add_(0, ids.long(), torch.ones(ids.numel(), dtype=counts.dtype, device=counts.device))
    plan: dict[tuple[int, int], tuple[str, int]] = {}
    staged: list[tuple[int, int]] = []
    seen: set[int] = set()
    for n, e in enumerate(ids.tolist()[:SCAN_PAIRS]):
        if e not in seen and bool(is_host[e]):
            staged.append((n, e))
        seen.add(e)
    usable: list[tuple[int, int]] = []
    if admit is not None:
        routed = admit.counts > admit.pass_start  # [E]
        admit.host_passes += (routed & (is_host != 0)).to(admit.host_passes.dtype)
        launched = ids.numel() > 0 and rows + admit.spares.numel() > 0  # else the kernel is not launched
        held = admit.hold if admit.hold is not None and admit.hold_passes > 0 and launched else None
        for s in admit.spares.tolist():
            occ = int(admit.occupant[s]) if s >= 0 else -1
            if s >= 0 and not (occ >= 0 and bool(routed[occ])) and not (held is not None and int(held[s]) > 0):
                usable.append((s, occ))
        if held is not None:
            held.sub_(1).clamp_(min=0)
    for rank, (n, e) in enumerate(staged):
        if rank < len(usable):
            s, occ = usable[rank]
            plan[(n, e)] = ("slot", s)
            table[:, e] = admit.slot_table[:, s]
            is_host[e] = 0
            if occ >= 0:
                table[:, occ] = admit.host_table[:, occ]
                is_host[occ] = 1
            admit.occupant[s] = e
            if held is not None:
                held[s] = admit.hold_passes
        elif rank - len(usable) < rows:
            plan[(n, e)] = ("row", rank - len(usable))
    return plan
