"""float32 helpers that reproduce ggml's C rounding and summation in numpy, shared by the quantizers."""

from __future__ import annotations

import numpy as np

F32 = np.float32


def fp16_bytes(v: np.ndarray) -> np.ndarray:
    """float32 [n] -> the fp16 encoding as bytes [n, 2] (out-of-range values become inf, as in ggml)."""
    with np.errstate(over="ignore"):
        return v.astype(np.float32).astype(np.float16).reshape(-1, 1).view(np.uint8)


def fp16_round(v: np.ndarray) -> np.ndarray:
    """float32 values after a round trip through fp16 (what the decoder will see)."""
    with np.errstate(over="ignore"):
        return v.astype(np.float16).astype(np.float32)


def inv(d: np.ndarray) -> np.ndarray:
    """1/d, with 0 where d == 0 (ggml's `d ? 1.0f/d : 0.0f`)."""
    with np.errstate(divide="ignore"):
        return np.where(d == 0, F32(0), F32(1) / d).astype(np.float32)


def round_away(v: np.ndarray) -> np.ndarray:
    """C roundf (halves away from zero), exact in float32."""
    a = np.abs(v)
    fl = np.floor(a)
    return np.sign(v) * (fl + np.floor(2 * (a - fl)))  # a - fl and the doubling are exact


def nearest_int(v: np.ndarray) -> np.ndarray:
    """ggml's nearest_int: add 1.5 * 2^23 so the FPU rounds half to even, read the mantissa (int32)."""
    bits = (np.asarray(v, dtype=np.float32) + F32(12582912.0)).view(np.int32)
    return (bits & 0x007FFFFF) - 0x00400000


def seq_sum(terms: np.ndarray, first: np.ndarray | None = None) -> np.ndarray:
    """Left-to-right float32 sum over axis 0 ([n, S] -> [S]), the order of a C loop.

    numpy's own reductions use pairwise summation, which would change the last bits.
    With `first`, the loop starts from that value instead of +0.0 (and skips terms[0]).
    """
    if first is None:
        acc = np.zeros(terms.shape[1:], dtype=np.float32)
        rest = terms
    else:
        acc = first.astype(np.float32, copy=True)
        rest = terms[1:]
    for t in rest:
        acc += t
    return acc
