"""Adam and AdamW with their moments kept in bfloat16 (``optimizer.state_dtype = "bfloat16"``).

Between steps each parameter's two moments are bfloat16: 4 bytes per parameter instead of 8. At
its update a parameter's moments are widened to float32, torch's own single-tensor Adam / AdamW
(``torch.optim.adam.adam``) updates it and them, and they are rounded back; one parameter at a
time, so a step holds float32 moments of one parameter only.

The trade-off: bfloat16 keeps 8 significant bits. An exponential average whose step is a small
fraction of its value (``1 - beta2 = 0.05`` of a squared gradient that is rarely larger than the
average) can round back to its old value, so the second moment follows the gradients more coarsely
than in float32, and the update's size with it. Use it where the memory is needed; compare losses
against float32 states before a long run (docs/optimizers.md).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.optim.adam import adam


class BF16StateAdam(torch.optim.AdamW):
    """``torch.optim.AdamW`` (or, with ``decoupled=False``, Adam) with bfloat16 moments."""

    def __init__(self, params: Any, *, decoupled: bool = True, **kwargs: Any) -> None:
        kwargs.pop("fused", None)  # one parameter at a time: torch's single-tensor path
        kwargs.pop("foreach", None)
        super().__init__(params, foreach=False, **kwargs)
        self.decoupled = decoupled

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's loading casts the moments to the parameters' dtype: back to bfloat16."""
        super().load_state_dict(state_dict)
        keep_state_dtype(self, ("exp_avg", "exp_avg_sq"), torch.bfloat16)

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = closure_loss(closure)
        for group, p, state in with_grads(self):
            if not state:
                state["step"] = torch.tensor(0.0)
                state["exp_avg"] = torch.zeros_like(p, dtype=torch.bfloat16)
                state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.bfloat16)
            exp_avg, exp_avg_sq = state["exp_avg"].float(), state["exp_avg_sq"].float()
            beta1, beta2 = group["betas"]
            adam(
                [p],
                [p.grad],
                [exp_avg],
                [exp_avg_sq],
                [],
                [state["step"]],
                foreach=False,
                decoupled_weight_decay=self.decoupled,
                amsgrad=False,
                beta1=beta1,
                beta2=beta2,
                lr=group["lr"],
                weight_decay=group["weight_decay"],
                eps=group["eps"],
                maximize=False,
            )
            state["exp_avg"].copy_(exp_avg)
            state["exp_avg_sq"].copy_(exp_avg_sq)
        return loss


def closure_loss(closure: Any) -> Any:
    """torch.optim's closure protocol: the loss the closure recomputes with gradients, or None."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


def with_grads(opt: torch.optim.Optimizer) -> Iterator[tuple[dict, torch.Tensor, dict]]:
    """``(group, parameter, its state)`` for every parameter of ``opt`` that has a gradient."""
    for group in opt.param_groups:
        for p in group["params"]:
            if p.grad is not None:
                yield group, p, opt.state[p]


def keep_state_dtype(opt: torch.optim.Optimizer, keys: tuple[str, ...], dtype: torch.dtype) -> None:
    """The state tensors named ``keys`` of every parameter of ``opt`` in ``dtype``."""
    for state in opt.state.values():
        for key in keys:
            if key in state and state[key].dtype != dtype:
                state[key] = state[key].to(dtype)
