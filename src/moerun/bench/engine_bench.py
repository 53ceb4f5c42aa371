"""Prefill and decode throughput of moerun, and the bytes a decode step must read (for bandwidth figures)."""

from __future__ import annotations

import random
import time

import torch
from torch import nn

from moerun.api import LLM
from moerun.bench.timing import synchronize, time_call
from moerun.engine.batch import ForwardBatch
from moerun.layers.quantized import QuantizedWeight
from moerun.sampling_params import SamplingParams


def _random_ids(n: int, vocab: int, rng: random.Random) -> list[int]:
    return [rng.randrange(vocab) for _ in range(n)]


def measure_prefill(llm: LLM, lengths: list[int], repeat: int = 3) -> dict[int, float]:
    """Prompt tokens per second of a single-sequence prefill, per prompt length."""
    engine, rng = llm.engine, random.Random(0)
    out = {}
    for L in lengths:
        if L >= llm.engine_config.max_model_len:
            continue
        ids = torch.tensor(_random_ids(L, llm.model_config.vocab_size, rng), device=engine.device)
        slot = engine.cache.allocate()
        try:
            with torch.inference_mode():
                batch = ForwardBatch.build([0], [L], [slot], engine.device)
                rows = batch.last_rows
                seconds = time_call(lambda: engine.runner.prefill(ids, batch, rows), engine.device, repeat=repeat)
        finally:
            engine.cache.release(slot)
        out[L] = L / seconds
    return out


def measure_decode(llm: LLM, batch_sizes: list[int], prompt_len: int, steps: int) -> dict[int, dict[str, float]]:
    """Generated tokens per second (summed over the batch) of whole engine steps, per batch size."""
    engine, rng = llm.engine, random.Random(1)
    params = SamplingParams(max_tokens=steps + 4, temperature=0, ignore_eos=True, detokenize=False)
    out = {}
    for B in batch_sizes:
        if B > engine.cache.num_slots:
            continue
        seqs = [engine.add_request(_random_ids(prompt_len, llm.model_config.vocab_size, rng), params)
                for _ in range(B)]
        while any(s.num_computed < len(s.prompt_ids) for s in seqs):
            engine.step()  # prefill
        for _ in range(2):
            engine.step()  # warm decode steps
        synchronize(engine.device)
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step()
        synchronize(engine.device)
        seconds = time.perf_counter() - t0
        for s in seqs:
            if not s.is_finished:
                engine.abort(s)
        out[B] = {"tok_per_s": B * steps / seconds, "step_ms": 1e3 * seconds / steps}
    return out


@torch.inference_mode()
def decode_step_bytes(llm: LLM, batch_size: int, context_len: int) -> int:
    """Bytes one decode step must read: non-expert weights (one embedding row per token), the experts that
    the batch's routing actually touches (counted by running the routers), and the KV cache. Quantized weights
    count the bytes they occupy on the device (repacked or GGUF blocks), not their dense size."""
    model, mc = llm.model, llm.model_config
    elem = torch.empty((), dtype=mc.dtype).element_size()
    touched: list[tuple[nn.Module, int]] = []
    hooks = [b.experts.register_forward_hook(lambda m, inp, out: touched.append((m, int(inp[2].unique().numel()))))
             for b in model.moe_blocks()]
    engine, rng = llm.engine, random.Random(2)
    slots = [engine.cache.allocate() for _ in range(batch_size)]
    try:
        ids = torch.tensor(_random_ids(batch_size, mc.vocab_size, rng), device=engine.device)
        batch = ForwardBatch.build([context_len - 1] * batch_size, [1] * batch_size, slots, engine.device)
        model(ids, batch, engine.cache)
    finally:
        for h in hooks:
            h.remove()
        for s in slots:
            engine.cache.release(s)
    bytes_ = _weight_bytes(model)
    expert_bytes = sum(n * bytes_["per_expert"][id(m)] for m, n in touched)
    kv = batch_size * context_len * 2 * mc.num_layers * mc.num_kv_heads * mc.head_dim * elem
    return bytes_["non_expert"] + batch_size * bytes_["embedding_row"] + expert_bytes + kv


def model_weight_bytes(model: nn.Module) -> int:
    """Bytes of all the model's weights as they sit in memory (quantized ones at their stored size)."""
    b = _weight_bytes(model)
    experts = sum(b["per_expert"].values()) * model.config.num_experts
    return b["non_expert"] + b["embedding_table"] + experts


def _experts_modules(model: nn.Module) -> list[nn.Module]:
    return [blk.experts for blk in model.moe_blocks()]


def _weight_bytes(model: nn.Module) -> dict:
    """non_expert: bytes of every weight outside the experts and the embedding table (a tied table counts here,
    as the output head reads it whole); embedding_table / embedding_row: the untied table and one of its rows;
    per_expert: {id(experts module): bytes of one expert}."""
    experts = _experts_modules(model)
    expert_tensors = {id(t) for m in experts for t in _module_weights(m)}
    table = model.model.embed_tokens
    tied = model.config.tie_word_embeddings
    table_weights = [] if tied else _module_weights(table)
    skip = expert_tensors | {id(t) for t in table_weights}
    seen: set[int] = set()
    non_expert = 0
    for module in model.modules():
        for t in _module_weights(module, recurse=False):
            if id(t) not in seen and id(t) not in skip:
                seen.add(id(t))
                non_expert += _nbytes(t)
    table_bytes = sum(_nbytes(t) for t in table_weights)
    rows = model.config.vocab_size
    return {"non_expert": non_expert, "embedding_table": table_bytes, "embedding_row": table_bytes // rows,
            "per_expert": {id(m): sum(_nbytes(t) for t in _module_weights(m)) // model.config.num_experts
                           for m in experts}}  # fmt: skip


def _module_weights(module: nn.Module, recurse: bool = True) -> list:
    """The module's weights: dense parameters not replaced by quantized ones, and its QuantizedWeights."""
    mods = module.modules() if recurse else [module]
    out = []
    for m in mods:
        out += [p for p in m.parameters(recurse=False)]
        out += [v for k, v in m.__dict__.items() if k.startswith("q_") and isinstance(v, QuantizedWeight)]
    return out


def _nbytes(t) -> int:
    return t.nbytes if isinstance(t, QuantizedWeight) else t.numel() * t.element_size()
