"""decode_attention_qk (q/k norm + RoPE + cache write + decode attention in one launch) against the two launches
it replaces (qk_norm_rope_write, decode_attention) and against the torch reference."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from moerun.kernels.quant.int8_dot import quantize_x  # noqa: E402
from moerun import ops  # noqa: E402
from moerun.ops.attention import decode_attention, decode_attention_int8  # noqa: E402
from moerun.ops.attention import qk_norm_rope_write  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
ON_CUDA = DEVICE.type == "cuda"
TOLERANCE = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=1.6e-2, atol=1.6e-2)}
# one float32 rounding of the sum of squares apart; in bf16 that can move a value by one bf16 step
K_TOLERANCE = {torch.float32: dict(rtol=1e-6, atol=1e-6), torch.bfloat16: dict(rtol=2**-7, atol=2**-7)}
N_Q, N_KV, D, L = 8, 2, 64, 1024


def make_case(seq_lens: list[int], dtype: torch.dtype, past_end: bool = False) -> dict:
    """Random q|k|v rows, norm weights, rotary tables and caches; each sequence's new token at its last attended
    position (past_end: one past it, written but not attended)."""
    B = len(seq_lens)
    S = B + 2
    angles = torch.arange(L)[:, None] * (10000.0 ** (-torch.arange(D // 2) / (D // 2)))[None, :]  # [L, D/2]
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    return dict(
        qkv=torch.randn(B, (N_Q + 2 * N_KV) * D).to(dtype).to(DEVICE),
        q_norm_w=(1 + 0.1 * torch.randn(D)).to(dtype).to(DEVICE),
        k_norm_w=(1 + 0.1 * torch.randn(D)).to(dtype).to(DEVICE),
        eps=1e-6,
        cos=angles.cos().repeat(1, 2).to(dtype).to(DEVICE),
        sin=angles.sin().repeat(1, 2).to(dtype).to(DEVICE),
        positions=(lens.long() - (0 if past_end else 1)).to(DEVICE),
        token_slots=torch.randperm(S)[:B].to(DEVICE),
        k_cache=torch.randn(S, L, N_KV, D).to(dtype).to(DEVICE),
        v_cache=torch.randn(S, L, N_KV, D).to(dtype).to(DEVICE),
        seq_lens=lens.to(DEVICE),
    )


def two_launches(c: dict, k_cache: torch.Tensor, v_cache: torch.Tensor, k_pad: int | None = None):
    """The unfused Triton path on its own copy of the caches: (out, int8 rows or None)."""
    q = qk_norm_rope_write(c["qkv"], c["q_norm_w"], c["k_norm_w"], c["eps"], c["cos"], c["sin"], c["positions"],
                           c["token_slots"], k_cache, v_cache, N_Q, N_KV, backend="triton")  # fmt: skip
    args = (q, k_cache, v_cache, c["token_slots"], c["seq_lens"], D**-0.5)
    if k_pad is None:
        return decode_attention(*args, backend="triton"), None
    return decode_attention_int8(*args, k_pad)


def one_launch(c: dict, k_cache: torch.Tensor, v_cache: torch.Tensor, k_pad: int | None = None,
               backend: str = "triton"):  # fmt: skip
    return ops.decode_attention_qk(
        c["qkv"], c["q_norm_w"], c["k_norm_w"], c["eps"], c["cos"], c["sin"], c["positions"], c["token_slots"],
        k_cache, v_cache, c["token_slots"], c["seq_lens"], D**-0.5, N_Q, N_KV, k_pad, backend=backend,
    )


@pytest.mark.parametrize("past_end", [False, True], ids=["last_position", "past_the_end"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_launch_matches_two(seed: int, dtype: torch.dtype, past_end: bool) -> None:
    # 1 position; one chunk; 700 positions in three chunks of the default 256 (the new token in the third, which
    # also merges the partials)
    c = make_case([1, 37, 700], dtype, past_end)
    k_ref, v_ref = c["k_cache"].clone(), c["v_cache"].clone()
    ref, _ = two_launches(c, k_ref, v_ref)
    for call in range(2):  # the second call proves the tickets were reset
        k_cache, v_cache = c["k_cache"].clone(), c["v_cache"].clone()
        out, rows = one_launch(c, k_cache, v_cache)
        assert rows is None
        # v is copied; k comes from the same norm code, which on the GPU may sum its squares in another order (the
        # two kernels lay a head out over their warps differently): float32 rounding apart there, equal here
        assert torch.equal(v_cache, v_ref), f"seed={seed} call {call}"
        if ON_CUDA:
            torch.testing.assert_close(k_cache, k_ref, **K_TOLERANCE[dtype], msg=lambda m: f"seed={seed}: {m}")
        else:
            assert torch.equal(k_cache, k_ref), f"seed={seed} call {call}"
        if ON_CUDA:  # the attention compiled without fused multiply-adds here: float32 rounding apart
            torch.testing.assert_close(out, ref, **TOLERANCE[dtype], msg=lambda m: f"seed={seed}: {m}")
        else:
            assert torch.equal(out, ref), f"seed={seed} call {call}"
    expected, _ = one_launch(c, c["k_cache"].clone(), c["v_cache"].clone(), backend="torch")
    torch.testing.assert_close(out, expected, **TOLERANCE[dtype], msg=lambda m: f"seed={seed} vs torch: {m}")


def test_int8_rows_of_the_output(seed: int) -> None:
    c = make_case([5, 130], torch.bfloat16)
    out, rows = one_launch(c, c["k_cache"].clone(), c["v_cache"].clone(), k_pad=N_Q * D)
    _, ref_rows = two_launches(c, c["k_cache"].clone(), c["v_cache"].clone(), k_pad=N_Q * D)
    expected = quantize_x(out.reshape(out.shape[0], -1), N_Q * D)
    for got, want in zip(rows, expected):  # the rows are those of the output it returns, bit for bit
        assert torch.equal(got, want), f"seed={seed}"
    if not ON_CUDA:
        for got, want in zip(rows, ref_rows):
            assert torch.equal(got, want), f"seed={seed}"


def test_bad_shapes_are_rejected() -> None:
    c = make_case([3], torch.float32)
    c["qkv"] = c["qkv"][:, :-1]
    with pytest.raises(ValueError, match="qkv must be"):
        one_launch(c, c["k_cache"], c["v_cache"])
