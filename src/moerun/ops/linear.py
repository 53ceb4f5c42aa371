"""Public dense-projection entry points: ``linear`` and ``rms_norm_linear`` (RMSNorm fused into the projection).

On CUDA with a few tokens they run the Triton GEMV (kernels/gemv.py): the projection is then a single read of
its weight, and the norm costs no launch of its own. Otherwise, and as the reference, F.linear (cuBLAS) after
``rms_norm``. backend="triton" forces the GEMV (on CPU it needs Triton's interpreter).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moerun.ops.dispatch import pick_backend
from moerun.ops.norm import rms_norm, rms_norm_reference


def linear_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ weight [N, K]^T (+ bias [N]) as torch computes it."""
    return F.linear(x, weight, bias)


def rms_norm_linear_reference(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm.forward_with_residual then F.linear: (y [T, N], new residual [T, K])."""
    normed, new_residual = rms_norm_reference(x, norm_weight, eps, residual)
    return F.linear(normed, weight, bias), new_residual


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, backend: str | None = None
) -> torch.Tensor:
    """x [..., K] @ weight [N, K]^T (+ bias [N]) -> [..., N] in x's dtype, accumulated in float32."""
    K, N = weight.shape[1], weight.shape[0]
    T = x.numel() // K if K else 0
    if _pick(backend, x, weight, T) == "torch":
        return F.linear(x, weight, bias)
    from moerun.kernels.gemv import linear_triton

    return linear_triton(x.reshape(T, K), weight, bias).view(*x.shape[:-1], N)


def rms_norm_linear(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """h = x + residual (or x); returns (RMSNorm(h) @ weight^T (+ bias) [T, N], h [T, K]).

    Rounds as ``RMSNorm.forward_with_residual`` followed by ``linear`` do. h is x itself when residual is None,
    otherwise a new tensor. x, residual [T, K]; norm_weight [K]; weight [N, K]; bias [N] or None. x may be float32
    beside a 16-bit residual (an MoE's unrounded slot sums), rounded to the residual's dtype first.
    """
    T = x.shape[0]
    # x may be an MoE's float32 sums beside a 16-bit residual: both norms round them first (the residual gives the
    # model's dtype)
    if _pick(backend, x if residual is None else residual, weight, T) == "torch":
        normed, new_residual = rms_norm(x, norm_weight, eps, residual, backend=backend)
        return linear(normed, weight, bias, backend=backend), new_residual
    from moerun.kernels.gemv import rms_norm_linear_triton

    return rms_norm_linear_triton(x, residual, norm_weight, eps, weight, bias)


def gemv_applies(x: torch.Tensor, weight: torch.Tensor, tokens: int) -> bool:
    """Whether the automatic choice (backend=None) runs the Triton GEMV for these operands."""
    return _pick(None, x, weight, tokens) == "triton"


def _pick(backend: str | None, x: torch.Tensor, weight: torch.Tensor, tokens: int) -> str:
    """'triton' or 'torch'. backend=None takes the GEMV only where it applies and was not tuned away."""
    choice = pick_backend(backend, x.device, "linear")
    if choice == "torch" or backend is not None:
        return choice
    from moerun.kernels.gemv import MAX_TOKENS, SUPPORTED_DTYPES, get_config

    if not 0 < tokens <= MAX_TOKENS or x.dtype not in SUPPORTED_DTYPES or weight.dtype != x.dtype:
        return "torch"
    N, K = weight.shape
    return get_config(N, K, tokens, x.dtype, x.device).backend
