"""A ``tokenizers.Tokenizer`` rebuilt from a GGUF file's ``tokenizer.ggml.*`` metadata (byte-level BPE, Qwen2 style).

The pre-tokenizer for ``tokenizer.ggml.pre = "qwen2"`` is the split regex of the Hugging Face Qwen2 tokenizer.json
(llama.cpp uses the same pattern with the ``(?i:...)`` group spelled out). Like the Hugging Face tokenizer, and
unlike llama.cpp, the text is NFC-normalised first, so ids match ``tokenizer.json`` exactly.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import tokenizers
from gguf.constants import TokenType
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors

from .reader import GGUFError

if TYPE_CHECKING:
    from .reader import GGUFFile

QWEN2_PRE_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                   r"|\s*[\r\n]+|\s+(?!\S)|\s+")
# tokenizer.ggml.pre values llama.cpp maps to its Qwen2 pre-tokenizer
PRE_TOKENIZER_REGEX = {name: QWEN2_PRE_REGEX for name in ("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez")}
# texts llama.cpp treats as end-of-generation when present in the vocabulary
EOG_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|eom_id|>", "<EOT>",
             "<|end_of_text|>")


@dataclass(frozen=True)
class GGUFTokenizerSpec:
    """What a GGUF file says about tokenization: the tokenizer, special ids and the chat template."""

    tokenizer: tokenizers.Tokenizer
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    pad_token_id: int | None
    chat_template: str | None
    add_bos: bool
    add_eos: bool = False
    unk_token_id: int | None = None


def tokenizer_from_gguf(metadata: Mapping[str, Any], source: str) -> GGUFTokenizerSpec:
    """Build the tokenizer and special-token facts from GGUF metadata (``tokenizer.ggml.model`` must be gpt2)."""
    model = metadata.get("tokenizer.ggml.model")
    if model != "gpt2":
        raise GGUFError(f"{source}: tokenizer.ggml.model is {model!r}; moerun supports 'gpt2' (byte-level BPE)")
    pre = metadata.get("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZER_REGEX:
        raise GGUFError(f"{source}: tokenizer.ggml.pre is {pre!r}; moerun supports {sorted(PRE_TOKENIZER_REGEX)}")
    tokens = _need_list(metadata, "tokenizer.ggml.tokens", source)
    merges = _need_list(metadata, "tokenizer.ggml.merges", source)
    types = metadata.get("tokenizer.ggml.token_type")
    if types is None:
        types = [TokenType.NORMAL] * len(tokens)
    elif len(types) != len(tokens):
        raise GGUFError(f"{source}: tokenizer.ggml.token_type has {len(types)} entries; expected one per token "
                        f"({len(tokens)})")
    types = types.tolist() if isinstance(types, np.ndarray) else [int(t) for t in types]

    special = {name: _token_id(metadata, f"tokenizer.ggml.{name}_token_id", len(tokens), source)
               for name in ("bos", "eos", "eot", "eom", "padding", "unknown")}
    add_bos = _flag(metadata, "tokenizer.ggml.add_bos_token", False, source)
    add_eos = _flag(metadata, "tokenizer.ggml.add_eos_token", False, source)
    tok = _build(tokens, types, merges, PRE_TOKENIZER_REGEX[pre], source)
    _add_post_processor(tok, tokens, special["bos"] if add_bos else None, special["eos"] if add_eos else None)

    eog = [special[n] for n in ("eos", "eot", "eom") if special[n] is not None]
    found = (tok.token_to_id(t) for t in EOG_TEXTS)
    eog += sorted(i for i in found if i is not None and types[i] == TokenType.CONTROL)
    template = metadata.get("tokenizer.chat_template")
    if template is not None and not isinstance(template, str):
        raise GGUFError(f"{source}: tokenizer.chat_template is {type(template).__name__}; expected a string")
    return GGUFTokenizerSpec(
        tokenizer=tok,
        bos_token_id=special["bos"],
        eos_token_ids=tuple(dict.fromkeys(eog)),
        pad_token_id=special["padding"],
        chat_template=template,
        add_bos=add_bos,
        add_eos=add_eos,
        unk_token_id=special["unknown"],
    )


def tokenizer_from_file(f: "GGUFFile") -> GGUFTokenizerSpec:
    """The tokenizer spec of an open GGUF file."""
    return tokenizer_from_gguf(f.metadata, str(f.path))


def _need_list(md: Mapping[str, Any], key: str, source: str) -> list[str]:
    v = md.get(key)
    if v is None:
        raise GGUFError(f"{source}: missing required metadata key {key!r} for a gpt2 tokenizer")
    if not isinstance(v, list) or (v and not isinstance(v[0], str)):
        raise GGUFError(f"{source}: metadata {key!r} must be an array of strings")
    return v


def _token_id(md: Mapping[str, Any], key: str, n_tokens: int, source: str) -> int | None:
    v = md.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < n_tokens:
        raise GGUFError(f"{source}: metadata {key!r} is {v!r}; expected a token id in [0, {n_tokens})")
    return v


def _flag(md: Mapping[str, Any], key: str, default: bool, source: str) -> bool:
    v = md.get(key, default)
    if not isinstance(v, bool):
        raise GGUFError(f"{source}: metadata {key!r} is {v!r}; expected a bool")
    return v


def _split_merges(merges: list[str], source: str) -> list[tuple[str, str]]:
    # llama.cpp splits at the first space after the first character; byte-level tokens never hold a raw space,
    # so a plain split is the same unless a merge starts with a space (checked in one pass over the joined text)
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    if (pairs and min(map(len, pairs)) < 2) or "\n " in "\n" + "\n".join(merges):
        for i, m in enumerate(merges):
            j = m.find(" ", 1)
            if j < 0:
                raise GGUFError(f"{source}: tokenizer.ggml.merges[{i}] = {m!r} is not two tokens separated by a space")
            pairs[i] = (m[:j], m[j + 1:])
    return pairs  # type: ignore[return-value]


def _build(tokens: list[str], types: list[int], merges: list[str], regex: str, source: str) -> tokenizers.Tokenizer:
    # a repeated string keeps its first id (the reversed zip lets earlier ids overwrite later ones)
    vocab = dict(zip(reversed(tokens), range(len(tokens) - 1, -1, -1)))
    try:
        tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=_split_merges(merges, source), fuse_unk=False,
                                              byte_fallback=False, ignore_merges=False))
    except Exception as exc:  # tokenizers reports bad merges as plain Exceptions
        raise GGUFError(f"{source}: the vocabulary and merges do not form a valid BPE model: {exc}") from None
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    # control tokens become special added tokens, user-defined ones plain added tokens; both match verbatim
    kinds = np.asarray(types)
    control = [AddedToken(tokens[i], special=True, normalized=False)
               for i in np.flatnonzero(kinds == TokenType.CONTROL).tolist()]
    user = [AddedToken(tokens[i], special=False, normalized=False)
            for i in np.flatnonzero(kinds == TokenType.USER_DEFINED).tolist()]
    tok.add_special_tokens(control)
    tok.add_tokens(user)
    for a in control + user:
        if tok.token_to_id(a.content) != vocab[a.content]:
            raise GGUFError(f"{source}: added token {a.content!r} did not keep its id {vocab[a.content]}")
    return tok


def _add_post_processor(tok: tokenizers.Tokenizer, tokens: list[str], bos: int | None, eos: int | None) -> None:
    if bos is None and eos is None:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
        return
    b = f"{tokens[bos]}:0 " if bos is not None else ""
    e = f" {tokens[eos]}:0" if eos is not None else ""
    special = [(tokens[i], i) for i in {bos, eos} if i is not None]
    tok.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single=f"{b}$A:0{e}", pair=f"{b}$A:0{e} {b}$B:1{e}", special_tokens=special),
    ])
