"""Generation behaviour: batching, sampling, seeds, stops, streaming, and the errors for bad requests."""

from __future__ import annotations

import random

import pytest

from moerun import SamplingParams

GREEDY = dict(temperature=0, ignore_eos=True)


def random_prompt(n: int) -> list[int]:
    return [random.randrange(1000) for _ in range(n)]


def test_batch_of_different_lengths_equals_each_alone(tiny_llm):
    prompts = [random_prompt(n) for n in (3, 17, 1, 9, 30)]
    params = SamplingParams(max_tokens=12, **GREEDY)
    batched = tiny_llm.generate(prompts, params)
    for prompt, out in zip(prompts, batched):
        alone = tiny_llm.generate([prompt], params)[0]
        assert out.token_ids == alone.token_ids
        assert out.prompt_token_ids == prompt


def test_more_prompts_than_slots_and_chunked_prefill(tiny_checkpoint):
    from moerun import LLM

    small = LLM(str(tiny_checkpoint), device="cpu", max_model_len=128, max_num_seqs=2, max_num_batched_tokens=8)
    prompts = [random_prompt(n) for n in (20, 5, 11)]
    params = SamplingParams(max_tokens=5, **GREEDY)
    outs = small.generate(prompts, params)
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == small.generate([prompt], params)[0].token_ids
    assert small.engine.cache.num_free == 2  # every slot came back


def test_seeded_sampling_is_reproducible(tiny_llm):
    prompt = random_prompt(6)
    params = SamplingParams(max_tokens=16, temperature=1.2, top_p=0.9, top_k=50, seed=1234, ignore_eos=True)
    a = tiny_llm.generate([prompt], params)[0].token_ids
    b = tiny_llm.generate([prompt], params)[0].token_ids
    assert a == b
    c = tiny_llm.generate([prompt], SamplingParams(max_tokens=16, temperature=1.2, seed=99, ignore_eos=True))
    assert len(c[0].token_ids) == 16


def test_top_k_1_equals_greedy(tiny_llm):
    prompt = random_prompt(8)
    greedy = tiny_llm.generate([prompt], SamplingParams(max_tokens=10, **GREEDY))[0].token_ids
    top1 = tiny_llm.generate([prompt], SamplingParams(max_tokens=10, temperature=0.8, top_k=1, ignore_eos=True))
    assert top1[0].token_ids == greedy


def test_max_tokens_and_finish_reason(tiny_llm):
    out = tiny_llm.generate(["Hello"], SamplingParams(max_tokens=7, **GREEDY))[0]
    assert len(out.token_ids) == 7 and out.finish_reason == "length"


def test_stop_token_ids_and_eos(tiny_llm):
    prompt = random_prompt(5)
    free = tiny_llm.generate([prompt], SamplingParams(max_tokens=10, **GREEDY))[0].token_ids
    stop_at = free[3]
    out = tiny_llm.generate([prompt], SamplingParams(max_tokens=10, temperature=0, stop_token_ids=[stop_at]))[0]
    assert out.token_ids == free[: free.index(stop_at) + 1]
    assert out.finish_reason == "stop"


def test_stop_strings_cut_the_text(tiny_llm):
    prompt = random_prompt(4)
    full = tiny_llm.generate([prompt], SamplingParams(max_tokens=20, **GREEDY))[0]
    assert len(full.text) > 6
    stop = full.text[3:6]
    cut = tiny_llm.generate([prompt], SamplingParams(max_tokens=20, stop=[stop], **GREEDY))[0]
    assert cut.finish_reason == "stop"
    assert cut.text == full.text[: full.text.index(stop)]
    kept = tiny_llm.generate(
        [prompt], SamplingParams(max_tokens=20, stop=stop, include_stop_str_in_output=True, **GREEDY)
    )[0]
    assert kept.text == full.text[: full.text.index(stop) + len(stop)]


def test_stream_concatenates_to_generate_text(tiny_llm):
    params = SamplingParams(max_tokens=24, **GREEDY)
    whole = tiny_llm.generate(["Once upon a time"], params)[0].text
    pieces = list(tiny_llm.stream("Once upon a time", params))
    assert "".join(pieces) == whole
    assert len(pieces) > 1


def test_stream_with_stop_string_never_leaks_it(tiny_llm):
    full = tiny_llm.generate(["abc"], SamplingParams(max_tokens=20, **GREEDY))[0].text
    stop = full[5:8]
    pieces = list(tiny_llm.stream("abc", SamplingParams(max_tokens=20, stop=[stop], **GREEDY)))
    assert "".join(pieces) == full[: full.index(stop)]


def test_repetition_penalty_rule():
    import torch

    from moerun.engine.sampler import apply_repetition_penalty
    from moerun.engine.sequence import Sequence

    logits = torch.randn(2, 50)
    seqs = [Sequence([3, 7, 7], SamplingParams(repetition_penalty=2.0)), Sequence([3], SamplingParams())]
    seqs[0].output_ids = [11]
    out = apply_repetition_penalty(logits.clone(), seqs)
    for t in range(50):
        v = logits[0, t]
        expected = (v * 2 if v < 0 else v / 2) if t in (3, 7, 11) else v
        assert torch.equal(out[0, t], expected)
    assert torch.equal(out[1], logits[1])


def test_min_p_one_keeps_only_the_top_token(tiny_llm):
    prompt = random_prompt(5)
    greedy = tiny_llm.generate([prompt], SamplingParams(max_tokens=8, **GREEDY))[0].token_ids
    out = tiny_llm.generate([prompt], SamplingParams(max_tokens=8, temperature=1.0, min_p=1.0, ignore_eos=True))
    assert out[0].token_ids == greedy


def test_prompt_longer_than_context_is_a_clear_error(tiny_llm):
    with pytest.raises(ValueError, match="the prompt has 600 tokens but the context holds 512"):
        tiny_llm.generate([[1] * 600], SamplingParams(max_tokens=4))


def test_generation_stops_at_context_end(tiny_llm):
    out = tiny_llm.generate([[5] * 505], SamplingParams(max_tokens=50, **GREEDY))[0]
    assert len(out.token_ids) == 7 and out.finish_reason == "length"


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(max_tokens=0), "max_tokens must be an integer >= 1"),
        (dict(temperature=-0.1), "temperature must be >= 0"),
        (dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
        (dict(top_p=1.5), r"top_p must be in \(0, 1\]"),
        (dict(top_k=-5), "top_k must be -1 or 0"),
        (dict(min_p=2.0), r"min_p must be in \[0, 1\]"),
        (dict(repetition_penalty=0.0), "repetition_penalty must be > 0"),
        (dict(stop=[""]), "stop must be non-empty strings"),
    ],
)
def test_bad_sampling_params(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_bad_prompts(tiny_llm):
    with pytest.raises(ValueError, match="the prompt is empty"):
        tiny_llm.generate([[]], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tiny_llm.generate([[10**7]], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tiny_llm.logits([1, -1])
    with pytest.raises(ValueError, match="got 2 SamplingParams for 1 prompts"):
        tiny_llm.generate(["a"], [SamplingParams(), SamplingParams()])
    assert tiny_llm.engine.cache.num_free == tiny_llm.engine.cache.num_slots


def test_filter_probs_per_row_settings():
    import torch

    from moerun.engine.sampler import filter_probs

    logits = torch.randn(4, 64)
    params = [SamplingParams(top_k=3), SamplingParams(top_p=1e-6), SamplingParams(), SamplingParams(min_p=0.5)]
    probs = filter_probs(logits.clone(), params)
    assert int((probs[0] > 0).sum()) == 3 and set(probs[0].nonzero().flatten().tolist()) == set(
        logits[0].topk(3).indices.tolist())
    assert int((probs[1] > 0).sum()) == 1 and int(probs[1].argmax()) == int(logits[1].argmax())
    assert torch.allclose(probs[2], logits[2].softmax(-1))
    full = logits[3].softmax(-1)
    assert torch.equal(probs[3] > 0, full >= 0.5 * full.max())
    assert torch.allclose(probs.sum(-1), torch.ones(4))


def test_stop_string_inside_text_added_at_once():
    # A step may add many characters at once (a character held back until its last token came): the first stop
    # string in them ends the text, however far back it starts.
    from moerun.engine.sequence import Sequence

    class Chunks:  # token i decodes to chunks[i]; token 0 alone is an incomplete character
        chunks = ["\ufffd", "x" + "***" + "y" * 60 + "***"]

        def decode(self, ids, skip_special_tokens=True):
            return "".join(self.chunks[i] for i in ids) if ids != [0] else "\ufffd"

    seq = Sequence([1], SamplingParams(max_tokens=10, stop=["***"]))
    seq.append(0, Chunks(), (), 100)
    assert seq.text == "" and not seq.is_finished
    seq.append(1, Chunks(), (), 100)
    assert seq.is_finished and seq.finish_reason == "stop" and seq.text.startswith("\ufffdx")
    assert "*" not in seq.text
