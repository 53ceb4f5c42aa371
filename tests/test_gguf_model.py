"""GGUF models end to end: written by moerun, loaded with weights kept quantized, checked against references."""

from __future__ import annotations

import random
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from helpers import build_checkpoint, reference_model, relative_error, with_random_blocks, write_small_tokenizer
from moerun import LLM, SamplingParams
from moerun.cli import main
from moerun.config import ModelConfig
from moerun.formats.gguf.names import gguf_to_hf
from moerun.formats.gguf.reader import GGUFFile
from moerun.formats.gguf.writer import write_gguf
from moerun.formats.safetensors_checkpoint import SafetensorsCheckpoint
from moerun.kernels.interpreter import interpreting

TYPES = ["F32", "F16", "BF16", "Q8_0", "Q6_K", "Q5_K_M", "Q4_K_M", "Q3_K_M", "Q2_K", "Q4_0", "IQ4_XS", "IQ4_NL",
         "MXFP4_MOE", "TQ2_0", "IQ3_M"]
SHAPE = dict(vocab_size=512, hidden_size=256, moe_intermediate_size=256, intermediate_size=512, head_dim=64,
             num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2, num_experts=4,
             num_experts_per_tok=2, tie_word_embeddings=False, with_tokenizer=False,
             bos_token_id=None, eos_token_id=None)


@pytest.fixture(scope="module")
def hf_checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("hf")
    build_checkpoint(folder, seed=random.randrange(2**31), **SHAPE)
    write_small_tokenizer(folder)
    return folder


def write(hf_checkpoint, out, ftype):
    config = ModelConfig.from_json_file(hf_checkpoint / "config.json")
    tensors = SafetensorsCheckpoint(hf_checkpoint).iter_tensors()
    return write_gguf(out, config, tensors, ftype=ftype, tokenizer_dir=hf_checkpoint, progress=False)[0]


def dequantized_checkpoint(gguf_path, hf_checkpoint, out):
    """An HF checkpoint holding the GGUF's weights as dequantised by the gguf package (an independent oracle)."""
    import gguf

    out.mkdir()
    tensors = {}
    with GGUFFile(gguf_path) as f:
        for name, ti in f.tensors.items():
            raw = np.array(f.tensor_bytes(name))
            if ti.ggml_type in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16,
                                gguf.GGMLQuantizationType.BF16):
                dense = f.tensor(name, copy=True).float()
            else:
                dense = torch.from_numpy(gguf.quants.dequantize(raw, ti.ggml_type).reshape(ti.shape).copy())
            hf = gguf_to_hf(name)
            if ".mlp.experts." in hf:  # stacked [E, rows, cols] -> per-expert tensors
                prefix, part = hf.rsplit(".", 1)
                for e in range(dense.shape[0]):
                    tensors[f"{prefix}.{e}.{part}.weight"] = dense[e].contiguous()
            else:
                tensors[hf] = dense.contiguous()
    save_file(tensors, str(out / "model.safetensors"))
    shutil.copy(hf_checkpoint / "config.json", out / "config.json")
    return out


def test_f32_gguf_equals_its_hf_checkpoint(hf_checkpoint, tmp_path):
    path = write(hf_checkpoint, tmp_path / "m.gguf", "F32")
    ours = LLM(str(path), device="cpu", max_model_len=128)
    hf = LLM(str(hf_checkpoint), device="cpu", max_model_len=128)
    ids = [random.randrange(362) for _ in range(19)]
    assert relative_error(ours.logits(ids), hf.logits(ids)) <= 1e-4
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    assert ours.generate([ids], params)[0].token_ids == hf.generate([ids], params)[0].token_ids
    # the tokenizer and chat template come from the file itself
    assert ours.tokenizer.encode("Hello, world!") == hf.tokenizer.encode("Hello, world!")
    chat = [{"role": "user", "content": "hi"}]
    assert ours.render_chat(chat) == hf.render_chat(chat)


@pytest.mark.parametrize("ftype", TYPES)
def test_quantized_gguf_matches_dequantized_reference(hf_checkpoint, tmp_path, ftype):
    path = write(hf_checkpoint, tmp_path / f"m-{ftype}.gguf", ftype)
    llm = LLM(str(path), device="cpu", max_model_len=128)
    ref = reference_model(dequantized_checkpoint(path, hf_checkpoint, tmp_path / "deq"))
    ids = [random.randrange(362) for _ in range(11)]
    with torch.no_grad():
        expected = ref(torch.tensor([ids])).logits[0]
    assert relative_error(llm.logits(ids), expected) <= 1e-4
    out = llm.generate(["Hello"], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0]
    assert len(out.token_ids) == 8
    if ftype not in ("F32", "F16", "BF16"):
        quantized = [m for m in llm.model.modules() if m.__dict__.get("q_w13") or m.__dict__.get("q_weight")]
        assert quantized, "block-quantised tensors must stay quantised in memory"


@pytest.mark.parametrize("qtype", ["IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ1_S", "IQ1_M", "TQ1_0",
                                   "TQ2_0", "MXFP4", "NVFP4"])
def test_read_only_types_match_dequantized_reference(hf_checkpoint, tmp_path, qtype):
    # Types moerun reads but does not write: the experts and two attention projections of a Q8_0 file replaced by
    # random valid blocks.
    base, path = write(hf_checkpoint, tmp_path / "q8.gguf", "Q8_0"), tmp_path / f"m-{qtype}.gguf"
    with_random_blocks(base, path, qtype, seed=11, names=("_exps.", "attn_q.", "attn_output."))
    llm = LLM(str(path), device="cpu", max_model_len=128)
    held = {t for m in llm.model.modules() for a in ("q_weight", "q_w13", "q_w2") if m.__dict__.get(a)
            for t in m.__dict__[a].qtypes}  # fmt: skip
    assert qtype in held, held
    ref = reference_model(dequantized_checkpoint(path, hf_checkpoint, tmp_path / "deq"))
    ids = [random.randrange(362) for _ in range(11)]
    with torch.no_grad():
        expected = ref(torch.tensor([ids])).logits[0]
    assert relative_error(llm.logits(ids), expected) <= 1e-4
    if (qtype.startswith("IQ") or qtype == "MXFP4") and interpreting():
        # the experts through the Triton kernels: 11 tokens x 2 slots > 4 experts, so the tile kernels read the
        # grid types' blocks as they multiply (ops/quant.py, moe_tile_parts), MXFP4's repacked
        tiles = LLM(str(path), device="cpu", max_model_len=128, moe_backend="triton")
        assert relative_error(tiles.logits(ids), expected) <= 1e-4


def test_grid_experts_take_hidden_rounded_by_the_router(hf_checkpoint, tmp_path, monkeypatch):
    # Where the grid types' GEMV rounds x to int8 (a GPU; forced here), the fused router's kernel hands the experts
    # hidden already rounded at decode, and the GEMV reads those rows: the same tokens as rounding it itself.
    import moerun.kernels.quant.from_blocks as from_blocks
    import moerun.ops.quant as quant_ops

    if not interpreting():
        pytest.skip("the Triton MoE on CPU tensors runs in Triton's interpreter")
    base, path = write(hf_checkpoint, tmp_path / "q8.gguf", "Q8_0"), tmp_path / "m-IQ2_S.gguf"
    with_random_blocks(base, path, "IQ2_S", seed=11, names=("_exps.",))
    monkeypatch.setattr(from_blocks, "grid_rounds_x", lambda: True)
    llm = LLM(str(path), device="cpu", max_model_len=64, moe_backend="triton", cuda_graphs=False)
    handed = []
    gemv = from_blocks.block_gemv

    def spy(*args, **kwargs):
        if kwargs.get("up_raw") is not None:
            handed.append(kwargs.get("x_int8") is not None)
        return gemv(*args, **kwargs)

    monkeypatch.setattr(from_blocks, "block_gemv", spy)
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    prompt = [[random.randrange(362)]]  # one token: its prefill takes the GEMV too
    rounded_by_router = llm.generate(prompt, params)[0].token_ids
    assert handed and all(handed), handed  # every decode step's gate and up GEMVs read the router's rows
    handed.clear()
    monkeypatch.setattr(quant_ops, "moe_int8_input_pad", lambda *args, **kwargs: None)
    assert llm.generate(prompt, params)[0].token_ids == rounded_by_router
    assert handed and not any(handed)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("base_type", ["F32", "Q8_0"])
def test_read_only_types_on_cuda_graphs(hf_checkpoint, tmp_path, base_type):
    # Read from their blocks inside the captured decode step: the graphs give the eager tokens, for one prompt (a
    # prefill graph, or eager prefill where the kernels round to int8 as no bucket's do) and for several. Beside
    # a Q8_0 base the int8 roundings of the packed types are in play too; beside F32 the logits are the CPU path's.
    base, path = write(hf_checkpoint, tmp_path / "base.gguf", base_type), tmp_path / "m-IQ2_XXS.gguf"
    with_random_blocks(base, path, "IQ2_XXS", seed=11, names=("_exps.", "attn_q."))
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    prompts = [[random.randrange(362) for _ in range(n)] for n in (9, 3, 30, 14, 5)]
    graphed = LLM(str(path), device="cuda", max_model_len=128, cuda_graphs=True, dtype="float32")
    eager = LLM(str(path), device="cuda", max_model_len=128, cuda_graphs=False, dtype="float32")
    assert graphed.engine.runner.graphs
    for some in [[p] for p in prompts[:3]] + [prompts]:  # three alone, then five together
        a, b = graphed.generate(some, params), eager.generate(some, params)
        assert [o.token_ids for o in a] == [o.token_ids for o in b]
    if base_type == "F32":
        cpu = LLM(str(path), device="cpu", max_model_len=128, dtype="float32")
        ids = prompts[0]
        assert relative_error(eager.logits(ids).float().cpu(), cpu.logits(ids).float()) <= 1e-4


def test_cli_generate_and_inspect_gguf(hf_checkpoint, tmp_path, capsys):
    path = write(hf_checkpoint, tmp_path / "m.gguf", "Q4_K_M")
    assert main(["generate", "--model", str(path), "--prompt", "Hello", "--max-tokens", "5", "--device", "cpu"]) == 0
    assert main(["inspect", str(path)]) == 0
    text = capsys.readouterr().out
    assert "qwen3moe" in text and "Q4_K" in text and "Q6_K" in text


def test_bad_gguf_is_a_clear_error(tmp_path):
    path = tmp_path / "bad.gguf"
    path.write_bytes(b"GGUF" + b"\x07\x00\x00\x00" + b"\x00" * 32)
    with pytest.raises(ValueError, match="bad.gguf"):
        LLM(str(path), device="cpu")


def test_quantize_cli_from_hf_and_requantize_a_gguf(hf_checkpoint, tmp_path, capsys):
    q8 = tmp_path / "q8.gguf"
    assert main(["quantize", str(hf_checkpoint), str(q8), "--type", "Q8_0"]) == 0
    q4 = tmp_path / "q4.gguf"
    assert main(["quantize", str(q8), str(q4), "--type", "Q4_K_M"]) == 0
    with GGUFFile(q4) as f:
        types = {ti.type_name for ti in f.tensors.values()}
        assert {"Q4_K", "Q6_K"} <= types
        assert len(f.metadata["tokenizer.ggml.tokens"]) == 512
    ids = [3, 50, 200, 7]
    ref = LLM(str(hf_checkpoint), device="cpu", max_model_len=64).logits(ids)
    a = LLM(str(q8), device="cpu", max_model_len=64).logits(ids)
    b = LLM(str(q4), device="cpu", max_model_len=64).logits(ids)
    # Both stay near the float model, the finer type nearer (tiny random models amplify quantisation noise:
    # over seeds Q4_K_M lands at 0.2-0.6 relative error, Q8_0 at 0.01-0.08).
    assert relative_error(a, ref) < 0.15
    assert relative_error(a, ref) < relative_error(b, ref) < 1.0
    assert LLM(str(q4), device="cpu", max_model_len=64).tokenizer.encode("Hello") == \
        LLM(str(hf_checkpoint), device="cpu", max_model_len=64).tokenizer.encode("Hello")
    assert main(["quantize", str(hf_checkpoint), str(tmp_path / "x.gguf"), "--type", "Q7_K"]) == 2
    assert "unknown type 'Q7_K'" in capsys.readouterr().err
