"""Configuration: the model's shape (ModelConfig) and how the engine runs it (EngineConfig).

ModelConfig is read from a Hugging Face ``config.json`` in both spellings found in the wild (the published
Qwen3 checkpoints: ``num_experts``, ``rope_theta``, ``rope_scaling``, ``torch_dtype``; transformers 5:
``num_local_experts``, ``rope_parameters``, ``dtype``) or built from GGUF metadata.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

SUPPORTED_MODEL_TYPES = {"qwen3_moe": "Qwen3MoeForCausalLM"}

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


def parse_dtype(value: str | torch.dtype | None) -> torch.dtype | None:
    """'bfloat16' / 'bf16' / torch.bfloat16 -> torch.bfloat16; None stays None."""
    if value is None or isinstance(value, torch.dtype):
        return value
    key = str(value).lower().removeprefix("torch.")
    if key not in _DTYPES:
        raise ValueError(f"unknown dtype {value!r}; expected one of float32, float16, bfloat16")
    return _DTYPES[key]


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding: NeoX-style halves; ``kind`` is 'default' or 'yarn'."""

    theta: float = 10000.0
    kind: str = "default"
    factor: float = 1.0
    original_max_position: int | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True

    def __post_init__(self) -> None:
        if self.kind not in ("default", "yarn"):
            raise ValueError(f"unsupported rope type {self.kind!r}; moerun supports 'default' and 'yarn'")
        if self.theta <= 0:
            raise ValueError(f"rope_theta must be positive, got {self.theta}")
        if self.kind == "yarn" and self.factor <= 0:
            raise ValueError(f"yarn rope factor must be positive, got {self.factor}")


@dataclass(frozen=True)
class ModelConfig:
    """The shape of a Qwen3-MoE model. H hidden, E experts, k experts per token, I expert intermediate."""

    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int  # dense MLP layers
    moe_intermediate_size: int  # I
    num_experts: int  # E
    num_experts_per_tok: int  # k
    norm_topk_prob: bool
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeConfig = field(default_factory=RopeConfig)
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    dtype: torch.dtype = torch.bfloat16
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None

    def __post_init__(self) -> None:
        positive = ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                    "max_position_embeddings", "decoder_sparse_step")
        for name in positive:
            if getattr(self, name) <= 0:
                raise ValueError(f"model config: {name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads != 0:
            raise ValueError(
                f"model config: num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )
        if self.num_experts > 0 and not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(
                f"model config: num_experts_per_tok ({self.num_experts_per_tok}) must be in "
                f"[1, num_experts={self.num_experts}]"
            )
        if self.head_dim % 2:
            raise ValueError(f"model config: head_dim must be even for rotary embeddings, got {self.head_dim}")

    def is_moe_layer(self, layer: int) -> bool:
        """True where the layer holds experts (as transformers decides it), False for a dense MLP layer."""
        return (
            layer not in self.mlp_only_layers
            and self.num_experts > 0
            and (layer + 1) % self.decoder_sparse_step == 0
        )

    @property
    def moe_layers(self) -> list[int]:
        return [i for i in range(self.num_layers) if self.is_moe_layer(i)]

    def with_dtype(self, dtype: torch.dtype) -> "ModelConfig":
        return replace(self, dtype=dtype)

    # ---- parameter accounting (for inspect, bench and offload planning) ----
    def expert_params_per_layer(self) -> int:
        return self.num_experts * 3 * self.hidden_size * self.moe_intermediate_size

    def param_counts(self) -> dict[str, int]:
        """Parameter counts: total, experts, non-expert, and active per token."""
        H, D = self.hidden_size, self.head_dim
        attn = H * D * (self.num_heads + 2 * self.num_kv_heads) + self.num_heads * D * H + 2 * D
        if self.attention_bias:
            attn += D * (self.num_heads + 2 * self.num_kv_heads)
        norms = 2 * H
        n_moe = len(self.moe_layers)
        n_dense = self.num_layers - n_moe
        experts = n_moe * self.expert_params_per_layer()
        router = n_moe * self.num_experts * H
        dense_mlp = n_dense * 3 * H * self.intermediate_size
        embed = self.vocab_size * H
        head = 0 if self.tie_word_embeddings else self.vocab_size * H
        non_expert = self.num_layers * (attn + norms) + router + dense_mlp + embed + head + H
        active_experts = n_moe * self.num_experts_per_tok * 3 * H * self.moe_intermediate_size
        # a token reads one embedding row but the whole output head (tied or not)
        active = non_expert - embed - head + self.vocab_size * H + active_experts
        return {"total": non_expert + experts, "experts": experts, "non_expert": non_expert, "active": active}

    # ---- reading ----
    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any], source: str = "config.json") -> "ModelConfig":
        """Build from a Hugging Face config dict, in either the published or the transformers-5 spelling."""
        model_type = cfg.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"{source}: model_type {model_type!r} is not supported; moerun supports "
                f"{sorted(SUPPORTED_MODEL_TYPES)} ({', '.join(SUPPORTED_MODEL_TYPES.values())})"
            )
        archs = cfg.get("architectures") or [SUPPORTED_MODEL_TYPES[model_type]]
        if SUPPORTED_MODEL_TYPES[model_type] not in archs:
            raise ValueError(
                f"{source}: architectures {archs} are not supported; expected {SUPPORTED_MODEL_TYPES[model_type]}"
            )
        if cfg.get("use_sliding_window"):
            raise ValueError(f"{source}: use_sliding_window=true is not supported by moerun")
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"{source}: hidden_act {act!r} is not supported; Qwen3-MoE uses 'silu'")

        def need(*names: str) -> Any:
            for n in names:
                if n in cfg and cfg[n] is not None:
                    return cfg[n]
            raise ValueError(f"{source}: missing required key {' or '.join(repr(n) for n in names)}")

        hidden = int(need("hidden_size"))
        heads = int(need("num_attention_heads"))
        num_experts = int(cfg.get("num_experts", cfg.get("num_local_experts", 0)) or 0)
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        dtype = parse_dtype(cfg.get("dtype") or cfg.get("torch_dtype") or "bfloat16")
        max_pos = int(cfg.get("max_position_embeddings", 32768))
        return cls(
            architecture=SUPPORTED_MODEL_TYPES[model_type],
            vocab_size=int(need("vocab_size")),
            hidden_size=hidden,
            num_layers=int(need("num_hidden_layers")),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            intermediate_size=int(cfg.get("intermediate_size", 0) or 0),
            moe_intermediate_size=int(cfg.get("moe_intermediate_size", 0) or 0),
            num_experts=num_experts,
            num_experts_per_tok=int(cfg.get("num_experts_per_tok", 1)),
            norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=max_pos,
            rope=_rope_from_hf(cfg, max_pos, source),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", False)),
            decoder_sparse_step=int(cfg.get("decoder_sparse_step", 1) or 1),
            mlp_only_layers=tuple(int(i) for i in (cfg.get("mlp_only_layers") or ())),
            dtype=dtype or torch.bfloat16,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=tuple(int(i) for i in eos_ids),
            pad_token_id=cfg.get("pad_token_id"),
        )

    @classmethod
    def from_json_file(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise FileNotFoundError(f"no config.json at {path}") from None
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: not valid JSON ({exc})") from None
        if not isinstance(data, dict):
            raise ValueError(f"{path}: expected a JSON object, found {type(data).__name__}")
        return cls.from_hf_dict(data, source=str(path))


def _rope_from_hf(cfg: dict[str, Any], max_pos: int, source: str) -> RopeConfig:
    params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type", "default")) or "default"
    if kind == "default":
        return RopeConfig(theta=theta)
    if kind != "yarn":
        raise ValueError(f"{source}: rope type {kind!r} is not supported; moerun supports 'default' and 'yarn'")
    orig = params.get("original_max_position_embeddings", cfg.get("original_max_position_embeddings", max_pos))
    factor = params.get("factor")
    factor = float(factor) if factor is not None else max_pos / float(orig)
    return RopeConfig(
        theta=theta,
        kind="yarn",
        factor=factor,
        original_max_position=int(orig),
        beta_fast=float(params.get("beta_fast") or 32.0),
        beta_slow=float(params.get("beta_slow") or 1.0),
        mscale=params.get("mscale"),
        mscale_all_dim=params.get("mscale_all_dim"),
        attention_factor=params.get("attention_factor"),
        truncate=bool(params.get("truncate", True)),
    )


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


@dataclass(frozen=True)
class EngineConfig:
    """How the engine runs a model: device, dtype, context and batch limits, MoE backend."""

    device: torch.device
    dtype: torch.dtype
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int = 8192
    moe_backend: str | None = None
    seed: int | None = None
    cuda_graphs: bool = True
    # launch each decode step before reading the previous one's tokens; None: on where decode is graphed
    async_scheduling: bool | None = None

    def __post_init__(self) -> None:
        if self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.moe_backend not in (None, "torch", "triton"):
            raise ValueError(f"moe_backend must be 'torch', 'triton' or None, got {self.moe_backend!r}")
