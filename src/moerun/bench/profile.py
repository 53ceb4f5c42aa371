"""Where a batch-1 decode step spends its time: graph replay vs whole engine step, and GPU time per kernel."""

from __future__ import annotations

import torch

from moerun.api import LLM
from moerun.engine.batch import ForwardBatch


@torch.inference_mode()
def profile_decode(llm: LLM, context_len: int = 128, top: int = 15) -> dict:
    """Graph replay time of the batch-1 bucket, and the kernels of one eager decode step ranked by GPU time."""
    engine = llm.engine
    if engine.device.type != "cuda":
        return {}
    out: dict = {}
    graph = engine.runner.graphs.get(1)
    if graph is not None:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for _ in range(5):
            graph.replay()
        start.record()
        for _ in range(50):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        out["graph_replay_ms"] = start.elapsed_time(end) / 50
    slot = engine.cache.allocate()
    try:
        batch = ForwardBatch.build([context_len - 1], [1], [slot], engine.device)
        ids = torch.tensor([7], device=engine.device)

        def step() -> None:
            llm.model.compute_logits(llm.model(ids, batch, engine.cache))

        for _ in range(3):
            step()
        torch.cuda.synchronize()
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                step()
            torch.cuda.synchronize()
    finally:
        engine.cache.release(slot)
    kernels: dict[str, list[float]] = {}
    for evt in prof.events():
        if evt.device_type == torch.autograd.DeviceType.CUDA:
            entry = kernels.setdefault(evt.name, [0.0, 0])
            entry[0] += evt.device_time / 1e3 / 3  # ms per step
            entry[1] += 1 / 3
    total = sum(v[0] for v in kernels.values())
    ranked = sorted(kernels.items(), key=lambda kv: -kv[1][0])
    out["gpu_kernel_ms_per_step"] = total
    out["kernels_per_step"] = int(round(sum(v[1] for v in kernels.values())))
    out["top_kernels"] = [{"name": n[:90], "ms": v[0], "calls": round(v[1]), "share": v[0] / total}
                          for n, v in ranked[:top]]
    return out


def format_profile(p: dict) -> str:
    if not p:
        return ""
    lines = ["", "batch-1 decode profile"]
    if "graph_replay_ms" in p:
        lines.append(f"  graph replay (model + logits)       {p['graph_replay_ms']:.3f} ms")
    lines.append(f"  eager step: {p['kernels_per_step']} kernels, {p['gpu_kernel_ms_per_step']:.3f} ms of GPU time")
    for k in p["top_kernels"]:
        lines.append(f"  {100 * k['share']:5.1f}%  {k['ms']:.3f} ms  x{k['calls']:<4} {k['name']}")
    return "\n".join(lines)
