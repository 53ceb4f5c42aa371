"""Budget errors come before anything is allocated; llm.stats() counters agree with each other; CLI flags."""

from __future__ import annotations

import pytest
import torch

from offload_common import GREEDY, prompts
from moerun import LLM
from moerun.cli import main
from moerun.moe.offload import OffloadConfig
from test_offload_generation import OPTS, cache_gb


def test_budget_too_small_for_non_expert_weights_is_a_clear_error(hf_model, monkeypatch):
    def no_loading(*args, **kwargs):
        raise AssertionError("weights were read before the budget was checked")

    monkeypatch.setattr("moerun.api.load_checkpoint", no_loading)
    monkeypatch.setattr("moerun.models.checkpoint.load_checkpoint", no_loading)
    with pytest.raises(ValueError, match=r"gpu_memory_gb=0\.001 \(0\.00 GiB\) is too small .* non-expert weights need"):
        LLM(str(hf_model), gpu_memory_gb=0.001, **OPTS)


def test_expert_cache_smaller_than_top_k_is_a_clear_error(hf_model):
    with pytest.raises(ValueError, match=r"holds 1 experts per layer, fewer than the 2 \(top-k\)"):
        LLM(str(hf_model), expert_cache_gb=cache_gb(hf_model, 1), **OPTS)


def test_bad_offload_options_are_clear_errors():
    with pytest.raises(ValueError, match="offload policy must be one of"):
        OffloadConfig(policy="fifo")
    with pytest.raises(ValueError, match="cpu_compute must be one of"):
        OffloadConfig(cpu_compute="sometimes")


@pytest.mark.parametrize("policy", ["lru", "activation"])
def test_stats_are_consistent(hf_model, policy):
    llm = LLM(str(hf_model), expert_cache_gb=cache_gb(hf_model, 3), **OPTS,
              offload=OffloadConfig(policy=policy, prefetch=True, overlap=True))
    ps = prompts(2)
    llm.generate(ps, GREEDY)
    s = llm.stats()
    manager = llm.model.expert_offload
    assert s["hits"] + s["misses"] == s["lookups"] > 0
    assert s["misses"] == s["misses_copied"] + s["misses_cpu"]
    assert s["hit_rate"] == pytest.approx(s["hits"] / s["lookups"])
    assert s["bytes_copied"] == s["copies"] * manager.store.expert_bytes(0)  # dense: every layer alike
    assert s["bytes_copied"] == s["bytes_copied_miss"] + s["bytes_copied_prefetch"]
    assert s["copies"] >= s["misses_copied"] and s["copies"] - s["misses_copied"] == s["prefetch_issued"]
    assert s["prefetch_issued"] == s["prefetch_useful"] + s["prefetch_wasted"] + s["prefetch_pending"]
    assert s["prefetch_pending"] == int(manager.table.prefetched.sum())
    assert 0 <= s["prefetch_accuracy"] <= 1
    # every forward pass counts its tokens once: whole prompts plus all generated tokens but the last
    assert s["tokens"] == sum(len(p) for p in ps) + len(ps) * (GREEDY.max_tokens - 1)
    assert s["bytes_copied_per_token"] == pytest.approx(s["bytes_copied"] / s["tokens"])
    # each lookup is one (layer, expert) of a forward pass: at most k per token and layer
    assert s["lookups"] <= s["tokens"] * s["num_moe_layers"] * llm.model_config.num_experts_per_tok
    assert s["evictions"] == s["copies"] - (s["num_moe_layers"] * s["slots_per_layer"])
    manager.reset_stats()
    assert llm.stats()["lookups"] == 0


def test_cli_flags_and_verbose_stats(hf_model, capsys):
    gb = cache_gb(hf_model, 3)
    argv = ["generate", "--model", str(hf_model), "--device", "cpu", "--prompt", "Hello", "--max-tokens", "4",
            "--temperature", "0", "--expert-cache-gb", f"{gb:.12f}", "--offload-policy", "lfu", "--verbose",
            "--max-model-len", "64"]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "expert offloading: policy lfu, 3 of 8 experts per layer" in err and "hit rate" in err
    assert main(argv[:-5] + ["--gpu-memory-gb", "0.001"]) == 2
    assert "too small" in capsys.readouterr().err


def test_offloaded_logits_match(hf_model):
    ids = prompts(3)[1]
    base = LLM(str(hf_model), **OPTS).logits(ids)
    llm = LLM(str(hf_model), expert_cache_gb=cache_gb(hf_model, 2), **OPTS)
    assert torch.equal(llm.logits(ids), base)
