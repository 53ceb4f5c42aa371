"""How fast the quantized MoE decode kernels read experts in place from pinned host memory (zero-copy offloading).

One Qwen3-30B-A3B-shaped MoE layer in Q4_K_M's expert types (gate/up Q4_K, down Q6_K), batch 1, top-8, the
experts' repacked arrays in host memory and found through the kernels' address tables; calls chained in a CUDA
graph. Variants: the routing of each call kept from replay to replay ("repeated") or drawn afresh before every
replay ("fresh", as in decoding); the experts of 1 or of 48 layers in host memory; page-locked by the caching
allocator ("pin_memory"), registered in place ("registered") or registered over transparent huge pages ("thp").
Prints time per layer and GB/s over the bytes of the touched experts, beside the same call on device memory.

    python benchmarks/bench_host_read.py [--layers 1,48] [--alloc pin_memory,registered,thp] [--routing fresh]
"""

from __future__ import annotations

import argparse
import mmap
import sys

import torch

from moerun.formats.quants import QuantType
from moerun.kernels.quant.fused_moe_quant import fused_moe_quant
from moerun.kernels.quant.repack import PackedWeight, expert_addresses
from moerun.kernels.quant.synthetic import random_quantized
from moerun.layers.quantized import QuantizedWeight
from moerun.ops.quant import packed_parts

E, H, I, K = 128, 2048, 768, 8  # noqa: E741
CALLS = 48  # layer calls per graph replay
Tables = tuple[list[torch.Tensor], torch.Tensor]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", default="1,48", help="layers of experts held in host memory")
    p.add_argument("--alloc", default="pin_memory,registered,thp")
    p.add_argument("--routing", default="fresh,repeated")
    p.add_argument("--replays", type=int, default=5)
    return p.parse_args(argv)


def host_layers(parts: list[PackedWeight], layers: int, alloc: str) -> tuple[list[list[PackedWeight]], object]:
    """``layers`` host copies of one layer's packed parts, and what keeps their memory alive."""
    if alloc == "pin_memory":
        out = [[PackedWeight(p.qtype, p.shape, p.k_pad, *[None if t is None else
                                                           torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                                                           .copy_(t) for t in p.tensors()]) for p in parts]
               for _ in range(layers)]  # fmt: skip
        return out, None
    layer_bytes = sum(t.numel() * t.element_size() for p in parts for t in p.tensors() if t is not None)
    size = layers * (layer_bytes + 16 * 4096) + (2 << 20)
    region = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if alloc == "thp":
        region.madvise(mmap.MADV_HUGEPAGE)
    buf = torch.frombuffer(region, dtype=torch.uint8)
    buf = buf[(-buf.data_ptr()) % (2 << 20):]  # 2 MiB aligned
    off, out = 0, []
    for _ in range(layers):
        layer = []
        for p in parts:
            arrays = []
            for t in p.tensors():
                if t is None:
                    arrays.append(None)
                    continue
                n = t.numel() * t.element_size()
                arrays.append(buf[off : off + n].view(t.dtype).view(t.shape).copy_(t))
                off = (off + n + 4095) // 4096 * 4096
            layer.append(PackedWeight(p.qtype, p.shape, p.k_pad, *arrays))
        out.append(layer)
    err = torch.cuda.cudart().cudaHostRegister(buf.data_ptr(), buf.numel(), 0)
    if int(err) != 0:
        raise RuntimeError(f"cudaHostRegister failed ({int(err)})")
    return out, (region, buf)


def tables_of(layer: list[PackedWeight], device: torch.device) -> Tables:
    return [expert_addresses(p).to(device) for p in layer[:-1]], expert_addresses(layer[-1]).to(device)


def time_calls(w13: list[PackedWeight], w2: PackedWeight, tables: list[Tables], fresh: bool, replays: int,
               device: torch.device) -> float:
    """Microseconds per layer call, the median over graph replays of CALLS calls (tables cycled)."""
    x = torch.randn(1, H, device=device, dtype=torch.bfloat16)
    weights = torch.full((1, K), 1.0 / K, device=device)
    ids = [torch.randperm(E, device=device)[:K].view(1, K).to(torch.int32) for _ in range(CALLS)]

    def step() -> None:
        for c in range(CALLS):
            fused_moe_quant(x, w13, w2, weights, ids[c], None, tables=tables[c % len(tables)])

    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    times = []
    for _ in range(replays):
        if fresh:
            for i in ids:
                i.copy_(torch.randperm(E, device=device)[:K].view(1, K))
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return times[len(times) // 2] * 1e3 / CALLS


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("needs CUDA (kernels reading pinned host memory)")
        return 1
    device = torch.device("cuda")
    w13 = QuantizedWeight([random_quantized(QuantType.Q4_K, (E, I, H), device) for _ in range(2)])
    w2 = QuantizedWeight([random_quantized(QuantType.Q6_K, (E, H, I), device)])
    parts = [*packed_parts(w13), packed_parts(w2)[0]]
    expert_bytes = sum(t[0].numel() * t.element_size() for p in parts for t in p.tensors() if t is not None)
    rows = []

    def row(where: str, layers: int, routing: str, us: float) -> None:
        rows.append((where, layers, routing, us, K * expert_bytes / us / 1e3))
        print(f"{where:<11} {layers:>6} {routing:<9} {us:9.1f} {rows[-1][4]:7.1f}", flush=True)

    print(f"{'memory':<11} {'layers':>6} {'routing':<9} {'us/layer':>9} {'GB/s':>7}")
    routings = [r.strip() for r in args.routing.split(",") if r.strip()]
    for routing in routings:
        row("device", 1, routing, time_calls(parts[:-1], parts[-1], [tables_of(parts, device)], routing == "fresh",
                                             args.replays, device))
    for alloc in [a.strip() for a in args.alloc.split(",") if a.strip()]:
        for layers in [int(n) for n in args.layers.split(",")]:
            host, keep = host_layers(parts, layers, alloc)
            tables = [tables_of(layer, device) for layer in host]
            for routing in routings:
                row(alloc, layers, routing, time_calls(parts[:-1], parts[-1], tables, routing == "fresh",
                                                       args.replays, device))
            if keep is not None:
                torch.cuda.cudart().cudaHostUnregister(keep[1].data_ptr())
            del host, keep, tables
    return 0


if __name__ == "__main__":
    sys.exit(main())
