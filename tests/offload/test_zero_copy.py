"""Zero-copy offloading: generation is token-for-token the non-offloaded engine's under every policy while the cache
churns between steps; table entries point at a slot only once its copy completed, evicted experts at their host
copies, no slot is double-booked; misses and bytes counted per forward pass when one boundary takes several steps;
options, errors and the CLI flag. The CUDA test checks the graphed decode."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from offload_common import GREEDY, SHORT, TRITON_DEVICES, prompts, triton_run
from moerun import LLM
from moerun.cli import main
from moerun.moe.offload import OffloadConfig
from moerun.moe.offload.config import resolve_mode
from moerun.moe.offload.store import HostExpertStore, PartSpec
from moerun.moe.offload.zero_copy import ZeroCopyOffload
from moerun.ops.moe_reference import fused_moe_reference
from moerun.sampling_params import SamplingParams
from test_offload_generation import OPTS, cache_gb

POLICIES = ["lru", "lfu", "activation"]
CHURN = 10**9  # admission budget per step that never binds: every missed expert is admitted when worth it


@pytest.fixture(scope="module")
def reference(hf_model):
    return [o.token_ids for o in LLM(str(hf_model), **OPTS).generate(prompts(), GREEDY)]


def zero_copy_llm(path, slots: int, opts: dict | None = None, **config) -> LLM:
    llm = LLM(str(path), expert_cache_gb=cache_gb(path, slots), offload=OffloadConfig(mode="zero_copy", **config),
              **OPTS, **(opts or {}))
    assert isinstance(llm.model.expert_offload, ZeroCopyOffload)
    return llm


def check_stats(llm: LLM) -> dict:
    s = llm.stats()
    manager = llm.model.expert_offload
    assert s["mode"] == "zero_copy" and s["offloading"]
    assert s["hits"] + s["misses"] == s["lookups"] > 0
    assert s["misses"] == s["misses_host"] and s["misses_copied"] == s["misses_cpu"] == 0
    assert s["bytes_read_host"] == s["misses_host"] * manager.store.expert_bytes(0)  # dense: every layer alike
    assert s["bytes_admitted"] == s["admissions"] * manager.store.expert_bytes(0) and s["copies"] == s["admissions"]
    assert s["bytes_copied"] == s["bytes_read_host"] + s["bytes_admitted"]
    assert s["copy_stall_s"] == 0 and s["prefetch_accuracy"] is None
    # the staging copies are timed by the GPU's clock where there is one (CUDA, the Triton backend)
    assert s["copy_timed"] == manager.copy_timed
    if manager.copy_timed:
        assert s["copy_in_step_s"] > 0 and s["copy_in_step_ms_per_token"] > 0
    else:
        assert s["copy_in_step_s"] == 0
    assert s["hit_rate"] == pytest.approx(s["hits"] / s["lookups"])
    manager.check()
    return s


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("admit", [None, CHURN])
def test_identical_to_the_resident_engine(hf_model, reference, policy, admit):
    llm = zero_copy_llm(hf_model, 3, policy=policy, admit_bytes_per_step=admit)
    assert [o.token_ids for o in llm.generate(prompts(), GREEDY)] == reference
    s = check_stats(llm)
    assert s["misses"] > 0 and s["admissions"] > 0 and s["evictions"] == s["admissions"]  # slots start full
    assert s["tokens"] == sum(len(p) for p in prompts()) + len(prompts()) * (GREEDY.max_tokens - 1)
    assert not llm.engine.runner.graphs  # CPU: no graphs, the same forward eagerly


def test_static_cache(hf_model, reference):
    llm = zero_copy_llm(hf_model, 3, admit_bytes_per_step=0)  # the first experts stay; the others are read in place
    assert [o.token_ids for o in llm.generate(prompts(), GREEDY)] == reference
    s = check_stats(llm)
    assert s["admissions"] == s["evictions"] == 0 and s["hits"] > 0 and s["misses"] > 0


@pytest.mark.parametrize("slots", [0, 1])
def test_cache_smaller_than_top_k(hf_model, reference, slots):
    # copy mode refuses fewer slots than top-k (2); zero-copy reads the rest from host memory, down to no cache
    llm = zero_copy_llm(hf_model, slots, admit_bytes_per_step=CHURN)
    assert llm.model.expert_offload.slots_per_layer == slots
    assert [o.token_ids for o in llm.generate(prompts(), GREEDY)] == reference
    s = check_stats(llm)
    assert s["misses"] > 0 and (s["hits"] == 0) == (slots == 0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="Triton's interpreter runs when there is no CUDA")
@pytest.mark.parametrize("stage", [None, 1], ids=["misses staged", "one staging row, the rest read in place"])
def test_triton_kernels_in_the_interpreter(hf_model, stage):
    # the Triton path (address tables dereferenced by the kernels, missed experts staged on the device first) with
    # slot churn, against the resident engine on the same kernels; a short run, the interpreter being slow
    opts = dict(moe_backend="triton")
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    ids = prompts(4)[:2]
    expected = [o.token_ids for o in LLM(str(hf_model), **OPTS, **opts).generate(ids, params)]
    llm = zero_copy_llm(hf_model, 2, policy="lru", admit_bytes_per_step=CHURN, opts=opts, stage_experts=stage)
    manager = llm.model.expert_offload
    # the default for an engine of several sequences: two rows per expert a token routes to
    assert manager.staging is not None and manager.staging.shape[0] == (stage or 2 * manager.top_k)
    assert [o.token_ids for o in llm.generate(ids, params)] == expected
    assert check_stats(llm)["admissions"] > 0
    manager.check()


@pytest.mark.parametrize("overlap,hold", [(None, None), (True, None), (None, 1)],
                         ids=["defaults", "overlap on", "admitted slots held"])
@pytest.mark.parametrize("device", TRITON_DEVICES)
def test_admission_on_device(hf_model, device, overlap, hold):
    # the default where staging applies: missed experts are staged straight into the slots the policy values least,
    # so the cache changes inside the step (in CUDA graphs on the GPU) and no admission reads host memory again;
    # with overlap (the default on CUDA) GEMM 1 of the cached experts' pairs runs before the staged ones'; with a
    # hold (none by default in a cache this small), a slot admitted into is not given up by the layer's next pass
    if device == "cuda" and overlap:
        pytest.skip("the default on CUDA")
    opts = dict(OPTS, moe_backend="triton", device=device)
    params = SamplingParams(max_tokens=5 if device == "cpu" else 24, temperature=0, ignore_eos=True)
    ids = prompts(4)[:2] if device == "cpu" else prompts()
    expected = [o.token_ids for o in LLM(str(hf_model), **opts).generate(ids, params)]
    llm = LLM(str(hf_model), expert_cache_gb=cache_gb(hf_model, 2),
              offload=OffloadConfig(mode="zero_copy", overlap=overlap, admit_hold_passes=hold), **opts)
    manager = llm.model.expert_offload
    assert manager.device_admission and manager.spares.shape == (manager.num_layers, 2)
    assert manager.hold_passes == (hold or 0)
    assert manager.overlap == (device == "cuda" or bool(overlap))
    assert bool(llm.engine.runner.graphs) == (device == "cuda")
    assert [o.token_ids for o in llm.generate(ids, params)] == expected
    s = llm.stats()
    assert s["admit_on_device"] and s["admissions"] == s["bytes_admitted"] == 0
    assert s["admissions_on_device"] > 0 and s["evictions"] == s["admissions_on_device"]  # slots start full
    assert s["hits"] + s["misses"] == s["lookups"] and s["misses"] == s["misses_host"] > 0 and s["hits"] > 0
    assert s["bytes_read_host"] == s["misses"] * manager.store.expert_bytes(0) == s["bytes_copied"]
    assert s["admit_hold_passes"] == (hold or 0)
    held = manager.hold.cpu()
    assert int(held.min()) >= 0 and int(held.max()) <= (hold or 0)  # a pass's worth at most; none without a hold
    manager.check()
    if hold:
        return
    with pytest.raises(ValueError, match="needs staging"):
        LLM(str(hf_model), expert_cache_gb=cache_gb(hf_model, 2), **opts,
            offload=OffloadConfig(mode="zero_copy", admit_on_device=True, stage_experts=0))
    with pytest.raises(ValueError, match="takes no admit_bytes_per_step"):
        OffloadConfig(admit_on_device=True, admit_bytes_per_step=0)


# ---- table / slot accounting over random routing ----
L, E, H, I = 3, 8, 8, 4  # noqa: E741


class Copy:
    """A copy's event under test control: it completes when the test says so."""

    def __init__(self) -> None:
        self.done = False

    def query(self) -> bool:
        return self.done


def toy_store(seed: int) -> HostExpertStore:
    g = torch.Generator().manual_seed(seed)
    parts = [[torch.randn(E, 2 * I, H, generator=g) / H**0.5, torch.randn(E, H, I, generator=g) / I**0.5]
             for _ in range(L)]
    specs = [[PartSpec("w13", (2 * I, H), torch.float32), PartSpec("w2", (H, I), torch.float32)] for _ in range(L)]
    return HostExpertStore(parts, specs)


@settings(max_examples=40, deadline=None)
@given(policy=st.sampled_from(POLICIES), k=st.integers(1, 3), slots=st.integers(0, E),
       admit=st.sampled_from([None, 0, 1, CHURN]), seed=st.integers(0, 2**16), zipf=st.floats(0.0, 2.0),
       steps=st.lists(st.tuples(st.integers(1, 5), st.floats(0.0, 1.0), st.booleans()), min_size=1, max_size=8))
def test_table_accounting(policy, k, slots, admit, seed, zipf, steps):
    store = toy_store(seed)
    nbytes = store.expert_bytes(0)
    config = OffloadConfig(mode="zero_copy", policy=policy,
                           admit_bytes_per_step=None if admit is None else admit * nbytes)
    manager = ZeroCopyOffload(store, slots, torch.device("cpu"), k, config, backend="torch")
    copies: list[Copy] = []
    manager.copier.record = lambda: copies.append(Copy()) or copies[-1]
    rng = np.random.default_rng(seed)
    popularity = 1.0 / np.arange(1, E + 1) ** zipf
    manager.check()
    for T, finish, new_request in steps:
        if new_request:
            manager.new_request()
        for c in copies:  # the oldest copies complete before the next step boundary (one stream: in order)
            if not c.done and rng.random() >= finish:
                break
            c.done = True
        completed = [(layer, e) for event, plan in manager.pending if event.query()
                     for layer, e in zip(plan.layers.tolist(), plan.experts.tolist())]
        manager.between_steps(T)
        # a completed copy switches its entry to the slot (unless the same boundary evicted it again)
        assert all(manager.slots.ready[layer, e] or manager.slots.slot_of[layer, e] < 0 for layer, e in completed)
        manager.check()  # pending copies point at the host copy, ready experts at their slots, no double booking
        for layer in range(L):
            ids = np.stack([rng.choice(E, k, replace=False, p=popularity / popularity.sum()) for _ in range(T)])
            topk_ids = torch.from_numpy(ids.astype(np.int32))
            topk_weights = torch.from_numpy(rng.random((T, k)).astype(np.float32))
            x = torch.from_numpy(rng.standard_normal((T, H)).astype(np.float32))
            out = manager.forward_layer(layer, x, topk_weights, topk_ids)
            w13, w2 = store.weights(layer)
            torch.testing.assert_close(out, fused_moe_reference(x, w13, w2, topk_weights, topk_ids), rtol=0, atol=0)
    s = manager.stats_dict()
    assert s["hits"] + s["misses"] == s["lookups"] > 0
    assert s["tokens"] == sum(T for T, _, _ in steps)
    assert s["evictions"] <= s["admissions"]
    if admit is not None:  # the budget binds at every step boundary (the first has no routing yet)
        assert s["bytes_admitted"] <= (len(steps) - 1) * admit * nbytes
    if slots == 0 or admit == 0:
        assert s["admissions"] == 0


# routing of two forward passes [T, k] in every layer: experts 0 .. 3 start in the slots, so 0 and 1 hit and 5 (in
# both passes) and 6 are read from host memory; 5 must count a miss and its bytes in each pass
TWO_PASSES = [[[5, 0], [0, 5]], [[5, 1], [6, 5]]]


def forward_pass(manager: ZeroCopyOffload, store: HostExpertStore, ids: list[list[int]]) -> None:
    topk_ids = torch.tensor(ids, dtype=torch.int32)
    topk_weights = torch.full(topk_ids.shape, 0.5)
    x = torch.randn(topk_ids.shape[0], H, generator=torch.Generator().manual_seed(len(ids)))
    for layer in range(L):
        out = manager.forward_layer(layer, x, topk_weights, topk_ids)
        w13, w2 = store.weights(layer)
        torch.testing.assert_close(out, fused_moe_reference(x, w13, w2, topk_weights, topk_ids), rtol=0, atol=0)


@pytest.mark.parametrize("taken_by", ["between_steps", "stats_dict"])
def test_steps_taken_together_count_each_pass(taken_by):
    # async scheduling: one boundary (or a stats read) often takes two finished steps at once; an expert missed in
    # both was read from host memory twice, so the statistics equal those of one boundary per step (synchronous)
    store = toy_store(0)
    keys = ["lookups", "hits", "misses", "misses_host", "bytes_read_host", "bytes_copied"]
    got = {}
    for together in (False, True):
        config = OffloadConfig(mode="zero_copy", policy="lfu", admit_bytes_per_step=0)  # the cache stays as filled
        manager = ZeroCopyOffload(store, 4, torch.device("cpu"), 2, config, backend="torch")
        manager.between_steps(2)
        for ids in TWO_PASSES:
            forward_pass(manager, store, ids)
            if not together:
                manager.between_steps(2)
        if together and taken_by == "between_steps":
            manager.between_steps(2)
        s = manager.stats_dict()
        got[together] = ({k: s[k] for k in keys}, manager.policy.freq.copy())
        manager.check()
    nbytes = store.expert_bytes(0)
    # per layer: pass 1 routes 0 (hit) and 5 (miss), pass 2 routes 1 (hit), 5 and 6 (misses)
    expected = dict(lookups=5 * L, hits=2 * L, misses=3 * L, misses_host=3 * L, bytes_read_host=3 * L * nbytes,
                    bytes_copied=3 * L * nbytes)
    assert got[False][0] == expected
    assert got[True][0] == expected
    freq = np.zeros((L, E), dtype=np.int64)  # the policy sees the (token, expert) pairs, as before
    freq[:, [0, 1, 5, 6]] = [2, 1, 4, 1]
    assert (got[False][1] == freq).all() and (got[True][1] == freq).all()


def test_reset_stats_drops_the_passes_before_it():
    store = toy_store(0)
    manager = ZeroCopyOffload(store, 4, torch.device("cpu"), 2, OffloadConfig(mode="zero_copy", admit_bytes_per_step=0),
                              backend="torch")
    manager.between_steps(2)
    forward_pass(manager, store, TWO_PASSES[0])
    manager.reset_stats()
    forward_pass(manager, store, TWO_PASSES[1])
    manager.between_steps(2)
    s = manager.stats_dict()
    assert (s["lookups"], s["hits"], s["misses"]) == (3 * L, L, 2 * L)
    assert s["bytes_read_host"] == 2 * L * store.expert_bytes(0)


# ---- quantized experts (the fused quantized kernels through address tables; Triton's interpreter on CPU) ----
@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize("admit", [CHURN, None], ids=["admitted between steps", "admitted on the device"])
def test_quantized_experts_read_in_place(gguf_model, device, admit):
    # on CUDA 'auto' picks zero-copy for experts the fused quantized kernels read; on the CPU it is asked for
    mode = "auto" if device == "cuda" else "zero_copy"
    opts, few, expected = triton_run(LLM, gguf_model, device, OPTS)
    llm = LLM(str(gguf_model), expert_cache_gb=cache_gb(gguf_model, 3, gguf=True), **opts,
              offload=OffloadConfig(mode=mode, admit_bytes_per_step=admit))
    manager = llm.model.expert_offload
    assert isinstance(manager, ZeroCopyOffload) and manager.packed and manager.staging is not None
    assert manager.table.shape[1:] == (2, 8, 4)  # gate|up and down parts, 8 experts, 4 arrays each
    assert manager.device_admission == (admit is None)
    assert [o.token_ids for o in llm.generate(few, SHORT)] == expected
    s = llm.stats()
    admitted = s["admissions_on_device"] if admit is None else s["admissions"]
    assert s["mode"] == "zero_copy" and s["misses_host"] == s["misses"] > 0 and admitted > 0
    assert s["hits"] + s["misses"] == s["lookups"] > 0
    manager.check()


# ---- options, errors, CLI ----
def test_mode_resolution_and_errors(gguf_model):
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_mode(OffloadConfig(), cpu, dense=True) == "copy"
    assert resolve_mode(OffloadConfig(), cuda, dense=True) == "zero_copy"
    assert resolve_mode(OffloadConfig(), cuda, dense=False) == "copy"
    assert resolve_mode(OffloadConfig(), cuda, dense=False, quantized_in_place=True) == "zero_copy"
    assert resolve_mode(OffloadConfig(), cpu, dense=False, quantized_in_place=True) == "copy"
    assert resolve_mode(OffloadConfig(mode="copy"), cuda, dense=False, quantized_in_place=True) == "copy"
    assert resolve_mode(OffloadConfig(cpu_compute="auto"), cuda, dense=True) == "copy"
    assert resolve_mode(OffloadConfig(mode="zero_copy"), cpu, dense=True) == "zero_copy"
    assert resolve_mode(OffloadConfig(prefetch=True), cuda, dense=True) == "copy"  # prefetch is copy mode's
    assert resolve_mode(OffloadConfig(prefetch=False), cuda, dense=True) == "zero_copy"
    with pytest.raises(ValueError, match="'zero_copy' does not prefetch"):
        OffloadConfig(mode="zero_copy", prefetch=True)
    with pytest.raises(ValueError, match="offload mode must be one of"):
        OffloadConfig(mode="mapped")
    with pytest.raises(ValueError, match="needs cpu_compute='off'"):
        OffloadConfig(mode="zero_copy", cpu_compute="always")
    with pytest.raises(ValueError, match="not 'staged'"):
        OffloadConfig(mode="zero_copy", pin="staged")
    with pytest.raises(ValueError, match="admit_bytes_per_step must be >= 0"):
        OffloadConfig(admit_bytes_per_step=-1)
    with pytest.raises(ValueError, match="admit_hold_passes must be >= 0"):
        OffloadConfig(admit_hold_passes=-1)
    with pytest.raises(ValueError, match="needs the Triton backend"):  # quantized experts: the fused kernels
        LLM(str(gguf_model), expert_cache_gb=cache_gb(gguf_model, 3, gguf=True), offload_mode="zero_copy", **OPTS,
            moe_backend="torch")


def test_staging_rows_and_hold_chosen_by_the_engine_size():
    # rows: top-k for one sequence at a time, twice that for batches; the hold: 2 passes where the held slots and as
    # many spares fit in half the cache, 1 where one pass's do, else none; given values are kept
    from moerun.moe.offload.placement import offload_options

    auto = OffloadConfig()
    assert [auto.stage_rows(8, n) for n in (1, 2, 64)] == [8, 16, 16]
    assert OffloadConfig(stage_experts=3).stage_rows(8, 64) == 3
    assert offload_options(None, top_k=8, max_num_seqs=1).stage_experts == 8
    assert offload_options(OffloadConfig(stage_experts=0), top_k=8, max_num_seqs=64).stage_experts == 0
    assert [auto.hold_passes(8, s) for s in (9, 31, 32, 47, 48, 128)] == [0, 0, 1, 1, 2, 2]
    assert OffloadConfig(admit_hold_passes=0).hold_passes(8, 128) == 0


def test_llm_kwarg_and_cli_flag(hf_model, capsys):
    llm = LLM(str(hf_model), expert_cache_gb=cache_gb(hf_model, 3), offload_mode="zero_copy", **OPTS)
    assert llm.stats()["mode"] == "zero_copy"
    assert LLM(str(hf_model), expert_cache_gb=cache_gb(hf_model, 3), **OPTS).stats()["mode"] == "copy"  # auto, CPU
    argv = ["generate", "--model", str(hf_model), "--device", "cpu", "--prompt", "Hello", "--max-tokens", "4",
            "--temperature", "0", "--expert-cache-gb", f"{cache_gb(hf_model, 3):.12f}", "--offload-mode",
            "zero_copy", "--verbose", "--max-model-len", "64"]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "expert offloading (zero-copy): policy lru, 3 of 8 experts per layer" in err and "read by the kernels" in err
    # prefetch is copy mode's: asked for, 'auto' takes that mode
    argv[argv.index("zero_copy")] = "auto"
    assert main([*argv, "--offload-prefetch", "on"]) == 0
    err = capsys.readouterr().err
    assert "expert offloading: policy lru" in err and "prefetch True" in err


# ---- CUDA: the decode step is graphed ----
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("policy", ["lru", "activation"])
def test_graphed_zero_copy_decode_on_cuda(hf_model, policy):
    opts = dict(device="cuda", max_model_len=128, max_num_seqs=4)
    expected = [o.token_ids for o in LLM(str(hf_model), **opts).generate(prompts(), GREEDY)]
    llm = LLM(str(hf_model), expert_cache_gb=cache_gb(hf_model, 3), **opts,
              offload=OffloadConfig(policy=policy, admit_bytes_per_step=CHURN))
    manager = llm.model.expert_offload
    assert isinstance(manager, ZeroCopyOffload) and manager.store.pinned  # 'auto' on CUDA
    assert manager.copy_timed == (manager.staging is not None)  # staged on the Triton backend, timed there
    assert llm.engine.runner.graphs  # decode graphs were captured with offloading on
    assert [o.token_ids for o in llm.generate(prompts(), GREEDY)] == expected
    s = check_stats(llm)
    assert s["admissions"] > 0 and s["misses"] > 0 and s["hits"] > 0


def test_admission_plan_fills_free_slots_then_replaces_what_the_policy_values_less():
    from moerun.moe.offload.residency import Plan, Residency

    slots = Residency(2, 6, 2)
    slots.admit(Plan(np.array([0, 0, 1]), np.array([0, 1, 0]), np.array([0, 1, 0]), np.array([-1, -1, -1])))
    slots.settle(np.array([0, 0, 1]), np.array([0, 1, 0]))
    value = np.array([[5.0, 1.0, 0, 4.0, 0, 2.0], [3.0, 0, 0, 0, 9.0, 1.0]])  # higher: keep
    routed = np.array([[0, 0, 0, 2, 0, 1], [0, 0, 0, 0, 1, 3]])
    nbytes = np.array([10, 10])
    plan = slots.plan(routed, value, value, nbytes, budget=100)
    got = sorted(zip(plan.layers.tolist(), plan.experts.tolist(), plan.slots.tolist(), plan.victims.tolist()))
    # layer 0: expert 3 (4.0) replaces expert 1 (1.0), expert 5 (2.0) does not beat expert 0 (5.0);
    # layer 1: expert 4 takes the free slot, then expert 5 (1.0) does not beat expert 0 (3.0)
    assert got == [(0, 3, 1, 1), (1, 4, 1, -1)]
    assert len(slots.plan(routed, value, value, nbytes, budget=10)) == 1  # the budget: one expert
    slots.admit(plan)
    slots.check()
    assert slots.loading[0, 3] and slots.slot_of[0, 1] == -1 and not slots.ready[0, 1]


def test_experts_missed_twice_are_admitted_beyond_the_quarter_budget():
    # the default budget is a quarter of the bytes read from host memory; an expert read from host memory at two
    # boundaries in a row is admitted on top of it, so a steady routing is served from slots within two steps
    store = toy_store(0)
    manager = ZeroCopyOffload(store, 4, torch.device("cpu"), 4, OffloadConfig(mode="zero_copy"), backend="torch")
    routing = torch.zeros(L, E, dtype=torch.int64)
    routing[:, 4:] = 1  # in every layer at every step the same 4 experts, not the 4 that start in the slots
    manager.between_steps(1)  # the first boundary: routing recorded before it belongs to no step
    manager.counts += routing
    manager.between_steps(1)  # 4 L missed: the quarter admits L of them
    assert manager.stats.admissions == L
    manager.counts += routing
    manager.between_steps(1)  # the other 3 L missed again: all admitted
    assert manager.stats.admissions == 4 * L
    assert (manager.slots.slot_of[:, 4:] >= 0).all()
    manager.check()


@pytest.mark.skipif(torch.cuda.is_available(), reason="Triton's interpreter runs when there is no CUDA")
@settings(max_examples=6, deadline=None)
@given(policy=st.sampled_from(POLICIES), k=st.integers(1, 3), slots=st.integers(1, E), seed=st.integers(0, 2**16),
       steps=st.lists(st.tuples(st.integers(1, 4), st.booleans()), min_size=1, max_size=4))
def test_admission_on_device_accounting(policy, k, slots, seed, steps):
    # the staging launch admits into slots on the device: outputs stay exact, the host's view follows the device's
    # occupants after each boundary (also when one boundary takes two passes), and the misses counted are the
    # routed experts whose entries pointed at host memory when their layer ran
    store = toy_store(seed)
    manager = ZeroCopyOffload(store, slots, torch.device("cpu"), k, OffloadConfig(mode="zero_copy", policy=policy),
                              backend="triton")
    assert manager.device_admission
    rng = np.random.default_rng(seed)
    manager.between_steps(1)
    lookups = misses = 0
    for T, together in steps:
        for _ in range(2 if together else 1):
            for layer in range(L):
                ids = np.stack([rng.choice(E, k, replace=False) for _ in range(T)])
                routed = np.unique(ids)
                lookups += len(routed)
                cached = routed[manager.is_host[layer, routed].numpy() == 0]
                misses += len(routed) - len(cached)
                topk_ids = torch.from_numpy(ids.astype(np.int32))
                topk_weights = torch.from_numpy(rng.random((T, k)).astype(np.float32))
                x = torch.from_numpy(rng.standard_normal((T, H)).astype(np.float32))
                before = manager.counts[layer].clone()
                out = manager.forward_layer(layer, x, topk_weights, topk_ids)
                w13, w2 = store.weights(layer)
                torch.testing.assert_close(out, fused_moe_reference(x, w13, w2, topk_weights, topk_ids))
                assert not manager.is_host[layer, cached].any()  # an expert the pass routes to is never given up
                # every pair counted once
                assert torch.equal(manager.counts[layer] - before, torch.bincount(topk_ids.view(-1).long(),
                                                                                  minlength=E))
        manager.between_steps(T)
        manager.check()
    s = manager.stats_dict()
    assert (s["lookups"], s["misses"]) == (lookups, misses)
    assert s["admissions"] == 0 and s["admissions_on_device"] >= s["evictions"]
