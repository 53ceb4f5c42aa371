"""Checkpoint loading: formats that must load identically, and broken checkpoints that must fail clearly."""

from __future__ import annotations

import json
import random
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers import SMALL_VOCAB, build_checkpoint
from moerun import LLM
from moerun.formats.safetensors_checkpoint import CheckpointError
from moerun.models.loading import WeightLoadError


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp("src"), seed=random.randrange(2**31))


def copy_checkpoint(src, dst):
    shutil.copytree(src, dst)
    return dst


def rewrite_weights(folder, edit):
    path = folder / "model.safetensors"
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path))


def logits_of(folder, ids=(1, 2, 3, 4, 5)):
    return LLM(str(folder), device="cpu", max_model_len=64, max_num_seqs=1).logits(list(ids))


def test_sharded_and_fused_checkpoints_load_the_same(source, tmp_path):
    expected = logits_of(source)
    tensors = load_file(str(source / "model.safetensors"))
    # sharded: three files and an index
    sharded = copy_checkpoint(source, tmp_path / "sharded")
    (sharded / "model.safetensors").unlink()
    names = sorted(tensors)
    weight_map = {}
    for i in range(3):
        part = {n: tensors[n] for n in names[i::3]}
        fname = f"model-0000{i + 1}-of-00003.safetensors"
        save_file(part, str(sharded / fname))
        weight_map.update({n: fname for n in part})
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    assert torch.equal(logits_of(sharded), expected)
    # fused experts, as transformers 5 holds them in memory
    fused = copy_checkpoint(source, tmp_path / "fused")

    def fuse(t):
        layers = {int(n.split(".")[2]) for n in t if ".experts." in n}
        for layer in layers:
            p = f"model.layers.{layer}.mlp.experts."
            E = len({n for n in t if n.startswith(p) and n.endswith("down_proj.weight")})
            gate = torch.stack([t.pop(f"{p}{e}.gate_proj.weight") for e in range(E)])
            up = torch.stack([t.pop(f"{p}{e}.up_proj.weight") for e in range(E)])
            t[p + "gate_up_proj"] = torch.cat([gate, up], dim=1)
            t[p + "down_proj"] = torch.stack([t.pop(f"{p}{e}.down_proj.weight") for e in range(E)])

    rewrite_weights(fused, fuse)
    assert torch.equal(logits_of(fused), expected)


def test_bf16_checkpoint_is_cast_to_the_requested_dtype(source):
    llm = LLM(str(source), device="cpu", dtype="bfloat16", max_model_len=64, max_num_seqs=1)
    assert llm.model.model.embed_tokens.weight.dtype == torch.bfloat16
    out = llm.logits([1, 2, 3])
    assert out.dtype == torch.float32 and torch.isfinite(out).all()


def test_missing_tensor(source, tmp_path):
    broken = copy_checkpoint(source, tmp_path / "m")
    rewrite_weights(broken, lambda t: t.pop("model.layers.1.mlp.experts.3.up_proj.weight"))
    with pytest.raises(WeightLoadError, match=r"missing tensors 'model\.layers\.1\.mlp\.experts\.3\.up_proj\.weight'"):
        LLM(str(broken), device="cpu")


def test_missing_attention_tensor(source, tmp_path):
    broken = copy_checkpoint(source, tmp_path / "m")
    rewrite_weights(broken, lambda t: t.pop("model.layers.0.self_attn.k_proj.weight"))
    with pytest.raises(WeightLoadError, match=r"missing tensors 'model\.layers\.0\.self_attn\.k_proj\.weight'"):
        LLM(str(broken), device="cpu")


def test_unexpected_tensor(source, tmp_path):
    broken = copy_checkpoint(source, tmp_path / "u")
    rewrite_weights(broken, lambda t: t.__setitem__("model.layers.0.mlp.extra.weight", torch.zeros(2, 2)))
    with pytest.raises(WeightLoadError, match=r"unexpected tensors 'model\.layers\.0\.mlp\.extra\.weight'"):
        LLM(str(broken), device="cpu")


def test_wrongly_shaped_tensor(source, tmp_path):
    broken = copy_checkpoint(source, tmp_path / "s")
    name = "model.layers.2.self_attn.o_proj.weight"
    rewrite_weights(broken, lambda t: t.__setitem__(name, torch.zeros(3, 5)))
    with pytest.raises(WeightLoadError, match=rf"tensor '{name}' has shape \[3, 5\], expected \[64, 64\]"):
        LLM(str(broken), device="cpu")


def test_duplicate_expert_via_two_spellings(source, tmp_path):
    broken = copy_checkpoint(source, tmp_path / "d")

    def add_fused(t):
        p = "model.layers.0.mlp.experts."
        t[p + "down_proj"] = torch.stack([t[f"{p}{e}.down_proj.weight"] for e in range(8)])

    rewrite_weights(broken, add_fused)
    with pytest.raises(WeightLoadError, match="appears more than once"):
        LLM(str(broken), device="cpu")


@pytest.mark.parametrize("keep", [4, 100, -50])
def test_truncated_file(source, tmp_path, keep):
    broken = copy_checkpoint(source, tmp_path / "t")
    path = broken / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[:keep] if keep > 0 else data[:keep])
    with pytest.raises(CheckpointError, match="model.safetensors"):
        LLM(str(broken), device="cpu")


def test_corrupt_header(source, tmp_path):
    broken = copy_checkpoint(source, tmp_path / "c")
    path = broken / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[8:20] = b"not json!!!!"
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="corrupt safetensors header"):
        LLM(str(broken), device="cpu")


def test_index_listing_a_missing_shard(source, tmp_path):
    broken = copy_checkpoint(source, tmp_path / "i")
    (broken / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"model.norm.weight": "model-00002-of-00002.safetensors"}})
    )
    with pytest.raises(CheckpointError, match="shard model-00002-of-00002.safetensors is listed but missing"):
        LLM(str(broken), device="cpu")


def test_pickle_weights_are_refused(source, tmp_path):
    folder = tmp_path / "p"
    folder.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(source / name, folder / name)
    (folder / "pytorch_model.bin").write_bytes(b"\x80\x04not really a pickle")
    with pytest.raises(CheckpointError, match="moerun reads safetensors only"):
        LLM(str(folder), device="cpu")


def test_unknown_architecture(source, tmp_path):
    broken = copy_checkpoint(source, tmp_path / "a")
    cfg = json.loads((broken / "config.json").read_text())
    cfg["model_type"] = "llama"
    (broken / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"model_type 'llama' is not supported; moerun supports \['qwen3_moe'\]"):
        LLM(str(broken), device="cpu")


def test_impossible_options(source):
    with pytest.raises(ValueError, match="max_model_len 999999 exceeds the model's max_position_embeddings 4096"):
        LLM(str(source), device="cpu", max_model_len=999999)
    with pytest.raises(ValueError, match="unknown dtype 'float8'"):
        LLM(str(source), device="cpu", dtype="float8")
    with pytest.raises(ValueError, match="moe_backend must be 'torch', 'triton' or None"):
        LLM(str(source), device="cpu", moe_backend="cutlass")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        LLM(str(source / "nope"), device="cpu")
    assert SMALL_VOCAB == 1024
