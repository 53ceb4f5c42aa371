"""Batch-1 decode of one preset model under launch variants (environment settings read at kernel launch, such as
MOERUN_PDL, MOERUN_PDL_TRIGGER, MOERUN_PDL_QUANT), side by side on one model build: each variant recaptures the
decode graph and times whole engine steps and graph replay.

    python benchmarks/bench_decode_variants.py --quant Q4_K_M \
        --variant base --variant after_wait:MOERUN_PDL_TRIGGER=after_wait --variant base

A variant is NAME or NAME:VAR=VALUE[,VAR=VALUE...]; every variant starts from the environment the script was
started with, the variables named by any variant unset. Repeat one (as above) to see the run's drift. Without
CUDA it runs eagerly on the CPU (``--preset tiny``: a smoke test of the script, not a measurement).
"""

from __future__ import annotations

import argparse
import os

import torch

from moerun.api import LLM
from moerun.bench.engine_bench import measure_decode
from moerun.bench.profile import replay_ms
from moerun.bench.run import _preset_model
from moerun.config import ModelConfig
from moerun.models.presets import preset_config
from moerun.models.tiny import qwen3_tokenizer_dir
from moerun.tokenizer import Tokenizer


def parse_variant(text: str) -> tuple[str, dict[str, str]]:
    """"name:A=1,B=2" -> ("name", {"A": "1", "B": "2"})."""
    name, _, assignments = text.partition(":")
    env = {}
    for item in filter(None, assignments.split(",")):
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"variant {text!r}: expected NAME:VAR=VALUE[,VAR=VALUE...]")
        env[key] = value
    return name, env


def _replay_ms(graph: torch.cuda.CUDAGraph | None) -> float:
    """Back-to-back replay time of the batch-1 graph; NaN without one (CPU)."""
    return float("nan") if graph is None else replay_ms(graph)


def main(argv: list[str] | None = None) -> list[tuple[str, float, float, float]]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="qwen3-30b-a3b")
    p.add_argument("--layers", type=int, help="use only this many layers of the preset")
    p.add_argument("--quant", help="a GGUF file type's quant mix (random valid blocks); default bf16")
    p.add_argument("--variant", action="append", required=True, help="NAME or NAME:VAR=VALUE[,VAR=VALUE...]")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--repeat", type=int, default=3, help="timed runs of --steps steps per variant (median kept)")
    args = p.parse_args(argv)
    variants = [parse_variant(v) for v in args.variant]
    named = {key for _, env in variants for key in env}
    base_env = {k: v for k, v in os.environ.items() if k not in named}

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    hf = preset_config(args.preset, args.layers)
    hf["torch_dtype"] = "bfloat16"
    config = ModelConfig.from_hf_dict(hf)
    model = _preset_model(config, device, args.quant, None)
    llm = LLM.from_model(model, Tokenizer.from_folder(qwen3_tokenizer_dir()), max_model_len=args.prompt_len * 2
                         + args.steps * (args.repeat + 2) + 64, max_num_seqs=1)  # fmt: skip
    rows = []
    started_with = dict(os.environ)
    try:
        for name, env in variants:
            os.environ.clear()
            os.environ.update({**base_env, **env})
            llm.engine.runner.graphs = {}
            llm.engine.runner.capture(args.prompt_len)
            steps = sorted(measure_decode(llm, [1], args.prompt_len, args.steps)[1]["step_ms"]
                           for _ in range(args.repeat))  # fmt: skip
            rows.append((name, steps[0], steps[len(steps) // 2], _replay_ms(llm.engine.runner.graphs.get(1))))
            print(f"  {name}: {rows[-1][2]:.3f} ms a step", flush=True)
    finally:
        os.environ.clear()
        os.environ.update(started_with)
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"\n{args.preset} {args.quant or 'bf16'} batch-1 decode, {gpu}")
    print(f"{'variant':28s} {'step ms':>8s} {'best':>8s} {'replay ms':>10s} {'tok/s':>8s}")
    for name, best, median, replay in rows:
        print(f"{name:28s} {median:8.3f} {best:8.3f} {replay:10.3f} {1e3 / median:8.1f}")
    return rows


if __name__ == "__main__":
    main()
