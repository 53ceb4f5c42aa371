"""Vectorised numpy quantisation of float32 tensors into GGUF block bytes.

Every type follows ggml's reference quantizers (quantize_row_*_ref, no importance
matrix) in the same float32 operation order, so the bytes match llama.cpp's
`ggml_quantize_chunk`. The legacy types (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1), F16 and BF16
also match gguf.quants, except for blocks made only of zeros with a negative sign,
where gguf's scale keeps a different zero sign than ggml's.
"""

from __future__ import annotations

import enum

import numpy as np

from .ggml_float import F32, fp16_bytes, fp16_round, inv, nearest_int, round_away, seq_sum
from .quantize_iq3 import quantize_iq3_s, quantize_iq3_xxs
from .types import FP4_VALUES, IQ4_VALUES, QuantType, as_quant_type, check_row_length

_GROUP_MAX_EPS = F32(1e-15)  # sub-blocks whose |max| is below this are treated as all-zero
_BLOCKS_PER_CHUNK = 4096  # bounds the (elements x sub-blocks) search temporaries to a few MiB

# llama.cpp's choice when a row does not split into 256-element super-blocks (llama_tensor_get_type).
_K_FALLBACK = {
    QuantType.Q4_K: QuantType.Q5_0,
    QuantType.Q5_K: QuantType.Q5_1,
    QuantType.Q6_K: QuantType.Q8_0,
    QuantType.TQ1_0: QuantType.Q4_0,
    QuantType.TQ2_0: QuantType.Q4_0,
    **{t: QuantType.IQ4_NL for t in (QuantType.Q2_K, QuantType.Q3_K, QuantType.IQ4_XS, QuantType.IQ2_XXS,
                                     QuantType.IQ2_XS, QuantType.IQ2_S, QuantType.IQ3_XXS, QuantType.IQ3_S,
                                     QuantType.IQ1_S, QuantType.IQ1_M)},
}


def fallback_type(qtype: int | str | enum.Enum, row_len: int) -> QuantType:
    """The type a tensor with rows of `row_len` elements is stored in when `qtype` was asked for.

    Mirrors llama.cpp's quantizer: Q4_K/Q5_K/Q6_K fall back to Q5_0/Q5_1/Q8_0, Q2_K, Q3_K and the IQ types to
    IQ4_NL, TQ1_0/TQ2_0 to Q4_0, and anything whose rows are still not whole blocks (row length not a multiple
    of 32) to F16.
    """
    qt = as_quant_type(qtype)
    if row_len % qt.block_elems == 0:
        return qt
    alt = _K_FALLBACK.get(qt, QuantType.F16)
    return alt if row_len % alt.block_elems == 0 else QuantType.F16


def quantize(array: np.ndarray, qtype: int | str | enum.Enum, tensor_name: str = "") -> np.ndarray:
    """Quantise a float array [..., row] into uint8 block bytes [..., row_bytes] of type `qtype`."""
    qt = as_quant_type(qtype, tensor_name)
    x = np.ascontiguousarray(array, dtype=np.float32)
    if x.ndim == 0:
        where = f"tensor '{tensor_name}': " if tensor_name else ""
        raise ValueError(f"{where}expected an array with at least one dimension, got a scalar")
    if qt.is_quantized and qt not in _BLOCK_QUANTIZERS:
        where = f"tensor '{tensor_name}': " if tensor_name else ""
        raise ValueError(
            f"{where}moerun reads {qt.name} but does not write it (its quantizer needs llama.cpp's grid search or "
            f"an importance matrix); it writes {', '.join(t.name for t in QUANTIZABLE_TYPES)}"
        )
    check_row_length(x.shape[-1], qt, tensor_name)
    out_shape = (*x.shape[:-1], x.shape[-1] // qt.block_elems * qt.block_bytes)
    if not qt.is_quantized:
        return _PLAIN[qt](x.reshape(-1)).reshape(out_shape)
    blocks = x.reshape(-1, qt.block_elems)  # [n_blocks, block_elems]
    out = np.empty((blocks.shape[0], qt.block_bytes), dtype=np.uint8)
    fn = _BLOCK_QUANTIZERS[qt]
    # Degenerate inputs (values near the float32 limits) overflow or divide by zero exactly
    # where the reference does; the results match it, so the warnings carry no information.
    with np.errstate(all="ignore"):
        for start in range(0, blocks.shape[0], _BLOCKS_PER_CHUNK):
            stop = start + _BLOCKS_PER_CHUNK
            out[start:stop] = fn(blocks[start:stop])
    return out.reshape(out_shape)


# ----------------------------------------------------------------------------- plain floats


def _to_f32(x: np.ndarray) -> np.ndarray:
    return x.view(np.uint8)


def _to_f16(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):  # beyond the fp16 range becomes inf, as in ggml
        return x.astype(np.float16).view(np.uint8)  # round to nearest even, like ggml


def _to_bf16(x: np.ndarray) -> np.ndarray:
    n = x.view(np.uint32)
    # NaNs become quiet NaNs, everything else rounds to nearest even on the top 16 bits.
    n = np.where((n & 0x7FFFFFFF) > 0x7F800000, (n & np.uint32(0xFFFF0000)) | np.uint32(64 << 16), n)
    n = (n.astype(np.uint64) + (0x7FFF + ((n >> 16) & 1))) >> 16
    return n.astype(np.uint16).view(np.uint8)


_PLAIN = {QuantType.F32: _to_f32, QuantType.F16: _to_f16, QuantType.BF16: _to_bf16}


# ----------------------------------------------------------------------------- shared helpers (see also ggml_float)


def _absmax_signed(x: np.ndarray, axis: int) -> np.ndarray:
    """The element of largest magnitude along `axis`, keeping its sign; +0.0 if none is nonzero.

    Same pick as ggml's running `if (fabsf(v) > amax)` from amax = 0: the first of equal
    magnitudes wins, and zeros (either sign) and NaNs are never picked.
    """
    a = np.abs(x)
    a = np.where(a > 0, a, F32(-1))
    idx = np.expand_dims(a.argmax(axis=axis), axis)
    picked = np.take_along_axis(x, idx, axis=axis).squeeze(axis)
    return np.where(np.take_along_axis(a, idx, axis=axis).squeeze(axis) > 0, picked, F32(0))


def _first_extreme(x: np.ndarray, largest: bool) -> np.ndarray:
    """Row max (or min) of [n, k] as the first element attaining it, so a zero keeps ggml's sign: [n, 1]."""
    idx = (x.argmax(axis=1) if largest else x.argmin(axis=1))[:, None]
    return np.take_along_axis(x, idx, axis=1)


def _positive_max(v: np.ndarray) -> np.ndarray:
    """Row maxima of [nb, k], or +0.0 where no entry is positive (a C running max started at 0)."""
    m = np.fmax.reduce(v, axis=1)  # NaNs never win a C `>` comparison
    return np.where(m > 0, m, F32(0)).astype(np.float32)


def _pack_crumbs(L: np.ndarray) -> np.ndarray:
    """2-bit codes [nb, 256] -> [nb, 64]: byte 32*h + l holds codes 128h + 32k + l at bits 2k."""
    L = L.reshape(-1, 2, 4, 32).astype(np.uint8)
    return (L[:, :, 0] | (L[:, :, 1] << 2) | (L[:, :, 2] << 4) | (L[:, :, 3] << 6)).reshape(-1, 64)


def _columns(blocks: np.ndarray, n: int) -> np.ndarray:
    """[nb, 256] -> [n, nb * 256 / n]: sub-blocks of n elements as columns (element index first)."""
    return np.ascontiguousarray(blocks.reshape(-1, n).T)


# ----------------------------------------------------------------------------- legacy 32-element types


def _q8_0(x: np.ndarray) -> np.ndarray:
    d = np.abs(x).max(axis=1, keepdims=True) / F32(127)  # [n, 1]
    q = round_away(x * inv(d)).astype(np.int8).view(np.uint8)  # [n, 32]
    return np.concatenate([fp16_bytes(d), q], axis=1)


def _q4_0(x: np.ndarray) -> np.ndarray:
    d = (_absmax_signed(x, 1) / F32(-8))[:, None]  # [n, 1]; the extreme value maps to code 0
    q = np.trunc(x * inv(d) + F32(8.5)).astype(np.uint8).clip(0, 15)  # [n, 32]
    return np.concatenate([fp16_bytes(d), q[:, :16] | (q[:, 16:] << 4)], axis=1)


def _q4_1(x: np.ndarray) -> np.ndarray:
    mx = _first_extreme(x, largest=True)
    mn = _first_extreme(x, largest=False)
    d = (mx - mn) / F32(15)  # [n, 1]
    q = np.trunc((x - mn) * inv(d) + F32(0.5)).astype(np.uint8).clip(0, 15)
    return np.concatenate([fp16_bytes(d), fp16_bytes(mn), q[:, :16] | (q[:, 16:] << 4)], axis=1)


def _q5_pack(q: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """5-bit codes [n, 32] -> (high bits [n, 4] as a little-endian uint32, nibbles [n, 16])."""
    qh = np.packbits(q >> 4, axis=1, bitorder="little")
    qs = (q[:, :16] & 0x0F) | (q[:, 16:] << 4)
    return qh, qs


def _q5_0(x: np.ndarray) -> np.ndarray:
    d = (_absmax_signed(x, 1) / F32(-16))[:, None]  # [n, 1]
    q = np.trunc(x * inv(d) + F32(16.5)).astype(np.uint8).clip(0, 31)
    qh, qs = _q5_pack(q)
    return np.concatenate([fp16_bytes(d), qh, qs], axis=1)


def _q5_1(x: np.ndarray) -> np.ndarray:
    mx = _first_extreme(x, largest=True)
    mn = _first_extreme(x, largest=False)
    d = (mx - mn) / F32(31)  # [n, 1]
    q = np.trunc((x - mn) * inv(d) + F32(0.5)).astype(np.uint8).clip(0, 31)
    qh, qs = _q5_pack(q)
    return np.concatenate([fp16_bytes(d), fp16_bytes(mn), qh, qs], axis=1)


# ----------------------------------------------------------------------------- K-quant scale searches
#
# Each search works on sub-blocks laid out as columns, x: [n, S] (n = 16 or 32 elements,
# S = all sub-blocks of the chunk), and loops only over the small search grid and over
# the n element positions where the reference accumulates sequentially.


def _fit_min_scale(
    x: np.ndarray, w: np.ndarray, nmax: int, rmin: float, rdelta: float, nstep: int, use_mad: bool
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Weighted fit x ~ scale * L - min with L in [0, nmax] (ggml make_qkx2_quants).

    Tries the plain min/max grid, then nstep + 1 stretched grids, each refined by a weighted
    least-squares solve for (scale, min); keeps the one with the lowest weighted error.
    Returns scale [S], the subtracted min (>= 0) [S] and the codes L [n, S] (uint8).
    """
    mn = np.where(x.min(axis=0) > 0, F32(0), x.min(axis=0))  # the offset never goes above zero
    mx = x.max(axis=0)
    flat = mx == mn
    sum_w = seq_sum(w, first=w[0])
    sum_x = seq_sum(w * x, first=w[0] * x[0])
    err_of = np.abs if use_mad else np.square

    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        iscale = F32(nmax) / (mx - mn)
        scale = F32(1) / iscale
        L = np.clip(nearest_int(iscale * (x - mn)), 0, nmax)  # [n, S]
        best = seq_sum(w * err_of(scale * L.astype(np.float32) + mn - x))
        best_min = mn.copy()
        for step in range(nstep + 1):
            # The grid is anchored at the best offset found so far, as in the reference.
            grid = F32(rmin) + F32(rdelta) * F32(step) + F32(nmax)
            la = np.clip(nearest_int((grid / (mx - best_min)) * (x - best_min)), 0, nmax)
            lf = la.astype(np.float32)
            wl = w * lf
            sum_l = seq_sum(wl)
            sum_l2 = seq_sum(wl * lf)
            sum_xl = seq_sum(wl * x)
            D = sum_w * sum_l2 - sum_l * sum_l
            this_scale = (sum_w * sum_xl - sum_x * sum_l) / D
            this_min = (sum_l2 * sum_x - sum_l * sum_xl) / D
            # A positive offset is not representable: refit the scale alone through zero.
            pos = this_min > 0
            this_min = np.where(pos, F32(0), this_min)
            this_scale = np.where(pos, sum_xl / sum_l2, this_scale)
            err = seq_sum(w * err_of(this_scale * lf + this_min - x))
            better = (D > 0) & (err < best)
            L = np.where(better, la, L)
            best = np.where(better, err, best)
            scale = np.where(better, this_scale, scale)
            best_min = np.where(better, this_min, best_min)

    scale = np.where(flat, F32(0), scale).astype(np.float32)
    best_min = np.where(flat, mn, best_min).astype(np.float32)
    L = np.where(flat, 0, L).astype(np.uint8)
    return scale, -best_min, L


def _fit_symmetric(x: np.ndarray, nmax: int) -> tuple[np.ndarray, np.ndarray]:
    """Weighted (w = x^2) fit x ~ scale * (L - nmax), L in [0, 2 nmax) (ggml make_qx_quants, rmse_type 1).

    Tries 19 grids around -nmax / max and keeps the best least-squares scale.
    Returns scale [S] and codes L [n, S] (int32); all-zero sub-blocks give 0 and 0.
    """
    amax_signed = _absmax_signed(x, 0)  # [S]
    zero = np.abs(amax_signed) < _GROUP_MAX_EPS
    w = x * x
    wx = w * x

    def fit(iscale: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        lv = np.clip(nearest_int(iscale * x), -nmax, nmax - 1)
        lf = lv.astype(np.float32)
        return lv, seq_sum(wx * lf), seq_sum(w * lf * lf)

    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        lv, sumlx, suml2 = fit(F32(-nmax) / amax_signed)
        scale = np.where(suml2 != 0, sumlx / suml2, F32(0)).astype(np.float32)
        best = scale * sumlx
        L = lv + nmax
        for step in (*range(-9, 0), *range(1, 10)):
            lv, sumlx, suml2 = fit(-(F32(nmax) + F32(0.1) * F32(step)) / amax_signed)
            better = (suml2 > 0) & (sumlx * sumlx > best * suml2)
            L = np.where(better, lv + nmax, L)
            scale = np.where(better, sumlx / suml2, scale)
            best = np.where(better, scale * sumlx, best)
    return np.where(zero, F32(0), scale).astype(np.float32), np.where(zero, 0, L)


def _fit_q3(x: np.ndarray, nmax: int) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric fit with w = x^2 refined by 5 passes of per-element coordinate descent (ggml make_q3_quants).

    Returns scale [S] and codes L [n, S] in [0, 2 nmax) (int32); all-zero sub-blocks give 0 and 0.
    """
    amax_signed = _absmax_signed(x, 0)
    zero = np.abs(amax_signed) < _GROUP_MAX_EPS
    w = x * x
    wx = w * x
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        lv = np.clip(nearest_int((F32(-nmax) / amax_signed) * x), -nmax, nmax - 1)  # [n, S]
        lf = lv.astype(np.float32)
        sumlx = seq_sum(wx * lf)
        suml2 = seq_sum(w * lf * lf)
        # A pass that changes nothing leaves the state as it was, so the reference's early exit
        # is equivalent to always running all five passes.
        for _ in range(5):
            for i in range(x.shape[0]):
                li = lv[i].astype(np.float32)
                slx = sumlx - wx[i] * li
                sl2 = suml2 - w[i] * li * li
                new_l = np.clip(nearest_int(x[i] * sl2 / slx), -nmax, nmax - 1)
                nf = new_l.astype(np.float32)
                slx_new = slx + wx[i] * nf
                sl2_new = sl2 + w[i] * nf * nf
                take = (
                    (slx > 0)
                    & (new_l != lv[i])
                    & (sl2_new > 0)
                    & (slx_new * slx_new * suml2 > sumlx * sumlx * sl2_new)
                )
                lv[i] = np.where(take, new_l, lv[i])
                sumlx = np.where(take, slx_new, sumlx)
                suml2 = np.where(take, sl2_new, suml2)
        scale = np.where(suml2 > 0, sumlx / suml2, F32(0))
    return np.where(zero, F32(0), scale).astype(np.float32), np.where(zero, 0, lv + nmax)


def _requantize(
    x: np.ndarray, d: np.ndarray, dm: np.ndarray | None, L: np.ndarray, lo: int, hi: int, offset: int
) -> np.ndarray:
    """Recompute codes against the stored (fp16/6-bit) scales: L = clip(round((x + dm) / d)) + offset.

    x: [nb, k, n] sub-blocks, d and dm: [nb, k]. Sub-blocks whose stored scale is 0 keep L.
    """
    d3 = d[..., None]
    v = x if dm is None else x + dm[..., None]
    with np.errstate(divide="ignore", invalid="ignore"):
        new = np.clip(nearest_int(v / d3), lo, hi) + offset
    return np.where(d3 != 0, new, L)


def _pack_k4_scales(ls: np.ndarray, lm: np.ndarray) -> np.ndarray:
    """Eight 6-bit scales and mins [nb, 8] -> the 12-byte Q4_K/Q5_K packing [nb, 12]."""
    ls, lm = ls.astype(np.uint8), lm.astype(np.uint8)
    out = np.empty((ls.shape[0], 12), dtype=np.uint8)
    # Scales/mins 0-3 keep all 6 bits in bytes 0-7; for 4-7 the low nibbles share bytes 8-11
    # and the top 2 bits ride in the spare bits 6-7 of bytes 0-7.
    out[:, 0:4] = ls[:, :4] | ((ls[:, 4:] >> 4) << 6)
    out[:, 4:8] = lm[:, :4] | ((lm[:, 4:] >> 4) << 6)
    out[:, 8:12] = (ls[:, 4:] & 0x0F) | ((lm[:, 4:] & 0x0F) << 4)
    return out


def _k4_common(
    x: np.ndarray, nmax: int, rmin: float, nstep: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Shared Q4_K/Q5_K step: per-32 fits, 6-bit scale/min codes, requantised codes.

    Returns (d, dmin fp16 bytes [nb, 2] each, packed scales [nb, 12], codes L [nb, 8, 32]).
    """
    nb = x.shape[0]
    xc = _columns(x, 32)  # [32, nb * 8]
    sum_x2 = seq_sum(xc * xc)
    av_x = np.sqrt(sum_x2 / F32(32))
    w = av_x + np.abs(xc)  # weight the larger values more, floored by the RMS
    scales, mins, L = _fit_min_scale(xc, w, nmax, rmin, 0.1, nstep, use_mad=False)
    scales, mins = scales.reshape(nb, 8), mins.reshape(nb, 8)
    L = L.T.reshape(nb, 8, 32).astype(np.int32)

    max_scale, max_min = _positive_max(scales), _positive_max(mins)  # [nb]
    with np.errstate(divide="ignore", invalid="ignore"):
        inv_scale = np.where(max_scale > 0, F32(63) / max_scale, F32(0)).astype(np.float32)
        inv_min = np.where(max_min > 0, F32(63) / max_min, F32(0)).astype(np.float32)
        # The reference stores nearest_int into a uint8 before clamping to 63.
        ls = np.minimum(nearest_int(inv_scale[:, None] * scales) & 0xFF, 63)
        lm = np.minimum(nearest_int(inv_min[:, None] * mins) & 0xFF, 63)
    d = max_scale / F32(63)
    dmin = max_min / F32(63)

    d_sub = fp16_round(d)[:, None] * ls.astype(np.float32)  # [nb, 8]
    m_sub = fp16_round(dmin)[:, None] * lm.astype(np.float32)
    L = _requantize(x.reshape(nb, 8, 32), d_sub, m_sub, L, 0, nmax, 0)
    return fp16_bytes(d), fp16_bytes(dmin), _pack_k4_scales(ls, lm), L


# ----------------------------------------------------------------------------- K-quant block encoders


def _q2_k(x: np.ndarray) -> np.ndarray:
    nb = x.shape[0]
    xc = _columns(x, 16)  # [16, nb * 16]
    scales, mins, L = _fit_min_scale(xc, np.abs(xc), 3, -0.5, 0.1, 15, use_mad=True)
    scales, mins = scales.reshape(nb, 16), mins.reshape(nb, 16)
    L = L.T.reshape(nb, 16, 16).astype(np.int32)

    max_scale, max_min = _positive_max(scales), _positive_max(mins)  # [nb]
    with np.errstate(divide="ignore", invalid="ignore"):
        # 4-bit scale and min codes against the block maxima; the byte keeps only the low 8 bits.
        iscale = (F32(15) / max_scale)[:, None]
        imin = (F32(15) / max_min)[:, None]
        ls = np.where(max_scale[:, None] > 0, nearest_int(iscale * scales), 0)
        lm = np.where(max_min[:, None] > 0, nearest_int(imin * mins) << 4, 0)
    sc = ((ls & 0xFF) | lm) & 0xFF  # [nb, 16]
    d = np.where(max_scale > 0, max_scale / F32(15), F32(0))
    dmin = np.where(max_min > 0, max_min / F32(15), F32(0))

    d_sub = fp16_round(d)[:, None] * (sc & 0x0F).astype(np.float32)  # [nb, 16]
    m_sub = fp16_round(dmin)[:, None] * (sc >> 4).astype(np.float32)
    L = _requantize(x.reshape(nb, 16, 16), d_sub, m_sub, L, 0, 3, 0)
    return np.concatenate(
        [sc.astype(np.uint8), _pack_crumbs(L.reshape(nb, 256)), fp16_bytes(d), fp16_bytes(dmin)], axis=1
    )


def _q3_k(x: np.ndarray) -> np.ndarray:
    nb = x.shape[0]
    xc = _columns(x, 16)  # [16, nb * 16]
    scales, L = _fit_q3(xc, 4)
    scales = scales.reshape(nb, 16)
    L = L.T.reshape(nb, 16, 16)

    max_scale = _absmax_signed(scales, 1)  # [nb], signed
    has = max_scale != 0
    with np.errstate(divide="ignore", invalid="ignore"):
        iscale = np.where(has, F32(-32) / max_scale, F32(0)).astype(np.float32)
        # int8 store, clamp to the signed 6-bit range, bias to 0..63.
        l6 = np.clip(nearest_int(iscale[:, None] * scales).astype(np.int8), -32, 31).astype(np.int32) + 32
        d = np.where(has, F32(1) / iscale, F32(0))
    l6 = np.where(has[:, None], l6, 0)  # [nb, 16]
    packed = np.empty((nb, 12), dtype=np.uint8)
    packed[:, :8] = (l6[:, :8] & 0x0F) | ((l6[:, 8:] & 0x0F) << 4)
    hi = (l6 >> 4).reshape(nb, 4, 4)  # [nb, j // 4, j % 4]
    packed[:, 8:] = hi[:, 0] | (hi[:, 1] << 2) | (hi[:, 2] << 4) | (hi[:, 3] << 6)

    d_sub = fp16_round(d)[:, None] * (l6 - 32).astype(np.float32)  # [nb, 16]
    L = _requantize(x.reshape(nb, 16, 16), d_sub, None, L, -4, 3, 4).reshape(nb, 8, 32)
    # Bit b of hmask byte l is the third bit of code 32 b + l; the low two bits go to qs.
    hbit = (L > 3).astype(np.uint8)
    hmask = np.bitwise_or.reduce(hbit << np.arange(8, dtype=np.uint8)[None, :, None], axis=1)
    return np.concatenate([hmask, _pack_crumbs((L & 3).reshape(nb, 256)), packed, fp16_bytes(d)], axis=1)


def _q4_k(x: np.ndarray) -> np.ndarray:
    nb = x.shape[0]
    d, dmin, packed, L = _k4_common(x, 15, -1.0, 20)
    L = L.reshape(nb, 4, 2, 32).astype(np.uint8)
    qs = (L[:, :, 0] | (L[:, :, 1] << 4)).reshape(nb, 128)
    return np.concatenate([d, dmin, packed, qs], axis=1)


def _q5_k(x: np.ndarray) -> np.ndarray:
    nb = x.shape[0]
    d, dmin, packed, L = _k4_common(x, 31, -0.5, 15)
    L = L.astype(np.uint8)  # [nb, 8, 32]
    # Bit s of qh[l] is the fifth bit of sub-block s, element l.
    qh = np.bitwise_or.reduce((L >> 4) << np.arange(8, dtype=np.uint8)[None, :, None], axis=1)
    low = (L & 0x0F).reshape(nb, 4, 2, 32)
    qs = (low[:, :, 0] | (low[:, :, 1] << 4)).reshape(nb, 128)
    return np.concatenate([d, dmin, packed, qh, qs], axis=1)


def _q6_k(x: np.ndarray) -> np.ndarray:
    nb = x.shape[0]
    xc = _columns(x, 16)  # [16, nb * 16]
    scales, L = _fit_symmetric(xc, 32)
    scales = scales.reshape(nb, 16)
    L = L.T.reshape(nb, 16, 16)

    max_scale = _absmax_signed(scales, 1)  # [nb], signed
    live = np.abs(max_scale) >= _GROUP_MAX_EPS
    with np.errstate(divide="ignore", invalid="ignore"):
        iscale = np.where(live, F32(-128) / max_scale, F32(0)).astype(np.float32)
        d = np.where(live, F32(1) / iscale, F32(0))
    sc = np.minimum(nearest_int(iscale[:, None] * scales), 127).astype(np.int8)  # [nb, 16]
    sc = np.where(live[:, None], sc, 0).astype(np.int8)

    d_sub = fp16_round(d)[:, None] * sc.astype(np.float32)
    L = _requantize(x.reshape(nb, 16, 16), d_sub, None, L, -32, 31, 32)
    L = np.where(live[:, None, None], L, 0).astype(np.uint8).reshape(nb, 2, 4, 32)  # [nb, half, k, l]
    ql = ((L[:, :, 0:2] & 0x0F) | ((L[:, :, 2:4] & 0x0F) << 4)).reshape(nb, 128)
    hi = L >> 4
    qh = (hi[:, :, 0] | (hi[:, :, 1] << 2) | (hi[:, :, 2] << 4) | (hi[:, :, 3] << 6)).reshape(nb, 64)
    return np.concatenate([ql, qh, sc.view(np.uint8), fp16_bytes(d)], axis=1)


# ----------------------------------------------------------------------------- non-linear 4-bit types
#
# ggml's quantize_row_iq4_nl_impl without an importance matrix (weights x^2, 7 tries each side), vectorised over
# 32-element sub-blocks held as columns [32, S]. Sums run in C loop order (seq_sum), each term (w * q) * x.

_IQ4 = np.array(IQ4_VALUES, dtype=np.float32)
_IQ4_TRIES = 7


def _iq4_index(v: np.ndarray) -> np.ndarray:
    """ggml's best_index_int8 over IQ4_VALUES: the nearest level's index, the upper one on a tie (uint8)."""
    mu = np.clip(np.searchsorted(_IQ4, v, side="right"), 1, 15)  # IQ4[mu - 1] <= v < IQ4[mu] inside the range
    pick = np.where(v - _IQ4[mu - 1] < _IQ4[mu] - v, mu - 1, mu)
    return np.where(v <= _IQ4[0], 0, np.where(v >= _IQ4[15], 15, pick)).astype(np.uint8)


def _iq4_fit(x: np.ndarray, w: np.ndarray, id_: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(sum w q x, sum w q q) [S] of sub-block columns x [32, S] at the levels nearest id_ x."""
    q = _IQ4[_iq4_index(id_ * x)]  # [32, S]
    wq = w * q
    return seq_sum(wq * x), seq_sum(wq * q)


def _iq4_scales(x: np.ndarray) -> np.ndarray:
    """The best float32 scale [S] of each sub-block column of x [32, S] (0 for an all-zero one)."""
    mx = _absmax_signed(x, 0)  # [S]
    live = np.abs(mx) >= _GROUP_MAX_EPS
    mx = np.where(live, mx, F32(1))  # dead columns are computed on a harmless value and zeroed at the end
    w = x * x
    sumqx, sumq2 = _iq4_fit(x, w, F32(1) / (-mx / _IQ4[0]))
    d = sumqx / sumq2
    best = d * sumqx
    for itry in range(-_IQ4_TRIES, _IQ4_TRIES + 1):
        sx, s2 = _iq4_fit(x, w, F32(itry + IQ4_VALUES[0]) / mx)
        better = (s2 > 0) & (sx * sx > best * s2)
        d = np.where(better, sx / np.where(better, s2, F32(1)), d)
        best = np.where(better, d * sx, best)
    return np.where(live, d, F32(0)).astype(np.float32)


def _iq4_pack(L: np.ndarray) -> np.ndarray:
    """Codes [nb, 32 m] -> nibbles [nb, 16 m]: element j of each 32 in the low nibble of byte j, j + 16 high."""
    L = L.reshape(L.shape[0], -1, 2, 16)
    return (L[:, :, 0] | (L[:, :, 1] << 4)).reshape(L.shape[0], -1)


def _iq4_nl(x: np.ndarray) -> np.ndarray:
    cols = np.ascontiguousarray(x.T)  # [32, nb]
    d = _iq4_scales(cols)  # [nb]
    L = _iq4_index(inv(d) * cols).T  # [nb, 32]
    return np.concatenate([fp16_bytes(d), _iq4_pack(L)], axis=1)


def _iq4_xs(x: np.ndarray) -> np.ndarray:
    nb = x.shape[0]
    cols = _columns(x, 32)  # [32, nb * 8]
    scales = _iq4_scales(cols).reshape(nb, 8)
    max_scale = _absmax_signed(scales, 1)  # [nb]: the first of largest magnitude
    d = -max_scale / F32(32)
    ls = np.clip(nearest_int(inv(d)[:, None] * scales), -32, 31)  # [nb, 8]
    dl = d[:, None] * ls.astype(np.float32)
    L = _iq4_index(inv(dl).reshape(1, -1) * cols).T.reshape(nb, 256)
    code = (ls + 32).astype(np.uint16)
    low = (code & 0x0F).astype(np.uint8).reshape(nb, 4, 2)
    high = np.zeros(nb, dtype=np.uint16)
    for j in range(8):
        high |= (code[:, j] >> 4) << (2 * j)
    return np.concatenate([fp16_bytes(d), high.reshape(nb, 1).view(np.uint8), low[:, :, 0] | (low[:, :, 1] << 4),
                           _iq4_pack(L)], axis=1)  # fmt: skip


# ----------------------------------------------------------------------------- ternary and FP4 types


def _trits(x: np.ndarray, id_: np.ndarray) -> np.ndarray:
    """ggml's lroundf(x id) + 1 of the ternary types: x [nb, k], id_ [nb, 1] -> [nb, k] in 0, 1, 2 (int32)."""
    return round_away((x * id_).astype(np.float32)).astype(np.int32) + 1


def _base3_bytes(t: np.ndarray, shift_last: bool = False) -> np.ndarray:
    """Trits t [nb, digits, m] (most significant first) -> [nb, m] bytes: the base-3 number scaled to 0..255 by a
    ceiling division (a byte of four trits is first multiplied by 3, its last digit left zero)."""
    q = np.zeros(t.shape[::2], dtype=np.int32)
    for n in range(t.shape[1]):
        q = q * 3 + t[:, n]
    if shift_last:
        q = q * 3
    return ((q * 256 + 242) // 243).astype(np.uint8)


def _tq1_0(x: np.ndarray) -> np.ndarray:
    # Bytes 0-31: five trits of elements m + 32 n; bytes 32-47: of 160 + m + 16 n; bytes 48-51: four trits of
    # 240 + j + 4 m. d = max |x| (id from the float32 value, d stored as fp16).
    d = np.abs(x).max(axis=1)  # [nb]
    t = _trits(x, inv(d)[:, None])
    nb = x.shape[0]
    qs0 = _base3_bytes(t[:, :160].reshape(nb, 5, 32))
    qs1 = _base3_bytes(t[:, 160:240].reshape(nb, 5, 16))
    qh = _base3_bytes(t[:, 240:].reshape(nb, 4, 4), shift_last=True)
    return np.concatenate([qs0, qs1, qh, fp16_bytes(d)], axis=1)


def _tq2_0(x: np.ndarray) -> np.ndarray:
    d = np.abs(x).max(axis=1)  # [nb]
    return np.concatenate([_pack_crumbs(_trits(x, inv(d)[:, None])), fp16_bytes(d)], axis=1)


_FP4 = np.array(FP4_VALUES, dtype=np.float32)


def _mxfp4(x: np.ndarray) -> np.ndarray:
    # e = floor(log2(max |x|)) - 2 + 127 (0 for an all-zero block); scale 2^(e - 128); each value takes the first
    # level of least |level scale - x|.
    amax = np.abs(x).max(axis=1)  # [nb]
    with np.errstate(divide="ignore"):
        e = np.where(amax > 0, np.floor(np.log2(amax)) + 125, 0).astype(np.int64).astype(np.uint8)  # [nb]
    e32 = e.astype(np.uint32)
    d = np.where(e32 < 2, np.uint32(0x00200000) << e32, (e32 - 1) << np.uint32(23)).view(np.float32)  # [nb]
    err = np.abs(_FP4 * d[:, None, None] - x[:, :, None])  # [nb, 32, 16]
    L = err.argmin(axis=2).astype(np.uint8)  # [nb, 32]
    return np.concatenate([e[:, None], L[:, :16] | (L[:, 16:] << 4)], axis=1)


_BLOCK_QUANTIZERS = {
    QuantType.Q8_0: _q8_0,
    QuantType.Q4_0: _q4_0,
    QuantType.Q4_1: _q4_1,
    QuantType.Q5_0: _q5_0,
    QuantType.Q5_1: _q5_1,
    QuantType.Q2_K: _q2_k,
    QuantType.Q3_K: _q3_k,
    QuantType.Q4_K: _q4_k,
    QuantType.Q5_K: _q5_k,
    QuantType.Q6_K: _q6_k,
    QuantType.IQ4_NL: _iq4_nl,
    QuantType.IQ4_XS: _iq4_xs,
    QuantType.TQ1_0: _tq1_0,
    QuantType.TQ2_0: _tq2_0,
    QuantType.MXFP4: _mxfp4,
    QuantType.IQ3_XXS: quantize_iq3_xxs,
    QuantType.IQ3_S: quantize_iq3_s,
}

# The quantized types `quantize` writes (the others are read only).
QUANTIZABLE_TYPES: tuple[QuantType, ...] = tuple(_BLOCK_QUANTIZERS)
