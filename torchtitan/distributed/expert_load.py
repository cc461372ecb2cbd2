"""The trainer's side of mixture-of-experts load balancing: what an MoE layer counted during a
step, summed over the ranks, turned into the expert-bias update and the load metrics.

An MoE layer (``models/common/moe.py``; found here by its buffers, not by its class: generic code
does not import models) counts the tokens routed to each expert in ``tokens_per_expert`` and, with
an auxiliary loss, sums that loss over its sequences in ``aux_loss_sum``. Per optimizer step:

* :meth:`ExpertLoad.begin_step` zeroes the counters (a validation pass in between counted too)
  and gives each layer the weight of one sequence's auxiliary loss: the coefficient over this
  rank's sequences in the step, so the objective gets the coefficient times the global mean.
* :meth:`ExpertLoad.end_step` sums every layer's counts over all ranks in one all-reduce of an
  ``[n_layers, E + 2]`` tensor (each rank fills the rows of the layers it holds: pipeline stages
  hold different layers, data- and context-parallel ranks saw different tokens; tensor-parallel
  ranks route the same tokens, so their copies are divided out), then moves each local layer's
  bias by ``coeff * sign(mean load - load)`` (centered; DeepSeek-V3, arXiv:2412.19437 section
  2.1.2). :meth:`ExpertLoad.metrics` (at logging steps) gives the max/mean expert load of each
  MoE layer, their mean and worst, the auxiliary loss's mean and the largest bias.

Every rank applies the same update from the same sums, so the biases of a layer's copies stay
equal without communication, and the update is the one a single process would make.
"""

from __future__ import annotations

import re

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["ExpertLoad", "moe_layers"]

# ``layers.N.`` or a multi-token-prediction depth's ``mtp_layers.N.`` (N after the main layers)
_LAYER = re.compile(r"(?:^|\.)(?:mtp_)?layers\.(\d+)\.")


def moe_layers(parts: list[nn.Module]) -> dict[int, nn.Module]:
    """``{layer id: MoE module}`` over this rank's model parts."""
    found = {}
    for part in parts:
        for name, module in part.named_modules():
            if hasattr(module, "tokens_per_expert") and hasattr(module, "expert_bias"):
                m = _LAYER.search(name + ".")
                if m is None:
                    raise ValueError(f"MoE module {name!r} is not inside a numbered layer")
                found[int(m.group(1))] = module
    return found


class ExpertLoad:
    """``parts``: this rank's model parts; ``n_layers``: the whole model's; ``coeff``: the bias
    update rate (0: no update); ``aux_coeff``: the auxiliary loss's weight; ``tp``: the
    tensor-parallel degree (its ranks count the same tokens)."""

    def __init__(
        self,
        parts: list[nn.Module],
        n_layers: int,
        *,
        coeff: float,
        aux_coeff: float,
        tp: int,
        device: torch.device | str = "cpu",
    ) -> None:
        self.layers = moe_layers(parts)
        self.n_layers, self.coeff, self.aux_coeff, self.tp = n_layers, coeff, aux_coeff, tp
        self.device = device
        n_experts = next(iter(self.layers.values())).num_experts if self.layers else 0
        if dist.is_initialized() and dist.get_world_size() > 1:
            # A pipeline stage may hold no MoE layer (the last one: norm and output alone); it
            # still joins every step's sums, or its peers would wait for it forever.
            found = torch.tensor([n_experts], device=device)
            dist.all_reduce(found, op=dist.ReduceOp.MAX)
            n_experts = int(found)
        self.n_experts = n_experts

    def __bool__(self) -> bool:
        """Whether the model has MoE layers (on any rank: every rank joins the sums)."""
        return self.n_experts > 0

    def begin_step(self, n_sequences: int) -> None:
        """Zero the counters; each sequence's auxiliary loss weighs ``aux_coeff / n_sequences``."""
        for layer in self.layers.values():
            layer.tokens_per_expert.zero_()
            layer.aux_loss_sum.zero_()
            layer.aux_loss_scale = self.aux_coeff / max(n_sequences, 1)

    @torch.no_grad()
    def end_step(self) -> None:
        """Sum the step's counts over the ranks and update the biases (every rank, every step)."""
        table = torch.zeros(self.n_layers, self.n_experts + 2, device=self.device)
        for i, layer in self.layers.items():
            table[i, :-2] = layer.tokens_per_expert
            table[i, -2:] = layer.aux_loss_sum
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(table)
            table /= self.tp
        load, aux = table[:, :-2], table[:, -2:]
        if self.coeff > 0:
            for i, layer in self.layers.items():
                delta = self.coeff * torch.sign(load[i].mean() - load[i])
                layer.expert_bias.add_(delta - delta.mean())
        self._last = (load, aux)

    @torch.no_grad()
    def metrics(self) -> dict[str, float]:
        """The last step's load and auxiliary loss, and the largest bias now (every rank calls
        it: the biases of other pipeline stages' layers come by one all-reduce)."""
        load, aux = self._last
        bias = torch.zeros(self.n_layers, device=load.device)
        for i, layer in self.layers.items():
            bias[i] = layer.expert_bias.abs().max()
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(bias, op=dist.ReduceOp.MAX)
        rows = load.sum(-1) > 0  # the MoE layers (any rank's)
        ratio = load.max(-1).values / load.mean(-1).clamp(min=1e-9)
        values = {
            f"moe/load_max_over_mean/layer_{i}": float(ratio[i]) for i in rows.nonzero()[:, 0]
        }
        if rows.any():
            worst = int(torch.where(rows, ratio, 0).argmax())
            values["moe/load_max_over_mean"] = float(ratio[rows].mean())
            values["moe/load_max_over_mean_worst"] = float(ratio[worst])
            values["moe/load_worst_layer"] = float(worst)
        if aux[:, 1].sum() > 0:
            values["moe/aux_loss"] = float(aux[:, 0].sum() / aux[:, 1].sum())
        values["moe/expert_bias_abs_max"] = float(bias.max())
        return values
