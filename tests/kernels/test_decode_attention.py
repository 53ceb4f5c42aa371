"""decode_attention (Triton flash-decoding, single launch or partial + combine kernels) against the SDPA
reference; a CUDA-graph replay of the decode ops."""

from __future__ import annotations

import pytest
import torch

from helpers import capture_cuda_graph

pytest.importorskip("triton")

from moerun.kernels.decode_attention import decode_attention_triton, default_num_splits  # noqa: E402
from moerun.kernels.tickets import ticket_counters  # noqa: E402
from moerun.ops.attention import (  # noqa: E402
    decode_attention,
    decode_attention_reference,
    qk_norm_rope_write,
    qk_norm_rope_write_reference,
)
from moerun.ops.norm import rms_norm, rms_norm_reference  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# SDPA in a 16-bit dtype rounds its output once; the kernel's softmax weights also round once before p @ v
TOLERANCE = {
    torch.float32: dict(rtol=1e-5, atol=1e-5),
    torch.float16: dict(rtol=2e-3, atol=2e-3),
    torch.bfloat16: dict(rtol=1.6e-2, atol=1.6e-2),
}


def make_cache(S: int, L: int, n_kv: int, D: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    k_cache = torch.randn(S, L, n_kv, D).to(dtype).to(DEVICE)  # [S, L, n_kv, D]
    v_cache = torch.randn(S, L, n_kv, D).to(dtype).to(DEVICE)
    return k_cache, v_cache


def check(
    seq_lens: list[int],
    n_q: int,
    n_kv: int,
    D: int,
    L: int,
    dtype: torch.dtype,
    seed: int,
    num_splits: int | None,
    block_n: int | None = None,
    len_dtype: torch.dtype = torch.int64,
    single_launch: bool = True,
    pad_rows: int = 0,
    min_chunk: int | None = None,
) -> None:
    """Both calls of the kernel (the second proves the single launch's tickets were reset) against SDPA.

    pad_rows extra rows point at one shared scratch slot with length 1, as a padded graph batch does.
    min_chunk defaults to block_n here, so that these short sequences still spread over several splits.
    """
    B, S = len(seq_lens) + pad_rows, len(seq_lens) + 3
    k_cache, v_cache = make_cache(S, L, n_kv, D, dtype)
    q = (torch.randn(B, n_q, D) * 2).to(dtype).to(DEVICE)  # [B, n_q, D], scaled so softmax is not flat
    slot_ids = torch.cat([torch.randperm(S - 1)[: len(seq_lens)], torch.full((pad_rows,), S - 1)]).to(DEVICE)  # [B]
    lens = torch.tensor(seq_lens + [1] * pad_rows, dtype=len_dtype, device=DEVICE)  # [B]
    scale = D**-0.5
    ref = decode_attention_reference(q, k_cache, v_cache, slot_ids, lens, scale)
    for call in range(2):
        out = decode_attention_triton(q, k_cache, v_cache, slot_ids, lens, scale, num_splits=num_splits,
                                      block_n=block_n, single_launch=single_launch,
                                      min_chunk=min_chunk if min_chunk is not None else block_n)
        assert out.dtype == dtype and out.shape == (B, n_q, D)
        torch.testing.assert_close(out, ref, **TOLERANCE[dtype], msg=lambda m: f"seed={seed} call {call}: {m}")
    assert not ticket_counters(DEVICE, B * n_kv, "decode_attention").any(), "tickets must be back at 0"


@pytest.fixture(params=[True, False], ids=["single-launch", "two-kernels"])
def single_launch(request: pytest.FixtureRequest) -> bool:
    return request.param


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_gqa3_mixed_lengths(seed: int, dtype: torch.dtype, single_launch: bool) -> None:
    # chunks are 16 positions here: 16 and 32 end exactly on a chunk, 17 one past it, 1 and 48 the extremes
    check([1, 48, 17, 16, 32], n_q=6, n_kv=2, D=32, L=48, dtype=dtype, seed=seed, num_splits=3, block_n=16,
          single_launch=single_launch)


def test_mha_single_sequence_full_cache(seed: int, single_launch: bool) -> None:
    check([40], n_q=2, n_kv=2, D=16, L=40, dtype=torch.float32, seed=seed, num_splits=2, block_n=16,
          single_launch=single_launch)


def test_gqa8_int32_lengths(seed: int, single_launch: bool) -> None:
    check([35, 2], n_q=8, n_kv=1, D=64, L=35, dtype=torch.float16, seed=seed, num_splits=2, block_n=16,
          len_dtype=torch.int32, single_launch=single_launch)


def test_qwen3_head_group_more_splits_than_blocks(seed: int, single_launch: bool) -> None:
    # Qwen3-30B-A3B's group of 8 query heads at D=128; 4 splits but 2 blocks of positions: 2 empty partials
    check([20], n_q=8, n_kv=1, D=128, L=24, dtype=torch.bfloat16, seed=seed, num_splits=4, block_n=16,
          single_launch=single_launch)


@pytest.mark.parametrize("n_q,n_kv", [(2, 2), (16, 2)], ids=["mha", "gqa8"])
def test_varied_lengths_with_padding_rows(seed: int, n_q: int, n_kv: int, single_launch: bool) -> None:
    # one position, a single chunk, a few chunks, the whole cache over all 4 splits; then 2 padding rows
    check([1, 9, 40, 64], n_q=n_q, n_kv=n_kv, D=32, L=64, dtype=torch.bfloat16, seed=seed, num_splits=4,
          block_n=16, single_launch=single_launch, pad_rows=2)


@pytest.mark.parametrize("min_chunk", [32, 1000])
def test_min_chunk(seed: int, min_chunk: int) -> None:
    # 32: two blocks per split, so 9 positions take one split and 64 two; 1000: every sequence in one chunk
    check([1, 9, 40, 64], n_q=8, n_kv=2, D=32, L=64, dtype=torch.bfloat16, seed=seed, num_splits=4, block_n=16,
          min_chunk=min_chunk, pad_rows=1)


def test_default_chunk_rule(seed: int) -> None:
    # default block_n (64 here), splits and chunks: 200 positions in one chunk (<= ONE_CHUNK), 700 in chunks of
    # MIN_CHUNK = 128, 2600 in 14 chunks of 192 (>= 1/16 of the sequence), 2 padding rows of one position
    check([200, 700, 2600], n_q=2, n_kv=1, D=16, L=2600, dtype=torch.float32, seed=seed, num_splits=None,
          pad_rows=2)


def test_empty_sequence_gives_zeros(seed: int, single_launch: bool) -> None:
    B, n_q, n_kv, D, L = 2, 4, 2, 16, 32
    k_cache, v_cache = make_cache(3, L, n_kv, D, torch.float32)
    q = torch.randn(B, n_q, D, device=DEVICE)
    lens = torch.tensor([0, 20], device=DEVICE)
    out = decode_attention_triton(q, k_cache, v_cache, torch.tensor([0, 1], device=DEVICE), lens, 0.25,
                                  num_splits=2, block_n=16, single_launch=single_launch, min_chunk=16)
    assert not out[0].any(), f"seed={seed}"
    ref = decode_attention_reference(q[1:], k_cache, v_cache, torch.tensor([1], device=DEVICE), lens[1:], 0.25)
    torch.testing.assert_close(out[1:], ref, **TOLERANCE[torch.float32], msg=lambda m: f"seed={seed}: {m}")


def test_dispatch_defaults(seed: int) -> None:
    B, n_q, n_kv, D, L = 1, 2, 1, 16, 130
    k_cache, v_cache = make_cache(3, L, n_kv, D, torch.bfloat16)
    q = torch.randn(B, n_q, D).to(torch.bfloat16).to(DEVICE)
    slot_ids = torch.tensor([2], device=DEVICE)
    lens = torch.tensor([129], device=DEVICE)
    out = decode_attention(q, k_cache, v_cache, slot_ids, lens, 0.25, backend="triton")
    ref = decode_attention(q, k_cache, v_cache, slot_ids, lens, 0.25, backend="torch")
    torch.testing.assert_close(out, ref, **TOLERANCE[torch.bfloat16], msg=lambda m: f"seed={seed}: {m}")
    with pytest.raises(ValueError, match="power-of-two head dim"):
        decode_attention_triton(q[..., :12], k_cache[..., :12], v_cache[..., :12], slot_ids, lens, 0.25)


def test_default_num_splits() -> None:
    cpu = torch.device("cpu")  # assumes 132 SMs
    assert default_num_splits(1, 4, 40960, 64, cpu) == 64
    assert default_num_splits(64, 4, 40960, 64, cpu) == 1
    assert default_num_splits(1, 4, 100, 64, cpu) == 2  # never more splits than blocks of positions


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_cuda_graph_replay(seed: int, single_launch: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Captures rms_norm + qk_norm_rope_write + decode_attention once, replays with new inputs and lengths."""
    import moerun.kernels.decode_attention as kernel

    monkeypatch.setattr(kernel, "SINGLE_LAUNCH", single_launch)
    dtype, eps = torch.bfloat16, 1e-6
    B, H, n_q, n_kv, D, S, L = 3, 256, 8, 2, 128, 5, 256
    dev = torch.device("cuda")
    x = torch.randn(B, H, device=dev, dtype=dtype)  # static inputs, refilled before each replay
    residual = torch.randn(B, H, device=dev, dtype=dtype)
    qkv = torch.randn(B, (n_q + 2 * n_kv) * D, device=dev, dtype=dtype)
    positions = torch.zeros(B, dtype=torch.int64, device=dev)
    slot_ids = torch.tensor([4, 0, 2], device=dev)
    seq_lens = torch.ones(B, dtype=torch.int64, device=dev)
    norm_w = 1 + 0.3 * torch.randn(H, device=dev, dtype=dtype)
    q_w, k_w = (1 + 0.3 * torch.randn(2, D, device=dev, dtype=dtype)).unbind(0)
    angles = torch.rand(L, D, device=dev) * 6
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    k_cache, v_cache = (torch.randn(2, S, L, n_kv, D, device=dev) * 0.5).to(dtype).unbind(0)

    def step() -> tuple[torch.Tensor, ...]:
        normed, new_residual = rms_norm(x, norm_w, eps, residual)
        q = qk_norm_rope_write(qkv, q_w, k_w, eps, cos, sin, positions, slot_ids, k_cache, v_cache, n_q, n_kv)
        return normed, new_residual, q, decode_attention(q, k_cache, v_cache, slot_ids, seq_lens, D**-0.5)

    graph, static_out = capture_cuda_graph(step)  # kernels compile outside the capture

    for new_positions in ([0, L - 1, 37], [64, 5, L - 1], [L - 1, 128, 0]):
        x.copy_(torch.randn_like(x))
        residual.copy_(torch.randn_like(residual))
        qkv.copy_(torch.randn_like(qkv))
        positions.copy_(torch.tensor(new_positions))
        seq_lens.copy_(positions + 1)
        k_before, v_before = k_cache.clone(), v_cache.clone()
        graph.replay()
        ref_normed, ref_residual = rms_norm_reference(x, norm_w, eps, residual)
        ref_q = qk_norm_rope_write_reference(
            qkv, q_w, k_w, eps, cos, sin, positions, slot_ids, k_before, v_before, n_q, n_kv
        )
        ref_attn = decode_attention_reference(ref_q, k_before, v_before, slot_ids, seq_lens, D**-0.5)
        normed, new_residual, q, attn = static_out
        torch.cuda.synchronize()
        msg = lambda m: f"seed={seed} positions={new_positions}: {m}"  # noqa: E731
        assert torch.equal(new_residual, ref_residual), msg("residual")
        torch.testing.assert_close(normed, ref_normed, rtol=2**-7, atol=2**-7, msg=msg)
        torch.testing.assert_close(q, ref_q, rtol=2**-7, atol=2**-5, msg=msg)
        torch.testing.assert_close(k_cache, k_before, rtol=2**-7, atol=2**-5, msg=msg)
        assert torch.equal(v_cache, v_before), msg("v cache")
        torch.testing.assert_close(attn, ref_attn, rtol=2e-2, atol=2e-2, msg=msg)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n_q,n_kv,D", [(8, 2, 32), (12, 4, 64), (4, 2, 32)], ids=["g4", "g3", "padded-k"])
def test_int8_output_is_the_quantized_output(seed: int, dtype: torch.dtype, n_q: int, n_kv: int, D: int) -> None:
    # decode_attention_int8_triton: the same output as decode_attention_triton and, bit for bit, the int8 rows that
    # quantize_x gives for it; lengths 0 (zeros), one chunk (no merge) and several (merged). Head groups of 4 and 3
    # (padding rows in the kernel's tiles) write the rows in the launch; a row of 128 values padded to 256 cannot
    # and quantizes after it.
    from moerun.kernels.decode_attention import INT8_MAX_BLOCK_N, decode_attention_int8_triton, default_block_n
    from moerun.kernels.quant.int8_dot import quantize_x

    lens, L = [0, 5, 300, 600], 640
    B, S = len(lens), len(lens) + 1
    k_cache, v_cache = make_cache(S, L, n_kv, D, dtype)
    q = (torch.randn(B, n_q, D) * 2).to(dtype).to(DEVICE)  # [B, n_q, D]
    slot_ids = torch.randperm(S)[:B].to(DEVICE)
    seq_lens = torch.tensor(lens, device=DEVICE)
    k_pad = -(-n_q * D // 256) * 256
    out, rows = decode_attention_int8_triton(q, k_cache, v_cache, slot_ids, seq_lens, D**-0.5, k_pad, num_splits=4)
    # the int8 launch takes at most INT8_MAX_BLOCK_N positions a step: the same steps here
    block_n = min(default_block_n(D, dtype), INT8_MAX_BLOCK_N)
    ref = decode_attention_triton(q, k_cache, v_cache, slot_ids, seq_lens, D**-0.5, num_splits=4, block_n=block_n)
    assert torch.equal(out, ref), f"seed={seed}"
    for got, want in zip(rows, quantize_x(ref.reshape(B, -1), k_pad)):
        assert torch.equal(got, want), f"seed={seed}"


def test_int8_output_needs_a_whole_padded_row() -> None:
    from moerun.kernels.decode_attention import decode_attention_int8_triton

    k_cache, v_cache = make_cache(2, 16, 1, 32, torch.float32)
    q = torch.randn(1, 2, 32, device=DEVICE)
    with pytest.raises(ValueError, match="multiple of 256"):
        decode_attention_int8_triton(q, k_cache, v_cache, torch.tensor([0], device=DEVICE),
                                     torch.tensor([3], device=DEVICE), 0.2, 128)
