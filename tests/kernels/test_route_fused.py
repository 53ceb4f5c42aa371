"""route_fused (add + RMSNorm + router GEMV + softmax/top-k in one kernel) against the unfused reference, and
SparseMoeBlock.forward_fused_norm against norm.forward_with_residual + forward."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from helpers import capture_cuda_graph

pytest.importorskip("triton")

from moerun.config import ModelConfig  # noqa: E402
from moerun.kernels.router_fused import (  # noqa: E402
    DEFAULT_CONFIG,
    INTERPRETER_CONFIG,
    SINGLE_TOKEN_CONFIG,
    FusedRouteConfig,
    default_config,
    route_fused_triton,
)
from moerun.kernels import tile_configs  # noqa: E402
from moerun.kernels.interpreter import interpreting  # noqa: E402
from moerun.kernels.tickets import ticket_counters  # noqa: E402
from moerun.layers.norm import RMSNorm  # noqa: E402
from moerun.moe import block as block_module  # noqa: E402
from moerun.moe.block import SparseMoeBlock  # noqa: E402
from moerun.ops import moe as moe_ops  # noqa: E402
from moerun.ops.moe_reference import route_fused_reference  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
EPS = 1e-6
# Two rounding steps of the dtype, relative: a normalised value may round the other way where the float32 sum of
# squares is added up in another order (one step of the value before the weight, which the product's own rounding
# can make two of the output: seen for float16 at 1.1e-3), and the router logits where their float32 sums round
# differently.
ULP = {torch.float32: 2e-6, torch.float16: 2e-3, torch.bfloat16: 8e-3}
# Routing probabilities closer than this (relative) count as tied: either may be picked first.
TIE = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}


def make_inputs(T: int, H: int, E: int, dtype: torch.dtype, with_residual: bool):
    """x, residual (or None), norm weight, gate weight, scaled so the router logits spread over a few units."""
    x = torch.randn(T, H).to(dtype).to(DEVICE)  # [T, H]
    residual = torch.randn(T, H).to(dtype).to(DEVICE) if with_residual else None  # [T, H]
    norm_weight = (1.0 + 0.2 * torch.randn(H)).to(dtype).to(DEVICE)  # [H]
    gate = (1.5 * torch.randn(E, H) / H**0.5).to(dtype).to(DEVICE)  # [E, H]
    return x, residual, norm_weight, gate


def check_routing(
    seed: int,
    weights: torch.Tensor,
    ids: torch.Tensor,
    x_normed: torch.Tensor,
    gate: torch.Tensor,
    k: int,
    renormalize: bool,
) -> None:
    """The picks are a top-k of the reference probabilities up to ties, in order, with matching weights."""
    T = ids.shape[0]
    tie = TIE[gate.dtype]
    logits = torch.nn.functional.linear(x_normed, gate)  # [T, E] in the model dtype
    probs = torch.softmax(logits.float(), dim=-1)  # [T, E]
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32 and ids.shape == weights.shape == (T, k)
    for row in ids.tolist():
        assert len(set(row)) == k, f"seed={seed}: repeated expert in {row}"
    picked = probs.gather(1, ids.long())  # [T, k] reference probabilities of the picked experts
    top = probs.topk(k, dim=-1).values  # [T, k]
    torch.testing.assert_close(picked, top, rtol=tie, atol=1e-7, msg=lambda m: f"seed={seed} picks: {m}")
    expected = picked / picked.sum(dim=-1, keepdim=True) if renormalize else picked
    torch.testing.assert_close(weights, expected, rtol=tie, atol=1e-6, msg=lambda m: f"seed={seed} weights: {m}")


def check_norm(seed: int, out, x, residual, norm_weight) -> None:
    """x_normed to one rounding step of ops.rms_norm's reference; the new residual bit-equal, in its own buffer."""
    from moerun.ops.norm import rms_norm_reference

    ref_normed, ref_residual = rms_norm_reference(x, norm_weight, EPS, residual)
    x_normed, residual_out = out[0], out[1]
    assert x_normed.dtype == residual_out.dtype == x.dtype
    assert torch.equal(residual_out, ref_residual), f"seed={seed}"
    if residual is not None:
        assert residual_out.data_ptr() not in (residual.data_ptr(), x.data_ptr())
    ulp = ULP[x.dtype]
    torch.testing.assert_close(
        x_normed.float(), ref_normed.float(), rtol=ulp, atol=ulp * 1e-2, msg=lambda m: f"seed={seed} normed: {m}"
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("with_residual", [True, False], ids=["residual", "no-residual"])
@pytest.mark.parametrize(
    "T,H,E,k,split,block_rows,renormalize",
    [
        (1, 72, 37, 1, 1, 0, True),  # one program per token
        (3, 72, 37, 2, 5, 2, False),  # 37 rows over 5 programs: 8 each, the last 5
        (8, 40, 37, 8, 4, 0, True),
        (3, 72, 7, 2, 16, 0, True),  # more programs asked than rows: one row each
        (3, 256, 128, 8, 16, 4, False),  # Qwen3's E and k
    ],
    ids=["T1-E37-k1-split1", "T3-E37-k2-split5", "T8-E37-k8-split4", "T3-E7-split16", "T3-E128-k8-split16"],
)
def test_route_fused_matches_reference(seed, T, H, E, k, split, block_rows, renormalize, with_residual, dtype):
    x, residual, norm_weight, gate = make_inputs(T, H, E, dtype, with_residual)
    cfg = FusedRouteConfig(split=split, block_rows=block_rows)
    out = route_fused_triton(x, residual, norm_weight, EPS, gate, k, renormalize, cfg)
    check_norm(seed, out, x, residual, norm_weight)
    check_routing(seed, out[2], out[3], out[0], gate, k, renormalize)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_single_token_config(seed, dtype) -> None:
    # a one-warp program per router row (the GPU default for one token), Qwen3's E and k
    assert default_config(2) == (INTERPRETER_CONFIG if interpreting() else DEFAULT_CONFIG)
    x, residual, norm_weight, gate = make_inputs(1, 256, 128, dtype, True)
    out = route_fused_triton(x, residual, norm_weight, EPS, gate, 8, True, SINGLE_TOKEN_CONFIG)
    check_norm(seed, out, x, residual, norm_weight)
    check_routing(seed, out[2], out[3], out[0], gate, 8, True)


@pytest.mark.parametrize("split", [1, 4])
def test_ticket_counters_reset_between_calls(seed, split) -> None:
    T, H, E, k = 3, 40, 13, 2  # noqa: E741
    cfg = FusedRouteConfig(split=split)
    for _ in range(2):  # the second call only routes right if the first left every ticket at zero
        x, residual, norm_weight, gate = make_inputs(T, H, E, torch.float32, True)
        out = route_fused_triton(x, residual, norm_weight, EPS, gate, k, True, cfg)
        ref = route_fused_reference(x, residual, norm_weight, EPS, gate, k, True)
        assert torch.equal(out[3], ref[3]), f"seed={seed}"
        torch.testing.assert_close(out[2], ref[2], msg=lambda m: f"seed={seed}: {m}")
    assert not ticket_counters(x.device, T, "route_fused").any()


def test_route_fused_dispatch(seed) -> None:
    T, H, E, k = 2, 40, 13, 3  # noqa: E741
    x, residual, norm_weight, gate = make_inputs(T, H, E, torch.float32, True)
    ref = route_fused_reference(x, residual, norm_weight, EPS, gate, k, True)
    for backend in ("torch", "triton"):
        out = moe_ops.route_fused(x, residual, norm_weight, EPS, gate, k, True, backend=backend)
        for got, want in zip(out, ref):
            torch.testing.assert_close(got, want, msg=lambda m: f"seed={seed} {backend}: {m}")
    with pytest.raises(ValueError, match="k must be"):
        moe_ops.route_fused(x, residual, norm_weight, EPS, gate, E + 1, True, backend="triton")


def test_route_fused_rejects_mismatched_weights() -> None:
    x = torch.randn(2, 40, device=DEVICE)
    with pytest.raises(ValueError, match="gate weight"):
        route_fused_triton(x, None, torch.ones(40, device=DEVICE), EPS, torch.randn(8, 32, device=DEVICE), 2, True)
    with pytest.raises(ValueError, match="norm weight"):
        route_fused_triton(x, None, torch.ones(40, device=DEVICE, dtype=torch.float16), EPS,
                           torch.randn(8, 40, device=DEVICE), 2, True)  # fmt: skip


def test_route_fused_empty_batch() -> None:
    x = torch.randn(0, 40, device=DEVICE)
    out = route_fused_triton(x, torch.randn(0, 40, device=DEVICE), torch.ones(40, device=DEVICE), EPS,
                             torch.randn(8, 40, device=DEVICE), 2, True)  # fmt: skip
    assert [tuple(t.shape) for t in out] == [(0, 40), (0, 40), (0, 2), (0, 2)]


# ---------------------------------------------------------------------------------------------------------------
# SparseMoeBlock.forward_fused_norm


def small_block(dtype: torch.dtype, backend: str = "triton") -> tuple[SparseMoeBlock, RMSNorm]:
    """A random MoE block (E=13, k=3, H=40, I=24) and its RMSNorm, on the test device."""
    cfg = ModelConfig(
        architecture="Qwen3MoeForCausalLM", vocab_size=32, hidden_size=40, num_layers=1, num_heads=2,
        num_kv_heads=1, head_dim=8, intermediate_size=64, moe_intermediate_size=24, num_experts=13,
        num_experts_per_tok=3, norm_topk_prob=True, rms_norm_eps=EPS, max_position_embeddings=64, dtype=dtype,
    )  # fmt: skip
    block = SparseMoeBlock(cfg, 0, backend=backend)
    norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
    with torch.no_grad():
        block.gate.weight.copy_(1.5 * torch.randn(13, 40) / 40**0.5)
        block.experts.w13.copy_(torch.randn(13, 48, 40) / 40**0.5)
        block.experts.w2.copy_(torch.randn(13, 40, 24) / 24**0.5)
        norm.weight.copy_(1.0 + 0.2 * torch.randn(40))
    return block.to(DEVICE, dtype), norm.to(DEVICE, dtype)


class RecordingExperts(nn.Module):
    """Stands in for an offloaded or quantized experts module: records its inputs, returns weight-scaled x."""

    def __init__(self, backend: str) -> None:
        super().__init__()
        self.backend = backend
        self.calls: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        self.calls.append((x, topk_weights, topk_ids))
        return x * topk_weights.sum(dim=-1, keepdim=True).to(x.dtype)


def unfused(block: SparseMoeBlock, norm: RMSNorm, x: torch.Tensor, residual: torch.Tensor | None):
    h, new_residual = norm.forward_with_residual(x, residual)
    return block(h), new_residual


@pytest.mark.parametrize("with_residual", [True, False], ids=["residual", "no-residual"])
@pytest.mark.parametrize("T", [1, 5])
def test_forward_fused_norm_matches_unfused(seed, monkeypatch, T, with_residual) -> None:
    block, norm = small_block(torch.float32)
    monkeypatch.setenv("MOERUN_TOPK_IN_GEMM1", "0")  # the router picks the routing (else the experts' GEMM 1 does)
    calls = []
    monkeypatch.setattr(block_module, "route_fused", lambda *a, **kw: calls.append(1) or moe_ops.route_fused(*a, **kw))
    x = torch.randn(T, 40, device=DEVICE)
    residual = torch.randn(T, 40, device=DEVICE) if with_residual else None
    out, new_residual = block.forward_fused_norm(x, residual, norm)
    ref, ref_residual = unfused(block, norm, x, residual)
    assert calls, "the fused routing kernel was not used"
    torch.testing.assert_close(new_residual, ref_residual, msg=lambda m: f"seed={seed}: {m}")
    torch.testing.assert_close(out, ref, rtol=2e-5, atol=2e-5, msg=lambda m: f"seed={seed}: {m}")


def test_forward_fused_norm_with_replaced_experts(seed) -> None:
    block, norm = small_block(torch.float32)
    block.experts = RecordingExperts("triton")
    x, residual = torch.randn(2, 40, device=DEVICE), torch.randn(2, 40, device=DEVICE)
    out, _ = block.forward_fused_norm(x, residual, norm)
    ref, _ = unfused(block, norm, x, residual)
    (h, w, ids), (ref_h, ref_w, ref_ids) = block.experts.calls
    assert torch.equal(ids, ref_ids), f"seed={seed}"
    torch.testing.assert_close(h, ref_h, msg=lambda m: f"seed={seed}: {m}")
    torch.testing.assert_close(w, ref_w, msg=lambda m: f"seed={seed}: {m}")
    torch.testing.assert_close(out, ref, msg=lambda m: f"seed={seed}: {m}")


def check_float32_sums_handed_on(block: SparseMoeBlock, norm: RMSNorm, x: torch.Tensor, residual: torch.Tensor,
                                 monkeypatch, module, getter: str, rounding: dict, summing: dict,
                                 seed: int) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """forward_fused_norm with ``module.getter`` returning a config whose output is rounded to bf16, then one whose
    output is float32 sums: the same residual, outputs equal but for the sums' order, and the next layer's norm on
    the float32 sums giving what it gives on their bf16 rounding, bit for bit. -> (the sums, the residual)."""
    outs = []
    for config in (rounding, summing):
        monkeypatch.setattr(module, getter, lambda *a, c=config, **kw: c)
        outs.append(block.forward_fused_norm(x, residual, norm))
    (out, res), (sums, sums_res) = outs
    assert out.dtype == torch.bfloat16 and sums.dtype == torch.float32
    assert torch.equal(res, sums_res), f"seed={seed}"
    torch.testing.assert_close(sums.to(torch.bfloat16), out, rtol=1e-2, atol=1e-2 * out.abs().max(),
                               msg=lambda m: f"seed={seed}: {m}")  # fmt: skip
    nxt = RMSNorm(sums.shape[1], EPS).to(DEVICE, torch.bfloat16)
    got = nxt.forward_with_residual(sums, sums_res)
    want = nxt.forward_with_residual(sums.to(torch.bfloat16), sums_res)
    assert all(torch.equal(a, b) for a, b in zip(got, want)), f"seed={seed}"
    return sums, sums_res


def test_quantized_experts_hand_float32_sums_to_the_next_norm(seed, monkeypatch) -> None:
    # Quantized experts whose GEMM 2 adds into a float32 buffer (config key sum2 = "atomic") return it unrounded
    # from forward_fused_norm; the next norm rounds it as the cast of the other configs does, so the next layer's
    # input is the same but for the slot sums' float32 order.
    from moerun.formats.quants import QuantType
    from moerun.kernels.quant import fused_moe_quant as quant_module
    from moerun.kernels.quant.configs import normalize_config
    from moerun.kernels.quant.synthetic import random_quantized
    from moerun.layers.quantized import QuantizedWeight

    H, I, E, k = 256, 256, 6, 2  # noqa: E741
    cfg = ModelConfig(
        architecture="Qwen3MoeForCausalLM", vocab_size=32, hidden_size=H, num_layers=1, num_heads=2, num_kv_heads=1,
        head_dim=8, intermediate_size=64, moe_intermediate_size=I, num_experts=E, num_experts_per_tok=k,
        norm_topk_prob=True, rms_norm_eps=EPS, max_position_embeddings=64, dtype=torch.bfloat16,
    )  # fmt: skip
    block = SparseMoeBlock(cfg, 0, backend="triton").to(DEVICE, torch.bfloat16)
    norm = RMSNorm(H, EPS).to(DEVICE, torch.bfloat16)
    with torch.no_grad():
        block.gate.weight.copy_(torch.randn(E, H) / H**0.5)
    block.experts.q_w13 = QuantizedWeight([random_quantized(QuantType.Q4_K, (E, I, H), DEVICE) for _ in range(2)])
    block.experts.q_w2 = QuantizedWeight([random_quantized(QuantType.Q6_K, (E, H, I), DEVICE)])
    plain = {"path": "gemv_v2", "BLOCK_N": 16 if DEVICE.type == "cuda" else 256, "BLOCK_K": 256, "num_warps": 4,
             "BLOCK_N2": 8 if DEVICE.type == "cuda" else 256, "BLOCK_K2": 256, "num_warps2": 4, "x_q8": True}
    x, residual = (torch.randn(1, H, device=DEVICE).to(torch.bfloat16) for _ in range(2))
    check_float32_sums_handed_on(block, norm, x, residual, monkeypatch, quant_module, "get_moe_config",
                                 normalize_config(plain), normalize_config({**plain, "sum2": "atomic"}), seed)


def test_dense_experts_hand_float32_sums_to_the_next_norm(seed, monkeypatch) -> None:
    # bf16 experts on the gemv path's atomic reduce return GEMM 2's float32 sums unrounded from forward_fused_norm;
    # the next norm, alone or in front of q|k|v (rms_norm_linear), rounds them as the cast would.
    from moerun.kernels import fused_moe as dense_module
    from moerun.ops.linear import rms_norm_linear

    block, norm = small_block(torch.bfloat16)
    x, residual = (torch.randn(1, 40, device=DEVICE).to(torch.bfloat16) for _ in range(2))
    atomic = {"path": "gemv", "BLOCK_N": 16, "BLOCK_K": 32, "BLOCK_N2": 16, "BLOCK_K2": 32, "reduce": "atomic"}
    atomic_out, atomic_res = check_float32_sums_handed_on(
        block, norm, x, residual, monkeypatch, dense_module, "get_config",
        tile_configs.normalize({**atomic, "reduce": "sum"}), tile_configs.normalize(atomic), seed)
    qkv = (torch.randn(24, 40) / 40**0.5).to(torch.bfloat16).to(DEVICE)
    norm_w = (1.0 + 0.2 * torch.randn(40)).to(torch.bfloat16).to(DEVICE)
    got = rms_norm_linear(atomic_out, atomic_res, norm_w, EPS, qkv, backend="triton")
    want = rms_norm_linear(atomic_out.to(torch.bfloat16), atomic_res, norm_w, EPS, qkv, backend="triton")
    assert all(torch.equal(a, b) for a, b in zip(got, want)), f"seed={seed}"


@pytest.mark.parametrize("case", ["many-tokens", "torch-backend"])
def test_forward_fused_norm_falls_back(seed, monkeypatch, case) -> None:
    block, norm = small_block(torch.float32, backend="torch" if case == "torch-backend" else "triton")
    monkeypatch.setattr(block_module, "route_fused", lambda *a, **kw: pytest.fail("route_fused was used"))
    T = moe_ops.ROUTE_FUSED_MAX_TOKENS + 1 if case == "many-tokens" else 2
    x, residual = torch.randn(T, 40, device=DEVICE), torch.randn(T, 40, device=DEVICE)
    out, new_residual = block.forward_fused_norm(x, residual, norm)
    ref, ref_residual = unfused(block, norm, x, residual)
    torch.testing.assert_close(new_residual, ref_residual, msg=lambda m: f"seed={seed}: {m}")
    torch.testing.assert_close(out, ref, msg=lambda m: f"seed={seed}: {m}")


# ---------------------------------------------------------------------------------------------------------------
# CUDA only: capture in a CUDA graph and replay with new inputs (the tickets must be back at zero every time).


@pytest.mark.skipif(DEVICE.type != "cuda", reason="needs CUDA")
@pytest.mark.parametrize("split", [1, 16])
def test_cuda_graph_capture_and_replay(seed, split) -> None:
    T, H, E, k = 4, 2048, 128, 8  # noqa: E741
    x, residual, norm_weight, gate = make_inputs(T, H, E, torch.bfloat16, True)
    cfg = FusedRouteConfig(split=split)

    def step():
        return route_fused_triton(x, residual, norm_weight, EPS, gate, k, True, cfg)

    graph, out = capture_cuda_graph(step)  # kernels compile outside the capture
    for _ in range(3):
        x.copy_(torch.randn(T, H, device=DEVICE))
        residual.copy_(torch.randn(T, H, device=DEVICE))
        graph.replay()
        torch.cuda.synchronize()
        check_norm(seed, out, x, residual, norm_weight)
        check_routing(seed, out[2], out[3], out[0], gate, k, True)


# x rounded to int8 for quantized experts (route_fused_int8)


@pytest.mark.parametrize("H", [40, 512, 600])  # 600: a slice of 512 values a program past the row's 768
@pytest.mark.parametrize("split", [1, 2, 3, 16])  # each program rounds a slice of the row; 3: the last one none
def test_route_fused_int8_rows_are_the_quantized_normed_rows(seed, H, split) -> None:
    from moerun.kernels.quant.int8_dot import quantize_x
    from moerun.kernels.quant.repack import padded_k
    from moerun.kernels.router_fused import FusedRouteConfig, route_fused_int8_triton, route_fused_triton

    x, residual, norm_weight, gate = make_inputs(3, H, 16, torch.bfloat16, True)
    cfg = FusedRouteConfig(split=split)
    *routed, rows = route_fused_int8_triton(x, residual, norm_weight, EPS, gate, 4, True, padded_k(H), cfg)
    ref = route_fused_triton(x, residual, norm_weight, EPS, gate, 4, True, cfg)
    for got, want in zip(routed, ref):
        assert torch.equal(got, want), f"seed={seed}"
    for got, want in zip(rows, quantize_x(routed[0], padded_k(H))):
        assert torch.equal(got, want), f"seed={seed}"


def quantized_block(qtype: str, H: int, I: int,  # noqa: E741
                    dtype: torch.dtype = torch.float32) -> tuple[SparseMoeBlock, RMSNorm]:  # fmt: skip
    """A MoE block (E = 6, k = 2) of dtype with random quantized experts of qtype, and its RMSNorm, on the device."""
    from moerun.kernels.quant.synthetic import random_quantized
    from moerun.layers.quantized import QuantizedWeight, set_quantized

    E = 6
    cfg = ModelConfig(
        architecture="Qwen3MoeForCausalLM", vocab_size=32, hidden_size=H, num_layers=1, num_heads=2,
        num_kv_heads=1, head_dim=8, intermediate_size=64, moe_intermediate_size=I, num_experts=E,
        num_experts_per_tok=2, norm_topk_prob=True, rms_norm_eps=EPS, max_position_embeddings=64, dtype=dtype,
    )  # fmt: skip
    block = SparseMoeBlock(cfg, 0, backend="triton").to(DEVICE, dtype)
    norm = RMSNorm(H, EPS).to(DEVICE, dtype)
    with torch.no_grad():
        block.gate.weight.copy_(torch.randn(E, H) / H**0.5)
        norm.weight.copy_(1.0 + 0.2 * torch.randn(H))
    w13 = QuantizedWeight([random_quantized(qtype, (E, I, H), DEVICE), random_quantized(qtype, (E, I, H), DEVICE)])
    set_quantized(block.experts, "w13", w13)
    set_quantized(block.experts, "w2", QuantizedWeight([random_quantized(qtype, (E, H, I), DEVICE)]))
    return block, norm


def test_quantized_experts_take_int8_rows_from_the_router(seed, monkeypatch) -> None:
    """Quantized experts whose kernels round x to int8 get it rounded by the fused router's kernel: the same int8
    rows as they compute themselves (test_route_fused_int8_rows_are_the_quantized_normed_rows), so the same output
    up to the float32 rounding of the routing weights (compiled with the int8 stores, the kernel's weights can
    differ in the last bit on the GPU)."""
    from moerun.kernels.quant import fused_moe_quant
    from moerun.moe.experts import Experts

    H = 64
    block, norm = quantized_block("Q8_0", H, 32)  # (Q8_0 rows: multiples of 32)
    int8_cfg = fused_moe_quant.normalize_config({"path": "gemv_v2", "BLOCK_N": 16 if DEVICE.type == "cuda" else 64,
                                                 "BLOCK_K": 256, "BLOCK_N2": 16, "BLOCK_K2": 256, "x_q8": True})
    monkeypatch.setattr(fused_moe_quant, "get_moe_config", lambda *args: int8_cfg)
    monkeypatch.setenv("MOERUN_TOPK_IN_GEMM1", "0")  # the router picks the routing (else the experts' GEMM 1 does)
    calls = []
    monkeypatch.setattr(block_module, "route_fused_int8",
                        lambda *a: calls.append(1) or moe_ops.route_fused_int8(*a))  # fmt: skip
    x, residual = torch.randn(2, H, device=DEVICE), torch.randn(2, H, device=DEVICE)
    out, new_residual = block.forward_fused_norm(x, residual, norm)
    assert calls == [1], "the router did not hand over int8 rows"
    monkeypatch.setattr(Experts, "int8_input_pad", lambda self, x, k: None)  # the experts round x themselves
    ref, ref_residual = block.forward_fused_norm(x, residual, norm)
    assert calls == [1]
    assert torch.equal(new_residual, ref_residual), f"seed={seed}"
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6, msg=lambda m: f"seed={seed}: {m}")


# ---------------------------------------------------------------------------------------------------------------
# The routing picked by the experts' GEMM 1 from the router's logits (MOERUN_TOPK_IN_GEMM1, fused_moe's select)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("T", [1, 3])
def test_route_fused_logits_are_the_routers(seed, dtype, T) -> None:
    # the logits-only launch computes what route_fused picks from: its top-k of them is route_fused's routing, and
    # its normed rows and new residual are route_fused's, bit for bit
    from moerun.kernels.router_fused import route_fused_logits_triton
    from moerun.ops.moe_reference import route_reference

    x, residual, norm_weight, gate = make_inputs(T, 72, 37, dtype, True)
    normed, res_out, logits = route_fused_logits_triton(x, residual, norm_weight, EPS, gate)
    want = route_fused_triton(x, residual, norm_weight, EPS, gate, 4, True)
    assert logits.dtype == torch.float32 and logits.shape == (T, 37)
    assert torch.equal(normed, want[0]) and torch.equal(res_out, want[1]), f"seed={seed}"
    assert torch.equal(logits, logits.to(dtype).float()), f"seed={seed}: logits not rounded to the model dtype"
    weights, ids = route_reference(logits, 4, True)
    probs = torch.softmax(logits, dim=-1)  # [T, E]: bf16 logits tie often, and torch.topk orders ties its own way
    assert torch.equal(probs.gather(1, ids.long()), probs.gather(1, want[3].long())), f"seed={seed}"
    torch.testing.assert_close(weights, want[2], rtol=1e-6, atol=1e-7, msg=lambda m: f"seed={seed}: {m}")
    ref = moe_ops.route_fused_logits(x, residual, norm_weight, EPS, gate, backend="torch")
    check_norm(seed, ref, x, residual, norm_weight)
    # a normed value an ulp off moves a logit by about an ulp of the largest: a bound on the scale of the logits
    torch.testing.assert_close(logits, ref[2], rtol=ULP[dtype], atol=ULP[dtype] * float(ref[2].abs().max()),
                               msg=lambda m: f"seed={seed} logits: {m}")  # fmt: skip


@pytest.mark.parametrize("config", ["gemv-atomic", "gemv-sum", "gemv-fused", "tile"])
@pytest.mark.parametrize("T", [1, 2])
@pytest.mark.parametrize("keyed", [False, True], ids=["float", "bf16-keys"])
def test_gemm1_picks_the_routers_top_k(seed, config, T, keyed) -> None:
    # fused_moe with select: the gemv path's GEMM 1 picks the routing from the logits and writes it (other paths
    # have it written first); the same routing and the same output as the router's picks handed in (keyed: told
    # that the logits are bfloat16 values, GEMM 1 orders them by one key a column)
    from moerun.kernels.fused_moe import fused_moe_triton
    from moerun.kernels.router_fused import route_fused_logits_triton
    from moerun.kernels.topk_select import TopkSelect

    configs = {
        "gemv-atomic": {"path": "gemv", "BLOCK_N": 16, "BLOCK_K": 32, "BLOCK_N2": 16, "BLOCK_K2": 32,
                        "reduce": "atomic"},
        "gemv-sum": {"path": "gemv", "BLOCK_N": 16, "BLOCK_K": 32, "BLOCK_N2": 16, "BLOCK_K2": 32, "reduce": "sum"},
        "gemv-fused": {"path": "gemv", "BLOCK_N": 16, "BLOCK_K": 32, "BLOCK_N2": 16, "BLOCK_K2": 16,
                       "reduce": "fused"},
        "tile": {"path": "tile", "BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 32},
    }  # fmt: skip
    block, norm = small_block(torch.bfloat16)
    x, residual = (torch.randn(T, 40, device=DEVICE).to(torch.bfloat16) for _ in range(2))
    w13, w2 = block.experts.w13, block.experts.w2
    normed, _, logits = route_fused_logits_triton(x, residual, norm.weight, EPS, block.gate.weight)
    _, _, want_w, want_ids = route_fused_triton(x, residual, norm.weight, EPS, block.gate.weight, 3, True)
    cfg = tile_configs.normalize(configs[config])
    want = fused_moe_triton(normed, w13, w2, want_w, want_ids, config=cfg)
    weights = torch.full((T, 3), -1.0, device=DEVICE)
    ids = torch.full((T, 3), -1, dtype=torch.int32, device=DEVICE)
    got = fused_moe_triton(normed, w13, w2, weights, ids, config=cfg, select=TopkSelect(logits, True, bf16=keyed))
    assert torch.equal(ids, want_ids), f"seed={seed}: {ids.tolist()} against {want_ids.tolist()}"
    torch.testing.assert_close(weights, want_w, rtol=1e-6, atol=1e-7, msg=lambda m: f"seed={seed}: {m}")
    if config != "tile" or interpreting():  # the tile path's atomics add in no fixed order on a GPU
        torch.testing.assert_close(got, want, rtol=0 if interpreting() else 1e-2, atol=0 if interpreting() else 1e-3,
                                   msg=lambda m: f"seed={seed}: {m}")  # fmt: skip


def test_topk_select_checks_its_buffers() -> None:
    from moerun.kernels.fused_moe import fused_moe_triton
    from moerun.kernels.topk_select import TopkSelect

    block, _ = small_block(torch.bfloat16)
    x = torch.randn(1, 40, device=DEVICE).to(torch.bfloat16)
    logits = torch.randn(1, 13, device=DEVICE)
    w13, w2 = block.experts.w13, block.experts.w2
    ok_w, ok_ids = torch.empty(1, 3, device=DEVICE), torch.empty(1, 3, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="logits must be"):
        fused_moe_triton(x, w13, w2, ok_w, ok_ids, select=TopkSelect(logits[:, :12], True))
    with pytest.raises(ValueError, match="buffers"):
        fused_moe_triton(x, w13, w2, ok_w, ok_ids.long(), select=TopkSelect(logits, True))


@pytest.mark.parametrize("T", [1, 4])
def test_block_with_the_top_k_in_gemm1_matches_the_router_path(seed, monkeypatch, T) -> None:
    # MOERUN_TOPK_IN_GEMM1=1: dense experts take the router's logits and pick in GEMM 1; the same block output
    calls = []
    monkeypatch.setattr(block_module, "route_fused_logits",
                        lambda *a, **kw: calls.append(1) or moe_ops.route_fused_logits(*a, **kw))  # fmt: skip
    block, norm = small_block(torch.bfloat16)
    x, residual = (torch.randn(T, 40, device=DEVICE).to(torch.bfloat16) for _ in range(2))
    monkeypatch.setenv("MOERUN_TOPK_IN_GEMM1", "0")
    want, want_res = block.forward_fused_norm(x, residual, norm)
    assert not calls
    monkeypatch.delenv("MOERUN_TOPK_IN_GEMM1")  # by default for one token only (TOPK_IN_GEMM1_MAX_TOKENS)
    assert block._selects_in_experts(T) == (T <= block_module.TOPK_IN_GEMM1_MAX_TOKENS)
    monkeypatch.setenv("MOERUN_TOPK_IN_GEMM1", "1")  # at any token count the fused router takes
    got, got_res = block.forward_fused_norm(x, residual, norm)
    assert calls, "the logits-only router was not used"
    assert torch.equal(got_res, want_res), f"seed={seed}"
    if interpreting():  # one float32 summation order everywhere
        assert torch.equal(got, want), f"seed={seed}"
    else:  # GEMM 2's float32 atomics add in no fixed order
        torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-3, msg=lambda m: f"seed={seed}: {m}")
    # the torch path of ops.fused_moe writes the picks first, by the router's reference
    from moerun.kernels.topk_select import TopkSelect

    normed, _, logits = moe_ops.route_fused_logits(x, residual, norm.weight, EPS, block.gate.weight, backend="torch")
    weights = torch.empty(T, 3, device=DEVICE)
    ids = torch.empty(T, 3, dtype=torch.int32, device=DEVICE)
    got_torch = moe_ops.fused_moe(normed, block.experts.w13, block.experts.w2, weights, ids, backend="torch",
                                  select=TopkSelect(logits, True))  # fmt: skip
    ref, _ = unfused(block, norm, x, residual)
    want_w, want_ids = moe_ops.route_reference(logits, 3, True)
    assert torch.equal(ids, want_ids) and torch.equal(weights, want_w), f"seed={seed}"
    torch.testing.assert_close(got_torch.float(), ref.float(), rtol=2e-2, atol=2e-2, msg=lambda m: f"seed={seed}: {m}")


@pytest.mark.parametrize("qtype, dtype", [("Q4_K", torch.float32), ("Q8_0", torch.float32), ("Q4_K", torch.bfloat16)],
                         ids=str)  # fmt: skip
@pytest.mark.parametrize("path", ["gemv_v2", "tile"])
def test_quantized_experts_pick_the_routers_top_k(seed, monkeypatch, qtype, dtype, path) -> None:
    # MOERUN_TOPK_IN_GEMM1=1 on quantized experts: the router stops at its logits (still rounding the normed rows
    # to int8 for them) and gemv_v2's GEMM 1 picks the routing (other paths get it written first); the same output
    # (bfloat16: GEMM 1 orders the logits by one key a column)
    from moerun.kernels.quant import fused_moe_quant

    H = 256
    block, norm = quantized_block(qtype, H, 256, dtype)  # (K-quant rows: multiples of 256)
    configs = {"gemv_v2": {"path": "gemv_v2", "BLOCK_N": 16 if DEVICE.type == "cuda" else 64, "BLOCK_K": 256,
                           "BLOCK_N2": 16, "BLOCK_K2": 256, "x_q8": True},
               "tile": {"path": "tile", "BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 256}}  # fmt: skip
    chosen = fused_moe_quant.normalize_config(configs[path])
    monkeypatch.setattr(fused_moe_quant, "get_moe_config", lambda *args: chosen)
    calls = []
    monkeypatch.setattr(block_module, "route_fused_int8_logits",
                        lambda *a: calls.append(1) or moe_ops.route_fused_int8_logits(*a))  # fmt: skip
    x, residual = torch.randn(2, H, device=DEVICE, dtype=dtype), torch.randn(2, H, device=DEVICE, dtype=dtype)
    monkeypatch.setenv("MOERUN_TOPK_IN_GEMM1", "0")
    want, want_res = block.forward_fused_norm(x, residual, norm)
    monkeypatch.setenv("MOERUN_TOPK_IN_GEMM1", "1")
    got, got_res = block.forward_fused_norm(x, residual, norm)
    assert calls == ([1] if path == "gemv_v2" else []), calls  # the tile config does not round x to int8
    assert torch.equal(got_res, want_res), f"seed={seed}"
    if interpreting():
        assert torch.equal(got, want), f"seed={seed}"
    else:  # atomics add in no fixed order
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=lambda m: f"seed={seed}: {m}")
