"""ParallelDims: the parallel degrees, checked against the world size, and the DeviceMesh they make.

After :meth:`ParallelDims.build_mesh` the object owns the mesh and answers what the rest of a run
asks of it: this rank's data-parallel, context-parallel and pipeline coordinates, the sub-meshes
FSDP, the loss average and the data loader use, and the pipeline's process group. With one
process there is no mesh and every answer is the trivial one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from torchtitan.errors import ConfigError

_KEYS = {
    "dp_replicate": "parallelism.data_parallel_replicate_degree",
    "dp_shard": "parallelism.data_parallel_shard_degree",
    "cp": "parallelism.context_parallel_degree",
    "tp": "parallelism.tensor_parallel_degree",
    "pp": "parallelism.pipeline_parallel_degree",
}
_EP = "parallelism.expert_parallel_degree"
_ETP = "parallelism.expert_tensor_parallel_degree"
#: each degree's config key
DIM_KEYS = {**_KEYS, "ep": _EP, "etp": _ETP}


@dataclass
class ParallelDims:
    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int
    pp: int
    world_size: int
    # expert parallel: the ranks that split an MoE layer's experts, borrowed from dp_shard x cp
    # (x tp when etp is 1); the experts are tensor parallel over etp ranks: tp (-1 says so) or 1
    # (whole experts, the TP ranks splitting the routed rows). Normalized to tp when ep is 1.
    ep: int = 1
    etp: int = -1
    mesh: DeviceMesh | None = field(default=None, init=False, repr=False)
    expert_mesh: DeviceMesh | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        for name in ("dp_replicate", "cp", "tp", "pp"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{_KEYS[name]}: {getattr(self, name)} must be >= 1")
        others = self.dp_replicate * self.cp * self.tp * self.pp
        if self.dp_shard == -1:
            if self.world_size % others:
                raise ConfigError(
                    f"{self._blame()}: {self._product()} does not divide the world "
                    f"size {self.world_size} (data_parallel_shard_degree -1 takes the rest); use "
                    f"degrees whose product divides {self.world_size}"
                )
            self.dp_shard = self.world_size // others
        if self.dp_shard < 1:
            raise ConfigError(f"{_KEYS['dp_shard']}: {self.dp_shard} must be -1 or >= 1")
        if others * self.dp_shard != self.world_size:
            raise ConfigError(
                f"{self._blame()}: {self._product()}, but the world size is {self.world_size}; make the product equal the number of processes"
            )
        self._check_expert_parallel()

    def _check_expert_parallel(self) -> None:
        """EP borrows ranks from ``dp_shard x cp`` (as upstream torchtitan does), and from the TP
        ranks too when the experts are not tensor parallel (``etp`` 1)."""
        if self.ep < 1:
            raise ConfigError(f"{_EP}: {self.ep} must be >= 1")
        if self.ep > 1 and self.etp not in (-1, 1, self.tp):  # upstream: no effect without EP
            raise ConfigError(
                f"{_ETP}: {self.etp} is not supported with tensor_parallel_degree {self.tp}; use "
                f"1 (whole experts, expert parallel borrowing the TP ranks) or {self.tp} (the "
                "experts split like the dense layers; -1 says the same)"
                if self.tp > 1
                else f"{_ETP}: {self.etp} needs tensor parallel; use 1 (or -1)"
            )
        if self.etp == -1 or self.ep == 1:
            self.etp = self.tp
        borrowed = self.expert_borrowed_ranks
        names, factors = (
            "data_parallel_shard_degree x context_parallel_degree",
            f"{self.dp_shard} x {self.cp}",
        )
        if self.experts_whole_under_tp:
            names = f"{names} x tensor_parallel_degree"
            factors = f"{factors} x {self.tp}"
        if borrowed % self.ep:
            raise ConfigError(
                f"{_EP}: {self.ep} must divide {names} = {factors} = {borrowed} (expert parallel "
                "borrows those ranks); use a divisor of it"
            )
        if self.ep > 1 and not self.fsdp_enabled and borrowed != self.ep:
            raise ConfigError(
                f"{_EP}: {self.ep} leaves the experts replicated over {borrowed // self.ep} tensor "
                "parallel ranks without FSDP to sum their gradients; use expert_parallel_degree "
                f"{borrowed}, or data_parallel_shard_degree > 1"
            )
        if self.ep > 1 and not self.fsdp_enabled and self.dp_replicate > 1:
            raise ConfigError(
                f"{_EP}: {self.ep} with data_parallel_replicate_degree {self.dp_replicate} needs "
                "FSDP for the experts (HSDP): set data_parallel_shard_degree > 1"
            )

    def _product(self) -> str:
        """The degrees above 1: ``3``, or ``name=value x ... = product`` for several."""
        raised = [n for n in _KEYS if getattr(self, n) > 1]
        if len(raised) < 2:
            return str(getattr(self, raised[0]) if raised else 1)
        product = 1
        for n in raised:
            product *= getattr(self, n)
        parts = " x ".join(f"{_KEYS[n].split('.')[1]}={getattr(self, n)}" for n in raised)
        return f"{parts} = {product}"

    def _blame(self) -> str:
        """The key of the largest degree set above 1 (the one most likely mistyped)."""
        raised = [n for n in _KEYS if getattr(self, n) > 1]
        return _KEYS[max(raised, key=lambda n: getattr(self, n))] if raised else "parallelism"

    def layout(self) -> str:
        ep = f" ep={self.ep}" if self.ep > 1 else ""
        ep += " etp=1" if self.experts_whole_under_tp else ""
        return f"dp_replicate={self.dp_replicate} dp_shard={self.dp_shard} cp={self.cp} tp={self.tp} pp={self.pp}{ep}"

    @property
    def dp(self) -> int:
        """Data-parallel degree: how many different batches are read per step."""
        return self.dp_replicate * self.dp_shard

    @property
    def dp_enabled(self) -> bool:
        return self.dp > 1

    @property
    def dp_shard_enabled(self) -> bool:
        return self.dp_shard > 1

    @property
    def dp_replicate_enabled(self) -> bool:
        return self.dp_replicate > 1

    def build_mesh(self, device_type: str) -> DeviceMesh | None:
        """A named mesh over the enabled dims, plus the flattened ``dp`` dim used by the data
        loader; kept as ``self.mesh``. None (no mesh) with one process."""
        if self.world_size == 1:
            return None
        dims = [
            (n, d)
            for n, d in (
                ("pp", self.pp),
                ("dp_replicate", self.dp_replicate),
                ("dp_shard", self.dp_shard),
                ("cp", self.cp),
                ("tp", self.tp),
            )
            if d > 1 or (n == "dp_shard" and self.replicates_through_fsdp)
        ]
        if not dims:
            dims = [("dp_shard", 1)]
        names = tuple(n for n, _ in dims)
        mesh = init_device_mesh(device_type, tuple(d for _, d in dims), mesh_dim_names=names)
        self._flat_names: dict[tuple[str, ...], str] = {}
        # the data loader's ranks; FSDP's shard dim (context-parallel ranks shard parameters
        # too); the ranks whose losses are averaged for logging
        for group, name in (
            (("dp_replicate", "dp_shard"), "dp"),
            (("dp_shard", "cp"), "dp_shard_cp"),
            (("dp_replicate", "dp_shard", "cp"), "dp_cp"),
            # Parameters sharded over several dims (FSDP x TP, HSDP x TP) reduce their grad norm
            # over all of them: one flattened dim lets DTensor do that in one all-reduce.
            (tuple(n for n in names if n != "pp"), "sharded"),
        ):
            group = tuple(n for n in group if n in names)
            if len(group) > 1 and group not in self._flat_names:  # one name per group
                mesh[group]._flatten(mesh_dim_name=name)
                self._flat_names[group] = name
        self.mesh = mesh
        if self.ep > 1:
            self.expert_mesh = self._build_expert_mesh(device_type)
        return mesh

    def _build_expert_mesh(self, device_type: str) -> DeviceMesh:
        """The same ranks laid out for the routed experts: the borrowed ranks, ``dp_shard x cp``
        (cp inner; ``x tp`` when the experts are whole, ``etp`` 1), split into ``efsdp x ep``,
        so that an EP group is ``ep`` consecutive ranks of them and the experts' FSDP shards over
        ``efsdp`` (with ``dp_replicate`` for HSDP); ``tp`` last when the experts are tensor
        parallel. Size-1 dims are kept, so the names are always there."""
        sizes = [
            ("pp", self.pp),
            ("dp_replicate", self.dp_replicate),
            ("efsdp", self.expert_borrowed_ranks // self.ep),
            ("ep", self.ep),
        ]
        if not self.experts_whole_under_tp:
            sizes.append(("tp", self.tp))
        return init_device_mesh(
            device_type, tuple(d for _, d in sizes), mesh_dim_names=tuple(n for n, _ in sizes)
        )

    @property
    def expert_borrowed_ranks(self) -> int:
        """The ranks EP borrows, ``ep x efsdp``: ``dp_shard x cp`` (``x tp`` with whole experts)."""
        return self.dp_shard * self.cp * (self.tp if self.experts_whole_under_tp else 1)

    @property
    def experts_whole_under_tp(self) -> bool:
        """``etp`` 1 under tensor parallel: each EP rank holds whole experts, and the TP ranks of
        a sequence split its routed rows between them instead of the experts' hidden width."""
        return self.tp > 1 and self.etp == 1

    @property
    def expert_fsdp_mesh(self) -> DeviceMesh:
        """The routed experts' FSDP mesh: ``efsdp``, with ``dp_replicate`` in front for HSDP."""
        assert self.expert_mesh is not None
        if not self.dp_replicate_enabled:
            return self.expert_mesh["efsdp"]
        return self.expert_mesh[("dp_replicate", "efsdp")]

    def _submesh(self, group: tuple[str, ...]) -> DeviceMesh | None:
        """The (flattened) sub-mesh over the enabled dims of ``group``; None if there are none."""
        group = tuple(n for n in group if getattr(self, n) > 1)
        if self.mesh is None or not group:
            return None
        return self.mesh[group[0] if len(group) == 1 else self._flat_names[group]]

    def _local_rank(self, name: str) -> int:
        return (
            self.mesh[name].get_local_rank()
            if self.mesh is not None and getattr(self, name) > 1
            else 0
        )

    @property
    def dp_mesh(self) -> DeviceMesh | None:
        """The data-parallel sub-mesh the data loader shards over, or None."""
        return self._submesh(("dp_replicate", "dp_shard"))

    @property
    def dp_rank(self) -> int:
        """Which of the ``dp`` different batches of a step this rank reads."""
        mesh = self.dp_mesh
        return mesh.get_local_rank() if mesh is not None else 0

    @property
    def cp_rank(self) -> int:
        """Which chunks of every sequence this rank holds under context parallel."""
        return self._local_rank("cp")

    @property
    def pp_rank(self) -> int:
        return self._local_rank("pp")

    @property
    def pp_group(self) -> Any:
        """The pipeline's process group (None without pipelining)."""
        return self.mesh["pp"].get_group() if self.mesh is not None and self.pp > 1 else None

    def sub(self, name: str) -> DeviceMesh:
        """The named one-dimensional sub-mesh (``"tp"``, ``"cp"``, ``"pp"``, ``"dp_replicate"``)."""
        return self.mesh[name]

    @property
    def loss_mesh(self) -> DeviceMesh | None:
        """The ranks that hold different tokens of a step (data and context parallel), whose
        losses average to the step's loss; None when this rank holds them all."""
        return self._submesh(("dp_replicate", "dp_shard", "cp"))

    @property
    def fsdp_enabled(self) -> bool:
        """FSDP (or HSDP) shards parameters over ``dp_shard x cp``: the context-parallel ranks
        of a replica hold different tokens, so their gradients are averaged like data parallel."""
        return self.dp_shard > 1 or self.cp > 1

    @property
    def replicates_through_fsdp(self) -> bool:
        """Data parallel by replication alone (``dp_replicate`` > 1, no FSDP) beside tensor or
        pipeline parallel: torch's DDP reducer neither sums DTensor gradients (under TP it left
        every gradient at zero) nor runs once per pipeline micro-batch, so the replicas go
        through FSDP2 as HSDP with one shard rank: whole parameters on every rank, as DDP keeps
        them, and gradients averaged over the replicas."""
        return self.dp_replicate > 1 and not self.fsdp_enabled and (self.tp > 1 or self.pp > 1)

    @property
    def uses_fully_shard(self) -> bool:
        """Whether FSDP2's ``fully_shard`` wraps the model (FSDP, HSDP, or replicas beside TP/PP):
        its mixed-precision policy then casts the parameters."""
        return self.fsdp_enabled or self.replicates_through_fsdp

    @property
    def fsdp_mesh(self) -> DeviceMesh:
        """FSDP's mesh: the shard dim, with ``dp_replicate`` in front for HSDP (a shard dim of
        one rank when the replicas go through FSDP2; see ``replicates_through_fsdp``)."""
        if self.replicates_through_fsdp:
            return self.mesh[("dp_replicate", "dp_shard")]
        shard = self._submesh(("dp_shard", "cp"))
        if not self.dp_replicate_enabled:
            return shard
        return self.mesh[("dp_replicate", shard.mesh_dim_names[0])]

    @cached_property
    def non_data_parallel_size(self) -> int:
        return self.cp * self.tp * self.pp
