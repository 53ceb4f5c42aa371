"""Expert offloading on one GPU: decode speed and cache behaviour of a Qwen3-30B-A3B-shaped model with random
weights at several GPU memory budgets (experts in pinned host memory, a device cache of expert slots).

Rows: bf16 experts at each --budgets GiB (LRU; uniform routing from the random routers, and a skewed routing trace),
policy / prefetch / CPU-compute variants at the middle budget, and a GGUF Q4_K_M-shaped variant (experts copied as
blocks) at the budgets llama.cpp needs with --n-cpu-moe 24 and 48 (non-expert weights + KV + half / none of the
experts). ``--vs transformers`` adds transformers with accelerate offloading (device_map from the same max_memory).
Every bf16 row runs in each of --modes: 'zero_copy' (kernels read missed experts from pinned host memory, decode in
CUDA graphs, the cache updated between steps) and 'copy' (misses copied into the cache, eager decode); the
quantized rows run in 'copy' mode, the only one for quantized experts.

Skewed trace: each MoE layer ranks its experts by a random permutation and routes with Zipf(--zipf) popularity over
that ranking; with probability --locality a token keeps the previous token's (same batch row's) expert set at that
layer (temporal locality). The routers still run, but the experts they pick are swapped for the trace's (drawn on
the host beforehand, each step's ids copied to the device before its forward pass, so graphed steps read them);
router-lookahead prefetch cannot predict the trace and is off for those rows.

Steady routing (``--routings ...,steady``): the random routers route, on a model whose token embeddings are scaled up
by --steady-scale (a power of two, undone after the rows), so that each layer changes the residual stream little,
as the router lookahead assumes of a trained model: the next layer's router applied to this layer's input then
predicts most of its experts (copy mode's rows report the accuracy measured).

The copy floor is the decode rate if nothing but moving the missed experts' bytes to the GPU took time (copied in
copy mode, read by the kernels in zero-copy mode) and the prefetched experts' (useful or not), at the pinned
host-to-device bandwidth measured in the same run. Zero-copy mode moves its misses with a copy kernel whose reads
of host memory run at a rate of their own, which depends on the host (on H100 hosts of one pool: 48-51 GB/s
against the copy engine's 54-55 on some, 28-33 against 46-52 on another). The run measures that rate too
(``h2d.stage_kernel_GBps``, from memory page-locked as the store's is), so that a zero-copy row's "x floor" can be
read against what its copies could do there (x floor x kernel rate / pinned rate), and the kernel's first pass over
the same experts (``h2d.stage_kernel_first_pass_GBps``, by its own clock), host pages the GPU has not read before.
Its rows also time those copies inside the steps by the GPU's clock (column "copy", ms a token, and "GB/s", their
rate where they move every miss; "stall" is copy mode's wait for its copies), so a row splits into copying and the
rest.

    python benchmarks/bench_offload.py [--quick] [--modes zero_copy,copy] [--vs transformers] [--out bench-offload]
"""

from __future__ import annotations

import argparse
import functools
import gc
import itertools
import json
import random
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from moerun.api import LLM
from moerun.config import ModelConfig, parse_dtype
from moerun.engine.memory import available_bytes
from moerun.models.presets import preset_config
from moerun.moe.offload import OffloadConfig
from moerun.moe.offload.planner import Footprint, GiB, footprint_of_config, plan_placement, workspace_bytes
from moerun.moe.offload.random_build import expert_specs, random_expert_store, random_offloaded_model
from moerun.moe.offload.store import pinned_empty, unregister_all
from moerun.moe.offload.packed_pool import packed_part_bytes
from moerun.moe.offload.placement import attach_offload
from moerun.sampling_params import SamplingParams


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="qwen3-30b-a3b")
    p.add_argument("--layers", type=int, help="use only this many layers of the preset")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--budgets", default="8,16,24", help="GPU memory budgets in GiB")
    p.add_argument("--modes", default="zero_copy,copy", help="offload modes of the bf16 rows, in order")
    p.add_argument("--admit-mb", type=float, help="zero-copy: MiB admitted into the cache per step (default: auto)")
    p.add_argument("--admit-on-device", default="auto",
                   help="zero-copy: stage missed experts straight into cache slots: auto (where staging applies), on, "
                        "off, or several in order, e.g. on,off (a row each)")
    for flag, what in (("--admit-hold", "with admission on the device: passes an admitted expert keeps its slot "
                                        "(OffloadConfig.admit_hold_passes)"),
                       ("--stage-experts", "device rows a layer stages its missed experts in "
                                           "(OffloadConfig.stage_experts)")):
        p.add_argument(flag, default="auto", help=f"zero-copy {what}: auto, or numbers; several in order give a "
                                                  "row each")
    p.add_argument("--routings", default="random,skewed",
                   help="routings of the bf16 rows at each budget: random, skewed, steady (see above)")
    p.add_argument("--steady-scale", type=float, default=128.0,
                   help="steady routing: factor on the token embeddings (a power of two)")
    p.add_argument("--overlap", default="auto",
                   help="zero-copy: stage on a side stream while the cached experts' pairs are computed "
                        "(OffloadConfig.overlap): auto (on CUDA), on, off, or several in order (a row each)")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction,
                   help="launch each decode step before the previous one's tokens are read (default: the engine's "
                        "choice, on unless the host fills the expert cache between steps)")
    p.add_argument("--batch-sizes", default="1,8")
    p.add_argument("--steps", type=int, default=16, help="decode steps timed per row")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--zipf", type=float, default=1.2, help="Zipf exponent of the skewed routing trace")
    p.add_argument("--locality", type=float, default=0.5, help="probability a token keeps the previous experts")
    p.add_argument("--quick", action="store_true", help="fewer steps and no variant rows (about half the time)")
    p.add_argument("--no-variants", action="store_true",
                   help="no policy / CPU-compute variant rows (as --quick, with all --steps timed)")
    p.add_argument("--profile", action="store_true",
                   help="after each row's timed steps, print the GPU time per kernel of a few more steps")
    p.add_argument("--no-gguf", action="store_true", help="skip the Q4_K_M-shaped variant")
    p.add_argument("--only-gguf", action="store_true", help="run only the Q4_K_M-shaped rows (no bf16 model)")
    p.add_argument("--gguf-modes", default="copy", help="offload modes of the Q4_K_M rows, in order (copy,zero_copy)")
    p.add_argument("--vs", choices=["transformers"], help="also time transformers + accelerate offloading")
    p.add_argument("--hf-tokens", type=int, default=3, help="decode tokens timed for transformers")
    p.add_argument("--hf-budgets", help="budgets for transformers (default: all --budgets)")
    p.add_argument("--out", default="bench-offload")
    args = p.parse_args(argv)
    if args.quick:
        args.steps = min(args.steps, 6)
    choices = {"auto": None, "on": True, "off": False}
    for flag in ("admit_on_device", "overlap"):  # OffloadConfig values, in order
        names = [n.strip() for n in getattr(args, flag).split(",") if n.strip()]
        if not names or any(n not in choices for n in names):
            p.error(f"--{flag.replace('_', '-')}: expected a list of {sorted(choices)}, got {getattr(args, flag)!r}")
        setattr(args, flag, [choices[n] for n in names])
    for flag in ("admit_hold", "stage_experts"):  # OffloadConfig values: None (auto) or integers
        try:
            setattr(args, flag, [None if n.strip() == "auto" else int(n) for n in getattr(args, flag).split(",")
                                 if n.strip()])
        except ValueError:
            p.error(f"--{flag.replace('_', '-')}: expected auto or integers, got {getattr(args, flag)!r}")
    args.routings = [r.strip() for r in args.routings.split(",") if r.strip()]
    if not args.routings or any(r not in ROUTINGS for r in args.routings):
        p.error(f"--routings: expected a list of {ROUTINGS}, got {args.routings!r}")
    scale = args.steady_scale
    if not (scale >= 1 and float(2 ** round(np.log2(scale))) == scale):
        p.error(f"--steady-scale must be a power of two >= 1 (undone exactly), got {scale}")
    return args


ROUTINGS = ("random", "skewed", "steady")


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


# ---- measurements ----
def _median_seconds(run: Callable[[], object], device: torch.device) -> float:
    """Median wall time of 5 calls of ``run`` on ``device`` (after one untimed call), each synchronised."""
    times = []
    for _ in range(6):
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        run()
        torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    return sorted(times[1:])[2]


def measure_h2d(device: torch.device, nbytes: int = 2**30) -> dict[str, float]:
    """Host-to-device GB/s from pinned and from pageable memory (median of 5 copies of ``nbytes``)."""
    if device.type != "cuda":
        return {"pinned_GBps": 0.0, "pageable_GBps": 0.0}
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    out = {}
    for kind, pin in (("pinned_GBps", True), ("pageable_GBps", False)):
        src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
        src.fill_(1)
        out[kind] = nbytes / _median_seconds(functools.partial(dst.copy_, src, non_blocking=pin), device) / 1e9
        del src
    del dst
    torch.cuda.empty_cache()
    return out


def measure_stage_copy(device: torch.device, mc: ModelConfig, launches: int = 16, per_launch: int = 3,
                       pool_bytes: int = 2 * 2**30) -> tuple[float, float]:
    """GB/s of zero-copy mode's staging copy kernel (kernels/stage_misses.py) from pinned host memory: ``launches``
    launches of ``per_launch`` distinct bf16 experts of the model's shape each (w13 and w2 arrays, drawn from a pool
    of ``pool_bytes`` made as the store makes its arenas, store.pinned_empty) into device memory. Returns (warm, first
    pass): the median of 5 replays of one CUDA graph of the launches, and the launches' first pass (the first read of
    those host pages by the GPU), timed by the kernel's own clock. (0, 0) without CUDA or Triton. The kernel reads
    host memory with SM loads, whose rate over PCIe differs from the copy engine's, by host."""
    if device.type != "cuda":
        return 0.0, 0.0
    try:
        from moerun.kernels.stage_misses import StagePlan, copy_clock, copy_misses_triton
    except ImportError:
        return 0.0, 0.0
    words = [2 * mc.moe_intermediate_size * mc.hidden_size // 4, mc.hidden_size * mc.moe_intermediate_size // 4]
    expert = sum(words)  # int64 words of one bf16 expert: w13 [2I, H] and w2 [H, I]
    count = max(pool_bytes // (8 * expert), launches * per_launch)
    registry: list[int] = []
    pool = pinned_empty(count * expert * 8, registry).view(torch.int64)  # [count experts]
    pool.fill_(1)
    dst = torch.empty(per_launch * expert, dtype=torch.int64, device=device)  # [per_launch experts]
    sizes = torch.tensor(words, dtype=torch.int64, device=device)  # [A = 2]
    picks = torch.randperm(count, generator=torch.Generator().manual_seed(0))[: launches * per_launch].tolist()
    plans = []
    for i in range(launches):
        src = [[pool.data_ptr() + 8 * (e * expert + off) for off in (0, words[0])]
               for e in picks[i * per_launch : (i + 1) * per_launch]]
        out = [[dst.data_ptr() + 8 * (j * expert + off) for off in (0, words[0])] for j in range(per_launch)]
        plans.append(StagePlan(torch.tensor(src, dtype=torch.int64, device=device),  # [per_launch, 2]
                               torch.tensor(out, dtype=torch.int64, device=device)))

    nbytes = launches * per_launch * expert * 8
    aligned = words[0] % 2 == 0 and expert % 2 == 0  # every address a multiple of 16 bytes, as in the engine
    clock = copy_clock(device)
    idle = StagePlan(plans[0].src, torch.zeros_like(plans[0].dst))  # copies nothing: compiles both variants
    copy_misses_triton(idle, sizes, max(words), dst, aligned=aligned)
    copy_misses_triton(idle, sizes, max(words), dst, clock=clock, aligned=aligned)
    for plan in plans:  # the first pass, which also warms up the graph's launches
        copy_misses_triton(plan, sizes, max(words), dst, clock=clock, aligned=aligned)
    torch.cuda.synchronize(device)
    first = nbytes / (int(clock[2]) * 1e-9) / 1e9
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for plan in plans:
            copy_misses_triton(plan, sizes, max(words), dst, aligned=aligned)
    seconds = _median_seconds(graph.replay, device)
    del graph, dst
    unregister_all(registry)
    del pool
    torch.cuda.empty_cache()
    return nbytes / seconds / 1e9, first


class SkewedTrace:
    """Replaces the experts the routers pick with a skewed trace: at each MoE layer, Zipf popularity over a random
    ranking of the experts, and with probability ``locality`` a batch row keeps its previous step's experts there.

    The routers still run (their kernels are part of the step); a forward pre-hook on each block's experts swaps
    the router's top-k ids for the trace's and keeps its weights. The trace is drawn on the host beforehand
    ([steps, layers, rows, k], cycled, in pinned memory); before each forward pass (the offload manager's
    between-steps hook) one non-blocking copy puts the next step's ids in a device buffer that the pre-hooks hand
    out as views, so a graphed step reads them with no launch of its own. A batch of more rows than the trace has
    (a prefill) draws fresh ids on the device (no locality)."""

    def __init__(self, blocks: list, manager, num_experts: int, k: int, zipf: float, locality: float, rows: int,
                 device: torch.device, steps: int = 256, seed: int = 1000):
        self.k, self.rows, self.steps, self.pos = k, rows, steps, 0
        rng = np.random.default_rng(seed)
        ranked = 1.0 / np.arange(1, num_experts + 1, dtype=np.float64) ** zipf
        trace = np.empty((steps, len(blocks), rows, k), dtype=np.int32)  # [steps, layers, rows, k]
        self.log_probs, self.handles = [], []
        for i, block in enumerate(blocks):
            probs = np.empty(num_experts)
            probs[rng.permutation(num_experts)] = ranked / ranked.sum()
            for t in range(steps):
                # Gumbel top-k: k experts without replacement, each draw by the Zipf probabilities
                fresh = np.argsort(np.log(probs) - np.log(-np.log(rng.random((rows, num_experts)))), axis=1)[:, -k:]
                keep = (rng.random((rows, 1)) < locality) if t else np.zeros((rows, 1), dtype=bool)
                trace[t, i] = np.where(keep, trace[t - 1, i], fresh)
            self.log_probs.append(torch.from_numpy(np.log(probs)).float().to(device))
            self.handles.append(block.experts.register_forward_pre_hook(
                lambda module, args, i=i: self._swap(args, i)))
        self.trace = torch.from_numpy(trace).pin_memory() if device.type == "cuda" else torch.from_numpy(trace)
        self.current = self.trace[0].to(device)  # [layers, rows, k]; read by the warm-up passes of graph capture
        self.manager, self.hook = manager, getattr(manager, "between_steps", None)
        manager.between_steps = self._advance  # shadows the method on this instance

    def _advance(self, *args, **kwargs) -> None:
        """Before a forward pass: the next step's ids, copied in stream order after the previous step's reads."""
        self.current.copy_(self.trace[self.pos], non_blocking=True)
        self.pos = (self.pos + 1) % self.steps
        if self.hook is not None:
            self.hook(*args, **kwargs)

    def _swap(self, args: tuple, layer: int) -> tuple:
        x, weights, ids = args[:3]  # x [T, H], weights / ids [T, k]
        T = ids.shape[0]
        if T > self.rows:
            u = torch.rand(T, self.log_probs[layer].numel(), device=ids.device).clamp_(1e-12, 1.0 - 1e-7)
            new = torch.topk(self.log_probs[layer] - torch.log(-torch.log(u)), self.k, dim=-1).indices  # [T, k]
        else:
            new = self.current[layer, :T]  # [T, k]
        return (x, weights, new.to(ids.dtype), *args[3:])

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.manager.__dict__.pop("between_steps", None)


def set_routing(model: torch.nn.Module, routing: str, args: argparse.Namespace) -> None:
    mc = model.config
    old = model.__dict__.pop("_skewed_trace", None)
    if old is not None:
        old.remove()
    # the embeddings' scale for steady routing: the previous rows' undone (exactly: a power of two), this one's set
    scale = (args.steady_scale if routing == "steady" else 1.0) / model.__dict__.pop("_steady_scale", 1.0)
    if scale != 1.0:
        with torch.no_grad():
            model.model.embed_tokens.weight.mul_(scale)
    if routing == "steady":
        model.__dict__["_steady_scale"] = args.steady_scale
    if routing == "skewed":
        rows = max(int(b) for b in args.batch_sizes.split(","))
        model.__dict__["_skewed_trace"] = SkewedTrace(
            model.moe_blocks(), model.expert_offload, mc.num_experts, mc.num_experts_per_tok, args.zipf,
            args.locality, rows, next(model.parameters()).device)


def measure_decode(llm: LLM, B: int, args: argparse.Namespace) -> dict[str, Any]:
    """tok/s of whole engine steps at batch B plus the offloading statistics of the timed steps."""
    engine, rng = llm.engine, random.Random(B)
    manager = llm.model.expert_offload
    params = SamplingParams(max_tokens=args.steps + 12, temperature=0, ignore_eos=True, detokenize=False)
    seqs = [engine.add_request([rng.randrange(llm.model_config.vocab_size) for _ in range(args.prompt_len)], params)
            for _ in range(B)]
    while any(s.num_computed < len(s.prompt_ids) for s in seqs):
        engine.step()
    for _ in range(2):
        engine.step()
    dev = engine.device
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    manager.reset_stats()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    seconds = time.perf_counter() - t0
    stats = llm.stats()
    if args.profile and dev.type == "cuda":
        from moerun.bench.profile import format_profile, kernel_table

        print(format_profile(kernel_table(engine.step, top=12), f"batch-{B} engine step, GPU time per kernel"),
              flush=True)
    for s in seqs:
        if not s.is_finished:
            engine.abort(s)
    return {"tok_s": B * args.steps / seconds, "step_ms": 1e3 * seconds / args.steps, "stats": stats}


def run_rows(model, store, slots: int, kv_bytes: int | None, config: OffloadConfig, routing: str, tokenizer,
             args: argparse.Namespace, base: dict[str, Any], bandwidth: float) -> list[dict[str, Any]]:
    attach_offload(model, store, slots, torch.device(args.device), config, kv_bytes)
    set_routing(model, routing, args)
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    llm = LLM.from_model(model, tokenizer, max_model_len=args.max_model_len, max_num_seqs=max(batch_sizes),
                         max_num_batched_tokens=max(batch_sizes) * args.prompt_len,
                         async_scheduling=args.async_scheduling)
    rows = []
    for B in batch_sizes:
        if args.device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        r = measure_decode(llm, B, args)
        s = r.pop("stats")
        # the floor's bytes: every byte that crossed to the GPU for the experts, misses and prefetches useful or not
        floor_bytes = s["missed_bytes_per_token"] + s["bytes_copied_prefetch"] / max(s["tokens"], 1)
        copy_ms = s["copy_in_step_ms_per_token"] if s.get("copy_timed") else None
        # the staging copies' rate, where they move every miss (as many staging rows as the batch routes to)
        all_staged = copy_ms and (s.get("staging_rows") or 0) >= B * model.config.num_experts_per_tok
        copy_rate = s["bytes_read_host_per_token"] / copy_ms / 1e6 if all_staged else None
        rows.append({**base, "mode": s["mode"], "routing": routing, "policy": config.policy,
                     "prefetch": s["prefetch"], "cpu_compute": config.cpu_compute,
                     "slots_per_layer": slots, "batch": B, **r, "graphs": bool(llm.engine.runner.graphs),
                     "hit_rate": s["hit_rate"], "bytes_copied_per_token": s["bytes_copied_per_token"],
                     "floor_bytes_per_token": floor_bytes,
                     "copy_floor_tok_s": bandwidth / floor_bytes if floor_bytes and bandwidth else None,
                     "copy_stall_ms_per_token": s["copy_stall_ms_per_token"],
                     # zero-copy: the staging copies' device time inside the steps (GPU clock)
                     "copy_in_step_ms_per_token": copy_ms, "copy_in_step_GBps": copy_rate,
                     "prefetch_accuracy": s["prefetch_accuracy"] if s["prefetch_issued"] else None,
                     "admitted_bytes_per_token": s["bytes_admitted"] / max(s["tokens"], 1),
                     "admit_on_device": s.get("admit_on_device", False), "overlap": s.get("overlap"),
                     "admit_hold_passes": s.get("admit_hold_passes", 0),
                     "admissions_on_device_per_token": s.get("admissions_on_device", 0) / max(s["tokens"], 1),
                     "misses_cpu": s["misses_cpu"], "misses_copied": s["misses_copied"],
                     "cost_model": s.get("cost_model"), "staging_rows": s.get("staging_rows"),
                     "peak_gib": torch.cuda.max_memory_allocated() / GiB if args.device == "cuda" else None})
        print(_row_line(rows[-1]), flush=True)
    del llm
    _free(model)
    return rows


def _free(model) -> None:
    model.__dict__.pop("expert_offload", None)
    for b in model.moe_blocks():
        b.experts.__dict__["manager"] = None
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ---- transformers + accelerate ----
def hf_offload_rate(model, store, hf_config: dict, budget_gib: float, tokens: int, device: torch.device) -> dict:
    """tok/s of transformers' model at batch 1 under accelerate's offloading (device_map from max_memory)."""
    from accelerate import dispatch_model, infer_auto_device_map
    from torch import nn

    from moerun.bench.hf_baseline import hf_model_sharing_weights

    params = dict(model.named_parameters())
    for i, layer in enumerate(model.config.moe_layers):  # experts: views of the host store, not copies
        params[f"model.layers.{layer}.mlp.experts.w13"] = nn.Parameter(store.parts[i][0], requires_grad=False)
        params[f"model.layers.{layer}.mlp.experts.w2"] = nn.Parameter(store.parts[i][1], requires_grad=False)
    shim = nn.Module()
    shim.config = model.config
    shim.named_parameters = lambda: iter(params.items())
    shim.parameters = lambda: iter(params.values())
    hf = hf_model_sharing_weights(shim, hf_config)
    device_map = infer_auto_device_map(hf, max_memory={0: int(budget_gib * GiB), "cpu": 2**50},
                                       no_split_module_classes=hf._no_split_modules, dtype=torch.bfloat16)
    for name, where in device_map.items():
        if where != "cpu":
            (hf.get_submodule(name) if name else hf).to(device)
    hf = dispatch_model(hf, device_map=device_map, main_device=device.index or 0)
    on_gpu = sum(1 for w in device_map.values() if w != "cpu")
    with torch.inference_mode():
        ids = torch.randint(0, hf.config.vocab_size, (1, 8), device=device)
        out = hf(ids, use_cache=True)
        cache, nxt = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        for _ in range(tokens):
            out = hf(nxt, past_key_values=cache, use_cache=True)
            nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        torch.cuda.synchronize(device)
        seconds = time.perf_counter() - t0
    del hf, out, cache
    gc.collect()
    torch.cuda.empty_cache()
    return {"tok_s": tokens / seconds, "s_per_token": seconds / tokens, "modules_on_gpu": on_gpu}


# ---- report ----
def _fmt(v: Any, spec: str) -> str:
    return "-" if v is None else format(v, spec)


HEADER = (f"{'variant':<24} {'mode':<9} {'dev':>3} {'ov':>2} {'budget':>6} {'slots':>5} {'routing':<7} {'policy':<10} "
          f"{'pf':>2} {'cpu':<6} {'B':>2} {'tok/s':>8} {'hit%':>6} {'MiB/tok':>8} {'floor':>8} {'stall':>6} "
          f"{'copy':>6} {'GB/s':>5} {'pf acc':>6} {'peak':>6} {'x floor':>7}")


def _row_line(r: dict[str, Any]) -> str:
    floor, rate = r.get("copy_floor_tok_s"), r.get("tok_s")
    dev = f"y{r.get('admit_hold_passes') or ''}" if r.get('admit_on_device') else "n"  # y<passes held>
    mib = r["bytes_copied_per_token"] / 2**20 if r.get("bytes_copied_per_token") is not None else None
    return (f"{r['variant']:<24} {r.get('mode', '-'):<9} {dev:>3} "
            f"{('y' if r.get('overlap') else 'n'):>2} "
            f"{_fmt(r.get('budget_gib'), '6.1f')} "
            f"{r.get('slots_per_layer', 0):>5} "
            f"{r.get('routing', '-'):<7} {r.get('policy', '-'):<10} {('y' if r.get('prefetch') else 'n'):>2} "
            f"{r.get('cpu_compute', '-'):<6} {r['batch']:>2} {_fmt(r.get('tok_s'), '8.2f')} "
            f"{_fmt(100 * r['hit_rate'] if r.get('hit_rate') is not None else None, '6.1f')} "
            f"{_fmt(mib, '8.1f')} "
            f"{_fmt(r.get('copy_floor_tok_s'), '8.1f')} {_fmt(r.get('copy_stall_ms_per_token'), '6.2f')} "
            f"{_fmt(r.get('copy_in_step_ms_per_token'), '6.2f')} {_fmt(r.get('copy_in_step_GBps'), '5.1f')} "
            f"{_fmt(r.get('prefetch_accuracy'), '6.2f')} {_fmt(r.get('peak_gib'), '6.1f')} "
            f"{_fmt(floor / rate if floor and rate else None, '7.2f')}")


def plot(rows: list[dict[str, Any]], path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    main = [r for r in rows if r["variant"] == "bf16 LRU"]
    for mode in sorted({r["mode"] for r in main}):
        for routing in ROUTINGS:
            for B in sorted({r["batch"] for r in main}):
                pts = sorted((r["cache_gib"], r["tok_s"], r["hit_rate"]) for r in main
                             if r["mode"] == mode and r["routing"] == routing and r["batch"] == B)
                if not pts:
                    continue
                xs, label = [p[0] for p in pts], f"{mode}, {routing}, batch {B}"
                a.plot(xs, [p[1] for p in pts], marker="o", label=label)
                b.plot(xs, [100 * p[2] for p in pts], marker="o", label=label)
    a.set(xlabel="expert cache (GiB)", ylabel="decode tok/s", title="decode throughput")
    b.set(xlabel="expert cache (GiB)", ylabel="hit rate (%)", title="expert cache hit rate")
    for ax in (a, b):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path


# ---- main ----
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    t_start = time.perf_counter()
    hf_config = preset_config(args.preset, args.layers)
    hf_config["torch_dtype"] = "bfloat16"
    mc = ModelConfig.from_hf_dict(hf_config)
    hf_config["max_position_embeddings"] = mc.max_position_embeddings
    dtype = parse_dtype("bfloat16")
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    max_seqs, chunk = max(batch_sizes), max(batch_sizes) * args.prompt_len
    bw = measure_h2d(device)
    bw["stage_kernel_GBps"], bw["stage_kernel_first_pass_GBps"] = measure_stage_copy(device, mc)
    print(f"host->device: pinned {bw['pinned_GBps']:.1f} GB/s, pageable {bw['pageable_GBps']:.1f} GB/s, zero-copy "
          f"staging kernel {bw['stage_kernel_GBps']:.1f} GB/s (first pass over its experts "
          f"{bw['stage_kernel_first_pass_GBps']:.1f})", flush=True)
    pinned_bps = bw["pinned_GBps"] * 1e9

    from moerun.models.tiny import qwen3_tokenizer_dir
    from moerun.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_folder(qwen3_tokenizer_dir())
    fp = footprint_of_config(mc, dtype)
    free = int(available_bytes(device) * 0.9)
    rows: list[dict[str, Any]] = []
    build_s = 0.0
    if args.only_gguf:
        print(HEADER, flush=True)
    else:
        build_s = run_bf16(args, mc, hf_config, dtype, device, tokenizer, fp, pinned_bps, max_seqs, chunk, rows)
    if mc.hidden_size % 256 or mc.moe_intermediate_size % 256:
        print(f"skipping Q4_K_M: rows of {mc.hidden_size} / {mc.moe_intermediate_size} are not whole Q4_K blocks")
    elif not args.no_gguf:
        rows += run_gguf(mc, device, args, tokenizer, pinned_bps, fp, free, max_seqs, chunk)
    result = {"model": args.preset + (f" ({args.layers} layers)" if args.layers else ""),
              "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"), "h2d": bw, "build_seconds": build_s,
              "total_seconds": time.perf_counter() - t_start, "steps": args.steps, "prompt_len": args.prompt_len,
              "skew": {"zipf": args.zipf, "locality": args.locality}, "rows": rows}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_offload.json").write_text(json.dumps(result, indent=2, default=str))
    png = plot(rows, out / "bench_offload.png")
    print(f"\ntotal {result['total_seconds']:.0f} s; wrote {out / 'bench_offload.json'}" + (f", {png}" if png else ""))
    return 0


def run_bf16(args: argparse.Namespace, mc: ModelConfig, hf_config: dict, dtype: torch.dtype, device: torch.device,
             tokenizer, fp: Footprint, pinned_bps: float, max_seqs: int, chunk: int,
             rows: list[dict[str, Any]]) -> float:
    """The bf16 rows (every budget and mode, the variants, transformers + accelerate) appended to ``rows``;
    returns the seconds it took to build the random bf16 experts."""
    t0 = time.perf_counter()
    store = random_expert_store(mc, device)
    model = random_offloaded_model(mc, device, mc.num_experts_per_tok, store=store)
    _free(model)
    build_s = time.perf_counter() - t0
    print(f"built: non-expert {fp.non_expert_bytes / GiB:.2f} GiB on {device}, experts {store.total_bytes / GiB:.2f}"
          f" GiB in {'pinned ' if store.pinned else ''}host memory ({build_s:.1f} s)", flush=True)
    free = int(available_bytes(device) * 0.9)

    def placement(budget_gib: float, footprint: Footprint, cfg: OffloadConfig):
        return plan_placement(footprint, mc, dtype, args.max_model_len, max_seqs, chunk, free, budget_gib,
                              None, replace(cfg, force=True))

    print(HEADER, flush=True)
    budgets = _floats(args.budgets)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    admit = int(args.admit_mb * 2**20) if args.admit_mb is not None else None
    lru = OffloadConfig(policy="lru", admit_bytes_per_step=admit)  # prefetch: the mode's default
    for budget in budgets:
        for mode in modes:
            zero_copy = mode == "zero_copy"
            options = [args.stage_experts, args.admit_on_device, args.overlap, args.admit_hold]
            for stage, on_device, overlap, hold in itertools.product(*(options if zero_copy else [[None]] * 4)):
                cfg = replace(lru, mode=mode, admit_on_device=on_device, overlap=overlap, admit_hold_passes=hold,
                              stage_experts=stage)
                # the staging rows (as LLM decides them for max_seqs when not given) come out of the budget
                cfg = replace(cfg, stage_experts=cfg.stage_rows(mc.num_experts_per_tok, max_seqs))
                pl = placement(budget, fp, cfg)
                base = {"variant": "bf16 LRU" if stage is None else f"bf16 LRU, {stage} rows", "budget_gib": budget,
                        "cache_gib": pl.cache_bytes / GiB}
                for routing in args.routings:  # the skewed trace is not router-predictable: no prefetch
                    rows += run_rows(model, store, pl.slots_per_layer, pl.kv_bytes,
                                     replace(cfg, prefetch=False) if routing == "skewed" else cfg, routing, tokenizer,
                                     args, base, pinned_bps)
    if not (args.quick or args.no_variants):
        mid = budgets[len(budgets) // 2]
        pl = placement(mid, fp, lru)
        variants = [("bf16 no prefetch", replace(lru, prefetch=False), "random"),
                    ("bf16 LFU", replace(lru, policy="lfu", prefetch=False), "skewed"),
                    ("bf16 activation-aware", replace(lru, policy="activation", prefetch=False), "skewed")]
        for name, cfg, routing in variants:
            for mode in modes:
                if name == "bf16 no prefetch" and mode == "zero_copy":
                    continue  # zero-copy never prefetches: the same as its LRU row
                base = {"variant": name, "budget_gib": mid, "cache_gib": pl.cache_bytes / GiB}
                rows += run_rows(model, store, pl.slots_per_layer, pl.kv_bytes, replace(cfg, mode=mode), routing,
                                 tokenizer, args, base, pinned_bps)
        low = budgets[0]
        pl = placement(low, fp, lru)
        cpu_args = argparse.Namespace(**{**vars(args), "batch_sizes": "1"})
        rows += run_rows(model, store, pl.slots_per_layer, pl.kv_bytes,
                         replace(lru, cpu_compute="auto", mode="copy"), "random", tokenizer, cpu_args,
                         {"variant": "bf16 CPU-compute auto", "budget_gib": low, "cache_gib": pl.cache_bytes / GiB},
                         pinned_bps)
    if args.vs == "transformers":
        hf_budgets = _floats(args.hf_budgets) if args.hf_budgets else budgets
        set_routing(model, "random", args)
        for budget in hf_budgets:
            try:
                r = hf_offload_rate(model, store, hf_config, budget, args.hf_tokens, device)
            except Exception as exc:  # an accelerate / transformers version this script does not handle
                r = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
            rows.append({"variant": "transformers+accelerate", "budget_gib": budget, "batch": 1, "routing": "random",
                         **r})
            print(_row_line(rows[-1]) if "tok_s" in r else f"transformers at {budget} GiB: {r['error']}", flush=True)
    del model, store
    gc.collect()
    return build_s


def run_gguf(mc: ModelConfig, device: torch.device, args: argparse.Namespace, tokenizer, pinned_bps: float,
             fp: Footprint, free: int, max_seqs: int, chunk: int) -> list[dict[str, Any]]:
    """Q4_K_M-shaped experts at llama.cpp's --n-cpu-moe 24 / 48 device memory, in each of --gguf-modes."""
    specs = expert_specs(mc, "Q4_K_M")
    # the slots hold repacked experts (a few percent above their GGUF blocks); llama.cpp's memory counts the blocks
    qfp = Footprint(fp.non_expert_bytes, tuple(sum(packed_part_bytes(s) for s in layer) for layer in specs),
                    mc.num_experts, mc.num_experts_per_tok)
    gguf_layer_bytes = [sum(s.nbytes for s in layer) for layer in specs]
    admit = int(args.admit_mb * 2**20) if args.admit_mb is not None else None
    dtype = mc.dtype
    kv = 2 * mc.num_layers * mc.num_kv_heads * mc.head_dim * 2 * args.max_model_len * max_seqs
    ws = workspace_bytes(mc, dtype, chunk, max_seqs)
    store = random_expert_store(mc, device, quant="Q4_K_M")
    model = random_offloaded_model(mc, device, mc.num_experts_per_tok, store=store)
    _free(model)
    rows = []
    n_moe = len(mc.moe_layers)
    for n_cpu in (n_moe // 2, n_moe):
        gpu_layers = n_moe - n_cpu
        # + the rows a zero-copy layer stages its missed experts in (2 x top-k experts for batches, about 50 MB)
        rows_staged = OffloadConfig().stage_rows(mc.num_experts_per_tok, max_seqs)  # as LLM decides them
        stage = rows_staged * max(qfp.expert_bytes)
        budget = (fp.non_expert_bytes + kv + ws + stage + sum(gguf_layer_bytes[:gpu_layers]) * mc.num_experts) / GiB
        for mode in [m.strip() for m in args.gguf_modes.split(",") if m.strip()]:
            zero_copy = mode == "zero_copy" and n_cpu < n_moe
            for on_device, hold in itertools.product(*([args.admit_on_device, args.admit_hold] if zero_copy
                                                       else [[None], [None]])):
                cfg = OffloadConfig(policy="lru", mode=mode, admit_bytes_per_step=admit,
                                    admit_on_device=on_device, admit_hold_passes=hold, stage_experts=rows_staged)
                slots, kv_bytes, base = gguf_placement(qfp, mc, args, max_seqs, chunk, free, budget, kv, cfg, n_cpu)
                rows += run_rows(model, store, slots, kv_bytes, cfg, "random", tokenizer, args, base, pinned_bps)
        if n_cpu == n_moe // 2 and not (args.quick or args.no_variants):
            cfg = OffloadConfig(policy="lru", prefetch=True, mode="copy", cpu_compute="auto")
            slots, kv_bytes, base = gguf_placement(qfp, mc, args, max_seqs, chunk, free, budget, kv, cfg, n_cpu)
            one = argparse.Namespace(**{**vars(args), "batch_sizes": "1"})
            rows += run_rows(model, store, slots, kv_bytes, cfg, "random", tokenizer, one,
                             {**base, "variant": f"Q4_K_M n-cpu-moe {n_cpu} CPU auto"}, pinned_bps)
    del model, store
    gc.collect()
    return rows


def gguf_placement(qfp: Footprint, mc: ModelConfig, args: argparse.Namespace, max_seqs: int, chunk: int, free: int,
                   budget: float, kv: int, cfg: OffloadConfig, n_cpu: int) -> tuple[int, int, dict[str, Any]]:
    """(slots per layer, KV bytes, row labels) of the Q4_K_M experts within ``budget`` GiB in cfg's mode; zero-copy
    may run with fewer than top-k slots a layer (even none), since it reads misses in place."""
    try:
        pl = plan_placement(qfp, mc, mc.dtype, args.max_model_len, max_seqs, chunk, free, budget, None,
                            replace(cfg, force=True))
        slots, kv_bytes, note = pl.slots_per_layer, pl.kv_bytes, ""
    except ValueError:  # no room for even top-k slots per layer: run the smallest cache, over the budget
        slots, kv_bytes = mc.num_experts_per_tok, kv
        note = f" (+{qfp.pool_bytes(slots) / GiB:.2f} GiB cache)"
    base = {"variant": f"Q4_K_M n-cpu-moe {n_cpu}{note}", "budget_gib": budget,
            "cache_gib": qfp.pool_bytes(slots) / GiB}
    return slots, kv_bytes, base


if __name__ == "__main__":
    sys.exit(main())
