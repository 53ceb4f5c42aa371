"""Offloaded generation is token-for-token the non-offloaded engine's, under every cache configuration."""

from __future__ import annotations

import pytest
import torch

from offload_common import GREEDY, SHORT, TRITON_DEVICES, prompts, triton_run
from moerun import LLM, SamplingParams
from moerun.moe.offload import OffloadConfig
from moerun.moe.offload.planner import footprint_of_config, footprint_of_gguf

OPTS = dict(device="cpu", max_model_len=128, max_num_seqs=4)
FEW = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)


def cache_gb(path, slots: int, gguf: bool = False) -> float:
    """expert_cache_gb holding ``slots`` experts per layer."""
    from moerun.config import ModelConfig
    from moerun.models.gguf_checkpoint import read_gguf_config

    if gguf:
        fp = footprint_of_gguf(path, read_gguf_config(path), torch.float32)
    else:
        fp = footprint_of_config(ModelConfig.from_json_file(path / "config.json"), torch.float32)
    return (fp.pool_bytes(slots) + 16) / 2**30


@pytest.fixture(scope="module")
def reference(hf_model):
    return [o.token_ids for o in LLM(str(hf_model), **OPTS).generate(prompts(), GREEDY)]


def run_offloaded(path, gb: float, **config) -> LLM:
    llm = LLM(str(path), expert_cache_gb=gb, offload=OffloadConfig(**config), **OPTS)
    assert llm.stats()["offloading"]
    return llm


@pytest.mark.parametrize("policy", ["lru", "lfu", "activation"])
@pytest.mark.parametrize("prefetch", [False, True])
@pytest.mark.parametrize("cpu_compute", ["off", "always"])
def test_identical_to_the_resident_engine(hf_model, reference, policy, prefetch, cpu_compute):
    # overlap alternates so that both the single pass and the hit/miss split run under every policy
    overlap = prefetch == (cpu_compute == "off")
    llm = run_offloaded(hf_model, cache_gb(hf_model, 3), policy=policy, prefetch=prefetch,
                        cpu_compute=cpu_compute, overlap=overlap)
    outs = [o.token_ids for o in llm.generate(prompts(), GREEDY)]
    assert outs == reference
    stats = llm.stats()
    assert stats["slots_per_layer"] == 3 and stats["lookups"] > 0
    if cpu_compute == "always":
        assert stats["misses_cpu"] == stats["misses"] > 0
    else:
        assert stats["misses_copied"] == stats["misses"] > 0 and stats["chunked_layers"] > 0
    if prefetch:
        assert stats["prefetch_issued"] > 0
    llm.model.expert_offload.table.check()


@pytest.mark.parametrize("device", TRITON_DEVICES)
def test_copy_mode_on_triton_takes_the_layers_tuned_tables(hf_model, device, monkeypatch):
    # the slot pool stacks 3 + 1 slots, but the layer's 8 experts pick the kernels' configs (tuned per shape and E)
    pytest.importorskip("triton")
    from moerun.kernels import fused_moe, tile_configs

    looked_up = set()
    for module in (fused_moe, tile_configs):
        lookup = module.get_config
        monkeypatch.setattr(module, "get_config", lambda E, *a, lookup=lookup: looked_up.add(E) or lookup(E, *a))
    opts, few, expected = triton_run(LLM, hf_model, device, OPTS)
    llm = LLM(str(hf_model), expert_cache_gb=cache_gb(hf_model, 3), **opts,
              offload=OffloadConfig(policy="lru", prefetch=False, mode="copy"))
    looked_up.clear()
    assert [o.token_ids for o in llm.generate(few, SHORT)] == expected
    assert looked_up == {llm.model.expert_offload.num_experts}


def test_cost_model_splits_misses_between_cpu_and_copies(hf_model, reference):
    # rates chosen so that one copy costs about as much as a 3-token CPU expert: both paths get work
    llm = run_offloaded(hf_model, cache_gb(hf_model, 4), policy="lru", cpu_compute="auto", pcie_gbps=1.0,
                        cpu_expert_ms=0.01, cpu_token_ms=0.01, overlap=True)
    stats_expert_ms = 1e3 * llm.model.expert_offload.store.expert_bytes(0) / 1e9
    assert 0.01 < stats_expert_ms
    assert [o.token_ids for o in llm.generate(prompts(), GREEDY)] == reference
    stats = llm.stats()
    assert stats["misses_cpu"] > 0 and stats["misses_copied"] > 0
    assert stats["cost_model"]["h2d_GBps"] == pytest.approx(1.0)


def test_model_that_does_not_fit_offloads_by_itself(hf_model, reference, caplog):
    from moerun.config import ModelConfig
    from moerun.moe.offload.planner import workspace_bytes

    opts = dict(OPTS, max_model_len=64)
    mc = ModelConfig.from_json_file(hf_model / "config.json")
    fp = footprint_of_config(mc, torch.float32)
    kv = 2 * mc.num_layers * mc.num_kv_heads * mc.head_dim * 4 * opts["max_model_len"] * opts["max_num_seqs"]
    need = fp.non_expert_bytes + workspace_bytes(mc, torch.float32, 8192, opts["max_num_seqs"]) + kv
    budget = (need + fp.pool_bytes(4) + 1024) / 2**30  # room for the KV cache and 4 of 8 experts per layer
    assert fp.pool_bytes(4) + kv < fp.experts_total + kv // opts["max_num_seqs"]  # so the whole model does not fit
    llm = LLM(str(hf_model), gpu_memory_gb=budget, **opts)
    stats = llm.stats()
    assert stats["offloading"] and stats["slots_per_layer"] == 4
    assert llm.engine.cache.num_slots == opts["max_num_seqs"]
    assert [o.token_ids for o in llm.generate(prompts(), GREEDY)] == reference


def test_model_that_fits_is_not_offloaded(hf_model):
    llm = LLM(str(hf_model), gpu_memory_gb=16, **OPTS)
    assert llm.stats() == {"offloading": False}
    assert not any(type(b.experts).__name__ == "OffloadedExperts" for b in llm.model.moe_blocks())


@pytest.fixture(scope="module")
def gguf_reference(gguf_model):
    return [o.token_ids for o in LLM(str(gguf_model), **OPTS).generate(prompts(1), GREEDY)]


@pytest.mark.parametrize("policy,prefetch,cpu_compute", [("lru", True, "off"), ("lfu", False, "off"),
                                                         ("activation", True, "always")])
def test_gguf_experts_offloaded_as_blocks(gguf_model, gguf_reference, policy, prefetch, cpu_compute):
    llm = LLM(str(gguf_model), expert_cache_gb=cache_gb(gguf_model, 3, gguf=True), **OPTS,
              offload=OffloadConfig(policy=policy, prefetch=prefetch, cpu_compute=cpu_compute, overlap=prefetch))
    manager = llm.model.expert_offload
    assert manager.pool.quantized and manager.slots_per_layer == 3
    qtypes = {s.qtype for layer in manager.store.specs for s in layer}
    assert None not in qtypes and len(qtypes) >= 2  # Q4_K gate/up, Q6_K down on some layers
    assert all(t.dtype == torch.uint8 for layer in manager.pool.parts for t in layer)
    assert [o.token_ids for o in llm.generate(prompts(1), GREEDY)] == gguf_reference
    stats = llm.stats()
    if cpu_compute == "off":
        assert stats["misses_copied"] > 0
        assert stats["bytes_copied"] == stats["bytes_copied_miss"] + stats["bytes_copied_prefetch"] > 0


@pytest.mark.parametrize("device", TRITON_DEVICES)
def test_read_only_types_offloaded_on_triton(gguf_model, tmp_path, device):
    # Grid types have no repacked layout: their experts move as GGUF blocks (copy mode) and the Triton path (the
    # interpreter on the CPU) reads the slots' blocks with its own kernels; the tokens are the resident engine's.
    from helpers import with_random_blocks

    path = tmp_path / "m-IQ3_XXS.gguf"
    with_random_blocks(gguf_model, path, "IQ3_XXS", seed=5, names=("_exps.", "attn_q."))
    # one prompt, three tokens: the grid types' prefill tiles take half a minute a step in the interpreter
    opts, few, want = triton_run(LLM, path, device, OPTS, count=1, params=FEW)
    cached = LLM(str(path), expert_cache_gb=cache_gb(path, 3, gguf=True), **opts)
    assert [o.token_ids for o in cached.generate(few, FEW)] == want
    stats = cached.stats()
    assert stats["mode"] == "copy" and stats["misses"] > 0


@pytest.mark.parametrize("device", TRITON_DEVICES)
def test_gguf_slots_stay_repacked_for_the_fused_kernels(gguf_model, device, monkeypatch):
    # the fused quantized kernels (Triton's interpreter on the CPU) run on slot ids over the repacked slot pool
    from moerun.kernels.quant import fused_moe_quant
    from moerun.moe.offload.packed_pool import PackedSlotPool

    looked_up = set()  # the expert counts the kernels' configs were looked up for
    lookup = fused_moe_quant.get_moe_config
    monkeypatch.setattr(fused_moe_quant, "get_moe_config", lambda q, E, *a: looked_up.add(E) or lookup(q, E, *a))
    opts, few, expected = triton_run(LLM, gguf_model, device, OPTS)
    llm = LLM(str(gguf_model), expert_cache_gb=cache_gb(gguf_model, 3, gguf=True), **opts,
              offload=OffloadConfig(policy="lru", prefetch=True, mode="copy"))
    manager = llm.model.expert_offload
    assert isinstance(manager.pool, PackedSlotPool) and not manager.compact
    looked_up.clear()
    assert [o.token_ids for o in llm.generate(few, SHORT)] == expected
    assert looked_up == {manager.num_experts}, "the layer's expert count picks the tuned tables, not the pool's"
    assert llm.stats()["misses_copied"] > 0
    for layer in range(manager.num_layers):  # every slot holds its expert's repacked blocks, the null slot zeros
        for part, ours in zip(manager.store.weights(layer), manager.pool.weights(layer)):
            full = part.dequantize(torch.float32)  # [E, N, K] from the host blocks
            packed = torch.cat([p.dequantize(torch.float32).cpu() for p in ours], dim=1)  # [S + 1, N, K]
            assert packed[manager.pool.null_slot].abs().max() == 0
            for expert in range(manager.num_experts):
                slot = int(manager.table.slot_of[layer, expert])
                if slot >= 0:
                    torch.testing.assert_close(packed[slot], full[expert], rtol=0, atol=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("prefetch", [False, True])
def test_copy_mode_decodes_through_layer_graphs(hf_model, prefetch):
    # three sequences replay the bucket of four: a padding row routes too, but only real rows are served
    opts = dict(OPTS, device="cuda")
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    few = prompts(3)[:3]
    expected = [o.token_ids for o in LLM(str(hf_model), **opts).generate(few, params)]
    llm = LLM(str(hf_model), expert_cache_gb=cache_gb(hf_model, 3), **opts,
              offload=OffloadConfig(policy="lru", prefetch=prefetch, mode="copy"))
    runner = llm.engine.runner
    assert runner.layer_graphs is not None and not runner.graphs
    assert [o.token_ids for o in llm.generate(few, params)] == expected
    stats = llm.stats()
    assert runner.layer_graphs.replays > 0 and stats["misses_copied"] > 0
    llm.model.expert_offload.table.check()


def test_offloaded_gguf_holds_its_non_expert_weights_once(gguf_model, gguf_reference):
    # on CUDA the moved weights are repacked and their GGUF blocks dropped (repack=True forces it here), embedding
    # tables too (their lookups decode rows of the repacked copy); generation is unchanged
    from moerun.layers.embedding import Embedding
    from moerun.layers.quantized import QuantizedWeight
    from moerun.moe.offload.placement import _move_quantized

    llm = LLM(str(gguf_model), expert_cache_gb=cache_gb(gguf_model, 3, gguf=True), **OPTS)
    model = llm.model
    _move_quantized(model, torch.device("cpu"), repack=True)
    weights = {(name, key): (isinstance(m, Embedding), v) for name, m in model.named_modules()
               for key, v in m.__dict__.items() if key.startswith("q_") and isinstance(v, QuantizedWeight)}
    assert any(table for table, _ in weights.values()) and any(not table for table, _ in weights.values())
    for (name, key), (_, w) in weights.items():
        assert w.released, f"{name}.{key}"
    assert [o.token_ids for o in llm.generate(prompts(1), GREEDY)] == gguf_reference


def test_gguf_footprint_counts_slots_at_their_repacked_size(gguf_model):
    from moerun.models.gguf_checkpoint import read_gguf_config
    from moerun.moe.offload.packed_pool import packed_part_bytes

    fp = footprint_of_gguf(gguf_model, read_gguf_config(gguf_model), torch.float32)
    llm = LLM(str(gguf_model), expert_cache_gb=cache_gb(gguf_model, 3, gguf=True), **OPTS)
    specs = llm.model.expert_offload.store.specs
    assert fp.expert_bytes == tuple(sum(packed_part_bytes(s) for s in layer) for layer in specs)
    assert all(b > sum(s.nbytes for s in layer) for b, layer in zip(fp.expert_bytes, specs))  # Q4_K rows grow
