"""linear / rms_norm_linear (Triton GEMV, optional fused add + RMSNorm) against F.linear and RMSNorm; the layer."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from helpers import assert_rare_flips, capture_cuda_graph, ulp_distance

pytest.importorskip("triton")

from moerun.config import ModelConfig  # noqa: E402
from moerun.engine.batch import ForwardBatch  # noqa: E402
from moerun.engine.kv_cache import KVCache  # noqa: E402
from moerun.kernels.gemv import (  # noqa: E402
    MAX_TOKENS,
    GemvConfig,
    choose,
    default_config,
    linear_triton,
    load_table,
    rms_norm_linear_triton,
    table_key,
    table_path,
    tuned_for,
)
from moerun.kernels.tickets import ticket_counters  # noqa: E402
from moerun.layers.attention import Qwen3Attention  # noqa: E402
from moerun.layers.norm import RMSNorm  # noqa: E402
from moerun.layers.rotary import RotaryEmbedding  # noqa: E402
from moerun.ops.linear import linear, linear_reference, rms_norm_linear, rms_norm_linear_reference  # noqa: E402
from moerun.ops.norm import rms_norm_reference  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
EPS = 1e-6
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# relative to the output's scale: float32 sums in another order; 16-bit outputs round once (half an ulp)
TOLERANCE = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}
# fma and dot paths, one K range or several (3 splits of K=100 in 32-column blocks leave a ragged last split)
CONFIGS = {
    "fma": GemvConfig(block_n=16, block_k=32, num_stages=1),
    "dot": GemvConfig(block_n=16, block_k=32, dot=True, num_stages=1),
    "fma-split3": GemvConfig(block_n=8, block_k=32, split_k=3, num_stages=1),
    "dot-split2": GemvConfig(block_n=16, block_k=64, split_k=2, dot=True, num_stages=1),
    # one K step per split, nothing loaded ahead: the whole row (K = 100 in a 128 block), or two halves
    "fma-one-step": GemvConfig(block_n=4, block_k=128, num_stages=1),
    "fma-split2-one-step": GemvConfig(block_n=2, block_k=64, split_k=2, num_stages=1),
    # behind the norm: the row's x + residual read once for the 1/rms and the product (ignored without the norm)
    "fma-one-step-row-once": GemvConfig(block_n=4, block_k=128, num_stages=1, row_once=True),
    "dot-one-step-row-once": GemvConfig(block_n=16, block_k=128, dot=True, num_stages=1, row_once=True),
}


def make_operands(T: int, N: int, K: int, dtype: torch.dtype, with_bias: bool):
    x = torch.randn(T, K).to(dtype).to(DEVICE)  # [T, K]
    weight = (torch.randn(N, K) / K**0.5).to(dtype).to(DEVICE)  # [N, K]
    bias = torch.randn(N).to(dtype).to(DEVICE) if with_bias else None  # [N]
    return x, weight, bias


def assert_linear_close(y: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias, seed: int, what: str) -> None:
    """y against the float32 product of the same (rounded) operands."""
    ref = linear_reference(x.float(), weight.float(), bias.float() if bias is not None else None)  # [T, N]
    assert y.dtype == x.dtype and y.shape == ref.shape, f"seed={seed} {what}"
    tol = TOLERANCE[y.dtype] * max(1.0, ref.abs().max().item())
    torch.testing.assert_close(y.float(), ref, rtol=TOLERANCE[y.dtype], atol=tol,
                               msg=lambda m: f"seed={seed} {what}: {m}")


def assert_tickets_reset() -> None:
    assert not ticket_counters(DEVICE, 64, "gemv").any(), "the last program must leave every ticket counter at 0"


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("T", [1, 3, 8])
@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_matches_torch(seed: int, dtype: torch.dtype, T: int, with_bias: bool, config: str) -> None:
    # odd N and K: N = 37 is no multiple of BLOCK_N, K = 100 none of BLOCK_K
    x, weight, bias = make_operands(T, 37, 100, dtype, with_bias)
    for call in range(2):  # the second call proves the split-K tickets were reset
        y = linear_triton(x, weight, bias, CONFIGS[config])
        assert_linear_close(y, x, weight, bias, seed, f"{config} call {call}")
    assert_tickets_reset()


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("T", [1, 3, 8])
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_linear_matches_unfused(seed: int, dtype: torch.dtype, T: int, with_residual: bool,
                                         config: str) -> None:
    x, weight, bias = make_operands(T, 37, 100, dtype, with_bias=T == 3)
    residual = (torch.randn(T, 100) * 2).to(dtype).to(DEVICE) if with_residual else None
    residual_before = residual.clone() if with_residual else None
    norm_w = (1 + 0.3 * torch.randn(100)).to(dtype).to(DEVICE)
    normed, ref_residual = rms_norm_reference(x, norm_w, EPS, residual)
    for call in range(2):
        y, new_residual = rms_norm_linear_triton(x, residual, norm_w, EPS, weight, bias, CONFIGS[config])
        # the residual sum rounds once in both: bit-identical, in a new tensor (or x itself without a residual)
        assert torch.equal(new_residual, ref_residual), f"seed={seed} call {call}"
        assert (new_residual is x) == (residual is None), f"seed={seed}"
        if with_residual:
            assert torch.equal(residual, residual_before), f"seed={seed}: residual was written"
        assert_linear_close(y, normed, weight, bias, seed, f"{config} call {call}")
    assert_tickets_reset()


@pytest.mark.parametrize("config", ["fma-one-step", "dot-one-step"])
@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float32], ids=["bf16_x", "float32_sums"])
def test_row_read_once_changes_nothing(seed: int, x_dtype: torch.dtype, config: str) -> None:
    # row_once (one K step over the whole row, behind the norm): the same products in the same order as reading
    # the row twice, so both outputs are equal bit for bit; where its conditions fail (a split) it is ignored
    T, N, K = 2, 37, 100
    _, weight, bias = make_operands(T, N, K, torch.bfloat16, with_bias=True)
    x = (torch.randn(T, K) * 2).to(x_dtype).to(DEVICE)
    residual = (torch.randn(T, K) * 2).to(torch.bfloat16).to(DEVICE)
    norm_w = (1 + 0.3 * torch.randn(K)).to(torch.bfloat16).to(DEVICE)
    base = CONFIGS["fma-one-step"] if config == "fma-one-step" else GemvConfig(block_n=16, block_k=128, dot=True,
                                                                               num_stages=1)  # fmt: skip
    for cfg in (base, replace(base, split_k=2, block_k=64)):
        want = rms_norm_linear_triton(x, residual, norm_w, EPS, weight, bias, cfg)
        got = rms_norm_linear_triton(x, residual, norm_w, EPS, weight, bias, replace(cfg, row_once=True))
        for g, w in zip(got, want):
            assert torch.equal(g, w), f"seed={seed} {cfg}"


@pytest.mark.parametrize("config", ["fma", "dot-split2"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_float32_sums_beside_a_16_bit_residual(seed: int, dtype: torch.dtype, config: str) -> None:
    # An MoE's unrounded float32 slot sums go into the norm in front of q|k|v as they are: the kernel rounds them to
    # the residual's dtype first, so both outputs equal those of the rounded sums, bit for bit; the op agrees
    T, N, K = 3, 37, 100
    x32 = torch.randn(T, K, device=DEVICE) * 2
    _, weight, bias = make_operands(T, N, K, dtype, with_bias=True)
    residual = (torch.randn(T, K) * 2).to(dtype).to(DEVICE)
    norm_w = (1 + 0.3 * torch.randn(K)).to(dtype).to(DEVICE)
    got = rms_norm_linear_triton(x32, residual, norm_w, EPS, weight, bias, CONFIGS[config])
    want = rms_norm_linear_triton(x32.to(dtype), residual, norm_w, EPS, weight, bias, CONFIGS[config])
    for g, w in zip(got, want):
        assert g.dtype == dtype and torch.equal(g, w), f"seed={seed}"
    for backend in ("triton", "torch"):
        y, new_residual = rms_norm_linear(x32, residual, norm_w, EPS, weight, bias, backend=backend)
        assert y.dtype == new_residual.dtype == dtype and torch.equal(new_residual, want[1]), f"seed={seed}"
    with pytest.raises(ValueError, match="share a dtype"):  # a float32 residual beside a 16-bit weight
        rms_norm_linear_triton(x32, residual.float(), norm_w, EPS, weight, bias)


@pytest.mark.parametrize("config", ["fma", "dot-split2"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fused_norm_rounds_like_rms_norm(seed: int, dtype: torch.dtype, config: str) -> None:
    """With one-hot weight rows y picks single normalised elements, so it shows the norm's roundings unblurred."""
    T, N, K = 3, 40, 96
    x, residual = ((torch.randn(2, T, K) * 3).to(dtype).to(DEVICE)).unbind(0)
    norm_w = (1 + 0.3 * torch.randn(K)).to(dtype).to(DEVICE)
    picks = torch.randperm(K)[:N]
    weight = torch.eye(K)[picks].to(dtype).to(DEVICE)  # [N, K], row n selects column picks[n]
    y, _ = rms_norm_linear_triton(x, residual, norm_w, EPS, weight, None, CONFIGS[config])
    normed, _ = rms_norm_reference(x, norm_w, EPS, residual)
    ref = normed[:, picks.to(DEVICE)]  # [T, N]
    # as in test_rmsnorm: the same float32 values rounded, except a rare flip from the sum's order (one ulp of the
    # normalised value, up to two of the output after the weight's product)
    ulps = ulp_distance(y, ref)
    assert ulps.max() <= 2, f"seed={seed}: {int(ulps.max())} ulps apart"
    assert_rare_flips(ulps > 0, seed, per=50)


def test_default_configs_run(seed: int) -> None:
    """The interpreter's default configs (fma for one token, dot for more), picked by the op itself."""
    for T in (1, 2, MAX_TOKENS):
        x, weight, bias = make_operands(T, 24, 48, torch.bfloat16, with_bias=True)
        assert_linear_close(linear(x, weight, bias, backend="triton"), x, weight, bias, seed, f"T={T}")


def test_dispatch(seed: int) -> None:
    x, weight, bias = make_operands(2, 20, 32, torch.float16, with_bias=True)
    x3 = x.reshape(1, 2, 32)  # leading dims are flattened into tokens and restored
    y = linear(x3, weight, bias, backend="triton")
    assert y.shape == (1, 2, 20)
    assert_linear_close(y[0], x, weight, bias, seed, "3-D input")
    assert torch.equal(linear(x, weight, bias, backend="torch"), linear_reference(x, weight, bias))
    with pytest.raises(ValueError, match="at most"):
        linear(torch.randn(MAX_TOKENS + 1, 32).to(x), weight, backend="triton")
    with pytest.raises(ValueError, match="dtype"):
        linear(x, weight.float(), backend="triton")
    norm_w = torch.ones(32, dtype=x.dtype, device=DEVICE)
    y, new_residual = rms_norm_linear(x, None, norm_w, EPS, weight, bias, backend="torch")
    ref, _ = rms_norm_linear_reference(x, None, norm_w, EPS, weight, bias)
    assert torch.equal(y, ref) and new_residual is x
    if DEVICE.type == "cpu":
        # automatic choice on CPU: the torch path, bit for bit
        assert torch.equal(linear(x, weight, bias), linear_reference(x, weight, bias))


def test_config_table_and_defaults() -> None:
    table = {1: GemvConfig(block_n=8), 4: GemvConfig(dot=True), 8: GemvConfig(backend="torch")}
    assert tuned_for(table, 1).block_n == 8
    assert tuned_for(table, 3).dot and tuned_for(table, 4).dot  # never a smaller bucket's tiles
    assert tuned_for(table, 5).backend == "torch"
    assert tuned_for(table, 9) is None
    assert GemvConfig.from_dict(GemvConfig(split_k=4).to_dict()) == GemvConfig(split_k=4)
    with pytest.raises(ValueError, match="unknown keys"):
        GemvConfig.from_dict({"BLOCK_N": 16})
    with pytest.raises(ValueError, match="dot path"):
        GemvConfig(block_n=8, dot=True)
    # a table entry where cuBLAS won alone: PDL decode of one token keeps Triton with its tiles, the rest cuBLAS
    cublas = GemvConfig(block_n=2, block_k=2048, backend="torch")
    default = default_config(5120, 2048, 1, torch.bfloat16, interpret=False)
    assert choose(cublas, default, 1, pdl=True) == GemvConfig(block_n=2, block_k=2048)
    assert choose(cublas, default, 1, pdl=False) == cublas and choose(cublas, default, 2, pdl=True) == cublas
    assert choose(None, default, 1, pdl=True) == default
    # on a 132-SM GPU: a narrow long projection is split over K, o_proj (N=2048, K=4096) and q|k|v are not
    assert default_config(256, 8192, 1, torch.bfloat16, interpret=False).split_k == 4
    assert default_config(2048, 4096, 1, torch.bfloat16, interpret=False).split_k == 1
    assert default_config(5120, 2048, 1, torch.bfloat16, interpret=False).split_k == 1
    # several tokens: cuBLAS unless tuned, with dot tiles for callers that force the GEMV
    many = default_config(151936, 2048, 8, torch.bfloat16, interpret=False)
    assert many.dot and many.backend == "torch"


def test_user_table_replaces_shipped_entries(tmp_path) -> None:
    """MOERUN_GEMV_CONFIG_DIR's table: the shapes it holds replace the shipped entries, the others stay."""
    shipped = load_table("NVIDIA_H200")
    key = table_key(5120, 2048, torch.bfloat16)
    assert key in shipped and len(shipped) > 1
    mine = GemvConfig(block_n=4, block_k=1024, num_warps=8)
    table_path("NVIDIA_H200", tmp_path).write_text(json.dumps({key: {"1": mine.to_dict()}}))
    merged = load_table("NVIDIA_H200", str(tmp_path))
    assert merged[key] == {1: mine}
    assert {k: v for k, v in merged.items() if k != key} == {k: v for k, v in shipped.items() if k != key}
    assert load_table("no-such-device", str(tmp_path)) == {}


def test_tuner_finalists_are_tables_the_op_reads(tmp_path) -> None:
    """benchmarks/tune_gemv.py --finalists: one folder a config, each a table MOERUN_GEMV_CONFIG_DIR reads."""
    import runpy
    from pathlib import Path

    from moerun.kernels.tile_configs import device_name

    script = runpy.run_path(str(Path(__file__).parents[2] / "benchmarks" / "tune_gemv.py"))
    key = table_key(5120, 2048, torch.bfloat16)
    configs = [("1", GemvConfig(block_n=2, block_k=2048)), ("shipped", GemvConfig(block_n=4, block_k=1024))]
    variants = script["write_finalists"]({("qkv", key, 1): configs, ("qkv", key, 2): configs[:1]}, tmp_path)
    assert len(variants) == 2  # batch-1 steps only: the T = 2 folder is written, not offered
    for label, cfg in configs:
        folder = tmp_path / f"qkv-t1-{label}"
        assert f"--variant qkv-t1-{label}:MOERUN_GEMV_CONFIG_DIR={folder}" in variants
        assert load_table(device_name(), str(folder))[key] == {1: cfg}
    assert load_table(device_name(), str(tmp_path / "qkv-t2-1"))[key] == {2: configs[0][1]}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("split_k", [1, 4])
def test_cuda_graph_replay(seed: int, split_k: int) -> None:
    """linear + rms_norm_linear captured once at the model's widths, replayed with new inputs."""
    dtype, T, K, N = torch.bfloat16, 2, 2048, 640
    x, weight, bias = make_operands(T, N, K, dtype, with_bias=True)
    residual = torch.randn_like(x)
    norm_w = (1 + 0.3 * torch.randn(K, device=DEVICE)).to(dtype)
    w_o = (torch.randn(K, N, device=DEVICE) / N**0.5).to(dtype)  # [K, N], an o_proj-like narrow output
    fma = GemvConfig(block_n=16, block_k=256, split_k=split_k)
    dot = GemvConfig(block_n=16, block_k=256, split_k=split_k, dot=True, num_stages=3)

    def step() -> tuple[torch.Tensor, ...]:
        y, new_residual = rms_norm_linear_triton(x, residual, norm_w, EPS, weight, bias, fma)
        return y, new_residual, linear_triton(y, w_o, None, dot)

    graph, static_out = capture_cuda_graph(step)  # kernels compile outside the capture
    for replay in range(3):
        x.copy_(torch.randn_like(x))
        residual.copy_(torch.randn_like(residual))
        graph.replay()
        torch.cuda.synchronize()
        y, new_residual, z = static_out
        normed, ref_residual = rms_norm_reference(x, norm_w, EPS, residual)
        assert torch.equal(new_residual, ref_residual), f"seed={seed} replay {replay}"
        assert_linear_close(y, normed, weight, bias, seed, f"replay {replay}")
        assert_linear_close(z, y, w_o, None, seed, f"replay {replay}")
    assert_tickets_reset()


# ---- the attention layer ----


def tiny_attention(dtype: torch.dtype, num_heads: int = 4, head_dim: int = 16) -> tuple[Qwen3Attention, RMSNorm,
                                                                                        ModelConfig]:
    config = ModelConfig(architecture="Qwen3MoeForCausalLM", vocab_size=64, hidden_size=64, num_layers=1,
                         num_heads=num_heads, num_kv_heads=2, head_dim=head_dim, intermediate_size=64,
                         moe_intermediate_size=32,
                         num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, rms_norm_eps=EPS,
                         max_position_embeddings=64)  # fmt: skip
    attn = Qwen3Attention(config, 0, RotaryEmbedding(config.rope, config.head_dim, 64))
    norm = RMSNorm(config.hidden_size, EPS)
    with torch.no_grad():
        for module in (attn, norm):
            for p in module.parameters():
                p.copy_(torch.randn_like(p) * (0.2 if p.dim() == 2 else 0.3) + (1.0 if p.dim() == 1 else 0.0))
    return attn.to(DEVICE, dtype), norm.to(DEVICE, dtype), config


def decode_inputs(config: ModelConfig, dtype: torch.dtype):
    positions = [5, 11, 2]
    cache = KVCache(1, len(positions), 16, config.num_kv_heads, config.head_dim, dtype, DEVICE)
    cache.k.normal_()
    cache.v.normal_()
    batch = ForwardBatch.build(positions, [1] * len(positions), [2, 0, 1], DEVICE)
    x, residual = (torch.randn(2, len(positions), config.hidden_size) * 2).to(dtype).to(DEVICE).unbind(0)
    return batch, cache, x, residual


def clone_cache(cache: KVCache) -> KVCache:
    copy = KVCache(1, cache.num_slots, cache.max_len, cache.k.shape[3], cache.k.shape[4], cache.k.dtype, DEVICE)
    copy.k.copy_(cache.k)
    copy.v.copy_(cache.v)
    return copy


def assert_equal_but_int8_rounding(out: torch.Tensor, ref: torch.Tensor, residual: torch.Tensor,
                                   ref_residual: torch.Tensor, seed: int) -> None:
    """Residuals bit for bit; outputs bit for bit on the CPU. On the GPU the norm kernel compiled with its int8
    stores (ops.rms_norm_int8) can leave a float32 row an ulp apart from the plain norm kernel's (as the fused
    router does, benchmarks/RESULTS.md), and that ulp can move one int8 rounding of x (1 seed in 3 or 4): the
    outputs are then equal to within that rounding."""
    assert torch.equal(residual, ref_residual), f"seed={seed}"
    if DEVICE.type == "cpu":
        assert torch.equal(out, ref), f"seed={seed}"
    else:
        torch.testing.assert_close(out, ref, rtol=1e-3, atol=1e-3 * ref.abs().max().item(),
                                   msg=lambda m: f"seed={seed}: {m}")


def run_both(attn, norm, batch, cache, x, residual, backend):
    """(output, new residual, cache) of norm + forward and of forward_fused_norm, each on its own cache copy."""
    cache_ref, cache_fused = clone_cache(cache), clone_cache(cache)
    with torch.no_grad():
        h, ref_residual = norm.forward_with_residual(x, residual)
        ref = attn(h, batch, cache_ref)
        out, new_residual = attn.forward_fused_norm(x, residual, norm, batch, cache_fused, backend=backend)
    return (ref, ref_residual, cache_ref), (out, new_residual, cache_fused)


@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_forward_fused_norm(seed: int, dtype: torch.dtype, with_residual: bool) -> None:
    attn, norm, config = tiny_attention(dtype)
    batch, cache, x, residual = decode_inputs(config, dtype)
    residual = residual if with_residual else None
    (ref, ref_residual, cache_ref), (out, new_residual, cache_fused) = run_both(
        attn, norm, batch, cache, x, residual, backend="triton"
    )
    assert torch.equal(new_residual, ref_residual), f"seed={seed}"
    # float32: the same math in another summation order; bfloat16: q|k|v may round one ulp apart, which the
    # q/k norms, the softmax and o_proj carry through
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=5e-2, atol=5e-2)
    torch.testing.assert_close(out, ref, **tol, msg=lambda m: f"seed={seed}: {m}")
    torch.testing.assert_close(cache_fused.k, cache_ref.k, **tol, msg=lambda m: f"seed={seed} k cache: {m}")
    torch.testing.assert_close(cache_fused.v, cache_ref.v, **tol, msg=lambda m: f"seed={seed} v cache: {m}")


def test_attention_forward_fused_norm_falls_back(seed: int) -> None:
    """GGUF-block q|k|v weights, and the CPU default, take the unfused path: equal bit for bit on the CPU."""
    from moerun.formats.quants import QuantizedTensor
    from moerun.layers.quantized import QuantizedWeight, set_quantized

    attn, norm, config = tiny_attention(torch.float32)
    batch, cache, x, residual = decode_inputs(config, torch.float32)
    if DEVICE.type == "cpu":
        (ref, ref_res, _), (out, res, _) = run_both(attn, norm, batch, cache, x, residual, backend=None)
        assert torch.equal(out, ref) and torch.equal(res, ref_res), f"seed={seed}"
    blocks = QuantizedTensor.from_float(attn.qkv_proj.weight.detach(), "Q8_0")
    blocks = QuantizedTensor(blocks.raw.to(DEVICE), blocks.qtype, blocks.shape)
    set_quantized(attn.qkv_proj, "weight", QuantizedWeight([blocks]))
    (ref, ref_res, _), (out, res, _) = run_both(attn, norm, batch, cache, x, residual, backend="triton")
    assert_equal_but_int8_rounding(out, ref, res, ref_res, seed)


def test_attention_gguf_qkv_takes_int8_rows_from_the_norm(seed: int, monkeypatch) -> None:
    """GGUF q|k|v whose kernels round x to int8: the norm's kernel hands x over rounded (ops.rms_norm_int8), and
    the result is bit for bit that of the q|k|v kernels rounding it themselves."""
    from moerun import ops
    from moerun.formats.quants import QuantizedTensor
    from moerun.kernels.quant import matmul_quant
    from moerun.layers.linear import Linear
    from moerun.layers.quantized import QuantizedWeight, set_quantized

    attn, norm, config = tiny_attention(torch.float32)
    batch, cache, x, residual = decode_inputs(config, torch.float32)
    blocks = QuantizedTensor.from_float(attn.qkv_proj.weight.detach(), "Q8_0")
    set_quantized(attn.qkv_proj, "weight", QuantizedWeight([QuantizedTensor(blocks.raw.to(DEVICE), blocks.qtype,
                                                                            blocks.shape)]))  # fmt: skip
    int8_cfg = {"path": "gemv_v2", "BLOCK_N": 16 if DEVICE.type == "cuda" else 128, "BLOCK_K": 256, "num_warps": 4,
                "num_stages": 1, "x_q8": True}  # fmt: skip
    monkeypatch.setattr(matmul_quant, "get_matmul_config", lambda *args: int8_cfg)
    # the interpreter on the CPU, for the quantized matmul and for the norm of the path that rounds x in q|k|v
    monkeypatch.setattr("moerun.ops.quant.pick_backend", lambda *args: "triton")
    monkeypatch.setattr("moerun.ops.norm.pick_backend", lambda *args: "triton")
    calls = []
    norm_int8 = ops.rms_norm_int8
    monkeypatch.setattr(ops, "rms_norm_int8", lambda *args: calls.append(1) or norm_int8(*args))

    def run() -> tuple[torch.Tensor, torch.Tensor]:
        with torch.no_grad():
            return attn.forward_fused_norm(x, residual, norm, batch, clone_cache(cache), backend="triton")

    out, new_residual = run()
    assert calls == [1], "the norm did not hand over int8 rows"
    monkeypatch.setattr(Linear, "int8_input_pad", lambda self, x, backend=None: None)  # q|k|v rounds x itself
    ref, ref_residual = run()
    assert calls == [1]
    assert_equal_but_int8_rounding(out, ref, new_residual, ref_residual, seed)


@pytest.mark.skipif(DEVICE.type != "cuda", reason="decode attention runs its Triton kernel on CUDA only")
@pytest.mark.parametrize("head_dim", [16, 32], ids=["after-launch", "in-launch"])
def test_attention_gguf_o_proj_takes_int8_rows_from_attention(seed: int, head_dim: int, monkeypatch) -> None:
    """GGUF o_proj whose kernel rounds x to int8: decode attention hands its output over rounded
    (ops.decode_attention_int8; in its own launch where head_dim is a multiple of 32), bit for bit what o_proj
    computes rounding it itself."""
    from moerun import ops
    from moerun.formats.quants import QuantizedTensor
    from moerun.kernels.quant import matmul_quant
    from moerun.layers.linear import Linear
    from moerun.layers.quantized import QuantizedWeight, set_quantized

    attn, norm, config = tiny_attention(torch.float32, num_heads=8, head_dim=head_dim)
    batch, cache, x, residual = decode_inputs(config, torch.float32)
    blocks = QuantizedTensor.from_float(attn.o_proj.weight.detach(), "Q8_0")
    set_quantized(attn.o_proj, "weight", QuantizedWeight([QuantizedTensor(blocks.raw.to(DEVICE), blocks.qtype,
                                                                          blocks.shape)]))  # fmt: skip
    int8_cfg = {"path": "gemv_v2", "BLOCK_N": 16, "BLOCK_K": 256, "num_warps": 4, "num_stages": 1, "x_q8": True}
    monkeypatch.setattr(matmul_quant, "get_matmul_config", lambda *args: int8_cfg)
    calls = []
    attention_int8 = ops.decode_attention_int8
    monkeypatch.setattr(ops, "decode_attention_int8", lambda *args: calls.append(1) or attention_int8(*args))

    def run() -> torch.Tensor:
        with torch.no_grad():
            return attn.forward_fused_norm(x, residual, norm, batch, clone_cache(cache))[0]

    out = run()
    assert calls == [1], "attention did not hand over int8 rows"
    monkeypatch.setattr(Linear, "int8_input_pad", lambda self, x, backend=None: None)  # o_proj rounds x itself
    ref = run()
    assert calls == [1]
    assert torch.equal(out, ref), f"seed={seed}"
