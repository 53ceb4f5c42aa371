"""Builds a model on the meta device, materialises it and fills every parameter from checkpoint tensors.

Each parameter carries ``shard_index`` (see layers/linear.py); this module copies each tensor into place,
checks its shape, and tracks which rows were filled, so that a missing, duplicated, unexpected or misshapen
tensor is a clear error and a half-filled model is never returned.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from moerun.config import ModelConfig
from moerun.layers.linear import shard_index_fn
from moerun.models.registry import get_model_class


class WeightLoadError(ValueError):
    """A checkpoint does not match the model: the message names the tensor."""


def build_empty_model(config: ModelConfig, device: torch.device, moe_backend: str | None = None) -> nn.Module:
    """The model with uninitialised parameters of config.dtype on device (no random init: it is overwritten)."""
    cls = get_model_class(config.architecture)
    with torch.device("meta"):
        model = cls(config, moe_backend=moe_backend)
    model = model.to(dtype=config.dtype)
    model.to_empty(device=device)
    if config.tie_word_embeddings:  # to_empty breaks parameter sharing; restore it
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.eval()


def load_weights(model: nn.Module, tensors: Iterable[tuple[str, torch.Tensor]], source: str = "checkpoint") -> None:
    """Copies (name, tensor) pairs into the model's parameters; raises WeightLoadError on any mismatch."""
    params = dict(model.named_parameters())
    # rows filled so far: one flag per row of a matrix (per element of a vector)
    filled = {name: torch.zeros(p.shape[:-1] if p.dim() > 1 else p.shape, dtype=torch.bool)
              for name, p in params.items()}
    unexpected: list[str] = []
    for name, tensor in tensors:
        target = model.map_checkpoint_name(name)
        if target is None:
            continue
        param_name, shard_id = target
        if param_name not in params:
            unexpected.append(name)
            continue
        param = params[param_name]
        module_name, _, attr = param_name.rpartition(".")
        try:
            index = shard_index_fn(model.get_submodule(module_name), attr)(shard_id)
            dest = param.data[index]
        except (KeyError, IndexError) as exc:
            raise WeightLoadError(f"{source}: tensor {name!r} does not fit {param_name} ({exc})") from None
        if tuple(dest.shape) != tuple(tensor.shape):
            raise WeightLoadError(
                f"{source}: tensor {name!r} has shape {list(tensor.shape)}, expected {list(dest.shape)}"
            )
        if bool(filled[param_name][index].any()):
            raise WeightLoadError(f"{source}: tensor {name!r} appears more than once")
        if not tensor.dtype.is_floating_point:
            raise WeightLoadError(f"{source}: tensor {name!r} has dtype {tensor.dtype}, expected a float type")
        with torch.no_grad():
            dest.copy_(tensor)
        filled[param_name][index] = True
    if unexpected:
        shown = ", ".join(repr(n) for n in unexpected[:5])
        more = f" and {len(unexpected) - 5} more" if len(unexpected) > 5 else ""
        raise WeightLoadError(f"{source}: unexpected tensors {shown}{more}")
    missing = []
    for param_name, mask in filled.items():
        if not bool(mask.all()):
            first = tuple(int(i) for i in (~mask).nonzero()[0]) if mask.dim() else ()
            missing.append(model.checkpoint_name_for(param_name, first))
    if missing:
        shown = ", ".join(repr(n) for n in missing[:5])
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise WeightLoadError(f"{source}: missing tensors {shown}{more}")
