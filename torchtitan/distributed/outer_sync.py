"""Semi-synchronous replica groups (``fault_tolerance.semi_sync_method``): each group takes
``sync_steps`` inner steps alone (its own optimizer, its own part of the data), then the live
groups meet through torchft (:class:`~torchtitan.distributed.replica_groups.ReplicaGroups`:
quorum, average, commit vote) at the steps that are multiples of ``sync_steps``:

- ``local_sgd`` (Stich, arXiv:1805.09767): the groups' weights are averaged.
- ``diloco`` (Douillard et al., arXiv:2311.08105): each group's change since the last sync
  (the synced weights minus its own, the "pseudo-gradient") is averaged and applied to the
  synced weights by an outer SGD with Nesterov momentum (the paper's lr 0.7, momentum 0.9);
  the result is every group's new weights (``fragment_update_alpha`` mixes a share of the
  group's own back in, as torchft's streaming DiLoCo does).

The groups also sync after the last step, so that they end together. A sync that a group's
death breaks is not committed: with DiLoCo every group goes back to the synced weights of the
last sync, and the inner steps since are lost (the step count goes on); with local SGD each
keeps its own. A group behind the others (restarted) takes the live groups' state at its first
sync, DiLoCo's synced weights and outer momentum included, and is left out of that sync's
average (it would count its source twice); all leave the sync with the same weights, bit for
bit (with ``fragment_update_alpha`` 0). DiLoCo's groups also compare a fingerprint of their
synced weights at every sync: those that differ (started from other weights, or a sync one of
them made alone) take the lowest-numbered group's state.

DiLoCo's state (the synced weights and the outer momentum, this rank's shards) is saved in the
checkpoints, so a group resumes a save from between two syncs exactly; a run that starts from
weights without it (a fresh run, ``initial_load_path``, a checkpoint of every-step groups) takes
its weights at the first step as the synced ones.

The sync is driven by the training loop at the step count, not by torchft's ``DiLoCo`` /
``LocalSGD`` (optimizer hooks with their own counter): a restarted group resumes between two
syncs and must meet the others at the same steps, and its state must be in our checkpoints.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from torchtitan.config.schema import FaultTolerance
from torchtitan.distributed.param_init import canonical_name
from torchtitan.distributed.replica_groups import ReplicaGroups, local_state, local_tensor
from torchtitan.observability.log import logger


class OuterSync:
    """The sync of semi-synchronous replica groups, every ``cfg.sync_steps`` steps."""

    def __init__(
        self, groups: ReplicaGroups, parts: list[nn.Module], cfg: FaultTolerance, total_steps: int
    ) -> None:
        self.groups, self.cfg, self.total_steps = groups, cfg, total_steps
        self.method, self.every = cfg.semi_sync_method, cfg.sync_steps
        self.params = [
            (canonical_name(name), p)
            for part in parts
            for name, p in part.named_parameters()
            if p.requires_grad
        ]
        # DiLoCo: the weights of the last sync and the outer momentum (this rank's shards),
        # from a checkpoint or a peer; ``provisional`` until then: the first step takes the
        # weights it starts from
        self.synced: list[torch.Tensor] = []
        self.outer: torch.optim.SGD | None = None
        self.provisional = True
        if self.method == "diloco":
            self._adopt([local_tensor(p).detach().clone() for _, p in self.params])
        self.syncs = 0  # syncs committed by this run
        self.healed = False  # this group took another's state in this sync

    # ---- the schedule

    def due(self, step: int) -> bool:
        """After every sync_steps-th step, and after the last (the groups end together)."""
        return step % self.every == 0 or step == self.total_steps

    def begin(self) -> None:
        """Before a step: without DiLoCo state from a checkpoint, the weights now are the
        synced ones (a fresh run, weights loaded alone)."""
        if self.method == "diloco" and self.provisional:
            with torch.no_grad():
                for (_, p), s, m in zip(self.params, self.synced, self._momentum()):
                    s.copy_(local_tensor(p))
                    m.zero_()
            self.provisional = False

    def sync(self, step: int) -> bool:
        """The groups meet after ``step``: the quorum (where a group behind takes the live
        groups' state), then the average and the vote; whether it was committed."""
        progress = (step - 1) // self.every  # syncs before this one
        self.healed = False
        self.groups.quorum(progress)
        if self.method == "diloco":
            self._same_synced_weights(progress)
            committed = self._diloco()
        else:
            committed = self._local_sgd()
        if committed:
            self.syncs += 1
            if self.syncs == 1:
                logger.info(
                    f"replica groups: first {self.method} sync of this run, with "
                    f"{self.groups.participants} live group(s); every {self.every} steps"
                )
        return committed

    def _same_synced_weights(self, progress: int) -> None:
        """DiLoCo's groups must apply the outer step to the same synced weights. Groups that
        meet holding different ones (started from different weights, without debug.seed; or
        one made a sync alone, the others too late for the lighthouse) are told apart by a
        fingerprint of them, and those that differ from the lowest-numbered group's take its
        state in a second quorum, as a group behind would."""
        fingerprint = torch.zeros((), dtype=torch.float64)
        for i, s in enumerate(self.synced):
            fingerprint += (i + 1) * s.double().sum().cpu()
        table = self.groups.by_group(
            torch.stack([torch.ones((), dtype=torch.float64), fingerprint])
        )
        present = table[:, 0] > 0
        if not present.any():  # a group failed during it: the sync will not be committed
            return
        reference = table[present][0, 1]
        off = (present & (table[:, 1] != reference)).to(torch.float64)
        if dist.is_initialized() and dist.get_world_size() > 1:  # a group differs on any rank
            device = local_tensor(self.params[0][1]).device if self.params else torch.device("cpu")
            off_here = off.to(device)
            dist.all_reduce(off_here, op=dist.ReduceOp.MAX)
            off = off_here.cpu()
        if not off.any():
            return
        groups = [i for i in range(len(off)) if off[i] > 0]
        logger.warning(
            f"replica groups: group(s) {groups} hold other synced weights than group "
            f"{int(present.nonzero()[0])}; they take its state"
        )
        self.groups.quorum(progress - 1 if off[self.cfg.replica_id] > 0 else progress)

    def _lost(self) -> str:
        return (
            f"the groups' last {self.every} steps are dropped, back to the weights of the last sync"
        )

    def _weight(self) -> float:
        """A group that took another's state in this sync holds its weights and weight
        changes: counting them again would count that group twice."""
        return 0.0 if self.healed else 1.0

    def _local_sgd(self) -> bool:
        mean = [local_tensor(p).detach().clone() for _, p in self.params]
        self.groups.average(mean, self._weight())
        if not self.groups.commit("sync", "each group keeps its own weights until the next one"):
            return False
        with torch.no_grad():
            for (_, p), m in zip(self.params, mean):
                local_tensor(p).copy_(m)
        return True

    def _diloco(self) -> bool:
        assert self.outer is not None
        own = [local_tensor(p).detach() for _, p in self.params]
        pseudo = [s - o for s, o in zip(self.synced, own)]
        self.groups.average(pseudo, self._weight())
        committed = self.groups.commit("sync", self._lost())
        alpha = self.cfg.fragment_update_alpha
        with torch.no_grad():
            if committed:
                for s, g in zip(self.synced, pseudo):
                    s.grad = g
                self.outer.step()
                for s in self.synced:
                    s.grad = None
            for (_, p), s in zip(self.params, self.synced):
                if committed and alpha > 0:  # (1 - alpha) x the global weights + alpha x own
                    local_tensor(p).lerp_(s, 1 - alpha)
                else:
                    local_tensor(p).copy_(s)
        return committed

    def _adopt(self, synced: list[torch.Tensor]) -> None:
        """The outer SGD over the synced weights, its momentum zeros (SGD's first step from a
        zero buffer is its first step without one, bit for bit)."""
        cfg = self.cfg
        self.synced = synced
        self.outer = torch.optim.SGD(
            synced, lr=cfg.outer_lr, momentum=cfg.outer_momentum, nesterov=cfg.outer_momentum > 0
        )
        for s in synced:
            self.outer.state[s]["momentum_buffer"] = torch.zeros_like(s)

    def _momentum(self) -> list[torch.Tensor]:
        if self.outer is None:
            return []
        return [self.outer.state[s]["momentum_buffer"] for s in self.synced]

    # ---- what a healing group is sent (local tensors: the groups have the same layout)

    def heal_state(self) -> dict[str, Any]:
        return local_state({"synced": self.synced, "momentum": self._momentum()})

    def heal_load(self, received: dict[str, Any]) -> None:
        self.healed = True
        with torch.no_grad():
            for key, mine in (("synced", self.synced), ("momentum", self._momentum())):
                for t, theirs in zip(mine, received[key]):
                    t.copy_(theirs)
        self.provisional = False

    # ---- in checkpoints: each tensor in its parameter's sharding (DCP writes whole tensors)

    def state_dict(self) -> dict[str, Any]:
        return {"synced": self._global(self.synced), "momentum": self._global(self._momentum())}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        with torch.no_grad():
            for key, mine in (("synced", self.synced), ("momentum", self._momentum())):
                for (name, _), t in zip(self.params, mine):
                    t.copy_(local_tensor(state[key][name]))
        self.provisional = False

    def _global(self, tensors: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        out = {}
        for (name, p), t in zip(self.params, tensors):
            if isinstance(p, DTensor):
                t = DTensor.from_local(
                    t,
                    p.device_mesh,
                    p.placements,
                    run_check=False,
                    shape=p.shape,
                    stride=p.stride(),
                )
            out[name] = t
        return out
