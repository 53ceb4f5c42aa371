"""What generate and chat return."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class GenerationOutput:
    """One finished request: the generated text and ids, and why it stopped ('stop' or 'length')."""

    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str
