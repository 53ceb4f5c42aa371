"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B), as transformers' ``Qwen3MoeForCausalLM`` defines it.

Checkpoint tensors keep their Hugging Face names except where moerun fuses: q|k|v into ``qkv_proj``, a dense
layer's gate|up into ``gate_up_proj``, and each layer's experts into ``experts.w13`` [E, 2I, H] / ``w2`` [E, H, I].
"""

from __future__ import annotations

import re

import torch
from torch import nn

from moerun.config import ModelConfig
from moerun.engine.batch import ForwardBatch
from moerun.engine.kv_cache import KVCache
from moerun.layers.attention import Qwen3Attention
from moerun.layers.embedding import Embedding
from moerun.layers.linear import Linear
from moerun.layers.mlp import GatedMLP
from moerun.layers.norm import RMSNorm
from moerun.layers.rotary import RotaryEmbedding
from moerun.moe.block import SparseMoeBlock


class Qwen3MoeDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, rotary: RotaryEmbedding, moe_backend: str | None):
        super().__init__()
        self.self_attn = Qwen3Attention(config, layer, rotary)
        if config.is_moe_layer(layer):
            self.mlp: nn.Module = SparseMoeBlock(config, layer, moe_backend)
        else:
            self.mlp = GatedMLP(config.hidden_size, config.intermediate_size)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, batch: ForwardBatch, cache: KVCache
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (this layer's output before the residual add, the residual stream so far)."""
        # Each norm is fused into the op after it where a kernel exists (decode: q|k|v GEMV, router).
        moe = self.mlp if isinstance(self.mlp, SparseMoeBlock) else None
        post_norm, o_proj = self.post_attention_layernorm, self.self_attn.o_proj
        if moe is not None and moe.routes_in_o_proj(x if residual is None else residual, o_proj, post_norm):
            # o_proj and the router in one launch, the norm inside the experts' GEMM 1
            a, residual = self.self_attn.forward_fused_norm(x, residual, self.input_layernorm, batch, cache,
                                                            project=False)  # fmt: skip
            return moe.forward_from_attention(a, residual, o_proj, post_norm)
        h, residual = self.self_attn.forward_fused_norm(x, residual, self.input_layernorm, batch, cache)
        if moe is not None:
            return moe.forward_fused_norm(h, residual, post_norm)
        h, residual = self.post_attention_layernorm.forward_with_residual(h, residual)
        return self.mlp(h), residual


class Qwen3MoeModel(nn.Module):
    def __init__(self, config: ModelConfig, moe_backend: str | None):
        super().__init__()
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size)
        rotary = RotaryEmbedding(config.rope, config.head_dim, config.max_position_embeddings)
        self.layers = nn.ModuleList(
            Qwen3MoeDecoderLayer(config, i, rotary, moe_backend) for i in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, batch: ForwardBatch, cache: KVCache) -> torch.Tensor:
        x = self.embed_tokens(input_ids)  # [T, H]
        residual = None
        for layer in self.layers:
            x, residual = layer(x, residual, batch, cache)
        x, _ = self.norm.forward_with_residual(x, residual)
        return x


_LAYER = r"model\.layers\.(\d+)\."
_RULES: list[tuple[re.Pattern[str], str, object]] = [
    (re.compile(_LAYER + r"self_attn\.([qkv])_proj\.(weight|bias)$"), r"model.layers.\1.self_attn.qkv_proj.\3", 2),
    (re.compile(_LAYER + r"mlp\.(gate|up)_proj\.weight$"), r"model.layers.\1.mlp.gate_up_proj.weight", 2),
    (re.compile(_LAYER + r"mlp\.experts\.(\d+)\.(gate|up)_proj\.weight$"), r"model.layers.\1.mlp.experts.w13",
     "expert"),
    (re.compile(_LAYER + r"mlp\.experts\.(\d+)\.down_proj\.weight$"), r"model.layers.\1.mlp.experts.w2", "expert"),
    (re.compile(_LAYER + r"mlp\.experts\.(gate_up|gate|up)_proj(?:\.weight)?$"), r"model.layers.\1.mlp.experts.w13",
     "stacked"),
    (re.compile(_LAYER + r"mlp\.experts\.(down)_proj(?:\.weight)?$"), r"model.layers.\1.mlp.experts.w2", "stacked"),
]


class Qwen3MoeForCausalLM(nn.Module):
    """input_ids [T] + batch metadata -> hidden states [T, H]; ``compute_logits`` applies the output head."""

    def __init__(self, config: ModelConfig, moe_backend: str | None = None) -> None:
        super().__init__()
        self.config = config
        self.model = Qwen3MoeModel(config, moe_backend)
        self.lm_head = Linear(config.hidden_size, config.vocab_size)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, batch: ForwardBatch, cache: KVCache) -> torch.Tensor:
        return self.model(input_ids, batch, cache)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)  # [N, V]

    def moe_blocks(self) -> list[SparseMoeBlock]:
        return [layer.mlp for layer in self.model.layers if isinstance(layer.mlp, SparseMoeBlock)]

    # ---- checkpoint names ----
    def map_checkpoint_name(self, name: str) -> tuple[str, object] | None:
        """Checkpoint tensor name -> (parameter name, shard id); None for a tensor to skip (tied lm_head)."""
        if (name == "lm_head.weight" and self.config.tie_word_embeddings) or name.endswith("rotary_emb.inv_freq"):
            return None
        for pattern, target, kind in _RULES:
            m = pattern.match(name)
            if not m:
                continue
            param = m.expand(target)
            if kind == 2:
                return param, m.group(2)
            if kind == "expert":
                part = m.group(3) if m.re.groups >= 3 else "down"
                return param, (int(m.group(2)), part)
            return param, (None, m.group(2))
        return name, None

    def checkpoint_name_for(self, param: str, index: tuple[int, ...]) -> str:
        """The Hugging Face name of the checkpoint tensor that fills ``param`` at ``index`` (for error messages)."""
        m = re.match(r"model\.layers\.(\d+)\.mlp\.experts\.(w13|w2)$", param)
        if m:
            layer, which = m.groups()
            expert = index[0]
            if which == "w2":
                part = "down"
            else:
                part = "gate" if index[1] < self.config.moe_intermediate_size else "up"
            return f"model.layers.{layer}.mlp.experts.{expert}.{part}_proj.weight"
        m = re.match(r"(model\.layers\.\d+\.self_attn)\.qkv_proj\.(weight|bias)$", param)
        if m:
            D, nq = self.config.head_dim, self.config.num_heads
            row = index[0]
            part = "q" if row < nq * D else ("k" if row < (nq + self.config.num_kv_heads) * D else "v")
            return f"{m.group(1)}.{part}_proj.{m.group(2)}"
        m = re.match(r"(model\.layers\.\d+\.mlp)\.gate_up_proj\.weight$", param)
        if m:
            part = "gate" if index[0] < self.config.intermediate_size else "up"
            return f"{m.group(1)}.{part}_proj.weight"
        return param
