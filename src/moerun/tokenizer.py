"""Tokenizer: a ``tokenizers`` BPE tokenizer plus special ids, EOS ids and the chat template.

Built from a Hugging Face folder (tokenizer.json, tokenizer_config.json, generation_config.json) or from a
GGUF file's metadata. The chat template is rendered in a sandboxed Jinja environment, as transformers does.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HFTokenizer


@dataclass
class Tokenizer:
    """Encodes text, decodes ids, and renders chat messages through the model's template."""

    backend: HFTokenizer
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    pad_token_id: int | None = None
    add_bos: bool = False
    chat_template: str | None = None
    special_tokens: dict[str, str | None] = field(default_factory=dict)

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self.backend.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.add_bos and self.bos_token_id is not None:
            ids = [self.bos_token_id] + ids
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        **template_kwargs: Any,
    ) -> str:
        """Renders messages to the prompt text; template_kwargs reach the template (e.g. enable_thinking)."""
        if not self.chat_template:
            raise ValueError("this model's tokenizer has no chat template; use generate() with plain prompts")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise ValueError(f"chat message {i} must be a dict with 'role' and 'content', got {m!r}")
        template = _compiled_template(self.chat_template)
        return template.render(
            messages=messages,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            **{k: v for k, v in self.special_tokens.items() if v is not None},
            **template_kwargs,
        )

    @classmethod
    def from_folder(cls, folder: str | Path) -> "Tokenizer":
        """From a Hugging Face model folder holding tokenizer.json (+ tokenizer_config.json, generation_config.json)."""
        folder = Path(folder)
        path = folder / "tokenizer.json"
        if not path.exists():
            raise FileNotFoundError(f"{folder}: no tokenizer.json (moerun needs the fast-tokenizer file)")
        backend = HFTokenizer.from_file(str(path))
        config = _read_json(folder / "tokenizer_config.json")
        gen = _read_json(folder / "generation_config.json")

        def token_of(key: str) -> str | None:
            value = config.get(key)
            return value.get("content") if isinstance(value, dict) else value

        special = {k: token_of(k) for k in ("bos_token", "eos_token", "pad_token", "unk_token")}
        bos_id = backend.token_to_id(special["bos_token"]) if special["bos_token"] else None
        pad_id = backend.token_to_id(special["pad_token"]) if special["pad_token"] else None
        eos: list[int] = []
        gen_eos = gen.get("eos_token_id")
        for i in gen_eos if isinstance(gen_eos, list) else ([gen_eos] if gen_eos is not None else []):
            eos.append(int(i))
        if special["eos_token"] and backend.token_to_id(special["eos_token"]) is not None:
            eos.append(backend.token_to_id(special["eos_token"]))
        template = config.get("chat_template")
        if isinstance(template, list):  # a list of named templates; take the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        if template is None and (folder / "chat_template.jinja").exists():
            template = (folder / "chat_template.jinja").read_text()
        return cls(
            backend=backend,
            eos_token_ids=tuple(dict.fromkeys(eos)),
            bos_token_id=bos_id,
            pad_token_id=pad_id,
            add_bos=bool(config.get("add_bos_token", False)),
            chat_template=template,
            special_tokens=special,
        )


def _read_json(path: Path) -> dict[str, Any]:
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not valid JSON ({exc})") from None
    return data if isinstance(data, dict) else {}


_TEMPLATES: dict[str, Any] = {}


def _compiled_template(source: str) -> Any:
    """Compiles a chat template in an immutable sandbox (templates come with downloaded models)."""
    if source not in _TEMPLATES:
        from jinja2.exceptions import TemplateError
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise TemplateError(message)

        def tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
                   sort_keys: bool = False) -> str:
            return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                              sort_keys=sort_keys)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        _TEMPLATES[source] = env.from_string(source)
    return _TEMPLATES[source]
