"""Where a batch-1 decode step and a single-prompt prefill spend their time: GPU time per kernel (and, for decode,
graph replay against the whole engine step)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from moerun.api import LLM
from moerun.engine.batch import ForwardBatch


def replay_ms(graph: torch.cuda.CUDAGraph, repeat: int = 100) -> float:
    """Mean milliseconds of back-to-back replays of a captured graph (CUDA events, after 5 warm-up replays)."""
    for _ in range(5):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeat):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeat


@torch.inference_mode()
def profile_decode(llm: LLM, context_len: int = 128, top: int = 15) -> dict:
    """Graph replay time of the batch-1 bucket, and the kernels of one eager decode step ranked by GPU time."""
    engine = llm.engine
    if engine.device.type != "cuda":
        return {}
    out: dict = {}
    graph = engine.runner.graphs.get(1)
    if graph is not None:
        out["graph_replay_ms"] = replay_ms(graph, 50)
    slot = engine.cache.allocate()
    try:
        batch = ForwardBatch.build([context_len - 1], [1], [slot], engine.device)
        ids = torch.tensor([7], device=engine.device)

        def step() -> None:
            llm.model.compute_logits(llm.model(ids, batch, engine.cache))

        out.update(kernel_table(step, top))
    finally:
        engine.cache.release(slot)
    return out


@torch.inference_mode()
def profile_prefill(llm: LLM, length: int, top: int = 15) -> dict:
    """The kernels of one eager single-prompt prefill of ``length`` tokens ranked by GPU time."""
    engine = llm.engine
    if engine.device.type != "cuda" or length >= llm.engine_config.max_model_len:
        return {}
    slot = engine.cache.allocate()
    try:
        batch = ForwardBatch.build([0], [length], [slot], engine.device)
        ids = torch.randint(0, llm.model_config.vocab_size, (length,), device=engine.device)
        rows = batch.last_rows

        def step() -> None:
            llm.model.compute_logits(llm.model(ids, batch, engine.cache)[rows])

        return {"tokens": length, **kernel_table(step, top)}
    finally:
        engine.cache.release(slot)


def kernel_table(step: Callable[[], object], top: int, repeats: int = 3) -> dict:
    """GPU time per kernel of ``step`` (after warm-up), averaged over ``repeats`` calls, ranked."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(repeats):
            step()
        torch.cuda.synchronize()
    kernels: dict[str, list[float]] = {}
    first, last = float("inf"), 0.0  # us: the first GPU op's start, the last one's end
    for evt in prof.events():
        if evt.device_type == torch.autograd.DeviceType.CUDA:
            entry = kernels.setdefault(evt.name, [0.0, 0])
            entry[0] += evt.device_time / 1e3 / repeats  # ms per step
            entry[1] += 1 / repeats
            first, last = min(first, evt.time_range.start), max(last, evt.time_range.end)
    total = sum(v[0] for v in kernels.values())
    ranked = sorted(kernels.items(), key=lambda kv: -kv[1][0])
    span = (last - first) / 1e3 / repeats if kernels else 0.0
    return {"gpu_kernel_ms_per_step": total, "gpu_span_ms_per_step": span,
            "kernels_per_step": int(round(sum(v[1] for v in kernels.values()))),
            "top_kernels": [{"name": n[:90], "ms": v[0], "calls": round(v[1]), "share": v[0] / total}
                            for n, v in ranked[:top]]}


def format_profile(p: dict, title: str = "batch-1 decode profile") -> str:
    if not p:
        return ""
    lines = ["", title]
    if "graph_replay_ms" in p:
        lines.append(f"  graph replay (model + logits)       {p['graph_replay_ms']:.3f} ms")
    what = "forward" if "tokens" in p else "step"
    lines.append(f"  eager {what}: {p['kernels_per_step']} kernels, {p['gpu_kernel_ms_per_step']:.3f} ms of GPU time"
                 + (f" in a span of {p['gpu_span_ms_per_step']:.3f} ms" if p.get("gpu_span_ms_per_step") else ""))
    for k in p["top_kernels"]:
        lines.append(f"  {100 * k['share']:5.1f}%  {k['ms']:.3f} ms  x{k['calls']:<4} {k['name']}")
    return "\n".join(lines)
