"""The job's plan: the configuration checked against the world it will run on.

:func:`plan_job` resolves the parallel layout (``ParallelDims``), the model family (its train
spec) and arguments, the pipeline plan and the batch arithmetic, and reports every problem at
once, each with the file or flag that set the key. ``train.py`` (through the builders), the
launcher's preflight (``python -m torchtitan.preflight``) and the memory estimator call it.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import os
import tempfile
from dataclasses import dataclass
from typing import Any

import torch

from torchtitan.config.checks import global_batch, located
from torchtitan.config.parse import import_user_module
from torchtitan.config.schema import JobConfig
from torchtitan.data.mixture import check_data_config
from torchtitan.distributed import utils as dist_utils
from torchtitan.distributed.parallel_dims import DIM_KEYS, ParallelDims
from torchtitan.distributed.pipeline import PipelinePlan, check_pipeline_config
from torchtitan.distributed.replica_groups import check_environment
from torchtitan.errors import ConfigError, ConfigErrors, Problems
from torchtitan.models.spec import ModelSpec, get_model_args, get_model_spec
from torchtitan.quantization.float8 import check_converters
from torchtitan.remote import check_reachable, is_url


@dataclass
class JobPlan:
    """What the checks resolved: the parallel layout, the model family and its arguments."""

    dims: ParallelDims
    spec: ModelSpec
    model_args: Any
    grad_accum_steps: int
    global_batch_size: int
    pipeline: PipelinePlan | None = None  # set when parallelism.pipeline_parallel_degree > 1
    # fault_tolerance.enable: this job is group ``group_index`` of ``groups`` replica groups,
    # which share the global batch (each reads its own part of every step's)
    groups: int = 1
    group_index: int = 0

    def data_shard(self) -> tuple[int, int]:
        """``(rank, world)`` of this rank among every data-parallel reader of every group."""
        return self.group_index * self.dims.dp + self.dims.dp_rank, self.dims.dp * self.groups


def plan_job(job_config: JobConfig, world_size: int, device_type: str | None = None) -> JobPlan:
    """The job's plan for ``world_size`` processes on ``device_type`` (default: this machine's),
    or ConfigError(s) naming every problem found, each with the file or flag that set the key."""
    device_type = device_type or dist_utils.device_type
    problems = Problems()
    with problems.collect():
        import_custom_module(job_config.job.custom_import)
    with problems.collect():
        _check_device_features(job_config, device_type)
    with problems.collect():
        _check_dump_folder(job_config.job.dump_folder)
    with problems.collect():
        _check_object_storage(job_config.checkpoint)
    if job_config.fault_tolerance.enable:
        with problems.collect():
            check_environment(job_config.fault_tolerance, device_type)
    with problems.collect():
        check_data_config(job_config.training)
    with problems.collect():
        _check_dataloader_workers(job_config.training)
    dims = spec = model_args = pipeline = None
    with problems.collect():
        dims = _dims(job_config, world_size)
    with problems.collect():
        spec = get_model_spec(job_config.model.name)
        model_args = resolve_model_args(job_config)
    if dims is not None:
        for layout_check in (_check_validation, _check_eval, _check_sequence_split):
            with problems.collect():
                layout_check(job_config, dims)
    if job_config.fault_tolerance.enable and model_args is not None:
        with problems.collect():
            _check_replica_groups_model(job_config, model_args)
    if dims is not None and model_args is not None:
        with problems.collect():  # what the family refuses first: the same keys, said once
            _check_family_supports_layout(dims, spec, job_config.model.name)
            _check_model_fits_layout(dims, model_args)
            _check_context_chunks(job_config.training.seq_len, dims, model_args)
        if dims.pp > 1:
            with problems.collect():
                pipeline = pipeline_plan(job_config, model_args, dims)
        elif job_config.parallelism.pipeline_parallel_schedule_csv:
            problems.add(
                "parallelism.pipeline_parallel_schedule_csv: a pipeline schedule, but "
                "parallelism.pipeline_parallel_degree is 1; set the degree, or leave it empty"
            )
    global_batch = accum = 0
    if dims is not None:
        with problems.collect():
            global_batch, accum = _global_batch(job_config.training, dims, _groups(job_config))
        if job_config.optimizer.early_step_in_backward:
            with problems.collect():
                _check_early_step(job_config, dims, accum)
    if problems.lines:
        raise located(job_config, ConfigErrors(problems.lines))
    ft = job_config.fault_tolerance
    return JobPlan(
        dims, spec, model_args, accum, global_batch, pipeline, _groups(job_config), ft.replica_id
    )


def _groups(job_config: JobConfig) -> int:
    ft = job_config.fault_tolerance
    return max(1, ft.group_size) if ft.enable else 1


def _dims(job_config: JobConfig, world_size: int) -> ParallelDims:
    p = job_config.parallelism
    if job_config.checkpoint.create_seed_checkpoint:  # the whole model in one process
        if world_size != 1:
            raise ConfigError(
                f"checkpoint.create_seed_checkpoint: runs on one process (NGPU=1), not "
                f"{world_size}; the seed then starts runs of any layout"
            )
        return ParallelDims(1, 1, 1, 1, 1, world_size=1)
    return ParallelDims(
        dp_replicate=p.data_parallel_replicate_degree,
        dp_shard=p.data_parallel_shard_degree,
        cp=p.context_parallel_degree,
        tp=p.tensor_parallel_degree,
        pp=p.pipeline_parallel_degree,
        world_size=world_size,
        ep=p.expert_parallel_degree,
        etp=p.expert_tensor_parallel_degree,
    )


def _global_batch(t: Any, dims: ParallelDims, groups: int = 1) -> tuple[int, int]:
    """(global batch, gradient accumulation steps); with replica groups the global batch is
    every group's together."""
    if t.local_batch_size < 1:
        return 0, 0  # reported by the config's own checks
    return global_batch(t.local_batch_size, t.global_batch_size, dims.dp * groups)


def _check_dataloader_workers(t: Any) -> None:
    """``[training.dataloader]``: each worker reads whole rows of every local batch."""
    w, key = t.dataloader, "training.dataloader"
    if w.num_workers > t.local_batch_size:
        raise ConfigError(
            f"{key}.num_workers: {w.num_workers} workers, but each reads whole rows of every "
            f"batch and training.local_batch_size is {t.local_batch_size}; use at most "
            f"{t.local_batch_size}"
        )
    for name in ("persistent_workers", "pin_memory"):
        if getattr(w, name) and w.num_workers == 0:
            raise ConfigError(
                f"{key}.{name}: applies to worker processes; set {key}.num_workers > 0, or "
                f"leave {name} false"
            )


def _check_early_step(job_config: JobConfig, dims: ParallelDims, accum: int) -> None:
    """``optimizer.early_step_in_backward`` updates each parameter once its gradient is whole:
    what needs the gradients of a step together, or more than one backward per step, cannot."""
    key = "optimizer.early_step_in_backward"
    if dims.pp > 1:
        raise ConfigError(
            f"{key}: a pipeline stage runs backward once per micro-batch, so each would step; "
            "turn it off with parallelism.pipeline_parallel_degree > 1"
        )
    if accum > 1:
        raise ConfigError(
            f"{key}: training.global_batch_size {job_config.training.global_batch_size} takes "
            f"{accum} backward passes per step (accumulation), each would step; use "
            "global_batch_size = local_batch_size x the data-parallel degree (-1)"
        )
    if dims.dp_replicate > 1 and not dims.uses_fully_shard:
        raise ConfigError(
            f"{key}: DDP (parallelism.data_parallel_replicate_degree "
            f"{dims.dp_replicate}) averages gradients after backward has them; use "
            "data_parallel_shard_degree (FSDP reduces each gradient before it steps)"
        )
    if job_config.optimizer.name == "Muon":
        raise ConfigError(
            f"{key}: Muon orthogonalizes whole matrices across ranks at the step; use AdamW or Adam"
        )
    if job_config.resilience.loss_spike_zscore > 0:
        raise ConfigError(
            f"{key}: resilience.loss_spike_zscore skips a step's update after backward, when it "
            "is already applied; set loss_spike_zscore = 0"
        )
    if job_config.checkpoint.enable and job_config.checkpoint.async_mode != "disabled":
        raise ConfigError(
            f"{key}: checkpoint.async_mode {job_config.checkpoint.async_mode} copies the weights "
            "while the next step runs, and that step updates them in backward; use disabled"
        )


def _check_dump_folder(folder: str) -> None:
    """The run writes logs, metrics and checkpoints here: it must be creatable and writable."""
    try:
        os.makedirs(folder, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".write-check-"):
            pass
    except OSError as e:
        raise ConfigError(
            f"job.dump_folder: '{folder}' cannot be created or written ({e.strerror or e}); give "
            "a folder this user can write"
        ) from None


def _check_object_storage(ckpt: Any) -> None:
    """A checkpoint folder (or initial load) in object storage answers, with its bucket, before
    anything is built: the one line names the key and what to set (see torchtitan.remote)."""
    if ckpt.enable and is_url(ckpt.folder):
        check_reachable(ckpt.folder, "checkpoint.folder")
    if ckpt.enable and is_url(ckpt.initial_load_path or ""):
        check_reachable(ckpt.initial_load_path, "checkpoint.initial_load_path")


def import_custom_module(name: str | None) -> None:
    """``job.custom_import``: a user's module (dotted name or .py file) imported for its side
    effects, such as registering a model family with ``register_model_spec``."""
    if name:
        import_user_module(name, "job.custom_import", "what it registers")


def check_vocab(job_config: JobConfig, model_args: Any, n_words: int) -> int:
    """The embedding's vocabulary size: the tokenizer's, or a published flavor's own. A flavor's
    table may be padded beyond its tokenizer (Qwen3: 151,936 rows for 151,669 tokens; the args'
    ``tokenizer_vocab_size``): that tokenizer keeps the published size, so published weights
    load. Any other tokenizer for a published flavor (a dropped tokenizer key picking up the test
    tokenizer, say) is refused unless ``model.vocab_size_from_tokenizer`` says it is meant."""
    published = getattr(model_args, "vocab_size", -1)
    if published <= 0 or n_words == published or job_config.model.vocab_size_from_tokenizer:
        return n_words
    if n_words == getattr(model_args, "tokenizer_vocab_size", None):
        return published
    m = job_config.model
    path, key = m.tokenizer_source()
    raise ConfigError(
        f"{key}: the tokenizer '{path}' has {n_words:,} tokens, but {m.name} {m.flavor} has a "
        f"vocabulary of {published:,}; use the model's own tokenizer, or set "
        "model.vocab_size_from_tokenizer = true to size the embedding from this one"
    )


def resolve_model_args(job_config: JobConfig) -> Any:
    """The flavor's model arguments with the ``model.*`` overrides applied."""
    m = job_config.model
    flavor = get_model_args(m.name, m.flavor)
    changes: dict[str, Any] = {}
    if getattr(flavor, "moe", None) is not None:  # how the run balances and runs its experts
        e = job_config.moe
        changes["moe"] = dataclasses.replace(
            flavor.moe,
            load_balance_coeff=e.load_balance_coeff,
            aux_loss_coeff=e.aux_loss_coeff,
            grouped_mm=e.grouped_mm,
        )
    if m.num_mtp_layers >= 0:
        if not hasattr(flavor, "num_mtp_layers") and m.num_mtp_layers > 0:
            raise ConfigError(
                f"model.num_mtp_layers: {m.num_mtp_layers}, but {m.name} has no multi-token "
                "prediction; use -1 or 0 (deepseek_v3 has it)"
            )
        if hasattr(flavor, "num_mtp_layers"):
            changes["num_mtp_layers"] = m.num_mtp_layers
    return dataclasses.replace(
        flavor,
        norm_type=m.norm_type,
        n_layers=m.n_layers or flavor.n_layers,
        attn_mask_type=m.attn_mask_type,
        **changes,
    )


def _check_replica_groups_model(job_config: JobConfig, args: Any) -> None:
    """A mixture of experts balances its routing with biases moved by the step's expert loads,
    which each replica group counts over its own tokens only: the groups' biases would part."""
    if getattr(args, "moe", None) is not None and job_config.moe.load_balance_coeff > 0:
        raise ConfigError(
            "moe.load_balance_coeff: the routing biases move with each replica group's own "
            "expert loads, and the groups' models would part; set it to 0 with "
            "fault_tolerance.enable (the auxiliary loss, moe.aux_loss_coeff, is averaged)"
        )


def _check_model_fits_layout(dims: ParallelDims, args: Any) -> None:
    moe = getattr(args, "moe", None)
    if dims.ep > 1 and moe is None:
        raise ConfigError(
            f"parallelism.expert_parallel_degree: {dims.ep}, but this model has no experts; "
            "use 1 (or a mixture-of-experts model)"
        )
    if moe is not None and moe.num_experts % dims.ep:
        raise ConfigError(
            f"parallelism.expert_parallel_degree: {dims.ep} does not divide the model's "
            f"{moe.num_experts} experts; use a divisor of it"
        )
    n_mtp = getattr(args, "num_mtp_layers", 0)
    if n_mtp and dims.cp > 1:
        raise ConfigError(
            f"parallelism.context_parallel_degree: {dims.cp}, but multi-token prediction "
            f"(model.num_mtp_layers: {n_mtp}) reads the tokens after each rank's chunk; use 1, "
            "or model.num_mtp_layers = 0"
        )
    if n_mtp and dims.tp > 1:
        raise ConfigError(
            f"parallelism.tensor_parallel_degree: {dims.tp}, but multi-token prediction "
            f"(model.num_mtp_layers: {n_mtp}) has no tensor-parallel plan yet (its depths read "
            "the sequence-sharded embeddings moved along the sequence); use 1, or "
            "model.num_mtp_layers = 0"
        )
    key = "parallelism.tensor_parallel_degree"
    sizes = (("n_heads", args.n_heads), ("n_kv_heads", args.n_kv_heads), ("dim", args.dim))
    sizes += (("feed-forward hidden size", args.ffn_hidden_dim()),)
    # a family's own head counts that TP splits (linear attention's key heads)
    sizes += tuple(getattr(args, "tensor_parallel_sizes", lambda: ())())
    for what, n in sizes:
        if n % dims.tp:
            raise ConfigError(
                f"{key}: {dims.tp} does not divide the model's {what} ({n}); use a divisor of it"
            )


def _check_family_supports_layout(dims: ParallelDims, spec: Any, name: str) -> None:
    for dim, why in spec.not_yet.items():
        if getattr(dims, dim) > 1:
            key = DIM_KEYS[dim]
            raise ConfigError(f"{key}: {getattr(dims, dim)}, but model {name} {why}; use 1")


def _check_validation(job_config: JobConfig, dims: ParallelDims) -> None:
    v = job_config.validation
    if not v.enable:
        return
    check_data_config(v, section="validation")
    _check_eval_shape("validation", v.seq_len, v.local_batch_size, job_config, dims)


def _check_eval(job_config: JobConfig, dims: ParallelDims) -> None:
    e = job_config.eval
    if not e.enable:
        return
    from torchtitan.evaluation.tasks import parse_tasks

    if not e.tasks:
        raise ConfigError(
            "eval.enable: true, but eval.tasks is empty; add [[eval.tasks]] tables with name "
            "and path (docs/evaluation.md)"
        )
    for task in parse_tasks(e.tasks):
        if not os.path.isfile(task.path):
            raise ConfigError(f"eval.tasks: task '{task.name}': no file {task.path}")
    _check_eval_shape("eval", e.seq_len, e.local_batch_size, job_config, dims)


def _check_eval_shape(
    section: str, seq_len: int, batch: int, job_config: JobConfig, dims: ParallelDims
) -> None:
    """An evaluation's batches (0: training's size) fit the model's rotary table, and have the
    training shape where the pipeline or the sequence split fixes it."""
    t = job_config.training
    seq_len, batch = seq_len or t.seq_len, batch or t.local_batch_size
    if seq_len > t.seq_len:
        raise ConfigError(
            f"{section}.seq_len: {seq_len} is longer than training.seq_len ({t.seq_len}), the "
            "model's rotary table; use at most that"
        )
    if dims.tp > 1 and seq_len % dims.tp:
        raise ConfigError(
            f"{section}.seq_len: {seq_len} must be divisible by "
            f"parallelism.tensor_parallel_degree = {dims.tp} (sequence parallel splits it)"
        )
    fixed = [f"{n}={d}" for n, d in (("pp", dims.pp), ("cp", dims.cp)) if d > 1]
    if fixed and (seq_len, batch) != (t.seq_len, t.local_batch_size):
        raise ConfigError(
            f"{section}.seq_len / local_batch_size: with {' '.join(fixed)} {section} batches "
            f"must have the training shape ({t.local_batch_size} x {t.seq_len}); leave both 0"
        )


def _check_context_chunks(seq_len: int, dims: ParallelDims, args: Any) -> None:
    """Linear attention's short convolution reads the ``K - 1`` positions before each of a CP
    rank's chunks, which must hold that many."""
    reach = getattr(args, "context_parallel_reach", lambda: 0)()
    if dims.cp > 1 and seq_len // (2 * dims.cp) < reach:
        raise ConfigError(
            f"parallelism.context_parallel_degree: {dims.cp} cuts training.seq_len {seq_len} "
            f"into chunks of {seq_len // (2 * dims.cp)} positions, shorter than the model's "
            f"convolution reads back ({reach}); use a smaller degree or a longer sequence"
        )


def _check_sequence_split(job_config: JobConfig, dims: ParallelDims) -> None:
    """Context parallel cuts each sequence into 2 x cp chunks; sequence parallel then splits a
    rank's part over the TP ranks."""
    seq_len = job_config.training.seq_len
    if dims.cp > 1 and seq_len % (2 * dims.cp):
        raise ConfigError(
            f"training.seq_len: {seq_len} must be divisible by 2 x "
            f"parallelism.context_parallel_degree = {2 * dims.cp} (each rank holds two chunks)"
        )
    if dims.tp > 1 and (seq_len // dims.cp) % dims.tp:
        raise ConfigError(
            f"training.seq_len: {seq_len} / context_parallel_degree {dims.cp} = "
            f"{seq_len // dims.cp} tokens per rank must be divisible by "
            f"parallelism.tensor_parallel_degree = {dims.tp} (sequence parallel splits them)"
        )


def _check_device_features(job_config: JobConfig, device_type: str) -> None:
    """Features that need CUDA GPUs fail here, on a CPU machine, with the key that asked for them."""
    p = job_config.parallelism
    tp = p.tensor_parallel_degree
    check_converters(job_config.model.converters, job_config.float8, device_type)
    _check_norm_type(job_config.model.norm_type, device_type)
    if job_config.parallelism.enable_async_tensor_parallel:
        key = "parallelism.enable_async_tensor_parallel"
        if device_type != "cuda":
            raise ConfigError(
                f"{key}: async tensor parallel needs CUDA GPUs (symmetric memory); set it false on CPU"
            )
        if tp == 1 or not job_config.compile.compiles("model"):
            raise ConfigError(
                f"{key}: needs parallelism.tensor_parallel_degree > 1 and compiled blocks "
                f"(compile.enable = true, 'model' in compile.components); got tp={tp}, "
                f"compile.enable={job_config.compile.enable}, "
                f"compile.components={job_config.compile.components}"
            )


def _check_norm_type(norm_type: str, device_type: str) -> None:
    """fused_rmsnorm is a Triton kernel: CUDA only. It works with tensor parallel (sequence
    parallel norms run it on each rank's local rows), so the layout is not restricted."""
    if norm_type != "fused_rmsnorm":
        return
    key = "model.norm_type"
    if device_type != "cuda":
        raise ConfigError(
            f"{key}: fused_rmsnorm needs a CUDA GPU (Triton); use rmsnorm or compiled_rmsnorm "
            f"on {device_type}"
        )
    # Only where the kernel will really run: a memory estimate for a CUDA target may be made on a
    # machine without GPU or triton.
    if torch.cuda.is_available() and importlib.util.find_spec("triton") is None:
        raise ConfigError(
            f"{key}: fused_rmsnorm needs the triton package, which is not installed: "
            "pip install triton, or use rmsnorm or compiled_rmsnorm"
        )


def pipeline_plan(job_config: JobConfig, model_args: Any, dims: ParallelDims) -> PipelinePlan:
    """The pipeline plan of the job's sections (a one-line ConfigError naming the key)."""
    m = job_config.model
    return check_pipeline_config(
        job_config.parallelism,
        model_args,
        dims,
        local_batch_size=job_config.training.local_batch_size,
        compile_enabled=job_config.compile.enable,
        ac=job_config.activation_checkpoint,
        model_label=f"{m.name} {m.flavor}",
    )
