"""align_tokens: every (token, slot) pair exactly once, grouped by expert, padded to BLOCK_M with the sentinel."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from moerun.kernels import align  # noqa: E402
from moerun.kernels.align import align_tokens, max_padded_rows  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def random_ids(T: int, E: int, k: int) -> torch.Tensor:
    """[T, k] int32 distinct experts per token, as top-k produces."""
    return torch.argsort(torch.rand(T, E), dim=1)[:, :k].to(torch.int32)


def check_alignment(ids: torch.Tensor, E: int, block_m: int, seed: int) -> None:
    T, k = ids.shape
    n = T * k
    out = align_tokens(ids.to(DEVICE), E, block_m)
    sorted_ids = out.sorted_ids.cpu()
    block_expert = out.block_expert.cpu()
    num_padded = int(out.num_padded.item())
    flat = ids.reshape(-1)
    counts = torch.bincount(flat.long(), minlength=E)
    expected_padded = int(((counts + block_m - 1) // block_m * block_m).sum())

    assert sorted_ids.numel() == max_padded_rows(n, E, block_m), f"seed={seed}"
    assert block_expert.numel() * block_m == sorted_ids.numel(), f"seed={seed}"
    assert num_padded == expected_padded, f"seed={seed}"
    assert (block_expert[num_padded // block_m :] == -1).all(), f"seed={seed}"

    valid = sorted_ids[:num_padded].view(-1, block_m)  # [blocks, BLOCK_M]
    seen = torch.zeros(n, dtype=torch.int64)
    for b in range(valid.shape[0]):
        e = int(block_expert[b])
        assert 0 <= e < E, f"seed={seed}: block {b} has expert {e}"
        row = valid[b]
        real = row[row < n].long()
        pad = row[row >= n]
        assert (pad == n).all(), f"seed={seed}: padding must be the sentinel {n}"
        assert (flat[real] == e).all(), f"seed={seed}: block {b} mixes experts"
        # Padding only ever trails an expert's run.
        assert real.numel() == 0 or (row[: real.numel()] < n).all(), f"seed={seed}"
        seen[real] += 1
    assert (seen == 1).all(), f"seed={seed}: pairs covered {seen.tolist()}"

    # Experts appear in increasing order, each block run sized to its count, and pairs keep their flat order.
    order = block_expert[: num_padded // block_m]
    assert (order[1:] >= order[:-1]).all(), f"seed={seed}"
    for e in range(E):
        blocks = (order == e).nonzero().flatten()
        assert blocks.numel() == (int(counts[e]) + block_m - 1) // block_m, f"seed={seed}: expert {e}"
        members = valid[blocks].flatten()
        members = members[members < n]
        expected = (flat == e).nonzero().flatten().to(torch.int32)
        assert torch.equal(members, expected), f"seed={seed}: expert {e}"


@pytest.mark.parametrize(
    "T,E,k,block_m",
    [(1, 7, 1, 16), (1, 13, 8, 16), (37, 13, 2, 16), (9, 7, 8, 32), (300, 16, 8, 32), (131, 128, 8, 64)],
)
def test_align_random(seed: int, T: int, E: int, k: int, block_m: int) -> None:
    check_alignment(random_ids(T, E, k), E, block_m, seed)


def test_align_one_expert_takes_all(seed: int) -> None:
    T, E = 45, 13
    ids = torch.full((T, 1), 11, dtype=torch.int32)
    check_alignment(ids, E, 16, seed)


def test_align_empty_experts(seed: int) -> None:
    # Only experts 2, 5 and 6 of 13 receive pairs.
    T, E = 23, 13
    choices = torch.tensor([2, 5, 6], dtype=torch.int32)
    ids = torch.stack([choices[torch.randperm(3)[:2]] for _ in range(T)])  # [T, 2]
    check_alignment(ids, E, 16, seed)


@pytest.mark.parametrize("T,E,k,block_m", [(300, 16, 8, 32), (150, 128, 8, 16)])
def test_align_chunks_of_several_sub_chunks(seed: int, monkeypatch, T: int, E: int, k: int, block_m: int) -> None:
    # At most 3 chunks: 2400 pairs in sub-chunks of 256 (E = 16) and 1200 in sub-chunks of 128 (E = 128) make
    # chunks of several sub-chunks and a short last one; with E = 128, 195 M-blocks take the 3 programs' strides
    # of 64 blocks round twice.
    monkeypatch.setattr(align, "_MAX_CHUNKS", 3)
    check_alignment(random_ids(T, E, k), E, block_m, seed)
