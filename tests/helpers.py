"""Helpers shared by the tests: seeded tiny checkpoints and their transformers reference models."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from moerun.models.tiny import make_tiny_checkpoint

# Small vocabulary for speed; token ids of the tests stay below it.
SMALL_VOCAB = 1024


def build_checkpoint(folder: Path, seed: int, **overrides) -> Path:
    """A float32 tiny checkpoint (for exact comparisons) with a small vocabulary unless overridden."""
    overrides.setdefault("vocab_size", SMALL_VOCAB)
    overrides.setdefault("torch_dtype", "float32")
    spelling = overrides.pop("spelling", "published")
    fused = overrides.pop("fused_experts", False)
    with_tokenizer = overrides.pop("with_tokenizer", True)
    return make_tiny_checkpoint(folder, seed=seed, spelling=spelling, fused_experts=fused, dtype=torch.float32,
                                with_tokenizer=with_tokenizer, **overrides)


def reference_model(folder: Path):
    """transformers' Qwen3MoeForCausalLM on the same checkpoint, float32, eager attention."""
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(folder), dtype=torch.float32, attn_implementation="eager", experts_implementation="eager"
    )
    return model.eval()


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def write_small_tokenizer(folder: Path, vocab_size: int = 512) -> Path:
    """A byte-level BPE tokenizer with Qwen3's pre-tokenizer, special tokens and chat template, trained on a
    short text so that test models can have a small vocabulary (and small embedding tables)."""
    import json

    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    from moerun.models.tiny import qwen3_tokenizer_dir

    qwen = json.loads((qwen3_tokenizer_dir() / "tokenizer.json").read_text())
    pattern = qwen["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"]
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - len(specials), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    corpus = ["The quick brown fox jumps over the lazy dog. " * 3, "Hello, world! 1234567890", "数字和中文 emoji 🙂",
              "def f(x):\n    return x ** 2\n", "user assistant system think"] * 20
    tok.train_from_iterator(corpus, trainer)
    tok.add_special_tokens(specials)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    config = json.loads((qwen3_tokenizer_dir() / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": config["chat_template"], "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
        "bos_token": None, "add_bos_token": False,
    }))
    return folder


@torch.no_grad()
def reference_greedy(ref, ids: list[int], n: int, repetition_penalty: float = 1.0) -> list[int]:
    """Greedy decoding with a transformers model, recomputing the whole sequence each step (no KV cache), with
    transformers' own repetition-penalty processor."""
    from transformers import RepetitionPenaltyLogitsProcessor

    penalty = RepetitionPenaltyLogitsProcessor(repetition_penalty) if repetition_penalty != 1.0 else None
    seq = torch.tensor([ids])
    for _ in range(n):
        scores = ref(seq).logits[:, -1].float()
        if penalty is not None:
            scores = penalty(seq, scores)
        seq = torch.cat([seq, scores.argmax(-1, keepdim=True)], dim=1)
    return seq[0, len(ids):].tolist()


def capture_cuda_graph(step):
    """Runs step() once on a side stream (compiling kernels and allocating their buffers outside the capture),
    then captures it in a CUDA graph; returns (graph, the outputs of the captured call, static on replay)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    return graph, out


def check_graphed_moe(step, hidden, logits, w13, w2, k: int, tol: float, seed: int, replays: int = 3) -> None:
    """step() routes logits [T, E] (renormalised top-k) and runs the experts on hidden [T, H]: captured once,
    then replayed on fresh inputs, each replay equal to the torch reference to tol (relative to its scale)."""
    from moerun.ops.moe_reference import fused_moe_reference, route_reference

    graph, out = capture_cuda_graph(step)
    for _ in range(replays):
        hidden.copy_(torch.randn_like(hidden))
        logits.copy_(torch.randn_like(logits))
        graph.replay()
        torch.cuda.synchronize()
        ref = fused_moe_reference(hidden, w13, w2, *route_reference(logits, k, True))
        scale = ref.float().abs().max().item()
        torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol * scale,
                                   msg=lambda m: f"seed={seed}: {m}")


def reference_rounding(ref: torch.Tensor, hidden: torch.Tensor, w13, w2, weights, ids) -> float:
    """How far fused_moe_reference's result ref on 16-bit hidden lies from the same MoE in float32: the reference
    rounds its intermediate too, and where cancellation leaves a small output that rounding alone can exceed a
    tolerance taken relative to the output. 0 for float32 hidden."""
    from moerun.ops.moe_reference import fused_moe_reference

    if hidden.dtype == torch.float32:
        return 0.0
    return (ref.float() - fused_moe_reference(hidden.float(), w13, w2, weights, ids)).abs().max().item()


def on_int8_grid(T: int, K: int, dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """x [T, K] that int8 quantization per 32 values represents exactly (the quantized decode kernels' x_q8): integer
    codes in [-127, 127] with +-127 in every block, times a power of two per block; exact in bf16 too."""
    q = torch.randint(-127, 128, (T, K))
    q[:, ::32] = 127 * (torch.randint(0, 2, q[:, ::32].shape) * 2 - 1)
    scale = torch.pow(2.0, torch.randint(-8, -3, (T, (K + 31) // 32)).float()).repeat_interleave(32, dim=1)[:, :K]
    return (q * scale).to(dtype).to(device)


def with_random_blocks(src, dst, qtype: str, seed: int, names: tuple[str, ...] = ("_exps.",)) -> None:
    """A copy of the GGUF src whose tensors with any of `names` in their name hold random valid blocks of qtype
    (written by gguf's writer): files of any type, those moerun cannot write included."""
    import gguf

    from moerun.kernels.quant.synthetic import random_quantized

    reader = gguf.GGUFReader(src)
    writer = gguf.GGUFWriter(dst, arch=reader.fields["general.architecture"].contents())
    for field in reader.fields.values():
        if field.name == "general.architecture" or field.name.startswith("GGUF."):
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), vtype, sub_type=sub)
    gen = torch.Generator().manual_seed(seed)
    for t in reader.tensors:
        if any(n in t.name for n in names):
            shape = tuple(int(s) for s in reversed(t.shape.tolist()))  # [E, N, K] or [N, K]
            data = random_quantized(qtype, shape, generator=gen).raw.numpy()  # [..., N, row bytes]
            writer.add_tensor(t.name, data, raw_dtype=gguf.GGMLQuantizationType[qtype])
        else:
            writer.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def ulp_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """How many representable values of their (common) 16- or 32-bit dtype lie between a and b, elementwise."""
    int_type = {4: torch.int32, 2: torch.int16}[a.element_size()]
    sign_bit = 8 * a.element_size() - 1

    def ordered(x: torch.Tensor) -> torch.Tensor:
        bits = x.contiguous().view(int_type).long()
        return torch.where(bits < 0, -(bits & ((1 << sign_bit) - 1)), bits)  # monotone in the float value

    return (ordered(a) - ordered(b)).abs()


def assert_rare_flips(differ: torch.Tensor, seed: int, per: int = 100) -> None:
    """differ: where a result rounded the other way than its reference. A rare flip is allowed: at most one element
    in ``per``, and one however small the tensor (a fraction of a tiny case rounds down to none)."""
    count = int(differ.sum())
    assert count <= max(1, differ.numel() // per), f"seed={seed}: {count} of {differ.numel()} differ"
