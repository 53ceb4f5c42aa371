"""gemv_v2's GEMM 1 normalising its rows itself (a TopkSelect carrying the RMSNorm): x times the norm weight rounded
to int8 block by block in the program (kernels/quant/int8_dot.xq_tiles_rounded), the products scaled by the row's
1/rms, the routing picked from the logits before the 1/rms; against the rows normalised first with the logits
scaled (TopkSelect.prenormalised), which the other paths and types take."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from test_o_proj_router import recorded_picks  # noqa: E402
from test_route_fused import DEVICE, EPS, quantized_block  # noqa: E402

from moerun.kernels.fused_moe import TopkSelect  # noqa: E402
from moerun.kernels.quant import fused_moe_quant  # noqa: E402
from moerun.kernels.quant.gemv_v2 import normalises_x  # noqa: E402
from moerun.formats.quants import QuantType  # noqa: E402


def _gemv_v2(monkeypatch) -> dict:
    cfg = fused_moe_quant.normalize_config({"path": "gemv_v2", "BLOCK_N": 16 if DEVICE.type == "cuda" else 64,
                                            "BLOCK_K": 256, "BLOCK_N2": 16, "BLOCK_K2": 256, "x_q8": True,
                                            "sum2": "atomic"})  # fmt: skip
    monkeypatch.setattr(fused_moe_quant, "get_moe_config", lambda *args: cfg)
    return cfg


@pytest.mark.parametrize("qtype", ["Q4_K", "Q8_0", "Q6_K", "Q3_K"])
@pytest.mark.parametrize("renormalize", [True, False])
def test_gemm1_normalises_quantized_rows(seed, monkeypatch, qtype, renormalize) -> None:
    cfg = _gemv_v2(monkeypatch)
    H, k = 512, 2
    block, _ = quantized_block(qtype, H, 256)
    E = block.gate.weight.shape[0]
    # a residual stream of rms about 50: logits before the 1/rms spread over hundreds
    h = 50.0 * torch.randn(1, H, device=DEVICE)
    norm_weight = (1.0 + 0.2 * torch.randn(H)).to(DEVICE)
    logits = 200.0 * torch.randn(1, E, device=DEVICE)
    select = TopkSelect(logits, renormalize, norm_weight, EPS)
    normed, scaled = select.prenormalised(h)
    want_w, want_ids = torch.empty(1, k, device=DEVICE), torch.empty(1, k, dtype=torch.int32, device=DEVICE)
    want = block.experts(normed, want_w, want_ids, select=scaled, keep_float32=True)
    got_w, got_ids = torch.full((1, k), -1.0, device=DEVICE), torch.full((1, k), -1, dtype=torch.int32, device=DEVICE)
    got = block.experts(h, got_w, got_ids, select=select, keep_float32=True)
    assert normalises_x(cfg, QuantType[qtype])
    assert torch.equal(got_ids, want_ids), f"seed={seed}: {got_ids.tolist()} against {want_ids.tolist()}"
    torch.testing.assert_close(got_w, want_w, rtol=1e-5, atol=1e-6, msg=lambda m: f"seed={seed}: {m}")
    # int8 codes of h * g against those of the normalised rows: the same but where a value sits within float
    # rounding of a half step
    err = float((got.float() - want.float()).norm() / want.float().norm())
    assert err < 2e-3, f"seed={seed}: relative error {err}"


def test_gemm1_refuses_to_normalise_float_x(monkeypatch) -> None:
    from moerun.kernels.quant.gemv_v2 import fused_moe_gemv_v2
    from moerun.ops.quant import packed_parts

    cfg = fused_moe_quant.normalize_config({"path": "gemv_v2", "BLOCK_N": 64, "BLOCK_K": 256, "BLOCK_N2": 16,
                                            "BLOCK_K2": 256})  # fmt: skip
    assert not normalises_x(cfg, QuantType.Q4_K)
    block, _ = quantized_block("Q4_K", 256, 256)
    p13 = packed_parts(block.experts.__dict__["q_w13"])
    gate, up = fused_moe_quant.split_gate_up(p13 if len(p13) > 1 else p13[0])
    select = TopkSelect(torch.randn(1, 6, device=DEVICE), True, torch.ones(256, device=DEVICE), EPS)
    w, ids = torch.empty(1, 2, device=DEVICE), torch.empty(1, 2, dtype=torch.int32, device=DEVICE)
    down = packed_parts(block.experts.__dict__["q_w2"])[0]
    with pytest.raises(ValueError, match="normalises x only"):
        fused_moe_gemv_v2(torch.randn(1, 256, device=DEVICE), gate, up, down, w, ids, cfg, torch.float32,
                          select=select)  # fmt: skip


@pytest.mark.parametrize("qtype", ["Q4_K", "Q8_0"])
@pytest.mark.parametrize("T", [1, 2])
def test_quantized_o_proj_with_the_routers_logits(seed, qtype, T) -> None:
    # the quantized o_proj + router launch: h as the plain quantized o_proj on the same int8 rows plus the residual
    # (added as the norm adds it), the logits as the torch reference over the dequantised o_proj
    from moerun.kernels.quant.int8_dot import dequantize_xq, quantize_x
    from moerun.kernels.quant.matmul_quant import quant_matmul_triton
    from moerun.kernels.quant.o_proj_router_v2 import o_proj_router_v2
    from moerun.kernels.quant.synthetic import random_quantized
    from moerun.layers.quantized import QuantizedWeight
    from moerun.ops.moe_reference import o_proj_router_reference, router_rows
    from moerun.ops.quant import packed_parts

    H, Q, E = 256, 512, 13
    weight = QuantizedWeight([random_quantized(qtype, (H, Q), DEVICE)])
    (w,) = packed_parts(weight)
    cfg = fused_moe_quant.normalize_config({"path": "gemv_v2", "BLOCK_N": 4 if DEVICE.type == "cuda" else 64,
                                            "BLOCK_K": 512, "x_q8": True})  # fmt: skip
    a, residual = torch.randn(T, Q, device=DEVICE), torch.randn(T, H, device=DEVICE)
    gate, norm_weight = torch.randn(E, H, device=DEVICE) / H**0.5, 1.0 + 0.2 * torch.randn(H, device=DEVICE)
    dense = weight.dequantize(torch.float32)  # [H, Q]
    rows = router_rows(gate, norm_weight, dense)
    a_int8 = quantize_x(a, w.k_pad)
    h, z = o_proj_router_v2(a, a_int8, residual, w, rows, cfg)
    want_h = quant_matmul_triton(a, [w], config=cfg, x_int8=a_int8) + residual
    _, want_z = o_proj_router_reference(dequantize_xq(*a_int8[:2])[:, :Q], residual, dense, rows)  # over a^
    torch.testing.assert_close(h, want_h, rtol=1e-6, atol=1e-6, msg=lambda m: f"seed={seed}: {m}")
    torch.testing.assert_close(z, want_z, rtol=1e-4, atol=1e-4, msg=lambda m: f"seed={seed}: {m}")
    with pytest.raises(ValueError, match="x_q8"):
        o_proj_router_v2(a, a_int8, residual, w, rows, {**cfg, "x_q8": False})


@pytest.mark.parametrize("qtype", ["Q4_K", "Q8_0"])
def test_quantized_block_from_attention(seed, monkeypatch, qtype) -> None:
    # MOERUN_ROUTER_IN_OPROJ_QUANT=1: a GGUF o_proj and experts take the attention's output: o_proj with the
    # router's logits in one launch, the norm inside GEMM 1; the same routing and new residual as the quantized
    # o_proj then the fused router, the output within the int8 rounding of the rows
    from moerun.kernels.quant.int8_dot import quantize_x
    from moerun.kernels.quant.synthetic import random_quantized
    from moerun.layers.linear import Linear
    from moerun.layers.quantized import QuantizedWeight, set_quantized

    from moerun.kernels.quant import configs, matmul_quant
    from moerun.kernels.quant.matmul_quant import quant_matmul_triton
    from moerun.ops.quant import packed_parts

    _gemv_v2(monkeypatch)
    o_cfg = fused_moe_quant.normalize_config({"path": "gemv_v2", "BLOCK_N": 4 if DEVICE.type == "cuda" else 64,
                                              "BLOCK_K": 512, "x_q8": True})  # fmt: skip
    for module in (configs, matmul_quant):  # o_proj on int8 rows, as the GPUs' tables run it at one token
        monkeypatch.setattr(module, "get_matmul_config", lambda *args, **kw: o_cfg)
    H, Q = 256, 512
    block, norm = quantized_block(qtype, H, 256)
    o_proj = Linear(Q, H).to(DEVICE)
    set_quantized(o_proj, "weight", QuantizedWeight([random_quantized(qtype, (H, Q), DEVICE)]))
    a, residual = torch.randn(1, Q, device=DEVICE), torch.randn(1, H, device=DEVICE)
    assert not block.routes_in_o_proj(residual, o_proj, norm), "on without MOERUN_ROUTER_IN_OPROJ_QUANT"
    monkeypatch.setenv("MOERUN_ROUTER_IN_OPROJ_QUANT", "1")
    assert block.routes_in_o_proj(residual, o_proj, norm)
    picks = recorded_picks(block, monkeypatch)
    a_int8 = quantize_x(a, 512)
    got, got_res = block.forward_from_attention(a, residual, o_proj, norm, a_int8)
    o = quant_matmul_triton(a, packed_parts(o_proj.__dict__["q_weight"]), x_int8=a_int8)  # o_proj's Triton path
    want, want_res = block.forward_fused_norm(o, residual, norm)
    torch.testing.assert_close(got_res, want_res, rtol=1e-6, atol=1e-6, msg=lambda m: f"seed={seed}: {m}")
    assert torch.equal(picks[0][1], picks[1][1]), f"seed={seed}: {picks[0][1]} against {picks[1][1]}"
    torch.testing.assert_close(picks[0][0], picks[1][0], rtol=1e-4, atol=1e-5, msg=lambda m: f"seed={seed}: {m}")
    err = float((got.float() - want.float()).norm() / want.float().norm())
    assert err < 2e-3, f"seed={seed}: relative error {err}"
    # without the attention's int8 rows the block rounds a itself: the same result
    again, _ = block.forward_from_attention(a, residual, o_proj, norm)
    torch.testing.assert_close(again, got, rtol=1e-6, atol=1e-6, msg=lambda m: f"seed={seed}: {m}")
