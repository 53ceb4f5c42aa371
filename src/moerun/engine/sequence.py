"""A request in flight: its tokens, its KV-cache slot, incremental detokenisation and stop conditions."""

from __future__ import annotations

import itertools
from enum import Enum

import torch

from moerun.sampling_params import SamplingParams
from moerun.tokenizer import Tokenizer

_ids = itertools.count()


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """Prompt + generated ids; ``text`` is the decoded output with stop strings applied."""

    def __init__(self, prompt_ids: list[int], params: SamplingParams, prompt: str | None = None):
        self.id = next(_ids)
        self.prompt = prompt
        self.prompt_ids = list(prompt_ids)
        self.params = params
        self.output_ids: list[int] = []
        self.status = Status.WAITING
        self.finish_reason: str | None = None
        self.slot: int | None = None
        self.num_computed = 0  # tokens already written to the KV cache
        self.text = ""
        self._emitted = 0  # characters of text handed out by take_delta
        self._prefix_offset = 0
        self._read_offset = 0
        self.generator: torch.Generator | None = None

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def token_slice(self, start: int, n: int) -> list[int]:
        """Tokens [start, start + n) of prompt + output, without copying the whole sequence."""
        P = len(self.prompt_ids)
        if start >= P:
            return self.output_ids[start - P : start - P + n]
        head = self.prompt_ids[start : start + n]
        return head + self.output_ids[: n - len(head)]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def is_finished(self) -> bool:
        return self.status == Status.FINISHED

    def append(self, token: int, tokenizer: Tokenizer, eos_ids: tuple[int, ...], max_len: int) -> None:
        """Adds a sampled token, extends the text, and finishes the sequence on EOS, stop or length."""
        self.output_ids.append(token)
        p = self.params
        if token in p.stop_token_ids or (token in eos_ids and not p.ignore_eos):
            self._finish("stop")
            return
        before = len(self.text)
        if p.detokenize:
            self._extend_text(tokenizer)
        if p.stop_strings and self._apply_stop_strings(before):
            return
        if len(self.output_ids) >= p.max_tokens or self.num_tokens >= max_len:
            self._finish("length")

    def _extend_text(self, tokenizer: Tokenizer) -> None:
        # Decode a short window so that multi-token characters appear only when complete.
        skip = self.params.skip_special_tokens
        ids = self.output_ids
        prefix = tokenizer.decode(ids[self._prefix_offset : self._read_offset], skip)
        full = tokenizer.decode(ids[self._prefix_offset :], skip)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.text += full[len(prefix) :]
            self._prefix_offset, self._read_offset = self._read_offset, len(ids)

    def _apply_stop_strings(self, before: int) -> bool:
        """Finishes at the first stop string that the text added after position `before` completes (a step may add
        many characters at once: a multi-token character held back until whole)."""
        stops = self.params.stop_strings
        window = before - (max(len(s) for s in stops) - 1)
        hits = [(self.text.find(s, max(window, 0)), s) for s in stops]
        hits = [(i, s) for i, s in hits if i >= 0]
        if not hits:
            return False
        index, stop = min(hits)
        self.text = self.text[: index + (len(stop) if self.params.include_stop_str_in_output else 0)]
        self._finish("stop")
        return True

    def _finish(self, reason: str) -> None:
        self.status = Status.FINISHED
        self.finish_reason = reason

    def take_delta(self) -> str:
        """Text not yet handed out; while running, holds back a tail that could still become a stop string."""
        end = len(self.text)
        if not self.is_finished and self.params.stop_strings:
            end -= max(len(s) for s in self.params.stop_strings) - 1
        if end <= self._emitted:
            return ""
        delta = self.text[self._emitted : end]
        self._emitted = end
        return delta
