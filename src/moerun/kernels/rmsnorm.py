"""RMSNorm with an optional fused residual add, one Triton program per row; optionally also the output rounded
to int8 as the quantized decode kernels read it (int8_dot.quantize_x's layout), saving them a launch.

The roundings follow ``RMSNorm.forward_with_residual`` step by step (sum in x's dtype, normalisation in
float32, cast to x's dtype, product with the weight rounded once), so only the order of the float32 sum of
squares differs from torch.
"""

from __future__ import annotations


import torch
import triton
import triton.language as tl

from moerun.kernels.interpreter import interpreting
from moerun.kernels.pdl import launch_dependents, launch_options, pdl_mode, wait_for_previous
from moerun.kernels.quant.int8_dot import Int8Rows, check_k_pad, quantize_store_row

# A whole row lives in registers (at most 32 floats per thread with 16 warps); larger rows would spill.
MAX_HIDDEN = 16384


@triton.jit
def round_to(x, dtype: tl.constexpr, INTERPRET: tl.constexpr):
    """float32 x rounded to nearest even in dtype (the GPU's cast; the interpreter's bfloat16 cast truncates)."""
    if INTERPRET:
        if dtype == tl.bfloat16:
            bits = x.to(tl.uint32, bitcast=True)
            # add just under half an ulp of bfloat16, plus one when the kept part is odd, then drop the low half
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
            x = bits.to(tl.float32, bitcast=True)
    return x.to(dtype)


@triton.jit
def _mean(total, N: tl.constexpr, INTERPRET: tl.constexpr):
    """total / N as torch's mean finishes it on each device."""
    if INTERPRET:
        return total / N  # torch on the CPU divides the sum
    else:
        return total * (1.0 / N)  # torch on CUDA multiplies by 1/N rounded to float32


@triton.jit
def mean_of_squares(xf, N: tl.constexpr, INTERPRET: tl.constexpr):
    """sum(xf^2) / N over a float32 vector whose padding is zero, finished as torch's mean is on each device."""
    return _mean(tl.sum(xf * xf, axis=0), N, INTERPRET)


@triton.jit
def mean_of_squares_rows(xf, N: tl.constexpr, INTERPRET: tl.constexpr):
    """mean_of_squares of each row of a float32 [R, BLOCK] tile -> [R]."""
    return _mean(tl.sum(xf * xf, axis=1), N, INTERPRET)


@triton.jit
def add_rms_norm_row(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, row, n_store, eps, stride_x, stride_r,
    H: tl.constexpr, HAS_RESIDUAL: tl.constexpr, BLOCK_H: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    """(weight * rms_normalise(x + residual) of one row -> [BLOCK_H] in x's dtype, its float32 1 / rms); the first
    n_store columns are stored in out [T, H], with x + residual in res_out [T, H] (n_store = H, or 0 where another
    program stores)."""
    cols = tl.arange(0, BLOCK_H)  # [BLOCK_H]
    x = _added_row(x_ptr, res_ptr, row, cols, stride_x, stride_r, H, HAS_RESIDUAL, INTERPRET)
    if HAS_RESIDUAL:
        tl.store(res_out_ptr + row * H + cols, x, mask=cols < n_store)
    inv_rms = tl.math.rsqrt(mean_of_squares(x.to(tl.float32), H, INTERPRET) + eps)
    out = _scaled_row(x, inv_rms, w_ptr, cols, H, INTERPRET)  # [BLOCK_H]
    tl.store(out_ptr + row * H + cols, out, mask=cols < n_store)
    return out, inv_rms


@triton.jit
def rms_norm_slice(
    x_ptr, res_ptr, w_ptr, row, start, inv_rms, stride_x, stride_r,
    H: tl.constexpr, HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    """Columns start + [0, BLOCK) of add_rms_norm_row's output for the row whose 1 / rms is inv_rms, bit for bit
    (the same operations on those columns; zero past H), loaded again rather than taken from another program."""
    cols = start + tl.arange(0, BLOCK)  # [BLOCK]
    x = _added_row(x_ptr, res_ptr, row, cols, stride_x, stride_r, H, HAS_RESIDUAL, INTERPRET)
    return _scaled_row(x, inv_rms, w_ptr, cols, H, INTERPRET)


@triton.jit
def _added_row(x_ptr, res_ptr, row, cols, stride_x, stride_r, H: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
               INTERPRET: tl.constexpr):  # fmt: skip
    """x + residual at columns cols of one row, in the residual's dtype (zero past H); x float32 with a 16-bit residual
    (an MoE's unrounded slot sums) is first rounded to that dtype, as the unfused path's cast rounds it."""
    mask = cols < H
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)  # in x's dtype
    if HAS_RESIDUAL:
        x = residual_sum(x, tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0), INTERPRET)
    return x


@triton.jit
def residual_sum(x, r, INTERPRET: tl.constexpr):
    """x + r in r's dtype, added in float32 and rounded once as torch does; float32 x beside a 16-bit r (an MoE's
    unrounded slot sums) is first rounded to r's dtype, as the unfused path's cast rounds it."""
    if x.dtype != r.dtype:
        x = round_to(x.to(tl.float32), r.dtype, INTERPRET)
    return round_to(x.to(tl.float32) + r.to(tl.float32), r.dtype, INTERPRET)


@triton.jit
def _scaled_row(x, inv_rms, w_ptr, cols, H: tl.constexpr, INTERPRET: tl.constexpr):
    """weight * round(x / rms) at columns cols, in x's dtype."""
    normed = round_to(x.to(tl.float32) * inv_rms, x.dtype, INTERPRET)  # rounded before the weight, as torch does
    w = tl.load(w_ptr + cols, mask=cols < H, other=0.0)
    # a product of two 16-bit floats is exact in float32, so this is one rounding like torch's
    return round_to(w.to(tl.float32) * normed.to(tl.float32), x.dtype, INTERPRET)


@triton.jit
def _rms_norm_kernel(
    x_ptr,  # [T, H]
    res_ptr,  # [T, H] or a dummy when HAS_RESIDUAL is false
    w_ptr,  # [H]
    out_ptr,  # [T, H]
    new_res_ptr,  # [T, H] or a dummy when HAS_RESIDUAL is false
    eps,
    stride_x,
    stride_r,
    H: tl.constexpr,  # one compilation per hidden size: the model has two or three
    HAS_RESIDUAL: tl.constexpr,
    BLOCK_H: tl.constexpr,
    INTERPRET: tl.constexpr,
    PDL: tl.constexpr,
    xq_ptr=None,  # Q8: [T, K_PAD / 4] int32, [T, K_PAD / 32] and [T, K_PAD / 16] float32 (Int8Rows)
    dx_ptr=None,
    xs_ptr=None,
    K_PAD: tl.constexpr = 0,
    Q8: tl.constexpr = False,
):
    launch_dependents(PDL)
    wait_for_previous(PDL)
    row = tl.program_id(0).to(tl.int64)
    out, _ = add_rms_norm_row(x_ptr, res_ptr, w_ptr, out_ptr, new_res_ptr, row, H, eps, stride_x, stride_r, H,
                              HAS_RESIDUAL, BLOCK_H, INTERPRET)  # fmt: skip
    if Q8:  # BLOCK_H >= K_PAD: the padding columns are zeros
        quantize_store_row(out.to(tl.float32), BLOCK_H, 0, xq_ptr, dx_ptr, xs_ptr, row, K_PAD, K_PAD)


def norm_dtype(x: torch.Tensor, residual: torch.Tensor | None) -> torch.dtype:
    """The dtype a norm of x (+ residual) computes in and returns: x's, or the residual's where x is float32 beside
    it (an MoE's unrounded slot sums)."""
    return residual.dtype if residual is not None and x.dtype == torch.float32 else x.dtype


def check_norm_operands(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None) -> None:
    """Raises unless x [T, H], weight [H] and residual [T, H] (or None) are what a kernel normalising whole rows in
    registers takes: one dtype (x may also be float32 beside a residual: an MoE's unrounded sums), H at most
    MAX_HIDDEN. Shapes and dtypes only."""
    if x.dim() != 2:
        raise ValueError(f"x must be [T, H], got shape {tuple(x.shape)}")
    H = x.shape[1]
    dtype = norm_dtype(x, residual)
    if weight.shape != (H,) or weight.dtype != dtype:
        raise ValueError(f"norm weight must be [{H}] of {dtype}, got {tuple(weight.shape)} of {weight.dtype}")
    if H > MAX_HIDDEN:
        raise ValueError(f"hidden size {H} exceeds the one-row-in-registers limit {MAX_HIDDEN}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != dtype):
        raise ValueError(
            f"residual must match x {tuple(x.shape)} {x.dtype}, got {tuple(residual.shape)} {residual.dtype}"
        )


def rms_norm_triton(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight * rms_normalise(x + residual), x + residual) for x [T, H]; new_residual is x when residual is None."""
    out, new_residual, _ = _rms_norm(x, weight, eps, residual, None)
    return out, new_residual


def rms_norm_int8_triton(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None, k_pad: int
) -> tuple[torch.Tensor, torch.Tensor, Int8Rows]:
    """rms_norm_triton, plus its output rounded to int8 as int8_dot.quantize_x(out, k_pad) would give it, in the
    same launch."""
    check_k_pad(k_pad, x.shape[-1])
    out, new_residual, rows = _rms_norm(x, weight, eps, residual, k_pad)
    assert rows is not None
    return out, new_residual, rows


def _rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None, k_pad: int | None
) -> tuple[torch.Tensor, torch.Tensor, Int8Rows | None]:
    """Both entry points: checks, one launch; the int8 rows when k_pad is given."""
    check_norm_operands(x, weight, residual)
    T, H = x.shape
    if x.stride(1) != 1:
        x = x.contiguous()
    if residual is not None and residual.stride(1) != 1:
        residual = residual.contiguous()
    weight = weight.contiguous()
    out = torch.empty(T, H, dtype=weight.dtype, device=x.device)  # [T, H] (x's dtype, or float32 x's residual's)
    new_residual = torch.empty_like(out) if residual is not None else x  # [T, H]
    rows = Int8Rows.empty(T, k_pad, x.device) if k_pad is not None else None
    if T == 0:
        return out, new_residual, rows
    block_h = triton.next_power_of_2(max(H, k_pad or 0))
    # about 8 elements per thread: enough loads in flight without spilling
    num_warps = max(1, min(16, block_h // 256))
    pdl = pdl_mode(x.device, T)
    _rms_norm_kernel[(T,)](
        x,
        residual if residual is not None else x,
        weight,
        out,
        new_residual,
        eps,
        x.stride(0),
        residual.stride(0) if residual is not None else 0,
        H=H,
        HAS_RESIDUAL=residual is not None,
        BLOCK_H=block_h,
        INTERPRET=interpreting(),
        num_warps=num_warps,
        # keeps x*x and the first adds of the sum unfused, as torch's separate square and sum kernels
        enable_fp_fusion=False,
        PDL=pdl,
        **launch_options(pdl),
        **(rows.store_args() if rows is not None else {}),
    )
    return out, new_residual, rows
