"""Replica groups with torchft (``[fault_tolerance]``): this job is one of
``fault_tolerance.group_size`` groups that train one model together. Each group is an ordinary
job of this library (FSDP, TP, PP inside it, its own torchrun); between the groups, torchft's
``Manager`` plays the data-parallel replicate dimension:

- every step starts with a quorum of the live groups, through torchft's lighthouse
  (``TORCHFT_LIGHTHOUSE``);
- after the backward each group's gradients (this rank's local shards: the groups have the same
  layout, so rank r of every group holds the same shards) are averaged over the groups that
  take part in the step, one flat all-reduce per dtype over torchft's process group;
- the update is made only when every group votes to commit (``should_commit``); a step that a
  group's death broke is retried (its batch dropped) with the groups that are left;
- a group that starts while others train (restarted by its launcher), or is behind them, is
  sent the live groups' state at its first quorum (rank r of a live group to rank r of it,
  torchft's HTTP transport) and applies it before its step: it goes on from the current step.

What is sent is registered by the trainer (:meth:`ReplicaGroups.register`): the model, the
optimizer, the LR schedule and the step counters, as this rank's local tensors
(:func:`local_state`), put back into the same sharding on arrival (:func:`into_place`).

With ``fault_tolerance.semi_sync_method`` (DiLoCo, local SGD) the groups meet only every
``sync_steps`` steps instead (:mod:`torchtitan.distributed.outer_sync`, kept in
:attr:`ReplicaGroups.outer`), through the same quorum, average and commit.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed import ReduceOp
from torch.distributed.tensor import DTensor

from torchtitan.config.schema import FaultTolerance
from torchtitan.errors import ConfigError, TorchTitanError
from torchtitan.observability.log import logger

if TYPE_CHECKING:
    from torchtitan.distributed.outer_sync import OuterSync

LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"


class ReplicaGroupError(TorchTitanError):
    """Replica groups that cannot go on: no quorum, no lighthouse, steps never committed."""

    exit_code = 1
    names_rank = False


MAX_RETRIES = 10  # steps in a row not committed before the group stops


def check_environment(cfg: FaultTolerance, device_type: str = "cpu") -> None:
    """What a replica group needs before it starts: torchft, the lighthouse's address, and
    NCCL's devices for ``process_group = "nccl"``."""
    # torchft's own lines (a quorum every step) at warnings and above, unless asked for; read
    # when torchft is first imported
    os.environ.setdefault("RUST_LOG", "warn")
    try:
        import torchft  # noqa: F401
    except ImportError:
        raise ConfigError(
            "fault_tolerance.enable: needs torchft (pip install torchft; its lighthouse is "
            "the torchft_lighthouse command)"
        ) from None
    if cfg.process_group == "nccl" and device_type != "cuda":
        raise ConfigError(
            f"fault_tolerance.process_group: nccl needs CUDA devices, and this job runs on "
            f"{device_type}; use gloo"
        )
    if not os.environ.get(LIGHTHOUSE_ENV):
        raise ConfigError(
            f"fault_tolerance.enable: {LIGHTHOUSE_ENV} is not set; start a lighthouse "
            "(torchft_lighthouse --min_replicas 1, or FT_LIGHTHOUSE=start with "
            f"run_llama_train.sh) and set {LIGHTHOUSE_ENV}=http://HOST:29510"
        )


def quorum_timeout_ms(cfg: FaultTolerance) -> int:
    """How long a group waits for its quorum: ``quorum_timeout_ms``, or by default 60 s for
    groups in step and 30 min for semi-synchronous ones (which wait at a sync for the others'
    inner steps, and a restarted group for theirs to its first sync)."""
    if cfg.quorum_timeout_ms:
        return cfg.quorum_timeout_ms
    return 60_000 if cfg.semi_sync_method is None else 1_800_000


class ReplicaGroups:
    """torchft's Manager for this rank of replica group ``cfg.replica_id``."""

    def __init__(
        self, cfg: FaultTolerance, *, rank: int, world_size: int, init_sync: bool = True
    ) -> None:
        check_environment(cfg)
        from torchft import Manager, ProcessGroupGloo, ProcessGroupNCCL

        timeout = timedelta(milliseconds=cfg.process_group_timeout_ms)
        pg = ProcessGroupGloo(timeout=timeout) if cfg.process_group == "gloo" else None
        pg = pg or ProcessGroupNCCL(timeout=timeout)
        self.cfg = cfg
        self._store, host, port = _fresh_store(rank)
        # a replica id ending in digits: the group's index among the others
        self.manager = _one_line(cfg, "cannot reach torchft's lighthouse", Manager)(
            pg=pg,
            load_state_dict=None,
            state_dict=None,
            min_replica_size=cfg.min_replica_size,
            # the quorum, and what a healing group is sent, before the step: the state is read
            # through FSDP's state-dict API, which must not run beside the forward
            use_async_quorum=False,
            rank=rank,
            world_size=world_size,
            store_addr=host,
            store_port=port,
            replica_id=f"torchtitan_ft_{cfg.replica_id}",
            timeout=max(timeout, timedelta(seconds=60)),
            quorum_timeout=timedelta(milliseconds=quorum_timeout_ms(cfg)),
            # groups that start together take the first one's weights, unless a seed made
            # them equal already (a group that starts behind always heals)
            init_sync=init_sync,
        )
        self.gpu_collectives = cfg.process_group == "nccl"
        self.retried = 0  # steps (or syncs) this group made that were not committed
        self.in_a_row = 0  # of them, since the last committed one
        # semi_sync_method: the groups meet every sync_steps steps (set by the trainer)
        self.outer: OuterSync | None = None

    def register(self, name: str, state: Callable[[], Any], load: Callable[[Any], None]) -> None:
        """``name``'s state, sent to a group that heals (``state()``, this rank's tensors) and
        taken from a live group (``load(received)``)."""
        self.manager.register_state_dict_fn(name, load, state)

    def quorum(self, progress: int) -> None:
        """The live groups' quorum. ``progress`` is how far this group is (its steps; with
        semi_sync_method its syncs): a group behind the others takes their state here."""
        state = {"step": progress, "batches_committed": self.manager.batches_committed()}
        self.manager.load_state_dict(state)
        _one_line(self.cfg, "no quorum of the replica groups", self.manager.start_quorum)()

    def average_gradients(self, params: list[torch.nn.Parameter]) -> None:
        """Each parameter's gradient (this rank's local shard) averaged over the groups that
        take part in the step."""
        # a parameter without a gradient (no token reached it) sends zeros, so that every group's
        # buffer holds the same parameters; its gradient stays None
        self.average(
            [
                local_tensor(p.grad) if p.grad is not None else torch.zeros_like(local_tensor(p))
                for p in params
                if p.requires_grad
            ]
        )

    def average(self, tensors: list[torch.Tensor], weight: float | None = None) -> None:
        """In place: each tensor averaged over the groups of this quorum, one all-reduce per
        dtype of the tensors laid end to end; zeros when a group failed during it (the step
        is then not committed). ``weight``: this group's share of a weighted mean (0: it is
        left out, its tensors are not counted); None: every group counts once."""
        total = None if weight is None else self.sum_over_groups(torch.tensor([float(weight)]))
        for dtype in sorted({t.dtype for t in tensors}, key=str):
            same = [t for t in tensors if t.dtype == dtype]
            flat = torch.cat([g.reshape(-1) for g in same])
            on_cpu = not self.gpu_collectives and flat.device.type != "cpu"
            buffer = flat.cpu() if on_cpu else flat
            if total is None:
                self.manager.allreduce(buffer).wait()
            elif float(total[0]) > 0:
                buffer.mul_(weight)
                self.manager.allreduce(buffer, reduce_op=ReduceOp.SUM).wait()
                buffer.div_(float(total[0]))
            if self.manager.errored() is not None or (total is not None and total[0] <= 0):
                buffer.zero_()  # a group failed: the step is not committed
            if on_cpu:
                flat.copy_(buffer)
            offset = 0
            for g in same:
                g.copy_(flat[offset : offset + g.numel()].view_as(g))
                offset += g.numel()

    def sum_over_groups(self, t: torch.Tensor) -> torch.Tensor:
        """A small CPU tensor summed over the groups of this quorum (zeros when a group failed
        during it)."""
        buffer = t.double()
        if self.gpu_collectives:
            buffer = buffer.cuda()
        self.manager.allreduce(buffer, reduce_op=ReduceOp.SUM).wait()
        if self.manager.errored() is not None:
            buffer.zero_()
        return buffer.cpu()

    def by_group(self, row: torch.Tensor) -> torch.Tensor:
        """Every group's ``row`` (a small CPU tensor) of this quorum, as a table indexed by
        replica id: absent groups' rows are zeros."""
        table = torch.zeros(self.cfg.group_size, row.numel(), dtype=torch.float64)
        table[self.cfg.replica_id] = row.double().reshape(-1)
        return self.sum_over_groups(table)

    def commit(
        self, what: str = "step", lost: str = "retrying it with the groups that are left"
    ) -> bool:
        """Whether every group of the quorum voted to commit ``what``; False: ``lost`` says
        what happens instead (a step is retried; a semi-synchronous sync drops its inner
        steps)."""
        committed = self.manager.should_commit()
        if committed:
            self.in_a_row = 0
            return True
        self.retried += 1
        self.in_a_row += 1
        if self.in_a_row >= MAX_RETRIES:
            raise ReplicaGroupError(
                f"replica group {self.cfg.replica_id}: {self.in_a_row} {what}s in a row were "
                f"not committed ({_first_line(self.manager.errored())}); check that "
                f"fault_tolerance.min_replica_size ({self.cfg.min_replica_size}) groups are up, "
                f"the lighthouse ({os.environ.get(LIGHTHOUSE_ENV)}) and the network between groups"
            )
        logger.warning(
            f"replica group {self.cfg.replica_id}: {what} not committed (a group failed during "
            f"it); {lost}"
        )
        return False

    @property
    def participants(self) -> int:
        """How many groups took part in the last quorum (all of them before the first)."""
        return self.manager.num_participants() or self.cfg.group_size

    def shutdown(self) -> None:
        self.manager.shutdown(wait=False)


def _first_line(error: Any) -> str:
    text = str(getattr(error, "original_exception", error) or "no error reported").strip()
    return (text.splitlines() or [""])[0][:200]


def _one_line(cfg: FaultTolerance, what: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` whose failure (a timeout, the lighthouse out of reach) is one line, not a
    traceback from torchft's RPC."""

    def call(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            raise ReplicaGroupError(
                f"replica group {cfg.replica_id}: {what} ({type(e).__name__}: {_first_line(e)}); "
                f"is the lighthouse at {os.environ.get(LIGHTHOUSE_ENV)} up, and are "
                f"fault_tolerance.min_replica_size ({cfg.min_replica_size}) groups running?"
            ) from None

    return call


def _fresh_store(rank: int) -> tuple[Any, str, int]:
    """A key-value store of this attempt for torchft's manager, hosted by rank 0 on a free port:
    torchrun's own store (MASTER_ADDR/MASTER_PORT, torchft's default) outlives a restart of the
    workers and still holds the dead attempt's manager address, which a restarted rank would
    then wait on. Returns (the store on rank 0, else None; its host; its port)."""
    import torch.distributed as dist
    from torch.distributed import TCPStore

    store = None
    where: list[Any] = [None]
    if rank == 0:
        store = TCPStore(socket.gethostname(), 0, is_master=True, wait_for_workers=False)
        where = [(socket.gethostname(), store.port)]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(where, src=0)
    host, port = where[0]
    return store, host, port


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``t``: its local shard if a DTensor, else ``t``."""
    return t.to_local() if isinstance(t, DTensor) else t


def local_state(state: Any) -> Any:
    """``state`` with every DTensor replaced by this rank's local tensor (what is sent to the
    same rank of a group that heals; the groups have the same layout)."""
    if isinstance(state, dict):
        return {k: local_state(v) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(local_state(v) for v in state)
    return local_tensor(state).detach() if isinstance(state, torch.Tensor) else state


def into_place(current: Any, received: Any) -> Any:
    """``received`` (local tensors) in the form of ``current``: each DTensor rebuilt with its
    mesh and placements around the received local tensor (on the current device and dtype)."""
    if isinstance(current, dict):
        return {k: into_place(current[k], v) if k in current else v for k, v in received.items()}
    if isinstance(current, DTensor):
        local = received.to(current.to_local().device, current.dtype)
        return DTensor.from_local(
            local,
            current.device_mesh,
            current.placements,
            run_check=False,
            shape=current.shape,
            stride=current.stride(),
        )
    if isinstance(current, torch.Tensor) and isinstance(received, torch.Tensor):
        return received.to(current.device, current.dtype)
    return received
