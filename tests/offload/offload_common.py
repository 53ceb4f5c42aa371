"""Shapes, prompts and sampling shared by the offloading tests and their fixtures."""

from __future__ import annotations

import random

import pytest
import torch

from moerun.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
SHORT = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)  # runs of the quantized kernels (interpreter)
# The fused Triton kernels run in Triton's interpreter on CPU-only machines and on the GPU where there is one.
TRITON_DEVICES = [
    pytest.param("cpu", marks=pytest.mark.skipif(torch.cuda.is_available(), reason="Triton's interpreter is off "
                                                 "where CUDA is (tests/offload/conftest.py)")),
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))]
# 4 MoE layers of 8 experts, top-2: a cache of 3 slots per layer misses often and must serve batches in rounds
SHAPE = dict(vocab_size=512, num_hidden_layers=4, num_experts=8, num_experts_per_tok=2, with_tokenizer=False)
# GGUF: rows of 256 so that the experts quantize to Q4_K / Q6_K blocks (Q4_K_M)
GGUF_SHAPE = dict(SHAPE, hidden_size=256, moe_intermediate_size=256, intermediate_size=256, head_dim=64,
                  num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                  bos_token_id=None, eos_token_id=None)


def prompts(seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(500) for _ in range(n)] for n in (5, 17, 3, 9)]


def triton_run(llm_cls, path, device: str, opts: dict, count: int = 2, params: SamplingParams = SHORT
               ) -> tuple[dict, list[list[int]], list[list[int]]]:  # fmt: skip
    """(``opts`` on ``device`` with the Triton MoE backend, ``count`` short prompts, the resident engine's greedy
    tokens for them under ``params``): what the quantized offloading tests compare against."""
    options = dict(opts, device=device, moe_backend="triton")
    few = prompts(2)[:count]
    return options, few, [o.token_ids for o in llm_cls(str(path), **options).generate(few, params)]
