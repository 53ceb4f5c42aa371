"""Picks the next token of each sequence from its logits: penalties, temperature, top-k, top-p, min-p."""

from __future__ import annotations

import torch

from moerun.device import to_device
from moerun.engine.sequence import Sequence
from moerun.sampling_params import SamplingParams


def apply_repetition_penalty(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """Divides positive (multiplies negative) logits of tokens already seen, per sequence (as transformers)."""
    for row, seq in enumerate(seqs):
        penalty = seq.params.repetition_penalty
        if penalty == 1.0:
            continue
        seen = torch.tensor(sorted(set(seq.all_ids)), dtype=torch.int64, device=logits.device)
        scores = logits[row, seen]
        logits[row, seen] = torch.where(scores < 0, scores * penalty, scores / penalty)
    return logits


def filter_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Probabilities [B, V] after each row's temperature, top-k, top-p and min-p.

    Which filters run is decided from the host-side params, so sampling never waits on the device.
    """
    dev = logits.device
    temperature = to_device([p.temperature for p in params], dev, torch.float32)  # [B]
    logits = logits / temperature[:, None]
    V = logits.shape[-1]
    if any(p.top_k > 0 or p.top_p < 1 for p in params):
        top_k = to_device([p.top_k if p.top_k > 0 else V for p in params], dev, torch.int64)  # [B]
        top_p = to_device([p.top_p for p in params], dev, torch.float32)  # [B]
        sorted_logits, order = logits.sort(dim=-1, descending=True)  # [B, V]
        rank = torch.arange(V, device=dev)[None, :]
        sorted_logits = sorted_logits.masked_fill(rank >= top_k[:, None], float("-inf"))
        sorted_probs = sorted_logits.softmax(dim=-1)
        before = sorted_probs.cumsum(dim=-1) - sorted_probs  # mass of strictly more likely tokens
        sorted_logits = sorted_logits.masked_fill(before >= top_p[:, None], float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    probs = logits.softmax(dim=-1)
    if any(p.min_p > 0 for p in params):
        min_p = to_device([p.min_p for p in params], dev, torch.float32)  # [B]
        threshold = min_p[:, None] * probs.max(dim=-1, keepdim=True).values
        probs = probs.masked_fill(probs < threshold, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


class Sampler:
    """Samples one token per row; rows with a seed use their own generator, so they are reproducible."""

    def __init__(self, device: torch.device, seed: int | None = None) -> None:
        self.device = device
        self.generator = torch.Generator(device=device)
        if seed is not None:
            self.generator.manual_seed(seed)
        else:
            self.generator.seed()

    def generator_for(self, seed: int | None) -> torch.Generator | None:
        if seed is None:
            return None
        g = torch.Generator(device=self.device)
        g.manual_seed(seed)
        return g

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
        """logits [B, V] float32 -> one token id per sequence."""
        return self.pick(logits, seqs).tolist()

    def pick(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """logits [B, V] float32 -> token ids [B] int64 on the logits' device, without waiting for the device
        (a repetition penalty reads each sequence's tokens on the host, so they must all be there)."""
        logits = apply_repetition_penalty(logits.float(), seqs)
        tokens = logits.argmax(dim=-1)  # [B], the greedy choice
        sampled_rows = [i for i, s in enumerate(seqs) if not s.params.greedy]
        if sampled_rows:
            rows = to_device(sampled_rows, logits.device, torch.int64)
            probs = filter_probs(logits[rows], [seqs[i].params for i in sampled_rows])  # [S, V]
            picks = torch.empty(len(sampled_rows), dtype=torch.int64, device=logits.device)  # [S]
            shared = [j for j, i in enumerate(sampled_rows) if seqs[i].generator is None]
            if shared:  # rows without a seed share the engine's generator: one draw for all of them
                at = to_device(shared, logits.device, torch.int64)
                picks[at] = torch.multinomial(probs[at], 1, generator=self.generator).squeeze(1)
            for j, i in enumerate(sampled_rows):
                if seqs[i].generator is not None:  # a seeded row draws from its own generator
                    picks[j] = torch.multinomial(probs[j], 1, generator=seqs[i].generator)[0]
            tokens[rows] = picks
        return tokens
