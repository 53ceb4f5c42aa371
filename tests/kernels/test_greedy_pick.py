"""greedy_pick (Triton: float32 logits, the greedy token, the rows advanced; one launch) against its torch reference."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from moerun.kernels.greedy_pick import BLOCK, greedy_pick_triton  # noqa: E402
from moerun.ops import greedy_pick  # noqa: E402
from moerun.ops.pick import greedy_pick_reference  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def outputs(fn, logits: torch.Tensor, advance: bool, max_len: int = 64):
    """(out, ids, positions, seq_lens) after fn on fresh buffers (positions near the cap, so it is exercised)."""
    B, V = logits.shape
    out = torch.full((B, V), float("nan"), dtype=torch.float32, device=DEVICE)  # [B, V]
    ids = torch.full((B,), -1, dtype=torch.int64, device=DEVICE)  # [B]
    meta = torch.stack([torch.arange(B) + max_len - 3, torch.arange(B) + max_len - 2]).to(DEVICE)  # [2, B]
    positions, seq_lens = (meta[0], meta[1]) if advance else (None, None)
    fn(logits, out, ids, positions, seq_lens, max_len if advance else 0)
    return out, ids, meta


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("B,V", [(1, 1000), (3, 2 * BLOCK + 77), (2, BLOCK)])
@pytest.mark.parametrize("advance", [True, False])
def test_greedy_pick_matches_reference(seed, dtype, B, V, advance) -> None:
    logits = (torch.randn(B, V) * 4).to(dtype).to(DEVICE)  # [B, V]
    # ties: row 0's largest value at positions 1 and V - 1 (in different blocks where V has several); row 1 constant
    logits[0, 1] = logits[0, V - 1] = (logits[0].float().amax() + 1).to(dtype)
    if B > 1:
        logits[1, :] = logits[1, 0]
    got = outputs(greedy_pick_triton, logits, advance)
    want = outputs(greedy_pick_reference, logits, advance)
    for g, w, name in zip(got, want, ("logits", "ids", "positions and lengths")):
        assert torch.equal(g, w), f"seed={seed}: {name} differ"
    assert int(got[1][0]) == 1, f"seed={seed}: the first of two equal maxima must win"
    if B > 1:
        assert int(got[1][1]) == 0, f"seed={seed}"
    if advance:  # rows near the cache's end stay inside it
        assert int(got[2][0].max()) <= 63 and int(got[2][1].max()) <= 64, f"seed={seed}"


def test_greedy_pick_resets_its_counters_between_launches(seed) -> None:
    # the rows' tickets return to 0, so a second launch (a graph replay) reduces again
    for _ in range(3):
        logits = torch.randn(2, 3 * BLOCK, device=DEVICE)  # [2, V]
        out = torch.empty_like(logits)
        ids = torch.empty(2, dtype=torch.int64, device=DEVICE)
        greedy_pick(logits, out, ids, backend="triton")
        assert torch.equal(ids, logits.argmax(dim=1)), f"seed={seed}"


def test_greedy_pick_rejects_bad_operands() -> None:
    logits = torch.randn(2, 10, device=DEVICE)
    ids = torch.zeros(2, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match="out must be"):
        greedy_pick(logits, torch.empty(2, 10, dtype=torch.float16, device=DEVICE), ids, backend="torch")
    with pytest.raises(ValueError, match="ids must be"):
        greedy_pick(logits, torch.empty_like(logits), ids.int(), backend="triton")
    with pytest.raises(ValueError, match="give both or neither"):
        greedy_pick(logits, torch.empty_like(logits), ids, positions=ids.clone(), backend="torch")
    with pytest.raises(ValueError, match="max_len"):
        greedy_pick(logits, torch.empty_like(logits), ids, ids.clone(), ids.clone(), backend="triton")
