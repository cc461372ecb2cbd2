"""Pipeline parallelism for a decoder (any family), with ``torch.distributed.pipelining``.

The model is cut between transformer blocks into stages. Stage 0 also holds the token embedding,
the last stage the final norm and the output projection. Single-stage schedules (GPipe, 1F1B)
give each pipeline rank one stage; looped multi-stage schedules (Interleaved1F1B, LoopedBFS,
InterleavedZeroBubble) give rank ``r`` stages ``r, r + pp, r + 2 pp, ...``; V-shaped schedules
(ZBVZeroBubble, DualPipeV) give rank ``r`` exactly stages ``r`` and ``2 pp - 1 - r``.

Three steps, each usable on its own:

1. :func:`check_pipeline_config` (pure, run by preflight): validates the configuration against
   the model and the parallel layout and returns a :class:`PipelinePlan` (which layers each
   stage holds, which rank runs it, the micro-batching).
2. :func:`split_model`: this rank's stages, cut from the meta-device full model. Parameter names
   are those of the full model (``layers`` keeps its keys), so ``layout_invariant_init`` gives
   every stage the weights the unsplit model would have. Each part is then parallelized
   (TP/AC/compile/FSDP) and materialized like a whole model.
3. :class:`Pipeline`: the schedule over the materialized parts; :meth:`Pipeline.forward_backward`
   runs one local batch and returns its loss on every pipeline rank.

Loss and gradient scaling: each pipeline micro-batch's loss is the training loss as the
unpipelined step computes it (its summed cross entropy over the valid tokens of the whole
optimizer step, ``TokenMeanLoss``), and the schedule's own ``scale_grads`` is off. The summed
micro-batch losses and gradients are then exactly those of the unpipelined step. (The
schedule's ``scale_grads=True`` would divide the *accumulated* ``.grad`` by the number of
micro-batches after every step, which is wrong under gradient accumulation.) The document ids
of block-causal attention go to every stage as a keyword argument, split like the batch.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from torchtitan.distributed.utils import full_tensor
from torchtitan.errors import ConfigError

__all__ = [
    "SCHEDULES",
    "PipelinePlan",
    "check_pipeline_config",
    "split_layers",
    "split_model",
    "Pipeline",
]

SINGLE_STAGE = ("GPipe", "1F1B")
LOOPED = ("Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble")
V_SHAPED = ("ZBVZeroBubble", "DualPipeV")
SCHEDULES = SINGLE_STAGE + LOOPED + V_SHAPED
# These split each backward into input and weight parts (torch.compile and per-op selective
# activation checkpointing cannot run that).
ZERO_BUBBLE = ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")
# Schedules that need at least as many micro-batches as stages (torch raises otherwise).
NEED_MICROBATCH_PER_STAGE = ("1F1B", "DualPipeV")

_P = "parallelism."
_DEGREE = _P + "pipeline_parallel_degree"
_SCHEDULE = _P + "pipeline_parallel_schedule"
_LPS = _P + "pipeline_parallel_layers_per_stage"
_SPLIT = _P + "pipeline_parallel_split_points"
_MBS = _P + "pipeline_parallel_microbatch_size"


@dataclass(frozen=True)
class PipelinePlan:
    """Where every layer goes and how a local batch is cut; the same on every rank."""

    schedule: str  # canonical name, one of SCHEDULES
    pp: int
    stage_layers: tuple[tuple[int, ...], ...]  # stage index -> its transformer block ids
    microbatch_size: int
    n_microbatches: int

    @property
    def num_stages(self) -> int:
        return len(self.stage_layers)

    @property
    def v_shaped(self) -> bool:
        return self.schedule in V_SHAPED

    def stage_rank(self, stage: int) -> int:
        """The pipeline rank that runs ``stage``."""
        if self.v_shaped:
            return stage if stage < self.pp else 2 * self.pp - 1 - stage
        return stage % self.pp

    def stages_of(self, pp_rank: int) -> list[int]:
        """The stages ``pp_rank`` runs, in increasing order."""
        return [s for s in range(self.num_stages) if self.stage_rank(s) == pp_rank]

    def describe_stage(self, stage: int) -> str:
        layers = self.stage_layers[stage]
        parts = ["tok_embeddings"] if stage == 0 else []
        parts.append(
            f"layers {layers[0]}-{layers[-1]}" if len(layers) > 1 else f"layer {layers[0]}"
        )
        if stage == self.num_stages - 1:
            parts.append("norm + output")
        return f"stage {stage} (pp rank {self.stage_rank(stage)}): " + " + ".join(parts)

    def describe(self) -> str:
        return (
            f"Pipeline schedule {self.schedule}: {self.num_stages} stages on pp={self.pp} ranks, "
            f"{self.n_microbatches} micro-batches of {self.microbatch_size}; "
            + "; ".join(self.describe_stage(s) for s in range(self.num_stages))
        )


def canonical_schedule(name: str) -> str:
    by_lower = {s.lower(): s for s in SCHEDULES}
    if name.lower() not in by_lower:
        raise ConfigError(f"{_SCHEDULE}: unknown schedule '{name}'; valid: {', '.join(SCHEDULES)}")
    return by_lower[name.lower()]


def split_layers(n_layers: int, num_stages: int) -> tuple[tuple[int, ...], ...]:
    """Consecutive layer ids per stage, as even as possible; earlier stages get the extra ones."""
    base, extra = divmod(n_layers, num_stages)
    stages, start = [], 0
    for s in range(num_stages):
        size = base + (1 if s < extra else 0)
        stages.append(tuple(range(start, start + size)))
        start += size
    return tuple(stages)


def _num_stages(schedule: str, pp: int, n_layers: int, layers_per_stage: int | None) -> int:
    if layers_per_stage is None:
        num_stages = pp if schedule in SINGLE_STAGE else 2 * pp
        if num_stages > n_layers:
            raise ConfigError(
                f"{_DEGREE}: {pp} with the {schedule} schedule needs {num_stages} stages "
                f"({num_stages // pp} per rank), more than the model's {n_layers} layers; "
                f"use a smaller degree or a single-stage schedule (GPipe, 1F1B)"
            )
        return num_stages
    if layers_per_stage < 1:
        raise ConfigError(f"{_LPS}: {layers_per_stage} must be >= 1 (or unset for an even split)")
    if n_layers % layers_per_stage or (n_layers // layers_per_stage) % pp:
        raise ConfigError(
            f"{_LPS}: {layers_per_stage} does not divide the model's {n_layers} layers into a "
            f"multiple of pipeline_parallel_degree={pp} stages; use a divisor of {n_layers} "
            f"that leaves a multiple of {pp} stages, or leave it unset for an even split"
        )
    num_stages = n_layers // layers_per_stage
    per_rank = num_stages // pp
    if schedule in SINGLE_STAGE and per_rank != 1:
        raise ConfigError(
            f"{_LPS}: {layers_per_stage} makes {num_stages} stages, but the {schedule} schedule "
            f"runs exactly one stage per rank ({pp} stages of {n_layers // pp} layers); use "
            f"{n_layers // pp} or a multi-stage schedule ({', '.join(LOOPED + V_SHAPED)})"
        )
    if schedule in V_SHAPED and per_rank != 2:
        fix = "leave it unset for an even split"
        if n_layers % (2 * pp) == 0:
            fix = f"use {n_layers // (2 * pp)} or " + fix
        raise ConfigError(
            f"{_LPS}: {layers_per_stage} makes {num_stages} stages, but the {schedule} schedule "
            f"runs exactly two stages per rank ({2 * pp} stages); {fix}"
        )
    return num_stages


def _check_microbatches(schedule: str, local_batch: int, mbs: int, num_stages: int, pp: int) -> int:
    if local_batch % mbs:
        raise ConfigError(
            f"training.local_batch_size: {local_batch} is not divisible by {_MBS}={mbs}; "
            f"use a multiple of {mbs}, or a micro-batch size that divides {local_batch}"
        )
    n = local_batch // mbs
    if schedule in NEED_MICROBATCH_PER_STAGE and n < num_stages:
        raise ConfigError(
            f"{_MBS}: {mbs} cuts training.local_batch_size={local_batch} into {n} micro-batches, "
            f"but the {schedule} schedule needs at least one per stage ({num_stages}); use a "
            f"local batch of at least {num_stages * mbs}"
            + (" or a smaller micro-batch size" if mbs > 1 else "")
        )
    if schedule in ("Interleaved1F1B", "InterleavedZeroBubble") and n % max(1, n // pp):
        # torch runs them in rounds of n // pp micro-batches, which must divide n
        raise ConfigError(
            f"{_MBS}: {mbs} cuts training.local_batch_size={local_batch} into {n} micro-batches, "
            f"but the {schedule} schedule needs a count of at most pipeline_parallel_degree={pp} "
            f"or one divisible by count // {pp} (e.g. a multiple of {pp})"
        )
    return n


def _check_composes(job_config: Any, schedule: str, dims: Any) -> None:
    """Combinations with the other features that cannot work (one-line errors)."""
    if schedule not in ZERO_BUBBLE:
        return
    if job_config.compile.enable:  # compiled blocks fail; a compiled loss alone is untested
        raise ConfigError(
            f"{_SCHEDULE}: {schedule} splits backward into input and weight parts, which "
            f"torch.compile does not support; turn compile.enable off or use another schedule"
        )
    ac = job_config.activation_checkpoint
    if ac.mode == "selective" and ac.selective_ac_option == "op":
        raise ConfigError(
            f"{_SCHEDULE}: {schedule} splits backward into input and weight parts, which "
            f"per-op selective activation checkpointing cannot replay twice; use "
            f"activation_checkpoint.mode full, a layer interval, or another schedule"
        )


def check_pipeline_config(job_config: Any, model_args: Any, dims: Any) -> PipelinePlan:
    """Validate the pipeline settings against the model and the parallel layout (a
    ``ParallelDims``): the plan, or a one-line ConfigError naming the key."""
    p = job_config.parallelism
    pp = dims.pp
    schedule = canonical_schedule(p.pipeline_parallel_schedule)
    n_layers = model_args.n_layers
    if getattr(model_args, "tie_word_embeddings", False):
        raise ConfigError(
            f"{_DEGREE}: {pp} splits the model across stages, but {job_config.model.name} "
            f"{job_config.model.flavor} ties its input and output embeddings "
            f"(tie_word_embeddings), which must live on one rank; use 1 or an untied flavor"
        )
    if pp > n_layers:
        raise ConfigError(f"{_DEGREE}: {pp} exceeds the model's {n_layers} layers")
    _check_composes(job_config, schedule, dims)
    if p.pipeline_parallel_split_points:
        stage_layers = _stages_at(p.pipeline_parallel_split_points, n_layers, schedule, pp)
        if p.pipeline_parallel_layers_per_stage is not None:
            raise ConfigError(f"{_LPS}: give it or {_SPLIT}, not both")
    else:
        num = _num_stages(schedule, pp, n_layers, p.pipeline_parallel_layers_per_stage)
        stage_layers = split_layers(n_layers, num)
    mbs = p.pipeline_parallel_microbatch_size
    local = job_config.training.local_batch_size
    n_mb = _check_microbatches(schedule, local, mbs, len(stage_layers), pp)
    return PipelinePlan(schedule, pp, stage_layers, mbs, n_mb)


def _stages_at(points: list[str], n_layers: int, schedule: str, pp: int) -> tuple:
    """Stage layer ids from split points ``layers.N`` (where each stage after the first starts)."""
    starts = []
    for point in points:
        name, _, index = point.partition(".")
        if name != "layers" or not index.isdigit() or not 0 < int(index) < n_layers:
            raise ConfigError(
                f"{_SPLIT}: '{point}' is not a block of the model; give layers.N with 0 < N < "
                f"{n_layers}, in increasing order"
            )
        starts.append(int(index))
    if starts != sorted(set(starts)):
        raise ConfigError(f"{_SPLIT}: {points} must be in increasing order without repeats")
    bounds = [0, *starts, n_layers]
    stages = tuple(tuple(range(a, b)) for a, b in zip(bounds, bounds[1:]))
    per_rank, rest = divmod(len(stages), pp)
    need = 1 if schedule in SINGLE_STAGE else 2 if schedule in V_SHAPED else None
    if rest or per_rank != (need or max(per_rank, 2)):
        want = f"{need * pp}" if need else f"a multiple of {pp} (at least {2 * pp})"
        raise ConfigError(
            f"{_SPLIT}: {len(points)} split points make {len(stages)} stages, but "
            f"pipeline_parallel_degree={pp} with the {schedule} schedule needs {want}"
        )
    return stages


def split_model(model: nn.Module, plan: PipelinePlan, pp_rank: int) -> dict[int, nn.Module]:
    """This rank's stages, keyed by stage index: copies of the (meta-device) full model that keep
    only their own layers, the embedding on stage 0 and norm + output on the last stage."""
    parts: dict[int, nn.Module] = {}
    for stage in plan.stages_of(pp_rank):
        part = copy.deepcopy(model)
        keep = {str(i) for i in plan.stage_layers[stage]}
        for name in [n for n in part.layers if n not in keep]:
            del part.layers[name]
        if stage != 0:
            part.tok_embeddings = None
        if stage != plan.num_stages - 1:
            part.norm = None
            part.output = None
        parts[stage] = part
    return parts


class Pipeline:
    """The schedule over this rank's materialized stage modules (``parts``, keyed by stage)."""

    def __init__(
        self,
        plan: PipelinePlan,
        parts: dict[int, nn.Module],
        device: torch.device,
        group: dist.ProcessGroup,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    ):
        # (imported here: preflight, which needs only the plan, stays light)
        from torch.distributed.pipelining import PipelineStage
        from torch.distributed.pipelining.schedules import (
            PipelineScheduleSingle,
            get_schedule_class,
        )

        self.plan = plan
        self.device = device
        self.group = group
        self.stage_indices = sorted(parts)
        self.has_first = 0 in parts
        self.has_last = plan.num_stages - 1 in parts
        self.last_rank = plan.stage_rank(plan.num_stages - 1)
        stages = [
            PipelineStage(parts[s], s, plan.num_stages, device, group=group)
            for s in self.stage_indices
        ]
        cls = get_schedule_class(plan.schedule)
        self.schedule = cls(
            stages[0] if issubclass(cls, PipelineScheduleSingle) else stages,
            n_microbatches=plan.n_microbatches,
            loss_fn=loss_fn,
            scale_grads=False,
        )

    def forward_loss(
        self, inputs: torch.Tensor, labels: torch.Tensor, doc_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The loss of one local batch (the sum of its micro-batches' ``loss_fn``), forward only
        (evaluation), on every pipeline rank."""
        args = (inputs,) if self.has_first else ()
        losses: list[torch.Tensor] = []
        with torch.no_grad():
            self.schedule.eval(
                *args,
                target=labels if self.has_last else None,
                losses=losses if self.has_last else None,
                **_stage_kwargs(doc_ids),
            )
        return self._broadcast_sum(losses)

    def _broadcast_sum(self, losses: list[torch.Tensor]) -> torch.Tensor:
        """The sum of the last stage's micro-batch losses, broadcast to every pipeline rank."""
        if self.has_last:
            loss = torch.stack([full_tensor(x.detach()).float() for x in losses]).sum()
        else:
            loss = torch.zeros((), device=self.device)
        dist.broadcast(loss, group=self.group, group_src=self.last_rank)
        return loss

    def forward_backward(
        self, inputs: torch.Tensor, labels: torch.Tensor, doc_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Forward and backward of one local batch through the pipeline (gradients accumulate
        into the parts' ``.grad``). Returns the batch's loss (the sum of its micro-batches'),
        on every pipeline rank: it is broadcast from the rank that holds the last stage."""
        args = (inputs,) if self.has_first else ()
        losses: list[torch.Tensor] = []
        self.schedule.step(
            *args,
            target=labels if self.has_last else None,
            losses=losses if self.has_last else None,
            return_outputs=False,
            **_stage_kwargs(doc_ids),
        )
        return self._broadcast_sum(losses)


def _stage_kwargs(doc_ids: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """Keyword arguments of every stage's forward (split into micro-batches like the inputs)."""
    return {} if doc_ids is None else {"doc_ids": doc_ids}
