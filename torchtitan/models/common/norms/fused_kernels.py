"""Triton kernels of ``fused_rmsnorm`` and their launchers; imports triton, so only
:mod:`torchtitan.models.common.norms.fused` imports this module, and only when a kernel runs.

Both kernels take the input as rows ``x [M, N]`` (contiguous) and hold one whole row in a block
of ``BLOCK_N = next_power_of_2(N)`` lanes; the lanes past ``N`` are masked, so any width works.
All arithmetic is float32 whatever the storage dtype (bf16, fp16 or fp32).

* forward, one program per row: ``rstd = 1 / sqrt(mean(x^2) + eps)`` (saved, float32 ``[M]``),
  ``y = cast_x(x * rstd) * weight`` rounded once to the output dtype (the promoted dtype of
  ``x`` and ``weight``: the reference rounds the normalized row to ``x``'s dtype before the
  scale, and so does the kernel).
* backward, each program a contiguous run of rows: with ``n = x * rstd`` and
  ``dn = dy * weight``, ``dx = rstd * (dn - n * mean(dn * n))``; ``dy * cast_x(n)`` is added to a
  float32 ``[N]`` accumulator that the program stores as its partial sum of the weight gradient.
  The launcher sums the partials (one row per program) and casts to the weight's dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# One row lives in registers: 64k float32 lanes is far above any Llama width (16384 for 405B).
MAX_BLOCK_N = 65536


@triton.jit
def _round(x, dtype: tl.constexpr):
    """float32 ``x`` rounded to the nearest value of ``dtype`` (ties to even), kept in float32.

    bfloat16 is rounded with integer operations rather than by a cast: a cast rounds to nearest
    on a GPU but truncates under Triton's interpreter (3.9), so this way both compute the same
    bits, and then the final cast of an already representable value is exact on both."""
    if dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
        quiet_nan = ((bits | 0x400000) >> 16) << 16  # a NaN stays NaN (adding could carry)
        y = tl.where(x != x, quiet_nan, rounded).to(tl.float32, bitcast=True)
    elif dtype == tl.float16:
        y = x.to(tl.float16).to(tl.float32)
    else:
        y = x
    return y


@triton.jit
def _rms_norm_fwd_kernel(
    X,
    W,
    Y,
    RSTD,
    N,
    eps,
    BLOCK_N: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < N
    x = tl.load(X + row * N + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / N + eps)
    tl.store(RSTD + row, rstd)
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    normed = _round(x * rstd, X.dtype.element_ty)
    y = _round(normed * w, Y.dtype.element_ty)
    tl.store(Y + row * N + cols, y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _rms_norm_bwd_kernel(
    DY,
    X,
    W,
    RSTD,
    DX,
    DW_PARTIAL,
    M,
    N,
    rows_per_program,
    BLOCK_N: tl.constexpr,
):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < N
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK_N], dtype=tl.float32)
    first = pid.to(tl.int64) * rows_per_program  # int64 rows: M * N may exceed 2**31
    last = tl.minimum(first + rows_per_program, M)
    for row in range(first, last):
        offsets = row * N + cols
        x = tl.load(X + offsets, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + offsets, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + row)
        n = x * rstd
        dn = dy * w
        dot = tl.sum(dn * n, axis=0) / N
        dx = _round((dn - n * dot) * rstd, DX.dtype.element_ty)
        tl.store(DX + offsets, dx.to(DX.dtype.element_ty), mask=mask)
        dw += dy * _round(n, X.dtype.element_ty)
    tl.store(DW_PARTIAL + pid.to(tl.int64) * N + cols, dw, mask=mask)


def _block_and_warps(n: int) -> tuple[int, int]:
    block = triton.next_power_of_2(n)
    if block > MAX_BLOCK_N:
        raise ValueError(f"fused_rmsnorm: row width {n} is above the kernel's limit {MAX_BLOCK_N}")
    return block, min(max(block // 512, 1), 16)


def _backward_programs(x: torch.Tensor, m: int) -> int:
    """Programs of the backward: a few per SM on a GPU (each adds one partial row of the weight
    gradient), a handful under the interpreter (which runs programs one after the other)."""
    if x.is_cuda:
        target = 4 * torch.cuda.get_device_properties(x.device).multi_processor_count
    else:
        target = 4
    return max(1, min(m, target))


def rms_norm_fwd(
    x: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [M, N]`` contiguous, ``weight [N]`` -> (``y [M, N]``, ``rstd [M]`` float32)."""
    m, n = x.shape
    block, warps = _block_and_warps(n)
    y = torch.empty((m, n), dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    rstd = torch.empty((m,), dtype=torch.float32, device=x.device)
    if m:
        _rms_norm_fwd_kernel[(m,)](x, weight, y, rstd, n, eps, BLOCK_N=block, num_warps=warps)
    return y, rstd


def rms_norm_bwd(
    dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of :func:`rms_norm_fwd`: (``dx`` like ``x``, ``dweight`` like ``weight``)."""
    m, n = x.shape
    block, warps = _block_and_warps(n)
    dx = torch.empty_like(x)
    if not m:
        return dx, torch.zeros_like(weight)
    programs = _backward_programs(x, m)
    rows_per_program = triton.cdiv(m, programs)
    programs = triton.cdiv(m, rows_per_program)
    partial = torch.empty((programs, n), dtype=torch.float32, device=x.device)
    _rms_norm_bwd_kernel[(programs,)](
        dy, x, weight, rstd, dx, partial, m, n, rows_per_program, BLOCK_N=block, num_warps=warps
    )
    return dx, partial.sum(0).to(weight.dtype)
