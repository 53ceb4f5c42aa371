"""The ``moerun`` command: generate, chat, inspect, make-tiny, quantize, bench."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

DEMO_NOTE = (
    "moerun: no --model given; using the built-in tiny demo model at {path}.\n"
    "        Its weights are RANDOM: it shows the pipeline working, its text is gibberish.\n"
)


def default_model_dir() -> Path:
    """The built-in demo model's folder, made on first use."""
    root = Path(os.environ.get("MOERUN_CACHE", Path.home() / ".cache" / "moerun"))
    return root / "tiny-qwen3-moe"


def ensure_demo_model() -> Path:
    from moerun.models.tiny import make_tiny_checkpoint

    path = default_model_dir()
    if not (path / "model.safetensors").exists():
        tmp = path.with_name(path.name + ".partial")
        make_tiny_checkpoint(tmp, seed=0)
        tmp.replace(path) if not path.exists() else None
    return path


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", "-m",
                   help="Hugging Face checkpoint folder or GGUF file (default: the built-in tiny demo model)")
    p.add_argument("--device", help="cuda, cpu, cuda:1 ... (default: cuda if present)")
    p.add_argument("--dtype", help="bfloat16, float16 or float32 (default: checkpoint's on CUDA, float32 on CPU)")
    p.add_argument("--moe-backend", choices=["torch", "triton"], help="experts backend (default: triton on CUDA)")
    p.add_argument("--max-model-len", type=int, help="context length (default: min(model's, 8192))")
    # expert offloading (moe/offload)
    p.add_argument("--gpu-memory-gb", type=float, help="device memory budget; experts are offloaded to host memory "
                   "when the model does not fit (default: the device's free memory)")
    p.add_argument("--expert-cache-gb", type=float, help="offload experts with a device cache of this size")
    p.add_argument("--offload-policy", choices=["lru", "lfu", "activation"], help="expert cache eviction policy")
    p.add_argument("--offload-cpu-compute", choices=["off", "auto", "always"],
                   help="compute missed experts on the CPU: off (default), auto (cost model) or always")
    p.add_argument("--offload-mode", choices=["auto", "copy", "zero_copy"],
                   help="zero_copy: kernels read missed experts from pinned host memory, decode keeps its CUDA "
                   "graphs; copy: misses are copied into the cache, a graph pair per decoder layer; auto (default): "
                   "zero_copy on CUDA for experts the kernels can read in place (dense, or quantized on Triton)")
    p.add_argument("--offload-prefetch", choices=["auto", "on", "off"],
                   help="copy mode: prefetch the next layer's experts predicted by its router on this layer's input; "
                   "auto (default): on in copy mode; on: also makes --offload-mode auto choose copy mode")
    p.add_argument("--verbose", action="store_true", help="print expert-offloading statistics when done")


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--top-k", type=int, default=20)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--seed", type=int)
    p.add_argument("--stop", action="append", help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="moerun", description="Fast inference for Mixture-of-Experts LLMs.")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="complete a prompt, streaming the text to stdout")
    _add_model_args(g)
    _add_sampling_args(g)
    g.add_argument("--prompt", "-p", help="the prompt (default: read stdin)")
    g.add_argument("--chat-template", action="store_true", help="wrap the prompt as one user chat message")
    g.add_argument("--no-think", action="store_true", help="with --chat-template: disable Qwen3 thinking")

    c = sub.add_parser("chat", help="interactive chat (type /exit to quit, /reset to start over)")
    _add_model_args(c)
    _add_sampling_args(c)
    c.add_argument("--system", help="system prompt")
    c.add_argument("--no-think", action="store_true", help="disable Qwen3 thinking")

    i = sub.add_parser("inspect", help="show a checkpoint's architecture, parameter counts and bytes")
    i.add_argument("path")

    t = sub.add_parser("make-tiny", help="write a seeded random tiny Qwen3-MoE checkpoint with the Qwen3 tokenizer")
    t.add_argument("out")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--layers", type=int, default=4)
    t.add_argument("--experts", type=int, default=8)
    t.add_argument("--top-k", type=int, default=2)
    t.add_argument("--hidden", type=int, default=64)
    t.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    q = sub.add_parser("quantize", help="write a qwen3moe GGUF from an HF checkpoint or re-quantize a GGUF")
    q.add_argument("src", help="HF checkpoint folder or GGUF file")
    q.add_argument("out", help="output .gguf path")
    q.add_argument("--type", required=True,
                   help="Q8_0, Q6_K, Q5_K_M, Q4_K_M, Q3_K_M, Q2_K, Q4_0, IQ4_XS, IQ4_NL, F16, BF16, F32")

    b = sub.add_parser("bench", help="measure prefill and decode speed on a preset shape or a checkpoint")
    from moerun.bench.run import add_arguments

    add_arguments(b)
    return parser


def _sampling(args: argparse.Namespace):
    from moerun import SamplingParams

    return SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        min_p=args.min_p, repetition_penalty=args.repetition_penalty, seed=args.seed, stop=args.stop,
        ignore_eos=args.ignore_eos,
    )


def _load(args: argparse.Namespace):
    from moerun import LLM

    model = args.model
    if model is None:
        model = ensure_demo_model()
        sys.stderr.write(DEMO_NOTE.format(path=model))
    from moerun.moe.offload import OffloadConfig

    prefetch = {"on": True, "off": False}.get(args.offload_prefetch)  # auto: None, the mode's default
    offload = OffloadConfig(cpu_compute=args.offload_cpu_compute or "off", mode=args.offload_mode or "auto",
                            prefetch=prefetch)
    return LLM(str(model), device=args.device, dtype=args.dtype, moe_backend=args.moe_backend,
               max_model_len=args.max_model_len, gpu_memory_gb=args.gpu_memory_gb,
               expert_cache_gb=args.expert_cache_gb, offload_policy=args.offload_policy, offload=offload)


def _print_stats(args: argparse.Namespace, llm) -> None:
    if args.verbose:
        from moerun.moe.offload import format_stats

        sys.stderr.write(format_stats(llm.stats()) + "\n")


def cmd_generate(args: argparse.Namespace) -> int:
    params = _sampling(args)  # bad options fail before the model loads
    prompt = args.prompt if args.prompt is not None else sys.stdin.read()
    llm = _load(args)
    if args.chat_template:
        prompt = llm.render_chat([{"role": "user", "content": prompt}], enable_thinking=not args.no_think)
    for delta in llm.stream(prompt, params):
        sys.stdout.write(delta)
        sys.stdout.flush()
    sys.stdout.write("\n")
    _print_stats(args, llm)
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    params = _sampling(args)
    llm = _load(args)
    history = [{"role": "system", "content": args.system}] if args.system else []
    start = len(history)
    while True:
        try:
            line = input(">>> ")
        except EOFError:
            break
        if line.strip() == "/exit":
            break
        if line.strip() == "/reset":
            del history[start:]
            continue
        history.append({"role": "user", "content": line})
        prompt = llm.render_chat(history, enable_thinking=not args.no_think)
        reply = []
        for delta in llm.stream(prompt, params):
            reply.append(delta)
            sys.stdout.write(delta)
            sys.stdout.flush()
        sys.stdout.write("\n")
        history.append({"role": "assistant", "content": "".join(reply)})
    _print_stats(args, llm)
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    from moerun.inspect import describe

    print(describe(args.path))
    return 0


def cmd_make_tiny(args: argparse.Namespace) -> int:
    import torch

    from moerun.models.tiny import make_tiny_checkpoint

    dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[args.dtype]
    heads = max(1, args.hidden // 16)
    out = make_tiny_checkpoint(
        args.out, seed=args.seed, dtype=dtype, num_hidden_layers=args.layers, num_experts=args.experts,
        num_experts_per_tok=args.top_k, hidden_size=args.hidden, num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 2), torch_dtype=args.dtype,
    )
    print(f"wrote a random tiny Qwen3-MoE checkpoint to {out}")
    return 0


def cmd_quantize(args: argparse.Namespace) -> int:
    from moerun.formats.convert import quantize_model

    paths = quantize_model(args.src, args.out, args.type)
    print("wrote " + ", ".join(str(p) for p in paths))
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from moerun.bench.run import main as bench_main

    return bench_main(args)


COMMANDS = {"generate": cmd_generate, "chat": cmd_chat, "inspect": cmd_inspect, "make-tiny": cmd_make_tiny,
            "quantize": cmd_quantize, "bench": cmd_bench}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except (ValueError, FileNotFoundError, RuntimeError) as exc:
        sys.stderr.write(f"moerun {args.command}: error: {exc}\n")
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
