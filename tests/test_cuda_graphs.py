"""CUDA only: graphed decode equals eager decode, padding never leaks, the decode step never syncs the host,
and the Triton backends give the torch backend's logits (bf16 tolerance)."""

from __future__ import annotations

import random

import pytest
import torch

from moerun import LLM, SamplingParams
from moerun.config import ModelConfig
from moerun.models.presets import preset_config
from moerun.models.random_init import random_model
from moerun.models.tiny import qwen3_tokenizer_dir
from moerun.tokenizer import Tokenizer

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def small_model(moe_backend=None, seed=0, dtype="float32"):
    # float32: kernels picked for different batch sizes then agree far below any greedy tie
    cfg = preset_config("qwen3-30b-a3b", layers=3)
    cfg.update(hidden_size=1024, moe_intermediate_size=256, num_experts=32, intermediate_size=2048,
               torch_dtype=dtype)
    mc = ModelConfig.from_hf_dict(cfg)
    return random_model(mc, torch.device("cuda"), seed=seed, moe_backend=moe_backend)


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.from_folder(qwen3_tokenizer_dir())


@pytest.fixture(scope="module")
def pair(tokenizer):
    model = small_model()
    graphed = LLM.from_model(model, tokenizer, max_model_len=512, max_num_seqs=16, cuda_graphs=True)
    eager = LLM.from_model(model, tokenizer, max_model_len=512, max_num_seqs=16, cuda_graphs=False)
    assert graphed.engine.runner.graphs and not eager.engine.runner.graphs
    return graphed, eager


@pytest.mark.parametrize("batch", [1, 3, 8])
def test_graph_replay_equals_eager_over_64_steps(pair, batch):
    graphed, eager = pair
    prompts = [[random.randrange(150000) for _ in range(random.randint(3, 40))] for _ in range(batch)]
    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True, detokenize=False)
    a = graphed.generate(prompts, params)
    b = eager.generate(prompts, params)
    for x, y in zip(a, b):
        assert x.token_ids == y.token_ids


def test_bucket_padding_never_leaks(pair):
    graphed, _ = pair
    prompts = [[random.randrange(150000) for _ in range(n)] for n in (5, 17, 9)]  # 3 rows replay bucket 4
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, detokenize=False)
    together = graphed.generate(prompts, params)
    for prompt, out in zip(prompts, together):
        assert graphed.generate([prompt], params)[0].token_ids == out.token_ids


def test_decode_step_does_not_synchronise(pair):
    graphed, eager = pair
    for llm in (graphed, eager):
        engine = llm.engine
        seqs = [engine.add_request([1, 2, 3, 4], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
                for _ in range(2)]
        engine.step()  # prefill
        plan = engine.scheduler.plan()
        assert not plan.is_prefill
        from moerun.engine.batch import ForwardBatch

        batch = ForwardBatch.build([s.num_computed for s in seqs], [1, 1], [s.slot for s in seqs], engine.device)
        ids = torch.tensor([5, 6], device=engine.device)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            with torch.inference_mode():
                engine.runner.decode(ids, batch)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        for s in seqs:
            engine.abort(s)


@pytest.mark.parametrize("n", [5, 128, 300])
def test_graphed_prefill_equals_eager_prefill(pair, n):
    graphed, eager = pair
    from moerun.engine.batch import ForwardBatch

    ids = [random.randrange(150000) for _ in range(n)]
    out = []
    for llm in (graphed, eager):
        engine = llm.engine
        slot = engine.cache.allocate()
        try:
            batch = ForwardBatch.build([0], [n], [slot], engine.device)
            x = torch.tensor(ids, device=engine.device)
            with torch.inference_mode():
                out.append(engine.runner.prefill(x, batch, batch.last_rows).clone())
        finally:
            engine.cache.release(slot)
    assert graphed.engine.runner.prefill_graphs.graphs  # the graphed path really ran
    assert float((out[0] - out[1]).norm() / out[1].norm()) < 1e-5


def test_triton_backend_logits_match_torch_backend(tokenizer):
    triton_llm = LLM.from_model(small_model("triton", seed=3, dtype="bfloat16"), tokenizer, max_model_len=256,
                                cuda_graphs=False)
    torch_llm = LLM.from_model(small_model("torch", seed=3, dtype="bfloat16"), tokenizer, max_model_len=256,
                               cuda_graphs=False)
    ids = [random.randrange(150000) for _ in range(100)]
    a, b = triton_llm.logits(ids), torch_llm.logits(ids)
    assert float((a - b).norm() / b.norm()) < 2e-2


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
                    reason="programmatic dependent launch needs compute capability 9.0")
def test_pdl_launches_give_the_plain_launches_tokens(tokenizer, monkeypatch):
    from moerun.kernels.pdl import pdl_mode

    model = small_model(seed=2, dtype="bfloat16")
    prompts = [[random.randrange(150000) for _ in range(random.randint(3, 40))] for _ in range(4)]
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True, detokenize=False)
    outs = {}
    for flag, trigger, mode in (("0", "start", 0), ("1", "start", 1), ("1", "after_wait", 2)):
        monkeypatch.setenv("MOERUN_PDL", flag)  # read at capture and at every launch
        monkeypatch.setenv("MOERUN_PDL_TRIGGER", trigger)
        assert pdl_mode(torch.device("cuda")) == mode
        llm = LLM.from_model(model, tokenizer, max_model_len=256, max_num_seqs=4, cuda_graphs=True)
        outs[mode] = ([o.token_ids for o in llm.generate(prompts[:1], params)],
                      [o.token_ids for o in llm.generate(prompts, params)], llm.logits(prompts[0]))
        del llm
    for mode in (1, 2):
        assert outs[0][0] == outs[mode][0] and outs[0][1] == outs[mode][1]
        torch.testing.assert_close(outs[0][2], outs[mode][2], rtol=0, atol=0)


def tokens_under_switch(tokenizer, monkeypatch, variable: str, seed: int) -> dict[str, tuple]:
    """Greedy tokens of one float32 model (one prompt, then four) with the switch ``variable`` at "0" and "1",
    read at capture: {"0": ..., "1": ...}."""
    model = small_model(seed=seed)
    prompts = [[random.randrange(150000) for _ in range(random.randint(3, 40))] for _ in range(4)]
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True, detokenize=False)
    outs = {}
    for flag in ("0", "1"):
        monkeypatch.setenv(variable, flag)
        llm = LLM.from_model(model, tokenizer, max_model_len=256, max_num_seqs=4, cuda_graphs=True)
        outs[flag] = ([o.token_ids for o in llm.generate(prompts[:1], params)],
                      [o.token_ids for o in llm.generate(prompts, params)])
        del llm
    return outs


def test_decode_qk_inside_attention_gives_the_same_tokens(tokenizer, monkeypatch):
    # float32: the one launch rounds the attention math (no fused multiply-adds) apart from the two launches, far
    # below any greedy tie; the cache writes are bit for bit the separate kernel's (tests/kernels)
    outs = tokens_under_switch(tokenizer, monkeypatch, "MOERUN_DECODE_QK_FUSED", 3)
    assert outs["0"] == outs["1"]


def test_greedy_steps_continued_in_the_graph_give_the_eager_tokens(tokenizer, monkeypatch):
    # the graphs end in ops.greedy_pick (MOERUN_GRAPH_PICKS, read at capture, on by default), and a greedy step
    # that continues the last replay's rows replays with nothing copied in
    model = small_model(seed=4)
    monkeypatch.setenv("MOERUN_GRAPH_PICKS", "1")
    graphed = LLM.from_model(model, tokenizer, max_model_len=256, max_num_seqs=8, cuda_graphs=True)
    eager = LLM.from_model(model, tokenizer, max_model_len=256, max_num_seqs=8, cuda_graphs=False)
    runner = graphed.engine.runner
    assert runner.picks_in_graph and graphed.engine.async_scheduling
    continued = []
    real = runner.continue_decode
    monkeypatch.setattr(runner, "continue_decode", lambda B: continued.append(B) or real(B))
    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True, detokenize=False)
    for batch in (1, 3, 8):
        prompts = [[random.randrange(150000) for _ in range(random.randint(3, 40))] for _ in range(batch)]
        for x, y in zip(graphed.generate(prompts, params), eager.generate(prompts, params)):
            assert x.token_ids == y.token_ids
    assert 1 in continued and 8 in continued and 3 not in continued  # 3 rows replay the graph of 4


def test_graphs_without_picks_give_the_same_tokens(tokenizer, monkeypatch):
    # MOERUN_GRAPH_PICKS=0: the graphs end at the logits and the engine picks and copies each step's inputs in
    outs = tokens_under_switch(tokenizer, monkeypatch, "MOERUN_GRAPH_PICKS", 6)
    assert outs["0"] == outs["1"]


def test_top_k_picked_in_gemm1_gives_the_same_tokens(tokenizer, monkeypatch):
    # MOERUN_TOPK_IN_GEMM1=1 (read at capture; by default for one token only): the router stops at its logits and
    # GEMM 1 picks the routing; the same picks, weights a float32 rounding apart (another summation order), so the
    # same greedy tokens in float32
    outs = tokens_under_switch(tokenizer, monkeypatch, "MOERUN_TOPK_IN_GEMM1", 5)
    assert outs["0"] == outs["1"]


def test_router_in_o_proj_gives_the_same_tokens(tokenizer, monkeypatch):
    # MOERUN_ROUTER_IN_OPROJ: the router's logits come out of the o_proj launch and GEMM 1 normalises its rows;
    # in float32 the same greedy tokens (the logits differ in summation order only)
    outs = tokens_under_switch(tokenizer, monkeypatch, "MOERUN_ROUTER_IN_OPROJ", 9)
    assert outs["0"] == outs["1"]
