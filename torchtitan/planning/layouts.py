"""The layouts a job could run with on N devices: every combination of degrees, activation
checkpointing, local batch and pipeline schedule that keeps the global batch, and the config
keys that say each.

Candidates are cheap to list (thousands for a large job); whether one is valid is the job plan's
to say (:func:`torchtitan.train.plan.plan_job`, the launcher's own checks), asked only of the
candidates the planner reaches.
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Iterator
from typing import Any

from torchtitan.config.compat import ALIASES
from torchtitan.config.parse import split_cli
from torchtitan.config.schema import JobConfig
from torchtitan.distributed.pipeline import canonical_schedule
from torchtitan.errors import ConfigError
from torchtitan.planning.cost import Layout

# Layout field -> the config key that sets it
KEYS = {
    "dp_replicate": "parallelism.data_parallel_replicate_degree",
    "dp_shard": "parallelism.data_parallel_shard_degree",
    "tp": "parallelism.tensor_parallel_degree",
    "cp": "parallelism.context_parallel_degree",
    "pp": "parallelism.pipeline_parallel_degree",
    "ep": "parallelism.expert_parallel_degree",
    "etp": "parallelism.expert_tensor_parallel_degree",
    "ac": "activation_checkpoint.mode",
    "local_batch": "training.local_batch_size",
    "schedule": "parallelism.pipeline_parallel_schedule",
    "microbatch": "parallelism.pipeline_parallel_microbatch_size",
}
AC_MODES = ("none", "selective", "full")  # least memory saved first
SCHEDULES = ("1F1B", "Interleaved1F1B", "ZBVZeroBubble")
MAX_TP = 8  # inside a node: TP's collectives are on the critical path


def given_keys(cli: list[str]) -> list[str]:
    """The current names of the ``section.key`` options given (old names through the aliases;
    an old key with no current one, accepted and ignored, left out), but the config file's."""
    keys = []
    for setting in split_cli(cli):
        alias = ALIASES.get(setting.written)
        if alias is not None and not alias.new:
            continue
        key = alias.new if alias is not None else setting.written
        if key != "job.config_file":
            keys.append(key)
    return keys


def fixed_fields(cli: list[str]) -> set[str]:
    """The Layout fields the command line sets: the planner keeps the config's value for those."""
    given = set(given_keys(cli))
    fields = {name for name, key in KEYS.items() if key in given}
    if "activation_checkpoint.selective_ac_option" in given:
        fields.add("ac_option")  # not a field: how selective checkpointing is done
    return fields


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidates(
    job_config: JobConfig,
    world: int,
    global_batch: int,
    fixed: set[str],
    num_experts: int = 0,
    devices_per_node: int = 8,
) -> Iterator[Layout]:
    """Every layout of ``world`` devices for ``global_batch`` sequences a step, with the fields
    in ``fixed`` at the config's values; not yet checked (the job plan does that)."""
    p = job_config.parallelism
    if "schedule" in fixed:  # a name torch has no schedule for: refused here, not planned around
        canonical_schedule(p.pipeline_parallel_schedule, p.pipeline_parallel_schedule_csv)
    own = config_layout(job_config, world)
    etp_given = p.expert_tensor_parallel_degree if "etp" in fixed else None

    def choices(name: str, free: list) -> list:
        return [getattr(own, name)] if name in fixed else free

    for tp, cp, pp in itertools.product(
        choices("tp", [d for d in divisors(world) if d <= min(MAX_TP, devices_per_node)]),
        choices("cp", [d for d in divisors(world) if d <= 8]),
        choices("pp", divisors(world)),
    ):
        if world % (tp * cp * pp):
            continue
        rest = world // (tp * cp * pp)
        for dp_replicate in choices("dp_replicate", divisors(rest)):
            if rest % dp_replicate:
                continue
            dp_shard = rest // dp_replicate
            if "dp_shard" in fixed and p.data_parallel_shard_degree not in (-1, dp_shard):
                continue
            dp = dp_replicate * dp_shard
            if global_batch % dp:
                continue
            dims = dict(dp_replicate=dp_replicate, dp_shard=dp_shard, cp=cp, tp=tp, pp=pp)
            for ep, etp in _expert_degrees(dims, num_experts, fixed, own, etp_given):
                dims_ep = dict(dims, ep=ep, etp=etp)
                yield from _batches(job_config, dims_ep, global_batch // dp, fixed, own)


def _expert_degrees(
    dims: dict, num_experts: int, fixed: set[str], own: Layout, etp_given: int | None
) -> list[tuple[int, int]]:
    """The (ep, etp) pairs of one set of degrees: EP dividing the experts and the ranks it
    borrows, ``dp_shard x cp`` with the experts split over TP (etp = tp), ``x tp`` with whole
    experts (etp 1, the config's default). ``etp_given``: the degree the command line fixes (1:
    whole experts; -1: split over whatever TP; N: split, with TP N only)."""
    if not num_experts:
        return [(own.ep if "ep" in fixed else 1, 1)]
    tp = dims["tp"]
    if etp_given is None:
        etps = sorted({1, tp})
    elif etp_given in (1, -1, tp):
        etps = [1 if etp_given == 1 else tp]
    else:
        return []
    out = []
    for etp in etps:
        borrowed = dims["dp_shard"] * dims["cp"] * (tp if etp == 1 else 1)
        for ep in [own.ep] if "ep" in fixed else divisors(borrowed):
            if num_experts % ep == 0 and borrowed % ep == 0 and (ep > 1 or len(etps) == 1):
                out.append((ep, etp))
    return out or [(own.ep, etps[0])]


def _batches(
    job_config: JobConfig, dims: dict, per_rank: int, fixed: set[str], own: Layout
) -> Iterator[Layout]:
    """The activation checkpointing, local batches and pipeline cuts of one set of degrees."""
    # selective checkpointing: per-op, or as the job says it (its mode selective, or the option
    # given): every k-th layer
    ac = job_config.activation_checkpoint
    option = ac.selective_ac_option if ac.mode == "selective" or "ac_option" in fixed else "op"
    modes = [f"selective:{option}" if m == "selective" and option != "op" else m for m in AC_MODES]
    acs = [own.ac] if "ac" in fixed else modes
    batches = [own.local_batch] if "local_batch" in fixed else divisors(per_rank)
    for ac, local in itertools.product(acs, batches):
        if per_rank % local:
            continue
        base = dict(dims, ac=ac, local_batch=local, accum=per_rank // local)
        if dims["pp"] == 1:
            yield Layout(**base)
            continue
        schedules = [_schedule(job_config.parallelism)] if "schedule" in fixed else list(SCHEDULES)
        micro = [own.microbatch] if "microbatch" in fixed else divisors(local)
        for schedule, mb in itertools.product(schedules, micro):
            if local % mb == 0 and local // mb >= dims["pp"]:
                yield Layout(**base, schedule=schedule, microbatch=mb)


def config_layout(job_config: JobConfig, world: int) -> Layout:
    """The layout the config itself says (dp_shard -1: the rest of the world)."""
    p, t = job_config.parallelism, job_config.training
    others = p.data_parallel_replicate_degree * p.tensor_parallel_degree
    others *= p.context_parallel_degree * p.pipeline_parallel_degree
    shard = p.data_parallel_shard_degree
    if shard == -1:
        shard = max(1, world // others)
    return Layout(
        dp_replicate=p.data_parallel_replicate_degree,
        dp_shard=shard,
        cp=p.context_parallel_degree,
        tp=p.tensor_parallel_degree,
        pp=p.pipeline_parallel_degree,
        ep=p.expert_parallel_degree,
        etp=1 if p.expert_tensor_parallel_degree == 1 else p.tensor_parallel_degree,
        ac=_ac_mode(job_config),
        local_batch=t.local_batch_size,
        schedule=_schedule(p) if p.pipeline_parallel_degree > 1 else None,
        microbatch=p.pipeline_parallel_microbatch_size,
    )


def _schedule(p: Any) -> str:
    """The config's schedule by its canonical name (as given when it names none: the job's
    checks say so)."""
    try:
        return canonical_schedule(p.pipeline_parallel_schedule, p.pipeline_parallel_schedule_csv)
    except ConfigError:
        return p.pipeline_parallel_schedule


def _ac_mode(job_config: JobConfig) -> str:
    """``none``, ``full``, ``selective`` (the per-op policy) or ``selective:k`` (every k-th
    layer checkpointed whole)."""
    ac = job_config.activation_checkpoint
    if ac.mode != "selective" or ac.selective_ac_option == "op":
        return ac.mode
    return f"selective:{ac.selective_ac_option}"


def overrides(lay: Layout, global_batch: int) -> dict[str, Any]:
    """The config keys (and values) that run ``lay``."""
    out = {KEYS[name]: getattr(lay, name) for name in ("dp_replicate", "dp_shard", "tp", "cp")}
    out[KEYS["pp"]] = lay.pp
    out[KEYS["ep"]] = lay.ep
    out[KEYS["etp"]] = lay.etp
    mode, _, interval = lay.ac.partition(":")
    out[KEYS["ac"]] = mode
    if mode == "selective":
        out["activation_checkpoint.selective_ac_option"] = interval or "op"
    out[KEYS["local_batch"]] = lay.local_batch
    out["training.global_batch_size"] = global_batch
    if lay.pp > 1:
        out[KEYS["schedule"]] = lay.schedule
        out[KEYS["microbatch"]] = lay.microbatch
    return out


def with_layout(job_config: JobConfig, lay: Layout, global_batch: int) -> JobConfig:
    """A copy of the config running ``lay``."""
    cfg = copy.deepcopy(job_config)
    for key, value in overrides(lay, global_batch).items():
        section, name = key.split(".")
        setattr(getattr(cfg, section), name, value)
    return cfg


def cli_overrides(lay: Layout, global_batch: int) -> list[str]:
    """``--section.key value`` for each key of the layout."""
    out = []
    for key, value in overrides(lay, global_batch).items():
        out += [f"--{key}", str(value)]
    return out
