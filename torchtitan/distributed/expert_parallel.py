"""Expert parallelism: each rank of an EP group holds ``E / ep`` of an MoE layer's routed experts,
and every token goes to the rank of its expert and back by all-to-all.

The MoE layer (``models/common/moe.py``) calls its experts as ``experts(x, counts)``: the routed
copies of its tokens sorted by expert, and ``counts [E]`` rows per expert. :class:`ExpertParallel`
wraps that call and nothing else, so the layer's math is untouched:

* the parameters ``w1``/``w2``/``w3`` ``[E, ...]`` (and their biases, where the experts have
  them) become DTensors sharded on dim 0 over the EP ranks (and, with the experts split over
  tensor parallel, on their hidden dim over the TP ranks too, ``w2_bias`` whole: a 2-D mesh; whole experts under TP get their rows' share from ``SplitRoutedRows`` in
  ``tensor_parallel.py``, which runs before the dispatch);
* before the call (**dispatch**): the ranks exchange their ``counts`` (one all-to-all of ``E``
  integers), send each rank the rows of its experts (``all_to_all_single`` with autograd: the
  backward sends the gradients back the same way), and regroup what arrived, which comes
  rank by rank, expert by expert, into expert by expert, rank by rank, the order the grouped
  matmul wants;
* after it (**combine**): the inverse regrouping and the all-to-all back, so the layer receives
  its own rows' outputs in the order it sent them.

The splits are host integers (the all-to-all needs them), so the two steps run eagerly: under
``torch.compile`` they are graph breaks (``torch.compiler.disable``) and the rest of the block is
compiled around them.

The gradients of the expert weights: an EP rank's expert sees the tokens of all ``ep`` ranks of
its group, each rank's loss being already scaled for the average over all data-parallel ranks,
so their FSDP reduction over the remaining ``efsdp`` ranks must divide by all of them (the
``gradient divide factor`` set in ``parallelize.py``), not by ``efsdp`` alone.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle

__all__ = ["EXPERT_WIDTH_DIMS", "ExpertParallel", "exchange_counts", "regroup_index"]

# the hidden dim of each stacked expert parameter, which tensor parallel shards (None: the
# parameter has none, and each rank holds it whole: the output bias)
EXPERT_WIDTH_DIMS: dict[str, int | None] = {
    "w1": 1,
    "w3": 1,
    "w2": 2,
    "w1_bias": 1,
    "w3_bias": 1,
    "w2_bias": None,
}


def exchange_counts(
    counts: torch.Tensor, rows: int, ep: int, group: dist.ProcessGroup
) -> tuple[torch.Tensor, list[int], list[int]]:
    """The dispatch's bookkeeping for this rank's ``counts [E]`` (``rows`` in all, ``len(x)``):
    ``received [ep, E / ep]``, the rows each rank of the EP group sends to each expert of this
    rank (one all-to-all of the counts), and, as host integers, the rows this rank sends to each
    rank and receives from each.

    A module-level function so that ``scripts/estimate_memory.py`` can replace it: fake tensors
    have no values, so the estimate assumes balanced routing (each expert ``rows / E``), which
    needs only ``rows``. Training reads the real counts and does not use ``rows``."""
    received = torch.empty_like(counts)
    dist.all_to_all_single(received, counts, group=group)
    sent_splits = counts.view(ep, -1).sum(1).tolist()
    received = received.view(ep, -1)  # [source rank, local expert]
    return received, sent_splits, received.sum(1).tolist()


def regroup_index(counts: torch.Tensor, total: int | None = None) -> torch.Tensor:
    """For rows laid out block by block in row-major order of ``counts [A, B]`` (block ``(a, b)``
    holds ``counts[a, b]`` rows), the row indices that lay them out in column-major block order:
    ``rows[regroup_index(counts)]`` is ``(0, 0), (1, 0), ..., (0, 1), (1, 1), ...``. ``total``:
    ``counts.sum()`` when the caller has it on the host (no device sync to read it)."""
    sizes = counts.flatten()
    starts = sizes.cumsum(0) - sizes  # where each block starts, row-major
    by_column = counts.t().flatten()
    new_starts = by_column.cumsum(0) - by_column  # where it starts, column-major
    shift = starts.view(counts.shape).t().flatten() - new_starts
    total = int(sizes.sum()) if total is None else total
    return torch.arange(total, device=counts.device) + shift.repeat_interleave(
        by_column, output_size=total
    )


class ExpertParallel(ParallelStyle):
    """Apply to an MoE layer's ``experts`` with ``device_mesh`` the EP mesh, or the 2-D
    ``("ep", "tp")`` mesh when the experts are split over tensor parallel too."""

    def __init__(self) -> None:
        super().__init__()
        self._state: tuple[Any, ...] | None = None

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        ep_mesh = device_mesh["ep"] if device_mesh.ndim > 1 else device_mesh
        self.group = ep_mesh.get_group()
        self.ep = ep_mesh.size()
        return distribute_module(
            module,
            device_mesh,
            partition_fn=self._partition,
            input_fn=self._dispatch,
            output_fn=self._combine,
        )

    @staticmethod
    def _partition(name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        for pname, hidden in EXPERT_WIDTH_DIMS.items():
            if getattr(module, pname) is None:  # experts without biases
                continue
            width = Replicate() if hidden is None else Shard(hidden)
            placements = [Shard(0)] + ([width] if mesh.ndim > 1 else [])
            local = getattr(module, pname)
            param = nn.Parameter(distribute_tensor(local, mesh, placements), local.requires_grad)
            module.register_parameter(pname, param)

    @torch.compiler.disable
    def _dispatch(self, module: nn.Module, inputs: tuple[Any, ...], mesh: DeviceMesh) -> Any:
        x, counts = inputs
        received, sent_splits, received_splits = exchange_counts(
            counts.to(torch.int64), x.shape[0], self.ep, self.group
        )
        rows = funcol.all_to_all_single_autograd(
            x.contiguous(), received_splits, sent_splits, self.group
        )
        rows = funcol.wait_tensor(rows)
        # rank by rank -> expert by expert
        order = regroup_index(received, sum(received_splits))
        self._state = (order, sent_splits, received_splits)
        return rows[order], received.sum(0)

    @torch.compiler.disable
    def _combine(self, module: nn.Module, out: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
        order, sent_splits, received_splits = self._state
        self._state = None
        back = torch.empty_like(out).index_copy(0, order, out)  # expert by expert -> rank by rank
        result = funcol.all_to_all_single_autograd(back, sent_splits, received_splits, self.group)
        return funcol.wait_tensor(result)
