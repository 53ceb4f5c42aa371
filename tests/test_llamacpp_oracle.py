"""GGUF files written by moerun, run by llama.cpp itself (llama-cpp-python): the same greedy tokens and logits.

llama-cpp-python builds llama.cpp from source (minutes), so CI skips this module; run it where it is installed.
"""

from __future__ import annotations

import numpy as np
import pytest

from helpers import build_checkpoint, with_random_blocks, write_small_tokenizer
from moerun import LLM, SamplingParams
from moerun.formats.convert import quantize_model

llama_cpp = pytest.importorskip("llama_cpp")

SHAPE = dict(vocab_size=512, hidden_size=256, moe_intermediate_size=256, intermediate_size=512, head_dim=64,
             num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2, num_experts=4,
             num_experts_per_tok=2, tie_word_embeddings=False, with_tokenizer=False, bos_token_id=None,
             eos_token_id=None)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("hf")
    build_checkpoint(folder, seed=5, **SHAPE)
    write_small_tokenizer(folder)
    return folder


@pytest.mark.parametrize("ftype", ["F32", "Q8_0", "Q4_K_M"])
def test_llama_cpp_generates_the_same_greedy_tokens(checkpoint, tmp_path, ftype):
    path = tmp_path / f"m-{ftype}.gguf"
    quantize_model(checkpoint, path, ftype, progress=False)
    ids = [5, 77, 200, 13, 9]
    ours = LLM(str(path), device="cpu", max_model_len=128).generate(
        [ids], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))[0].token_ids
    model = llama_cpp.Llama(model_path=str(path), n_ctx=128, verbose=False)
    theirs = []
    for token in model.generate(ids, temp=0.0, top_k=1, repeat_penalty=1.0):
        theirs.append(token)
        if len(theirs) == 16:
            break
    assert ours == theirs


@pytest.mark.parametrize("ftype", ["F32", "Q8_0", "Q6_K", "Q5_K_M", "Q4_K_M", "Q3_K_M", "Q2_K", "Q4_0", "IQ4_XS",
                                   "IQ4_NL", "MXFP4_MOE", "IQ3_M"])
def test_llama_cpp_logits_agree(checkpoint, tmp_path, ftype):
    path = tmp_path / f"m-{ftype}.gguf"
    quantize_model(checkpoint, path, ftype, progress=False)
    # llama.cpp quantizes activations to 8 bits inside its quantized dot products (moerun does not), and near
    # ties in routing then pick other experts: the coarser the type, the larger the gap
    _check_logits(path, {"F32": 2e-3, "Q2_K": 0.12}.get(ftype, 0.03))  # F32: llama.cpp keeps its KV cache in F16


def _check_logits(path, bound: float) -> None:
    ids = [5, 77, 200, 13, 9, 42, 300]
    ours = LLM(str(path), device="cpu", max_model_len=128).logits(ids).numpy()
    model = llama_cpp.Llama(model_path=str(path), n_ctx=128, verbose=False, logits_all=True)
    model.eval(ids)
    theirs = np.array(model.scores[: len(ids)])
    assert np.linalg.norm(ours - theirs) / np.linalg.norm(theirs) < bound
    assert (ours.argmax(-1) == theirs.argmax(-1)).mean() >= 0.85


@pytest.mark.parametrize("qtype", ["IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ1_S", "IQ1_M", "TQ1_0",
                                   "TQ2_0", "MXFP4"])
def test_llama_cpp_logits_agree_on_read_only_types(checkpoint, tmp_path, qtype):
    # moerun does not write these types: the experts of a Q8_0 file are replaced by random valid blocks.
    base, path = tmp_path / "q8.gguf", tmp_path / f"m-{qtype}.gguf"
    quantize_model(checkpoint, base, "Q8_0", progress=False)
    with_random_blocks(base, path, qtype, seed=7)
    from moerun.formats.gguf.reader import GGUFFile

    with GGUFFile(path) as f:
        assert f.tensors["blk.0.ffn_up_exps.weight"].type_name == qtype
    _check_logits(path, 0.03)


def _llama_quantize(src, dst, ftype: str) -> None:
    import ctypes

    import gguf

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = int(gguf.LlamaFileType[f"MOSTLY_{ftype}"])
    assert llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params)) == 0


@pytest.mark.parametrize("ftype", ["Q8_0", "Q6_K", "Q5_K_M", "Q4_K_M", "Q3_K_M", "Q2_K", "Q4_0", "IQ4_XS", "IQ4_NL",
                                   "MXFP4_MOE", "TQ2_0", "TQ1_0", "IQ3_M", "IQ3_S", "IQ3_XS",
                                   "Q2_K-odd", "Q3_K_M-odd", "Q4_K_M-odd", "Q5_K_M-odd", "IQ4_XS-odd", "TQ1_0-odd",
                                   "Q4_K_M-8x", "Q3_K_M-8x", "IQ3_M-8x", "IQ3_XS-8x"])
def test_llama_cpp_quantizes_to_the_same_file(tmp_path_factory, ftype):
    # llama.cpp's own quantizer (llama_model_quantize, no importance matrix) from the F32 file: every tensor gets the
    # same type and the same bytes as moerun's. 8 query heads on 2 kv heads and 16 layers reach the type mix's
    # n_head / n_head_kv >= 4 and per-layer rules. "-odd": rows of 288 and 160 elements, not whole super-blocks,
    # take the fallback types; "-8x": 8 experts, which some rules single out.
    from moerun.formats.gguf.reader import GGUFFile

    ftype, variant = (ftype.split("-") + [""])[:2]
    folder = tmp_path_factory.mktemp("hf16")
    shape = {**SHAPE, "num_attention_heads": 8, "num_hidden_layers": 16}
    if variant == "8x":
        shape["num_experts"] = 8
    if variant == "odd":
        shape.update(hidden_size=288, moe_intermediate_size=160, intermediate_size=320)
    build_checkpoint(folder, seed=3, **shape)
    write_small_tokenizer(folder)
    f32, ours, theirs = (folder / f"{n}.gguf" for n in ("f32", "ours", "theirs"))
    quantize_model(folder, f32, "F32", progress=False)
    quantize_model(folder, ours, ftype, progress=False)
    _llama_quantize(f32, theirs, ftype)
    with GGUFFile(ours) as a, GGUFFile(theirs) as b:
        assert set(a.tensors) == set(b.tensors)
        for name, info in a.tensors.items():
            assert info.type_name == b.tensors[name].type_name, name
            assert bytes(a.tensor_bytes(name)) == bytes(b.tensor_bytes(name)), name


