"""The LoRA linear layer (Hu et al., 2021, "LoRA: Low-Rank Adaptation of Large Language Models",
arXiv:2106.09685) and its tensor-parallel styles.

``y = x W^T + b + (alpha / r) * dropout(x) A^T B^T``: the frozen base ``W [out, in]`` (and
bias) plus a trained low-rank update, ``A [r, in]`` and ``B [out, r]``. ``B`` starts at zero, so
training starts from the base model exactly; ``A`` starts as ``nn.Linear`` initializes its weight
(Kaiming-uniform with ``a = sqrt(5)``), as ``peft``'s default does. The layer is an
``nn.Linear`` (its ``weight`` and ``bias`` keep their names, so base checkpoints load into it)
with two more parameters, ``lora_a`` and ``lora_b``.

Tensor parallel: a column-wise layer shards ``W``'s rows, so ``B``'s rows go with them and ``A``
is replicated; a row-wise layer shards ``W``'s columns, so ``A``'s columns go with them and ``B``
is replicated: each rank's ``B A_r x_r`` is then a partial sum, reduced with the base output's.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel


class LoRALinear(nn.Linear):
    """``nn.Linear`` plus a low-rank update of rank ``rank`` scaled by ``alpha / rank`` (see the
    module docstring); ``dropout`` applies to the update's input only."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        bias: bool,
        rank: int,
        alpha: float,
        dropout: float = 0.0,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.rank, self.alpha, self.dropout = rank, alpha, dropout
        self.scale = alpha / rank
        self.lora_a = nn.Parameter(torch.empty(rank, in_features, device=device, dtype=dtype))
        self.lora_b = nn.Parameter(torch.empty(out_features, rank, device=device, dtype=dtype))

    @classmethod
    def around(cls, linear: nn.Linear, *, rank: int, alpha: float, dropout: float) -> LoRALinear:
        """A LoRA layer whose base is ``linear``'s weight and bias (the same tensors)."""
        w = linear.weight
        out = cls(
            linear.in_features,
            linear.out_features,
            bias=linear.bias is not None,
            rank=rank,
            alpha=alpha,
            dropout=dropout,
            device=w.device,
            dtype=w.dtype,
        )
        out.weight = linear.weight
        out.bias = linear.bias
        return out

    def init_added_parameters(self) -> None:
        """``A`` as ``nn.Linear`` initializes a weight, ``B`` zero (the update starts at 0).
        Kaiming-uniform with ``a = sqrt(5)`` is uniform on ``+-1 / sqrt(in)``; written as the
        ``uniform_`` it is, which layout-invariant init seeds by the parameter's name
        (``distributed/param_init.py``)."""
        bound = 1 / math.sqrt(self.in_features)
        nn.init.uniform_(self.lora_a, -bound, bound)
        nn.init.zeros_(self.lora_b)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        base = F.linear(x, self.weight, self.bias)
        h = F.dropout(x, self.dropout, self.training) if self.dropout else x
        return base + F.linear(F.linear(h, self.lora_a), self.lora_b) * self.scale

    def delta(self) -> torch.Tensor:
        """The update ``(alpha / r) B A`` as a weight ``[out, in]`` (full tensors)."""
        return (self.lora_b @ self.lora_a) * self.scale

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, rank={self.rank}, alpha={self.alpha:g}, dropout={self.dropout:g}"


def _distribute(module: nn.Module, name: str, mesh, placement) -> None:
    param = getattr(module, name)
    dist = distribute_tensor(param, mesh, [placement])
    module.register_parameter(name, nn.Parameter(dist, requires_grad=param.requires_grad))


class LoRAColwiseParallel(ColwiseParallel):
    """``ColwiseParallel`` for a :class:`LoRALinear`: ``B`` sharded by rows with ``W``, ``A``
    replicated."""

    def _partition_linear_fn(self, name, module, device_mesh):  # noqa: ARG002 - torch's signature
        for param in ("weight", "bias", "lora_b"):
            if getattr(module, param, None) is not None:
                _distribute(module, param, device_mesh, Shard(0))
        _distribute(module, "lora_a", device_mesh, Replicate())


class LoRARowwiseParallel(RowwiseParallel):
    """``RowwiseParallel`` for a :class:`LoRALinear`: ``A`` sharded by columns with ``W``, ``B``
    replicated (its output is a partial sum, reduced with the base's)."""

    def _partition_linear_fn(self, name, module, device_mesh):  # noqa: ARG002 - torch's signature
        _distribute(module, "weight", device_mesh, Shard(1))
        _distribute(module, "lora_a", device_mesh, Shard(1))
        _distribute(module, "lora_b", device_mesh, Replicate())
        if module.bias is not None:
            _distribute(module, "bias", device_mesh, Replicate())


def is_lora(module: nn.Module) -> bool:
    return isinstance(module, LoRALinear)
