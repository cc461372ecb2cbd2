"""How a run's parts are built, once. ``train.py``, the validator, the benchmarks and the scripts
call these instead of repeating the steps.

:func:`init_runtime` (devices, processes, the job plan, the mesh, seeds) comes first; the others
take the :class:`Runtime` it returns. Everything family-specific comes from the model spec.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from torchtitan.checkpoint import CheckpointManager, TrainState
from torchtitan.checkpoint.hf_exchange import HFExchange, hf_load_source
from torchtitan.checkpoint.mismatch import run_facts
from torchtitan.checkpoint.states import ModelState
from torchtitan.config.schema import JobConfig
from torchtitan.data import tokenizer as tokenizers
from torchtitan.data.hf_tokenizer import write_tokenizer_files
from torchtitan.data.loader import DataSpec, build_hf_dataloader
from torchtitan.distributed import utils as dist_utils
from torchtitan.distributed.outer_sync import OuterSync
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.distributed.parallelize import parallelize_decoder
from torchtitan.distributed.param_init import layout_invariant_init
from torchtitan.distributed.pipeline import Pipeline, split_model
from torchtitan.distributed.replica_groups import (
    LIGHTHOUSE_ENV,
    ReplicaGroups,
    into_place,
    local_state,
)
from torchtitan.distributed.tensor_parallel import decoder_block_plan
from torchtitan.lora.apply import apply_lora
from torchtitan.lora.export import LoRAExport
from torchtitan.models.common.decoder import get_nparams_and_flops
from torchtitan.models.common.moe import inactive_params
from torchtitan.models.spec import ModelSpec
from torchtitan.observability.log import logger
from torchtitan.observability.metrics import MetricsProcessor
from torchtitan.observability.sinks import build_sinks
from torchtitan.optim import optimizers
from torchtitan.optim.lr_scheduling import build_lr_scheduler
from torchtitan.optim.param_groups import check_and_log
from torchtitan.quantization.float8 import apply_converters, tensorwise_tp
from torchtitan.remote import join
from torchtitan.train import runtime
from torchtitan.train.downstream import DownstreamEvaluator
from torchtitan.train.loss import build_loss_fn
from torchtitan.train.plan import JobPlan, check_vocab, plan_job
from torchtitan.train.step import StepRunner
from torchtitan.train.validation import Validator


@dataclass
class Runtime:
    """This process's place in the run: its device and rank, and the checked job plan (the
    parallel layout, owning its mesh, the model family and the batch arithmetic)."""

    device: torch.device
    rank: int
    world_size: int
    plan: JobPlan
    seed: int

    @property
    def dims(self) -> ParallelDims:
        return self.plan.dims

    @property
    def spec(self) -> ModelSpec:
        return self.plan.spec


def init_runtime(job_config: JobConfig) -> Runtime:
    """The device, the process group (under torchrun), the job plan, the device mesh and the
    seeds. Raises ConfigError(s) for a job that cannot run on this world."""
    device = dist_utils.init_device()
    dist_utils.init_distributed(device, job_config.comm, job_config.job.dump_folder)
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    plan = plan_job(job_config, world_size)
    plan.dims.build_mesh(dist_utils.device_type)
    seed = runtime.resolve_seed(job_config.debug.seed, device)
    runtime.set_determinism(seed, job_config.debug.deterministic)
    return Runtime(device, rank, world_size, plan, seed)


def build_tokenizer(job_config: JobConfig) -> Any:
    path, key = job_config.model.tokenizer_source()
    tokenizer = tokenizers.build_tokenizer(path, key=key)
    logger.info(f"Tokenizer {path} ({key}): {tokenizer.n_words:,} tokens")
    return tokenizer


def build_dataloader(job_config: JobConfig, rt: Runtime, tokenizer: Any) -> Any:
    """The training data of this data-parallel rank (infinite, checkpointable); read by worker
    processes with ``training.dataloader.num_workers`` > 0."""
    # with replica groups every group reads its own part of the global batch
    loader = dataloader_for(job_config, tokenizer, *rt.plan.data_shard(), rt.plan.global_batch_size)
    w = job_config.training.dataloader
    if w.num_workers == 0:
        return loader
    from torchtitan.data.workers import WorkerLoader

    return WorkerLoader(
        loader,
        w.num_workers,
        prefetch_factor=w.prefetch_factor,
        pin_memory=w.pin_memory,
        persistent_workers=w.persistent_workers,
    )


def dataloader_for(
    job_config: JobConfig,
    tokenizer: Any,
    dp_rank: int,
    dp_world_size: int,
    global_batch_size: int,
) -> Any:
    """The training loader of data-parallel rank ``dp_rank`` of ``dp_world_size`` (the
    benchmarks build any rank's without processes)."""
    t = job_config.training
    data = DataSpec(
        dataset=t.dataset,
        dataset_path=t.dataset_path,
        datasets=t.datasets,
        text_field=t.dataset_text_field,
        streaming=t.dataset_streaming,
        seed=t.data_seed,
        shuffle=t.shuffle,
        shuffle_buffer=t.shuffle_buffer,
        mask_document_starts=t.mask_document_starts,
        chat_template=t.chat_template,
    )
    return build_hf_dataloader(
        data,
        tokenizer,
        local_batch_size=t.local_batch_size,
        seq_len=t.seq_len,
        dp_rank=dp_rank,
        dp_world_size=dp_world_size,
        global_batch_size=global_batch_size,
    )


def build_validation_loader(job_config: JobConfig, rt: Runtime, tokenizer: Any) -> Any:
    """The held-out data of this data-parallel rank (one pass per evaluation), or None."""
    v, t = job_config.validation, job_config.training
    if not v.enable:
        return None
    data = DataSpec(
        dataset=v.dataset,
        dataset_path=v.dataset_path,
        datasets=v.datasets,
        split="validation",
        section="validation",
        mask_document_starts=t.mask_document_starts,
        chat_template=t.chat_template,
    )
    return build_hf_dataloader(
        data,
        tokenizer,
        local_batch_size=v.local_batch_size or t.local_batch_size,
        seq_len=v.seq_len or t.seq_len,
        dp_rank=rt.dims.dp_rank,
        dp_world_size=rt.dims.dp,
        infinite=False,
    )


@dataclass
class BuiltModel:
    """This rank's share of the model: its pipeline stages by index (``{0: model}`` without
    pipelining), parallelized and (unless asked not to) materialized."""

    stages: dict[int, nn.Module]
    args: Any
    nparams: int  # of the whole model
    flops_per_token: int

    @property
    def parts(self) -> list[nn.Module]:
        return list(self.stages.values())


def build_model(
    job_config: JobConfig,
    rt: Runtime,
    n_words: int,
    *,
    materialize: bool = True,
    on_meta: Callable[[str], None] | None = None,
) -> BuiltModel:
    """Described once, built on the meta device, converted (float8), cut into this rank's
    pipeline stages, each parallelized by the family's plan, then materialized with
    layout-invariant init (left on the meta device with ``materialize=False``).
    ``on_meta("model on meta")`` is called once the meta model exists (start-up timing)."""
    t, spec = job_config.training, rt.spec
    vocab_size = check_vocab(job_config, rt.plan.model_args, n_words)
    args = dataclasses.replace(rt.plan.model_args, vocab_size=vocab_size, max_seq_len=t.seq_len)
    with torch.device("meta"):
        model = spec.cls(args)
    nparams, flops_per_token = (spec.nparams_and_flops or get_nparams_and_flops)(
        model, args, t.seq_len
    )
    m = job_config.model
    cut = f" cut to {m.n_layers} layers (model.n_layers)" if m.n_layers else ""
    inactive = inactive_params(model)  # mixture of experts: a token uses top_k of them
    active = f" ({nparams - inactive:,} active per token)" if inactive else ""
    logger.info(
        f"Model {m.name} {m.flavor}{cut}: {nparams:,} parameters{active}, {flops_per_token:,} training "
        f"FLOPs per token (seq_len {t.seq_len}), vocab {args.vocab_size}"
    )
    # e.g. float8 linears, before any sharding
    apply_converters(model, job_config.model.converters, job_config.float8)
    added = _apply_lora(model, job_config)
    if m.print_after_conversion:
        logger.info(f"Model after model.converters:\n{model}")
    if on_meta is not None:
        on_meta("model on meta")
    stages = _split_into_stages(model, rt)
    for index, part in stages.items():
        stages[index] = parallelize_decoder(
            part,
            rt.dims,
            block_plan=spec.block_plan or decoder_block_plan,
            device_type=dist_utils.device_type,
            parallelism=job_config.parallelism,
            ac=job_config.activation_checkpoint,
            compile=job_config.compile,
            training=job_config.training,
            float8_tensorwise=tensorwise_tp(job_config.model.converters, job_config.float8),
        )
        if materialize:
            _materialize(stages[index], rt.device, rt.seed)
    built = BuiltModel(stages, args, nparams, flops_per_token)
    local = sum(_local_numel(p) for part in built.parts for p in part.parameters())
    whole = nparams + added
    logger.info(f"Parameters on this rank: {local:,} of {whole:,} ({100 * local / whole:.1f}%)")
    return built


def _apply_lora(model: nn.Module, job_config: JobConfig) -> int:
    """``[lora]``: adapters on the chosen linear layers, the rest frozen; the parameters added."""
    lo = job_config.lora
    if not lo.enable:
        return 0
    adapted = apply_lora(
        model,
        rank=lo.rank,
        alpha=lo.alpha,
        dropout=lo.dropout,
        target_modules=list(lo.target_modules),
    )
    logger.info(adapted.describe(lo.rank, lo.alpha))
    return adapted.trainable


def _split_into_stages(model: nn.Module, rt: Runtime) -> dict[int, nn.Module]:
    """This rank's pipeline stages by index (the layout is logged), or ``{0: model}``."""
    pipeline_plan, spec = rt.plan.pipeline, rt.spec
    if pipeline_plan is None:
        return {0: model}
    logger.info(pipeline_plan.describe())
    return (spec.pipeline_split or split_model)(model, pipeline_plan, rt.dims.pp_rank)


def _materialize(part: nn.Module, device: torch.device, seed: int) -> None:
    """Allocate a meta-device (parallelized) part and initialize it as in the unsplit model."""
    part.to_empty(device=device)
    with torch.no_grad(), layout_invariant_init(part, seed):
        part.init_weights()
        for module in part.modules():  # parameters a conversion added (LoRA's adapters)
            if hasattr(module, "init_added_parameters"):
                module.init_added_parameters()
    part.train()


def _local_numel(p: torch.Tensor) -> int:
    return p.to_local().numel() if hasattr(p, "to_local") else p.numel()


def build_step_runner(job_config: JobConfig, rt: Runtime, model: BuiltModel) -> StepRunner:
    """The loss (compiled if ``compile.components`` says so) and, under pipeline parallelism,
    the schedule over this rank's stages, wrapped in the one step runner."""
    loss_fn = build_loss_fn(rt.dims, job_config, model.parts)
    pipeline = None
    if rt.plan.pipeline is not None:
        pipeline = Pipeline(
            rt.plan.pipeline,
            model.stages,
            rt.device,
            rt.dims.pp_group,
            loss_fn,
        )
    return StepRunner(
        job_config,
        rt.dims,
        model=model.parts[0],
        pipeline=pipeline,
        loss_fn=loss_fn,
        device=rt.device,
    )


def build_evaluators(
    job_config: JobConfig, runner: StepRunner, val_loader: Any, tokenizer: Any
) -> tuple[Validator | None, DownstreamEvaluator | None]:
    """The validation pass (when ``validation.enable`` built a loader) and the downstream tasks
    (``eval.enable``: the task files are read and tokenized now, so a malformed one stops the
    run before training)."""
    validator = Validator(job_config, dataloader=val_loader, runner=runner) if val_loader else None
    evaluator = (
        DownstreamEvaluator(job_config, runner=runner, tokenizer=tokenizer)
        if job_config.eval.enable
        else None
    )
    return validator, evaluator


def build_optimizer(job_config: JobConfig, rt: Runtime, model: BuiltModel) -> tuple[Any, Any]:
    """The optimizer over this rank's parts and its learning-rate schedule."""
    optimizer = optimizers.build_optimizer(model.parts, job_config.optimizer)
    # parameter groups: every rule used on some rank; logged on rank 0
    rules = (optimizer.plans, optimizer.rules, optimizer.rule_hits)
    check_and_log(*rules, rt.dims.pp_group, rt.rank == 0)
    steps = job_config.lr_scheduler.total_steps or job_config.training.steps
    lr_scheduler = build_lr_scheduler(optimizer.optimizers, job_config.lr_scheduler, steps)
    return optimizer, lr_scheduler


def lora_export(job_config: JobConfig) -> LoRAExport | None:
    """A LoRA run's export settings (None without LoRA): a Hugging Face base it adapts is
    named in the peft adapter folder (a DCP base is not: peft could not load it)."""
    lo, ck = job_config.lora, job_config.checkpoint
    if not lo.enable:
        return None
    base = hf_load_source(ck, job_config.model) if ck.initial_load_in_hf else None
    return LoRAExport(
        rank=lo.rank,
        alpha=lo.alpha,
        dropout=lo.dropout,
        merge=lo.merge_on_export,
        base_model=base[0] if base else None,
    )


def build_checkpointer(
    job_config: JobConfig,
    rt: Runtime,
    model: BuiltModel,
    *,
    optimizer: Any,
    lr_scheduler: Any,
    dataloader: Any,
    train_state: TrainState,
    tokenizer: Any,
    replicas: ReplicaGroups | None = None,
) -> CheckpointManager:
    """The checkpoint manager over everything a resume needs, with the family's Hugging Face
    adapter from its model spec. A replica group (fault_tolerance) keeps its own checkpoints in
    ``replica-N`` of the folder (its data position is its own), with DiLoCo's state."""
    cfg = job_config.checkpoint
    if job_config.fault_tolerance.enable:
        cfg = dataclasses.replace(
            cfg, folder=join(cfg.folder, f"replica-{job_config.fault_tolerance.replica_id}")
        )
    return CheckpointManager(
        cfg,
        dump_folder=job_config.job.dump_folder,
        total_steps=job_config.training.steps,
        model_parts=model.parts,
        optimizers=optimizer,
        lr_schedulers=lr_scheduler,
        dataloader=dataloader,
        train_state=train_state,
        rank=rt.rank,
        world_size=rt.world_size,
        model_args=model.args,
        hf=HFExchange(
            adapter=rt.spec.state_dict_adapter,
            tokenizer=tokenizer,
            export_tokenizer=write_tokenizer_files,
            pp_rank=rt.dims.pp_rank,
            pp_degree=rt.dims.pp,
            load_source=hf_load_source(job_config.checkpoint, job_config.model),
            adapters=lora_export(job_config),
        ),
        trainable_only=job_config.lora.enable,
        extra_states=(
            {"diloco": replicas.outer}
            if replicas is not None and replicas.outer and replicas.outer.method == "diloco"
            else None
        ),
        run_facts=run_facts(
            global_batch_size=rt.plan.global_batch_size,
            local_batch_size=job_config.training.local_batch_size,
            dp=rt.dims.dp,
            model_name=job_config.model.name,
            flavor=job_config.model.flavor,
            vocab_size=model.args.vocab_size,
            parameters=model.nparams,
            optimizer=job_config.optimizer.name,
        ),
    )


def build_metrics(
    job_config: JobConfig, rt: Runtime, model: BuiltModel, dataloader: Any, resumed_step: int
) -> MetricsProcessor:
    """Console lines with the share done and the ETA, and this rank's sinks (TensorBoard: a run
    resumed from ``resumed_step`` continues its run folder, one curve across resumes; W&B)."""
    m = job_config.metrics
    sinks = build_sinks(
        m,
        job_config.job.dump_folder,
        rt.rank,
        resumed_step=resumed_step,
        run_config=job_config.to_dict(),
    )
    return MetricsProcessor(
        flops_per_token=model.flops_per_token,
        log_freq=m.log_freq,
        sinks=sinks,
        color=not m.disable_color_printing,
        is_rank0=rt.rank == 0,
        data_tokens=getattr(dataloader, "tokens_per_source", None),  # a mixture's shares
        total_steps=job_config.training.steps,
    )


def build_replica_groups(
    job_config: JobConfig,
    rt: Runtime,
    model: BuiltModel,
    optimizer: Any,
    lr_scheduler: Any,
    train_state: TrainState,
) -> ReplicaGroups | None:
    """``fault_tolerance.enable``: torchft's manager of this replica group, with what a group
    that heals takes from a live one (the model, optimizer, schedule and step counters, as this
    rank's local tensors; with DiLoCo its synced weights and outer momentum too); None
    otherwise. The data position is not sent: each group reads its own part of the batch."""
    ft = job_config.fault_tolerance
    if not ft.enable or job_config.checkpoint.create_seed_checkpoint:
        return None
    groups = ReplicaGroups(
        ft,
        rank=rt.rank,
        world_size=rt.world_size,
        # seeded: every group initializes alike. Semi-synchronous groups meet first after
        # their inner steps, where torchft's step-0 sync would stitch each rank's shard from
        # another group: their first sync compares the synced weights instead
        init_sync=job_config.debug.seed is None and ft.semi_sync_method is None,
    )
    weights = ModelState(model.parts)
    for name, obj in (
        ("model", weights),
        ("optimizer", optimizer),
        ("lr_scheduler", lr_scheduler),
        ("train_state", train_state),
    ):
        groups.register(
            name,
            lambda obj=obj: local_state(obj.state_dict()),
            lambda received, obj=obj: obj.load_state_dict(into_place(obj.state_dict(), received)),
        )
    how = "every step"
    if ft.semi_sync_method is not None:
        groups.outer = OuterSync(groups, model.parts, ft, job_config.training.steps)
        groups.register("outer_sync", groups.outer.heal_state, groups.outer.heal_load)
        how = f"{ft.semi_sync_method}, meeting every {ft.sync_steps} steps"
    logger.info(
        f"Replica group {ft.replica_id} of {ft.group_size} (torchft, lighthouse "
        f"{os.environ.get(LIGHTHOUSE_ENV)}; {how}): its share of the global batch is "
        f"{rt.plan.global_batch_size // rt.plan.groups} of {rt.plan.global_batch_size} sequences"
    )
    return groups
