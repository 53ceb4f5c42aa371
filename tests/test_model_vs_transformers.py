"""The model against transformers' Qwen3MoeForCausalLM: logits and greedy tokens on seeded tiny configs."""

from __future__ import annotations

import random

import pytest
import torch

from moerun import LLM, SamplingParams

from helpers import SMALL_VOCAB, build_checkpoint, reference_greedy, reference_model, relative_error

CONFIGS = {
    "odd_sizes_gqa3": dict(hidden_size=45, num_attention_heads=3, num_key_value_heads=1, head_dim=14,
                           moe_intermediate_size=19, intermediate_size=37),
    "mha_1to1": dict(num_attention_heads=4, num_key_value_heads=4),
    "gqa_3to1_norm_off": dict(num_attention_heads=6, num_key_value_heads=2, norm_topk_prob=False),
    "top1": dict(num_experts=5, num_experts_per_tok=1),
    "top4_of_7_untied": dict(num_experts=7, num_experts_per_tok=4, tie_word_embeddings=False),
    "dense_among_sparse": dict(mlp_only_layers=[1], num_hidden_layers=3),
    "sparse_step_2": dict(decoder_sparse_step=2, num_hidden_layers=4),
    "transformers5_spelling": dict(spelling="transformers5", norm_topk_prob=False),
    "fused_experts_bias": dict(fused_experts=True, attention_bias=True),
    "yarn": dict(rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256},
                 max_position_embeddings=1024),
    "yarn_transformers5": dict(spelling="transformers5", max_position_embeddings=1024,
                               rope_scaling={"rope_type": "yarn", "factor": 2.0,
                                             "original_max_position_embeddings": 512}),
}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def pair(request, tmp_path_factory):
    overrides = dict(CONFIGS[request.param])
    folder = build_checkpoint(tmp_path_factory.mktemp(request.param), seed=random.randrange(2**31), **overrides)
    return LLM(str(folder), device="cpu", max_model_len=256, max_num_seqs=4), reference_model(folder)


def test_logits_match_transformers(pair):
    llm, ref = pair
    ids = [random.randrange(SMALL_VOCAB) for _ in range(23)]
    ours = llm.logits(ids)
    with torch.no_grad():
        theirs = ref(torch.tensor([ids])).logits[0]
    assert ours.shape == theirs.shape == (23, SMALL_VOCAB)
    assert relative_error(ours, theirs) <= 1e-4


def test_greedy_generation_matches_transformers(pair):
    llm, ref = pair
    ids = [random.randrange(SMALL_VOCAB) for _ in range(7)]
    out = llm.generate([ids], SamplingParams(max_tokens=32, temperature=0, ignore_eos=True))[0]
    assert out.token_ids == reference_greedy(ref, ids, 32)
    assert out.finish_reason == "length"


def test_repetition_penalty_matches_transformers(pair):
    llm, ref = pair
    ids = [random.randrange(SMALL_VOCAB) for _ in range(5)]
    out = llm.generate([ids], SamplingParams(max_tokens=12, temperature=0, repetition_penalty=1.7, ignore_eos=True))
    assert out[0].token_ids == reference_greedy(ref, ids, 12, repetition_penalty=1.7)
