"""The layout planner: every layout of a job on N devices ranked by the cost model, the best
checked by the job plan and traced for their peak memory until ``top`` of them fit.

Walking the ranking from the fastest prediction down, a candidate is skipped without a trace
when a floor of its memory (the model state it must hold and the least its activations can)
cannot fit, or when a layout that holds no more than it (the
same degrees and schedule, as much checkpointing or more, no larger a batch) was traced and did
not fit; otherwise the job plan checks it (``plan_job``, the launcher's own checks) and the
memory estimate traces it (``train/memory_estimate.py``, the fast trace).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from torchtitan.config.schema import JobConfig
from torchtitan.distributed.pipeline import (
    canonical_schedule,
    holding,
    layers_of_stages,
    residency,
    schedule_order,
)
from torchtitan.errors import ConfigError
from torchtitan.planning import layouts as L
from torchtitan.planning.cost import (
    Hardware,
    Layout,
    ModelFacts,
    StepCost,
    mfu,
    step_cost,
    tokens_per_second_per_device,
)
from torchtitan.planning.facts import model_facts
from torchtitan.train.memory_estimate import TRACE_FAILURES, estimate_job, vocab_size
from torchtitan.train.memory_fit import state_bytes
from torchtitan.train.plan import plan_job, resolve_model_args

GIB = 1024**3
AC_RANK = {"none": 0, "selective": 1, "full": 2}
# bytes per token and model width a block keeps for its backward, at the least: Llama 3 8B's
# traces hold about 66 without checkpointing (seq 8192, bf16); full checkpointing keeps the
# block's input (2 bytes in bf16)
ACT_FLOOR = {"none": 16, "selective": 8, "full": 2}
# the share of the least per-token memory this job's traces held that the floor of an untraced
# layout takes (below 1: a trace's constant part, logits and one block's temporaries, is in it)
LEARNED_SHARE = 0.8


@dataclass
class Planned:
    """One layout's prediction."""

    layout: Layout
    cost: StepCost
    tokens_per_second_per_device: float
    mfu: float
    overrides: dict
    peak_gib: float | None = None  # the traced peak per device (None: not traced)
    fits: bool | None = None

    def as_json(self) -> dict:
        return {
            "layout": self.layout.describe(),
            "degrees": {
                k: getattr(self.layout, k)
                for k in ("dp_replicate", "dp_shard", "tp", "cp", "pp", "ep", "etp")
            },
            "activation_checkpoint": self.layout.ac,
            "local_batch_size": self.layout.local_batch,
            "gradient_accumulation_steps": self.layout.accum,
            "pipeline_schedule": self.layout.schedule,
            "pipeline_microbatch_size": self.layout.microbatch if self.layout.pp > 1 else None,
            "tokens_per_second_per_gpu": self.tokens_per_second_per_device,
            "mfu": self.mfu,
            "step_seconds": self.cost.seconds,
            "peak_gib": self.peak_gib,
            "fits": self.fits,
            "limit": self.cost.limit,
            "terms_seconds": self.cost.terms,
            "overrides": self.overrides,
        }


@dataclass
class Plan:
    facts: ModelFacts
    hardware: Hardware
    world: int
    seq_len: int
    global_batch: int
    layouts: list[Planned]  # the best that fit, fastest first
    reference: Planned | None  # the config's own layout, where valid
    candidates: int  # listed
    traced: int = 0
    notes: list[str] = field(default_factory=list)


def plan(
    job_config: JobConfig,
    cli: list[str],
    world: int,
    hardware: Hardware,
    device_type: str = "cuda",
    top: int = 5,
    max_traces: int = 24,
) -> Plan:
    """Rank every layout of ``job_config`` on ``world`` devices of ``hardware``; ``cli``: the
    ``--section.key value`` arguments given (the layout keys among them are kept)."""
    facts, seq_len = _facts(job_config), job_config.training.seq_len
    global_batch = _global_batch(job_config, world)
    fixed = L.fixed_fields(cli)
    moe = getattr(resolve_model_args(job_config), "moe", None)
    experts = moe.num_experts if moe is not None and facts.moe_layers else 0
    reduce_bytes = 2 if job_config.training.mixed_precision_reduce == "bfloat16" else 4
    ranked = []
    for lay in L.candidates(
        job_config, world, global_batch, fixed, experts, hardware.devices_per_node
    ):
        ranked.append((step_cost(facts, lay, hardware, seq_len, reduce_bytes), lay))
    # equal predictions: the simpler layout first (fewer parallelisms, less recomputation,
    # fewer accumulation steps: the model does not see a smaller batch's lower efficiency)
    ranked.sort(key=lambda c: (round(c[0].seconds, 9), _parts(c[1]), _ac_rank(c[1].ac), c[1].accum))
    if not ranked:
        keys = ", ".join(L.KEYS[f] for f in sorted(fixed) if f in L.KEYS) or "none"
        raise ConfigError(
            f"no layout of {world} devices keeps the global batch of {global_batch} sequences "
            f"with the layout keys given ({keys}); give degrees whose product divides {world}, "
            "a local batch dividing the global batch per data-parallel rank, or fewer keys"
        )
    walk = _Walk(job_config, world, hardware, device_type, facts, global_batch)
    chosen = []
    for cost, lay in ranked:
        if len(chosen) >= top or walk.traced >= max_traces:
            break
        planned = walk.check(lay, cost)
        if planned is not None and planned.fits:
            chosen.append(planned)
    own = L.config_layout(job_config, world)
    reference = _reference(walk, own, facts, hardware, seq_len, reduce_bytes, global_batch)
    notes = [f"refused by the job's checks: {why}" for why in walk.refused[:1]]
    notes += [f"the trace could not follow {why}" for why in walk.untraced[:3]]
    result = Plan(facts, hardware, world, seq_len, global_batch, chosen, reference, len(ranked))
    result.traced, result.notes = walk.traced, notes
    return result


def _reference(walk, own, facts, hardware, seq_len, reduce_bytes, global_batch):
    """The config's own layout (its global batch kept), where the job plan accepts it."""
    dp = own.dp_replicate * own.dp_shard
    if global_batch % (dp * own.local_batch):
        return None
    own = dataclasses.replace(own, accum=global_batch // (dp * own.local_batch))
    if own.world != walk.world:
        return None
    return walk.check(own, step_cost(facts, own, hardware, seq_len, reduce_bytes), force=True)


class _Walk:
    """The checks down the ranking, remembering the layouts that did not fit."""

    def __init__(self, job_config, world, hardware, device_type, facts, global_batch):
        self.job_config, self.world, self.hardware = job_config, world, hardware
        self.device_type, self.facts, self.global_batch = device_type, facts, global_batch
        self.seq_len = job_config.training.seq_len
        self.too_big: list[Layout] = []
        self.traced = 0
        self.refused: list[str] = []  # why the job plan refused layouts, the first few
        self.untraced: list[str] = []  # layouts the trace could not follow
        weights, grads, moments = state_bytes(job_config)
        if job_config.lora.enable:  # only the adapters train: the base weights alone are certain
            grads = moments = 0
        self.fixed_bytes, self.grad_bytes = weights + moments, grads
        self.learned: dict[str, float] = {}  # checkpointing mode -> bytes per token-dim-block
        self._walks: dict[tuple, tuple | None] = {}  # (schedule, pp, micro-batches) -> walk

    def check(self, lay: Layout, cost: StepCost, force: bool = False) -> Planned | None:
        """The layout traced, or None: cannot fit (without a trace) or not valid."""
        if not force and (self._dominated(lay) or self._floor_gib(lay) > self._budget()):
            return None
        cfg = L.with_layout(self.job_config, lay, self.global_batch)
        try:
            plan_job(cfg, self.world, self.device_type)
        except ConfigError as e:
            if len(self.refused) < 3:
                self.refused.append(f"{lay.describe()}: {str(e).splitlines()[0]}")
            return None
        try:
            estimate = estimate_job(cfg, self.world, self.device_type, fast=True)
        except TRACE_FAILURES as e:
            self.untraced.append(f"{lay.describe()}: {type(e).__name__}: {str(e)[:120]}")
            return None
        self.traced += 1
        peak = estimate["peak_gib"] + self.hardware.runtime_gib
        self._learn(lay, peak)
        fits = peak <= self._budget()
        if not fits:
            self.too_big.append(lay)
        return Planned(
            lay,
            cost,
            tokens_per_second_per_device(self.facts, lay, cost, cfg.training.seq_len),
            mfu(self.facts, lay, cost, self.hardware, cfg.training.seq_len),
            L.overrides(lay, self.global_batch),
            peak,
            fits,
        )

    def _budget(self) -> float:
        return self.hardware.memory_gib - self.hardware.reserve_gib

    def _floor_gib(self, lay: Layout) -> float:
        """Memory per device at the least: the weights and the optimizer's moments, and the
        most the activations and gradients hold together over the step. Without PP, the
        larger of the gradients (all alive after the backward) and the activations (all alive
        at the end of the forward, before any gradient); under PP, the gathered weights and
        the most of both over the actions of the first and the last pipeline rank in their
        schedule's order (:meth:`_schedule`: each local stage's micro-batches held, and its
        whole gradients from its first backward on), or the gathered weights alone where the
        order is not known. Parameters: the blocks split over pp, everything over the devices
        that shard it (tp x dp_shard x cp); under PP a stage holds one of the embedding and
        the output. Activations: each block's saved tensors, at least ``ACT_FLOOR`` bytes per
        token and dim (a quarter of what the traces of Llama 3 8B hold), or ``LEARNED_SHARE``
        of the least this job's traces held (:meth:`_learn`)."""
        params, token_dims = self._sizes(lay)
        mode = lay.ac.partition(":")[0]
        coefficient = max(ACT_FLOOR[mode], LEARNED_SHARE * self.learned.get(mode, 0.0))
        gathered, grads = self._pipelined_fsdp_bytes(lay, params)
        if lay.pp == 1:
            return (self.fixed_bytes * params + max(grads, coefficient * token_dims)) / GIB
        walk = self._schedule(lay)
        if walk is None:
            return (self.fixed_bytes * params + gathered) / GIB
        snapshots, _, v = walk
        per_stage = coefficient * token_dims / v  # one micro-batch through one local stage
        most = max(per_stage * held + grads / v * with_grads for held, with_grads in snapshots)
        return (self.fixed_bytes * params + gathered + most) / GIB

    def _schedule(self, lay: Layout) -> tuple[list[tuple[int, int]], int, int] | None:
        """The first and last pipeline rank's walk through their schedule's actions
        (``pipeline.schedule_order``: torch's own order for multi-stage schedules): after each
        action, the micro-batches their stages hold together and how many stages have
        gradients; the most micro-batches a trace of the rank holds (each stage at its most,
        ``pipeline.residency``); the stages per rank. None where the order is not known: a
        CSV file's, a cut the job's checks refuse, one this torch cannot lay out."""
        key = (lay.schedule, lay.pp, lay.microbatches)
        if key in self._walks:
            return self._walks[key]
        p, walk = self.job_config.parallelism, None
        try:
            if p.pipeline_parallel_schedule_csv:
                raise ValueError("a CSV file's order")
            schedule = canonical_schedule(lay.schedule or "1F1B")
            stages = len(layers_of_stages(p, schedule, lay.pp, self.facts.n_layers))
            snapshots, traced = [], 0
            for rank in sorted({0, lay.pp - 1}):
                order = schedule_order(schedule, lay.pp, stages, lay.microbatches, rank, True)
                snapshots += [(sum(h.values()), len(g)) for h, g in holding(order)]
                traced = max(traced, sum(max(most) for most in residency(order).values()))
            walk = (snapshots, traced, stages // lay.pp)
        except (ConfigError, ValueError, RuntimeError, AttributeError, TypeError, AssertionError):
            walk = None  # refused by the job's checks, or torch cannot lay the schedule out
        self._walks[key] = walk
        return walk

    def _pipelined_fsdp_bytes(self, lay: Layout, params: float) -> tuple[float, float]:
        """The gathered weights and the gradients a device holds at the end of its backwards.
        Under PP with FSDP, torch's schedules reduce-scatter only after the last micro-batch's
        backward: until then a stage's dense weights stay gathered (2 bytes each at the least)
        and their gradients accumulate whole (in the reduce dtype); the experts' are counted
        sharded (EP shards them otherwise). Else no gathered weights, and the gradient shard."""
        shard = lay.dp_shard * lay.cp
        if lay.pp == 1 or shard == 1 or self.grad_bytes == 0:
            return 0.0, self.grad_bytes * params
        m = self.facts
        dense = params * (1 - m.expert_parameters / m.parameters)
        reduce_bytes = 2 if self.job_config.training.mixed_precision_reduce == "bfloat16" else 4
        whole = reduce_bytes * dense * shard + self.grad_bytes * (params - dense)
        return 2 * dense * shard, max(whole, self.grad_bytes * params)

    def _sizes(self, lay: Layout) -> tuple[float, float]:
        """A device's parameters (the blocks split over pp, everything over tp x dp_shard x
        cp; a pipeline stage holds one of the embedding and the output) and the tokens x dim
        x blocks its activations scale with (split over TP): the local batch's, under PP one
        micro-batch's through the rank's blocks."""
        m = self.facts
        outer = m.outer_parameters / (2 if lay.pp > 1 else 1)
        params = (m.layer_parameters / lay.pp + outer) / (lay.tp * lay.dp_shard * lay.cp)
        sequences = lay.microbatch if lay.pp > 1 else lay.local_batch
        tokens = sequences * self.seq_len / lay.cp
        return params, m.dim * tokens / lay.tp * m.n_layers / lay.pp

    def _learn(self, lay: Layout, peak_gib: float) -> None:
        """The bytes per token, dim and block this job's traces held beyond the weights and
        moments (under PP, and beyond a stage's gathered weights and whole gradients, per
        micro-batch the trace held through a stage: :meth:`_schedule`), the least seen per
        checkpointing mode: the floor of the layouts not yet traced takes ``LEARNED_SHARE``
        of it."""
        params, token_dims = self._sizes(lay)
        state = self.fixed_bytes * params
        if lay.pp > 1:
            walk = self._schedule(lay)
            if walk is None:
                return
            _, traced, v = walk
            state += sum(self._pipelined_fsdp_bytes(lay, params))
            token_dims *= traced / v
        held = max(0.0, peak_gib * GIB - state) / token_dims
        mode = lay.ac.partition(":")[0]
        self.learned[mode] = min(self.learned.get(mode, held), held)

    def _dominated(self, lay: Layout) -> bool:
        """A layout holding as much or more than one that did not fit."""
        for big in self.too_big:
            same = all(
                getattr(lay, k) == getattr(big, k)
                for k in ("dp_replicate", "dp_shard", "cp", "tp", "pp", "ep", "etp", "schedule")
            )
            if (
                same
                and _ac_rank(lay.ac) <= _ac_rank(big.ac)
                and lay.local_batch >= big.local_batch
                and lay.microbatch >= big.microbatch
            ):
                return True
        return False


def _parts(lay: Layout) -> int:
    dims = (lay.dp_replicate, lay.dp_shard, lay.tp, lay.cp, lay.pp, lay.ep)
    return sum(d > 1 for d in dims)


def _ac_rank(ac: str) -> int:
    return AC_RANK[ac.partition(":")[0]]


def _facts(job_config: JobConfig) -> ModelFacts:
    from torchtitan.models.spec import get_model_spec

    args = resolve_model_args(job_config)
    args = dataclasses.replace(args, vocab_size=vocab_size(args, job_config))
    m = job_config.model
    spec = get_model_spec(m.name)
    return model_facts(spec, args, job_config.training.seq_len, f"{m.name} {m.flavor}")


def _global_batch(job_config: JobConfig, world: int) -> int:
    """Sequences per step: ``training.global_batch_size``, else the config's local batch on
    each data-parallel rank of its own layout on ``world`` devices."""
    t = job_config.training
    if t.global_batch_size > 0:
        return t.global_batch_size
    own = L.config_layout(job_config, world)
    if own.world == world:
        return t.local_batch_size * own.dp_replicate * own.dp_shard
    return t.local_batch_size * world
