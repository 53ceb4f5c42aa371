"""The generation loop: admits requests, runs scheduled forward passes, samples, detokenises, stops."""

from __future__ import annotations

import torch
from torch import nn

from moerun.config import EngineConfig
from moerun.device import to_device
from moerun.engine.batch import ForwardBatch
from moerun.engine.kv_cache import KVCache
from moerun.engine.pending import PendingTokens, next_input_ids
from moerun.engine.runner import ModelRunner
from moerun.engine.sampler import Sampler
from moerun.engine.scheduler import Scheduler, StepPlan
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
        # async scheduling: on by default where decode runs in CUDA graphs (the host work then overlaps the GPU),
        # except with offloaded experts behind a device cache whose admissions the host plans between steps: it
        # would plan them a step late. With no slots there is nothing to plan (a Q4_K_M at --n-cpu-moe 48's memory
        # ran 35.4 -> 36.8 tok/s); with admission on the device the host only ranks the spare slots (bf16 at 8 GiB:
        # 124 -> 135 tok/s random, 38.1 -> 39.3 skewed; benchmarks/RESULTS.md)
        self.async_scheduling = (config.async_scheduling if config.async_scheduling is not None
                                 else bool(self.runner.graphs) and not admits_between_steps(model))
        self._pending: PendingTokens | None = None
        pinned = self.device.type == "cuda"
        self._host_ids = [torch.zeros(num_slots, dtype=torch.int64, pin_memory=pinned) for _ in range(2)]
        self._next_buffer = 0

    def add_request(self, prompt_ids: list[int], params: SamplingParams, prompt: str | None = None) -> Sequence:
        """Validates and queues one request."""
        if not prompt_ids:
            raise ValueError("the prompt is empty: give at least one token")
        self._check_vocabulary(prompt_ids)
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
        return self.scheduler.has_work or self._pending is not None

    @torch.inference_mode()
    def step(self) -> list[Sequence]:
        """Runs one forward pass; returns the sequences that received a token.

        With async scheduling a decode step is launched before the previous step's tokens are read, so
        a token reaches its sequence one call later; a sequence that stops on a token the host has not read yet
        gets one extra step computed, and discarded.
        """
        plan = self.scheduler.plan()
        if plan is not None and not plan.is_prefill and self._can_decode_ahead(plan.seqs):
            return self._decode_ahead(plan.seqs)
        received = self._read_pending()
        if plan is None:
            return received
        if not plan.is_prefill:  # some may have stopped on the tokens just read
            seqs = [s for s in plan.seqs if not s.is_finished]
            if not seqs:
                return received
            plan = StepPlan(seqs, [1] * len(seqs), is_prefill=False)
        return list(dict.fromkeys(received + self._run(plan)))

    def _run(self, plan: StepPlan) -> list[Sequence]:
        """One forward pass of a plan, sampled and appended before returning (the synchronous path)."""
        ids, starts = [], []
        for seq, n in zip(plan.seqs, plan.num_new_tokens):
            start = seq.num_computed
            ids.extend(seq.token_slice(start, n))
            starts.append(start)
        batch = ForwardBatch.build(starts, plan.num_new_tokens, [s.slot for s in plan.seqs], self.device)
        input_ids = to_device(ids, self.device, torch.int64)
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
        picks = None if plan.is_prefill else self._graph_picks(seqs)
        tokens = self.sampler(logits, seqs) if picks is None else picks.tolist()
        for seq, token in zip(seqs, tokens):
            self._append(seq, token)
        return seqs

    def _append(self, seq: Sequence, token: int) -> None:
        seq.append(token, self.tokenizer, self.eos_ids, self.config.max_model_len)
        if seq.is_finished:
            self.scheduler.finish(seq)

    # ---- async scheduling (engine/pending.py) ----
    def _can_decode_ahead(self, seqs: list[Sequence]) -> bool:
        """Async scheduling applies to decode steps without repetition penalties (a penalty reads every token of
        its sequence on the host, including the one not read yet)."""
        return self.async_scheduling and all(s.params.repetition_penalty == 1.0 for s in seqs)

    def _decode_ahead(self, seqs: list[Sequence]) -> list[Sequence]:
        """Launches a decode step, then reads the previous one's tokens while the GPU runs it."""
        pending = self._pending
        rows = pending.rows() if pending is not None else {}
        # a sequence that certainly stops on its unread token (a length limit) is not launched again
        launch = [s for s in seqs if not (id(s) in rows and self._stops_by_length_after_one_more(s))]
        launched = None
        if launch:
            source_rows = [rows.get(id(s), -1) for s in launch]
            if self._continues_in_graph(launch, source_rows):
                picks = self.runner.continue_decode(len(launch))  # [B]
            else:
                host_ids = [0 if r >= 0 else s.token_slice(s.num_computed, 1)[0] for s, r in zip(launch, source_rows)]
                batch = ForwardBatch.build([s.num_computed for s in launch], [1] * len(launch),
                                           [s.slot for s in launch], self.device)  # fmt: skip
                input_ids = next_input_ids(host_ids, source_rows, pending, self.device)
                logits = self.runner.decode(input_ids, batch)  # [B, V]
                picks = self._graph_picks(launch)
                if picks is None:
                    picks = self.sampler.pick(logits, launch)  # [B]
            for seq in launch:
                seq.num_computed += 1
            buffer = self._host_ids[self._next_buffer]
            self._next_buffer ^= 1  # the pending step holds the other buffer
            launched = PendingTokens.launch(launch, picks, buffer)
        received = self._read_pending()
        self._pending = launched
        return received

    def _continues_in_graph(self, launch: list[Sequence], source_rows: list[int]) -> bool:
        """Whether this launch is the pending step's rows again, in order, all greedy, on a graph that left their
        next inputs in place (ModelRunner.can_continue): then the graph replays with nothing copied in."""
        return (self._pending is not None and len(launch) == len(self._pending.seqs)
                and source_rows == list(range(len(launch))) and all(s.params.greedy for s in launch)
                and self.runner.can_continue(len(launch)))  # fmt: skip

    def _graph_picks(self, seqs: list[Sequence]) -> torch.Tensor | None:
        """The tokens [B] that the decode graph just replayed picked, where they are what the sampler would pick:
        every row greedy, without a repetition penalty (ModelRunner.greedy_picks); else None."""
        if any(not s.params.greedy or s.params.repetition_penalty != 1.0 for s in seqs):
            return None
        return self.runner.greedy_picks(len(seqs))

    def _stops_by_length_after_one_more(self, seq: Sequence) -> bool:
        return (len(seq.output_ids) + 1 >= seq.params.max_tokens
                or seq.num_tokens + 1 >= self.config.max_model_len)

    def _read_pending(self) -> list[Sequence]:
        """Appends the tokens of the launched step not read yet; returns the sequences that took one."""
        pending, self._pending = self._pending, None
        if pending is None:
            return []
        received = []
        for seq, token in zip(pending.seqs, pending.read()):
            if seq.is_finished:  # stopped on the step before (its extra step is discarded), or aborted
                continue
            self._append(seq, token)
            received.append(seq)
        return received

    def _check_vocabulary(self, prompt_ids: list[int]) -> None:
        """Raises unless every id is in [0, vocab): the kernels never see an id outside the embedding table."""
        vocab = self.model.config.vocab_size
        bad = [t for t in prompt_ids if not 0 <= int(t) < vocab]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab})")

    @torch.inference_mode()
    def prefill_logits(self, prompt_ids: list[int]) -> torch.Tensor:
        """Logits [L, V] float32 of every position of one prompt, computed in one prefill."""
        if len(prompt_ids) > self.config.max_model_len:
            raise ValueError(f"{len(prompt_ids)} tokens exceed max_model_len {self.config.max_model_len}")
        self._check_vocabulary(prompt_ids)
        slot = self.cache.allocate()
        try:
            batch = ForwardBatch.build([0], [len(prompt_ids)], [slot], self.device)
            input_ids = torch.tensor(prompt_ids, dtype=torch.int64, device=self.device)
            hidden = self.model(input_ids, batch, self.cache)
            return self.model.compute_logits(hidden).float()
        finally:
            self.cache.release(slot)


def admits_between_steps(model: torch.nn.Module) -> bool:
    """Whether the model's experts are offloaded behind a device cache (at least one slot a layer) whose admissions
    the host plans between steps from the routing it reads back (not admitted on the device inside the step)."""
    manager = model.__dict__.get("expert_offload")
    return (manager is not None and manager.slots_per_layer > 0
            and not getattr(manager, "device_admission", False))
