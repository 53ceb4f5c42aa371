"""kernels/stage_misses.py: the missed experts of the first pairs are copied into staging rows, byte for byte, and
only their entries of the step's table move there; cached experts, repeated experts, missed experts beyond the
rows and pairs beyond the scanned ones are left as the table had them."""

from __future__ import annotations

import pytest
import torch

from moerun.kernels.stage_misses import SCAN_PAIRS, stage_misses_triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _expected(table, is_host, ids, rows):
    """{(p, e, w): staging row} of the entries the kernel must stage: the first ``rows`` distinct missed experts
    among the scanned pairs, in order."""
    P, E, W = table.shape
    staged, seen, row = {}, set(), 0
    for e in ids.tolist()[:SCAN_PAIRS]:
        if e not in seen and is_host[e]:
            if row < rows:
                for p in range(P):
                    for w in range(W):
                        staged[(p, e, w)] = row
            row += 1
        seen.add(e)
    return staged


@pytest.mark.parametrize("word_dtype", [torch.int64, torch.int32], ids=["8-byte words", "4-byte words"])
@pytest.mark.parametrize("pairs,rows", [(1, 8), (8, 8), (16, 8), (5, 3), (70, 4), (1500, 2), (6, 0)])
def test_staged_rows_and_table(seed, word_dtype, pairs, rows) -> None:
    # also the pass's routing counts, added by the kernel for every pair (beyond the scanned ones too)
    P, E, W = 2, 7 if pairs < 64 else 40, 2
    word = torch.empty((), dtype=word_dtype).element_size()
    sizes = torch.randint(1, 300, (P * W,))  # words; array (1, 1) absent
    sizes[3] = 0
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(sizes, 0)[:-1]])
    # every array of every expert: host arrays, and resident copies of some experts elsewhere
    host = [[torch.randint(-2**30, 2**30, (int(sizes[a]),), dtype=word_dtype, device=DEVICE) for a in range(P * W)]
            for _ in range(E)]  # fmt: skip
    is_host = (torch.rand(E) < 0.6).to(torch.int32)
    table = torch.zeros(P, E, W, dtype=torch.int64)
    resident = torch.full((1,), 7, dtype=word_dtype, device=DEVICE)
    for e in range(E):
        for a in range(P * W):
            table[a // W, e, a % W] = host[e][a].data_ptr() if is_host[e] else resident.data_ptr()
    ids = torch.randint(0, E, (pairs,), dtype=torch.int32)
    if pairs > 2:
        ids[2] = ids[0]  # a repeated expert shares the first pair's row
    staging = torch.zeros(rows, int(sizes.sum()), dtype=word_dtype, device=DEVICE)
    out = torch.empty(P, E, W, dtype=torch.int64, device=DEVICE)
    counts = torch.randint(0, 5, (E,))
    got_counts = counts.clone().to(DEVICE)
    flags = torch.full((pairs,), 7, dtype=torch.int32, device=DEVICE) if pairs <= SCAN_PAIRS else None
    stage_misses_triton(table.to(DEVICE), is_host.to(DEVICE), ids.to(DEVICE), sizes.to(DEVICE), offsets.to(DEVICE),
                        int(sizes.max()), staging, out, counts=got_counts, flags=flags)
    assert torch.equal(got_counts.cpu(), counts + torch.bincount(ids.long(), minlength=E))
    want = _expected(table, is_host.tolist(), ids, rows)
    if flags is not None:  # the pairs whose expert is copied (by its first pair), which must wait for the copy
        copied = {e for (_, e, _) in want}
        assert flags.cpu().tolist() == [int(e in copied) for e in ids.tolist()], f"seed={seed}"
    got = out.cpu()
    for p in range(P):
        for e in range(E):
            for w in range(W):
                a = p * W + w
                if (p, e, w) in want and sizes[a] > 0:
                    row = want[(p, e, w)]
                    start = int(offsets[a])
                    assert int(got[p, e, w]) == staging.data_ptr() + (row * staging.shape[1] + start) * word
                    view = staging[row, start : start + int(sizes[a])]
                    assert torch.equal(view, host[e][a]), f"seed={seed}: expert {e} array {a} not staged"
                else:
                    assert int(got[p, e, w]) == int(table[p, e, w]), f"seed={seed}: entry {(p, e, w)} moved"


@pytest.mark.parametrize("hold", [0, 2], ids=["no hold", "hold 2"])
@pytest.mark.parametrize("counted", ["by the kernel", "before"])
@pytest.mark.parametrize("pairs,rows,spares", [(1, 8, 2), (8, 8, 4), (16, 2, 3), (8, 0, 8), (70, 4, 5)])
def test_admission_into_spare_slots(seed, pairs, rows, spares, counted, hold) -> None:
    # the kernel against stage_misses_reference: spare slots taken first (skipping slots whose expert any pair of
    # this pass routes to, and held slots), then the rows; the layer's table, flags, occupants, host-pass counts and
    # holds rewritten alike; the pass's pairs counted by the kernel itself, or by the caller before it runs
    from moerun.kernels.stage_misses import Admission, stage_misses_reference

    g = torch.Generator().manual_seed(seed)
    P, E, W, S = 2, 12 if pairs < 64 else 40, 2, 6
    word_dtype = torch.int64
    sizes = torch.randint(1, 200, (P * W,), generator=g)
    sizes[1] = 0  # an absent array: no bytes, its entries still follow the expert
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(sizes, 0)[:-1]])
    host = [[torch.randint(-2**30, 2**30, (int(sizes[a]),), generator=g, dtype=word_dtype).to(DEVICE)
             for a in range(P * W)] for _ in range(E)]  # fmt: skip
    slots = [[torch.zeros(int(sizes[a]), dtype=word_dtype, device=DEVICE) for a in range(P * W)] for _ in range(S)]

    def addresses(arrays, a):
        return arrays[a].data_ptr() if sizes[a] > 0 else 0

    host_table = torch.tensor([[[addresses(host[e], p * W + w) for w in range(W)] for e in range(E)]
                               for p in range(P)])  # [P, E, W]
    slot_table = torch.tensor([[[addresses(slots[s], p * W + w) for w in range(W)] for s in range(S)]
                               for p in range(P)])  # [P, S, W]
    occupant = torch.full((S,), -1, dtype=torch.int64)
    occupant[: S - 1] = torch.randperm(E, generator=g)[: S - 1]  # one free slot
    is_host = torch.ones(E, dtype=torch.int32)
    table = host_table.clone()
    for s, e in enumerate(occupant.tolist()):
        if e >= 0:
            is_host[e] = 0
            table[:, e] = slot_table[:, s]
            for a in range(P * W):
                slots[s][a].copy_(host[e][a])
    ids = torch.randint(0, E, (pairs,), generator=g, dtype=torch.int32)
    if pairs > 2:
        ids[2] = ids[0]
    counts = torch.randint(0, 5, (E,), generator=g)
    start = counts.clone()
    if counted == "before":  # this pass's routing, every pair
        counts.index_add_(0, ids.long(), torch.ones(pairs, dtype=torch.int64))
    spare = torch.randperm(S, generator=g)[:spares] if spares <= S else torch.randperm(S, generator=g)
    spare = torch.cat([spare, torch.full((max(spares - S, 0),), -1)])  # padding past the slots
    host_passes = torch.randint(0, 3, (E,), generator=g)
    holds = torch.randint(0, 3, (S,), generator=g, dtype=torch.int32) * (torch.rand(S, generator=g) < 0.4)

    def admission(on):
        return Admission(slot_table.to(on), host_table.to(on), occupant.clone().to(on), spare.to(on),
                         counts.clone().to(on), start.to(on), host_passes.clone().to(on),
                         holds.clone().to(on) if hold else None, hold)

    want_admit, want_table, want_host = admission("cpu"), table.clone(), is_host.clone()
    by_kernel = counted == "by the kernel"
    plan = stage_misses_reference(want_table, want_host, ids, rows, want_admit,
                                  want_admit.counts if by_kernel else None)
    got_admit, got_table, got_host = admission(DEVICE), table.clone().to(DEVICE), is_host.clone().to(DEVICE)
    staging = torch.zeros(rows, int(sizes.sum()), dtype=word_dtype, device=DEVICE)
    out = torch.empty(P, E, W, dtype=torch.int64, device=DEVICE)
    flags = torch.full((pairs,), 7, dtype=torch.int32, device=DEVICE) if pairs <= SCAN_PAIRS else None
    stage_misses_triton(got_table, got_host, ids.to(DEVICE), sizes.to(DEVICE), offsets.to(DEVICE), int(sizes.max()),
                        staging, out, got_admit, got_admit.counts if by_kernel else None, flags)
    if flags is not None:
        copied = {e for (_, e) in plan}
        assert flags.cpu().tolist() == [int(e in copied) for e in ids.tolist()], f"seed={seed}"
    want_counts = start + torch.bincount(ids.long(), minlength=E)
    assert torch.equal(want_admit.counts, want_counts) and torch.equal(got_admit.counts.cpu(), want_counts)
    assert torch.equal(got_table.cpu(), want_table) and torch.equal(got_host.cpu(), want_host)
    assert torch.equal(got_admit.occupant.cpu(), want_admit.occupant)
    assert torch.equal(got_admit.host_passes.cpu(), want_admit.host_passes)
    routed = set(ids.tolist())
    free = [s for s in spare.tolist()  # slots that may be given up
            if s >= 0 and int(occupant[s]) not in routed and not (hold and holds[s] > 0)]
    if hold:  # every hold one pass shorter; the slots admitted into now held for ``hold`` passes
        admitted = {index for kind, index in plan.values() if kind == "slot"}
        want_holds = [hold if s in admitted else max(int(holds[s]) - 1, 0) for s in range(S)]
        assert want_admit.hold.tolist() == want_holds and got_admit.hold.cpu().tolist() == want_holds
    missed = len({e for e in ids.tolist()[:SCAN_PAIRS] if is_host[e]})
    assert sum(kind == "slot" for kind, _ in plan.values()) == min(len(free), missed)
    for s, e in enumerate(want_admit.occupant.tolist()):  # nothing this pass routes to was given up
        assert e in routed or e == occupant[s] or e < 0
    step = out.cpu()
    for e in range(E):
        staged = [where for (n, ex), where in plan.items() if ex == e]
        for a in range(P * W):
            p, w = divmod(a, W)
            if not staged:
                assert int(step[p, e, w]) == int(table[p, e, w]), f"seed={seed}: entry {(p, e, w)} moved"
                continue
            kind, index = staged[0]
            if sizes[a] == 0:
                expected = int(table[p, e, w]) if kind == "row" else int(slot_table[p, index, w])
                assert int(step[p, e, w]) == expected
                continue
            if kind == "slot":
                view = slots[index][a]
                assert int(step[p, e, w]) == view.data_ptr()
            else:
                start_word = int(offsets[a])
                view = staging[index, start_word : start_word + int(sizes[a])]
                assert int(step[p, e, w]) == view.data_ptr()
            assert torch.equal(view, host[e][a]), f"seed={seed}: expert {e} array {a} not staged"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the GPU's clock: CUDA only")
def test_timed_copy_adds_each_launch_span(seed) -> None:
    # the timed copy stages the same bytes as the untimed one; each launch adds its span to the clock, more than
    # nothing and no more than the launch's time on the stream (a launch that copies nothing: nothing), and leaves
    # the clock ready for the next launch
    from moerun.kernels.stage_misses import copy_clock, copy_misses_triton, plan_misses_triton

    g = torch.Generator().manual_seed(seed)
    P, E, W = 2, 6, 1
    sizes = torch.tensor([3 << 20, 1 << 20])  # words: 24 and 8 MiB, so a launch takes tens of microseconds
    offsets = torch.tensor([0, int(sizes[0])])
    host = [[torch.randint(-2**30, 2**30, (int(sizes[a]),), generator=g).to(DEVICE) for a in range(P)]
            for _ in range(E)]  # fmt: skip
    table = torch.tensor([[[host[e][p].data_ptr()] for e in range(E)] for p in range(P)], device=DEVICE)
    is_host = torch.ones(E, dtype=torch.int32, device=DEVICE)
    ids = torch.randperm(E, generator=g)[:3].to(torch.int32).to(DEVICE)
    clock = copy_clock(torch.device(DEVICE))
    idle = clock[:2].tolist()
    for timed, cached in ((False, False), (True, False), (True, True), (True, False)):
        is_host.fill_(0 if cached else 1)
        staging = torch.zeros(3, int(sizes.sum()), dtype=torch.int64, device=DEVICE)
        out = torch.empty(P, E, W, dtype=torch.int64, device=DEVICE)
        plan = plan_misses_triton(table, is_host, ids, sizes.to(DEVICE), offsets.to(DEVICE), staging, out)
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        before = int(clock[2])
        begin.record()
        copy_misses_triton(plan, sizes.to(DEVICE), int(sizes.max()), staging, clock if timed else None)
        end.record()
        torch.cuda.synchronize()
        for row, e in enumerate(ids.tolist()):
            for a in range(P):
                view = staging[row, int(offsets[a]) : int(offsets[a] + sizes[a])]
                assert torch.equal(view, torch.zeros_like(view) if cached else host[e][a])
        assert clock[:2].tolist() == idle
        span_ms = (int(clock[2]) - before) / 1e6
        if timed and not cached:
            assert 0 < span_ms <= begin.elapsed_time(end) * 1.05 + 0.005, f"span {span_ms} ms"
        else:
            assert span_ms == 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="Triton's interpreter runs when there is no CUDA")
def test_timed_copy_needs_the_gpu_clock() -> None:
    from moerun.kernels.stage_misses import StagePlan, copy_clock, copy_misses_triton

    plan = StagePlan(torch.zeros(1, 1, dtype=torch.int64), torch.zeros(1, 1, dtype=torch.int64))
    with pytest.raises(ValueError, match="interpreter does not have"):
        copy_misses_triton(plan, torch.ones(1, dtype=torch.int64), 1, torch.zeros(1, 1, dtype=torch.int64),
                           copy_clock(torch.device("cpu")))


@pytest.mark.parametrize("word_dtype", [torch.int64, torch.int32], ids=["8-byte words", "4-byte words"])
@pytest.mark.parametrize("aligned", [True, False], ids=["16-byte copies", "word copies"])
def test_whole_and_partial_chunks(seed, word_dtype, aligned) -> None:
    # arrays of whole chunks (copied unmasked), of whole chunks and a tail, and shorter than a chunk, staged byte
    # for byte; with ``aligned`` every address is a multiple of 16 bytes, as the engine vouches before asking
    from moerun.kernels.stage_misses import CHUNK_WORDS

    g = torch.Generator().manual_seed(seed)
    word = torch.empty((), dtype=word_dtype).element_size()
    sizes = torch.tensor([CHUNK_WORDS, 2 * CHUNK_WORDS + 4 * int(torch.randint(1, 500, (1,), generator=g)), 12])
    step = 256 // word  # rows' arrays start 256 bytes apart at least, as zero-copy lays them out
    padded = (sizes + step - 1) // step * step
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(padded, 0)[:-1]])
    E, P, W = 3, 3, 1
    host = [[torch.randint(-2**30, 2**30, (int(sizes[a]),), generator=g).to(word_dtype).to(DEVICE) for a in range(P)]
            for _ in range(E)]  # fmt: skip
    table = torch.tensor([[[host[e][p].data_ptr()] for e in range(E)] for p in range(P)], dtype=torch.int64)
    assert not aligned or all(int(x) % 16 == 0 for x in table.flatten())
    ids = torch.tensor([2, 0], dtype=torch.int32)
    staging = torch.zeros(2, int(padded.sum()), dtype=word_dtype, device=DEVICE)
    out = torch.empty(P, E, W, dtype=torch.int64, device=DEVICE)
    stage_misses_triton(table.to(DEVICE), torch.ones(E, dtype=torch.int32, device=DEVICE), ids.to(DEVICE),
                        sizes.to(DEVICE), offsets.to(DEVICE), int(sizes.max()), staging, out, aligned=aligned)
    for row, e in enumerate(ids.tolist()):
        for a in range(P):
            view = staging[row, int(offsets[a]) : int(offsets[a] + sizes[a])]
            assert torch.equal(view, host[e][a]), f"seed={seed}: expert {e} array {a} not staged"
            assert int(out[a, e, 0]) == view.data_ptr()
        assert not staging[row, int(offsets[1] + sizes[1]) : int(offsets[2])].any()  # nothing past an array's end
