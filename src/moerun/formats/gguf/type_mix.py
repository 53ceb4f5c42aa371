"""Per-tensor quantization type for a file type (``--type Q4_K_M`` ...), following llama.cpp's type mix.

The rules are those of ``llama_tensor_get_type`` in llama.cpp's ``src/llama-quant.cpp`` for the file types moerun
writes (no importance matrix, no manual overrides), plus the converter's rule that tensors which are not quantized
(1-D tensors, norms, biases, the MoE router ``ffn_gate_inp``) are stored as F32:

* ``output.weight`` (and ``token_embd.weight`` when the head is tied): Q6_K for every quantized type except Q8_0,
  Q8_0 when the row length is not a multiple of the type's block.
* ``attn_v``: Q2_K -> Q4_K if n_head/n_head_kv >= 4 else Q3_K; Q3_K_M -> Q5_K on the first two layers, Q4_K
  after; Q4_K_M / Q5_K_M -> Q6_K on the ``use_more_bits`` layers; with exactly 8 experts always Q8_0.
* ``attn_k``: Q8_0 with exactly 8 experts.
* ``ffn_down`` (dense and ``_exps``): Q2_K -> Q3_K; Q3_K_M -> Q5_K for layers < n/16, Q4_K after;
  Q4_K_M / Q5_K_M -> Q6_K on the ``use_more_bits`` layers.
* ``attn_output``: with exactly 8 experts Q5_K for Q2_K / Q3_K_M / Q4_K_M; otherwise Q2_K -> Q3_K,
  Q3_K_M -> Q4_K.
* IQ4_NL / IQ4_XS: ``attn_v`` Q5_K if n_head/n_head_kv >= 4, ``ffn_down`` Q5_K for layers < n/8 (the rule
  without an importance matrix), ``attn_output`` Q5_K with exactly 8 experts.
* Row-length fallback (ggml rows must be whole blocks): Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0, Q2_K, Q3_K,
  IQ4_XS and the grid types -> IQ4_NL, TQ1_0/TQ2_0 -> Q4_0, and F16 when even that does not fit.

* TQ1_0 / TQ2_0: ``token_embd`` Q4_K; MXFP4_MOE: the stacked experts MXFP4, every other matrix Q8_0.
* IQ3_S / IQ3_M / IQ3_XS (default IQ3_S): ``attn_v`` Q4_K (IQ3_S, IQ3_XS: when n_head/n_head_kv >= 4); IQ3_M
  ``attn_output`` Q4_K and ``ffn_down`` Q4_K on the first eighth (and the ``use_more_bits`` layers with 8 experts);
  IQ3_XS ``attn_q``, ``attn_k`` IQ3_XXS and ``ffn_gate`` / ``ffn_up`` IQ3_XXS between the first and last eighth;
  with 8 experts ``attn_output`` Q5_K.

The file types moerun reads but does not write (``READ_ONLY_FILE_TYPES``: IQ1_S, IQ1_M, IQ2_XXS ... IQ2_M,
IQ3_XXS, whose tensors include types moerun cannot quantize) have their mixes too, for random models of that file
type (``moerun bench --quant IQ2_M``). Their rules are the same function's for a quantization without an importance
matrix; llama.cpp writes these files only with one, so their mixes follow its source without a check against it.
"""

from __future__ import annotations

from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType, LlamaFileType

from moerun.formats.quants import QuantType, fallback_type

T = GGMLQuantizationType
F = LlamaFileType

# the --type names moerun accepts and the llama.cpp file type each one is
FILE_TYPES: dict[str, LlamaFileType] = {
    "F32": F.ALL_F32, "F16": F.MOSTLY_F16, "BF16": F.MOSTLY_BF16, "Q8_0": F.MOSTLY_Q8_0, "Q6_K": F.MOSTLY_Q6_K,
    "Q5_K_M": F.MOSTLY_Q5_K_M, "Q4_K_M": F.MOSTLY_Q4_K_M, "Q3_K_M": F.MOSTLY_Q3_K_M, "Q2_K": F.MOSTLY_Q2_K,
    "Q4_0": F.MOSTLY_Q4_0, "IQ4_XS": F.MOSTLY_IQ4_XS, "IQ4_NL": F.MOSTLY_IQ4_NL, "TQ1_0": F.MOSTLY_TQ1_0,
    "TQ2_0": F.MOSTLY_TQ2_0, "MXFP4_MOE": F.MOSTLY_MXFP4_MOE, "IQ3_M": F.MOSTLY_IQ3_M, "IQ3_S": F.MOSTLY_IQ3_S,
    "IQ3_XS": F.MOSTLY_IQ3_XS,
}
# file types whose tensor types moerun knows but whose quantizers it lacks (random models of them only)
READ_ONLY_FILE_TYPES: dict[str, LlamaFileType] = {
    name: F[f"MOSTLY_{name}"] for name in ("IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ2_M", "IQ3_XXS")
}
# llama_ftype_get_default_type
DEFAULT_TYPE: dict[LlamaFileType, GGMLQuantizationType] = {
    F.ALL_F32: T.F32, F.MOSTLY_F16: T.F16, F.MOSTLY_BF16: T.BF16, F.MOSTLY_Q8_0: T.Q8_0, F.MOSTLY_Q6_K: T.Q6_K,
    F.MOSTLY_Q5_K_M: T.Q5_K, F.MOSTLY_Q4_K_M: T.Q4_K, F.MOSTLY_Q3_K_M: T.Q3_K, F.MOSTLY_Q2_K: T.Q2_K,
    F.MOSTLY_Q4_0: T.Q4_0, F.MOSTLY_IQ4_XS: T.IQ4_XS, F.MOSTLY_IQ4_NL: T.IQ4_NL,
    F.MOSTLY_IQ1_S: T.IQ1_S, F.MOSTLY_IQ1_M: T.IQ1_M, F.MOSTLY_IQ2_XXS: T.IQ2_XXS, F.MOSTLY_IQ2_XS: T.IQ2_XS,
    F.MOSTLY_IQ2_S: T.IQ2_XS, F.MOSTLY_IQ2_M: T.IQ2_S, F.MOSTLY_IQ3_XXS: T.IQ3_XXS, F.MOSTLY_IQ3_XS: T.IQ3_S,
    F.MOSTLY_IQ3_S: T.IQ3_S, F.MOSTLY_IQ3_M: T.IQ3_S, F.MOSTLY_TQ1_0: T.TQ1_0, F.MOSTLY_TQ2_0: T.TQ2_0,
    F.MOSTLY_MXFP4_MOE: T.MXFP4,
}
_FLOAT = (T.F32, T.F16, T.BF16)
_IQ4 = (F.MOSTLY_IQ4_NL, F.MOSTLY_IQ4_XS)
# the file types whose attention and ffn_down rules form one group in llama.cpp (the IQ1 and IQ2 mixes)
_LOW = (F.MOSTLY_IQ2_XXS, F.MOSTLY_IQ2_XS, F.MOSTLY_IQ1_S, F.MOSTLY_IQ2_S, F.MOSTLY_IQ2_M, F.MOSTLY_IQ1_M)
_IQ2_SM = (F.MOSTLY_IQ2_S, F.MOSTLY_IQ2_M)
_IQ1 = (F.MOSTLY_IQ1_S, F.MOSTLY_IQ1_M)


def file_type(ftype: str | LlamaFileType, read_only: bool = False) -> LlamaFileType:
    """The llama.cpp file type for a ``--type`` name such as 'Q4_K_M' (or a LlamaFileType); read_only also takes
    the file types moerun cannot write (READ_ONLY_FILE_TYPES)."""
    known = {**FILE_TYPES, **READ_ONLY_FILE_TYPES} if read_only else FILE_TYPES
    if isinstance(ftype, LlamaFileType):
        if ftype not in known.values():
            raise ValueError(f"file type {ftype.name} is not supported; choose one of {', '.join(known)}")
        return ftype
    key = str(ftype).upper()
    if key not in known:
        raise ValueError(f"unknown GGUF file type {ftype!r}; choose one of {', '.join(known)}")
    return known[key]


def use_more_bits(layer: int, n_layers: int) -> bool:
    """llama.cpp's choice of layers that get more bits: the first and last eighth and every third in between."""
    return layer < n_layers // 8 or layer >= 7 * n_layers // 8 or (layer - n_layers // 8) % 3 == 2


def is_quantizable(gguf_name: str, shape: tuple[int, ...]) -> bool:
    """False for tensors kept in float32: 1-D tensors, norms, biases and the MoE router (as llama.cpp does)."""
    return (len(shape) >= 2 and gguf_name.endswith("weight") and "_norm.weight" not in gguf_name
            and "ffn_gate_inp.weight" not in gguf_name)


def _category(name: str) -> str:
    # same order of substring tests as llama.cpp's tensor_get_category
    if name == "output.weight":
        return "output"
    if name == "token_embd.weight":
        return "token_embd"
    for key, cat in (("attn_v.weight", "attn_v"), ("attn_k.weight", "attn_k"), ("attn_q.weight", "attn_q"),
                     ("attn_output.weight", "attn_output"), ("ffn_up", "ffn_up"), ("ffn_gate", "ffn_gate"),
                     ("ffn_down", "ffn_down")):
        if key in name:
            return cat
    return "other"


def tensor_type(gguf_name: str, shape: tuple[int, ...], ftype: str | LlamaFileType, layer: int | None,
                n_layers: int, n_expert: int, *, n_gqa: int = 1, tied_embeddings: bool = False) -> GGMLQuantizationType:
    """The GGML type of one tensor (torch-order ``shape``) in a file of type ``ftype``.

    ``layer`` is the block index (None for global tensors), ``n_gqa`` is n_head / n_head_kv and
    ``tied_embeddings`` says the file has no ``output.weight``, so ``token_embd`` is quantized like the head.
    """
    ft = file_type(ftype, read_only=True)
    shape = tuple(int(d) for d in shape)
    if not is_quantizable(gguf_name, shape):
        return T.F32
    default = DEFAULT_TYPE[ft]
    if default in _FLOAT:
        return default
    cat = _category(gguf_name)
    if cat in ("attn_v", "attn_k", "attn_q", "attn_output", "ffn_down", "ffn_gate", "ffn_up"):
        if layer is None or not 0 <= layer < n_layers:
            raise ValueError(f"tensor {gguf_name!r}: layer {layer} is not in [0, {n_layers})")
    return _fallback(_mix(cat, default, ft, shape, layer or 0, n_layers, n_expert, n_gqa, tied_embeddings), shape)


def _mix(cat: str, t: GGMLQuantizationType, ft: LlamaFileType, shape: tuple[int, ...], layer: int, n_layers: int,
         n_expert: int, n_gqa: int, tied: bool) -> GGMLQuantizationType:
    if cat == "output" or (tied and cat == "token_embd"):
        if ft == F.MOSTLY_MXFP4_MOE or shape[-1] % GGML_QUANT_SIZES[t][0]:
            return T.Q8_0
        if ft in (*_LOW, F.MOSTLY_IQ3_XXS):
            return T.Q5_K
        return t if t == T.Q8_0 else T.Q6_K
    if ft == F.MOSTLY_MXFP4_MOE:  # stacked experts in MXFP4, everything else in Q8_0
        return T.MXFP4 if len(shape) > 2 and shape[0] > 1 else T.Q8_0
    if cat == "token_embd":
        if ft in (F.MOSTLY_IQ2_XXS, F.MOSTLY_IQ2_XS, *_IQ1):
            return T.Q2_K
        if ft in (*_IQ2_SM, F.MOSTLY_IQ3_XXS):
            return T.IQ3_S
        if ft in (F.MOSTLY_TQ1_0, F.MOSTLY_TQ2_0):
            return T.Q4_K
        return t
    if ft in _LOW:
        return _mix_low(cat, t, ft, layer, n_layers, n_expert, n_gqa)
    if cat == "attn_v":
        if ft == F.MOSTLY_Q2_K:
            t = T.Q4_K if n_gqa >= 4 else T.Q3_K
        elif ft == F.MOSTLY_IQ3_XXS:
            t = T.Q4_K if n_gqa >= 4 else T.IQ3_S  # IQ3_XXS with an importance matrix
        elif ft in (F.MOSTLY_IQ3_XS, F.MOSTLY_IQ3_S) and n_gqa >= 4:
            t = T.Q4_K
        elif ft == F.MOSTLY_IQ3_M:
            t = T.Q4_K
        elif ft == F.MOSTLY_Q3_K_M:
            t = T.Q5_K if layer < 2 else T.Q4_K
        elif ft in _IQ4 and n_gqa >= 4:
            t = T.Q5_K
        elif ft in (F.MOSTLY_Q4_K_M, F.MOSTLY_Q5_K_M) and use_more_bits(layer, n_layers):
            t = T.Q6_K
        return T.Q8_0 if n_expert == 8 else t
    if cat == "attn_k":
        if n_expert == 8:
            return T.Q8_0
        return {F.MOSTLY_IQ3_XS: T.IQ3_XXS, F.MOSTLY_IQ3_XXS: T.IQ2_S}.get(ft, t)
    if cat == "attn_q":
        return {F.MOSTLY_IQ3_XS: T.IQ3_XXS, F.MOSTLY_IQ3_XXS: T.IQ2_S}.get(ft, t)
    if cat == "ffn_down":
        if ft == F.MOSTLY_Q2_K:
            return T.Q3_K
        if ft == F.MOSTLY_IQ3_XXS:
            return T.Q4_K if layer < n_layers // 8 else T.Q3_K
        if ft == F.MOSTLY_Q3_K_M:
            return T.Q5_K if layer < n_layers // 16 else T.Q4_K
        if ft == F.MOSTLY_IQ3_M and (layer < n_layers // 8 or (n_expert == 8 and use_more_bits(layer, n_layers))):
            return T.Q4_K
        if ft in (F.MOSTLY_Q4_K_M, F.MOSTLY_Q5_K_M) and use_more_bits(layer, n_layers):
            return T.Q6_K
        if ft in _IQ4 and layer < n_layers // 8:
            return T.Q5_K
        return t
    if cat == "attn_output":
        if n_expert == 8:
            bumped = (F.MOSTLY_Q2_K, F.MOSTLY_Q3_K_M, F.MOSTLY_Q4_K_M, *_IQ4, F.MOSTLY_IQ3_XS, F.MOSTLY_IQ3_XXS,
                      F.MOSTLY_IQ3_S, F.MOSTLY_IQ3_M)  # fmt: skip
            return T.Q5_K if ft in bumped else t
        return {F.MOSTLY_Q2_K: T.Q3_K, F.MOSTLY_IQ3_XXS: T.IQ3_S, F.MOSTLY_Q3_K_M: T.Q4_K,
                F.MOSTLY_IQ3_M: T.Q4_K}.get(ft, t)  # fmt: skip
    if cat in ("ffn_gate", "ffn_up") and ft == F.MOSTLY_IQ3_XS and n_layers // 8 <= layer < 7 * n_layers // 8:
        return T.IQ3_XXS
    return t


def _mix_low(cat: str, t: GGMLQuantizationType, ft: LlamaFileType, layer: int, n_layers: int, n_expert: int,
             n_gqa: int) -> GGMLQuantizationType:
    """The IQ1 / IQ2 file types' rules (one branch of llama.cpp's, without the 8-expert Q8_0 bumps)."""
    if cat == "attn_v":
        if n_gqa >= 4 or n_expert >= 4:
            return T.Q4_K
        return T.IQ3_S if ft in _IQ2_SM else T.Q2_K
    if cat == "attn_k" and n_expert == 8:
        return T.Q4_K
    if cat == "ffn_down" and layer < n_layers // 8:
        return T.IQ3_S if ft in _IQ2_SM else T.Q2_K
    if cat == "attn_output":
        if n_expert == 8:
            return T.Q5_K
        if ft in _IQ1:
            return T.IQ2_XXS
        if ft in _IQ2_SM:
            return T.IQ3_S
    return t


def _fallback(t: GGMLQuantizationType, shape: tuple[int, ...]) -> GGMLQuantizationType:
    """A type whose blocks divide the row length: llama.cpp's fallback chain, then F16."""
    return T(int(fallback_type(QuantType(int(t)), shape[-1])))
