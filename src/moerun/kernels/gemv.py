"""Dense y = x @ W^T (+ b) for a few tokens, optionally with the residual add and RMSNorm fused in front.

At decode a dense projection is a read of its weight: a bandwidth problem, not a compute one. The grid is
(N-tiles, SPLIT_K); each program streams BLOCK_N weight rows over its share of K in [BLOCK_N, BLOCK_K]
K-contiguous tiles and applies them to every token row at once, so W is read exactly once whatever T is.
Two inner products, picked by the config:
  fma  a [BLOCK_T, BLOCK_N, BLOCK_K] float32 partial, reduced once after the K loop (meant for T = 1); the
       next weight tile is loaded one step ahead, so two are in flight per program
  dot  tl.dot of the [BLOCK_T >= 16, BLOCK_K] token tile with the weight tile (a few tokens), pipelined by
       num_stages
SPLIT_K > 1 cuts K into SPLIT_K ranges for narrow N with long K: each program writes a float32 partial, takes a
ticket from a per-N-tile counter, and the last to arrive sums all partials in split order (deterministic),
writes y and resets the counter to 0 for the next launch (or CUDA-graph replay).

With the norm prologue (``rms_norm_linear_triton``) every program recomputes 1/rms of its token rows from the
whole row of x + residual (a few KB, from L2) and normalises its K range on the fly, rounding where
``RMSNorm.forward_with_residual`` rounds; the programs of N-tile 0 also write x + residual. Grids, buffers
and configs depend only on shapes, so a decode step with these kernels can be captured in a CUDA graph.
"""

from __future__ import annotations

import functools
import json
import os
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import triton
import triton.language as tl

from moerun.kernels.interpreter import interpreting
from moerun.kernels.pdl import launch_dependents, launch_options, pdl_enabled, pdl_mode, wait_for_previous
from moerun.kernels.rmsnorm import norm_dtype, residual_sum, round_to
from moerun.kernels.tickets import ticket_counters
from moerun.kernels.tile_configs import CONFIG_DIR, cuda_table_devices, dtype_name, first_found

# Beyond this many tokens the weight is no longer the whole cost and cuBLAS's tiled GEMMs win.
MAX_TOKENS = 16
# tl.dot needs every tile side >= 16.
MIN_DOT = 16
SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
BACKENDS = ("triton", "torch")


# ---------------------------------------------------------------------------------------------------------
# Configs
# ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GemvConfig:
    """Launch parameters of one (N, K, T, dtype) case.

    backend "torch" marks a case where the tuner found cuBLAS (F.linear) faster; the ops then use it, and the
    tiles are the fastest Triton ones, which a single-token GEMV under PDL keeps (see ``_cuda_config``).
    """

    block_n: int = 16
    block_k: int = 256
    split_k: int = 1
    dot: bool = False
    num_warps: int = 4
    num_stages: int = 2
    backend: str = "triton"
    # behind the add + RMSNorm, where one K step covers the whole row (no split): x + residual read once for the
    # 1/rms and the product (a tile held in registers), not twice from L2; elsewhere ignored
    row_once: bool = False

    def __post_init__(self) -> None:
        for name in ("block_n", "block_k"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"gemv config: {name} must be a power of two, got {value}")
        if self.dot and min(self.block_n, self.block_k) < MIN_DOT:
            raise ValueError(f"gemv config: the dot path needs block_n, block_k >= {MIN_DOT}, got {self}")
        if self.split_k < 1 or self.num_warps < 1 or self.num_stages < 1:
            raise ValueError(f"gemv config: split_k, num_warps, num_stages must be >= 1, got {self}")
        if self.backend not in BACKENDS:
            raise ValueError(f"gemv config: unknown backend {self.backend!r}; expected one of {BACKENDS}")

    @classmethod
    def from_dict(cls, raw: dict) -> "GemvConfig":
        unknown = set(raw) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"gemv config: unknown keys {sorted(unknown)} in {raw}")
        return cls(**raw)

    def to_dict(self) -> dict:
        return asdict(self)


def table_key(N: int, K: int, dtype: torch.dtype) -> str:
    """Key of one weight shape in the tuned table, e.g. 'N=5120,K=2048,dtype=bfloat16'."""
    return f"N={N},K={K},dtype={dtype_name(dtype)}"


def table_path(device: str, config_dir: Path = CONFIG_DIR) -> Path:
    """The tuned table of a device: configs/gemv_<device>.json, {table_key: {T: config}}."""
    return config_dir / f"gemv_{device}.json"


@functools.cache
def load_table(device: str, user_dir: str | None = None) -> dict[str, dict[int, GemvConfig]]:
    """The device's tuned table ({} when none was shipped); with user_dir, the shapes its table holds replace the
    shipped entries (the environment variable MOERUN_GEMV_CONFIG_DIR, as MOERUN_MOE_CONFIG_DIR for fused MoE)."""
    table: dict[str, dict[int, GemvConfig]] = {}
    paths = [table_path(device)] + ([table_path(device, Path(user_dir))] if user_dir else [])
    for path in filter(Path.is_file, paths):
        raw = json.loads(path.read_text())
        try:
            table.update({key: {int(t): GemvConfig.from_dict(cfg) for t, cfg in by_t.items()}
                          for key, by_t in raw.items()})
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{path}: {exc}") from exc
    return table


def default_config(
    N: int, K: int, T: int, dtype: torch.dtype, sms: int = 132, interpret: bool | None = None
) -> GemvConfig:
    """Hand-reasoned config when no tuned one covers the case.

    One token: the fma path over 4 rows x 1 KiB per step (on an H200 few rows and long steps won for every
    Qwen3-30B-A3B projection: each program's loads go out at once), K split while there are fewer than about
    four programs per SM and each split keeps at least four steps. More tokens: untuned, cuBLAS (backend
    "torch"), which beat the untuned dot path on an H200; the dot tiles here serve callers that force the GEMV.
    """
    interpret = interpreting() if interpret is None else interpret
    if interpret:
        # the interpreter runs programs one by one: few, small ones
        return GemvConfig(block_n=16, block_k=32, dot=T > 1, num_stages=1)
    if T > 1:
        return GemvConfig(block_n=16, block_k=min(512 // dtype.itemsize, 128), dot=True, num_stages=4,
                          backend="torch")
    block_k = 1024 // dtype.itemsize  # 1 KiB of every row per step: 16-byte loads across a warp, 4 rows in flight
    block_n = 4
    n_tiles = triton.cdiv(N, block_n)
    split_k = 1
    while n_tiles * split_k * 2 <= 4 * sms and K // (split_k * 2) >= 4 * block_k:
        split_k *= 2
    return GemvConfig(block_n=block_n, block_k=block_k, split_k=split_k, num_warps=4, num_stages=2)


def get_config(N: int, K: int, T: int, dtype: torch.dtype, device: torch.device | None = None) -> GemvConfig:
    """The tuned config of the smallest tuned T bucket >= T for this weight shape (the device's table, else the one
    shipped for its compute capability: tile_configs.table_devices), else the default.

    A larger bucket's config is safe for fewer tokens (same tiles, fewer rows); a smaller one's might not be.
    """
    if not interpreting() and device is not None and device.type == "cuda":
        return _cuda_config(N, K, T, dtype, device.index or 0, pdl_enabled(device),
                            os.environ.get("MOERUN_GEMV_CONFIG_DIR"))
    return default_config(N, K, T, dtype)


@functools.cache
def _cuda_config(N: int, K: int, T: int, dtype: torch.dtype, index: int, pdl: bool,
                 user_dir: str | None = None) -> GemvConfig:
    """get_config on CUDA device index, memoised: Linear.forward asks on every call.

    With PDL a single-token GEMV stays on Triton where cuBLAS won the tuning (by a few percent at most on an
    H200), with the fastest Triton tiles the tuner recorded: a cuBLAS launch would end the chain of
    early-starting kernels of the decode step.
    """
    key = table_key(N, K, dtype)
    tuned = tuned_for(first_found(lambda name: load_table(name, user_dir).get(key), cuda_table_devices(index)) or {}, T)
    return choose(tuned, default_config(N, K, T, dtype, sms=_sm_count(index)), T, pdl)


def choose(tuned: GemvConfig | None, default: GemvConfig, T: int, pdl: bool) -> GemvConfig:
    """The tuned config, else the default; a single token under PDL keeps Triton with the tuned tiles where the
    table says cuBLAS (see _cuda_config)."""
    if tuned is not None and tuned.backend == "torch" and T == 1 and pdl:
        return replace(tuned, backend="triton")
    return tuned or default


def tuned_for(by_t: dict[int, GemvConfig], T: int) -> GemvConfig | None:
    """The config of the smallest T bucket >= T, or None when every bucket is smaller."""
    fits = [t for t in by_t if t >= T]
    return by_t[min(fits)] if fits else None


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


# ---------------------------------------------------------------------------------------------------------
# Kernel
# ---------------------------------------------------------------------------------------------------------


@triton.jit
def weight_tile(w_rows, k0, K: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    """Weight rows w_rows [BLOCK_N, 1] at columns [k0, k0 + BLOCK_K) -> [BLOCK_N, BLOCK_K]; unmasked when
    every K block is full, so the loads stay 16-byte vectors."""
    k = k0 + tl.arange(0, BLOCK_K)  # [BLOCK_K]
    if EVEN_K:
        return tl.load(w_rows + k[None, :])
    return tl.load(w_rows + k[None, :], mask=(k < K)[None, :], other=0.0)


@triton.jit
def _residual_sum_tile(x_ptr, res_ptr, t, k, mask, stride_xt, stride_rt, HAS_RESIDUAL: tl.constexpr,
                       INTERPRET: tl.constexpr):
    """x (+ residual) at rows t [BLOCK_T], columns k [BLOCK_K], in the residual's dtype (the sum rounded once, as
    torch); float32 x beside a 16-bit residual (an MoE's unrounded slot sums) is first rounded to that dtype, as the
    unfused path's cast rounds it."""
    t64 = t.to(tl.int64)
    h = tl.load(x_ptr + t64[:, None] * stride_xt + k[None, :], mask=mask, other=0.0)  # [BLOCK_T, BLOCK_K]
    if HAS_RESIDUAL:
        h = residual_sum(h, tl.load(res_ptr + t64[:, None] * stride_rt + k[None, :], mask=mask, other=0.0), INTERPRET)
    return h


@triton.jit
def _inv_rms(x_ptr, res_ptr, t, t_mask, stride_xt, stride_rt, eps, K: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
             BLOCK_T: tl.constexpr, NORM_BLOCK_K: tl.constexpr, INTERPRET: tl.constexpr):
    """1 / sqrt(mean((x + residual)^2) + eps) of the token rows t, over the whole row [K] -> [BLOCK_T].

    Wide column blocks (often the whole row): these loads sit in front of the weight stream, so few round trips.
    """
    sq = tl.zeros([BLOCK_T, NORM_BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, NORM_BLOCK_K):
        k = k0 + tl.arange(0, NORM_BLOCK_K)  # [NORM_BLOCK_K]
        mask = t_mask[:, None] & (k < K)[None, :]
        h = _residual_sum_tile(x_ptr, res_ptr, t, k, mask, stride_xt, stride_rt, HAS_RESIDUAL, INTERPRET)
        hf = h.to(tl.float32)
        sq += hf * hf
    return rsqrt_mean(tl.sum(sq, axis=1), eps, K, INTERPRET)


@triton.jit
def rsqrt_mean(total, eps, K: tl.constexpr, INTERPRET: tl.constexpr):
    """1 / sqrt(total / K + eps) of row sums of squares total [BLOCK_T], the mean finished as torch's is."""
    if INTERPRET:
        mean = total / K  # torch on the CPU divides the sum
    else:
        mean = total * (1.0 / K)  # torch on CUDA multiplies by 1/K rounded to float32
    return tl.math.rsqrt(mean + eps)


@triton.jit
def _normalise(h, norm_w_ptr, k, inv_rms, K: tl.constexpr, INTERPRET: tl.constexpr):
    """weight * (h * inv_rms) for a tile h [BLOCK_T, BLOCK_K] in the model dtype, rounded as RMSNorm rounds:
    the normalised value once, its product with the weight once (a product of 16-bit floats is exact in fp32)."""
    normed = round_to(h.to(tl.float32) * inv_rms[:, None], h.dtype, INTERPRET)
    w = tl.load(norm_w_ptr + k, mask=k < K, other=0.0)  # [BLOCK_K]
    return round_to(w.to(tl.float32)[None, :] * normed.to(tl.float32), h.dtype, INTERPRET)


@triton.jit
def _store_y(acc, b_ptr, y_ptr, t, n, t_mask, n_mask, stride_yt, HAS_BIAS: tl.constexpr, INTERPRET: tl.constexpr):
    """y[t, n] = acc (+ bias[n]) rounded once to y's dtype, as cuBLAS's epilogue; acc [BLOCK_T, BLOCK_N] fp32."""
    if HAS_BIAS:
        bias = tl.load(b_ptr + n, mask=n_mask, other=0.0)  # [BLOCK_N]
        acc += bias.to(tl.float32)[None, :]
    y = round_to(acc, y_ptr.dtype.element_ty, INTERPRET)
    tl.store(y_ptr + t.to(tl.int64)[:, None] * stride_yt + n[None, :], y, mask=t_mask[:, None] & n_mask[None, :])


@triton.jit
def _gemv_kernel(
    x_ptr,  # [T, K]
    res_ptr,  # [T, K] residual (HAS_RESIDUAL) or a dummy
    norm_w_ptr,  # [K] RMSNorm weight (HAS_NORM) or a dummy
    w_ptr,  # [N, K] K-contiguous
    b_ptr,  # [N] (HAS_BIAS) or a dummy
    y_ptr,  # [T, N]
    res_out_ptr,  # [T, K] x + residual (HAS_RESIDUAL) or a dummy
    part_ptr,  # [SPLIT_K, T, N] float32 partials (SPLIT_K > 1) or a dummy
    ticket_ptr,  # [N-tiles] int32, 0 between launches (SPLIT_K > 1) or a dummy
    T,
    N,
    eps,
    stride_xt,
    stride_rt,
    stride_wn,
    stride_yt,
    K: tl.constexpr,  # one compilation per K: a model has a handful
    K_SPLIT: tl.constexpr,  # columns per split, a multiple of BLOCK_K
    HAS_NORM: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NORM_BLOCK_K: tl.constexpr,  # columns per step of the 1/rms pass
    SPLIT_K: tl.constexpr,
    USE_DOT: tl.constexpr,
    EVEN_K: tl.constexpr,  # K % BLOCK_K == 0: no column masks in the K loop
    DOT_PRECISION: tl.constexpr,
    INTERPRET: tl.constexpr,
    PDL: tl.constexpr,
    ONE_TILE: tl.constexpr = False,  # row_once, HAS_NORM, one split of one K step: the 1/rms pass's tile serves it
):
    launch_dependents(PDL)
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    t = tl.arange(0, BLOCK_T)  # [BLOCK_T] token rows
    t_mask = t < T
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] output columns = weight rows
    n_mask = n < N
    # rows past N re-read row n % N and are dropped at the store: the weight loads need no row mask
    w_rows = w_ptr + (n % N).to(tl.int64)[:, None] * stride_wn  # [BLOCK_N, 1]
    k_start = split * K_SPLIT
    k_end = tl.minimum(k_start + K_SPLIT, K)
    k_last = k_start + (tl.cdiv(k_end - k_start, BLOCK_K) - 1) * BLOCK_K  # first column of the last K block
    if USE_DOT:
        acc = tl.zeros([BLOCK_T, BLOCK_N], dtype=tl.float32)
    else:
        acc3 = tl.zeros([BLOCK_T, BLOCK_N, BLOCK_K], dtype=tl.float32)
        # the weight tile of the next step is loaded one step ahead (the first before the 1/rms pass), so two
        # tiles are in flight per program; the last step re-reads its own tile instead of masking the load
        w_next = weight_tile(w_rows, k_start, K, BLOCK_K, EVEN_K)
    wait_for_previous(PDL)  # x and the residual come from the previous kernel (weights did not)
    if ONE_TILE:
        # the whole row is the one K step's tile: x + residual read once (not again in the loop)
        k_row = tl.arange(0, BLOCK_K)  # [BLOCK_K]
        h_row = _residual_sum_tile(x_ptr, res_ptr, t, k_row, t_mask[:, None] & (k_row < K)[None, :], stride_xt,
                                   stride_rt, HAS_RESIDUAL, INTERPRET)  # [BLOCK_T, BLOCK_K]
        hf_row = h_row.to(tl.float32)
        inv_rms = rsqrt_mean(tl.sum(hf_row * hf_row, axis=1), eps, K, INTERPRET)  # [BLOCK_T]
    elif HAS_NORM:
        inv_rms = _inv_rms(x_ptr, res_ptr, t, t_mask, stride_xt, stride_rt, eps, K, HAS_RESIDUAL, BLOCK_T,
                           NORM_BLOCK_K, INTERPRET)  # [BLOCK_T]
    else:
        inv_rms = tl.zeros([BLOCK_T], dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)  # [BLOCK_K]
        if USE_DOT:
            w = weight_tile(w_rows, k0, K, BLOCK_K, EVEN_K)  # [BLOCK_N, BLOCK_K]; num_stages pipelines it
        else:
            w = w_next
            if K_SPLIT > BLOCK_K:  # a split of one step has nothing to load ahead
                w_next = weight_tile(w_rows, tl.minimum(k0 + BLOCK_K, k_last), K, BLOCK_K, EVEN_K)
        if EVEN_K:
            a_mask = t_mask[:, None]
        else:
            a_mask = t_mask[:, None] & (k < K)[None, :]
        if ONE_TILE:
            a = h_row
        else:
            a = _residual_sum_tile(x_ptr, res_ptr, t, k, a_mask, stride_xt, stride_rt, HAS_RESIDUAL,
                                   INTERPRET)  # [BLOCK_T, BLOCK_K]
        if HAS_RESIDUAL:
            if pid_n == 0:  # one program column writes the new residual stream [T, K]
                tl.store(res_out_ptr + t.to(tl.int64)[:, None] * K + k[None, :], a, mask=a_mask)
        if HAS_NORM:
            a = _normalise(a, norm_w_ptr, k, inv_rms, K, INTERPRET)
        if USE_DOT:
            if INTERPRET:  # the interpreter multiplies 16-bit dot operands wrongly
                a = a.to(tl.float32)
                w = w.to(tl.float32)
            acc += tl.dot(a, tl.trans(w), input_precision=DOT_PRECISION)  # [BLOCK_T, BLOCK_N]
        else:
            acc3 += a.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]
    if not USE_DOT:
        acc = tl.sum(acc3, axis=2)  # [BLOCK_T, BLOCK_N]: one cross-lane reduction for the whole K range

    if SPLIT_K == 1:
        _store_y(acc, b_ptr, y_ptr, t, n, t_mask, n_mask, stride_yt, HAS_BIAS, INTERPRET)
    else:
        y_mask = t_mask[:, None] & n_mask[None, :]
        rows = t.to(tl.int64)[:, None] * N + n[None, :]  # [BLOCK_T, BLOCK_N] index into one [T, N] partial
        tl.store(part_ptr + split * T * N + rows, acc, mask=y_mask)
        tl.debug_barrier()  # every thread's partial is written before the ticket is taken
        ticket = tl.atomic_add(ticket_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
        if ticket == SPLIT_K - 1:
            # the last program of this N-tile: every other partial is visible (acquire); sum them in split order
            tl.atomic_xchg(ticket_ptr + pid_n, 0)
            total = tl.zeros([BLOCK_T, BLOCK_N], dtype=tl.float32)
            for s in range(SPLIT_K):
                total += tl.load(part_ptr + s * T * N + rows, mask=y_mask, other=0.0, cache_modifier=".cg")
            _store_y(total, b_ptr, y_ptr, t, n, t_mask, n_mask, stride_yt, HAS_BIAS, INTERPRET)


# ---------------------------------------------------------------------------------------------------------
# Launch
# ---------------------------------------------------------------------------------------------------------


def linear_triton(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, config: GemvConfig | None = None
) -> torch.Tensor:
    """x [T, K] @ weight [N, K]^T (+ bias [N]) -> [T, N] in x's dtype, float32 accumulation; T <= MAX_TOKENS."""
    y, _ = _launch(x, None, None, 0.0, weight, bias, config)
    return y


def rms_norm_linear_triton(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    config: GemvConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(x + residual) @ weight^T (+ bias) [T, N], x + residual [T, K]); the new residual is x itself
    when residual is None, else a new tensor (never written in place: other programs still read residual)."""
    return _launch(x, residual, norm_weight, eps, weight, bias, config)


def _launch(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor | None,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    config: GemvConfig | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    _check(x, residual, norm_weight, weight, bias)
    T, K = x.shape
    N = weight.shape[0]
    if x.stride(1) != 1:
        x = x.contiguous()
    if residual is not None and residual.stride(1) != 1:
        residual = residual.contiguous()
    if weight.stride(1) != 1:
        weight = weight.contiguous()
    dtype = weight.dtype  # the model's: x may be float32 sums beside a 16-bit residual (_check)
    cfg = config or get_config(N, K, T, dtype, x.device)
    y = torch.empty(T, N, dtype=dtype, device=x.device)  # [T, N]
    res_out = torch.empty(T, K, dtype=dtype, device=x.device) if residual is not None else x  # [T, K]
    if T == 0:
        return y, res_out
    block_k = min(cfg.block_k, max(MIN_DOT if cfg.dot else 1, triton.next_power_of_2(K)))
    block_n = min(cfg.block_n, max(MIN_DOT if cfg.dot else 1, triton.next_power_of_2(N)))
    split_k = max(1, min(cfg.split_k, triton.cdiv(K, block_k)))  # no split without a K block of its own
    k_split = triton.cdiv(triton.cdiv(K, split_k), block_k) * block_k
    split_k = triton.cdiv(K, k_split)
    n_tiles = triton.cdiv(N, block_n)
    block_t = max(MIN_DOT, triton.next_power_of_2(T)) if cfg.dot else triton.next_power_of_2(T)
    # the 1/rms pass holds at most 8192 floats (64 registers a thread at 4 warps)
    norm_block_k = max(block_k, min(triton.next_power_of_2(K), 8192 // block_t))
    if split_k > 1:
        partials = torch.empty(split_k, T, N, dtype=torch.float32, device=x.device)  # [SPLIT_K, T, N]
        tickets = ticket_counters(x.device, n_tiles, "gemv")
    else:
        partials = tickets = y  # dummies, never touched
    interpret = interpreting()
    pdl = pdl_mode(x.device, T)
    _gemv_kernel[(n_tiles, split_k)](
        x,
        residual if residual is not None else x,
        norm_weight if norm_weight is not None else x,
        weight,
        bias if bias is not None else weight,
        y,
        res_out,
        partials,
        tickets,
        T,
        N,
        eps,
        x.stride(0),
        residual.stride(0) if residual is not None else 0,
        weight.stride(0),
        y.stride(0),
        K=K,
        K_SPLIT=k_split,
        HAS_NORM=norm_weight is not None,
        HAS_RESIDUAL=residual is not None,
        HAS_BIAS=bias is not None,
        BLOCK_T=block_t,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        NORM_BLOCK_K=norm_block_k,
        SPLIT_K=split_k,
        USE_DOT=cfg.dot,
        EVEN_K=K % block_k == 0,
        # float32 weights: full-precision products, not TF32; the interpreter's dots run in float32 anyway
        DOT_PRECISION="ieee" if dtype == torch.float32 or interpret else "tf32",
        INTERPRET=interpret,
        PDL=pdl,
        ONE_TILE=cfg.row_once and norm_weight is not None and split_k == 1 and k_split == block_k == norm_block_k,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        enable_fp_fusion=True,  # explicit: Triton's default differs between releases
        **launch_options(pdl),
    )
    return y, res_out


def _check(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor | None,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
) -> None:
    """Shape and dtype checks only: nothing here reads device memory. x shares the weight's dtype, or is float32
    beside a residual of the weight's dtype (an MoE's float32 slot sums, rounded by the kernel first)."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"gemv: x must be [T, K] and weight [N, K], got {tuple(x.shape)} and {tuple(weight.shape)}")
    T, K = x.shape
    N = weight.shape[0]
    if T > MAX_TOKENS:
        raise ValueError(f"gemv: at most {MAX_TOKENS} tokens (the token tile is one block), got T={T}")
    dtype = norm_dtype(x, residual)  # the model's
    if dtype not in SUPPORTED_DTYPES or weight.dtype != dtype:
        raise ValueError(f"gemv: x and weight must share a dtype of {SUPPORTED_DTYPES}, got {x.dtype}, {weight.dtype}")
    if bias is not None and (bias.shape != (N,) or bias.stride(0) != 1):
        raise ValueError(f"gemv: bias must be a contiguous [{N}], got {tuple(bias.shape)}")
    if norm_weight is not None and (norm_weight.shape != (K,) or norm_weight.dtype != dtype
                                    or norm_weight.stride(0) != 1):
        raise ValueError(f"gemv: norm weight must be a contiguous [{K}] of {dtype}, got "
                         f"{tuple(norm_weight.shape)} of {norm_weight.dtype}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != dtype):
        raise ValueError(f"gemv: residual must match x {tuple(x.shape)} {dtype}, got {tuple(residual.shape)} "
                         f"{residual.dtype}")
    if residual is not None and norm_weight is None:
        raise ValueError("gemv: a residual is only added in front of the RMSNorm")
