"""Pretrain a Llama model: ``python train.py --job.config_file train_configs/debug_model.toml``.

Read top to bottom, this file is the story of a run: configuration, processes and devices, data,
model, parallelism, optimizer, then the training loop. Features live in ``torchtitan/``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import time

import torch
import torch.distributed as dist

from torchtitan import float8, utils
from torchtitan.checkpoint import CheckpointManager, TrainState
from torchtitan.config_manager import JobConfig, help_text, parse_args
from torchtitan.errors import ConfigError, TorchTitanError, TrainingDiverged
from torchtitan.float8 import apply_converters
from torchtitan.log import add_log_file, init_logger, logger
from torchtitan.metrics import MetricsProcessor, build_sinks
from torchtitan.parallelisms import pipeline_llama
from torchtitan.parallelisms.context_parallel import shard_sequence
from torchtitan.parallelisms.init import layout_invariant_init
from torchtitan.parallelisms.parallelize_llama import build_loss_fn, loss_context, param_dtype
from torchtitan.preflight import check, check_vocab
from torchtitan.profiling import profiled_steps
from torchtitan.validate import Validator


def train(job_config: JobConfig) -> None:
    startup = utils.StartupTimer()  # logged after the first step

    # ---- processes, devices, seeds
    device = utils.init_device()
    utils.init_distributed(device, job_config.comm, job_config.job.dump_folder)
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    plan = check(job_config, world_size)
    dims, spec = plan.dims, plan.spec
    add_log_file(os.path.join(job_config.job.dump_folder, "logs", f"rank_{rank}.log"))
    logger.info(f"Starting job: {job_config.job.description}")
    if not os.environ.get("TORCHTITAN_CONFIG_CHECKED"):  # the launcher printed them already
        for line in job_config.warnings:
            logger.warning(line)
    logger.info(
        f"world_size={world_size} {dims.layout()} device={device} backend={utils.dist_backend}"
    )
    if job_config.job.print_config and rank == 0:
        print(job_config.to_toml(), flush=True)
    if job_config.job.save_config_file and rank == 0:
        _save_config(job_config)
    mesh = dims.build_mesh(utils.device_type) if world_size > 1 else None
    dp_mesh = dims.dp_mesh(mesh)
    dp_rank = dp_mesh.get_local_rank() if dp_mesh is not None else 0
    cp_rank = mesh["cp"].get_local_rank() if dims.cp > 1 else 0
    loss_mesh = dims.loss_mesh(mesh)  # the ranks holding different tokens of a step
    seed = utils.resolve_seed(job_config.debug.seed, device)
    utils.set_determinism(seed, job_config.debug.deterministic)
    logger.info(f"Seed {seed}, deterministic={job_config.debug.deterministic}")
    gc_handler = utils.GarbageCollection(job_config.training.gc_freq)
    startup.lap("config and process group")

    # ---- tokenizer and data
    t = job_config.training
    tokenizer_path, tokenizer_key = job_config.model.tokenizer_source()
    tokenizer = spec.build_tokenizer_fn(tokenizer_path, key=tokenizer_key)
    logger.info(f"Tokenizer {tokenizer_path} ({tokenizer_key}): {tokenizer.n_words:,} tokens")
    dataloader = spec.build_dataloader_fn(
        dataset=t.dataset,
        dataset_path=t.dataset_path,
        tokenizer=tokenizer,
        local_batch_size=t.local_batch_size,
        global_batch_size=plan.global_batch_size,
        seq_len=t.seq_len,
        dp_rank=dp_rank,
        dp_world_size=dims.dp,
        text_field=t.dataset_text_field,
        streaming=t.dataset_streaming,
    )

    val_loader = None
    if job_config.validation.enable:
        v = job_config.validation
        val_loader = spec.build_dataloader_fn(
            dataset=v.dataset,
            dataset_path=v.dataset_path,
            tokenizer=tokenizer,
            local_batch_size=v.local_batch_size or t.local_batch_size,
            seq_len=v.seq_len or t.seq_len,
            dp_rank=dp_rank,
            dp_world_size=dims.dp,
            infinite=False,
            split="validation",
        )

    startup.lap("tokenizer and data")

    # ---- model: described once, built on the meta device, cut into this rank's pipeline stages
    #      (a single part without pipelining), parallelized, then materialized
    vocab_size = check_vocab(job_config, plan.model_args, tokenizer.n_words)
    model_args = dataclasses.replace(plan.model_args, vocab_size=vocab_size, max_seq_len=t.seq_len)
    with torch.device("meta"):
        model = spec.cls(model_args)
    nparams, flops_per_token = spec.nparams_and_flops_fn(model, model_args, t.seq_len)
    logger.info(
        f"Model {job_config.model.name} {job_config.model.flavor}{_layers_note(job_config)}: "
        f"{nparams:,} parameters, "
        f"{flops_per_token:,} training FLOPs per token (seq_len {t.seq_len}), vocab {model_args.vocab_size}"
    )
    apply_converters(model, job_config)  # e.g. float8 linears, before any sharding
    if job_config.model.print_after_conversion:
        logger.info(f"Model after model.converters:\n{model}")
    startup.lap("model on meta")
    parts = _split_into_stages(model, plan.pipeline, mesh, spec)  # {stage index: module}
    for stage, part in parts.items():
        parts[stage] = spec.parallelize_fn(part, mesh, dims, job_config, utils.device_type)
        _materialize(parts[stage], device, seed)
    startup.lap("parallelize and materialize")
    model_parts = list(parts.values())
    _log_local_share(model_parts, nparams_total=nparams)
    loss_fn = build_loss_fn(spec.loss_fn, dims, job_config)  # compiled, if compile.components says
    pp_group = mesh["pp"].get_group() if dims.pp > 1 else None
    pipeline = None  # without pipelining, forward and backward are plain calls
    if plan.pipeline is not None:
        pipeline = pipeline_llama.Pipeline(
            plan.pipeline, parts, device, pp_group, loss_fn, plan.grad_accum_steps
        )

    validator = None
    if val_loader is not None:
        validator = Validator(
            job_config,
            dataloader=val_loader,
            dims=dims,
            model=model_parts[0],
            pipeline=pipeline,
            loss_fn=loss_fn,
            loss_mesh=loss_mesh,
            cp_rank=cp_rank,
            device=device,
        )

    # ---- optimizer, schedule, metrics
    optimizer = spec.build_optimizer_fn(model_parts, job_config.optimizer)
    schedule_steps = job_config.lr_scheduler.total_steps or t.steps
    lr_scheduler = spec.build_lr_scheduler_fn(optimizer, job_config.lr_scheduler, schedule_steps)
    metrics = MetricsProcessor(
        flops_per_token=flops_per_token,
        log_freq=job_config.metrics.log_freq,
        sinks=build_sinks(job_config, rank),
        color=not job_config.metrics.disable_color_printing,
        is_rank0=rank == 0,
    )
    autocast = _autocast(job_config, dims)
    logger.info(
        f"Global batch {plan.global_batch_size} sequences = local {t.local_batch_size} x dp {dims.dp} "
        f"x {plan.grad_accum_steps} accumulation steps; training {t.steps} steps"
    )

    # ---- checkpoints: resume from the newest complete one in the folder, if any
    train_state = TrainState()
    checkpointer = CheckpointManager(
        job_config,
        model_parts=model_parts,
        optimizers=optimizer,
        lr_schedulers=lr_scheduler,
        dataloader=dataloader,
        train_state=train_state,
        rank=rank,
        world_size=world_size,
        model_args=model_args,
        tokenizer=tokenizer,
        hf_adapter=spec.state_dict_adapter,
        export_tokenizer=spec.export_tokenizer_fn,
        pp_rank=mesh["pp"].get_local_rank() if dims.pp > 1 else 0,
        pp_degree=dims.pp,
    )
    if job_config.checkpoint.create_seed_checkpoint:  # initial weights for later runs, then stop
        checkpointer.save_seed()
        metrics.close()
        return
    checkpointer.load()
    startup.lap("optimizer, metrics, checkpoint")
    if train_state.step >= t.steps:
        logger.info(f"Already trained to step {train_state.step} of {t.steps}: nothing to do")
        metrics.close()
        return

    # ---- the training loop
    data_iter = iter(dataloader)
    params = [p for m in model_parts for p in m.parameters()]
    tokens_per_step = plan.global_batch_size * t.seq_len
    with profiled_steps(job_config, rank, train_state.step) as profiler:
        for step in range(train_state.step + 1, t.steps + 1):
            gc_handler.run(step)
            optimizer.zero_grad()
            loss_sum = torch.zeros((), device=device)
            for _ in range(plan.grad_accum_steps):
                t0 = time.perf_counter()
                inputs, labels = next(data_iter)
                metrics.data_loading_times.append(time.perf_counter() - t0)
                # tokens per device: TP/PP/CP ranks of one data-parallel replica share a batch
                metrics.ntokens_since_last_log += labels.numel() // dims.non_data_parallel_size
                inputs, labels = inputs.to(device), labels.to(device)
                if dims.cp > 1:  # this rank's chunks of every sequence
                    inputs, labels = (shard_sequence(x, dims.cp, cp_rank) for x in (inputs, labels))
                with loss_context(dims, job_config):
                    loss = _forward_backward(
                        model_parts[0],
                        pipeline,
                        loss_fn,
                        inputs,
                        labels,
                        autocast,
                        plan.grad_accum_steps,
                    )
                loss_sum += utils.full_tensor(loss.detach())  # a vocab-parallel loss is a DTensor
            grad_norm = utils.clip_grad_norm_(params, t.max_norm, pp_group=pp_group)
            _stop_if_diverged(step, loss_sum, grad_norm, checkpointer)
            checkpointer.wait_for_staging()  # a background save's copy of the weights, if one runs
            optimizer.step()
            float8.after_optimizer_step(model_parts, job_config)
            lr = lr_scheduler.get_last_lr()[0]
            lr_scheduler.step()
            train_state.step, train_state.ntokens_seen = (
                step,
                train_state.ntokens_seen + tokens_per_step,
            )
            if metrics.should_log(step) or step == t.steps:  # the last step is always logged
                metrics.log(step, _mean_over(loss_sum, loss_mesh), float(grad_norm), lr)
            if validator is not None and validator.due(step):
                metrics.log_validation(step, *validator.run())
            checkpointer.maybe_save(step)
            profiler.step(step)
            if startup is not None:  # first step of this run (compilation happens here)
                utils.set_train_timeout(job_config.comm)
                startup.lap("first step")
                logger.info(startup.summary())
                startup = None
    checkpointer.close()  # the last background save, if any, is written and marked complete
    metrics.close()
    logger.info("Training finished")


def _save_config(job_config: JobConfig) -> None:
    path = os.path.join(job_config.job.dump_folder, job_config.job.save_config_file)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        f.write(job_config.to_toml())
    logger.info(f"Resolved config written to {path} (job.save_config_file)")


def _layers_note(job_config) -> str:
    n = job_config.model.n_layers
    return f" cut to {n} layers (model.n_layers)" if n else ""


def _split_into_stages(model, pipeline_plan, mesh, spec) -> dict:
    """This rank's pipeline stages by index (the layout is logged), or ``{0: model}``."""
    if pipeline_plan is None:
        return {0: model}
    if spec.pipelining_fn is None:
        raise ConfigError(
            f"parallelism.pipeline_parallel_degree: model '{spec.name}' has no pipelining "
            "function in its train spec; use 1"
        )
    logger.info(pipeline_plan.describe())
    return spec.pipelining_fn(model, pipeline_plan, mesh["pp"].get_local_rank())


def _log_local_share(model_parts: list[torch.nn.Module], nparams_total: int) -> None:
    """How many parameter elements this rank holds (its FSDP / TP shards of its stages)."""
    local = sum(_local_numel(p) for m in model_parts for p in m.parameters())
    logger.info(
        f"Parameters on this rank: {local:,} of {nparams_total:,} ({100 * local / nparams_total:.1f}%)"
    )


def _local_numel(p: torch.Tensor) -> int:
    return p.to_local().numel() if hasattr(p, "to_local") else p.numel()


def _materialize(part: torch.nn.Module, device: torch.device, seed: int) -> None:
    """Allocate a meta-device (parallelized) part and initialize it as in the unsplit model."""
    part.to_empty(device=device)
    with torch.no_grad(), layout_invariant_init(part, seed):
        part.init_weights()
    part.train()


def _forward_backward(
    model, pipeline, loss_fn, inputs, labels, autocast, grad_accum_steps: int
) -> torch.Tensor:
    """Forward and backward of one local batch; its loss divided by the accumulation steps.

    With pipeline parallelism the schedule runs both, micro-batch by micro-batch, and every
    pipeline rank gets the loss (``model``, the first local stage, is then not called directly).
    """
    if pipeline is not None:
        with autocast:
            return pipeline.forward_backward(inputs, labels)
    with autocast:
        loss = loss_fn(model(inputs), labels) / grad_accum_steps
    loss.backward()
    return loss


def _autocast(job_config: JobConfig, dims) -> contextlib.AbstractContextManager:
    """Without FSDP (whose policy casts parameters), mixed precision on GPU comes from autocast."""
    dtype = param_dtype(job_config, utils.device_type)
    if utils.device_type == "cuda" and dtype != torch.float32 and not dims.fsdp_enabled:
        return torch.autocast("cuda", dtype=dtype)
    return contextlib.nullcontext()


def _stop_if_diverged(step: int, loss: torch.Tensor, grad_norm: torch.Tensor, checkpointer) -> None:
    """A non-finite gradient norm stops training before the optimizer step, so nothing from this
    step on is saved. The norm is already reduced over every rank and a non-finite loss on any
    rank makes it non-finite, so every rank decides alike with no collective: one host sync."""
    if torch.isfinite(grad_norm).item():
        return
    checkpointer.close()  # a background save of an earlier, good step is finished and marked
    newest = checkpointer.newest_complete()
    raise TrainingDiverged(
        f"step {step}: not finite: loss {float(loss):.6g} (this rank), gradient norm "
        f"{float(grad_norm):.6g}; training stopped before this step's optimizer step and nothing "
        f"from it on is saved (newest checkpoint: {newest or 'none'}). Lower optimizer.lr or "
        "raise lr_scheduler.warmup_steps, then resume"
    )


def _mean_over(value: torch.Tensor, mesh) -> float:
    if mesh is not None and mesh.size() > 1:
        value = value.clone()
        dist.all_reduce(value, op=dist.ReduceOp.AVG, group=mesh.get_group())
    return float(value)


def _report_user_error(e: TorchTitanError) -> None:
    """One line, no traceback: to the launcher's error file when there is one, else to stderr."""
    rank = int(os.environ.get("RANK", "0"))
    where = f"rank {rank}: " if utils.world_size_from_env() > 1 and e.exit_code != 2 else ""
    error_file = os.environ.get("TORCHTITAN_ERROR_FILE")
    if error_file:
        with open(error_file, "a") as f:
            f.writelines(f"{e.exit_code}\t{where}{line}\n" for line in str(e).splitlines())
    elif rank == 0 or e.exit_code != 2:
        lines = (f"error: {where}{line}" for line in str(e).splitlines())
        print("\n".join(lines), file=sys.stderr, flush=True)


def _another_rank_reported() -> bool:
    error_file = os.environ.get("TORCHTITAN_ERROR_FILE")
    return bool(error_file) and os.path.isfile(error_file) and os.path.getsize(error_file) > 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "-h" in argv or "--help" in argv:
        print(help_text())
        return 0
    init_logger()
    try:
        train(parse_args(argv))
        if dist.is_initialized():
            # Leave together: a rank that tears down its gloo connections while a peer is still
            # finishing can make that peer abort (SIGABRT) after a successful run.
            dist.barrier()
    except TorchTitanError as e:
        _report_user_error(e)
        return e.exit_code
    except Exception:
        if _another_rank_reported():
            return 1  # a peer stopped on a user error; our broken collective is only a consequence
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
