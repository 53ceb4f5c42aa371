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
@pytest.mark.parametrize("pairs,rows", [(1, 8), (8, 8), (16, 8), (5, 3), (70, 4)])
def test_staged_rows_and_table(seed, word_dtype, pairs, rows) -> None:
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
    stage_misses_triton(table.to(DEVICE), is_host.to(DEVICE), ids.to(DEVICE), sizes.to(DEVICE), offsets.to(DEVICE),
                        int(sizes.max()), staging, out)
    want = _expected(table, is_host.tolist(), ids, rows)
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
