"""o_proj with the router's logits in one launch (kernels/o_proj_router.py) against its torch reference; the
algebra it rests on (the router's logits through o_proj, before the 1/rms); GEMM 1 normalising its rows itself
(fused_moe's select with the norm); the MoE block's forward_from_attention against o_proj + forward_fused_norm."""

from __future__ import annotations

import pytest
import torch
from torch import nn

pytest.importorskip("triton")

from moerun.kernels import tile_configs  # noqa: E402
from moerun.kernels.o_proj_router import MAX_TOKENS, o_proj_router_triton  # noqa: E402
from moerun.layers.linear import Linear  # noqa: E402
from moerun.ops import moe as moe_ops  # noqa: E402
from moerun.ops.moe_reference import o_proj_router_reference, route_reference, router_rows  # noqa: E402
from moerun.ops.norm import rms_norm_reference  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
EPS = 1e-6


def operands(T: int, H: int, Q: int, E: int, dtype: torch.dtype):
    """a [T, Q], residual [T, H], o_proj weight [H, Q], router weight [E, H], norm weight [H]."""
    a = torch.randn(T, Q).to(dtype).to(DEVICE)
    residual = torch.randn(T, H).to(dtype).to(DEVICE)
    o_weight = (torch.randn(H, Q) / Q**0.5).to(dtype).to(DEVICE)
    gate = (1.5 * torch.randn(E, H) / H**0.5).to(dtype).to(DEVICE)
    norm_weight = (1.0 + 0.2 * torch.randn(H)).to(dtype).to(DEVICE)
    return a, residual, o_weight, gate, norm_weight


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("T", [1, 3])
@pytest.mark.parametrize("shape", [(40, 72, 13), (64, 128, 16)], ids=["ragged", "even"])
def test_kernel_matches_the_reference(seed, dtype, T, shape) -> None:
    H, Q, E = shape
    a, residual, o_weight, gate, norm_weight = operands(T, H, Q, E, dtype)
    rows = router_rows(gate, norm_weight, o_weight)
    h, z = o_proj_router_triton(a, residual, o_weight, rows)
    want_h, want_z = o_proj_router_reference(a, residual, o_weight, rows)
    assert h.dtype == dtype and z.dtype == torch.float32 and h.shape == (T, H) and z.shape == (T, E)
    # o_proj's sums in another order may round its output (then h) one step the other way
    step = {torch.float32: 1e-5, torch.bfloat16: 1.6e-2}[dtype]
    torch.testing.assert_close(h.float(), want_h.float(), rtol=step, atol=step, msg=lambda m: f"seed={seed}: {m}")
    torch.testing.assert_close(z, want_z, rtol=1e-4, atol=1e-4 * float(want_z.abs().max()),
                               msg=lambda m: f"seed={seed}: {m}")  # fmt: skip


@pytest.mark.parametrize("T", [1, 2])
def test_logits_times_one_over_rms_are_the_routers(seed, T) -> None:
    # z / rms(h) is the router's F.linear(norm(h), W_r), h = residual + o_proj(a): float32, where only summation
    # order differs
    a, residual, o_weight, gate, norm_weight = operands(T, 40, 72, 13, torch.float32)
    h, z = moe_ops.o_proj_router(a, residual, o_weight, router_rows(gate, norm_weight, o_weight), backend="triton")
    inv_rms = torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS)  # [T, 1]
    normed, _ = rms_norm_reference(h, norm_weight, EPS)
    want = normed @ gate.T  # [T, E]
    torch.testing.assert_close(z * inv_rms, want, rtol=1e-4, atol=1e-4, msg=lambda m: f"seed={seed}: {m}")


def test_operand_checks() -> None:
    a, residual, o_weight, gate, norm_weight = operands(1, 40, 72, 13, torch.float32)
    rows = router_rows(gate, norm_weight, o_weight)
    with pytest.raises(ValueError, match="router rows"):
        o_proj_router_triton(a, residual, o_weight, rows[:, :-1].contiguous())
    with pytest.raises(ValueError, match="one dtype"):
        o_proj_router_triton(a.to(torch.bfloat16), residual, o_weight, rows)
    with pytest.raises(ValueError, match="at most"):
        big = MAX_TOKENS + 1
        o_proj_router_triton(a.expand(big, -1), residual.expand(big, -1), o_weight, rows)


CONFIGS = {
    "gemv-atomic": {"path": "gemv", "BLOCK_N": 16, "BLOCK_K": 32, "BLOCK_N2": 16, "BLOCK_K2": 32, "reduce": "atomic"},
    "gemv-fused": {"path": "gemv", "BLOCK_N": 16, "BLOCK_K": 16, "BLOCK_N2": 16, "BLOCK_K2": 16, "reduce": "fused"},
    "tile": {"path": "tile", "BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 32},
}


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("renormalize", [True, False], ids=["renormalised", "softmax-weights"])
def test_gemm1_normalises_its_rows(seed, config, dtype, renormalize) -> None:
    # fused_moe on the un-normalised rows with a select that carries the norm: GEMM 1 (gemv path) normalises them
    # and scales the logits itself, other paths get both done first; the routing and output of the normalised
    # rows with the scaled logits handed in
    from moerun.kernels.fused_moe import fused_moe_triton
    from moerun.kernels.topk_select import TopkSelect

    T, H, E, I, k = 2, 40, 13, 24, 3  # noqa: E741
    # a residual stream of rms about 50 (deep layers' are large): logits before the 1/rms spread over hundreds,
    # where a softmax of them would underflow to ties
    h = (50.0 * torch.randn(T, H)).to(dtype).to(DEVICE)
    norm_weight = (1.0 + 0.2 * torch.randn(H)).to(dtype).to(DEVICE)
    logits = 200.0 * torch.randn(T, E, device=DEVICE)  # before the 1/rms
    w13 = (torch.randn(E, 2 * I, H) / H**0.5).to(dtype).to(DEVICE)
    w2 = (torch.randn(E, H, I) / I**0.5).to(dtype).to(DEVICE)
    cfg = tile_configs.normalize(CONFIGS[config])
    normed, scaled = TopkSelect(logits, renormalize, norm_weight, EPS).prenormalised(h)
    torch.testing.assert_close(normed, rms_norm_reference(h, norm_weight, EPS)[0], rtol=0, atol=0)
    want_w, want_ids = route_reference(scaled.logits, k, renormalize)
    want = fused_moe_triton(normed, w13, w2, want_w, want_ids.to(torch.int32), config=cfg)
    weights = torch.full((T, k), -1.0, device=DEVICE)
    ids = torch.full((T, k), -1, dtype=torch.int32, device=DEVICE)
    select = TopkSelect(logits, renormalize, norm_weight, EPS)
    got = fused_moe_triton(h, w13, w2, weights, ids, config=cfg, select=select)
    assert torch.equal(ids, want_ids.to(torch.int32)), f"seed={seed}: {ids.tolist()} against {want_ids.tolist()}"
    torch.testing.assert_close(weights, want_w, rtol=1e-5, atol=1e-6, msg=lambda m: f"seed={seed}: {m}")
    # a normalised value may round one step the other way where 1/rms differs in its last bit
    tol = {torch.float32: 1e-5, torch.bfloat16: 2e-2}[dtype]
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol, msg=lambda m: f"seed={seed}: {m}")


def test_a_select_with_a_norm_of_another_width_is_refused() -> None:
    from moerun.kernels.fused_moe import fused_moe_triton
    from moerun.kernels.topk_select import TopkSelect

    E, I, H = 13, 24, 40  # noqa: E741
    w13, w2 = torch.randn(E, 2 * I, H, device=DEVICE), torch.randn(E, H, I, device=DEVICE)
    select = TopkSelect(torch.randn(1, E, device=DEVICE), True, torch.ones(H + 8, device=DEVICE), EPS)
    with pytest.raises(ValueError, match="RMSNorm weight"):
        fused_moe_triton(torch.randn(1, H, device=DEVICE), w13, w2, torch.empty(1, 3, device=DEVICE),
                         torch.empty(1, 3, dtype=torch.int32, device=DEVICE), select=select,
                         config=tile_configs.normalize(CONFIGS["gemv-atomic"]))  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_block_from_attention_matches_o_proj_then_the_fused_router(seed, monkeypatch, dtype) -> None:
    # at one token (unless MOERUN_ROUTER_IN_OPROJ=0) the block takes the attention's output, runs o_proj with the
    # router's logits and normalises inside GEMM 1: the same routing, output and new residual as o_proj +
    # forward_fused_norm
    from test_route_fused import small_block

    block, norm = small_block(dtype)
    o_proj = Linear(72, 40).to(DEVICE, dtype)
    with torch.no_grad():
        o_proj.weight.copy_(torch.randn(40, 72) / 72**0.5)
    a, residual = torch.randn(1, 72).to(dtype).to(DEVICE), torch.randn(1, 40).to(dtype).to(DEVICE)
    monkeypatch.setenv("MOERUN_ROUTER_IN_OPROJ", "0")
    assert not block.routes_in_o_proj(residual, o_proj, norm), "on with the switch at 0"
    monkeypatch.delenv("MOERUN_ROUTER_IN_OPROJ")
    assert block.routes_in_o_proj(residual, o_proj, norm), "off by default"
    assert not block.routes_in_o_proj(residual.expand(2, -1), o_proj, norm), "one token only (the top-k in GEMM 1)"
    picks = []
    real = block.experts.forward

    def recording(x, topk_weights, topk_ids, **kw):
        out = real(x, topk_weights, topk_ids, **kw)
        picks.append((topk_weights.clone(), topk_ids.clone()))
        return out

    monkeypatch.setattr(block.experts, "forward", recording)
    got, got_res = block.forward_from_attention(a, residual, o_proj, norm)
    want, want_res = block.forward_fused_norm(o_proj(a), residual, norm)
    assert got.dtype == want.dtype
    step = {torch.float32: 1e-5, torch.bfloat16: 1.6e-2}[dtype]
    torch.testing.assert_close(got_res.float(), want_res.float(), rtol=step, atol=step,
                               msg=lambda m: f"seed={seed}: {m}")  # fmt: skip
    if dtype == torch.float32:  # (bf16 logits made another way may tie or swap the k-th pick)
        assert torch.equal(picks[0][1], picks[1][1]), f"seed={seed}: {picks[0][1]} against {picks[1][1]}"
        torch.testing.assert_close(picks[0][0], picks[1][0], rtol=1e-4, atol=1e-5, msg=lambda m: f"seed={seed}: {m}")
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4, msg=lambda m: f"seed={seed}: {m}")
    # the router's rows are made once, from the weights as they are then
    assert block.__dict__["_router_rows"].shape == (13, 72 + 40)
    assert isinstance(o_proj, nn.Module)
