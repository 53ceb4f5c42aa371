"""The bench's outputs: a printed table, a JSON file and a PNG plot of tok/s against batch size."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def format_table(result: dict[str, Any]) -> str:
    lines = [f"model {result['model']}  device {result['device']}  dtype {result['dtype']}"]
    if result.get("device", "cpu") != "cpu" and "tuned_tables" in result:
        lines.append(f"tuned tables {', '.join(result['tuned_tables']) or 'none (untuned defaults)'}")
    if result.get("weight_bytes"):
        built = f" (built in {result['build_seconds']:.1f} s)" if result.get("build_seconds") is not None else ""
        lines.append(f"weights {result['weight_bytes'] / 2**30:.2f} GiB{built}")
    ceil = result.get("ceilings", {})
    if ceil:
        lines.append(f"ceilings: HBM read {ceil['hbm_read_GBps']:.0f} GB/s, bf16 matmul "
                     f"{ceil['bf16_matmul_TFLOPs']:.0f} TFLOP/s")
    lines.append("")
    lines.append("prefill   tokens      moerun tok/s" + ("   transformers tok/s" if result.get("hf") else ""))
    hf_prefill = _best_hf_prefill(result)
    for L, rate in result["prefill"].items():
        extra = f"   {hf_prefill:>18,.0f}" if hf_prefill and int(L) == result.get("hf_prefill_len") else ""
        lines.append(f"          {int(L):>6}   {rate:>14,.0f}{extra}")
    lines.append("")
    lines.append("decode    batch   moerun tok/s   step ms   GB/step   BW util" +
                 ("   transformers tok/s (best)" if result.get("hf") else ""))
    for B, d in result["decode"].items():
        bw = d.get("bandwidth_util")
        bw_s = f"{100 * bw:>6.1f}%" if bw is not None else "      -"
        gb = d.get("bytes_per_step", 0) / 1e9
        hf_rate = _best_hf_decode(result, int(B))
        extra = f"   {hf_rate:>12,.1f}" if hf_rate else ""
        lines.append(f"          {int(B):>5}   {d['tok_per_s']:>12,.1f}   {d['step_ms']:>7.2f}   {gb:>7.2f}   "
                     f"{bw_s}{extra}")
    lines.extend(_profile_lines(result))
    return "\n".join(lines)


def _profile_lines(result: dict[str, Any]) -> list[str]:
    prof = result.get("profile") or {}
    if not prof.get("top_kernels"):
        return []
    step = result["decode"].get(1) or result["decode"].get("1") or {}
    parts = [f"engine step {step['step_ms']:.3f} ms" if step else None,
             f"synchronous step {prof['sync_step_ms']:.3f} ms" if prof.get("sync_step_ms") else None,
             f"graph replay {prof['graph_replay_ms']:.3f} ms" if prof.get("graph_replay_ms") else None,
             f"GPU kernels {prof['gpu_kernel_ms_per_step']:.3f} ms in {prof['kernels_per_step']} launches"]
    lines = ["", "batch-1 decode step: " + ", ".join(p for p in parts if p)]
    for k in prof["top_kernels"][:10]:
        lines.append(f"  {k['ms']:>7.3f} ms  {100 * k['share']:>5.1f}%  x{k['calls']:<4} {k['name'][:70]}")
    return lines


def _best_hf_decode(result: dict[str, Any], B: int) -> float | None:
    rates = [e["decode"].get(B) or e["decode"].get(str(B)) for e in (result.get("hf") or {}).values()
             if isinstance(e, dict) and "decode" in e]
    rates = [r for r in rates if r]
    return max(rates) if rates else None


def _best_hf_prefill(result: dict[str, Any]) -> float | None:
    rates = [e.get("prefill") for e in (result.get("hf") or {}).values() if isinstance(e, dict)]
    rates = [r for r in rates if r]
    return max(rates) if rates else None


def write_outputs(result: dict[str, Any], out_dir: Path) -> list[Path]:
    """Writes bench.json, bench.md and (when matplotlib is installed) bench.png; returns their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / "bench.json", out_dir / "bench.md"]
    paths[0].write_text(json.dumps(result, indent=2, default=str))
    paths[1].write_text("```\n" + format_table(result) + "\n```\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return paths
    fig, ax = plt.subplots(figsize=(7, 4.5))
    bs = [int(b) for b in result["decode"]]
    ax.plot(bs, [d["tok_per_s"] for d in result["decode"].values()], "o-", label="moerun")
    for impl, entry in (result.get("hf") or {}).items():
        if isinstance(entry, dict) and entry.get("decode"):
            pts = [(int(b), r) for b, r in entry["decode"].items() if r]
            if pts:
                ax.plot(*zip(*pts), "s--", label=f"transformers ({impl})")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("batch size")
    ax.set_ylabel("decode tokens/s (whole batch)")
    ax.set_title(f"{result['model']} on {result['device']}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_dir / "bench.png", dpi=120)
    paths.append(out_dir / "bench.png")
    return paths
