"""The tokenizer wrapper and chat template against transformers' tokenizer on the real Qwen3 files."""

from __future__ import annotations

import pytest

from moerun.models.tiny import qwen3_tokenizer_dir
from moerun.tokenizer import Tokenizer

TEXTS = [
    "Hello, world!",
    "  leading and   inner   spaces\n\n\ttabs",
    "数字 12345 和中文，emoji 🙂👍🏽, combining é vs é",
    "def f(x):\n    return x ** 2  # code",
    "<|im_start|>user\nhi<|im_end|>",
]

CONVERSATIONS = [
    [{"role": "user", "content": "What is 2+2?"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "<think>\nsay hi\n</think>\n\nHello."},
        {"role": "user", "content": "Name a colour."},
    ],
]


@pytest.fixture(scope="module")
def pair():
    transformers = pytest.importorskip("transformers")
    folder = qwen3_tokenizer_dir()
    return Tokenizer.from_folder(folder), transformers.AutoTokenizer.from_pretrained(str(folder))


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_match_transformers(pair, text):
    ours, theirs = pair
    ids = ours.encode(text)
    assert ids == theirs.encode(text)
    assert ours.decode(ids, skip_special_tokens=False) == theirs.decode(ids, skip_special_tokens=False)
    assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("conversation", CONVERSATIONS)
@pytest.mark.parametrize("enable_thinking", [True, False])
def test_chat_template_matches_transformers(pair, conversation, enable_thinking):
    ours, theirs = pair
    expected = theirs.apply_chat_template(
        conversation, tokenize=False, add_generation_prompt=True, enable_thinking=enable_thinking
    )
    assert ours.apply_chat_template(conversation, enable_thinking=enable_thinking) == expected


def test_chat_template_with_tools(pair):
    ours, theirs = pair
    tools = [{"type": "function", "function": {"name": "now", "description": "time", "parameters": {}}}]
    conv = CONVERSATIONS[0]
    expected = theirs.apply_chat_template(conv, tools=tools, tokenize=False, add_generation_prompt=True)
    assert ours.apply_chat_template(conv, tools=tools) == expected


def test_eos_ids_and_bad_messages(pair):
    ours, _ = pair
    assert ours.token_to_id("<|im_end|>") in ours.eos_token_ids
    with pytest.raises(ValueError, match="chat message 0 must be a dict with 'role' and 'content'"):
        ours.apply_chat_template([{"text": "hi"}])


def test_template_sandbox_blocks_attribute_escape(pair):
    from jinja2.exceptions import SecurityError

    ours, _ = pair
    evil = Tokenizer(ours.backend, chat_template="{{ messages.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(SecurityError):
        evil.apply_chat_template([{"role": "user", "content": "x"}])
