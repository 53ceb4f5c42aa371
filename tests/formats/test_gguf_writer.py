"""Writing qwen3moe GGUF files: expert stacking, the type mix, splits, and reading the result back."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from gguf import GGUFReader
from gguf.constants import GGMLQuantizationType, GGUFValueType
from gguf.quants import dequantize

from gguf_testutil import tiny_config
from moerun.formats.gguf.metadata import model_config_from_file
from moerun.formats.gguf.reader import GGUFError, GGUFFile
from moerun.formats.gguf.type_mix import tensor_type
from moerun.formats.gguf.writer import quantize_tensor, write_gguf
from moerun.formats.quants import quantize

T = GGMLQuantizationType


def model_tensors(config, seed: int = 0, fused_layers=(1,), torch_bf16: bool = True) -> dict[str, object]:
    """Random canonical HF tensors; experts per expert, or fused gate_up + stacked down on ``fused_layers``."""
    rng = np.random.default_rng(seed)
    c = config
    H, I, E, D = c.hidden_size, c.moe_intermediate_size, c.num_experts, c.head_dim

    def r(*shape):
        return rng.standard_normal(shape, dtype=np.float32)

    out: dict[str, object] = {"model.embed_tokens.weight": r(c.vocab_size, H)}
    for layer in range(c.num_layers):
        p = f"model.layers.{layer}."
        out[p + "input_layernorm.weight"] = 1 + r(H) / 10
        out[p + "post_attention_layernorm.weight"] = 1 + r(H) / 10
        out[p + "self_attn.q_proj.weight"] = r(c.num_heads * D, H)
        out[p + "self_attn.k_proj.weight"] = r(c.num_kv_heads * D, H)
        out[p + "self_attn.v_proj.weight"] = r(c.num_kv_heads * D, H)
        o = r(H, c.num_heads * D)
        out[p + "self_attn.o_proj.weight"] = torch.from_numpy(o).bfloat16() if torch_bf16 else o
        out[p + "self_attn.q_norm.weight"] = r(D)
        out[p + "self_attn.k_norm.weight"] = r(D)
        out[p + "mlp.gate.weight"] = r(E, H)
        if layer in fused_layers:
            out[p + "mlp.experts.gate_up_proj"] = r(E, 2 * I, H)
            out[p + "mlp.experts.down_proj"] = r(E, H, I)
        else:
            for e in reversed(range(E)):  # out of order on purpose
                out[p + f"mlp.experts.{e}.gate_proj.weight"] = r(I, H)
                out[p + f"mlp.experts.{e}.up_proj.weight"] = r(I, H)
                out[p + f"mlp.experts.{e}.down_proj.weight"] = r(H, I)
    out["model.norm.weight"] = 1 + r(H) / 10
    out["lm_head.weight"] = r(c.vocab_size, H)
    out["model.layers.0.self_attn.rotary_emb.inv_freq"] = r(D // 2)  # a buffer, skipped
    return out


def _f32(x) -> np.ndarray:
    return x.float().numpy() if isinstance(x, torch.Tensor) else x


def test_q8_0_round_trip(tmp_path):
    config = tiny_config()
    src = model_tensors(config)
    (path,) = write_gguf(tmp_path / "m.gguf", config, src.items(), ftype="Q8_0", name="tiny", progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf"]  # the scratch file is gone
    with GGUFFile(path) as f:
        assert model_config_from_file(f) == config
        assert f.metadata["general.file_type"] == 7 and f.metadata["general.name"] == "tiny"
        assert f.value_types["qwen3moe.block_count"][0] == GGUFValueType.UINT32
        assert f.value_types["qwen3moe.attention.layer_norm_rms_epsilon"][0] == GGUFValueType.FLOAT32
        names = list(f.tensors)
        assert names[0] == "token_embd.weight" and names[-2:] == ["output.weight", "output_norm.weight"]
        assert len(names) == 3 + 2 * 12
        ti = f.tensors["blk.0.ffn_gate_exps.weight"]
        assert ti.shape == (4, 32, 64) and ti.ggml_type == T.Q8_0
        assert f.tensors["blk.0.ffn_down_exps.weight"].shape == (4, 64, 32)
        assert f.tensors["blk.0.ffn_gate_inp.weight"].ggml_type == T.F32
        assert f.tensors["blk.0.attn_norm.weight"].ggml_type == T.F32
        # per-expert tensors are stacked in expert order, and quantizing them one by one equals quantizing the stack
        stacked = np.stack([src[f"model.layers.0.mlp.experts.{e}.gate_proj.weight"] for e in range(4)])
        assert np.array_equal(f.tensor_bytes("blk.0.ffn_gate_exps.weight"), quantize(stacked, "Q8_0").reshape(-1))
        # the fused gate_up is split: gate rows first
        fused = src["model.layers.1.mlp.experts.gate_up_proj"]
        assert np.array_equal(f.tensor_bytes("blk.1.ffn_up_exps.weight"), quantize(fused[:, 32:], "Q8_0").reshape(-1))
        assert np.array_equal(f.tensor("blk.1.attn_norm.weight").numpy(), src["model.layers.1.input_layernorm.weight"])
        o = f.tensor_bytes("blk.0.attn_output.weight")
        assert np.array_equal(o, quantize(_f32(src["model.layers.0.self_attn.o_proj.weight"]), "Q8_0").reshape(-1))
    ref = GGUFReader(path)  # gguf's own reader agrees on every tensor
    with GGUFFile(path) as f:
        for t in ref.tensors:
            assert f.tensor_bytes(t.name).tobytes() == t.data.tobytes()


def test_q4_k_m_follows_the_type_mix_and_dequantizes_close(tmp_path):
    config = tiny_config(hidden_size=256, moe_intermediate_size=256, head_dim=64, num_layers=3)
    src = model_tensors(config, fused_layers=(2,))
    (path,) = write_gguf(tmp_path / "m.gguf", config, src.items(), ftype="Q4_K_M", progress=False)
    with GGUFFile(path) as f:
        for name, ti in f.tensors.items():
            layer = int(name.split(".")[1]) if name.startswith("blk.") else None
            assert ti.ggml_type == tensor_type(name, ti.shape, "Q4_K_M", layer, 3, 4, n_gqa=2), name
        assert f.tensors["output.weight"].ggml_type == T.Q6_K
        assert f.tensors["blk.2.ffn_down_exps.weight"].ggml_type == T.Q6_K  # use_more_bits(2, 3): the last eighth
        assert f.tensors["blk.2.attn_v.weight"].ggml_type == T.Q6_K
        assert f.tensors["blk.0.ffn_down_exps.weight"].ggml_type == T.Q4_K
        assert f.tensors["blk.1.ffn_gate_exps.weight"].ggml_type == T.Q4_K
        ti = f.tensors["blk.1.ffn_gate_exps.weight"]
        got = dequantize(f.tensor_bytes(ti.name).reshape(4, 256, -1), ti.ggml_type)
        want = np.stack([src[f"model.layers.1.mlp.experts.{e}.gate_proj.weight"] for e in range(4)])
        assert np.abs(got - want).mean() < 0.1 * np.abs(want).mean()


def test_split_output_and_tied_embeddings(tmp_path):
    config = tiny_config(tie_word_embeddings=True)
    src = model_tensors(config)  # includes lm_head.weight, which a tied model drops
    paths = write_gguf(tmp_path / "m.gguf", config, src.items(), ftype="F16", split_max_tensors=8, progress=False)
    assert [p.name for p in paths] == [f"m-{i:05d}-of-00004.gguf" for i in (1, 2, 3, 4)]
    with GGUFFile(paths[2]) as f:
        assert "output.weight" not in f.tensors and len(f.tensors) == 2 + 2 * 12
        assert model_config_from_file(f) == replace(config, dtype=torch.float16)
        assert f.tensors["token_embd.weight"].ggml_type == T.F16
        assert f.tensors["blk.1.ffn_gate_inp.weight"].ggml_type == T.F32
        emb = f.tensor("token_embd.weight")
        assert torch.equal(emb, torch.from_numpy(src["model.embed_tokens.weight"]).half())


def test_writer_errors(tmp_path):
    config = tiny_config()
    src = model_tensors(config)
    incomplete = {k: v for k, v in src.items() if k != "model.layers.0.mlp.experts.2.down_proj.weight"}
    with pytest.raises(ValueError, match=r"layer 0 down_proj: experts \[2\] were never given"):
        write_gguf(tmp_path / "a.gguf", config, incomplete.items(), progress=False)
    with pytest.raises(GGUFError, match="unknown Hugging Face tensor name 'model.layers.0.mlp.shared_expert"):
        write_gguf(tmp_path / "b.gguf", config, [("model.layers.0.mlp.shared_expert.up_proj.weight", np.zeros((2, 2)))],
                   progress=False)
    no_head = {k: v for k, v in src.items() if k != "lm_head.weight"}
    with pytest.raises(ValueError, match="untied embeddings but no lm_head.weight"):
        write_gguf(tmp_path / "c.gguf", config, no_head.items(), progress=False)
    with pytest.raises(ValueError, match="expert 9 out of range"):
        write_gguf(tmp_path / "d.gguf", config, [("model.layers.0.mlp.experts.9.up_proj.weight", np.zeros((32, 64)))],
                   progress=False)
    dup = [("model.norm.weight", np.ones(64)), ("model.norm.weight", np.ones(64))]
    with pytest.raises(ValueError, match=r"tensor output_norm.weight \(model.norm.weight\) was given more than once"):
        write_gguf(tmp_path / "f.gguf", config, dup, progress=False)
    with pytest.raises(ValueError, match="unknown GGUF file type 'Q4_K_XL'"):
        write_gguf(tmp_path / "e.gguf", config, [], ftype="Q4_K_XL", progress=False)
    assert list(tmp_path.iterdir()) == []  # neither scratch files nor half-written models are left


def test_quantize_hook_returns_flat_bytes():
    x = np.random.default_rng(0).standard_normal((3, 64), dtype=np.float32)
    b = quantize_tensor(x, T.Q8_0, "t")
    assert b.dtype == np.uint8 and b.shape == (3 * 2 * 34,)
