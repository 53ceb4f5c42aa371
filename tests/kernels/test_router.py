"""route_triton (softmax + top-k + renormalise) against route_reference."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from moerun.kernels.router import pick_of_top_k, route_triton, top_k_columns  # noqa: E402
from moerun.ops import moe as moe_ops  # noqa: E402
from moerun.ops.moe_reference import route_reference  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def distinct_logits(T: int, E: int, dtype: torch.dtype) -> torch.Tensor:
    """[T, E] logits without ties even after rounding to 16 bits, so the top-k order is unique."""
    perms = torch.argsort(torch.rand(T, E), dim=1).float()  # [T, E] a permutation per row
    logits = perms * (4.0 / E) - 2.0 + torch.rand(T, E) * (0.5 / E)
    return logits.to(dtype).to(DEVICE)


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize(
    "T,E,k",
    [(1, 7, 1), (1, 13, 2), (5, 13, 8), (33, 16, 2), (130, 64, 8), (3, 128, 8), (9, 200, 8), (4, 8, 8)],
)
def test_route_matches_reference(seed: int, T: int, E: int, k: int, renormalize: bool) -> None:
    logits = distinct_logits(T, E, torch.float32)
    weights, ids = route_triton(logits, k, renormalize)
    ref_w, ref_ids = route_reference(logits, k, renormalize)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int32
    assert weights.shape == ids.shape == (T, k)
    assert torch.equal(ids, ref_ids), f"seed={seed}"
    torch.testing.assert_close(weights, ref_w, rtol=1e-5, atol=1e-6, msg=lambda m: f"seed={seed}: {m}")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_route_half_precision_logits(seed: int, dtype: torch.dtype) -> None:
    logits = distinct_logits(11, 13, dtype)
    weights, ids = route_triton(logits, 3, True)
    ref_w, ref_ids = route_reference(logits, 3, True)
    assert torch.equal(ids, ref_ids), f"seed={seed}"
    torch.testing.assert_close(weights, ref_w, rtol=1e-5, atol=1e-6, msg=lambda m: f"seed={seed}: {m}")


def test_route_strided_logits(seed: int) -> None:
    logits = distinct_logits(6, 26, torch.float32)[:, ::2]  # [6, 13] non-contiguous
    weights, ids = route_triton(logits, 2, False)
    ref_w, ref_ids = route_reference(logits, 2, False)
    assert torch.equal(ids, ref_ids), f"seed={seed}"
    torch.testing.assert_close(weights, ref_w, msg=lambda m: f"seed={seed}: {m}")


def test_route_dispatch_triton(seed: int) -> None:
    logits = distinct_logits(4, 13, torch.float32)
    weights, ids = moe_ops.route(logits, 2, True, backend="triton")
    ref_w, ref_ids = route_reference(logits, 2, True)
    assert torch.equal(ids, ref_ids), f"seed={seed}"
    torch.testing.assert_close(weights, ref_w, msg=lambda m: f"seed={seed}: {m}")


def test_route_ties_pick_lowest_index() -> None:
    logits = torch.zeros(3, 13, device=DEVICE)
    logits[1, 5] = logits[1, 9] = 1.0  # row 1: a tie at the top between experts 5 and 9
    logits[2, 1], logits[2, 6], logits[2, 12], logits[2, 10] = 1.5, 1.1, 0.8867, 0.8867  # row 2: picks 3, 4 tie
    weights, ids = route_triton(logits, 4, False)
    assert ids[0].tolist() == [0, 1, 2, 3]
    assert ids[1].tolist() == [5, 9, 0, 1]
    assert ids[2].tolist() == [1, 6, 10, 12]
    torch.testing.assert_close(weights[0], torch.full((4,), 1 / 13, device=DEVICE))
    for k in (3, 4):  # the torch reference breaks ties the same way, also where the tie straddles the last pick
        ref_w, ref_ids = route_reference(logits, k, True)
        assert torch.equal(ref_ids, route_triton(logits, k, True)[1]), f"k={k}: {ref_ids.tolist()}"
        assert torch.equal(ref_ids, moe_ops.route(logits, k, True, backend="torch")[1]), f"k={k}"


@triton.jit
def _top_k_kernel(x_ptr, v_ptr, i_ptr, E, K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr):
    """top_k_columns of rows [BLOCK_T, E] (columns past E: -inf) -> values, ids [BLOCK_T, K]."""
    rows = tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_E)
    x = tl.load(x_ptr + rows[:, None] * E + cols[None, :], mask=(cols < E)[None, :], other=float("-inf"))
    top_x, top_i = top_k_columns(x, K, BLOCK_T, BLOCK_E)
    out = rows[:, None] * K + cols[None, :]
    tl.store(v_ptr + out, top_x, mask=(cols < K)[None, :])
    tl.store(i_ptr + out, top_i, mask=(cols < K)[None, :])


def test_top_k_columns_orders_by_value_then_lowest_index(seed: int) -> None:
    # the top-k itself (GEMM 1 picks by value from raw logits): negative values, repeated values, -0.0 beside 0.0
    # (equal: the lower column first), -inf; against a stable sort by value
    T, E, K = 4, 50, 8
    x = torch.randint(-6, 6, (T, E)).float() * 0.75  # many repeats, negatives
    x[0, 3], x[0, 1] = -0.0, 0.0
    x[1, :] = -0.0
    x[1, 7] = 0.0
    x[2, 10:20] = float("-inf")
    x[3] = -torch.rand(E) * 1e30
    x = x.to(DEVICE)
    values = torch.empty(T, K, device=DEVICE)
    ids = torch.empty(T, K, dtype=torch.int32, device=DEVICE)
    _top_k_kernel[(1,)](x, values, ids, E, K=K, BLOCK_T=T, BLOCK_E=64)
    want = torch.sort(-x.cpu(), dim=1, stable=True).indices[:, :K]  # -(-0.0) == -(0.0): stable keeps column order
    assert torch.equal(ids.cpu().long(), want), f"seed={seed}: {ids.tolist()} against {want.tolist()}"
    assert torch.equal(values.cpu(), torch.gather(x.cpu(), 1, want)), f"seed={seed}"


@triton.jit
def _pick_kernel(x_ptr, i_ptr, v_ptr, sum_ptr, E, K: tl.constexpr, ROWS: tl.constexpr, BLOCK_E: tl.constexpr,
                 BF16: tl.constexpr):
    """Program s: pick_of_top_k's pick s of rows [ROWS, E] (columns past E: -inf) -> ids, values, sums [ROWS, K]."""
    s = tl.program_id(0)
    rows = tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_E)
    x = tl.load(x_ptr + rows[:, None] * E + cols[None, :], mask=(cols < E)[None, :], other=float("-inf"))
    col, value, largest, pick_sum, _, _ = pick_of_top_k(x, s, K, ROWS, BLOCK_E, BF16)
    tl.store(i_ptr + rows * K + s, col)
    tl.store(v_ptr + rows * K + s, value)
    tl.store(sum_ptr + rows * K + s, pick_sum * tl.exp(largest))


@pytest.mark.parametrize("bf16", [False, True])
def test_pick_of_top_k_orders_by_value_then_lowest_index(seed: int, bf16: bool) -> None:
    # each pick alone, as a GEMM 1 program takes its slot's: the order of the test above (ties spanning several
    # picks, -0.0 beside 0.0, -inf among the picks); bf16: values a bfloat16 holds, ordered by one key a column
    T, E, K = 8, 50, 8
    x = torch.randint(-4, 4, (T, E)).float() * 0.75  # many repeats: ties across picks
    x[0, 3], x[0, 1] = -0.0, 0.0
    x[1, :] = -0.0
    x[1, 7] = 0.0
    x[2, :46] = float("-inf")  # four finite values, then -inf picks
    x[3] = -torch.rand(E) * 1e30
    x[4:] = torch.randn(4, E)  # distinct values: the sums of the picks' exponentials below
    if bf16:
        x = x.to(torch.bfloat16).float()
    x = x.to(DEVICE)
    ids = torch.empty(T, K, dtype=torch.int32, device=DEVICE)
    values, sums = torch.empty(T, K, device=DEVICE), torch.empty(T, K, device=DEVICE)
    _pick_kernel[(K,)](x, ids, values, sums, E, K=K, ROWS=T, BLOCK_E=64, BF16=bf16)
    want = torch.sort(-x.cpu(), dim=1, stable=True).indices[:, :K]
    assert torch.equal(ids.cpu().long(), want), f"seed={seed}: {ids.tolist()} against {want.tolist()}"
    assert torch.equal(values.cpu(), torch.gather(x.cpu(), 1, want)), f"seed={seed}"
    want_sum = torch.gather(x.cpu(), 1, want)[4:].double().exp().sum(dim=1, keepdim=True)  # [4, 1]
    torch.testing.assert_close(sums.cpu()[4:].double(), want_sum.expand(4, K), rtol=1e-5, atol=0)


def test_pick_of_top_k_with_fewer_values_than_picks(seed: int) -> None:
    # every column equal, no padding column: the first pick removes them all, the later ones find only removed
    # keys; the picks are the first K columns, and the sum of their exponentials stays finite (K)
    E, K = 16, 4
    x = torch.full((2, E), 0.5).to(DEVICE)
    x[1] = -2.25
    ids = torch.empty(2, K, dtype=torch.int32, device=DEVICE)
    values, sums = torch.empty(2, K, device=DEVICE), torch.empty(2, K, device=DEVICE)
    _pick_kernel[(K,)](x, ids, values, sums, E, K=K, ROWS=2, BLOCK_E=E, BF16=False)
    assert ids.cpu().tolist() == [[0, 1, 2, 3]] * 2, f"seed={seed}: {ids.tolist()}"
    assert torch.equal(values.cpu(), x.cpu()[:, :K]), f"seed={seed}"
    torch.testing.assert_close(sums.cpu(), (K * x.cpu()[:, :1].exp()).expand(2, K))
