"""qk_norm_rope_write (Triton) against its torch composition, and that composition against the model's layers."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from helpers import assert_rare_flips

pytest.importorskip("triton")

from moerun.config import RopeConfig  # noqa: E402
from moerun.kernels.qk_norm_rope import qk_norm_rope_write_triton  # noqa: E402
from moerun.layers.norm import RMSNorm  # noqa: E402
from moerun.layers.rotary import RotaryEmbedding  # noqa: E402
from moerun.ops.attention import qk_norm_rope_write, qk_norm_rope_write_reference  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
EPS = 1e-6
MAX_POSITION = 64  # rows of the cos/sin tables
SLOTS, MAX_LEN = 6, MAX_POSITION


@dataclass
class Case:
    """Inputs of one call; the caches are fresh random tensors so untouched entries are checked too."""

    qkv: torch.Tensor  # [T, (n_q + 2 n_kv) * D]
    q_w: torch.Tensor  # [D]
    k_w: torch.Tensor  # [D]
    cos: torch.Tensor  # [MAX_POSITION, D]
    sin: torch.Tensor  # [MAX_POSITION, D]
    positions: torch.Tensor  # [T]
    slots: torch.Tensor  # [T]
    k_cache: torch.Tensor  # [SLOTS, MAX_LEN, n_kv, D]
    v_cache: torch.Tensor  # [SLOTS, MAX_LEN, n_kv, D]
    n_q: int
    n_kv: int

    def args(self, k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple:
        return (self.qkv, self.q_w, self.k_w, EPS, self.cos, self.sin, self.positions, self.slots,
                k_cache, v_cache, self.n_q, self.n_kv)


def make_case(T: int, n_q: int, n_kv: int, D: int, dtype: torch.dtype) -> Case:
    rotary = RotaryEmbedding(RopeConfig(theta=1e6), D, MAX_POSITION)
    cos, sin = rotary.cos_sin(DEVICE, dtype)
    # one token per slot as in decode; positions include the last rows of the tables
    slots = torch.randperm(SLOTS)[:T]  # [T]
    positions = torch.cat([torch.tensor([MAX_POSITION - 1]), torch.randint(MAX_POSITION - 8, MAX_POSITION, (T - 1,))])
    positions[1::3] = torch.randint(0, MAX_POSITION, positions[1::3].shape)  # and some early ones
    return Case(
        qkv=(torch.randn(T, (n_q + 2 * n_kv) * D) * 2).to(dtype).to(DEVICE),
        q_w=(1 + 0.3 * torch.randn(D)).to(dtype).to(DEVICE),
        k_w=(1 + 0.3 * torch.randn(D)).to(dtype).to(DEVICE),
        cos=cos,
        sin=sin,
        positions=positions.to(DEVICE),
        slots=slots.to(DEVICE),
        k_cache=torch.randn(SLOTS, MAX_LEN, n_kv, D).to(dtype).to(DEVICE),
        v_cache=torch.randn(SLOTS, MAX_LEN, n_kv, D).to(dtype).to(DEVICE),
        n_q=n_q,
        n_kv=n_kv,
    )


def assert_rope_close(out: torch.Tensor, ref: torch.Tensor, seed: int) -> None:
    """16-bit: at most 1 ulp of 1.0 apart and nearly all bit-identical; float32: rounding-order noise only."""
    assert out.dtype == ref.dtype and out.shape == ref.shape, f"seed={seed}"
    msg = lambda m: f"seed={seed}: {m}"  # noqa: E731
    if out.dtype == torch.float32:
        # only the float32 sum of squares adds in another order than torch
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=2e-6, msg=msg)
        return
    # Each op rounds where torch rounds, so only a norm scale one float32 ulp away from torch's can flip a
    # rounding (about 1 element in 2^15); x*cos + rot*sin may then move by one ulp of its larger term.
    ulp_one = torch.finfo(out.dtype).eps
    torch.testing.assert_close(out, ref, rtol=ulp_one, atol=ulp_one * 4, msg=msg)
    assert_rare_flips(out != ref, seed)


def run_and_compare(case: Case, seed: int) -> None:
    k_cache, v_cache = case.k_cache.clone(), case.v_cache.clone()
    q = qk_norm_rope_write_triton(*case.args(k_cache, v_cache))
    ref_q = qk_norm_rope_write_reference(*case.args(case.k_cache, case.v_cache))
    assert_rope_close(q, ref_q, seed)
    assert_rope_close(k_cache, case.k_cache, seed)
    assert torch.equal(v_cache, case.v_cache), f"seed={seed}"


@pytest.mark.parametrize("T,n_q,n_kv,D", [(1, 2, 1, 128), (3, 4, 2, 16)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_qk_norm_rope_write_matches_reference(seed: int, dtype: torch.dtype, T: int, n_q: int, n_kv: int, D: int):
    run_and_compare(make_case(T, n_q, n_kv, D, dtype), seed)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_qk_norm_rope_write_prompt(seed: int, dtype: torch.dtype) -> None:
    """A prompt (more tokens than MANY_TOKENS, several heads per program, head counts that leave the last group
    part-empty): q, the caches, and k written out for prefill attention all match the reference."""
    from moerun.kernels.qk_norm_rope import MANY_TOKENS

    T, n_q, n_kv, D = MANY_TOKENS + 21, 12, 3, 64
    case = make_case(1, n_q, n_kv, D, dtype)
    case.qkv = (torch.randn(T, (n_q + 2 * n_kv) * D) * 2).to(dtype).to(DEVICE)
    first = int(torch.randint(0, MAX_LEN - T + 1, ()))
    case.positions = torch.arange(first, first + T, device=DEVICE)  # one sequence's positions in one slot
    case.slots = torch.full((T,), int(torch.randint(0, SLOTS, ())), device=DEVICE)
    k_cache, v_cache = case.k_cache.clone(), case.v_cache.clone()
    k_out = torch.empty(T, n_kv, D, dtype=dtype, device=DEVICE)
    ref_k = torch.empty_like(k_out)
    q = qk_norm_rope_write_triton(*case.args(k_cache, v_cache), k_out=k_out)
    ref_q = qk_norm_rope_write_reference(*case.args(case.k_cache, case.v_cache), k_out=ref_k)
    assert_rope_close(q, ref_q, seed)
    assert_rope_close(k_out, ref_k, seed)
    assert_rope_close(k_cache, case.k_cache, seed)
    assert torch.equal(v_cache, case.v_cache), f"seed={seed}"
    assert torch.equal(k_cache[case.slots, case.positions], k_out), f"seed={seed}"


def test_qk_norm_rope_write_strided_qkv(seed: int) -> None:
    case = make_case(3, 2, 1, 32, torch.bfloat16)
    wide = torch.randn(3, case.qkv.shape[1] + 8, dtype=torch.bfloat16, device=DEVICE)
    wide[:, 8:] = case.qkv
    case.qkv = wide[:, 8:]  # rows are 8 elements longer than their content
    case.slots = case.slots.to(torch.int32)  # int32 indices work as well
    run_and_compare(case, seed)


def test_reference_matches_layers(seed: int) -> None:
    """The reference equals what Qwen3Attention computes with its RMSNorm and RotaryEmbedding modules."""
    T, n_q, n_kv, D, dtype = 3, 4, 2, 32, torch.bfloat16
    case = make_case(T, n_q, n_kv, D, dtype)
    k_cache, v_cache = case.k_cache.clone(), case.v_cache.clone()
    q_ref = qk_norm_rope_write_reference(*case.args(k_cache, v_cache))

    q_norm, k_norm = RMSNorm(D, EPS).to(DEVICE, dtype), RMSNorm(D, EPS).to(DEVICE, dtype)
    with torch.no_grad():
        q_norm.weight.copy_(case.q_w)
        k_norm.weight.copy_(case.k_w)
        q, k, v = case.qkv.split([n_q * D, n_kv * D, n_kv * D], dim=-1)
        q = q_norm(q.reshape(T, n_q, D))  # [T, n_q, D]
        k = k_norm(k.reshape(T, n_kv, D))  # [T, n_kv, D]
        q, k = RotaryEmbedding(RopeConfig(theta=1e6), D, MAX_POSITION)(case.positions, q, k)
    assert torch.equal(q, q_ref), f"seed={seed}"
    assert torch.equal(k_cache[case.slots, case.positions], k), f"seed={seed}"
    assert torch.equal(v_cache[case.slots, case.positions], v.reshape(T, n_kv, D)), f"seed={seed}"


def test_qk_norm_rope_write_dispatch(seed: int) -> None:
    case = make_case(1, 2, 1, 16, torch.float16)
    k_cache, v_cache = case.k_cache.clone(), case.v_cache.clone()
    q = qk_norm_rope_write(*case.args(k_cache, v_cache), backend="triton")
    ref_q = qk_norm_rope_write(*case.args(case.k_cache, case.v_cache), backend="torch")
    assert_rope_close(q, ref_q, seed)
    assert_rope_close(k_cache, case.k_cache, seed)
    with pytest.raises(ValueError, match="q_norm_w"):
        qk_norm_rope_write_triton(case.qkv, case.q_w[:8], *case.args(k_cache, v_cache)[2:])
