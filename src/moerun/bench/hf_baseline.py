"""transformers' Qwen3MoeForCausalLM on the same weights as a moerun model (sharing their memory), timed."""

from __future__ import annotations

import re
import time

import torch
from torch import nn

from moerun.bench.timing import synchronize, time_call

EXPERTS_IMPLEMENTATIONS = ("eager", "grouped_mm", "batched_mm")


def hf_model_sharing_weights(model: nn.Module, hf_config: dict) -> nn.Module:
    """Builds transformers' model on the meta device and points its parameters at moerun's tensors."""
    import transformers

    mc = model.config
    cfg = transformers.Qwen3MoeConfig(**{k: v for k, v in hf_config.items() if k not in ("architectures",
                                                                                          "torch_dtype")})
    with torch.device("meta"):
        hf = transformers.Qwen3MoeForCausalLM(cfg)
    ours = dict(model.named_parameters())
    nq, nkv = mc.num_heads * mc.head_dim, mc.num_kv_heads * mc.head_dim

    def source(name: str) -> torch.Tensor:
        m = re.match(r"(.*\.self_attn\.)([qkv])_proj\.(weight|bias)$", name)
        if m:
            fused = ours[f"{m.group(1)}qkv_proj.{m.group(3)}"]
            start = {"q": 0, "k": nq, "v": nq + nkv}[m.group(2)]
            return fused[start : start + (nq if m.group(2) == "q" else nkv)]
        if ".mlp.experts.gate_up_proj" in name:
            return ours[name.replace("gate_up_proj", "w13")]
        if ".mlp.experts.down_proj" in name:
            return ours[name.replace("down_proj", "w2")]
        m = re.match(r"(.*\.mlp\.)(gate|up)_proj\.weight$", name)
        if m:
            fused = ours[f"{m.group(1)}gate_up_proj.weight"]
            half = fused.shape[0] // 2
            return fused[:half] if m.group(2) == "gate" else fused[half:]
        if name == "lm_head.weight" and mc.tie_word_embeddings:
            return ours["model.embed_tokens.weight"]
        return ours[name]

    for name, param in list(hf.named_parameters(remove_duplicate=False)):
        module_name, _, attr = name.rpartition(".")
        module = hf.get_submodule(module_name)
        setattr(module, attr, nn.Parameter(source(name), requires_grad=False))
    dev = next(model.parameters()).device
    rotary = hf.model.rotary_emb  # its buffers were built on the meta device: compute them for real
    with torch.device("cpu"):
        if rotary.rope_type == "default":
            inv_freq, scaling = rotary.compute_default_rope_parameters(cfg)
        else:
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rotary.rope_type](cfg, "cpu")
    rotary.inv_freq = inv_freq.to(dev)
    rotary.original_inv_freq = inv_freq.clone().to(dev)
    rotary.attention_scaling = scaling
    return hf.eval()


@torch.inference_mode()
def measure_hf(hf: nn.Module, device: torch.device, prompt_len: int, steps: int, batch_sizes: list[int],
               prefill_len: int, implementations: tuple[str, ...] = EXPERTS_IMPLEMENTATIONS) -> dict[str, dict]:
    """Decode tok/s per batch size and prefill tok/s for each experts implementation transformers offers."""
    results: dict[str, dict] = {}
    vocab = hf.config.vocab_size
    for impl in implementations:
        try:
            hf.set_experts_implementation(impl)
        except Exception as exc:  # an implementation this transformers version lacks
            results[impl] = {"error": str(exc)[:200]}
            continue
        entry: dict = {"decode": {}}
        for B in batch_sizes:
            try:
                entry["decode"][B] = _decode_rate(hf, device, vocab, B, prompt_len, steps)
            except torch.OutOfMemoryError:
                entry["decode"][B] = None
                torch.cuda.empty_cache()
        if impl != "batched_mm":  # batched_mm gathers one weight copy per token: out of memory at long prompts
            try:
                ids = torch.randint(0, vocab, (1, prefill_len), device=device)
                entry["prefill"] = prefill_len / time_call(lambda: hf(ids, use_cache=False), device, repeat=3)
            except torch.OutOfMemoryError:
                entry["prefill"] = None
                torch.cuda.empty_cache()
        results[impl] = entry
    return results


def _decode_rate(hf: nn.Module, device: torch.device, vocab: int, B: int, prompt_len: int, steps: int) -> float:
    ids = torch.randint(0, vocab, (B, prompt_len), device=device)
    out = hf(ids, use_cache=True)
    cache = out.past_key_values
    nxt = out.logits[:, -1].argmax(-1, keepdim=True)
    for _ in range(2):  # warm-up
        out = hf(nxt, past_key_values=cache, use_cache=True)
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
    synchronize(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        out = hf(nxt, past_key_values=cache, use_cache=True)
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
    synchronize(device)
    return B * steps / (time.perf_counter() - t0)
