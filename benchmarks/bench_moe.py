"""Benchmark one MoE layer's experts (and the router) across token counts at the Qwen3-MoE shapes.

Implementations: moerun's Triton kernels, the torch reference, a torch._grouped_mm path and transformers'
"grouped_mm"/"batched_mm" experts functions when importable. Times are medians over many runs; capturable
implementations are replayed from CUDA graphs (several calls per graph, inputs rotating over weight copies and
routing sets so L2 does not hold the weights between calls), the others are timed eagerly. Bandwidth counts the
bytes of the experts actually touched plus the activations; ceilings are measured in the same run.

    python benchmarks/bench_moe.py --out bench_out
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

from tune_moe import DTYPES, MODEL_SHAPES  # noqa: E402

from moerun.bench.profile import kernel_table  # noqa: E402
from moerun.kernels.fused_moe import fused_moe_triton  # noqa: E402
from moerun.kernels.router import route_triton  # noqa: E402
from moerun.kernels.interpreter import interpreting  # noqa: E402
from moerun.kernels.tile_configs import device_name, get_config  # noqa: E402
from moerun.ops.moe_reference import fused_moe_reference, route_reference  # noqa: E402

DEFAULT_MS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096)
# Without CUDA the script can still be smoke-tested end to end in Triton's interpreter (TRITON_INTERPRET=1).
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
Impl = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


# ------------------------------------------------------------------------------------------------ ceilings


def time_events(fn: Callable[[], Any], runs: int) -> float:
    """Median seconds of fn over runs, each bracketed by CUDA events."""
    times = []
    for _ in range(runs):
        if DEVICE != "cuda":
            start_s = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start_s)
            continue
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def measure_ceilings(budget_s: float, max_runs: int, n: int = 1 << 30, mm: int = 8192) -> dict[str, float]:
    """HBM read and copy bandwidth (GB/s) over n bf16 elements and the bf16 matmul rate (TFLOP/s) at mm^3.

    The matmul rate is timed twice: as a burst of 10 calls after a pause, and the way the kernels are timed
    (CUDA-graph replays over ``budget_s``), which is the rate the % column compares against. On an H200 a GEMM's
    rate drops within a fraction of a second of back-to-back work (the 8192^3 matmul from 799 to 664 TFLOP/s over
    2 s), as the MoE kernels' does, so a burst ceiling against a sustained kernel time would mix two regimes."""
    src = torch.ones(n, device=DEVICE, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    nbytes = src.numel() * src.element_size()
    dst.copy_(src)
    copy_s = time_events(lambda: dst.copy_(src), 10)
    src.sum()
    read_s = time_events(lambda: src.sum(), 10)
    a = torch.randn(mm, mm, device=DEVICE, dtype=torch.bfloat16)
    b = torch.randn(mm, mm, device=DEVICE, dtype=torch.bfloat16)
    a @ b
    synchronize()
    time.sleep(0.5)
    burst_s = time_events(lambda: a @ b, 10)
    mm_s, _ = timed_median([lambda: a @ b], budget_s, max_runs)
    empty_cache()
    return {
        "copy_rw_GBps": 2 * nbytes / copy_s / 1e9,  # bytes read + bytes written
        "read_GBps": nbytes / read_s / 1e9,  # a full-tensor reduction: reads only
        "matmul_bf16_TFLOPs": 2 * mm**3 / mm_s / 1e12,  # timed as the kernels are
        "matmul_bf16_burst_TFLOPs": 2 * mm**3 / burst_s / 1e12,  # 10 calls after a pause
    }


def synchronize() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def empty_cache() -> None:
    if DEVICE == "cuda":
        torch.cuda.empty_cache()


# ------------------------------------------------------------------------------------------- implementations


def grouped_mm_moe(hidden, w13, w2, topk_weights, topk_ids) -> torch.Tensor:
    """Sort the token-slots by expert and run both expert GEMMs as torch._grouped_mm calls."""
    T, k = topk_ids.shape
    E, two_i, _ = w13.shape
    inter = two_i // 2
    flat = topk_ids.reshape(-1).long()  # [T*k]
    sorted_e, perm = torch.sort(flat)
    counts = torch.zeros(E, dtype=torch.int32, device=hidden.device).scatter_add_(
        0, sorted_e, torch.ones_like(sorted_e, dtype=torch.int32)
    )
    offs = torch.cumsum(counts, 0, dtype=torch.int32)  # [E] end row of each expert
    x = hidden[perm // k]  # [T*k, H]
    gate_up = torch._grouped_mm(x, w13.transpose(1, 2), offs=offs)  # [T*k, 2I]
    act = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]  # [T*k, I]
    y = torch._grouped_mm(act, w2.transpose(1, 2), offs=offs)  # [T*k, H]
    y = y.float() * topk_weights.reshape(-1)[perm].unsqueeze(1)
    out = torch.zeros(T, hidden.shape[1], dtype=torch.float32, device=hidden.device)
    out.index_add_(0, perm // k, y)
    return out.to(hidden.dtype)


def transformers_experts(name: str) -> Impl | None:
    """transformers' experts function `name` wrapped to our signature, or None when unavailable."""
    try:
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
    except Exception:  # noqa: BLE001 - optional dependency, any import problem means "skip"
        return None
    if name not in ALL_EXPERTS_FUNCTIONS:
        return None
    forward = ALL_EXPERTS_FUNCTIONS[name]

    def run(hidden, w13, w2, topk_weights, topk_ids):
        inter = w2.shape[2]
        module = types.SimpleNamespace(
            gate_up_proj=w13, down_proj=w2, num_experts=w13.shape[0], has_gate=True, has_bias=False,
            is_transposed=False, _is_expert_parallel=False, has_post_expert_norm=False, act_fn=F.silu,
            _apply_gate=lambda gu: F.silu(gu[..., :inter]) * gu[..., inter:],
        )  # fmt: skip
        return forward(module, hidden, topk_ids.long(), topk_weights.to(hidden.dtype))

    return run


def implementations(selected: list[str]) -> dict[str, Impl]:
    """The requested implementations that exist in this environment."""
    impls: dict[str, Impl | None] = {
        "triton": fused_moe_triton,
        "torch_ref": fused_moe_reference,
        "grouped_mm": grouped_mm_moe if hasattr(torch, "_grouped_mm") else None,
        "hf_grouped_mm": transformers_experts("grouped_mm"),
        "hf_batched_mm": transformers_experts("batched_mm"),
    }
    return {name: fn for name, fn in impls.items() if name in selected and fn is not None}


# -------------------------------------------------------------------------------------------------- timing


def timed_median(
    calls: list[Callable[[], Any]], budget_s: float, max_runs: int, capture: bool = True
) -> tuple[float, str]:
    """Median seconds per call: CUDA-graph replays of all calls when capturable, else eager per-call events."""
    graphed = capture and DEVICE == "cuda"
    for call in calls if graphed else calls[:1]:  # a capture needs every call run once, eager timing one call
        call()
    synchronize()
    if graphed:
        try:
            return _graph_median(calls, budget_s, max_runs), "graph"
        except Exception as exc:  # noqa: BLE001 - fall back to eager timing
            print(f"  (capture failed: {type(exc).__name__}: {str(exc)[:120]}; timing eagerly)", file=sys.stderr)
            synchronize()
    one = time_events(calls[0], 1)
    runs = int(min(max_runs, max(3, budget_s / max(one, 1e-6))))
    times = [time_events(calls[i % len(calls)], 1) for i in range(runs)]
    return statistics.median(times), "eager"


def _graph_median(calls: list[Callable[[], Any]], budget_s: float, max_runs: int) -> float:
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    torch.cuda.synchronize()
    replay_s = time_events(graph.replay, 1)
    runs = int(min(max_runs, max(5, budget_s / max(replay_s, 1e-6))))
    return time_events(graph.replay, runs) / len(calls)


def bench_shape(name: str, shape: dict[str, int], dtype: torch.dtype, ms: list[int], impls: dict[str, Impl], args):
    """Rows of results for one model shape."""
    E, H, I, k = shape["E"], shape["H"], shape["I"], shape["k"]  # noqa: E741
    esize = torch.tensor([], dtype=dtype).element_size()
    expert_bytes = 3 * H * I * esize
    layer_bytes = E * expert_bytes
    # Enough weight copies that consecutive calls never find their experts in L2 (60 MB on an H200).
    copies = max(2, min(args.max_copies, math.ceil(4 * 60e6 / layer_bytes)))
    weights = [
        (torch.randn(E, 2 * I, H, device=DEVICE, dtype=dtype) / H**0.5,
         torch.randn(E, H, I, device=DEVICE, dtype=dtype) / I**0.5)
        for _ in range(copies)
    ]  # fmt: skip
    rows = []
    for m in ms:
        n_sets = args.routing_sets
        sets = []
        for i in range(n_sets):
            logits = torch.randn(m, E, device=DEVICE)
            topk_w, topk_ids = route_reference(logits, k, True)
            sets.append((torch.randn(m, H, device=DEVICE, dtype=dtype), logits, topk_w, topk_ids, weights[i % copies]))
        touched = statistics.mean(len(torch.unique(s[3])) for s in sets)
        nbytes = touched * expert_bytes + 2 * m * H * esize
        flops = 6 * H * I * m * k
        cfg = get_config(E, H, I, k, dtype, m)
        row: dict[str, Any] = {"shape": name, "M": m, "experts_touched": touched, "bytes": nbytes, "flops": flops,
                               "triton_path": cfg["path"], "triton_config": cfg}  # fmt: skip

        # Correctness of the Triton path on one set, against the reference.
        x, _, tw, ti, (w13, w2) = sets[0]
        if "triton" in impls:
            ref = fused_moe_reference(x, w13, w2, tw, ti).float()
            err = (fused_moe_triton(x, w13, w2, tw, ti).float() - ref).abs().max().item()
            row["triton_max_rel_err"] = err / max(ref.abs().max().item(), 1e-6)

        per_graph = 8 if m <= 256 else 4
        for impl_name, fn in impls.items():
            calls = [
                (lambda s=s, fn=fn: fn(s[0], s[4][0], s[4][1], s[2], s[3])) for s in (sets * per_graph)[:per_graph]
            ]
            if impl_name == "hf_batched_mm" and m * k * expert_bytes > args.batched_mm_max_bytes:
                row[impl_name] = {"error": "skipped: gathers one weight copy per token-slot"}
                continue
            # The reference reads counts back to the host, so it cannot be captured.
            capture = impl_name != "torch_ref"
            budget = args.budget_s if capture else args.budget_s / 2
            try:
                sec, mode = timed_median(calls, budget, args.max_runs, capture)
            except Exception as exc:  # noqa: BLE001 - an unsupported implementation/shape is reported, not fatal
                row[impl_name] = {"error": f"{type(exc).__name__}: {str(exc)[:160]}"}
                continue
            row[impl_name] = {
                "us": sec * 1e6,
                "mode": mode,
                "GBps": nbytes / sec / 1e9,
                "TFLOPs": flops / sec / 1e12,
            }
        if "triton" in impls:
            route_calls = [(lambda s=s: route_triton(s[1], k, True)) for s in sets]
            sec, _ = timed_median(route_calls, 0.05, 200)
            row["route_triton_us"] = sec * 1e6
        rows.append(row)
        print(format_row(row, list(impls), args.ceilings), flush=True)
        if args.kernels and "triton" in impls and DEVICE == "cuda":
            row["triton_kernels"] = kernel_split(lambda: fused_moe_triton(x, w13, w2, tw, ti))
            split = ", ".join(f"{n} {t:.1f}" for n, t in row["triton_kernels"].items())
            print(f"    kernels (us): {split}", flush=True)
        del sets
    del weights
    empty_cache()
    return rows


def kernel_split(call: Callable[[], object]) -> dict[str, float]:
    """GPU microseconds per kernel of one Triton MoE call (alignment, GEMM 1, GEMM 2, slot sum...), from the
    profiler over repeated eager calls on one input: where the layer's time goes, not a replacement for the
    graph-replayed, input-rotated total above (small M then finds its experts in L2)."""
    table = kernel_table(call, top=12, repeats=10)
    return {k["name"].removeprefix("_").removesuffix("_kernel")[:40]: 1e3 * k["ms"] for k in table["top_kernels"]}


# ------------------------------------------------------------------------------------------------- output


def header(impl_names: list[str]) -> str:
    cols = ["shape", "M", "experts", "path"] + [f"{n} us" for n in impl_names]
    cols += ["triton %HBM-read", "triton %bf16-mm", "vs grouped_mm", "route us"]
    return "| " + " | ".join(cols) + " |\n|" + "---|" * len(cols)


def format_row(row: dict[str, Any], impl_names: list[str], ceilings: dict[str, float]) -> str:
    def us(name: str) -> str:
        r = row.get(name, {})
        if "us" not in r:
            return "skip" if str(r.get("error", "")).startswith("skipped") else ("n/a" if not r else "err")
        return f"{r['us']:.1f}" + ("" if r["mode"] == "graph" else "*")

    cells = [row["shape"], str(row["M"]), f"{row['experts_touched']:.0f}", row["triton_path"]]
    cells += [us(n) for n in impl_names]
    tri = row.get("triton", {})
    if "us" in tri:
        cells.append(f"{100 * tri['GBps'] / ceilings['read_GBps']:.0f}%")
        cells.append(f"{100 * tri['TFLOPs'] / ceilings['matmul_bf16_TFLOPs']:.0f}%")
        gm = row.get("grouped_mm", {})
        cells.append(f"{gm['us'] / tri['us']:.2f}x" if "us" in gm else "n/a")
    else:
        cells += ["n/a"] * 3
    cells.append(f"{row['route_triton_us']:.1f}" if "route_triton_us" in row else "n/a")
    return "| " + " | ".join(cells) + " |"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", action="append", choices=sorted(MODEL_SHAPES), help="default: both presets")
    p.add_argument("--E", type=int, help="custom shape instead of the presets (with --H, --I, --k)")
    p.add_argument("--H", type=int)
    p.add_argument("--I", type=int)
    p.add_argument("--k", type=int, default=8)
    p.add_argument("--m", type=int, nargs="+", default=list(DEFAULT_MS))
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    p.add_argument("--impl", action="append", help="triton, torch_ref, grouped_mm, hf_grouped_mm, hf_batched_mm")
    p.add_argument("--out", default="bench_out", help="directory for bench_moe.json and bench_moe.md")
    p.add_argument("--routing-sets", type=int, default=8, help="distinct routing/hidden inputs rotated per M")
    p.add_argument("--max-copies", type=int, default=4, help="most weight copies rotated per shape")
    p.add_argument("--budget-s", type=float, default=0.25, help="timing budget per (M, implementation)")
    p.add_argument("--max-runs", type=int, default=200)
    p.add_argument("--batched-mm-max-bytes", type=float, default=4e9, help="skip hf_batched_mm above this gather")
    p.add_argument("--kernels", action="store_true", help="also the Triton path's GPU time per kernel (CUDA only)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if DEVICE != "cuda" and not interpreting():
        sys.exit("bench_moe.py needs a CUDA device (or TRITON_INTERPRET=1 for a smoke test on tiny shapes)")
    dtype = DTYPES[args.dtype]
    impls = implementations(args.impl or ["triton", "torch_ref", "grouped_mm", "hf_grouped_mm", "hf_batched_mm"])
    start = time.perf_counter()
    budget = (args.budget_s, args.max_runs)
    args.ceilings = measure_ceilings(*budget) if DEVICE == "cuda" else measure_ceilings(*budget, 1 << 20, 256)
    c = args.ceilings
    print(f"device {device_name()}  torch {torch.__version__}  dtype {args.dtype}")
    print(f"ceilings: HBM read {c['read_GBps']:.0f} GB/s (tensor sum), device copy {c['copy_rw_GBps']:.0f} GB/s "
          f"(read+write), bf16 matmul 8192^3 {c['matmul_bf16_TFLOPs']:.0f} TFLOP/s timed as the kernels are "
          f"({c['matmul_bf16_burst_TFLOPs']:.0f} in a burst of 10 calls)")  # fmt: skip
    print("%HBM-read = (touched expert weights + activations) / time / HBM read ceiling; * = eager timing\n")
    table = [header(list(impls))]
    print(table[0])
    rows = []
    shapes = {name: MODEL_SHAPES[name] for name in args.shape or ([] if args.E else list(MODEL_SHAPES))}
    if args.E:
        shapes[f"E{args.E}-H{args.H}-I{args.I}-k{args.k}"] = {"E": args.E, "H": args.H, "I": args.I, "k": args.k}
    for name, shape in shapes.items():
        shape_rows = bench_shape(name, shape, dtype, args.m, impls, args)
        rows += shape_rows
        table += [format_row(r, list(impls), c) for r in shape_rows]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"device": device_name(), "torch": torch.__version__, "dtype": args.dtype, "ceilings": c}
    try:
        import triton

        meta["triton"] = triton.__version__
    except ImportError:
        pass
    (out / "bench_moe.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1, default=str) + "\n")
    notes = (
        f"device {meta['device']}, torch {meta['torch']}, triton {meta.get('triton')}, {args.dtype}\n\n"
        f"HBM read ceiling {c['read_GBps']:.0f} GB/s (reduction over 2 GiB); device copy {c['copy_rw_GBps']:.0f} "
        f"GB/s counting read+write; bf16 matmul {c['matmul_bf16_TFLOPs']:.0f} TFLOP/s timed as the kernels are "
        f"(graph replays over the same budget; {c['matmul_bf16_burst_TFLOPs']:.0f} TFLOP/s in a burst of 10 calls "
        f"after a pause; %bf16-mm is against the former). Times in us per layer "
        f"(experts only; route separate); * = eager timing (launch overhead included).\n\n"
    )
    (out / "bench_moe.md").write_text(notes + "\n".join(table) + "\n")
    print(f"\nwrote {out / 'bench_moe.json'} and {out / 'bench_moe.md'} in {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
