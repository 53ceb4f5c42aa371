"""ModelConfig from both config.json spellings; rotary frequencies against transformers."""

from __future__ import annotations

import pytest
import torch

from moerun.config import ModelConfig, RopeConfig
from moerun.layers.rotary import rope_inv_freq
from moerun.models.tiny import tiny_config


def test_both_spellings_give_the_same_config():
    scaling = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    a = ModelConfig.from_hf_dict(tiny_config("published", rope_scaling=scaling, max_position_embeddings=131072))
    b = ModelConfig.from_hf_dict(tiny_config("transformers5", rope_scaling=scaling, max_position_embeddings=131072))
    assert a == b
    assert a.num_experts == 8 and a.rope.kind == "yarn" and a.rope.factor == 4.0
    assert a.dtype == torch.bfloat16


def test_qwen3_30b_a3b_counts():
    cfg = ModelConfig.from_hf_dict(tiny_config(
        hidden_size=2048, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
        moe_intermediate_size=768, intermediate_size=6144, num_experts=128, num_experts_per_tok=8,
        tie_word_embeddings=False,
    ))
    counts = cfg.param_counts()
    assert 30.0e9 < counts["total"] < 30.8e9  # Qwen3-30B-A3B has 30.5B parameters
    assert 3.0e9 < counts["active"] < 3.5e9  # and 3.3B active


@pytest.mark.parametrize("scaling", [
    None,
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
    {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 4096, "beta_fast": 16, "beta_slow": 2},
])
def test_rope_frequencies_match_transformers(scaling):
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    raw = tiny_config("published", head_dim=128, rope_scaling=scaling, max_position_embeddings=131072)
    ours, our_scale = rope_inv_freq(ModelConfig.from_hf_dict(raw).rope, 128)
    hf = transformers.Qwen3MoeConfig(**{k: v for k, v in raw.items() if k not in ("architectures", "torch_dtype")})
    if scaling is None:
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeRotaryEmbedding

        theirs, their_scale = Qwen3MoeRotaryEmbedding.compute_default_rope_parameters(hf)
    else:
        theirs, their_scale = ROPE_INIT_FUNCTIONS["yarn"](hf, "cpu")
    assert torch.equal(ours, theirs.float())
    assert our_scale == pytest.approx(their_scale, rel=0, abs=0)


@pytest.mark.parametrize("edit, message", [
    (dict(model_type="mixtral"), "model_type 'mixtral' is not supported"),
    (dict(architectures=["Qwen3MoeForSequenceClassification"]), "architectures .* are not supported"),
    (dict(hidden_act="gelu"), "hidden_act 'gelu' is not supported"),
    (dict(use_sliding_window=True), "use_sliding_window=true is not supported"),
    (dict(num_attention_heads=6, num_key_value_heads=4), "must be a multiple of num_key_value_heads"),
    (dict(num_experts_per_tok=9), r"num_experts_per_tok \(9\) must be in \[1, num_experts=8\]"),
    (dict(rope_scaling={"rope_type": "longrope"}), "rope type 'longrope' is not supported"),
    (dict(hidden_size=None), "missing required key 'hidden_size'"),
])
def test_bad_configs(edit, message):
    raw = tiny_config()
    raw.update(edit)
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf_dict(raw)


def test_rope_config_checks():
    with pytest.raises(ValueError, match="rope_theta must be positive"):
        RopeConfig(theta=0)
