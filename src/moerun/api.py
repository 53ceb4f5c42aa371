"""The public Python API: ``LLM`` loads a model and generates, chats, streams or returns logits."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator, Sequence as Seq
from pathlib import Path
from typing import TYPE_CHECKING, Any, Union

import torch

from moerun.config import EngineConfig, ModelConfig, parse_dtype
from moerun.engine.engine import Engine
from moerun.engine.kv_cache import KVCache
from moerun.engine.memory import available_bytes
from moerun.engine.sequence import Sequence
from moerun.models.checkpoint import load_checkpoint, read_model_config, resolve_dtype
from moerun.outputs import GenerationOutput
from moerun.sampling_params import SamplingParams
from moerun.tokenizer import Tokenizer

if TYPE_CHECKING:
    from moerun.moe.offload import OffloadConfig

logger = logging.getLogger("moerun")

Prompt = Union[str, list[int]]
Message = dict[str, Any]


class LLM:
    """A loaded model ready to generate.

    ``model`` is a Hugging Face checkpoint folder (config.json + safetensors + tokenizer files) or a GGUF file.
    device None picks CUDA when present, else CPU; dtype None keeps the checkpoint's dtype on CUDA and uses
    float32 on CPU. async_scheduling: launch each decode step (without repetition penalties) before the previous
    step's tokens reach the host (the host's work per step then overlaps the GPU's); None turns it on where decode
    runs in CUDA graphs, unless the experts are offloaded behind a device cache that the host fills between steps
    (it would plan each step's admissions a step late; zero-copy mode admits on the device by default).

    Expert offloading (moe/offload): gpu_memory_gb bounds what the model may use on the device; when the model does
    not fit (or expert_cache_gb is given) the experts stay in host memory and a device cache of expert slots serves
    them (offload_policy 'lru', 'lfu' or 'activation'; more options in ``offload``, an OffloadConfig).
    offload_mode: 'zero_copy' (the kernels read missed experts from pinned host memory and decoding keeps its CUDA
    graphs), 'copy' (misses are copied into slots between per-layer graphs) or 'auto' (zero_copy on CUDA for
    experts the kernels can read in place: dense ones, quantized ones on Triton); None keeps ``offload.mode``.
    """

    def __init__(
        self,
        model: str | Path,
        device: str | torch.device | None = None,
        dtype: str | torch.dtype | None = None,
        moe_backend: str | None = None,
        max_model_len: int | None = None,
        max_num_seqs: int | None = None,
        max_num_batched_tokens: int = 8192,
        seed: int | None = None,
        cuda_graphs: bool = True,
        async_scheduling: bool | None = None,
        progress: bool = True,
        gpu_memory_gb: float | None = None,
        expert_cache_gb: float | None = None,
        offload_policy: str | None = None,
        offload: "OffloadConfig | None" = None,
        offload_mode: str | None = None,
    ) -> None:
        device = _resolve_device(device)
        if moe_backend not in (None, "torch", "triton"):
            raise ValueError(f"moe_backend must be 'torch', 'triton' or None, got {moe_backend!r}")
        requested_dtype = parse_dtype(dtype)
        # every option is checked against the config before any weight is read
        mc = read_model_config(model)
        engine_config = _engine_config(mc, device, resolve_dtype(mc.dtype, requested_dtype, device), moe_backend,
                                       max_model_len, max_num_seqs, max_num_batched_tokens, seed, cuda_graphs,
                                       async_scheduling)
        # ---- expert offloading (moe/offload): placed within gpu_memory_gb / expert_cache_gb, checked first ----
        from moerun.moe.offload.placement import load_offloaded, offload_options, plan_for_checkpoint

        offload = offload_options(offload, offload_policy, offload_mode, mc.num_experts_per_tok,
                                  engine_config.max_num_seqs)
        placement = plan_for_checkpoint(model, mc, engine_config, gpu_memory_gb, expert_cache_gb, offload)
        if placement.offload:
            loaded = load_offloaded(model, engine_config, placement, offload, progress=progress)
        else:
            loaded = load_checkpoint(model, device, requested_dtype, moe_backend, progress=progress)
        self._start(loaded.model, loaded.tokenizer, engine_config, kv_bytes=placement.kv_bytes)

    @classmethod
    def from_model(
        cls,
        model: torch.nn.Module,
        tokenizer: Tokenizer,
        max_model_len: int | None = None,
        max_num_seqs: int | None = None,
        max_num_batched_tokens: int = 8192,
        seed: int | None = None,
        cuda_graphs: bool = True,
        async_scheduling: bool | None = None,
    ) -> "LLM":
        """An LLM around a model already in memory (built from a preset, or loaded by other means)."""
        self = cls.__new__(cls)
        mc: ModelConfig = model.config
        device = next(model.parameters()).device
        moe_backend = next((b.experts.backend for b in model.moe_blocks()), None)
        engine_config = _engine_config(mc, device, mc.dtype, moe_backend, max_model_len, max_num_seqs,
                                       max_num_batched_tokens, seed, cuda_graphs, async_scheduling)
        self._start(model, tokenizer, engine_config)
        return self

    def _start(self, model: torch.nn.Module, tokenizer: Tokenizer, engine_config: EngineConfig,
               kv_bytes: int | None = None) -> None:
        self.model, self.tokenizer, self.model_config = model, tokenizer, model.config
        offload = model.__dict__.get("expert_offload")
        if offload is not None:  # offloaded experts: whole-step graphs when the manager's forward is device work
            # only, else one graph per layer where the manager has a device part (engine/layer_graphs.py), else eager
            if not offload.graphable and not offload.layer_graphable:
                engine_config = dataclasses.replace(engine_config, cuda_graphs=False)
            mc, ec = self.model_config, engine_config
            slots = offload.kv_slots(mc.num_layers, mc.num_kv_heads, mc.head_dim, mc.dtype, ec.max_model_len,
                                     ec.max_num_seqs)
        else:
            from moerun.ops.quant import block_scratch_bytes

            scratch = block_scratch_bytes(model, self.model_config.dtype)  # experts dequantised at prefill sizes
            slots = _kv_slots(self.model_config, engine_config, scratch)
            if kv_bytes is not None:  # gpu_memory_gb given: the KV cache stays within the placement's share
                mc = self.model_config
                per_seq = KVCache.bytes_per_token(mc.num_layers, mc.num_kv_heads, mc.head_dim, mc.dtype)
                slots = max(1, min(slots, kv_bytes // (per_seq * engine_config.max_model_len)))
        self.engine_config = engine_config
        self.engine = Engine(self.model, self.tokenizer, engine_config, slots)

    def stats(self) -> dict[str, Any]:
        """Expert-offloading statistics (hit rate, bytes copied per token, ...); {'offloading': False} if off."""
        offload = self.model.__dict__.get("expert_offload")
        return offload.stats_dict() if offload is not None else {"offloading": False}

    # ---- generation ----
    def generate(
        self, prompts: Prompt | Seq[Prompt], sampling_params: SamplingParams | Seq[SamplingParams] | None = None
    ) -> list[GenerationOutput]:
        """Generates for each prompt (text or token ids); returns outputs in the order of the prompts."""
        prompts_list = _as_prompt_list(prompts)
        params_list = _as_params_list(sampling_params, len(prompts_list))
        seqs = [self._add(p, sp) for p, sp in zip(prompts_list, params_list)]
        try:
            while self.engine.has_work:
                self.engine.step()
        except BaseException:
            for s in seqs:
                if not s.is_finished:
                    self.engine.abort(s)
            raise
        return [_output(s) for s in seqs]

    def chat(
        self,
        messages: list[Message] | list[list[Message]],
        sampling_params: SamplingParams | None = None,
        enable_thinking: bool = True,
        tools: list[dict[str, Any]] | None = None,
        **template_kwargs: Any,
    ) -> list[GenerationOutput]:
        """Renders one conversation (or a list of them) with the chat template and generates the reply."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.render_chat(c, enable_thinking, tools, **template_kwargs) for c in conversations]
        return self.generate(prompts, sampling_params)

    def render_chat(
        self, messages: list[Message], enable_thinking: bool = True, tools: list[dict[str, Any]] | None = None,
        **template_kwargs: Any,
    ) -> str:
        return self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tools=tools, enable_thinking=enable_thinking, **template_kwargs
        )

    def stream(self, prompt: Prompt, sampling_params: SamplingParams | None = None) -> Iterator[str]:
        """Yields the text of one request piece by piece as it is generated."""
        seq = self._add(prompt, sampling_params or SamplingParams())
        try:
            while not seq.is_finished:
                self.engine.step()
                delta = seq.take_delta()
                if delta:
                    yield delta
            delta = seq.take_delta()
            if delta:
                yield delta
        finally:
            if not seq.is_finished:
                self.engine.abort(seq)

    def logits(self, token_ids: list[int]) -> torch.Tensor:
        """float32 logits [len(token_ids), vocab] of one prefill (for checking against reference models)."""
        if not token_ids:
            raise ValueError("logits() needs at least one token id")
        return self.engine.prefill_logits(list(token_ids)).cpu()

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def _add(self, prompt: Prompt, params: SamplingParams) -> Sequence:
        if isinstance(prompt, str):
            return self.engine.add_request(self.tokenizer.encode(prompt), params, prompt)
        return self.engine.add_request([int(t) for t in prompt], params, None)


def _as_prompt_list(prompts: Prompt | Seq[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(p, int) for p in prompts):
        return [prompts]  # a single prompt given as token ids
    for p in prompts:
        if not isinstance(p, (str, list, tuple)):
            raise ValueError(f"a prompt must be a string or a list of token ids, got {type(p).__name__}")
    return [p if isinstance(p, str) else list(p) for p in prompts]


def _as_params_list(params: SamplingParams | Seq[SamplingParams] | None, n: int) -> list[SamplingParams]:
    if params is None or isinstance(params, SamplingParams):
        return [params or SamplingParams()] * n
    params = list(params)
    if len(params) != n:
        raise ValueError(f"got {len(params)} SamplingParams for {n} prompts")
    return params


def _output(seq: Sequence) -> GenerationOutput:
    return GenerationOutput(
        prompt=seq.prompt,
        prompt_token_ids=seq.prompt_ids,
        text=seq.text,
        token_ids=list(seq.output_ids),
        finish_reason=seq.finish_reason or "abort",
    )


def _resolve_device(device: str | torch.device | None) -> torch.device:
    device = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was asked for but CUDA is not available")
    if device.type not in ("cuda", "cpu"):
        raise ValueError(f"device {device} is not supported; use 'cuda' or 'cpu'")
    return device


def _engine_config(
    mc: ModelConfig, device: torch.device, dtype: torch.dtype, moe_backend: str | None, max_model_len: int | None,
    max_num_seqs: int | None, max_num_batched_tokens: int, seed: int | None, cuda_graphs: bool,
    async_scheduling: bool | None = None,
) -> EngineConfig:
    if max_model_len is None:
        max_model_len = min(mc.max_position_embeddings, 8192)
    if max_model_len > mc.max_position_embeddings:
        raise ValueError(
            f"max_model_len {max_model_len} exceeds the model's max_position_embeddings {mc.max_position_embeddings}"
        )
    return EngineConfig(
        device=device,
        dtype=dtype,
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs or (64 if device.type == "cuda" else 8),
        max_num_batched_tokens=max_num_batched_tokens,
        moe_backend=moe_backend,
        seed=seed,
        cuda_graphs=cuda_graphs,
        async_scheduling=async_scheduling,
    )


def _kv_slots(mc: ModelConfig, ec: EngineConfig, reserve: int = 0) -> int:
    """How many sequences of max_model_len tokens the KV cache holds: max_num_seqs if memory allows (reserve: bytes
    kept free besides the usual tenth of the free memory)."""
    per_seq = KVCache.bytes_per_token(mc.num_layers, mc.num_kv_heads, mc.head_dim, mc.dtype) * ec.max_model_len
    budget = int(available_bytes(ec.device) * 0.9) - reserve
    slots = min(ec.max_num_seqs, budget // per_seq)
    if slots < 1:
        raise ValueError(
            f"the KV cache for one sequence of max_model_len={ec.max_model_len} tokens needs "
            f"{per_seq / 2**30:.2f} GiB but only {budget / 2**30:.2f} GiB is available; lower max_model_len"
        )
    if slots < ec.max_num_seqs:
        logger.warning("KV cache holds %d sequences of %d tokens (max_num_seqs %d)", slots, ec.max_model_len,
                       ec.max_num_seqs)
    return slots
