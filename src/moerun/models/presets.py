"""Named model shapes (config.json dicts) for benchmarks and tuning: the real Qwen3-MoE sizes and a tiny one."""

from __future__ import annotations

from typing import Any

from moerun.models.tiny import tiny_config

_QWEN3_COMMON: dict[str, Any] = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "vocab_size": 151936,
    "head_dim": 128,
    "num_key_value_heads": 4,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 40960,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "hidden_act": "silu",
    "use_sliding_window": False,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "torch_dtype": "bfloat16",
}

PRESETS: dict[str, dict[str, Any]] = {
    "qwen3-30b-a3b": {**_QWEN3_COMMON, "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768,
                      "num_hidden_layers": 48, "num_attention_heads": 32},
    "qwen3-235b-a22b": {**_QWEN3_COMMON, "hidden_size": 4096, "intermediate_size": 12288,
                        "moe_intermediate_size": 1536, "num_hidden_layers": 94, "num_attention_heads": 64},
    "tiny": tiny_config(),
}


def preset_config(name: str, layers: int | None = None) -> dict[str, Any]:
    """The config dict of a preset, optionally with fewer layers (to fit a large shape on one GPU)."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
    cfg = dict(PRESETS[name])
    if layers is not None:
        if layers < 1:
            raise ValueError(f"--layers must be >= 1, got {layers}")
        cfg["num_hidden_layers"] = layers
    return cfg
