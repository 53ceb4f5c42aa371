"""The generation loop: admits requests, runs scheduled forward passes, samples, detokenises, stops."""

from __future__ import annotations

import torch
from torch import nn

from moerun.config import EngineConfig
from moerun.engine.batch import ForwardBatch
from moerun.engine.kv_cache import KVCache
from moerun.engine.runner import ModelRunner
from moerun.engine.sampler import Sampler
from moerun.engine.scheduler import Scheduler
from moerun.engine.sequence import Sequence
from moerun.sampling_params import SamplingParams
from moerun.tokenizer import Tokenizer


class Engine:
    """Owns the model, the KV cache, the scheduler and the sampler of one LLM."""

    def __init__(self, model: nn.Module, tokenizer: Tokenizer, config: EngineConfig, num_slots: int) -> None:
        self.model, self.tokenizer, self.config = model, tokenizer, config
        mc = model.config
        self.device = config.device
        self.cache = KVCache(mc.num_layers, num_slots, config.max_model_len, mc.num_kv_heads, mc.head_dim,
                             mc.dtype, self.device)
        self.scheduler = Scheduler(self.cache, config.max_num_batched_tokens)
        self.runner = ModelRunner(model, self.cache, num_slots, use_graphs=config.cuda_graphs)
        self.runner.capture(config.max_num_batched_tokens)
        self.sampler = Sampler(self.device, config.seed)
        self.eos_ids = tuple(dict.fromkeys(tokenizer.eos_token_ids + mc.eos_token_ids))

    def add_request(self, prompt_ids: list[int], params: SamplingParams, prompt: str | None = None) -> Sequence:
        """Validates and queues one request."""
        if not prompt_ids:
            raise ValueError("the prompt is empty: give at least one token")
        vocab = self.model.config.vocab_size
        bad = [t for t in prompt_ids if not 0 <= int(t) < vocab]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        limit = self.config.max_model_len
        if len(prompt_ids) >= limit:
            raise ValueError(
                f"the prompt has {len(prompt_ids)} tokens but the context holds {limit} "
                f"(max_model_len); shorten the prompt or raise max_model_len"
            )
        seq = Sequence(prompt_ids, params, prompt)
        seq.generator = self.sampler.generator_for(params.seed)
        offload = self.model.__dict__.get("expert_offload")
        if offload is not None:  # expert offloading: a new request starts a new activation record
            offload.new_request()
        self.scheduler.add(seq)
        return seq

    def abort(self, seq: Sequence) -> None:
        self.scheduler.finish(seq)
        seq.finish_reason = seq.finish_reason or "abort"

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    @torch.inference_mode()
    def step(self) -> list[Sequence]:
        """Runs one forward pass; returns the sequences that received a token."""
        plan = self.scheduler.plan()
        if plan is None:
            return []
        ids, starts = [], []
        for seq, n in zip(plan.seqs, plan.num_new_tokens):
            start = seq.num_computed
            ids.extend(seq.token_slice(start, n))
            starts.append(start)
        batch = ForwardBatch.build(starts, plan.num_new_tokens, [s.slot for s in plan.seqs], self.device)
        input_ids = torch.tensor(ids, dtype=torch.int64, device=self.device)
        for seq, n in zip(plan.seqs, plan.num_new_tokens):
            seq.num_computed += n
        ready = [i for i, s in enumerate(plan.seqs) if s.num_computed >= len(s.prompt_ids)]
        if plan.is_prefill:
            if not ready:
                self.runner.prefill(input_ids, batch, batch.last_rows[:0])  # fills the KV cache only
                return []
            logits = self.runner.prefill(input_ids, batch, batch.last_rows[ready])
        else:
            logits = self.runner.decode(input_ids, batch)  # [B, V]
        seqs = [plan.seqs[i] for i in ready]
        tokens = self.sampler(logits, seqs)
        for seq, token in zip(seqs, tokens):
            seq.append(token, self.tokenizer, self.eos_ids, self.config.max_model_len)
            if seq.is_finished:
                self.scheduler.finish(seq)
        return seqs

    @torch.inference_mode()
    def prefill_logits(self, prompt_ids: list[int]) -> torch.Tensor:
        """Logits [L, V] float32 of every position of one prompt, computed in one prefill."""
        if len(prompt_ids) > self.config.max_model_len:
            raise ValueError(f"{len(prompt_ids)} tokens exceed max_model_len {self.config.max_model_len}")
        slot = self.cache.allocate()
        try:
            batch = ForwardBatch.build([0], [len(prompt_ids)], [slot], self.device)
            input_ids = torch.tensor(prompt_ids, dtype=torch.int64, device=self.device)
            hidden = self.model(input_ids, batch, self.cache)
            return self.model.compute_logits(hidden).float()
        finally:
            self.cache.release(slot)
