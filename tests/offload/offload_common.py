"""Shapes, prompts and sampling shared by the offloading tests and their fixtures."""

from __future__ import annotations

import random

from moerun.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
# 4 MoE layers of 8 experts, top-2: a cache of 3 slots per layer misses often and must serve batches in rounds
SHAPE = dict(vocab_size=512, num_hidden_layers=4, num_experts=8, num_experts_per_tok=2, with_tokenizer=False)
# GGUF: rows of 256 so that the experts quantize to Q4_K / Q6_K blocks (Q4_K_M)
GGUF_SHAPE = dict(SHAPE, hidden_size=256, moe_intermediate_size=256, intermediate_size=256, head_dim=64,
                  num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                  bos_token_id=None, eos_token_id=None)


def prompts(seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(500) for _ in range(n)] for n in (5, 17, 3, 9)]
