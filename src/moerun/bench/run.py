"""Runs the whole benchmark: build or load the model, measure, compare with transformers, report."""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import torch

from moerun.api import LLM
from moerun.bench.engine_bench import decode_step_bytes, measure_decode, measure_prefill, model_weight_bytes
from moerun.bench.report import format_table, write_outputs
from moerun.bench.timing import measure_ceilings
from moerun.config import ModelConfig, parse_dtype
from moerun.kernels.tile_configs import current_table_devices, devices_with_tables
from moerun.models.presets import preset_config
from moerun.models.random_init import random_model
from moerun.models.random_quant import QUANT_FILE_TYPES, random_quantized_model
from moerun.models.tiny import qwen3_tokenizer_dir
from moerun.tokenizer import Tokenizer


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", default="qwen3-30b-a3b", help="qwen3-30b-a3b, qwen3-235b-a22b or tiny")
    p.add_argument("--model", help="a checkpoint folder instead of a preset")
    p.add_argument("--layers", type=int, help="use only this many layers of the preset (to fit large shapes)")
    p.add_argument("--device", help="cuda or cpu (default: cuda if present)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--quant", type=str.upper, choices=QUANT_FILE_TYPES,
                   help="a preset in this GGUF file type's mix of quant types (llama.cpp's), random valid blocks")
    p.add_argument("--moe-backend", choices=["torch", "triton"])
    p.add_argument("--prefill-lens", default="128,512,2048,8192")
    p.add_argument("--batch-sizes", default="1,2,4,8,16,32,64,128,256")
    p.add_argument("--prompt-len", type=int, default=128, help="context of each sequence before decoding")
    p.add_argument("--steps", type=int, default=32, help="decode steps timed per batch size")
    p.add_argument("--max-model-len", type=int, default=9216)
    p.add_argument("--no-graphs", action="store_true", help="decode eagerly (no CUDA graphs)")
    p.add_argument("--vs", choices=["transformers"], help="also time transformers on the same weights")
    p.add_argument("--hf-batch-sizes", default="1,8,64")
    p.add_argument("--profile", action="store_true", help="also break a batch-1 decode step down by kernel")
    p.add_argument("--out", default="bench-out", help="folder for bench.json / bench.md / bench.png")


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def run(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    batch_sizes = _ints(args.batch_sizes)
    quant = getattr(args, "quant", None)
    if quant and (args.model or args.vs):
        raise ValueError("--quant builds a preset in a GGUF type mix; it takes neither --model nor --vs")
    ceilings = measure_ceilings(device)  # before the model and its KV cache take the memory
    t0 = time.perf_counter()
    hf_config, build_s, model_device_bytes = None, None, None
    if args.model:
        llm = LLM(args.model, device=device, dtype=args.dtype, moe_backend=args.moe_backend,
                  max_model_len=args.max_model_len, max_num_seqs=max(batch_sizes), cuda_graphs=not args.no_graphs)
        name = args.model
    else:
        hf_config = preset_config(args.preset, args.layers)
        hf_config["torch_dtype"] = str(parse_dtype(args.dtype)).removeprefix("torch.")
        mc = ModelConfig.from_hf_dict(hf_config)
        hf_config["max_position_embeddings"] = mc.max_position_embeddings
        allocated = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
        model = _preset_model(mc, device, quant, args.moe_backend)
        build_s = time.perf_counter() - t0
        if device.type == "cuda":
            model_device_bytes = torch.cuda.memory_allocated(device) - allocated
        llm = LLM.from_model(model, Tokenizer.from_folder(qwen3_tokenizer_dir()),
                             max_model_len=min(args.max_model_len, mc.max_position_embeddings),
                             max_num_seqs=max(batch_sizes), cuda_graphs=not args.no_graphs)
        name = args.preset + (f" ({args.layers} layers)" if args.layers else "") + (f" {quant}" if quant else "")
    setup_s = time.perf_counter() - t0
    result: dict[str, Any] = {
        "model": name,
        "quant": quant,
        "weight_bytes": model_weight_bytes(llm.model),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "tuned_tables": devices_with_tables(current_table_devices()) if device.type == "cuda" else [],
        "dtype": str(llm.model_config.dtype).removeprefix("torch."),
        "build_seconds": build_s,
        "model_device_bytes": model_device_bytes,
        "setup_seconds": setup_s,
        "cuda_graphs": bool(llm.engine.runner.graphs),
        "ceilings": ceilings,
        "prefill": measure_prefill(llm, _ints(args.prefill_lens)),
        "decode": measure_decode(llm, batch_sizes, args.prompt_len, args.steps),
        "date": time.strftime("%Y-%m-%d"),
        "torch": torch.__version__,
    }
    for B, entry in result["decode"].items():
        nbytes = decode_step_bytes(llm, B, args.prompt_len + args.steps // 2)
        entry["bytes_per_step"] = nbytes
        if ceilings:
            entry["bandwidth_util"] = nbytes / (entry["step_ms"] / 1e3) / (ceilings["hbm_read_GBps"] * 1e9)
    if args.profile:
        from moerun.bench.profile import profile_decode, profile_prefill

        result["profile"] = profile_decode(llm, args.prompt_len)
        lengths = [L for L in _ints(args.prefill_lens) if L <= 2048]
        if lengths:  # the longest prompt up to 2048 tokens
            result["prefill_profile"] = profile_prefill(llm, max(lengths))
        if llm.engine.async_scheduling and 1 in result["decode"]:  # what async scheduling gains at batch 1
            llm.engine.async_scheduling = False
            result["profile"]["sync_step_ms"] = measure_decode(llm, [1], args.prompt_len, args.steps)[1]["step_ms"]
            llm.engine.async_scheduling = True
    if args.vs == "transformers":
        if hf_config is None:
            raise ValueError("--vs transformers needs a --preset model (it shares the preset's weights)")
        from moerun.bench.hf_baseline import hf_model_sharing_weights, measure_hf

        hf = hf_model_sharing_weights(llm.model, hf_config)
        prefill_len = 2048 if 2048 in result["prefill"] else max(result["prefill"], default=128)
        result["hf_prefill_len"] = prefill_len
        result["hf_logits_check"] = _compare_logits(llm, hf, device)
        result["hf"] = measure_hf(hf, device, args.prompt_len, min(args.steps, 16), _ints(args.hf_batch_sizes),
                                  prefill_len)
    return result


def _preset_model(mc: ModelConfig, device: torch.device, quant: str | None,
                  moe_backend: str | None) -> torch.nn.Module:
    """The preset with random weights: dense, or in a GGUF file type's quant mix with random valid blocks."""
    if quant:
        model = random_quantized_model(mc, device, quant, moe_backend=moe_backend)
    else:
        model = random_model(mc, device, moe_backend=moe_backend)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return model


@torch.inference_mode()
def _compare_logits(llm: LLM, hf: torch.nn.Module, device: torch.device) -> float:
    """Relative error of moerun's prefill logits against transformers' on the shared weights."""
    ids = torch.randint(0, llm.model_config.vocab_size, (64,)).tolist()
    ours = llm.logits(ids)
    theirs = hf(torch.tensor([ids], device=device)).logits[0].float().cpu()
    return float((ours - theirs).norm() / theirs.norm())


def main(args: argparse.Namespace) -> int:
    result = run(args)
    paths = write_outputs(result, Path(args.out))
    print(format_table(result))
    from moerun.bench.profile import format_profile

    if result.get("profile"):
        print(format_profile(result["profile"]))
    if result.get("prefill_profile"):
        tokens = result["prefill_profile"]["tokens"]
        print(format_profile(result["prefill_profile"], f"prefill profile, one prompt of {tokens} tokens"))
    if "hf_logits_check" in result:
        print(f"\nlogits vs transformers on the same weights: relative error {result['hf_logits_check']:.2e}")
    print("\nwrote " + ", ".join(str(p) for p in paths))
    return 0
