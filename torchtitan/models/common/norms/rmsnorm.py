"""RMSNorm and its implementations, chosen by ``model.norm_type`` (``ModelArgs.norm_type``).

Every implementation is an :class:`RMSNorm`: one parameter ``weight`` of shape ``[dim]``,
initialized to ones by ``reset_parameters``, so checkpoints, Hugging Face conversion and
parallelisms do not depend on the choice. The math is :func:`rms_norm` in each:

* ``rmsnorm``: :class:`RMSNorm`, eager PyTorch operations (the reference);
* ``compiled_rmsnorm``: :class:`CompiledRMSNorm`, the same function through ``torch.compile``
  (one generated kernel for the forward and one for the backward, CPU or GPU);
* ``fused_rmsnorm``: :class:`FusedRMSNorm`, hand-written Triton kernels for the forward and the
  backward (:mod:`torchtitan.models.common.norms.fused`); CUDA only (preflight refuses it elsewhere).

Tensor parallel: sequence-parallel norms receive DTensors sharded along the sequence, with the
weight replicated. The reference computes on them with DTensor operations. The compiled and fused
norms run on each rank's local rows instead (:func:`on_local_rows`) and wrap the result back, so
the kernels only ever see plain tensors.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate

from torchtitan.distributed.utils import waited
from torchtitan.models.common.norms.fused import fused_rms_norm

__all__ = [
    "NORM_TYPES",
    "rms_norm",
    "RMSNorm",
    "CompiledRMSNorm",
    "FusedRMSNorm",
    "ZeroCenteredRMSNorm",
    "build_norm",
    "on_local_rows",
]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / sqrt(mean(x^2) + eps) * weight`` over the last dim, accumulated in float32.

    In float32 (``x`` and ``weight``) this is torch's own ``F.rms_norm``: one ``aten`` op, with
    the same numbers. In lower precision the normalized ``x`` is cast back to ``x``'s dtype before
    the scale (``transformers``' rounding, which the fused Triton kernel reproduces bit for bit;
    ``F.rms_norm`` rounds once, at the end), and the result has the promoted dtype of ``x`` and
    ``weight``.
    """
    if x.dtype == weight.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return normed.type_as(x) * weight


NormFn = Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]


def on_local_rows(fn: NormFn, x: DTensor, weight: torch.Tensor, eps: float) -> DTensor:
    """``fn(x, weight, eps)`` for a DTensor ``x`` whose rows are whole on each rank: ``fn`` runs on
    the local rows and the result gets ``x``'s placements. The weight (replicated on ``x``'s mesh)
    is used locally with a gradient declared ``Partial`` along the mesh dims that split the rows
    (each rank's gradient is the sum over its own rows): DTensor then reduces it as it does for
    the reference norm, whose weight gradient is ``Partial`` there too."""
    last = x.ndim - 1
    for p in x.placements:
        if p.is_partial() or (p.is_shard() and p.dim % x.ndim == last):
            raise ValueError(
                f"RMSNorm on local rows: a DTensor input with placements {x.placements} splits "
                "or reduces the normalized (last) dimension; each rank needs whole rows"
            )
    if not isinstance(weight, DTensor) or weight.device_mesh != x.device_mesh:
        raise TypeError("RMSNorm on local rows: a DTensor input needs a DTensor weight on its mesh")
    if not all(p.is_replicate() for p in weight.placements):
        raise ValueError(
            f"RMSNorm on local rows: the weight must be replicated; got {weight.placements}"
        )
    local = waited(x.to_local())  # the embedding's reduce-scatter output may still be in flight
    grad_placements = [Partial() if p.is_shard() else Replicate() for p in x.placements]
    out = fn(local, weight.to_local(grad_placements=grad_placements), eps)
    return DTensor.from_local(
        out, x.device_mesh, x.placements, run_check=False, shape=x.shape, stride=x.stride()
    )


class RMSNorm(nn.Module):
    """Root-mean-square layer norm with a learned scale, computed in float32 and cast back."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


@functools.cache
def _compiled_rms_norm() -> NormFn:
    # One compiled function for every norm, compiled on first use (per dtype and shape family).
    # Inside a block that is compiled as a whole (compile.enable), dynamo inlines it.
    return torch.compile(rms_norm)


class CompiledRMSNorm(RMSNorm):
    """:class:`RMSNorm` with :func:`rms_norm` run through ``torch.compile``; same parameter, same
    results up to floating-point rounding (the generated kernel may order the sum differently)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if isinstance(x, DTensor):
            # On the local rows: plain tensors in the compiled graph. (Compiling this function
            # on DTensor inputs works, but on torch 2.13 CPU a second process that loads the graph
            # from the warm AOTAutograd cache crashes with a segmentation fault.)
            return on_local_rows(_compiled_rms_norm(), x, self.weight, self.eps)
        return _compiled_rms_norm()(x, self.weight, self.eps)


class FusedRMSNorm(RMSNorm):
    """:class:`RMSNorm` computed by the Triton kernels of :mod:`torchtitan.models.common.norms.fused`
    (on CUDA; see there for the PyTorch path it takes on tensors elsewhere)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if isinstance(x, DTensor):
            return on_local_rows(fused_rms_norm, x, self.weight, self.eps)
        return fused_rms_norm(x, self.weight, self.eps)


class ZeroCenteredRMSNorm(RMSNorm):
    """RMSNorm whose learned scale is ``1 + weight``, ``weight`` starting at zero (Qwen3-Next,
    so that weight decay pulls the scale to one, not to zero). As ``transformers``'
    ``Qwen3NextRMSNorm``: normalized and scaled in float32, rounded once at the end. A different
    parameter from :class:`RMSNorm`'s (its zero is their one): a model chooses it by its
    architecture, not ``norm_type``."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__(dim, eps)
        self.reset_parameters()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * (1.0 + self.weight.float())).type_as(x)

    def reset_parameters(self) -> None:
        nn.init.zeros_(self.weight)


_NORMS = {"rmsnorm": RMSNorm, "compiled_rmsnorm": CompiledRMSNorm, "fused_rmsnorm": FusedRMSNorm}
NORM_TYPES = tuple(_NORMS)


def build_norm(norm_type: str, dim: int, eps: float, zero_centered: bool = False) -> RMSNorm:
    """The RMSNorm implementation ``norm_type`` (one of :data:`NORM_TYPES`) names; with
    ``zero_centered``, :class:`ZeroCenteredRMSNorm` (its reference implementation only)."""
    if norm_type not in _NORMS:
        raise ValueError(f"norm_type {norm_type!r} is not one of: {', '.join(NORM_TYPES)}")
    if zero_centered:
        if norm_type != "rmsnorm":
            raise ValueError(
                f"model.norm_type {norm_type!r}: this model's norms are zero-centered, which "
                "only 'rmsnorm' implements; use it"
            )
        return ZeroCenteredRMSNorm(dim, eps=eps)
    return _NORMS[norm_type](dim, eps=eps)
