"""Layout-invariant weight initialization.

Under FSDP or TP a parameter is a DTensor: each rank holds a slice, and running the model's own
``init_weights`` on the slices with the ordinary RNG would give every layout different weights
(and pipeline stages, which skip other stages' layers, different RNG streams). Inside
:func:`layout_invariant_init`, every random fill of a parameter (``uniform_``, ``normal_`` and the
``nn.init`` functions built on them) instead

1. draws the *full* tensor from an RNG seeded by ``(seed, parameter name)`` alone, and
2. keeps the slice this rank owns.

So the weights depend on the seed and the parameter names only: one process, DDP, FSDP, TP and
pipeline stages all start from the same model. The cost is one full-size temporary tensor at a
time. The model's own init code is unchanged (it stays free of parallelism).
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.overrides import TorchFunctionMode

_RANDOM_FILLS = {
    torch.Tensor.uniform_,
    torch.Tensor.normal_,
    nn.init.uniform_,
    nn.init.normal_,
    nn.init.trunc_normal_,
}


_WRAPPER_PARTS = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")


def canonical_name(name: str) -> str:
    """A parameter's name with wrapper prefixes (activation checkpointing, compile) removed."""
    for part in _WRAPPER_PARTS:
        name = name.replace(part, "")
    return name


def param_seed(seed: int, name: str) -> int:
    """A 63-bit seed from the run's seed and a parameter's fully qualified name."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little") >> 1


class _InitMode(TorchFunctionMode):
    def __init__(self, names: dict[int, str], seed: int):
        super().__init__()
        self.names = names
        self.seed = seed

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func not in _RANDOM_FILLS:
            return func(*args, **kwargs)
        # nn.init functions arrive with the tensor as keyword ``tensor``; methods as args[0].
        target = args[0] if args else kwargs.get("tensor")
        if id(target) not in self.names:
            return func(*args, **kwargs)
        local = target.to_local() if isinstance(target, DTensor) else target
        full = torch.empty(target.shape, dtype=local.dtype, device=local.device)
        generator = torch.Generator(device=local.device)
        generator.manual_seed(param_seed(self.seed, self.names[id(target)]))
        if args:
            func(full, *args[1:], **{**kwargs, "generator": generator})
        else:
            func(**{**kwargs, "tensor": full, "generator": generator})
        if isinstance(target, DTensor):
            full = distribute_tensor(
                full, target.device_mesh, target.placements, src_data_rank=None
            ).to_local()
        with torch.no_grad():
            local.copy_(full)
        return target


@contextlib.contextmanager
def layout_invariant_init(model: nn.Module, seed: int) -> Iterator[None]:
    """Within this context, random fills of ``model``'s parameters are layout-invariant."""
    names: dict[int, str] = {}
    for name, param in model.named_parameters():  # tied parameters keep their first name
        names.setdefault(id(param), canonical_name(name))
    with _InitMode(names, seed):
        yield
