"""GGUF metadata <-> ModelConfig for the ``qwen3moe`` architecture (keys as llama.cpp's converter writes them).

Facts this follows: llama.cpp's converter does not write ``qwen3moe.expert_weights_norm`` and llama.cpp always
normalises the top-k routing weights for qwen3moe, so a missing key means ``norm_topk_prob=True``; without
``expert_feed_forward_length`` llama.cpp uses ``feed_forward_length / expert_used_count``; a missing
``output.weight`` tensor means the output head is tied to ``token_embd.weight``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from gguf.constants import LlamaFileType

from ...config import ModelConfig, RopeConfig
from .names import gguf_layer
from .reader import GGUFError

if TYPE_CHECKING:
    from .reader import GGUFFile

SUPPORTED_ARCHITECTURES = {"qwen3moe": "Qwen3MoeForCausalLM"}
_GGUF_ARCH = {v: k for k, v in SUPPORTED_ARCHITECTURES.items()}

# token-id keys read into / written from ModelConfig; eos_token_ids is spread over eos, eot and eom
BOS_KEY = "tokenizer.ggml.bos_token_id"
EOS_KEYS = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
PAD_KEY = "tokenizer.ggml.padding_token_id"

_FILE_TYPE_DTYPE = {LlamaFileType.ALL_F32: torch.float32, LlamaFileType.MOSTLY_F16: torch.float16,
                    LlamaFileType.MOSTLY_BF16: torch.bfloat16}
_DTYPE_FILE_TYPE = {v: k for k, v in _FILE_TYPE_DTYPE.items()}


class _Keys:
    """Typed, error-reporting access to one architecture's metadata keys."""

    def __init__(self, md: Mapping[str, Any], arch: str, source: str) -> None:
        self.md, self.arch, self.source = md, arch, source

    def key(self, name: str) -> str:
        return name if name.startswith(("general.", "tokenizer.")) else f"{self.arch}.{name}"

    def get_int(self, name: str, default: int | None = None, *, required: bool = False) -> int | None:
        k = self.key(name)
        if k not in self.md:
            if required:
                raise GGUFError(f"{self.source}: missing required metadata key {k!r} for architecture {self.arch!r}")
            return default
        v = self.md[k]
        if isinstance(v, (list, np.ndarray)):
            # llama.cpp allows per-layer arrays for some counts; moerun needs one value for all layers
            values = {int(x) for x in v}
            if len(values) != 1:
                raise GGUFError(f"{self.source}: metadata {k!r} varies per layer ({sorted(values)[:8]}...); moerun "
                                f"supports one value for all layers")
            v = values.pop()
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
            raise GGUFError(f"{self.source}: metadata {k!r} is {v!r}; expected an integer")
        return int(v)

    def get_float(self, name: str, default: float | None = None, *, required: bool = False) -> float | None:
        k = self.key(name)
        if k not in self.md:
            if required:
                raise GGUFError(f"{self.source}: missing required metadata key {k!r} for architecture {self.arch!r}")
            return default
        v = self.md[k]
        if isinstance(v, bool) or not isinstance(v, (int, float, np.floating, np.integer)):
            raise GGUFError(f"{self.source}: metadata {k!r} is {v!r}; expected a number")
        v = float(v)
        if float(np.float32(v)) == v:
            # GGUF stores these as float32: take the shortest decimal that round-trips (1e-6, not 9.99999997e-07)
            v = float(str(np.float32(v)))
        return v

    def get_bool(self, name: str, default: bool) -> bool:
        k = self.key(name)
        v = self.md.get(k, default)
        if not isinstance(v, (bool, np.bool_)):
            raise GGUFError(f"{self.source}: metadata {k!r} is {v!r}; expected a bool")
        return bool(v)

    def get_str(self, name: str, default: str | None = None) -> str | None:
        k = self.key(name)
        v = self.md.get(k, default)
        if v is not None and not isinstance(v, str):
            raise GGUFError(f"{self.source}: metadata {k!r} is {v!r}; expected a string")
        return v


def gguf_architecture(metadata: Mapping[str, Any], source: str) -> str:
    """``general.architecture``, checked against the architectures moerun supports."""
    arch = metadata.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise GGUFError(f"{source}: architecture {arch!r} is not supported; moerun supports "
                        f"{sorted(SUPPORTED_ARCHITECTURES)} ({', '.join(SUPPORTED_ARCHITECTURES.values())})")
    return arch


def model_config_from_gguf(metadata: Mapping[str, Any], source: str,
                           tensor_names: Iterable[str] | None = None) -> ModelConfig:
    """ModelConfig from GGUF metadata; ``tensor_names`` decides tied embeddings, attention bias and dense layers."""
    k = _Keys(metadata, gguf_architecture(metadata, source), source)
    try:
        return _config(k, set(tensor_names) if tensor_names is not None else None)
    except GGUFError:
        raise
    except ValueError as exc:  # ModelConfig / RopeConfig validation
        raise GGUFError(f"{source}: {exc}") from None


def _config(k: _Keys, names: set[str] | None) -> ModelConfig:
    src, arch = k.source, k.arch
    hidden = k.get_int("embedding_length", required=True)
    heads = k.get_int("attention.head_count", required=True)
    if not heads:
        raise GGUFError(f"{src}: metadata {k.key('attention.head_count')!r} is 0; expected a positive head count")
    head_dim = k.get_int("attention.key_length", hidden // heads)
    value_dim = k.get_int("attention.value_length", head_dim)
    if value_dim != head_dim:
        raise GGUFError(f"{src}: attention.key_length {head_dim} != attention.value_length {value_dim}; "
                        f"moerun needs equal key and value head sizes")
    rot = k.get_int("rope.dimension_count", head_dim)
    if rot != head_dim:
        raise GGUFError(f"{src}: rope.dimension_count {rot} != head size {head_dim}; partial rotary embeddings "
                        f"are not supported for {arch}")
    experts = k.get_int("expert_count", required=True)
    used = k.get_int("expert_used_count", required=True)
    if not experts or not used:
        raise GGUFError(f"{src}: {arch} needs expert_count and expert_used_count > 0, found {experts} and {used}")
    ff = k.get_int("feed_forward_length", 0)
    moe_ff = k.get_int("expert_feed_forward_length")
    if moe_ff is None:
        if not ff:
            raise GGUFError(f"{src}: missing required metadata key {k.key('expert_feed_forward_length')!r} "
                            f"(and no {k.key('feed_forward_length')!r} to derive it from)")
        moe_ff = ff // used  # what llama.cpp assumes when the key is absent
    ctx = k.get_int("context_length", required=True)
    dense_layers: set[int] = set()
    if names is not None:
        dense_layers = {gguf_layer(n) for n in names if n.endswith(".ffn_down.weight")} - {None}  # type: ignore
    return ModelConfig(
        architecture=SUPPORTED_ARCHITECTURES[arch],
        vocab_size=_vocab_size(k),
        hidden_size=hidden,
        num_layers=k.get_int("block_count", required=True),
        num_heads=heads,
        num_kv_heads=k.get_int("attention.head_count_kv", heads),
        head_dim=head_dim,
        intermediate_size=ff,
        moe_intermediate_size=moe_ff,
        num_experts=experts,
        num_experts_per_tok=used,
        norm_topk_prob=k.get_bool("expert_weights_norm", True),
        rms_norm_eps=k.get_float("attention.layer_norm_rms_epsilon", required=True),
        max_position_embeddings=ctx,
        rope=_rope(k, ctx),
        tie_word_embeddings=names is not None and "output.weight" not in names,
        attention_bias=names is not None and "blk.0.attn_q.bias" in names,
        mlp_only_layers=tuple(sorted(dense_layers)),
        dtype=_FILE_TYPE_DTYPE.get(k.get_int("general.file_type"), torch.bfloat16),  # quantized: compute in bf16
        bos_token_id=k.get_int(BOS_KEY),
        eos_token_ids=tuple(dict.fromkeys(i for i in (k.get_int(key) for key in EOS_KEYS) if i is not None)),
        pad_token_id=k.get_int(PAD_KEY),
    )


def model_config_from_file(f: "GGUFFile") -> ModelConfig:
    """ModelConfig of an open GGUF file, using its tensor names."""
    return model_config_from_gguf(f.metadata, str(f.path), f.tensors.keys())


def _vocab_size(k: _Keys) -> int:
    tokens = k.md.get("tokenizer.ggml.tokens")
    if tokens is not None:
        return len(tokens)
    size = k.get_int("vocab_size")
    if size is None:
        raise GGUFError(f"{k.source}: cannot tell the vocabulary size: neither 'tokenizer.ggml.tokens' nor "
                        f"{k.key('vocab_size')!r} is present")
    return size


def _rope(k: _Keys, ctx: int) -> RopeConfig:
    theta = k.get_float("rope.freq_base", 10000.0)
    kind = k.get_str("rope.scaling.type", "none")
    if kind == "none":
        return RopeConfig(theta=theta)
    if kind != "yarn":
        raise GGUFError(f"{k.source}: {k.key('rope.scaling.type')!r} is {kind!r}; moerun supports 'none' and 'yarn'")
    factor = k.get_float("rope.scaling.factor", required=True)
    if not factor or factor <= 0:
        raise GGUFError(f"{k.source}: {k.key('rope.scaling.factor')!r} is {factor}; expected a positive factor")
    return RopeConfig(
        theta=theta,
        kind="yarn",
        factor=factor,
        original_max_position=k.get_int("rope.scaling.original_context_length", int(ctx / factor)),
        beta_fast=k.get_float("rope.scaling.yarn_beta_fast", 32.0),
        beta_slow=k.get_float("rope.scaling.yarn_beta_slow", 1.0),
        attention_factor=k.get_float("rope.scaling.yarn_attn_factor"),
    )


def gguf_metadata_for(config: ModelConfig) -> dict[str, Any]:
    """GGUF metadata for a ModelConfig: ints are written as UINT32, floats as FLOAT32, bools as BOOL.

    Not representable and so not written: RoPE ``mscale``/``mscale_all_dim``/``truncate`` (unused by Qwen3),
    and dense layers, which GGUF expresses by the tensors present.
    """
    arch = _GGUF_ARCH.get(config.architecture)
    if arch is None:
        raise ValueError(f"cannot write GGUF metadata for architecture {config.architecture!r}; supported: "
                         f"{sorted(_GGUF_ARCH)}")
    if len(config.eos_token_ids) > len(EOS_KEYS):
        raise ValueError(f"GGUF holds at most {len(EOS_KEYS)} end-of-generation ids ({', '.join(EOS_KEYS)}); "
                         f"config has {config.eos_token_ids}")
    a = f"{arch}."
    md: dict[str, Any] = {
        "general.architecture": arch,
        a + "vocab_size": config.vocab_size,
        a + "block_count": config.num_layers,
        a + "context_length": config.max_position_embeddings,
        a + "embedding_length": config.hidden_size,
        a + "feed_forward_length": config.intermediate_size,
        a + "expert_feed_forward_length": config.moe_intermediate_size,
        a + "expert_count": config.num_experts,
        a + "expert_used_count": config.num_experts_per_tok,
        a + "expert_weights_norm": config.norm_topk_prob,
        a + "attention.head_count": config.num_heads,
        a + "attention.head_count_kv": config.num_kv_heads,
        a + "attention.key_length": config.head_dim,
        a + "attention.value_length": config.head_dim,
        a + "attention.layer_norm_rms_epsilon": float(config.rms_norm_eps),
        a + "rope.freq_base": float(config.rope.theta),
    }
    if config.rope.kind == "yarn":
        md[a + "rope.scaling.type"] = "yarn"
        md[a + "rope.scaling.factor"] = float(config.rope.factor)
        if config.rope.original_max_position is not None:
            md[a + "rope.scaling.original_context_length"] = config.rope.original_max_position
        md[a + "rope.scaling.yarn_beta_fast"] = float(config.rope.beta_fast)
        md[a + "rope.scaling.yarn_beta_slow"] = float(config.rope.beta_slow)
        if config.rope.attention_factor is not None:
            md[a + "rope.scaling.yarn_attn_factor"] = float(config.rope.attention_factor)
    if config.dtype in _DTYPE_FILE_TYPE:
        md["general.file_type"] = int(_DTYPE_FILE_TYPE[config.dtype])
    if config.bos_token_id is not None:
        md[BOS_KEY] = config.bos_token_id
    for key, tid in zip(EOS_KEYS, config.eos_token_ids):
        md[key] = tid
    if config.pad_token_id is not None:
        md[PAD_KEY] = config.pad_token_id
    return md
