"""The tokenizer rebuilt from a GGUF written with the real Qwen3 vocabulary matches tokenizer.json."""

from __future__ import annotations

import json
import time

import pytest
from gguf import GGUFWriter
from gguf.constants import GGUFValueType, TokenType
from tokenizers import Tokenizer

from gguf_testutil import tiny_config, tokenizer_dir
from moerun.formats.gguf.reader import GGUFError, GGUFFile
from moerun.formats.gguf.tokenizer import tokenizer_from_gguf
from moerun.formats.gguf.writer import gguf_metadata

TEXTS = [
    "Hello, world! How are you today?",
    "你好，世界。今天天气很好。こんにちは世界、안녕하세요",
    "emoji 😀👍🏽 family 👨‍👩‍👧‍👦 flag 🇯🇵 ZWJ 😶‍🌫️ llama 🦙🦙",
    "combining: e\u0301 cafe\u0301 n\u0303 A\u030a vs café Å; ligature ﬁ; Kelvin \u212a",
    "   leading spaces, trailing   \t\ttabs\t \n\n\n  blank lines \r\n windows\r\n",
    "digits 1234567890 3.14159 -42 1e-6 2024-06-01 ١٢٣ ５６",
    "def fib(n: int) -> int:\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)  # 🐍\n",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    "<think>\n\n</think>\n\nHello!<|im_end|><|endoftext|>",
    "I'm sure they'LL say WE'RE done, isn't it? don't 'd 's",
    "",
    "\u00a0non-breaking\u2009thin\u3000ideographic space",
    "<|im_start|user without closing and <tool_call>{\"a\": 1}</tool_call>",
]


@pytest.fixture(scope="session")
def writer_metadata():
    """The writer's metadata for a Qwen3-sized config and the real tokenizer folder."""
    config = tiny_config(vocab_size=151936, bos_token_id=151643, eos_token_ids=(151645,), pad_token_id=151643)
    return gguf_metadata(config, 15, tokenizer_dir=tokenizer_dir())


@pytest.fixture(scope="session")
def vocab_gguf(tmp_path_factory, writer_metadata):
    """A tensor-less GGUF holding the real Qwen3 vocabulary, merges and chat template."""
    path = tmp_path_factory.mktemp("vocab") / "qwen3-vocab.gguf"
    w = GGUFWriter(path, "qwen3moe")
    for key, v in writer_metadata.items():
        if key.startswith("tokenizer."):
            w.add_key_value(key, v.value, v.type, v.sub_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="session")
def spec(vocab_gguf):
    with GGUFFile(vocab_gguf) as f:
        return tokenizer_from_gguf(f.metadata, str(vocab_gguf))


@pytest.fixture(scope="session")
def hf():
    return Tokenizer.from_file(str(tokenizer_dir() / "tokenizer.json"))


@pytest.mark.parametrize("text", TEXTS)
def test_ids_match_tokenizer_json(spec, hf, text):
    ours = spec.tokenizer.encode(text).ids
    assert ours == hf.encode(text).ids
    assert spec.tokenizer.decode(ours, skip_special_tokens=False) == hf.decode(ours, skip_special_tokens=False)
    assert spec.tokenizer.decode(ours) == hf.decode(ours)


def test_digits_split_one_by_one(spec):
    enc = spec.tokenizer.encode("12345")
    assert enc.tokens == ["1", "2", "3", "4", "5"]


def test_special_tokens_and_template(spec, vocab_gguf):
    tok = spec.tokenizer
    assert tok.encode("<|im_start|>").ids == [151644]
    assert tok.decode([151644, 872, 151645]) == "user"  # control tokens are special: skipped when decoding
    assert tok.decode([151667]) == "<think>"  # user-defined tokens are not
    assert spec.eos_token_ids[0] == 151645 and 151643 in spec.eos_token_ids  # eos, then <|endoftext|>
    assert spec.pad_token_id == 151643 and spec.add_bos is False
    assert spec.bos_token_id == 151643  # from the model config: tokenizer_config.json has bos_token null
    cfg = json.loads((tokenizer_dir() / "tokenizer_config.json").read_text())
    assert spec.chat_template == cfg["chat_template"]
    with GGUFFile(vocab_gguf) as f:
        md = f.metadata
        assert md["tokenizer.ggml.model"] == "gpt2" and md["tokenizer.ggml.pre"] == "qwen2"
        assert len(md["tokenizer.ggml.tokens"]) == 151936
        types = md["tokenizer.ggml.token_type"]
        assert types[151644] == TokenType.CONTROL and types[151667] == TokenType.USER_DEFINED
        assert types[100] == TokenType.NORMAL and types[151700] == TokenType.UNUSED
        assert md["tokenizer.ggml.tokens"][151700] == "[PAD151700]"


def test_open_and_build_are_fast(vocab_gguf):
    t0 = time.perf_counter()
    with GGUFFile(vocab_gguf) as f:
        t1 = time.perf_counter()
        tokenizer_from_gguf(f.metadata, "v")
    t2 = time.perf_counter()
    # measured ~0.3 s to open and ~1 s to build on a loaded 2-core machine; gguf.GGUFReader needs ~17 s to open
    assert t1 - t0 < 5.0 and t2 - t1 < 10.0


def test_add_bos_template(spec, vocab_gguf):
    with GGUFFile(vocab_gguf) as f:
        md = dict(f.metadata)
    md.update({"tokenizer.ggml.add_bos_token": True, "tokenizer.ggml.bos_token_id": 151643})
    s = tokenizer_from_gguf(md, "v")
    assert s.add_bos and s.tokenizer.encode("hi").ids == [151643] + spec.tokenizer.encode("hi").ids


def test_tokenizer_errors(vocab_gguf):
    with GGUFFile(vocab_gguf) as f:
        md = dict(f.metadata)
    with pytest.raises(GGUFError, match="v: tokenizer.ggml.model is 'llama'; moerun supports 'gpt2'"):
        tokenizer_from_gguf({**md, "tokenizer.ggml.model": "llama"}, "v")
    with pytest.raises(GGUFError, match="tokenizer.ggml.pre is 'llama-bpe'; moerun supports .*'qwen2'"):
        tokenizer_from_gguf({**md, "tokenizer.ggml.pre": "llama-bpe"}, "v")
    with pytest.raises(GGUFError, match="missing required metadata key 'tokenizer.ggml.merges'"):
        tokenizer_from_gguf({k: v for k, v in md.items() if k != "tokenizer.ggml.merges"}, "v")
    with pytest.raises(GGUFError, match="'tokenizer.ggml.eos_token_id' is 999999; expected a token id in"):
        tokenizer_from_gguf({**md, "tokenizer.ggml.eos_token_id": 999999}, "v")
    with pytest.raises(GGUFError, match=r"tokenizer.ggml.merges\[0\] = 'ab' is not two tokens"):
        tokenizer_from_gguf({**md, "tokenizer.ggml.merges": ["ab"]}, "v")


def test_writer_metadata_like_the_converter(writer_metadata):
    value = {k: v.value for k, v in writer_metadata.items()}
    assert value["tokenizer.ggml.model"] == "gpt2" and value["tokenizer.ggml.pre"] == "qwen2"
    assert len(value["tokenizer.ggml.tokens"]) == 151936 and len(value["tokenizer.ggml.merges"]) == 151387
    assert value["tokenizer.ggml.bos_token_id"] == 151643  # from the config: tokenizer_config.json has none
    assert value["tokenizer.ggml.eos_token_id"] == 151645 and value["tokenizer.ggml.add_bos_token"] is False
    assert value["tokenizer.chat_template"].startswith("{%- if tools %}")
    assert value["general.file_type"] == 15 and "general.architecture" not in value
    assert value["qwen3moe.vocab_size"] == 151936
    assert writer_metadata["tokenizer.ggml.token_type"].sub_type == GGUFValueType.INT32
