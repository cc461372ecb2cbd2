"""RMSNorm with a Triton kernel for the forward and one for the backward
(``model.norm_type = "fused_rmsnorm"``; the module is :class:`torchtitan.models.common.norms.rmsnorm.FusedRMSNorm`).

Same math and dtypes as :func:`torchtitan.models.common.norms.rmsnorm.rms_norm`: float32 statistics, the
normalized row rounded to the input's dtype, then times ``weight``. The kernels are in
:mod:`torchtitan.models.common.norms.fused_kernels`, imported only when one runs, so importing this
module (or the model) does not import triton. What the forward saves for the backward is the
input and a float32 reciprocal RMS per row, nothing else.

Pieces:

* two custom ops, ``torch.ops.torchtitan.fused_rms_norm_fwd`` and ``..._bwd``, on rows
  ``[M, N]``. Being custom ops with a shape-only (fake) implementation, they trace under
  ``torch.compile`` (``compile.enable``) and on fake or meta tensors
  (``scripts/estimate_memory.py``, meta-device models) without running a kernel;
* :class:`FusedRMSNormFunction`, the ``torch.autograd.Function`` that flattens any leading shape
  to rows, calls the forward op, saves ``(x, rstd)`` and calls the backward op.

Where it runs: the Triton kernels run on CUDA tensors, and on CPU tensors when
``TRITON_INTERPRET=1`` is set and triton is installed (Triton's interpreter; the tests use it).
On any other tensor the ops compute the same formulas with PyTorch operations. That path exists
for tests of the wiring on machines without a GPU: preflight refuses ``fused_rmsnorm`` where there
is no CUDA GPU, so training never takes it.
"""

from __future__ import annotations

import importlib.util
import os

import torch

__all__ = ["FusedRMSNormFunction", "fused_rms_norm", "uses_triton"]

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def uses_triton(x: torch.Tensor) -> bool:
    """Whether the ops run the Triton kernels on ``x`` (CUDA, or CPU under the interpreter)."""
    if x.is_cuda:
        return True
    return (
        x.device.type == "cpu"
        and os.environ.get("TRITON_INTERPRET") == "1"
        and importlib.util.find_spec("triton") is not None
    )


def _check_rows(x: torch.Tensor, weight: torch.Tensor) -> None:
    if x.dim() != 2 or not x.is_contiguous() or weight.shape != (x.shape[1],):
        raise ValueError(
            f"fused_rmsnorm: needs contiguous rows [M, N] and a weight [N]; got "
            f"{tuple(x.shape)} and {tuple(weight.shape)}"
        )
    if x.dtype not in _DTYPES or weight.dtype not in _DTYPES:
        raise TypeError(
            f"fused_rmsnorm: supports float32, bfloat16 and float16; got {x.dtype} and "
            f"{weight.dtype}"
        )


# ----------------------------------------------------------------------------- custom ops


@torch.library.custom_op("torchtitan::fused_rms_norm_fwd", mutates_args=())
def _fwd_op(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows ``x [M, N]`` -> (``y [M, N]`` in the promoted dtype, ``rstd [M]`` float32)."""
    _check_rows(x, weight)
    if uses_triton(x):
        from torchtitan.models.common.norms import fused_kernels as fused_rmsnorm_kernels

        return fused_rmsnorm_kernels.rms_norm_fwd(x, weight.contiguous(), eps)
    x32 = x.float()
    rstd = torch.rsqrt(x32.pow(2).mean(-1) + eps)
    y = (x32 * rstd.unsqueeze(-1)).to(x.dtype) * weight
    return y, rstd


@_fwd_op.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    y = x.new_empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype))
    return y, x.new_empty((x.shape[0],), dtype=torch.float32)


@torch.library.custom_op("torchtitan::fused_rms_norm_bwd", mutates_args=())
def _bwd_op(
    dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of ``fused_rms_norm_fwd``: (``dx`` like ``x``, ``dweight`` like ``weight``)."""
    _check_rows(x, weight)
    if uses_triton(x):
        from torchtitan.models.common.norms import fused_kernels as fused_rmsnorm_kernels

        return fused_rmsnorm_kernels.rms_norm_bwd(dy.contiguous(), x, weight.contiguous(), rstd)
    n = x.float() * rstd.unsqueeze(-1)
    dy32 = dy.float()
    dn = dy32 * weight.float()
    dx = (dn - n * (dn * n).mean(-1, keepdim=True)) * rstd.unsqueeze(-1)
    dw = (dy32 * n.to(x.dtype).float()).sum(0)
    return dx.to(x.dtype), dw.to(weight.dtype)


@_bwd_op.register_fake
def _(
    dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(x), torch.empty_like(weight)


# ----------------------------------------------------------------------------- autograd


class FusedRMSNormFunction(torch.autograd.Function):
    """``rms_norm(x, weight, eps)`` for any leading shape of ``x``; saves ``x`` and ``rstd``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1]).contiguous()
        y, rstd = _fwd_op(rows, weight, eps)
        ctx.save_for_backward(rows, weight, rstd)
        ctx.x_shape = x.shape
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        rows, weight, rstd = ctx.saved_tensors
        dx, dw = _bwd_op(dy.reshape(rows.shape).contiguous(), rows, weight, rstd)
        return dx.view(ctx.x_shape), dw, None


def fused_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Functional form on plain tensors (``FusedRMSNorm`` handles DTensors)."""
    return FusedRMSNormFunction.apply(x, weight, eps)
