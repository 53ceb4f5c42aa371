"""Batch-1 decode of one preset model under launch variants (environment settings read at kernel launch, such as
MOERUN_PDL, MOERUN_PDL_TRIGGER, MOERUN_PDL_QUANT), side by side on one model build: each variant recaptures the
decode graph and times whole engine steps and graph replay.

    python benchmarks/bench_decode_variants.py --quant Q4_K_M \
        --variant base --variant after_wait:MOERUN_PDL_TRIGGER=after_wait --variant base

A variant is NAME or NAME:VAR=VALUE[,VAR=VALUE...]; every variant starts from the environment the script was
started with, the variables named by any variant unset. Repeat one (as above) to see the run's drift. Without
CUDA it runs eagerly on the CPU (``--preset tiny``: a smoke test of the script, not a measurement).

An assignment moe.M.KEY=VALUE changes the fused-MoE tables' entry for M tokens (every MoE table, bf16 and
quantized, that has one) for that variant: the device's shipped tables, or with ``--tables-from DEVICE`` another
device's (e.g. NVIDIA_H200 on a GPU that has none of its own, which would otherwise run the defaults), are copied
into a folder of the variant's own under this device's name and given to it as MOERUN_MOE_CONFIG_DIR (and the
dense GEMV table of DEVICE as MOERUN_GEMV_CONFIG_DIR):

    python benchmarks/bench_decode_variants.py --tables-from NVIDIA_H200 --variant base \
        --variant n16:moe.1.BLOCK_N2=16,moe.1.reduce=atomic --variant base

An assignment gemv.NxK.T.KEY=VALUE changes the dense GEMV table's entry for an [N, K] weight at T tokens the
same way (e.g. gemv.5120x2048.1.row_once=true, the q|k|v projection of Qwen3-30B-A3B at one token), and
qgemv.NxK.M.KEY=VALUE the quantized matmul table's entries of [N, K] parts of any type at M rows.

An assignment attr.MODULE.NAME=VALUE sets a module-level constant of moerun for the variant's capture and steps
(restored afterwards), e.g. attr.moerun.kernels.decode_attention.NUM_WARPS=8, and attr.MODULE.NAME.FIELD=VALUE one
field of a dataclass constant, e.g. attr.moerun.kernels.router_fused.SINGLE_TOKEN_CONFIG.split=64. Only constants
that the code reads from its module at call time (not copied elsewhere at import) take effect.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any, Iterator

import torch

from moerun.api import LLM
from moerun.bench.engine_bench import measure_decode
from moerun.bench.profile import replay_ms
from moerun.bench.run import _preset_model
from moerun.config import ModelConfig
from moerun.kernels.gemv import table_path as gemv_table_path
from moerun.kernels.quant.configs import matmul_table_path
from moerun.kernels.tile_configs import CONFIG_DIR, device_name
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


Entries = dict[Any, dict[str, Any]]


def _json_value(text: str) -> Any:
    """A table value as JSON where it parses (16, true), else the string itself."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def table_overrides(env: dict[str, str]) -> tuple[dict[str, str], Entries, Entries]:
    """A variant's assignments split into environment variables, MoE table entries ({M: {KEY: value}}, from
    moe.M.KEY=VALUE) and dense matmul table entries ({(table, N, K, T): {KEY: value}}, from gemv.NxK.T.KEY=VALUE,
    table "gemv", and qgemv.NxK.M.KEY=VALUE, table "quant_gemv")."""
    plain: dict[str, str] = {}
    moe: Entries = {}
    gemv: Entries = {}
    for key, text in env.items():
        kind, _, rest = key.partition(".")
        if kind == "attr":
            continue  # attribute_overrides
        if kind == "moe":
            m, _, field = rest.partition(".")
            if not m.isdigit() or not field:
                raise ValueError(f"{key!r}: expected moe.M.KEY, M a token count")
            moe.setdefault(int(m), {})[field] = _json_value(text)
        elif kind in ("gemv", "qgemv"):
            shape, _, rest = rest.partition(".")
            t, _, field = rest.partition(".")
            n, _, k = shape.partition("x")
            if not (n.isdigit() and k.isdigit() and t.isdigit() and field):
                raise ValueError(f"{key!r}: expected {kind}.NxK.T.KEY, e.g. {kind}.5120x2048.1.block_n")
            table = "gemv" if kind == "gemv" else "quant_gemv"
            gemv.setdefault((table, int(n), int(k), int(t)), {})[field] = _json_value(text)
        else:
            plain[key] = text
    return plain, moe, gemv


def attribute_overrides(env: dict[str, str]) -> list[tuple[object, str, Any]]:
    """A variant's attr.MODULE.NAME[.FIELD]=VALUE assignments as (module, NAME, new value)."""
    return [_attribute(key, _json_value(text)) for key, text in env.items() if key.startswith("attr.")]


def _attribute(key: str, value: Any) -> tuple[object, str, Any]:
    """(module, NAME, value) of attr.MODULE.NAME[.FIELD]: the longest importable prefix is the module; with a FIELD,
    value replaces that field of the dataclass NAME holds."""
    parts = key.split(".")[1:]
    for cut in range(len(parts) - 1, 0, -1):
        try:
            module = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        name, fields = parts[cut], parts[cut + 1 :]
        if len(fields) <= 1 and hasattr(module, name):
            if fields:
                value = dataclasses.replace(getattr(module, name), **{fields[0]: value})
            return module, name, value
        break
    raise ValueError(f"{key!r}: expected attr.MODULE.NAME or attr.MODULE.NAME.FIELD naming a constant of a module")


@contextlib.contextmanager
def attributes_set(overrides: list[tuple[object, str, Any]]) -> Iterator[None]:
    """The module attributes set for the block, restored after it."""
    saved = [(module, name, getattr(module, name)) for module, name, _ in overrides]
    try:
        for module, name, value in overrides:
            setattr(module, name, value)
        yield
    finally:
        for module, name, value in reversed(saved):
            setattr(module, name, value)


def _update_gemv_table(name: str, table: dict, entries: Entries) -> set:
    """Each (name, N, K, T) entry of ``entries`` merged into the table's entries of that weight shape (any dtype or
    quant type); returns the entries it found."""
    found = set()
    for (table_name, n, k, t), fields in entries.items():
        for key, by_t in table.items():
            shape = dict(item.partition("=")[::2] for item in key.split(","))
            if table_name == name and (shape.get("N"), shape.get("K")) == (str(n), str(k)) and str(t) in by_t:
                by_t[str(t)].update(fields)
                found.add((table_name, n, k, t))
    return found


def write_tables(folder: Path, source: str, device: str, entries: Entries, gemv_entries: Entries | None = None) -> Path:
    """The MoE tables shipped for device ``source``, copied into folder under ``device``'s name with each entry M of
    ``entries`` updated (in every table that has one), and source's dense GEMV table beside them with
    ``gemv_entries`` updated. Raises where an updated M or (N, K, T) is in none of them."""
    folder.mkdir(parents=True, exist_ok=True)
    updated = set()
    for path in sorted(CONFIG_DIR.glob(f"*device={source}.json")):
        table = json.loads(path.read_text())
        for m, fields in entries.items():
            if str(m) in table:
                table[str(m)].update(fields)
                updated.add(m)
        (folder / path.name.replace(f"device={source}", f"device={device}")).write_text(json.dumps(table, indent=1))
    if set(entries) - updated:
        raise ValueError(f"no MoE table of {source} has an entry for M = {sorted(set(entries) - updated)}")
    found = set()
    for name, path in (("gemv", gemv_table_path(source)), ("quant_gemv", matmul_table_path(source))):
        if path.is_file():
            table = json.loads(path.read_text())
            found |= _update_gemv_table(name, table, gemv_entries or {})
            (folder / path.name.replace(source, device)).write_text(json.dumps(table, indent=1))
    missing = set(gemv_entries or {}) - found
    if missing:
        raise ValueError(f"the matmul tables of {source} have no entry for (table, N, K, T) = {sorted(missing)}")
    return folder


def variant_env(name: str, env: dict[str, str], tables_from: str | None, device: str, folder: Path) -> dict[str, str]:
    """The environment of one variant: its variables, and where it changes MoE table entries or takes another
    device's tables, ``folder`` with its own tables."""
    plain, entries, gemv_entries = table_overrides(env)
    if not entries and not gemv_entries and tables_from is None:
        return plain
    if {"MOERUN_MOE_CONFIG_DIR", "MOERUN_GEMV_CONFIG_DIR"} & set(plain):
        raise ValueError(f"variant {name!r}: moe.M.KEY / gemv.NxK.T.KEY assignments and --tables-from set the "
                         "config folders themselves")  # fmt: skip
    write_tables(folder, tables_from or device, device, entries, gemv_entries)
    return {**plain, "MOERUN_MOE_CONFIG_DIR": str(folder), "MOERUN_GEMV_CONFIG_DIR": str(folder)}


def _replay_ms(graph: torch.cuda.CUDAGraph | None) -> float:
    """Back-to-back replay time of the batch-1 graph; NaN without one (CPU)."""
    return float("nan") if graph is None else replay_ms(graph)


def main(argv: list[str] | None = None) -> list[tuple[str, float, float, float]]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="qwen3-30b-a3b")
    p.add_argument("--layers", type=int, help="use only this many layers of the preset")
    p.add_argument("--quant", help="a GGUF file type's quant mix (random valid blocks); default bf16")
    p.add_argument("--variant", action="append", required=True,
                   help="NAME or NAME:VAR=VALUE[,VAR=VALUE...]; VAR may be moe.M.KEY (a MoE table entry's key), "
                        "gemv.NxK.T.KEY / qgemv.NxK.M.KEY (a matmul table entry's) or attr.MODULE.NAME[.FIELD] "
                        "(a module constant)")
    p.add_argument("--tables-from", metavar="DEVICE",
                   help="every variant runs on the tables shipped for DEVICE (e.g. NVIDIA_H200), renamed for this one")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--repeat", type=int, default=3, help="timed runs of --steps steps per variant (median kept)")
    args = p.parse_args(argv)
    device_tag = device_name()
    folders = tempfile.TemporaryDirectory(prefix="moerun-variants-")
    variants = [(name, variant_env(name, env, args.tables_from, device_tag, Path(folders.name) / str(i)),
                 attribute_overrides(env))
                for i, (name, env) in enumerate(map(parse_variant, args.variant))]  # fmt: skip
    named = {key for _, env, _ in variants for key in env}
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
        for name, env, attrs in variants:
            os.environ.clear()
            os.environ.update({**base_env, **env})
            with attributes_set(attrs):
                llm.engine.runner.graphs = {}
                llm.engine.runner.capture(args.prompt_len)
                steps = sorted(measure_decode(llm, [1], args.prompt_len, args.steps)[1]["step_ms"]
                               for _ in range(args.repeat))  # fmt: skip
                rows.append((name, steps[0], steps[len(steps) // 2], _replay_ms(llm.engine.runner.graphs.get(1))))
            print(f"  {name}: {rows[-1][2]:.3f} ms a step", flush=True)
    finally:
        os.environ.clear()
        os.environ.update(started_with)
        folders.cleanup()
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"\n{args.preset} {args.quant or 'bf16'} batch-1 decode, {gpu}")
    print(f"{'variant':28s} {'step ms':>8s} {'best':>8s} {'replay ms':>10s} {'tok/s':>8s}")
    for name, best, median, replay in rows:
        print(f"{name:28s} {median:8.3f} {best:8.3f} {replay:10.3f} {1e3 / median:8.1f}")
    return rows


if __name__ == "__main__":
    main()
