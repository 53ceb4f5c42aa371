"""``greedy_pick``: the end of a graphed decode step (float32 logits, greedy tokens as the next input ids, the rows'
positions and lengths advanced), torch or Triton (kernels/greedy_pick.py)."""

from __future__ import annotations

import torch

from moerun.ops.dispatch import pick_backend


def greedy_pick_reference(logits: torch.Tensor, out: torch.Tensor, ids: torch.Tensor,
                          positions: torch.Tensor | None = None, seq_lens: torch.Tensor | None = None,
                          max_len: int = 0) -> None:  # fmt: skip
    """greedy_pick as plain torch: out = logits as float32, ids = out.argmax(-1), positions and seq_lens + 1 (capped
    below / at max_len)."""
    check_pick_operands(logits, out, ids, positions, seq_lens, max_len)
    out.copy_(logits)
    ids.copy_(out.argmax(dim=-1))
    if positions is not None and seq_lens is not None:
        positions.add_(1).clamp_(max=max_len - 1)
        seq_lens.add_(1).clamp_(max=max_len)


def greedy_pick(logits: torch.Tensor, out: torch.Tensor, ids: torch.Tensor, positions: torch.Tensor | None = None,
                seq_lens: torch.Tensor | None = None, max_len: int = 0,
                backend: str | None = None) -> None:  # fmt: skip
    """logits [B, V] -> out [B, V] float32 and ids [B] int64, each row's first largest entry (NaN on the Triton path
    counts as +inf); with positions and seq_lens [B] int64, both advanced by one in place, positions kept below
    max_len and lengths at most max_len (the cache's length). Writes only its arguments; returns nothing."""
    if pick_backend(backend, logits.device, "greedy_pick") == "torch":
        greedy_pick_reference(logits, out, ids, positions, seq_lens, max_len)
        return
    from moerun.kernels.greedy_pick import greedy_pick_triton

    greedy_pick_triton(logits, out, ids, positions, seq_lens, max_len)


def check_pick_operands(logits: torch.Tensor, out: torch.Tensor, ids: torch.Tensor, positions: torch.Tensor | None,
                        seq_lens: torch.Tensor | None, max_len: int) -> None:  # fmt: skip
    """Shapes, dtypes and strides both implementations need (torch only: the reference runs without
    Triton); raises ValueError naming what is wrong."""
    if logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError(f"logits must be [B, V] with unit stride along V, got {tuple(logits.shape)}")
    B, V = logits.shape
    if out.shape != logits.shape or out.dtype != torch.float32 or out.stride(1) != 1:
        raise ValueError(f"out must be [{B}, {V}] float32 with unit stride along V, got {tuple(out.shape)} {out.dtype}")
    if V >= 2**31:
        raise ValueError(f"a vocabulary of {V} entries does not fit int32 indices")
    rows = [("ids", ids)] + ([("positions", positions), ("seq_lens", seq_lens)] if positions is not None else [])
    if (positions is None) != (seq_lens is None):
        raise ValueError("positions and seq_lens are advanced together: give both or neither")
    for name, t in rows:
        if t.shape != (B,) or t.dtype != torch.int64 or t.device != logits.device:
            raise ValueError(f"{name} must be [{B}] int64 on {logits.device}, got {tuple(t.shape)} {t.dtype} "
                             f"on {t.device}")  # fmt: skip
    if positions is not None and max_len < 1:
        raise ValueError(f"advancing positions needs the cache's length max_len >= 1, got {max_len}")
