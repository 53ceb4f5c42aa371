"""The "onepass" decode path of the quantized fused MoE (kernels/quant/onepass.py: both GEMMs in one launch, the
down projection split along its inputs, slices summed by float32 atomics) against the torch reference of the
int8 kernels (x and the intermediate rounded to int8), through address tables, into a caller's zeroed buffer,
and its config checks."""

from __future__ import annotations

import pytest
import torch

from test_int8_dot import int8_moe_reference

pytest.importorskip("triton")

from moerun.formats.quants import QuantType  # noqa: E402
from moerun.kernels.quant import fused_moe_quant as fused_moe_quant_module  # noqa: E402
from moerun.kernels.quant.configs import normalize_config  # noqa: E402
from moerun.kernels.quant.fused_moe_quant import fused_moe_quant, int8_roundings, split_gate_up  # noqa: E402
from moerun.kernels.quant.int8_dot import quantize_x  # noqa: E402
from moerun.kernels.quant.onepass import fused_moe_onepass  # noqa: E402
from moerun.kernels.quant.repack import expert_addresses, padded_k  # noqa: E402
from moerun.kernels.quant.synthetic import random_quantized  # noqa: E402
from moerun.layers.quantized import QuantizedWeight  # noqa: E402
from moerun.ops.moe_reference import route_reference  # noqa: E402
from moerun.ops.quant import packed_parts  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
ON_CUDA = DEVICE.type == "cuda"
ONEPASS = {"path": "onepass", "BLOCK_N": 64, "BLOCK_K": 256, "BLOCK_N2": 128, "num_warps": 4, "num_stages": 1}
# gate/up type, down type, I (160 pads to 256: its padded inputs must read as zeros; K-quant rows of 160 cannot be)
CASES = [
    (QuantType.Q4_K, QuantType.Q6_K, 256),
    (QuantType.Q4_K, QuantType.Q4_K, 512),
    (QuantType.Q5_K, QuantType.Q5_K, 256),
    (QuantType.Q6_K, QuantType.Q8_0, 160),
    (QuantType.Q8_0, QuantType.Q8_0, 256),
    (QuantType.IQ4_XS, QuantType.Q3_K, 256),
]


def make_layer(E: int, H: int, I: int, gate_t: QuantType, down_t: QuantType):  # noqa: E741
    w13 = QuantizedWeight([random_quantized(gate_t, (E, I, H), DEVICE), random_quantized(gate_t, (E, I, H), DEVICE)])
    w2 = QuantizedWeight([random_quantized(down_t, (E, H, I), DEVICE)])
    return w13, w2


def routing(T: int, E: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    weights, ids = route_reference(torch.randn(T, E), k, True)
    return weights.to(DEVICE), ids.to(DEVICE).to(torch.int32).contiguous()


def assert_int8_close(out: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    # As test_int8_dot's inter_q8 check: an intermediate value within float32 rounding of a half step may round
    # the other way than in the reference (one step of one value).
    err = (out - ref).abs().max().item()
    assert err <= 2e-3 * ref.abs().max().item(), f"{what}: max error {err}"


@pytest.mark.parametrize("gate_t,down_t,I", CASES, ids=lambda c: getattr(c, "name", str(c)))
@pytest.mark.parametrize("T,k,block_n,stages", [(1, 8, 64, 1), (3, 2, 128, 3)])
def test_matches_int8_reference(seed, gate_t, down_t, I, T, k, block_n, stages) -> None:  # noqa: E741
    E, H = 9, 512
    w13, w2 = make_layer(E, H, I, gate_t, down_t)
    weights, ids = routing(T, E, k)
    hidden = torch.randn(T, H, device=DEVICE)
    out = fused_moe_quant(hidden, packed_parts(w13), packed_parts(w2)[0], weights, ids,
                          {**ONEPASS, "BLOCK_N": block_n, "num_stages": stages}, out_dtype=torch.float32)  # fmt: skip
    assert out.dtype == torch.float32 and out.shape == (T, H)
    assert_int8_close(out, int8_moe_reference(hidden, w13, w2, weights, ids),
                      f"seed={seed} {gate_t.name}/{down_t.name} I={I} T={T} k={k}")  # fmt: skip


def test_bf16_output_and_address_tables(seed) -> None:
    E, H, I, T, k = 6, 512, 256, 2, 4  # noqa: E741
    w13, w2 = make_layer(E, H, I, QuantType.Q4_K, QuantType.Q6_K)
    p13, p2 = packed_parts(w13), packed_parts(w2)[0]
    weights, ids = routing(T, E, k)
    hidden = torch.randn(T, H, device=DEVICE, dtype=torch.bfloat16)
    stacked = fused_moe_quant(hidden, p13, p2, weights, ids, ONEPASS, out_dtype=torch.float32)
    bf16 = fused_moe_quant(hidden, p13, p2, weights, ids, ONEPASS)
    assert bf16.dtype == torch.bfloat16
    torch.testing.assert_close(bf16, stacked.to(torch.bfloat16), rtol=0, atol=0)
    tables = ([expert_addresses(p).to(DEVICE) for p in p13], expert_addresses(p2).to(DEVICE))
    through = fused_moe_quant(hidden, p13, p2, weights, ids, ONEPASS, out_dtype=torch.float32, tables=tables)
    if ON_CUDA:  # the atomics add the slices in any order
        torch.testing.assert_close(through, stacked, rtol=1e-5, atol=1e-5 * stacked.abs().max().item())
    else:
        assert torch.equal(through, stacked), f"seed={seed}"


def test_adds_into_a_zeroed_buffer_and_reads_int8_rows(seed) -> None:
    E, H, I, T, k = 5, 256, 256, 2, 3  # noqa: E741
    w13, w2 = make_layer(E, H, I, QuantType.Q4_K, QuantType.Q4_K)
    gate, up = split_gate_up(packed_parts(w13))
    p2 = packed_parts(w2)[0]
    weights, ids = routing(T, E, k)
    hidden = torch.randn(T, H, device=DEVICE)
    own = fused_moe_onepass(hidden, gate, up, p2, weights, ids, normalize_config(ONEPASS))
    buf = torch.zeros(T, H, device=DEVICE)
    rows = quantize_x(hidden, padded_k(H))
    given = fused_moe_onepass(hidden, gate, up, p2, weights, ids, normalize_config(ONEPASS), x_int8=rows, out=buf)
    assert given.data_ptr() == buf.data_ptr()
    torch.testing.assert_close(given, own, rtol=1e-5, atol=1e-5 * own.abs().max().item())
    other = quantize_x(torch.randn(T, H, device=DEVICE), padded_k(H))
    assert not torch.allclose(fused_moe_onepass(hidden, gate, up, p2, weights, ids, normalize_config(ONEPASS),
                                                x_int8=other), own)  # fmt: skip
    with pytest.raises(ValueError, match="float32"):
        fused_moe_onepass(hidden, gate, up, p2, weights, ids, normalize_config(ONEPASS),
                          out=torch.zeros(T, H, device=DEVICE, dtype=torch.bfloat16))  # fmt: skip


def test_config_checks_and_roundings(monkeypatch) -> None:
    E, H, I = 4, 256, 256  # noqa: E741
    w13, w2 = make_layer(E, H, I, QuantType.Q4_K, QuantType.Q4_K)
    p13, p2 = packed_parts(w13), packed_parts(w2)[0]
    weights, ids = routing(1, E, 2)
    with pytest.raises(ValueError, match="multiple of 64"):
        fused_moe_quant(torch.randn(1, H, device=DEVICE), p13, p2, weights, ids, {**ONEPASS, "BLOCK_N": 32})
    assert normalize_config(ONEPASS)["path"] == "onepass"
    # a table entry of this path rounds x and the intermediate to int8
    monkeypatch.setattr(fused_moe_quant_module, "get_moe_config", lambda *args, **kwargs: normalize_config(ONEPASS))
    assert int8_roundings(p13, p2, 2, 1) == (True, True)
