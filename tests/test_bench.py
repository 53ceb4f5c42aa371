"""``moerun bench`` on the CPU: runs on the tiny preset (dense and Q4_K_M), writes its JSON, and skips CUDA graphs
cleanly; on CUDA, a Q4_K_M model's graphed decode equals its eager decode."""

from __future__ import annotations

import json
import random

import pytest
import torch

from moerun import LLM, SamplingParams
from moerun.cli import main
from moerun.config import ModelConfig
from moerun.engine.batch import ForwardBatch
from moerun.models.presets import preset_config
from moerun.models.random_quant import random_quantized_model
from moerun.models.tiny import qwen3_tokenizer_dir
from moerun.tokenizer import Tokenizer


def test_bench_tiny_on_cpu(tmp_path, capsys):
    out = tmp_path / "bench"
    args = ["bench", "--preset", "tiny", "--device", "cpu", "--dtype", "float32", "--prefill-lens", "8,32",
            "--batch-sizes", "1,3", "--prompt-len", "8", "--steps", "3", "--max-model-len", "128",
            "--out", str(out)]
    assert main(args) == 0
    result = json.loads((out / "bench.json").read_text())
    assert result["cuda_graphs"] is False
    assert set(result["prefill"]) == {"8", "32"}
    assert set(result["decode"]) == {"1", "3"}
    assert all(d["tok_per_s"] > 0 and d["bytes_per_step"] > 0 for d in result["decode"].values())
    assert "decode    batch" in capsys.readouterr().out


@pytest.mark.parametrize("quant", ["Q4_K_M", "IQ2_M"])  # IQ2_M: a file type moerun reads but does not write
def test_bench_tiny_quantized_on_cpu(tmp_path, capsys, quant):
    # The preset in llama.cpp's mix with random valid blocks (the CPU path dequantises each weight per call, so
    # few forward passes); quantized weights count at their stored size.
    out = tmp_path / "bench"
    args = ["bench", "--preset", "tiny", "--device", "cpu", "--dtype", "float32", "--quant", quant,
            "--prefill-lens", "8", "--batch-sizes", "2", "--prompt-len", "4", "--steps", "1",
            "--max-model-len", "32", "--out", str(out)]
    assert main(args) == 0
    result = json.loads((out / "bench.json").read_text())
    assert result["quant"] == quant and result["model"].endswith(quant)
    assert set(result["prefill"]) == {"8"} and set(result["decode"]) == {"2"}
    step = result["decode"]["2"]
    assert step["tok_per_s"] > 0
    # Below half the float32 bytes a step of the same shape reads (Q8_0 output head, 4-6 bit layers).
    dense_bytes = 4 * ModelConfig.from_hf_dict(preset_config("tiny")).param_counts()["active"]
    assert 0 < step["bytes_per_step"] < dense_bytes / 2
    assert 0 < result["weight_bytes"] < dense_bytes / 2
    assert f"tiny {quant}" in capsys.readouterr().out


def test_bench_vs_transformers_shares_weights(tmp_path, capsys):
    out = tmp_path / "bench"
    args = ["bench", "--preset", "tiny", "--device", "cpu", "--dtype", "float32", "--prefill-lens", "16",
            "--batch-sizes", "1", "--prompt-len", "8", "--steps", "2", "--max-model-len", "64",
            "--vs", "transformers", "--hf-batch-sizes", "1", "--out", str(out)]
    assert main(args) == 0
    result = json.loads((out / "bench.json").read_text())
    assert result["hf_logits_check"] < 1e-5  # the same model, computed by both engines
    assert any(e.get("decode", {}).get("1") for e in result["hf"].values())


def test_released_blocks_answer_from_the_repacked_copy():
    # What a CUDA build does to every weight (repack, drop the GGUF blocks), here on the CPU: the torch path then
    # dequantises the repacked arrays, bit-exact with the blocks; the tied embedding's lookups read them too.
    from moerun.ops.quant import pack_model

    cfg = preset_config("tiny")
    cfg["torch_dtype"] = "float32"
    model = random_quantized_model(ModelConfig.from_hf_dict(cfg), torch.device("cpu"), "Q4_K_M", seed=1)
    x = torch.randn(2, cfg["hidden_size"])
    ids = torch.randint(0, cfg["vocab_size"], (5,))
    expert = model.model.layers[0].mlp.experts.__dict__["q_w2"]
    before = (model.compute_logits(x), expert.expert(3, torch.float32), model.model.embed_tokens(ids))
    pack_model(model, release_blocks=True)
    table = model.model.embed_tokens.__dict__["q_weight"]
    assert expert.released and table.released and model.lm_head.__dict__["q_weight"] is table
    assert torch.equal(model.compute_logits(x), before[0])
    assert torch.equal(expert.expert(3, torch.float32), before[1])
    assert torch.equal(model.model.embed_tokens(ids), before[2])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_q4_k_m_decode_graphs_equal_eager_and_never_sync():
    # A small Q4_K_M model (repacked weights only): the graphed decode step gives the eager tokens, and an eager
    # decode step reads nothing back to the host.
    cfg = preset_config("qwen3-30b-a3b", layers=3)
    cfg.update(hidden_size=1024, moe_intermediate_size=256, num_experts=32, intermediate_size=2048,
               torch_dtype="float32")
    model = random_quantized_model(ModelConfig.from_hf_dict(cfg), torch.device("cuda"), "Q4_K_M")
    assert all(q.released for q in _quantized_weights(model.model.layers))
    tok = Tokenizer.from_folder(qwen3_tokenizer_dir())
    graphed = LLM.from_model(model, tok, max_model_len=256, max_num_seqs=8, cuda_graphs=True)
    eager = LLM.from_model(model, tok, max_model_len=256, max_num_seqs=8, cuda_graphs=False)
    assert graphed.engine.runner.graphs
    prompts = [[random.randrange(150000) for _ in range(n)] for n in (3, 20, 9)]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, detokenize=False)
    for a, b in zip(graphed.generate(prompts, params), eager.generate(prompts, params)):
        assert a.token_ids == b.token_ids
    for prompt in prompts:  # one prompt alone: a prefill graph (20 tokens) or, rounding as no bucket does, eager
        assert graphed.generate([prompt], params)[0].token_ids == eager.generate([prompt], params)[0].token_ids
    assert set(graphed.engine.runner.prefill_graphs.graphs) == {128}
    engine = eager.engine
    slot = engine.cache.allocate()
    batch = ForwardBatch.build([7], [1], [slot], engine.device)
    ids = torch.tensor([5], device=engine.device)  # a copy from the host: made before the check
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.inference_mode():
            engine.runner.decode(ids, batch)
    finally:
        torch.cuda.set_sync_debug_mode("default")
        engine.cache.release(slot)


def test_int8_roundings_tell_few_tokens_from_many(monkeypatch, request):
    # GGUF kernels round x to int8 at decode sizes only (the GPU's configs, also when Triton's interpreter runs):
    # 1 token differs from a prefill bucket, 128 and 300 agree
    from moerun.engine.prefill_graphs import PREFILL_BUCKETS
    from moerun.kernels.quant import configs
    from moerun.ops.quant import int8_roundings, pack_model

    monkeypatch.setattr(configs, "interpreting", lambda: False)
    configs.clear_matmul_configs()  # memoised: cleared before and after
    request.addfinalizer(configs.clear_matmul_configs)

    cfg = preset_config("tiny")
    cfg["torch_dtype"] = "float32"
    model = random_quantized_model(ModelConfig.from_hf_dict(cfg), torch.device("cpu"), "Q4_K_M", seed=2)
    pack_model(model)
    k, layers = cfg["num_experts_per_tok"], model.model.layers
    one, many = int8_roundings(layers, 1, k), int8_roundings(layers, PREFILL_BUCKETS[0], k)
    n_parts = sum(len(m.__dict__["q_weight"].__dict__["packed"]) for m in layers.modules() if "q_weight" in m.__dict__)
    assert len(one) == len(many) == n_parts + 2 * cfg["num_hidden_layers"]  # each part, each MoE's two GEMMs
    assert any(one) and not any(many)
    assert int8_roundings(layers, 300, k) == many


def _quantized_weights(module) -> list:
    return [v for m in module.modules() for k, v in m.__dict__.items() if k.startswith("q_")]


def test_decode_variants_script_on_cpu(monkeypatch):
    # benchmarks/bench_decode_variants.py: each variant runs under its own settings, the environment comes back
    import os
    import runpy
    from pathlib import Path

    script = runpy.run_path(str(Path(__file__).parents[1] / "benchmarks" / "bench_decode_variants.py"))
    monkeypatch.setenv("MOERUN_PDL_TRIGGER", "start")  # named by a variant below: unset in the others
    seen = []
    real = script["measure_decode"]

    def spy(llm, *args):
        seen.append((os.environ.get("MOERUN_PDL"), os.environ.get("MOERUN_PDL_TRIGGER")))
        return real(llm, *args)

    script["main"].__globals__["measure_decode"] = spy
    rows = script["main"](["--preset", "tiny", "--variant", "base", "--variant",
                           "mode2:MOERUN_PDL=1,MOERUN_PDL_TRIGGER=after_wait", "--steps", "2", "--prompt-len", "8",
                           "--repeat", "1"])  # fmt: skip
    assert [r[0] for r in rows] == ["base", "mode2"] and all(r[1] > 0 for r in rows)
    assert seen == [(None, None), ("1", "after_wait")]
    assert os.environ.get("MOERUN_PDL_TRIGGER") == "start" and "MOERUN_PDL" not in os.environ
    with pytest.raises(ValueError, match="NAME:VAR=VALUE"):
        script["parse_variant"]("bad:novalue")


def test_decode_variants_table_entries(tmp_path, monkeypatch):
    # moe.M.KEY=VALUE: the variant runs on a copy of the tables (another device's with --tables-from, renamed for
    # this one) whose entries for M tokens carry the change, in every MoE table that has one
    import json
    import os
    import runpy
    from pathlib import Path

    from moerun.kernels.tile_configs import CONFIG_DIR

    script = runpy.run_path(str(Path(__file__).parents[1] / "benchmarks" / "bench_decode_variants.py"))
    plain, entries, gemv = script["table_overrides"]({"MOERUN_PDL": "0", "moe.1.BLOCK_N2": "16",
                                                      "moe.1.reduce": "atomic", "moe.4.x_q8": "true",
                                                      "gemv.5120x2048.1.row_once": "true"})  # fmt: skip
    assert plain == {"MOERUN_PDL": "0"} and entries == {1: {"BLOCK_N2": 16, "reduce": "atomic"}, 4: {"x_q8": True}}
    assert gemv == {("gemv", 5120, 2048, 1): {"row_once": True}}
    with pytest.raises(ValueError, match="moe.M.KEY"):
        script["table_overrides"]({"moe.one.BLOCK_N2": "16"})
    with pytest.raises(ValueError, match="gemv.NxK.T.KEY"):
        script["table_overrides"]({"gemv.5120.1.row_once": "true"})
    env = script["variant_env"]("n16", {"moe.1.BLOCK_N2": "16"}, "NVIDIA_H200", "MY_GPU", tmp_path / "n16")
    assert env == {"MOERUN_MOE_CONFIG_DIR": str(tmp_path / "n16"), "MOERUN_GEMV_CONFIG_DIR": str(tmp_path / "n16")}
    shipped = sorted(CONFIG_DIR.glob("*device=NVIDIA_H200.json"))
    assert shipped
    for path in shipped:
        table = json.loads(path.read_text())
        copy = json.loads((tmp_path / "n16" / path.name.replace("NVIDIA_H200", "MY_GPU")).read_text())
        assert copy == {m: ({**cfg, "BLOCK_N2": 16} if m == "1" else cfg) for m, cfg in table.items()}
    assert (tmp_path / "n16" / "gemv_MY_GPU.json").is_file()
    # gemv.NxK.T.KEY: the dense GEMV table's entry of that weight shape at T tokens, the others as shipped
    script["variant_env"]("ro", {"gemv.5120x2048.1.row_once": "true", "gemv.5120x2048.1.block_n": "4"}, "NVIDIA_H200",
                          "MY_GPU", tmp_path / "ro")  # fmt: skip
    shipped_gemv = json.loads((CONFIG_DIR / "gemv_NVIDIA_H200.json").read_text())
    copy = json.loads((tmp_path / "ro" / "gemv_MY_GPU.json").read_text())
    key = "N=5120,K=2048,dtype=bfloat16"
    assert copy[key]["1"] == {**shipped_gemv[key]["1"], "row_once": True, "block_n": 4}
    assert {k: v for k, v in copy.items() if k != key} == {k: v for k, v in shipped_gemv.items() if k != key}
    with pytest.raises(ValueError, match="no entry"):
        script["variant_env"]("g", {"gemv.7x7.1.block_n": "4"}, "NVIDIA_H200", "MY_GPU", tmp_path / "g")
    # qgemv.NxK.M.KEY: the quantized matmul table's entries of that shape, whatever their type
    script["variant_env"]("q", {"qgemv.2048x4096.1.num_warps": "2"}, "NVIDIA_H200", "MY_GPU", tmp_path / "q")
    shipped_q = json.loads((CONFIG_DIR / "quant_gemv_NVIDIA_H200.json").read_text())
    copy = json.loads((tmp_path / "q" / "quant_gemv_MY_GPU.json").read_text())
    key = "type=Q4_K,N=2048,K=4096"
    assert copy[key]["1"] == {**shipped_q[key]["1"], "num_warps": 2} and copy[key]["1"]["num_warps"] == 2
    assert {k: v for k, v in copy.items() if k != key} == {k: v for k, v in shipped_q.items() if k != key}
    assert script["variant_env"]("plain", {"MOERUN_PDL": "0"}, None, "MY_GPU", tmp_path / "p") == {"MOERUN_PDL": "0"}
    with pytest.raises(ValueError, match="M = \\[3\\]"):
        script["variant_env"]("m3", {"moe.3.BLOCK_N2": "16"}, "NVIDIA_H200", "MY_GPU", tmp_path / "m3")
    with pytest.raises(ValueError, match="config folders"):
        script["variant_env"]("both", {"moe.1.BLOCK_N2": "16", "MOERUN_MOE_CONFIG_DIR": "x"}, None, "MY_GPU",
                              tmp_path / "b")  # fmt: skip
    # through main on the CPU: the variant sees its folder while it runs, and the folders go afterwards
    seen = []
    real = script["measure_decode"]

    def spy(llm, *args):
        seen.append(os.environ.get("MOERUN_MOE_CONFIG_DIR"))
        return real(llm, *args)

    script["main"].__globals__["measure_decode"] = spy
    monkeypatch.delenv("MOERUN_MOE_CONFIG_DIR", raising=False)
    script["main"](["--preset", "tiny", "--tables-from", "NVIDIA_H200", "--variant", "base", "--variant",
                    "n16:moe.1.BLOCK_N2=16", "--steps", "2", "--prompt-len", "8", "--repeat", "1"])  # fmt: skip
    assert len(seen) == 2 and seen[0] != seen[1] and not any(Path(d).exists() for d in seen)
    assert "MOERUN_MOE_CONFIG_DIR" not in os.environ


def test_decode_variants_module_constants(monkeypatch):
    # attr.MODULE.NAME[.FIELD]=VALUE: a module constant (or one field of a dataclass constant) set for the variant's
    # capture and steps, restored afterwards; names that match nothing are refused before anything runs
    import runpy
    from pathlib import Path

    from moerun.kernels import decode_attention, router_fused

    script = runpy.run_path(str(Path(__file__).parents[1] / "benchmarks" / "bench_decode_variants.py"))
    overrides = script["attribute_overrides"]({"attr.moerun.kernels.decode_attention.NUM_WARPS": "8",
                                               "attr.moerun.kernels.router_fused.SINGLE_TOKEN_CONFIG.split": "64",
                                               "MOERUN_PDL": "0"})  # fmt: skip
    assert [(m, n) for m, n, _ in overrides] == [(decode_attention, "NUM_WARPS"), (router_fused, "SINGLE_TOKEN_CONFIG")]
    assert overrides[1][2] == router_fused.SINGLE_TOKEN_CONFIG.__class__(
        **{**router_fused.SINGLE_TOKEN_CONFIG.__dict__, "split": 64})
    assert script["table_overrides"]({"attr.moerun.kernels.decode_attention.NUM_WARPS": "8"}) == ({}, {}, {})
    for bad in ("attr.moerun.kernels.decode_attention.NO_SUCH", "attr.no_such_module.X",
                "attr.moerun.kernels.router_fused.SINGLE_TOKEN_CONFIG.split.more"):
        with pytest.raises(ValueError, match="attr.MODULE.NAME"):
            script["attribute_overrides"]({bad: "1"})
    seen = []
    real = script["measure_decode"]

    def spy(llm, *args):
        seen.append((decode_attention.NUM_WARPS, router_fused.SINGLE_TOKEN_CONFIG.split))
        return real(llm, *args)

    script["main"].__globals__["measure_decode"] = spy
    before = (decode_attention.NUM_WARPS, router_fused.SINGLE_TOKEN_CONFIG)
    script["main"](["--preset", "tiny", "--variant", "base", "--variant",
                    "w8:attr.moerun.kernels.decode_attention.NUM_WARPS=8,"
                    "attr.moerun.kernels.router_fused.SINGLE_TOKEN_CONFIG.split=64",
                    "--steps", "2", "--prompt-len", "8", "--repeat", "1"])  # fmt: skip
    assert seen == [(before[0], before[1].split), (8, 64)]
    assert (decode_attention.NUM_WARPS, router_fused.SINGLE_TOKEN_CONFIG) == before
