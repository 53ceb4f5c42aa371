"""Tensor names: GGUF (llama.cpp) <-> the Hugging Face names moerun uses as canonical.

Stacked experts have no ``.weight`` suffix on the Hugging Face side (``model.layers.N.mlp.experts.gate_proj``,
shape [E, I, H]); GGUF stores them as ``blk.N.ffn_gate_exps.weight`` with the same torch-order shape. Qwen3-MoE
uses NeoX rotary embeddings, so llama.cpp's converter copies q/k projections without permuting rows and so do we.
"""

from __future__ import annotations

import re

from .reader import GGUFError

GLOBAL_NAMES: dict[str, str] = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}

# per-layer names, without the "blk.N." / "model.layers.N." prefixes
LAYER_NAMES: dict[str, str] = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.bias": "self_attn.o_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "ffn_gate_exps.weight": "mlp.experts.gate_proj",
    "ffn_up_exps.weight": "mlp.experts.up_proj",
    "ffn_down_exps.weight": "mlp.experts.down_proj",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}

_HF_GLOBAL = {v: k for k, v in GLOBAL_NAMES.items()}
_HF_LAYER = {v: k for k, v in LAYER_NAMES.items()}
_GGUF_LAYER = re.compile(r"^blk\.(0|[1-9][0-9]*)\.(.+)$")
_HF_LAYER_RE = re.compile(r"^model\.layers\.(0|[1-9][0-9]*)\.(.+)$")
_HF_EXPERT = re.compile(r"^model\.layers\.(0|[1-9][0-9]*)\.mlp\.experts\.(0|[1-9][0-9]*)\.(gate_proj|up_proj|down_proj)"
                        r"\.weight$")
_HF_FUSED = re.compile(r"^model\.layers\.(0|[1-9][0-9]*)\.mlp\.experts\.gate_up_proj(?:\.weight)?$")


def _known(kind: str) -> str:
    if kind == "gguf":
        names = list(GLOBAL_NAMES) + [f"blk.N.{s}" for s in LAYER_NAMES]
    else:
        names = list(_HF_GLOBAL) + [f"model.layers.N.{s}" for s in _HF_LAYER]
    return ", ".join(names)


def gguf_to_hf(name: str) -> str:
    """The canonical Hugging Face name of a GGUF tensor name (``blk.3.attn_q.weight`` -> ``model.layers.3...``)."""
    if name in GLOBAL_NAMES:
        return GLOBAL_NAMES[name]
    m = _GGUF_LAYER.match(name)
    if m and m[2] in LAYER_NAMES:
        return f"model.layers.{m[1]}.{LAYER_NAMES[m[2]]}"
    raise GGUFError(f"unknown GGUF tensor name {name!r} for qwen3moe; known names: {_known('gguf')}")


def hf_to_gguf(name: str) -> str:
    """The GGUF name of a canonical Hugging Face tensor name; per-expert names must be stacked first."""
    if name in _HF_GLOBAL:
        return _HF_GLOBAL[name]
    m = _HF_LAYER_RE.match(name)
    if m and m[2] in _HF_LAYER:
        return f"blk.{m[1]}.{_HF_LAYER[m[2]]}"
    if _HF_EXPERT.match(name) or _HF_FUSED.match(name):
        raise GGUFError(f"{name!r} is a per-expert or fused expert tensor; stack the layer's experts into "
                        f"model.layers.N.mlp.experts.gate_proj/up_proj/down_proj before mapping")
    raise GGUFError(f"unknown Hugging Face tensor name {name!r} for Qwen3-MoE; known names: {_known('hf')}")


def gguf_layer(name: str) -> int | None:
    """The block index of a GGUF tensor name, or None for global tensors."""
    m = _GGUF_LAYER.match(name)
    return int(m[1]) if m else None


def parse_expert_name(name: str) -> tuple[int, int, str] | None:
    """(layer, expert, 'gate_proj'|'up_proj'|'down_proj') for a per-expert HF name, else None."""
    m = _HF_EXPERT.match(name)
    return (int(m[1]), int(m[2]), m[3]) if m else None


def parse_fused_gate_up(name: str) -> int | None:
    """The layer of a fused ``mlp.experts.gate_up_proj`` HF name ([E, 2I, H], gate rows first), else None."""
    m = _HF_FUSED.match(name)
    return int(m[1]) if m else None
