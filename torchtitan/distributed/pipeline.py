"""Pipeline parallelism for a decoder (any family), with ``torch.distributed.pipelining``.

The model is cut between transformer blocks into stages. Stage 0 also holds the token embedding,
the last stage the final norm and the output projection; as upstream torchtitan splits, the
embedding counts as ``pipeline_parallel_first_stage_less_layers`` layers and norm + output as
``pipeline_parallel_last_stage_less_layers`` (1 each by default), so a 6-layer model split into 8
stages has an embedding-only first stage and a norm + output-only last one
(:func:`split_layers`). Single-stage schedules (GPipe, 1F1B)
give each pipeline rank one stage; looped multi-stage schedules (Interleaved1F1B, LoopedBFS,
InterleavedZeroBubble) give rank ``r`` stages ``r, r + pp, r + 2 pp, ...``; V-shaped schedules
(ZBVZeroBubble, DualPipeV) give rank ``r`` exactly stages ``r`` and ``2 pp - 1 - r``. A custom
order of each rank's actions can come from a CSV file (``pipeline_parallel_schedule_csv``,
torch's ``PipelineScheduleMulti._load_csv`` format; :func:`check_schedule_csv`).

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
optimizer step, ``train/loss.py``), and the schedule's own ``scale_grads`` is off. The summed
micro-batch losses and gradients are then exactly those of the unpipelined step. (The
schedule's ``scale_grads=True`` would divide the *accumulated* ``.grad`` by the number of
micro-batches after every step, which is wrong under gradient accumulation.) The document ids
of block-causal attention go to every stage as a keyword argument, split like the batch.
"""

from __future__ import annotations

import contextlib
import copy
import csv
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from torchtitan.config.schema import ActivationCheckpoint, Parallelism
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
# torch's base classes, named to run a CSV file's order on the single- or looped-stage layout
CSV_ONLY = ("PipelineScheduleSingle", "PipelineScheduleMulti")
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
_FIRST = _P + "pipeline_parallel_first_stage_less_layers"
_LAST = _P + "pipeline_parallel_last_stage_less_layers"
_CSV = _P + "pipeline_parallel_schedule_csv"


@dataclass(frozen=True)
class PipelinePlan:
    """Where every layer goes and how a local batch is cut; the same on every rank."""

    schedule: str  # canonical name, one of SCHEDULES
    pp: int
    stage_layers: tuple[tuple[int, ...], ...]  # stage index -> its transformer block ids
    microbatch_size: int
    n_microbatches: int
    schedule_csv: str = ""  # each rank's actions in order (check_schedule_csv); "" = the schedule's

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
        if layers:
            parts.append(
                f"layers {layers[0]}-{layers[-1]}" if len(layers) > 1 else f"layer {layers[0]}"
            )
        if stage == self.num_stages - 1:
            parts.append("norm + output")
        return f"stage {stage} (pp rank {self.stage_rank(stage)}): " + " + ".join(parts)

    def describe(self) -> str:
        order = f" in the order of {self.schedule_csv}" if self.schedule_csv else ""
        return (
            f"Pipeline schedule {self.schedule}{order}: {self.num_stages} stages on pp={self.pp} "
            "ranks, "
            f"{self.n_microbatches} micro-batches of {self.microbatch_size}; "
            + "; ".join(self.describe_stage(s) for s in range(self.num_stages))
        )


def canonical_schedule(name: str, csv: str = "") -> str:
    """The schedule's canonical name; torch's base classes (CSV_ONLY) only with a CSV file."""
    by_lower = {s.lower(): s for s in SCHEDULES + CSV_ONLY}
    canonical = by_lower.get(name.lower())
    if canonical is None:
        raise ConfigError(f"{_SCHEDULE}: unknown schedule '{name}'; valid: {', '.join(SCHEDULES)}")
    if canonical in CSV_ONLY and not csv:
        raise ConfigError(
            f"{_SCHEDULE}: {canonical} runs the order of a CSV file; set {_CSV}, or name a "
            f"schedule: {', '.join(SCHEDULES)}"
        )
    return canonical


def split_layers(
    n_layers: int, num_stages: int, first_less: int = 0, last_less: int = 0
) -> tuple[tuple[int, ...], ...]:
    """Consecutive layer ids per stage. As upstream torchtitan splits, the embedding counts as
    ``first_less`` layers and norm + output as ``last_less``: the ``n_layers + first_less +
    last_less`` counted layers are split as evenly as possible (earlier stages get the extra
    ones), and the first and last stages hold that many fewer transformer blocks (none, when
    that is all they count). (0, 0): the blocks alone, split evenly."""
    counted = n_layers + first_less + last_less
    base, extra = divmod(counted, num_stages)
    if num_stages > 1 and (base < first_less or base < last_less):
        raise ValueError(f"{num_stages} stages of {counted} counted layers leave {base} a stage")
    stages, start = [], 0
    for s in range(num_stages):
        size = base + (1 if s < extra else 0)
        size -= (first_less if s == 0 else 0) + (last_less if s == num_stages - 1 else 0)
        stages.append(tuple(range(start, start + size)))
        start += size
    return tuple(stages)


def stages_per_rank(schedule: str) -> int | None:
    """Stages every rank runs: 1 (single-stage), 2 (V-shaped), None (looped: any, at least 2)."""
    if schedule in (*SINGLE_STAGE, "PipelineScheduleSingle"):
        return 1
    return 2 if schedule in V_SHAPED else None


def _num_stages(
    schedule: str, pp: int, n_layers: int, layers_per_stage: int | None, first: int, last: int
) -> int:
    """How many stages, as upstream counts them: the model's layers plus ``first`` for the
    embedding and ``last`` for norm + output; ``layers_per_stage`` of those per stage (rounded
    up), else one stage per rank (single-stage schedules) or two."""
    counted = n_layers + first + last
    what = (
        f"{counted} layers as stages count them ({n_layers} + {first} for the embedding + "
        f"{last} for norm + output)"
    )
    per_rank = stages_per_rank(schedule)
    if layers_per_stage is None:
        num_stages = pp * (per_rank or 2)
        if num_stages > counted:
            raise ConfigError(
                f"{_DEGREE}: {pp} with the {schedule} schedule needs {num_stages} stages "
                f"({num_stages // pp} per rank), more than the model's {what}; use a smaller "
                f"degree or a single-stage schedule (GPipe, 1F1B)"
            )
    else:
        num_stages = _stages_of_size(schedule, pp, counted, layers_per_stage, what, per_rank)
    base = counted // num_stages
    if num_stages > 1 and max(first, last) > base:
        key, value = (_FIRST, first) if first > base else (_LAST, last)
        raise ConfigError(
            f"{key}: {value} is more than the {base} counted layers each of the {num_stages} "
            f"stages holds; use at most {base}"
        )
    return num_stages


def _stages_of_size(
    schedule: str, pp: int, counted: int, size: int, what: str, per_rank: int | None
) -> int:
    """Stages of ``size`` counted layers each (``pipeline_parallel_layers_per_stage``)."""
    if size < 1:
        raise ConfigError(f"{_LPS}: {size} must be >= 1 (or unset for an even split)")
    num_stages = -(-counted // size)
    want = per_rank or max(2, num_stages // pp)
    if num_stages == pp * want:
        return num_stages
    fits = [n for n in range(1, counted + 1) if -(-counted // n) == pp * want]
    fix = f"use {fits[0]} or leave it unset" if fits else "leave it unset"
    if per_rank is None:  # looped: any multiple of pp, at least 2 per rank
        fix = "use a size that gives a multiple of it (at least two per rank), or leave it unset"
    layout = {1: "exactly one stage", 2: "exactly two stages"}.get(per_rank or 0, "stages")
    raise ConfigError(
        f"{_LPS}: {size} makes {num_stages} stages of the model's {what}, but the {schedule} "
        f"schedule runs {layout} per rank on pipeline_parallel_degree={pp} ranks "
        f"({pp * want} stages); {fix}"
    )


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


def _check_composes(
    p: Parallelism,
    compile_enabled: bool,
    ac: ActivationCheckpoint,
    schedule: str,
    key: str = _SCHEDULE,
) -> None:
    """Combinations with the other features that cannot work (one-line errors). ``key``: where
    the split backward comes from (the schedule, or a CSV file's I/W actions)."""
    if schedule not in ZERO_BUBBLE and key == _SCHEDULE:
        return
    what = schedule if key == _SCHEDULE else f"'{p.pipeline_parallel_schedule_csv}'"
    if compile_enabled:  # compiled blocks fail; a compiled loss alone is untested
        raise ConfigError(
            f"{key}: {what} splits backward into input and weight parts, which "
            f"torch.compile does not support; turn compile.enable off or use another schedule"
        )
    if ac.mode == "selective" and ac.selective_ac_option == "op":
        raise ConfigError(
            f"{key}: {what} splits backward into input and weight parts, which "
            f"per-op selective activation checkpointing cannot replay twice; use "
            f"activation_checkpoint.mode full, a layer interval, or another schedule"
        )


def check_pipeline_config(
    p: Parallelism,
    model_args: Any,
    dims: Any,
    *,
    local_batch_size: int,
    compile_enabled: bool,
    ac: ActivationCheckpoint,
    model_label: str,
) -> PipelinePlan:
    """Validate the ``parallelism`` section's pipeline settings against the model
    (``model_label``: its name and flavor, for messages) and the parallel layout (a
    ``ParallelDims``): the plan, or a one-line ConfigError naming the key."""
    pp = dims.pp
    csv_path = p.pipeline_parallel_schedule_csv
    schedule = canonical_schedule(p.pipeline_parallel_schedule, csv_path)
    n_layers = model_args.n_layers
    if getattr(model_args, "tie_word_embeddings", False):
        raise ConfigError(
            f"{_DEGREE}: {pp} splits the model across stages, but {model_label} "
            f"ties its input and output embeddings "
            f"(tie_word_embeddings), which must live on one rank; use 1 or an untied flavor"
        )
    if pp > n_layers:
        raise ConfigError(f"{_DEGREE}: {pp} exceeds the model's {n_layers} layers")
    _check_composes(p, compile_enabled, ac, schedule)
    stage_layers = layers_of_stages(p, schedule, pp, n_layers)
    mbs = p.pipeline_parallel_microbatch_size
    local = local_batch_size
    n_mb = _check_microbatches(schedule, local, mbs, len(stage_layers), pp)
    plan = PipelinePlan(schedule, pp, stage_layers, mbs, n_mb, csv_path)
    if csv_path and check_schedule_csv(plan):
        _check_composes(p, compile_enabled, ac, schedule, key=_CSV)
    return plan


def layers_of_stages(p: Parallelism, schedule: str, pp: int, n_layers: int) -> tuple:
    """Each stage's block ids: from the split points, else ``layers_per_stage`` or one stage
    per rank (two for multi-stage schedules), as :func:`split_layers` cuts them; a one-line
    ConfigError when the keys do not make the schedule's stages."""
    if p.pipeline_parallel_split_points:
        if p.pipeline_parallel_layers_per_stage is not None:
            raise ConfigError(f"{_LPS}: give it or {_SPLIT}, not both")
        return _stages_at(p.pipeline_parallel_split_points, n_layers, schedule, pp)
    first = p.pipeline_parallel_first_stage_less_layers
    last = p.pipeline_parallel_last_stage_less_layers
    lps = p.pipeline_parallel_layers_per_stage
    num = _num_stages(schedule, pp, n_layers, lps, first, last)
    return split_layers(n_layers, num, first, last)


def check_schedule_csv(plan: PipelinePlan) -> bool:
    """The plan's CSV file, checked against it (a one-line ConfigError naming the file on any
    problem): one row per pipeline rank, each cell one action ``<stage><F|B|I|W><micro-batch>``
    (``0F1``: stage 0's forward of micro-batch 1; F forward, B full backward, I and W backward's
    input and weight halves) or empty (idle); every stage on the rank the schedule's layout gives
    it, each of its micro-batches forward once and backward once (B, or I then W). Returns
    whether the file splits backward (I / W actions)."""
    from torch.distributed.pipelining.schedules import _Action, _validate_schedule

    path = plan.schedule_csv
    where = f"{_CSV}: '{path}'"
    try:
        with open(path, newline="") as f:
            rows = list(csv.reader(f))
    except OSError as e:
        raise ConfigError(
            f"{where} cannot be read ({e.strerror}); give a CSV file of each pipeline rank's "
            "actions (docs/parallelisms.md)"
        ) from None
    if len(rows) != plan.pp:
        raise ConfigError(f"{where} has {len(rows)} rows; give one per pipeline rank ({plan.pp})")
    actions = {
        r: [_csv_action(_Action, cell, r, i, plan, where) for i, cell in enumerate(row)]
        for r, row in enumerate(rows)
    }
    done = [a for row in actions.values() for a in row if a is not None]
    _check_csv_counts(done, plan, where)
    try:  # torch's own check: the order (a backward after its forward, W after its I)
        _validate_schedule(actions, plan.pp, plan.num_stages, plan.n_microbatches)
    except (AssertionError, KeyError) as e:
        raise ConfigError(f"{where}: {' '.join(str(e).strip().splitlines()[0].split())}") from None
    return any(a.computation_type.value in "IW" for a in done)


def _check_csv_counts(actions: list[Any], plan: PipelinePlan, where: str) -> None:
    """Every stage runs forward once per micro-batch, and backward once (B, or I and W)."""
    want = list(range(plan.n_microbatches))
    for stage in range(plan.num_stages):
        seen: dict[str, list[int]] = {t: [] for t in "FBIW"}
        for a in actions:
            if a.stage_index == stage:
                seen[a.computation_type.value].append(a.microbatch_index)
        backward = sorted(seen["B"] + seen["I"])
        if sorted(seen["F"]) != want or backward != want or sorted(seen["W"]) != sorted(seen["I"]):
            raise ConfigError(
                f"{where}: stage {stage} runs forward on micro-batches {sorted(seen['F'])} and "
                f"backward (B or I) on {backward} (W on {sorted(seen['W'])}); each of "
                f"{want[0]}-{want[-1]} needs one F and one B (or an I and a W)"
            )


def _csv_action(
    action_cls: Any, cell: str, rank: int, i: int, plan: PipelinePlan, where: str
) -> Any:
    """One cell of a schedule CSV as torch's action (None: empty), checked against the plan."""
    at = f"{where}: row {rank + 1} (pp rank {rank}), entry {i + 1} {cell.strip()!r}"
    try:
        action = action_cls.from_str(cell)
    except RuntimeError:
        action = False
    if action is None:
        return None
    if (
        action is False
        or repr(action) != cell.strip()  # torch reads a prefix: 0F0x would pass as 0F0
        or action.computation_type.value not in ("F", "B", "I", "W")
        or action.microbatch_index is None
    ):
        raise ConfigError(
            f"{at} is not an action; write <stage><F|B|I|W><micro-batch>, e.g. 0F1 (or leave the "
            "cell empty)"
        )
    stage, mb = action.stage_index, action.microbatch_index
    if not 0 <= stage < plan.num_stages or not 0 <= mb < plan.n_microbatches:
        raise ConfigError(
            f"{at}: the plan has stages 0-{plan.num_stages - 1} and micro-batches "
            f"0-{plan.n_microbatches - 1}"
        )
    if plan.stage_rank(stage) != rank:
        raise ConfigError(
            f"{at}: stage {stage} runs on pp rank {plan.stage_rank(stage)} in the "
            f"{plan.schedule} layout; move the action to that rank's row"
        )
    return action


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
    need = stages_per_rank(schedule)
    if rest or per_rank != (need or max(per_rank, 2)):
        want = f"{need * pp}" if need else f"a multiple of {pp} (at least {2 * pp})"
        raise ConfigError(
            f"{_SPLIT}: {len(points)} split points make {len(stages)} stages, but "
            f"pipeline_parallel_degree={pp} with the {schedule} schedule needs {want}"
        )
    return stages


def rank_order(plan: PipelinePlan, pp_rank: int) -> tuple[tuple[int, str], ...]:
    """The compute actions ``pp_rank`` runs in one step, in order, as ``(stage, kind)``: kind F
    (forward), B (full backward), I or W (backward's input and weight halves). The CSV file's row
    when the plan has one, else the schedule's own order (:func:`schedule_order`)."""
    if not plan.schedule_csv:
        return schedule_order(plan.schedule, plan.pp, plan.num_stages, plan.n_microbatches, pp_rank)
    from torch.distributed.pipelining.schedules import _Action

    with open(plan.schedule_csv, newline="") as f:  # checked by check_schedule_csv
        row = list(csv.reader(f))[pp_rank]
    actions = [_Action.from_str(cell) for cell in row]
    return tuple((a.stage_index, a.computation_type.value) for a in actions if a is not None)


@functools.lru_cache(maxsize=256)
def schedule_order(
    schedule: str, pp: int, num_stages: int, n: int, pp_rank: int, exact: bool = False
) -> tuple[tuple[int, str], ...]:
    """:func:`rank_order` of a named schedule. GPipe: every forward, then every backward. 1F1B
    (torch's ``Schedule1F1B``): ``min(n, pp - rank)`` forwards, then a backward and a forward in
    turn, then the remaining backwards. Multi-stage schedules: torch's own ``pipeline_order``,
    laid out by the schedule from stand-in stages (an overlapped forward and backward as the
    forward, then the backward); where this torch's schedule cannot be laid out that way, an
    order that holds the most any can (every forward of every local stage, then the
    backwards; with ``exact``, the error instead)."""
    if schedule == "GPipe":
        return tuple([(pp_rank, "F")] * n + [(pp_rank, "B")] * n)
    if schedule == "1F1B":
        warmup = min(n, pp - pp_rank)
        steady = [a for _ in range(n - warmup) for a in ((pp_rank, "B"), (pp_rank, "F"))]
        return tuple([(pp_rank, "F")] * warmup + steady + [(pp_rank, "B")] * warmup)
    plan = PipelinePlan(schedule, pp, ((),) * num_stages, 1, n)
    local = plan.stages_of(pp_rank)
    try:
        order = _torch_order(plan, local, pp_rank)
    except Exception:  # noqa: BLE001 - another torch's constructor reads more of a stage
        if exact:
            raise
        return tuple(
            [(s, "F") for s in local for _ in range(n)]
            + [(s, "B") for s in local for _ in range(n)]
        )
    out = []
    for action in order:
        for a in action.sub_actions or (action,):
            out.append((a.stage_index, a.computation_type.value))
    return tuple(out)


def holding(order: tuple[tuple[int, str], ...]) -> Iterator[tuple[dict[int, int], set[int]]]:
    """After each action of a rank's ``order`` (:func:`rank_order`): how many micro-batches'
    activations each stage holds (a forward keeps them, a full or weight backward frees them,
    an input backward keeps them for its weight half), and the stages whose gradients exist
    (from their first full or weight backward on). The same objects, updated in place."""
    held = {stage: 0 for stage, _ in order}
    grads: set[int] = set()
    for stage, kind in order:
        if kind == "F":
            held[stage] += 1
        elif kind in "BW":
            held[stage] -= 1
            grads.add(stage)
        yield held, grads


def residency(order: tuple[tuple[int, str], ...]) -> dict[int, tuple[int, int]]:
    """For each stage in ``order``: the most micro-batches it holds before its first gradient
    exists, and the most it holds while its gradients exist (0 if never) (:func:`holding`)."""
    before: dict[int, int] = {}
    after: dict[int, int] = {}
    for held, grads in holding(order):
        for stage, n in held.items():
            most = after if stage in grads else before
            most[stage] = max(most.get(stage, 0), n)
    return {stage: (before.get(stage, 0), after.get(stage, 0)) for stage, _ in order}


def _torch_order(plan: PipelinePlan, local: list[int], pp_rank: int) -> list[Any]:
    """``pp_rank``'s compute actions as torch's schedule class lays them out (no process group:
    the layout reads only a stage's index, rank, and place in the pipeline)."""
    from torch.distributed.pipelining.schedules import get_schedule_class

    class StandIn:
        def __init__(self, index: int):
            self.stage_index, self.group_size, self.group_rank = index, plan.pp, pp_rank
            self.num_stages, self.submod = plan.num_stages, None
            self.is_first, self.is_last = index == 0, index == plan.num_stages - 1

    cls = get_schedule_class(plan.schedule)
    schedule = cls([StandIn(s) for s in local], plan.n_microbatches)
    return [a for a in schedule.pipeline_order[pp_rank] if a is not None]


def split_model(model: nn.Module, plan: PipelinePlan, pp_rank: int) -> dict[int, nn.Module]:
    """This rank's stages, keyed by stage index: copies of the (meta-device) full model that keep
    only their own layers, the embedding on stage 0 and norm + output (and the multi-token-
    prediction depths, which share the output) on the last stage."""
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
            part.mtp_layers = None  # multi-token prediction: on the last stage, by the head
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
        loss_fn: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor],
    ):
        # (imported here: preflight, which needs only the plan, stays light)
        from torch.distributed.pipelining import PipelineStage
        from torch.distributed.pipelining.schedules import (
            PipelineScheduleSingle,
            _PipelineScheduleRuntime,
            get_schedule_class,
        )

        self.plan = plan
        self.loss_fn = loss_fn
        self.divisor: float | None = None  # the running call's, passed to every micro-batch loss
        # the last forward_backward's micro-batch losses as the loss function returned them
        # (on the rank of the last stage; empty elsewhere)
        self.micro_batch_losses: list[torch.Tensor] = []
        self.device = device
        self.group = group
        self.stage_indices = sorted(parts)
        self.parts = [parts[s] for s in self.stage_indices]
        self.has_first = 0 in parts
        self.has_last = plan.num_stages - 1 in parts
        self.last_rank = plan.stage_rank(plan.num_stages - 1)
        stage_cls = _keeping_buffers(PipelineStage)
        stages = [
            stage_cls(parts[s], s, plan.num_stages, device, group=group) for s in self.stage_indices
        ]
        # a CSV file's order runs on torch's runtime of compute actions (it adds the sends and
        # receives), on every rank's stages
        cls = _PipelineScheduleRuntime if plan.schedule_csv else get_schedule_class(plan.schedule)
        self.schedule = cls(
            stages[0] if issubclass(cls, PipelineScheduleSingle) else stages,
            n_microbatches=plan.n_microbatches,
            loss_fn=self._micro_batch_loss,
            scale_grads=False,
        )
        if plan.schedule_csv:
            self.schedule._load_csv(plan.schedule_csv)

    def _micro_batch_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """What the schedule calls on the last stage: ``loss_fn`` with the running call's divisor
        (set only while :meth:`forward_backward` or :meth:`forward_loss` runs)."""
        if self.divisor is None:
            raise RuntimeError("the pipeline's loss runs only inside forward_backward/forward_loss")
        return self.loss_fn(output, target, self.divisor)

    @contextlib.contextmanager
    def _divided_by(self, divisor: float) -> Iterator[None]:
        self.divisor = divisor
        try:
            yield
        finally:
            self.divisor = None

    def forward_loss(
        self, inputs: torch.Tensor, labels: torch.Tensor, doc_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The summed loss of one local batch (``loss_fn`` with divisor 1 over its micro-
        batches), forward only (evaluation), on every pipeline rank."""
        args = (inputs,) if self.has_first else ()
        losses: list[torch.Tensor] = []
        with torch.no_grad(), self._divided_by(1.0):
            self.schedule.eval(
                *args,
                target=labels if self.has_last else None,
                losses=losses if self.has_last else None,
                **_stage_kwargs(doc_ids),
            )
        return self._broadcast_sum(losses)

    def forward_rows(
        self,
        inputs: torch.Tensor,
        labels: torch.Tensor,
        doc_ids: torch.Tensor | None,
        row_loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    ) -> torch.Tensor:
        """Each row's ``row_loss`` (``[rows]``: a value per sequence of the local batch, in
        order) forward only, on every pipeline rank (broadcast from the last stage's)."""
        args = (inputs,) if self.has_first else ()
        losses: list[torch.Tensor] = []
        training_loss = self.loss_fn
        self.loss_fn = lambda output, target, _divisor: row_loss(output, target)
        try:
            with torch.no_grad(), self._divided_by(1.0):
                self.schedule.eval(
                    *args,
                    target=labels if self.has_last else None,
                    losses=losses if self.has_last else None,
                    **_stage_kwargs(doc_ids),
                )
        finally:
            self.loss_fn = training_loss
        if self.has_last:
            rows = torch.cat([full_tensor(x).float().reshape(-1) for x in losses])
        else:
            rows = torch.zeros(labels.shape[0], device=self.device)
        dist.broadcast(rows, group=self.group, group_src=self.last_rank)
        return rows

    def _broadcast_sum(self, losses: list[torch.Tensor]) -> torch.Tensor:
        """The sum of the last stage's micro-batch losses, broadcast to every pipeline rank."""
        if self.has_last:
            loss = torch.stack([full_tensor(x.detach()).float() for x in losses]).sum()
        else:
            loss = torch.zeros((), device=self.device)
        dist.broadcast(loss, group=self.group, group_src=self.last_rank)
        return loss

    def forward_backward(
        self,
        inputs: torch.Tensor,
        labels: torch.Tensor,
        doc_ids: torch.Tensor | None = None,
        divisor: float = 1.0,
    ) -> torch.Tensor:
        """Forward and backward of one local batch through the pipeline (gradients accumulate
        into the parts' ``.grad``), each micro-batch's summed loss divided by ``divisor``.
        Returns the batch's loss (the sum of its micro-batches'), on every pipeline rank: it is
        broadcast from the rank that holds the last stage."""
        args = (inputs,) if self.has_first else ()
        losses: list[torch.Tensor] = []
        with self._divided_by(divisor):
            self.schedule.step(
                *args,
                target=labels if self.has_last else None,
                losses=losses if self.has_last else None,
                return_outputs=False,
                **_stage_kwargs(doc_ids),
            )
        self.micro_batch_losses = losses
        return self._broadcast_sum(losses)


def _keeping_buffers(stage_cls: type) -> type:
    """``stage_cls`` (torch's ``PipelineStage``) whose buffers come out of torch's metadata
    inference as they went in.

    Before its first micro-batch, torch runs every stage's forward once to learn the shapes
    between stages: the first stage on the first micro-batch, the others on uninitialized
    tensors of the received shapes (torch 2.13's ``_forward_metadata_inference``). A module that
    counts in its forward (a MoE layer's ``tokens_per_expert``, its auxiliary loss's sum) would
    count that pass too, and the first optimizer step would move the expert biases by a load no
    micro-batch had: measured on the DeepSeek-V3 debug flavor, PP2 then left one process by
    1e-4 from step 2 on (up to 1.3e-3 by step 8); with the buffers restored, by 1e-6. A torch
    without the cleanup hook (2.11) infers the shapes inside ``_prepare_forward_infra``: there
    the buffers are restored when it returns (the same PP2 case, 1.2e-3 without, passed
    with it on torch 2.11, 2026-11-27)."""

    class Stage(stage_cls):
        _saved_buffers: list[tuple[torch.Tensor, torch.Tensor]] | None = None

        def _prepare_forward_infra(self, *args: Any, **kwargs: Any) -> Any:
            if self._saved_buffers is None:
                self._saved_buffers = [(b, b.detach().clone()) for b in self.submod.buffers()]
            out = super()._prepare_forward_infra(*args, **kwargs)
            if not hasattr(stage_cls, "_post_metadata_inference_cleanup"):
                self._restore_buffers()  # older torch: shape inference ran in there
            return out

        def _post_metadata_inference_cleanup(self) -> None:
            super()._post_metadata_inference_cleanup()
            self._restore_buffers()

        def _restore_buffers(self) -> None:
            if self._saved_buffers is not None:
                with torch.no_grad():
                    for buffer, saved in self._saved_buffers:
                        buffer.copy_(saved)
                self._saved_buffers = None

    return Stage


def _stage_kwargs(doc_ids: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """Keyword arguments of every stage's forward (split into micro-batches like the inputs)."""
    return {} if doc_ids is None else {"doc_ids": doc_ids}
