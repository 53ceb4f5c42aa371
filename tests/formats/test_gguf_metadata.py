"""GGUF metadata <-> ModelConfig, and the GGUF <-> Hugging Face tensor-name mapping."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from gguf_testutil import tiny_config
from moerun.config import RopeConfig
from moerun.formats.gguf.metadata import gguf_metadata_for, model_config_from_gguf
from moerun.formats.gguf.names import (
    GLOBAL_NAMES,
    LAYER_NAMES,
    gguf_layer,
    gguf_to_hf,
    hf_to_gguf,
    parse_expert_name,
    parse_fused_gate_up,
)
from moerun.formats.gguf.reader import GGUFError

QWEN3_30B = dict(vocab_size=151936, hidden_size=2048, num_layers=48, num_heads=32, num_kv_heads=4, head_dim=128,
                 intermediate_size=6144, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
                 max_position_embeddings=40960, bos_token_id=151643, eos_token_ids=(151645,), pad_token_id=151643)


def _names(config, tied=False, bias=False, dense=()):
    names = {"token_embd.weight", "output_norm.weight"} | ({"output.weight"} if not tied else set())
    for i in range(config.num_layers):
        names |= {f"blk.{i}.attn_q.weight", f"blk.{i}.ffn_down.weight" if i in dense else f"blk.{i}.ffn_down_exps.weight"}
        if bias:
            names.add(f"blk.{i}.attn_q.bias")
    return names


@pytest.mark.parametrize("config", [
    tiny_config(),
    tiny_config(**QWEN3_30B, rope=RopeConfig(theta=1_000_000.0)),
    tiny_config(**QWEN3_30B, rope=RopeConfig(theta=1e6, kind="yarn", factor=4.0, original_max_position=32768,
                                              attention_factor=1.25), norm_topk_prob=False, rms_norm_eps=1e-5),
    tiny_config(tie_word_embeddings=True, attention_bias=True, mlp_only_layers=(0,), dtype=torch.float16,
                eos_token_ids=(2, 5, 7), bos_token_id=None, pad_token_id=None),
    tiny_config(dtype=torch.float32, rms_norm_eps=3e-7),
])
def test_config_round_trip(config):
    md = gguf_metadata_for(config)
    names = _names(config, config.tie_word_embeddings, config.attention_bias, config.mlp_only_layers)
    assert model_config_from_gguf(md, "t.gguf", names) == config


def test_written_keys_follow_llama_cpp():
    md = gguf_metadata_for(tiny_config(**QWEN3_30B))
    assert md["general.architecture"] == "qwen3moe"
    assert md["qwen3moe.expert_feed_forward_length"] == 768 and md["qwen3moe.feed_forward_length"] == 6144
    assert md["qwen3moe.attention.key_length"] == md["qwen3moe.attention.value_length"] == 128
    assert md["tokenizer.ggml.eos_token_id"] == 151645
    assert "qwen3moe.rope.scaling.type" not in md


def test_llama_cpp_defaults_when_keys_are_absent():
    md = gguf_metadata_for(tiny_config(**QWEN3_30B))
    for k in ("qwen3moe.expert_weights_norm", "qwen3moe.expert_feed_forward_length", "qwen3moe.attention.key_length",
              "qwen3moe.attention.value_length", "qwen3moe.attention.head_count_kv", "qwen3moe.rope.freq_base",
              "general.file_type"):
        del md[k]
    md["tokenizer.ggml.tokens"] = ["x"] * 1000  # the token list decides the vocabulary size
    c = model_config_from_gguf(md, "t.gguf")
    assert c.norm_topk_prob is True  # llama.cpp always normalises qwen3moe top-k weights
    assert c.moe_intermediate_size == 6144 // 8  # n_ff / n_expert_used
    assert c.head_dim == 2048 // 32 and c.num_kv_heads == 32
    assert c.rope.theta == 10000.0 and c.dtype == torch.bfloat16 and c.vocab_size == 1000
    assert c.tie_word_embeddings is False  # tensor names unknown
    assert model_config_from_gguf(md, "t.gguf", {"token_embd.weight"}).tie_word_embeddings is True


def test_float32_values_read_back_as_written():
    md = gguf_metadata_for(tiny_config())
    md["qwen3moe.attention.layer_norm_rms_epsilon"] = 9.999999974752427e-07  # 1e-6 after a float32 round trip
    assert model_config_from_gguf(md, "t.gguf").rms_norm_eps == 1e-6


def test_metadata_errors():
    md = gguf_metadata_for(tiny_config())
    with pytest.raises(GGUFError, match=r"t.gguf: architecture 'llama' is not supported; moerun supports \['qwen3moe'\]"):
        model_config_from_gguf({**md, "general.architecture": "llama"}, "t.gguf")
    for key in ("qwen3moe.block_count", "qwen3moe.expert_count", "qwen3moe.attention.layer_norm_rms_epsilon",
                "qwen3moe.context_length", "qwen3moe.embedding_length"):
        bad = {k: v for k, v in md.items() if k != key}
        with pytest.raises(GGUFError, match=f"t.gguf: missing required metadata key '{key}' for architecture 'qwen3moe'"):
            model_config_from_gguf(bad, "t.gguf")
    with pytest.raises(GGUFError, match="'qwen3moe.block_count' is 'two'; expected an integer"):
        model_config_from_gguf({**md, "qwen3moe.block_count": "two"}, "t.gguf")
    with pytest.raises(GGUFError, match="rope.scaling.type' is 'linear'; moerun supports 'none' and 'yarn'"):
        model_config_from_gguf({**md, "qwen3moe.rope.scaling.type": "linear"}, "t.gguf")
    with pytest.raises(GGUFError, match="t.gguf: model config: num_attention_heads \\(4\\) must be a multiple"):
        model_config_from_gguf({**md, "qwen3moe.attention.head_count_kv": 3}, "t.gguf")
    with pytest.raises(GGUFError, match="varies per layer"):
        model_config_from_gguf({**md, "qwen3moe.attention.head_count_kv": [2, 4]}, "t.gguf")
    with pytest.raises(ValueError, match="at most 3 end-of-generation ids"):
        gguf_metadata_for(replace(tiny_config(), eos_token_ids=(1, 2, 3, 4)))


# ---- names ----
def test_names_map_both_ways():
    assert gguf_to_hf("token_embd.weight") == "model.embed_tokens.weight"
    assert gguf_to_hf("output.weight") == "lm_head.weight"
    assert gguf_to_hf("blk.7.ffn_norm.weight") == "model.layers.7.post_attention_layernorm.weight"
    assert gguf_to_hf("blk.12.ffn_gate_exps.weight") == "model.layers.12.mlp.experts.gate_proj"
    assert gguf_to_hf("blk.0.ffn_gate_inp.weight") == "model.layers.0.mlp.gate.weight"
    assert gguf_to_hf("blk.3.attn_k.bias") == "model.layers.3.self_attn.k_proj.bias"
    assert hf_to_gguf("model.layers.5.mlp.experts.down_proj") == "blk.5.ffn_down_exps.weight"
    assert hf_to_gguf("model.layers.5.mlp.down_proj.weight") == "blk.5.ffn_down.weight"
    for g, h in GLOBAL_NAMES.items():
        assert hf_to_gguf(gguf_to_hf(g)) == g and gguf_to_hf(hf_to_gguf(h)) == h
    for suffix in LAYER_NAMES:
        assert hf_to_gguf(gguf_to_hf(f"blk.31.{suffix}")) == f"blk.31.{suffix}"
    assert gguf_layer("blk.31.attn_v.weight") == 31 and gguf_layer("output.weight") is None


def test_unknown_and_expert_names():
    with pytest.raises(GGUFError, match="unknown GGUF tensor name 'blk.0.ffn_gate_shexp.weight' for qwen3moe; known"):
        gguf_to_hf("blk.0.ffn_gate_shexp.weight")
    with pytest.raises(GGUFError, match="unknown GGUF tensor name 'blk.01.attn_q.weight'"):
        gguf_to_hf("blk.01.attn_q.weight")
    with pytest.raises(GGUFError, match="unknown Hugging Face tensor name 'model.foo'"):
        hf_to_gguf("model.foo")
    with pytest.raises(GGUFError, match="per-expert or fused expert tensor"):
        hf_to_gguf("model.layers.0.mlp.experts.3.up_proj.weight")
    assert parse_expert_name("model.layers.4.mlp.experts.17.down_proj.weight") == (4, 17, "down_proj")
    assert parse_expert_name("model.layers.4.mlp.experts.down_proj") is None
    assert parse_fused_gate_up("model.layers.9.mlp.experts.gate_up_proj") == 9
