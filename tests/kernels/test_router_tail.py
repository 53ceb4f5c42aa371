"""The decode routing as the tail of the o_proj GEMV (router_fused.RouterTail): extra programs of the GEMV's launch
route its output once the GEMV's programs are done. Against the GEMV followed by the fused router's own launch
(route_fused_triton / route_fused_int8_triton), bit for bit under the same router split, for the dense GEMV
(kernels/gemv.py, with and without a split of K) and the quantized one (quant/matmul_v2.py)."""

from __future__ import annotations

import importlib

import pytest
import torch

pytest.importorskip("triton")

from moerun.formats.quants import QuantType  # noqa: E402
from moerun.kernels.gemv import GemvConfig, linear_triton  # noqa: E402
from moerun.kernels.quant import matmul_quant  # noqa: E402
from moerun.kernels.quant.int8_dot import unpack_xq  # noqa: E402
from moerun.kernels.quant.matmul_quant import one_v2_launch, quant_matmul_triton  # noqa: E402
from moerun.kernels.quant.repack import pack, padded_k  # noqa: E402
from moerun.kernels.quant.synthetic import random_quantized  # noqa: E402
from moerun.kernels.router_fused import (  # noqa: E402
    FusedRouteConfig, RouterTail, route_fused_int8_triton, route_fused_triton,
)
from moerun.kernels.tickets import ticket_counters  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
EPS = 1e-6
E, TOP_K = 16, 4
INT8 = {"path": "gemv_v2", "BLOCK_N": 16, "BLOCK_K": 256, "num_warps": 4, "num_stages": 1, "x_q8": True}
PLAIN = {"path": "gemv_v2", "BLOCK_N": 16, "BLOCK_K": 256, "num_warps": 2, "num_stages": 1}


def _router(H: int, T: int):
    """residual [T, H], norm weight [H], gate [E, H] scaled so the logits spread over a few units."""
    residual = torch.randn(T, H, device=DEVICE).bfloat16()
    norm_w = (1 + 0.2 * torch.randn(H, device=DEVICE)).bfloat16()
    gate = (1.5 * torch.randn(E, H, device=DEVICE) / H**0.5).bfloat16()
    return residual, norm_w, gate


def _check_against_router(y: torch.Tensor, tail: RouterTail, residual: torch.Tensor, norm_w: torch.Tensor,
                          gate: torch.Tensor, split: int, num_warps: int, renormalize: bool) -> None:  # fmt: skip
    """The tail's outputs equal the fused router's on the GEMV's output y, under the same split and warps: bit for
    bit in the interpreter. On a GPU the tail's code is compiled with the GEMV's float contraction (the router's
    own kernel without), so its norm and logits may round an ulp apart: the normed rows (and their int8 codes) to
    one step, the picks a top-k of the router's probabilities up to ties."""
    cfg = FusedRouteConfig(split=split, num_warps=num_warps)
    if tail.rows is None:
        ref = route_fused_triton(y, residual, norm_w, EPS, gate, TOP_K, renormalize, cfg)
    else:
        ref = route_fused_int8_triton(y, residual, norm_w, EPS, gate, TOP_K, renormalize, tail.rows.k_pad, cfg)
    assert torch.equal(tail.residual_out, ref[1]), "new residual"
    assert not ticket_counters(DEVICE, 2 * y.shape[0], "router_tail").any(), "the tail's counters reset"
    assert not ticket_counters(DEVICE, y.shape[0], "route_fused").any(), "the top-k tickets reset"
    if DEVICE.type == "cpu":
        assert torch.equal(tail.normed, ref[0]), "normed rows"
        assert torch.equal(tail.weights, ref[2]), "routing weights"
        assert torch.equal(tail.ids, ref[3]), "expert ids"
        if tail.rows is not None:
            for got, want in zip(tail.rows, ref[4]):
                assert torch.equal(got, want), "int8 rows"
        return
    torch.testing.assert_close(tail.normed.float(), ref[0].float(), rtol=8e-3, atol=1e-3)
    probs = torch.softmax(torch.nn.functional.linear(ref[0], gate).float(), dim=-1)  # [T, E]
    picked, top = probs.gather(1, tail.ids.long()), probs.topk(TOP_K, dim=-1).values  # [T, k]
    torch.testing.assert_close(picked, top, rtol=3e-2, atol=1e-6)
    expected = picked / picked.sum(dim=-1, keepdim=True) if renormalize else picked
    torch.testing.assert_close(tail.weights, expected, rtol=3e-2, atol=1e-6)
    if tail.rows is not None:
        got, want = (unpack_xq(r.xq).int() for r in (tail.rows, ref[4]))
        assert (got - want).abs().max() <= 1, "int8 codes more than a step apart"


@pytest.mark.parametrize("split_k", [1, 2], ids=["whole_k", "split_k2"])
@pytest.mark.parametrize("T", [1, 3])
@pytest.mark.parametrize("int8", [False, True], ids=["bf16_rows", "int8_rows"])
def test_dense_gemv_tail_equals_gemv_then_router(seed, T: int, split_k: int, int8: bool) -> None:
    K, H, split = 256, 128, 4
    x = torch.randn(T, K, device=DEVICE).bfloat16()
    w = (torch.randn(H, K, device=DEVICE) / K**0.5).bfloat16()
    residual, norm_w, gate = _router(H, T)
    cfg = GemvConfig(block_n=16, block_k=64, split_k=split_k, num_warps=2)
    renorm = bool(seed % 2)
    tail = RouterTail.empty(T, x, norm_w, EPS, gate, TOP_K, renorm, k_pad=padded_k(H) if int8 else None,
                            config=FusedRouteConfig(split=split, num_warps=2)).with_residual(residual)
    y = linear_triton(x, w, config=cfg, tail=tail)
    assert torch.equal(y, linear_triton(x, w, config=cfg)), f"seed={seed}: the GEMV's own output"
    _check_against_router(y, tail, residual, norm_w, gate, split, 2, renorm)
    again = RouterTail.empty(T, x, norm_w, EPS, gate, TOP_K, renorm, k_pad=padded_k(H) if int8 else None,
                             config=FusedRouteConfig(split=split, num_warps=2)).with_residual(residual)
    linear_triton(x, w, config=cfg, tail=again)  # the counters left at 0 serve the next launch
    assert torch.equal(again.ids, tail.ids) and torch.equal(again.weights, tail.weights)


@pytest.mark.parametrize("config", [INT8, PLAIN], ids=["int8_x", "bf16_x"])
@pytest.mark.parametrize("M", [1, 2])
@pytest.mark.parametrize("qtype", [QuantType.Q4_K, QuantType.Q6_K, QuantType.Q8_0])
def test_quant_gemv_tail_equals_gemv_then_router(seed, monkeypatch, qtype: QuantType, M: int, config: dict) -> None:
    monkeypatch.setattr(matmul_quant, "get_matmul_config", lambda *args: config)
    K, H, split = 256, 128, 4
    part = pack(random_quantized(qtype, (H, K), DEVICE))
    assert one_v2_launch([part], M)
    x = torch.randn(M, K, device=DEVICE).bfloat16()
    residual, norm_w, gate = _router(H, M)
    tail = RouterTail.empty(M, x, norm_w, EPS, gate, TOP_K, True, k_pad=padded_k(H),
                            config=FusedRouteConfig(split=split, num_warps=config["num_warps"]))
    tail = tail.with_residual(residual)
    y = quant_matmul_triton(x, [part], tail=tail)
    assert torch.equal(y, quant_matmul_triton(x, [part])), f"seed={seed}: the GEMV's own output"
    _check_against_router(y, tail, residual, norm_w, gate, split, config["num_warps"], True)


def test_tail_refusals(monkeypatch) -> None:
    x = torch.randn(1, 256, device=DEVICE).bfloat16()
    residual, norm_w, gate = _router(128, 1)
    with pytest.raises(ValueError, match="norm weight"):
        RouterTail.empty(1, x, norm_w[:64], EPS, gate, TOP_K, True)
    with pytest.raises(ValueError, match="k must be"):
        RouterTail.empty(1, x, norm_w, EPS, gate, E + 1, True)
    tail = RouterTail.empty(1, x, norm_w, EPS, gate, TOP_K, True)
    with pytest.raises(ValueError, match="residual must be"):
        tail.with_residual(residual[:, :64])
    with pytest.raises(ValueError, match="with_residual before the launch"):
        linear_triton(x, torch.randn(128, 256, device=DEVICE).bfloat16(), tail=tail)
    tail = tail.with_residual(residual)
    w_other = torch.randn(96, 256, device=DEVICE).bfloat16()  # an output of 96 columns, the router wants 128
    with pytest.raises(ValueError, match="routes rows of"):
        linear_triton(x, w_other, tail=tail)
    monkeypatch.setattr(matmul_quant, "get_matmul_config", lambda *args: INT8)
    part = pack(random_quantized(QuantType.Q4_K, (128, 256), DEVICE))
    with pytest.raises(ValueError, match="own config"):
        quant_matmul_triton(x, [part], config=INT8, tail=tail)


# ---- in the decoder layer ----


def _tiny_layer(monkeypatch, o_proj: str):
    """A float32 Qwen3-MoE decoder layer (MoE block on the Triton backend) whose o_proj runs the Triton GEMV (the
    interpreter on the CPU): dense, or Q8_0 blocks read by an int8-x gemv_v2 config."""
    from moerun.config import ModelConfig
    from moerun.formats.quants import QuantizedTensor
    from moerun.layers.quantized import QuantizedWeight, set_quantized
    from moerun.layers.rotary import RotaryEmbedding
    from moerun.models.qwen3_moe import Qwen3MoeDecoderLayer

    config = ModelConfig(architecture="Qwen3MoeForCausalLM", vocab_size=64, hidden_size=64, num_layers=1,
                         num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=64, moe_intermediate_size=32,
                         num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, rms_norm_eps=EPS,
                         max_position_embeddings=64)  # fmt: skip
    layer = Qwen3MoeDecoderLayer(config, 0, RotaryEmbedding(config.rope, config.head_dim, 64), "triton")
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn_like(p) * (0.2 if p.dim() >= 2 else 0.3) + (1.0 if p.dim() == 1 else 0.0))
    layer = layer.to(DEVICE)
    # the module, not ops.linear the function of the same name
    monkeypatch.setattr(importlib.import_module("moerun.ops.linear"), "pick_backend", lambda *args: "triton")
    if o_proj == "Q8_0":
        blocks = QuantizedTensor.from_float(layer.self_attn.o_proj.weight.detach().cpu(), "Q8_0")
        set_quantized(layer.self_attn.o_proj, "weight", QuantizedWeight([QuantizedTensor(
            blocks.raw.to(DEVICE), blocks.qtype, blocks.shape)]))  # fmt: skip
        monkeypatch.setattr(matmul_quant, "get_matmul_config", lambda *args: INT8)
        monkeypatch.setattr("moerun.ops.quant.pick_backend", lambda *args: "triton")
    return layer, config


@pytest.mark.parametrize("o_proj", ["dense", "Q8_0"])
def test_decoder_layer_routes_in_the_o_proj_launch(seed, monkeypatch, o_proj: str) -> None:
    """MOERUN_ROUTER_TAIL=1: the layer's MoE block takes its routing from o_proj's launch (no route_fused launch),
    with the output and residual of the router's own launch, bit for bit in the interpreter."""
    from moerun.engine.batch import ForwardBatch
    from moerun.engine.kv_cache import KVCache
    from moerun.moe import block as block_module

    layer, config = _tiny_layer(monkeypatch, o_proj)
    cache = KVCache(1, 3, 16, config.num_kv_heads, config.head_dim, torch.float32, DEVICE)
    cache.k.normal_()
    cache.v.normal_()
    batch = ForwardBatch.build([5, 11, 2], [1, 1, 1], [2, 0, 1], DEVICE)
    x, residual = (torch.randn(2, 3, config.hidden_size, device=DEVICE) * 2).unbind(0)
    calls = []
    for name in ("route_fused", "route_fused_int8"):
        op = getattr(block_module, name)
        monkeypatch.setattr(block_module, name, lambda *a, op=op, **kw: calls.append(1) or op(*a, **kw))

    def run() -> tuple[torch.Tensor, torch.Tensor]:
        copy = KVCache(1, 3, 16, config.num_kv_heads, config.head_dim, torch.float32, DEVICE)
        copy.k.copy_(cache.k)
        copy.v.copy_(cache.v)
        with torch.no_grad():
            return layer(x, residual, batch, copy)

    ref, ref_residual = run()
    assert calls == [1], "the router ran in its own launch"
    monkeypatch.setenv("MOERUN_ROUTER_TAIL", "1")
    assert layer.mlp.router_tail(x, layer.self_attn.o_proj, layer.post_attention_layernorm) is not None
    out, new_residual = run()
    assert calls == [1], "the router ran in its own launch beside the tail"
    assert torch.equal(new_residual, ref_residual), f"seed={seed}"
    if DEVICE.type == "cpu":
        assert torch.equal(out, ref), f"seed={seed}"
    else:  # a GEMV launch compiled with the tail's code may contract its float operations apart
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4, msg=lambda m: f"seed={seed}: {m}")
    prefill = ForwardBatch.build([0], [3], [0], DEVICE)
    assert layer.mlp.router_tail(x, layer.self_attn.o_proj, layer.post_attention_layernorm) is not None
    with pytest.raises(ValueError, match="for decode steps"):
        layer.self_attn._attend(torch.zeros(3, 128, device=DEVICE), prefill, cache,
                                layer.mlp.router_tail(x, layer.self_attn.o_proj, layer.post_attention_layernorm))
