"""The per-tensor type policy follows llama.cpp's llama_tensor_get_type for the file types moerun writes."""

from __future__ import annotations

import pytest
from gguf.constants import GGMLQuantizationType, LlamaFileType

from moerun.formats.gguf.type_mix import file_type, tensor_type, use_more_bits

T = GGMLQuantizationType
N_LAYERS, N_EXPERT = 48, 128  # Qwen3-30B-A3B
H, I, E, VOCAB = 2048, 768, 128, 151936
SHAPES = {
    "token_embd.weight": (VOCAB, H), "output.weight": (VOCAB, H), "output_norm.weight": (H,),
    "attn_norm.weight": (H,), "attn_q.weight": (4096, H), "attn_k.weight": (512, H), "attn_v.weight": (512, H),
    "attn_output.weight": (H, 4096), "attn_q_norm.weight": (128,), "ffn_norm.weight": (H,),
    "ffn_gate_inp.weight": (E, H), "ffn_gate_exps.weight": (E, I, H), "ffn_up_exps.weight": (E, I, H),
    "ffn_down_exps.weight": (E, H, I),
}


def mix(ftype: str, name: str, layer: int | None = None, n_expert: int = N_EXPERT, **kw) -> T:
    full = name if layer is None else f"blk.{layer}.{name}"
    return tensor_type(full, SHAPES[name], ftype, layer, N_LAYERS, n_expert, n_gqa=8, **kw)


def test_use_more_bits_layers():
    chosen = [i for i in range(N_LAYERS) if use_more_bits(i, N_LAYERS)]
    assert chosen == [0, 1, 2, 3, 4, 5] + list(range(8, 42, 3)) + list(range(42, 48))


@pytest.mark.parametrize("ftype", ["F32", "F16", "BF16", "Q8_0", "Q6_K", "Q5_K_M", "Q4_K_M", "Q3_K_M", "Q2_K", "Q4_0",
                                   "IQ4_XS", "IQ4_NL"])
def test_never_quantized_tensors_stay_f32(ftype):
    for name in ("output_norm.weight",):
        assert mix(ftype, name) == T.F32
    for name in ("attn_norm.weight", "attn_q_norm.weight", "ffn_norm.weight", "ffn_gate_inp.weight"):
        assert mix(ftype, name, 3) == T.F32
    assert tensor_type("blk.0.attn_q.bias", (4096,), ftype, 0, N_LAYERS, N_EXPERT) == T.F32


@pytest.mark.parametrize("ftype,expected", [("F32", T.F32), ("F16", T.F16), ("BF16", T.BF16)])
def test_float_files(ftype, expected):
    for name in ("token_embd.weight", "output.weight"):
        assert mix(ftype, name) == expected
    for name in ("attn_v.weight", "ffn_down_exps.weight", "ffn_gate_exps.weight"):
        assert mix(ftype, name, 0) == expected


def test_q4_k_m():
    assert mix("Q4_K_M", "output.weight") == T.Q6_K
    assert mix("Q4_K_M", "token_embd.weight") == T.Q4_K
    assert mix("Q4_K_M", "token_embd.weight", tied_embeddings=True) == T.Q6_K
    for layer in range(N_LAYERS):
        more = T.Q6_K if use_more_bits(layer, N_LAYERS) else T.Q4_K
        assert mix("Q4_K_M", "attn_v.weight", layer) == more
        assert mix("Q4_K_M", "ffn_down_exps.weight", layer) == more
        for name in ("attn_q.weight", "attn_k.weight", "attn_output.weight", "ffn_gate_exps.weight",
                     "ffn_up_exps.weight"):
            assert mix("Q4_K_M", name, layer) == T.Q4_K
    assert mix("Q4_K_M", "attn_v.weight", 7) == T.Q4_K and mix("Q4_K_M", "attn_v.weight", 8) == T.Q6_K


def test_q5_k_m_q6_k_q8_0_q4_0():
    assert mix("Q5_K_M", "attn_v.weight", 0) == T.Q6_K and mix("Q5_K_M", "attn_v.weight", 7) == T.Q5_K
    assert mix("Q5_K_M", "ffn_down_exps.weight", 47) == T.Q6_K and mix("Q5_K_M", "ffn_up_exps.weight", 0) == T.Q5_K
    assert mix("Q5_K_M", "output.weight") == T.Q6_K
    assert {mix("Q6_K", n, 5) for n in ("attn_v.weight", "ffn_down_exps.weight", "attn_q.weight")} == {T.Q6_K}
    assert mix("Q8_0", "output.weight") == T.Q8_0 and mix("Q8_0", "ffn_down_exps.weight", 0) == T.Q8_0
    assert mix("Q8_0", "token_embd.weight") == T.Q8_0
    assert mix("Q4_0", "output.weight") == T.Q6_K and mix("Q4_0", "attn_v.weight", 0) == T.Q4_0


def test_q3_k_m():
    assert mix("Q3_K_M", "attn_v.weight", 0) == T.Q5_K and mix("Q3_K_M", "attn_v.weight", 1) == T.Q5_K
    assert mix("Q3_K_M", "attn_v.weight", 2) == T.Q4_K
    assert [mix("Q3_K_M", "ffn_down_exps.weight", i) for i in (0, 2, 3, 47)] == [T.Q5_K, T.Q5_K, T.Q4_K, T.Q4_K]
    assert mix("Q3_K_M", "attn_output.weight", 10) == T.Q4_K
    assert mix("Q3_K_M", "ffn_gate_exps.weight", 10) == T.Q3_K and mix("Q3_K_M", "output.weight") == T.Q6_K


def test_q2_k():
    assert mix("Q2_K", "attn_v.weight", 10) == T.Q4_K  # n_head / n_head_kv = 8 >= 4
    assert tensor_type("blk.0.attn_v.weight", (512, H), "Q2_K", 0, N_LAYERS, N_EXPERT, n_gqa=2) == T.Q3_K
    assert mix("Q2_K", "ffn_down_exps.weight", 10) == T.Q3_K and mix("Q2_K", "attn_output.weight", 10) == T.Q3_K
    assert mix("Q2_K", "ffn_up_exps.weight", 10) == T.Q2_K and mix("Q2_K", "token_embd.weight") == T.Q2_K
    assert mix("Q2_K", "output.weight") == T.Q6_K


@pytest.mark.parametrize("ftype,t", [("IQ4_XS", T.IQ4_XS), ("IQ4_NL", T.IQ4_NL)])
def test_iq4(ftype, t):
    assert mix(ftype, "output.weight") == T.Q6_K and mix(ftype, "token_embd.weight") == t
    assert mix(ftype, "attn_v.weight", 20) == T.Q5_K  # n_head / n_head_kv = 8 >= 4
    assert tensor_type("blk.0.attn_v.weight", (512, H), ftype, 0, N_LAYERS, N_EXPERT, n_gqa=2) == t
    # without an importance matrix the first eighth of the down projections get Q5_K
    assert [mix(ftype, "ffn_down_exps.weight", i) for i in (0, 5, 6, 47)] == [T.Q5_K, T.Q5_K, t, t]
    for name in ("attn_q.weight", "attn_k.weight", "attn_output.weight", "ffn_gate_exps.weight"):
        assert mix(ftype, name, 30) == t
    assert mix(ftype, "attn_output.weight", 7, n_expert=8) == T.Q5_K
    assert mix(ftype, "attn_v.weight", 7, n_expert=8) == T.Q8_0


def test_eight_expert_rules():
    assert mix("Q4_K_M", "attn_v.weight", 7, n_expert=8) == T.Q8_0
    assert mix("Q4_K_M", "attn_k.weight", 7, n_expert=8) == T.Q8_0
    assert mix("Q4_K_M", "attn_output.weight", 7, n_expert=8) == T.Q5_K
    assert mix("Q5_K_M", "attn_output.weight", 7, n_expert=8) == T.Q5_K  # Q5_K_M is not in the bump list
    assert mix("Q2_K", "attn_output.weight", 7, n_expert=8) == T.Q5_K


def test_row_length_fallbacks():
    def t(ftype: str, name: str, row: int) -> T:
        return tensor_type(f"blk.0.{name}", (64, row), ftype, 0, N_LAYERS, N_EXPERT)
    assert t("Q4_K_M", "attn_q.weight", 2080) == T.Q5_0  # 2080 = 65 * 32, not a multiple of 256
    assert t("Q4_K_M", "attn_v.weight", 2080) == T.Q8_0  # Q6_K on layer 0 -> Q8_0
    assert t("Q5_K_M", "attn_q.weight", 2080) == T.Q5_1
    assert t("Q3_K_M", "ffn_up_exps.weight", 2080) == T.IQ4_NL  # Q3_K -> IQ4_NL, as llama.cpp writes it
    assert t("IQ4_XS", "attn_q.weight", 2080) == T.IQ4_NL
    assert t("Q4_K_M", "attn_q.weight", 100) == T.F16
    assert t("Q8_0", "attn_q.weight", 100) == T.F16
    assert tensor_type("output.weight", (VOCAB, 2080), "Q4_K_M", None, N_LAYERS, N_EXPERT) == T.Q8_0


def test_bad_arguments():
    with pytest.raises(ValueError, match="unknown GGUF file type 'Q4_K_S'; choose one of F32, F16"):
        file_type("Q4_K_S")
    assert file_type("q4_k_m") == LlamaFileType.MOSTLY_Q4_K_M
    with pytest.raises(ValueError, match=r"tensor 'blk.48.attn_v.weight': layer 48 is not in \[0, 48\)"):
        tensor_type("blk.48.attn_v.weight", (512, H), "Q4_K_M", 48, N_LAYERS, N_EXPERT)


def test_read_only_file_types():
    # Mixes of file types moerun cannot write (random models of them), Qwen3-30B-A3B (n_gqa 8, 128 experts).
    assert mix("IQ2_M", "ffn_up_exps.weight", 20) == T.IQ2_S
    assert mix("IQ2_M", "ffn_down_exps.weight", 5) == T.IQ3_S and mix("IQ2_M", "ffn_down_exps.weight", 6) == T.IQ2_S
    assert mix("IQ2_XXS", "ffn_down_exps.weight", 0) == T.Q2_K and mix("IQ2_XXS", "attn_q.weight", 3) == T.IQ2_XXS
    assert mix("IQ2_S", "attn_q.weight", 3) == T.IQ2_XS  # the IQ2_S file type's default type is IQ2_XS
    assert mix("IQ2_M", "attn_v.weight", 3) == T.Q4_K and mix("IQ1_S", "attn_output.weight", 3) == T.IQ2_XXS
    assert mix("IQ1_M", "attn_output.weight", 3, n_expert=8) == T.Q5_K
    assert mix("IQ2_M", "token_embd.weight") == T.IQ3_S and mix("IQ1_S", "token_embd.weight") == T.Q2_K
    assert mix("IQ2_M", "output.weight") == T.Q5_K and mix("IQ3_S", "output.weight") == T.Q6_K
    assert mix("IQ3_XXS", "attn_q.weight", 3) == T.IQ2_S and mix("IQ3_XXS", "attn_v.weight", 3) == T.Q4_K
    assert mix("IQ3_XXS", "ffn_down_exps.weight", 5) == T.Q4_K and mix("IQ3_XXS", "ffn_down_exps.weight", 6) == T.Q3_K
    assert mix("IQ3_M", "attn_output.weight", 3) == T.Q4_K and mix("IQ3_M", "ffn_gate_exps.weight", 3) == T.IQ3_S
    assert mix("IQ3_XS", "ffn_gate_exps.weight", 6) == T.IQ3_XXS and mix("IQ3_XS", "ffn_gate_exps.weight", 5) == T.IQ3_S
    assert mix("TQ2_0", "token_embd.weight") == T.Q4_K and mix("TQ1_0", "ffn_up_exps.weight", 3) == T.TQ1_0
    assert mix("MXFP4_MOE", "ffn_up_exps.weight", 3) == T.MXFP4 and mix("MXFP4_MOE", "attn_q.weight", 3) == T.Q8_0
    assert mix("MXFP4_MOE", "output.weight") == T.Q8_0
    # moerun writes none of the IQ1 / IQ2 / IQ3_XXS ones (IQ3_S, IQ3_M, IQ3_XS it writes)
    with pytest.raises(ValueError, match="unknown GGUF file type 'IQ2_M'"):
        file_type("IQ2_M")
    assert file_type("iq2_m", read_only=True) == LlamaFileType.MOSTLY_IQ2_M
    assert file_type("IQ3_M") == LlamaFileType.MOSTLY_IQ3_M
