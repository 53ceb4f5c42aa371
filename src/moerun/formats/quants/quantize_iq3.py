"""numpy quantizers of IQ3_XXS and IQ3_S without an importance matrix, byte for byte llama.cpp's.

Both describe 32 elements by eight indices into a grid of 4-value points (values 2l + 1, l = 0..7; 256 points for
IQ3_XXS, 512 for IQ3_S), a sign per element and a 4-bit scale. The search follows ggml's quantize_row_iq3_*_impl:
for each of 31 (IQ3_XXS) or 19 (IQ3_S) trial scales every group of 4 rounds to the nearest lattice point; a point
off the grid takes the best of its precomputed neighbours (the grid points at the nearest two or three distances);
the trial with the best weighted fit wins, groups still off the grid are refitted at that scale, and the scale is
refitted. Weights are x^2. Every float32 operation, sum order and tie rule is ggml's, vectorised over sub-blocks.
"""

from __future__ import annotations

import functools

import numpy as np

from .grids import GRID_OF
from .ggml_float import F32, fp16_bytes, inv, nearest_int
from .types import QuantType

_EPS_IQ3_XXS = F32(1e-8)
_K_MAX = 8  # levels 0..7, grid values 2l + 1


class _Grid:
    """The lattice of one IQ3 grid: points [G, 4] (2l + 1), the map from 12-bit lattice codes to grid indices, and
    each off-grid code's neighbour list (all lists back to back in `flat`, code c's at start[c], count[c] long)."""

    def __init__(self, qtype: QuantType) -> None:
        import gguf

        owner, size, _ = GRID_OF[qtype]
        cls = getattr(gguf.quants, owner)
        cls.init_grid()
        values = cls.grid.reshape(size, 4)
        levels = np.searchsorted(np.array(cls.grid_map, dtype=np.float32), values).astype(np.int64)  # [G, 4] in 0..7
        self.points = (2 * levels + 1).astype(np.int64)  # [G, 4]
        self.points_f32 = self.points.astype(np.float32)
        codes = (levels << np.array([0, 3, 6, 9])).sum(axis=1)  # [G]
        self.map = np.full(4096, -1, dtype=np.int64)
        self.map[codes] = np.arange(size)
        nwant = 2 if size == 256 else 3
        lattice = 2 * ((np.arange(4096)[:, None] >> np.array([0, 3, 6, 9])) & 7) + 1  # [4096, 4]
        off = np.nonzero(self.map < 0)[0]
        d2 = ((self.points[None, :, :] - lattice[off][:, None, :]) ** 2).sum(axis=2)  # [n_off, G], exact integers
        order = np.lexsort((np.broadcast_to(np.arange(size), d2.shape), d2), axis=1)  # by distance, then index
        sorted_d2 = np.take_along_axis(d2, order, axis=1)
        # keep the points at the nwant smallest distinct distances
        distinct = np.concatenate([np.ones((len(off), 1), bool), sorted_d2[:, 1:] > sorted_d2[:, :-1]], axis=1)
        keep = np.cumsum(distinct, axis=1) <= nwant
        self.count = np.zeros(4096, dtype=np.int64)
        self.count[off] = keep.sum(axis=1)
        self.start = np.concatenate([[0], np.cumsum(self.count)[:-1]])
        self.flat = order[keep]  # row by row, each row's kept prefix in order


@functools.lru_cache(maxsize=None)
def _grid(qtype: QuantType) -> _Grid:
    return _Grid(qtype)


def _best_neighbour(g: _Grid, code: np.ndarray, xval: np.ndarray, waux: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """Grid index of least sum w (scale q - x)^2 among each off-grid code's neighbours (the first on a tie):
    code [n], xval / waux [n, 4], scale [n] -> [n]. The (query, candidate) pairs are laid out flat, query by query."""
    counts = g.count[code]  # [n]
    seg = np.concatenate([[0], np.cumsum(counts)[:-1]])  # each query's first pair
    q = np.repeat(np.arange(code.size), counts)  # [P] the query of each pair
    cand = g.flat[g.start[code][q] + np.arange(q.size) - seg[q]]  # [P]
    pts = g.points_f32[cand]  # [P, 4]
    xq, wq, sq = xval[q], waux[q], scale[q]
    d2 = np.zeros(q.size, dtype=np.float32)
    for i in range(4):
        diff = sq * pts[:, i] - xq[:, i]
        d2 += wq[:, i] * diff * diff
    first_min = np.where(d2 == np.minimum.reduceat(d2, seg)[q], np.arange(q.size), q.size)
    return cand[np.minimum.reduceat(first_min, seg)]


def _snap(g: _Grid, xval: np.ndarray, waux: np.ndarray, id_: np.ndarray, scale: np.ndarray
          ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:  # fmt: skip
    """Each group of 4 of xval [S, 32] at inverse scale id_ [S] to the grid: (levels [S, 32] 0..7, grid indices
    [S, 8], on_grid [S, 8]); off-grid lattice points take their best neighbour at `scale` [S]."""
    S = xval.shape[0]
    l = np.clip(nearest_int(F32(0.5) * (id_[:, None] * xval - F32(1))), 0, _K_MAX - 1)  # [S, 32]
    groups = l.reshape(S, 8, 4)
    code = (groups << np.array([0, 3, 6, 9])).sum(axis=2)  # [S, 8]
    idx = g.map[code]
    on = idx >= 0
    s_off, k_off = np.nonzero(~on)
    if s_off.size:
        pick = _best_neighbour(g, code[s_off, k_off], xval.reshape(S, 8, 4)[s_off, k_off],
                               waux.reshape(S, 8, 4)[s_off, k_off], scale[s_off])  # fmt: skip
        idx[s_off, k_off] = pick
        groups = groups.copy()
        groups[s_off, k_off] = (g.points[pick] - 1) // 2
    return groups.reshape(S, 32), idx, on


def _fit(w: np.ndarray, xval: np.ndarray, L: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """ggml's sequential sums over the 32 elements: (sum w x q, sum w q q), q = 2L + 1: [S] each."""
    q = (2 * L + 1).astype(np.float32)
    sumqx = np.zeros(w.shape[0], dtype=np.float32)
    sumq2 = np.zeros(w.shape[0], dtype=np.float32)
    for i in range(32):
        sumqx += w[:, i] * xval[:, i] * q[:, i]
        sumq2 += w[:, i] * q[:, i] * q[:, i]
    return sumqx, sumq2


def _search(qtype: QuantType, x: np.ndarray) -> tuple[np.ndarray, ...]:
    """Sub-blocks x [S, 32] -> (scale [S], grid indices [S, 8], sign bits [S, 4] uint8, live [S])."""
    g = _grid(qtype)
    xxs = qtype == QuantType.IQ3_XXS
    S = x.shape[0]
    w = x * x  # [S, 32]
    waux = np.sqrt(w)
    neg = x < 0
    xval = np.where(neg, -x, x).astype(np.float32)
    signs = neg.reshape(S, 4, 8)
    if xxs:  # an odd count of negative values: the element of least w x^2 keeps the even parity, negated
        odd = signs.sum(axis=2) % 2 == 1  # [S, 4]
        imin = (w * x * x).reshape(S, 4, 8).argmin(axis=2)  # first minimum, as a strict < loop
        flip = np.zeros((S, 4, 8), bool)
        np.put_along_axis(flip, imin[:, :, None], odd[:, :, None], axis=2)
        xval = np.where(flip.reshape(S, 32), -xval, xval)
        signs = signs ^ flip
    bits = (signs.astype(np.uint8) << np.arange(8, dtype=np.uint8)).sum(axis=2).astype(np.uint8)  # [S, 4]
    if xxs:
        bits &= 127
    mx = xval[:, 0].copy()
    for i in range(1, 32):  # C MAX(): the later value wins only when strictly greater
        mx = np.where(xval[:, i] > mx, xval[:, i], mx)
    live = mx >= _EPS_IQ3_XXS if xxs else mx != 0
    mx_safe = np.where(live, mx, F32(1))
    best = np.zeros(S, dtype=np.float32)
    scale = (mx / F32(2 * _K_MAX - 1)).astype(np.float32)
    L = np.zeros((S, 32), dtype=np.int64)
    idx = np.zeros((S, 8), dtype=np.int64)
    on_grid = np.zeros((S, 8), bool)
    trials = range(-15, 16) if xxs else range(-9, 10)
    for t in trials:
        id_ = ((F32(2 * _K_MAX - 1) + F32(t) * F32(0.2)) / mx_safe).astype(np.float32)
        Laux, idx_aux, on_aux = _snap(g, xval, waux, id_, (F32(1) / id_).astype(np.float32))
        sumqx, sumq2 = _fit(w, xval, Laux)
        better = (sumq2 > 0) & (sumqx * sumqx > best * sumq2) & live
        with np.errstate(divide="ignore", invalid="ignore"):
            new_scale = (sumqx / sumq2).astype(np.float32)
        scale = np.where(better, new_scale, scale)
        best = np.where(better, scale * sumqx, best)
        L = np.where(better[:, None], Laux, L)
        idx = np.where(better[:, None], idx_aux, idx)
        on_grid = np.where(better[:, None], on_aux, on_grid)
    refit = live & (~on_grid).any(axis=1) & (scale > 0)
    if refit.any():
        r = np.nonzero(refit)[0]
        Lr, idx_r, _ = _snap(g, xval[r], waux[r], inv(scale[r]), scale[r])
        if xxs:  # IQ3_XXS refits only the groups that were off the grid; IQ3_S all of them
            keep = on_grid[r]
            Lr = np.where(np.repeat(keep, 4, axis=1), L[r], Lr)
            idx_r = np.where(keep, idx[r], idx_r)
        L[r], idx[r] = Lr, idx_r
        sumqx, sumq2 = _fit(w[r], xval[r], Lr)
        with np.errstate(divide="ignore", invalid="ignore"):
            scale[r] = np.where(sumq2 > 0, sumqx / sumq2, scale[r])
    flipped = scale < 0
    scale = np.where(flipped, -scale, scale)
    bits = np.where(flipped[:, None], ~bits & (127 if xxs else 255), bits).astype(np.uint8)
    scale = np.where(live, scale, F32(0)).astype(np.float32)
    return scale, idx, bits, live


def _block_scales(scale: np.ndarray, nb: int, fudge: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Sub-block scales [nb * 8] -> (fp16 d bytes [nb, 2], 4-bit codes [nb, 8], blocks whose scales are all zero
    [nb]) as ggml: d = max / 31 x fudge."""
    sc = scale.reshape(nb, 8)
    max_scale = np.zeros(nb, dtype=np.float32)
    for i in range(8):
        max_scale = np.where(sc[:, i] > max_scale, sc[:, i], max_scale)
    d = (max_scale / F32(31)).astype(np.float32)
    ls = np.clip(nearest_int(F32(0.5) * (inv(d)[:, None] * sc - F32(1))), 0, 15).astype(np.uint32)
    dbytes = fp16_bytes(np.where(max_scale > 0, d * F32(fudge), F32(0)).astype(np.float32))
    return dbytes, np.where(max_scale[:, None] > 0, ls, 0).astype(np.uint32), max_scale == 0


def quantize_iq3_xxs(x: np.ndarray) -> np.ndarray:
    """Blocks x [nb, 256] -> IQ3_XXS bytes [nb, 98]."""
    nb = x.shape[0]
    scale, idx, bits, live = _search(QuantType.IQ3_XXS, x.reshape(-1, 32))
    dbytes, ls, dead = _block_scales(scale, nb, 1.0125)
    b = bits.astype(np.uint32)
    words = np.where(live, b[:, 0] | (b[:, 1] << 7) | (b[:, 2] << 14) | (b[:, 3] << 21), 0).reshape(nb, 8)
    words = (words | (ls << 28)).astype("<u4")
    qs = np.where(live[:, None], idx, 0).astype(np.uint8).reshape(nb, 64)
    out = np.concatenate([dbytes, qs, words.view(np.uint8).reshape(nb, 32)], axis=1)
    out[dead] = 0  # no sub-block scale: zeros throughout
    return out


def quantize_iq3_s(x: np.ndarray) -> np.ndarray:
    """Blocks x [nb, 256] -> IQ3_S bytes [nb, 110]."""
    nb = x.shape[0]
    scale, idx, bits, live = _search(QuantType.IQ3_S, x.reshape(-1, 32))
    dbytes, ls, _ = _block_scales(scale, nb, 1.033)
    live_b = live.reshape(nb, 8)
    qs = np.zeros((nb, 64), dtype=np.uint8)
    signs = np.zeros((nb, 32), dtype=np.uint8)
    qh = np.zeros((nb, 8), dtype=np.uint8)
    idx_b, bits_b = idx.reshape(nb, 8, 8), bits.reshape(nb, 8, 4)
    # ggml advances its qs / signs write positions only past sub-blocks that are not all zero, so the sub-blocks
    # after an all-zero one land earlier (their qh bits stay at their own place).
    slot = np.cumsum(live_b, axis=1) - 1  # [nb, 8]
    for ib in range(8):
        rows = np.nonzero(live_b[:, ib])[0]
        at = slot[rows, ib]
        for k in range(8):
            qs[rows, 8 * at + k] = idx_b[rows, ib, k] & 255
            qh[rows, ib] |= ((idx_b[rows, ib, k] >> 8) << k).astype(np.uint8)
        for k in range(4):
            signs[rows, 4 * at + k] = bits_b[rows, ib, k]
    scales = (ls[:, 0::2] | (ls[:, 1::2] << 4)).astype(np.uint8)
    out = np.concatenate([dbytes, qs, qh, signs, scales], axis=1)
    out[~live_b.any(axis=1)] = 0
    return out
