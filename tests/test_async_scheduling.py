"""Async scheduling (engine/pending.py): launching each greedy decode step before the previous step's tokens are
read changes nothing in what is generated; it is compared with the synchronous engine on the CPU, where the same
code path runs eagerly."""

from __future__ import annotations

import random

import pytest
import torch

from moerun import LLM, SamplingParams
from moerun.engine.pending import PendingTokens, next_input_ids


@pytest.fixture(scope="module")
def pair(tiny_checkpoint):
    kw = dict(device="cpu", max_model_len=96, max_num_seqs=4, max_num_batched_tokens=64)
    return (LLM(str(tiny_checkpoint), async_scheduling=True, **kw),
            LLM(str(tiny_checkpoint), async_scheduling=False, **kw))


def _prompts(rng: random.Random, n: int) -> list[list[int]]:
    return [[rng.randrange(1000, 20000) for _ in range(rng.randrange(1, 40))] for _ in range(n)]


def _same(a, b) -> None:
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert [o.finish_reason for o in a] == [o.finish_reason for o in b]
    assert [o.text for o in a] == [o.text for o in b]


def test_async_is_on_where_asked_and_off_by_default_without_graphs(pair, tiny_llm):
    assert pair[0].engine.async_scheduling and not pair[1].engine.async_scheduling
    assert not tiny_llm.engine.async_scheduling  # CPU: no CUDA graphs, so off unless asked


def test_greedy_batches_equal_the_synchronous_engine(pair):
    rng = random.Random()  # fresh prompts every run
    prompts = _prompts(rng, 7)  # more prompts than slots: prefills interleave with pending decode steps
    params = [SamplingParams(max_tokens=rng.randrange(1, 12), temperature=0) for _ in prompts]
    _same(pair[0].generate(prompts, params), pair[1].generate(prompts, params))
    for llm in pair:
        assert llm.engine.cache.num_free == 4 and not llm.engine.has_work


def test_stops_on_tokens_not_read_yet(pair):
    rng = random.Random()
    prompt = _prompts(rng, 1)[0]
    free = pair[1].generate([prompt], SamplingParams(max_tokens=12, temperature=0))[0].token_ids
    stop_at = free[rng.randrange(1, 8)]
    params = [SamplingParams(max_tokens=12, temperature=0, stop_token_ids=[stop_at]),
              SamplingParams(max_tokens=12, temperature=0)]
    outs = pair[0].generate([prompt, prompt], params)
    _same(outs, pair[1].generate([prompt, prompt], params))
    assert outs[0].finish_reason == "stop" and outs[0].token_ids[-1] == stop_at
    assert outs[1].token_ids == free


def test_seeded_sampling_equals_the_synchronous_engine(pair):
    rng = random.Random()
    prompts = _prompts(rng, 5)
    params = [SamplingParams(max_tokens=rng.randrange(2, 14), temperature=rng.choice([0.7, 1.0]),
                             top_p=rng.choice([0.9, 1.0]), top_k=rng.choice([-1, 40]), seed=rng.randrange(10**6))
              for _ in prompts]  # each row draws from its own generator, in the same order either way
    params[1] = SamplingParams(max_tokens=9, temperature=0)  # a greedy row in the same steps
    _same(pair[0].generate(prompts, params), pair[1].generate(prompts, params))


def test_context_end_and_mixed_sampling(pair):
    rng = random.Random()
    near_end = [rng.randrange(1000, 20000) for _ in range(90)]  # 96-token context: 6 tokens left
    params = [SamplingParams(max_tokens=50, temperature=0),
              SamplingParams(max_tokens=9, temperature=0.8, seed=3),
              SamplingParams(max_tokens=7, temperature=0, repetition_penalty=1.3)]  # steps with it run synchronously
    prompts = [near_end] + _prompts(rng, 2)
    outs = pair[0].generate(prompts, params)
    _same(outs, pair[1].generate(prompts, params))
    assert len(outs[0].token_ids) == 6 and outs[0].finish_reason == "length"


def test_stream_and_abort(pair):
    llm = pair[0]
    text = "".join(llm.stream("Hello there", SamplingParams(max_tokens=9, temperature=0)))
    assert text == pair[1].generate(["Hello there"], SamplingParams(max_tokens=9, temperature=0))[0].text
    engine = llm.engine
    seq = engine.add_request([11, 12, 13], SamplingParams(max_tokens=30, temperature=0))
    for _ in range(4):
        engine.step()
    engine.abort(seq)  # while a step of it is pending
    while engine.has_work:
        engine.step()
    assert seq.finish_reason == "abort" and len(seq.output_ids) <= 3
    assert engine.cache.num_free == 4


def test_next_input_ids_mixes_pending_and_known_tokens():
    picks = torch.randint(0, 1000, (5,))
    pending = PendingTokens([object()] * 5, picks, picks.clone(), None)
    out = next_input_ids([7, 0, 9, 0], [-1, 3, -1, 0], pending, torch.device("cpu"))
    assert out.tolist() == [7, picks[3].item(), 9, picks[0].item()]
    assert next_input_ids([4, 5], [-1, -1], None, torch.device("cpu")).tolist() == [4, 5]
    # every row the pending row of the same index: the picks themselves, no copy
    assert next_input_ids([0] * 5, [0, 1, 2, 3, 4], pending, torch.device("cpu")) is picks
    assert next_input_ids([0] * 4, [0, 1, 2, 3], pending, torch.device("cpu")).tolist() == picks[:4].tolist()


def test_default_is_off_only_behind_an_expert_cache_the_host_fills() -> None:
    # a device cache of experts whose admissions the host plans from each step's routing would plan them a step late
    # under async scheduling; with no slots a layer (every expert staged or read from host memory) there is nothing
    # to plan, and with admission on the device the host only ranks spare slots, so the default stays on there
    from types import SimpleNamespace

    from moerun.engine.engine import admits_between_steps

    model = torch.nn.Linear(1, 1)
    assert not admits_between_steps(model)
    model.__dict__["expert_offload"] = SimpleNamespace(slots_per_layer=0)
    assert not admits_between_steps(model)
    model.__dict__["expert_offload"] = SimpleNamespace(slots_per_layer=3)
    assert admits_between_steps(model)
    model.__dict__["expert_offload"] = SimpleNamespace(slots_per_layer=3, device_admission=False)
    assert admits_between_steps(model)
    model.__dict__["expert_offload"] = SimpleNamespace(slots_per_layer=3, device_admission=True)
    assert not admits_between_steps(model)


class _EagerReplay:
    """Stands in for a decode graph of b rows on the CPU: replay() runs what capture records, eagerly, on the
    runner's static buffers (the same forward, logits and greedy_pick into its inputs)."""

    def __init__(self, runner, b: int) -> None:
        self.runner, self.b = runner, b

    def replay(self) -> None:
        r = self.runner
        r._forward_into_logits(r._inputs.input_ids[: self.b], r._inputs.batch(self.b), self.b)


def _graphs_emulated(llm, monkeypatch) -> list[int]:
    """llm's runner with MOERUN_GRAPH_PICKS decode "graphs" replayed eagerly; returns the list continue_decode
    appends each continued step's row count to."""
    from moerun.engine.static_inputs import StaticInputs

    runner = llm.engine.runner
    n = runner.buckets[-1]
    runner._inputs = StaticInputs(n, runner.cache)
    runner._logits = torch.zeros(n, llm.engine.model.config.vocab_size)
    runner.graphs = {b: _EagerReplay(runner, b) for b in runner.buckets}
    runner.picks_in_graph = True
    continued: list[int] = []
    real = runner.continue_decode

    def counting(B: int) -> torch.Tensor:
        continued.append(B)
        return real(B)

    monkeypatch.setattr(runner, "continue_decode", counting)
    return continued


@pytest.mark.parametrize("rows", [1, 3])
def test_greedy_steps_continue_in_the_graph(tiny_checkpoint, pair, rows, monkeypatch):
    # MOERUN_GRAPH_PICKS: a greedy step that continues every row of the last replay replays with nothing copied in
    # (the graph wrote its tokens as the next inputs and moved positions and lengths on); same tokens, same ends
    llm = LLM(str(tiny_checkpoint), async_scheduling=True, device="cpu", max_model_len=96, max_num_seqs=3,
              max_num_batched_tokens=64)  # fmt: skip
    continued = _graphs_emulated(llm, monkeypatch)
    rng = random.Random()
    prompts = _prompts(rng, rows)
    params = [SamplingParams(max_tokens=rng.randrange(6, 14), temperature=0) for _ in prompts]
    _same(llm.generate(prompts, params), pair[1].generate(prompts, params))
    assert continued, "no step continued in the graph"
    # a sampled row in the batch: its steps go through the sampler and the host's inputs; only the greedy rows left
    # after it ends may continue
    continued.clear()
    params[0] = SamplingParams(max_tokens=10, temperature=0.8, seed=5)
    _same(llm.generate(prompts, params), pair[1].generate(prompts, params))
    assert all(b < rows for b in continued), continued
    # more prompts than slots: prefills interleave with continued steps, near the context's end too
    prompts = _prompts(rng, 5) + [[rng.randrange(1000, 20000) for _ in range(88)]]
    params = [SamplingParams(max_tokens=rng.randrange(2, 12), temperature=0) for _ in prompts]
    _same(llm.generate(prompts, params), pair[1].generate(prompts, params))
    assert llm.engine.cache.num_free == 3 and not llm.engine.has_work


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_greedy_steps_take_the_graphs_picks(tiny_checkpoint, pair, async_scheduling, monkeypatch):
    # a greedy decode step that does not continue the last replay (a new batch) takes the tokens its graph picked:
    # the logits handed back are zeroed on those steps, so an argmax of them would give token 0 every time;
    # same tokens as the engine without graphs, synchronous and async
    # buckets 1, 2, 4: three rows replay the graph of 4 with a padding row
    llm = LLM(str(tiny_checkpoint), async_scheduling=async_scheduling, device="cpu", max_model_len=96,
              max_num_seqs=4, max_num_batched_tokens=64)  # fmt: skip
    _graphs_emulated(llm, monkeypatch)
    runner = llm.engine.runner
    real_decode, taken = runner.decode, []

    def decode_hiding_logits(input_ids, batch):
        logits = real_decode(input_ids, batch)
        if runner.greedy_picks(batch.num_seqs) is None:
            return logits
        taken.append(batch.num_seqs)
        return torch.zeros_like(logits)

    monkeypatch.setattr(runner, "decode", decode_hiding_logits)
    rng = random.Random()
    prompts = _prompts(rng, 7)  # more prompts than slots: batches change, steps go through decode
    params = [SamplingParams(max_tokens=rng.randrange(4, 12), temperature=0) for _ in prompts]
    _same(llm.generate(prompts, params), pair[1].generate(prompts, params))
    assert taken, "no decode step took the graph's picks"
    # three rows on the graph of 4 (a padding row): never continued in the graph, every step takes its picks
    taken.clear()
    params = [SamplingParams(max_tokens=8, temperature=0, ignore_eos=True) for _ in prompts[:3]]
    _same(llm.generate(prompts[:3], params), pair[1].generate(prompts[:3], params))
    assert taken.count(3) == 7, taken
    # a repetition penalty changes the choice: those steps take the sampler's (logits left as they are)
    monkeypatch.setattr(runner, "decode", real_decode)
    params = [SamplingParams(max_tokens=10, temperature=0, repetition_penalty=1.5) for _ in prompts[:3]]
    _same(llm.generate(prompts[:3], params), pair[1].generate(prompts[:3], params))
