"""Host time of expert offloading's host work, what the GPU waits for when nearly every routed expert is cached:
a copy-mode MoE layer's host part (``ExpertOffload._finish``, once per layer) and zero-copy's work between two
steps (``ZeroCopyOffload.between_steps``: routing counts, statistics, admission plan, table writes, copies). Runs
on the CPU (numpy and Python; the experts are tiny dense ones); no GPU needed. The tiny experts' compute, which a
GPU would run after the host has moved on, is timed apart and printed beside the host part.

    python benchmarks/bench_offload_host.py [--layers 48] [--experts 128] [--top-k 8] [--slots 63]

Routing: a fixed set of k experts per layer, one of which changes with probability --churn per layer and step,
so most layers hit and a few miss, as in steady batch-1 decode.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from moerun.moe.offload import OffloadConfig
from moerun.moe.offload.manager import ExpertOffload
from moerun.moe.offload.store import HostExpertStore, PartSpec
from moerun.moe.offload.zero_copy import ZeroCopyOffload


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=48)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--slots", type=int, default=63)
    p.add_argument("--churn", type=float, default=0.02)
    p.add_argument("--steps", type=int, default=50)
    return p.parse_args(argv)


def tiny_store(args: argparse.Namespace) -> HostExpertStore:
    """Dense experts of args.layers x args.experts, tiny (the host work does not depend on their size)."""
    torch.manual_seed(0)
    L, E, H, I = args.layers, args.experts, 64, 32  # noqa: E741
    specs = [[PartSpec("w13", (2 * I, H), torch.float32), PartSpec("w2", (H, I), torch.float32)] for _ in range(L)]
    return HostExpertStore([[torch.randn(E, 2 * I, H), torch.randn(E, H, I)] for _ in range(L)], specs)


def churn(sets: list[np.ndarray], rng: np.random.Generator, args: argparse.Namespace) -> None:
    """With probability args.churn per layer, one of the layer's routed experts changes."""
    for layer, chosen in enumerate(sets):
        if rng.random() < args.churn:
            chosen[rng.integers(len(chosen))] = rng.choice(np.setdiff1d(np.arange(args.experts), chosen))


def time_between_steps(args: argparse.Namespace) -> tuple[float, float]:
    """(median microseconds per step of zero-copy's host work between steps, hit rate) over ``args.steps`` steps
    after 20 of warm-up; each step's routing is recorded as the graphed step records it (counts and steps [L, E])."""
    manager = ZeroCopyOffload(tiny_store(args), args.slots, torch.device("cpu"), args.top_k,
                              OffloadConfig(mode="zero_copy"), backend="torch")
    rng = np.random.default_rng(0)
    sets = [rng.choice(args.experts, args.top_k, replace=False) for _ in range(args.layers)]
    times = []
    for step in range(20 + args.steps):
        churn(sets, rng, args)
        routing = torch.from_numpy(np.stack([np.bincount(s, minlength=args.experts) for s in sets]))  # [L, E]
        manager.counts += routing
        manager.steps += routing > 0  # one forward pass used these experts
        t0 = time.perf_counter()
        manager.between_steps(1)
        if step >= 20:
            times.append(time.perf_counter() - t0)
    return 1e6 * float(np.median(times)), manager.stats.hits / max(manager.stats.lookups, 1)


def time_finish(args: argparse.Namespace, prefetch: bool) -> tuple[float, float, float]:
    """(microseconds per layer of the host part, of which the experts' compute, hit rate) over ``args.steps`` decode
    steps after 20 of warm-up. On the CPU the fused MoE passes (``ExpertOffload._run``) and CPU-computed misses
    (``_cpu``) compute the tiny experts where the host part runs; on a GPU a pass is a kernel launch that the host
    does not wait for. Their time is timed apart, so the host's own work is the difference."""
    L, E, k, H = args.layers, args.experts, args.top_k, 64
    store = tiny_store(args)
    gates = [torch.randn(E, H) for _ in range(L)]
    manager = ExpertOffload(store, args.slots, torch.device("cpu"), torch.float32, k, gates,
                            OffloadConfig(prefetch=prefetch, overlap=True), backend="torch")
    rng = np.random.default_rng(0)
    sets = [rng.choice(E, k, replace=False) for _ in range(L)]
    x, w = torch.randn(1, H), torch.full((1, k), 1.0 / k)
    inside = 0.0  # seconds of the experts' compute within the current _finish call (_begin computes too)

    def timed(method):
        def run(*a, **kw):
            nonlocal inside
            t0 = time.perf_counter()
            out = method(*a, **kw)
            inside += time.perf_counter() - t0
            return out
        return run

    manager._run, manager._cpu = timed(manager._run), timed(manager._cpu)  # shadow the methods on this instance
    total, spent, calls = 0.0, 0.0, 0
    for step in range(20 + args.steps):
        churn(sets, rng, args)
        for layer in range(L):
            start = manager._begin(layer, x, w, torch.tensor(sets[layer], dtype=torch.int32)[None])
            inside = 0.0
            t0 = time.perf_counter()
            manager._finish(start, 1, graphed=True)
            if step >= 20:
                total += time.perf_counter() - t0
                spent += inside
                calls += 1
    return 1e6 * total / calls, 1e6 * spent / calls, manager.stats.hits / max(manager.stats.lookups, 1)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    print(f"{args.layers} layers, {args.experts} experts, top-{args.top_k}, {args.slots} slots a layer, batch 1")
    for prefetch in (False, True):
        us, experts_us, hit = time_finish(args, prefetch)
        own = us - experts_us
        print(f"prefetch {'on ' if prefetch else 'off'}: host part {us:6.1f} us per layer, of which the tiny experts' "
              f"compute {experts_us:5.1f} (a launch on a GPU); without it {own:6.1f} us per layer, "
              f"{own * args.layers / 1e3:5.2f} ms per token (hit rate {hit:.3f})")
    us, hit = time_between_steps(args)
    print(f"zero-copy: between steps {us:7.1f} us per token, median (hit rate {hit:.3f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
