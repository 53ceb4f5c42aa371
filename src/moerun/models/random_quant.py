"""Random quantized models: a GGUF file type's mix of quant types (llama.cpp's rules, formats/gguf/type_mix.py)
filled with random valid blocks (kernels/quant/synthetic.py), generated on the device tensor by tensor.

Tensors go where a GGUF file's would (models/gguf_checkpoint.py): the GGUF name maps to a parameter and its rows,
block-quantized tensors become QuantizedWeights inside the layers, float ones (norms, the router) dense
parameters. On CUDA each weight is repacked for the kernels as soon as it is made and its GGUF blocks are dropped
(except the embedding table's, whose rows are looked up), so the device holds about the file's size.
"""

from __future__ import annotations

from collections import defaultdict

import torch
from torch import nn

from moerun.config import ModelConfig
from moerun.formats.gguf.names import gguf_layer, gguf_to_hf
from moerun.formats.gguf.type_mix import FILE_TYPES, READ_ONLY_FILE_TYPES, tensor_type
from moerun.formats.quants import QuantizedTensor, QuantType
from moerun.layers.embedding import Embedding
from moerun.layers.linear import shard_index_fn
from moerun.layers.quantized import QuantizedWeight, set_quantized
from moerun.models.registry import get_model_class

# File types whose tensors are mostly block-quantized (the float ones would give a dense model), those moerun
# writes and those it only reads.
QUANT_FILE_TYPES = tuple(name for name in (*FILE_TYPES, *READ_ONLY_FILE_TYPES) if name not in ("F32", "F16", "BF16"))
_FLOAT_DTYPES = {QuantType.F32: torch.float32, QuantType.F16: torch.float16, QuantType.BF16: torch.bfloat16}


def gguf_tensor_shapes(config: ModelConfig) -> list[tuple[str, tuple[int, ...]]]:
    """Every tensor of a qwen3moe GGUF of this config: (GGUF name, torch-order shape)."""
    H, D, V = config.hidden_size, config.head_dim, config.vocab_size
    nq, nkv, E = config.num_heads * D, config.num_kv_heads * D, config.num_experts
    I, dense_i = config.moe_intermediate_size, config.intermediate_size  # noqa: E741
    out = [("token_embd.weight", (V, H)), ("output_norm.weight", (H,))]
    if not config.tie_word_embeddings:
        out.append(("output.weight", (V, H)))
    for i in range(config.num_layers):
        b = f"blk.{i}."
        out += [(b + "attn_norm.weight", (H,)), (b + "ffn_norm.weight", (H,)), (b + "attn_q.weight", (nq, H)),
                (b + "attn_k.weight", (nkv, H)), (b + "attn_v.weight", (nkv, H)), (b + "attn_output.weight", (H, nq)),
                (b + "attn_q_norm.weight", (D,)), (b + "attn_k_norm.weight", (D,))]  # fmt: skip
        if config.attention_bias:
            out += [(b + "attn_q.bias", (nq,)), (b + "attn_k.bias", (nkv,)), (b + "attn_v.bias", (nkv,)),
                    (b + "attn_output.bias", (H,))]  # fmt: skip
        if config.is_moe_layer(i):
            out += [(b + "ffn_gate_inp.weight", (E, H)), (b + "ffn_gate_exps.weight", (E, I, H)),
                    (b + "ffn_up_exps.weight", (E, I, H)), (b + "ffn_down_exps.weight", (E, H, I))]  # fmt: skip
        else:
            out += [(b + "ffn_gate.weight", (dense_i, H)), (b + "ffn_up.weight", (dense_i, H)),
                    (b + "ffn_down.weight", (H, dense_i))]  # fmt: skip
    return out


def tensor_types(config: ModelConfig, ftype: str) -> dict[str, QuantType]:
    """GGUF name -> the quant type llama.cpp's mix gives it in a file of type ftype (e.g. 'Q4_K_M')."""
    if ftype.upper() not in QUANT_FILE_TYPES:
        raise ValueError(f"unknown quantized file type {ftype!r}; choose one of {', '.join(QUANT_FILE_TYPES)}")
    c = config
    return {name: QuantType(int(tensor_type(name, shape, ftype.upper(), gguf_layer(name), c.num_layers,
                                            c.num_experts, n_gqa=c.num_heads // c.num_kv_heads,
                                            tied_embeddings=c.tie_word_embeddings)))
            for name, shape in gguf_tensor_shapes(config)}  # fmt: skip


@torch.no_grad()
def random_quantized_model(config: ModelConfig, device: torch.device, ftype: str = "Q4_K_M", seed: int = 0,
                           moe_backend: str | None = None) -> nn.Module:
    """The model with ftype's quant type per tensor and random valid blocks, built on `device` (norms 1, router
    normal(0, 1/sqrt(H)), float matrices normal(0, 0.02)); on CUDA the weights are kept repacked only."""
    from moerun.ops.quant import pack_model, pack_weight

    device = torch.device(device)
    types = tensor_types(config, ftype)
    shapes = dict(gguf_tensor_shapes(config))
    with torch.device("meta"):
        model = get_model_class(config.architecture)(config, moe_backend=moe_backend)
    model = model.to(dtype=config.dtype)
    sources: dict[str, list[tuple[object, str]]] = defaultdict(list)  # parameter -> [(shard id, GGUF name)]
    for name in shapes:
        target = model.map_checkpoint_name(gguf_to_hf(name))
        if target is not None:
            sources[target[0]].append((target[1], name))
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    tied = config.tie_word_embeddings
    for pname, param in list(model.named_parameters()):
        module_name, _, attr = pname.rpartition(".")
        module = model.get_submodule(module_name)
        parts = sources[pname]
        if any(types[n].is_quantized for _, n in parts):
            weight = _quantized_weight(module, attr, parts, shapes, types, device, g)
            set_quantized(module, attr, weight)
            module.__dict__["compute_dtype"] = config.dtype
            if device.type == "cuda" and not isinstance(module, Embedding):  # tables: pack_model below
                pack_weight(weight, release_blocks=True)  # at once, so that the blocks never pile up
        else:
            setattr(module, attr, nn.Parameter(_dense(pname, param.shape, config, device, g), requires_grad=False))
    if tied:
        q = model.model.embed_tokens.__dict__.get("q_weight")
        if q is not None:
            set_quantized(model.lm_head, "weight", q)
        else:
            model.lm_head.weight = model.model.embed_tokens.weight
    if device.type == "cuda":
        pack_model(model, release_blocks=True)  # the embedding table (and a tied head), which the loop left
    return model.eval()


def _dense(pname: str, shape: torch.Size, config: ModelConfig, device: torch.device,
           g: torch.Generator) -> torch.Tensor:
    """A float parameter as models/random_init.py initialises it."""
    t = torch.empty(shape, dtype=config.dtype, device=device)
    if pname.endswith("norm.weight"):
        return t.fill_(1.0)
    if pname.endswith("mlp.gate.weight"):
        return t.normal_(0.0, 1.0 / config.hidden_size**0.5, generator=g)  # the router
    return t.normal_(0.0, 0.02, generator=g)


def _quantized_weight(module: nn.Module, attr: str, parts: list[tuple[object, str]],
                      shapes: dict[str, tuple[int, ...]], types: dict[str, QuantType], device: torch.device,
                      g: torch.Generator) -> QuantizedWeight:
    """Random blocks for each GGUF tensor of one parameter, ordered by the rows they fill."""
    from moerun.kernels.quant.synthetic import random_quantized

    index_of = shard_index_fn(module, attr)
    placed = []
    for shard, name in parts:
        rows = index_of(shard)
        start = (rows[-1].start or 0) if rows else 0
        placed.append((start, name))
    qparts = []
    for _, name in sorted(placed):
        qt, shape = types[name], shapes[name]
        if qt in _FLOAT_DTYPES:  # a row length no block type divides: llama.cpp stores it as a float
            dense = torch.empty(shape, dtype=_FLOAT_DTYPES[qt], device=device).normal_(0.0, 0.02, generator=g)
            qparts.append(QuantizedTensor(dense.view(torch.uint8).reshape(-1), qt, shape, name))
        else:
            t = random_quantized(qt, shape, device, g)
            qparts.append(QuantizedTensor(t.raw, qt, shape, name))
    return QuantizedWeight(qparts)
