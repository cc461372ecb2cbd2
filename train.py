"""Pretrain a language model: ``python train.py --job.config_file train_configs/debug_model.toml``.

Read top to bottom, this file is the story of a run: configuration, processes and devices, data,
model, parallelism, optimizer, checkpoint, then the training loop. How each part is built lives in
``torchtitan/train/builders.py``; how a batch goes through the model, in ``torchtitan/train/step.py``; the
steps themselves, in ``torchtitan/train/loop.py``.
"""

from __future__ import annotations

import gc
import os
import sys

import torch.distributed as dist

from torchtitan.checkpoint import TrainState
from torchtitan.config.help import help_text, save_config
from torchtitan.config.parse import parse_args
from torchtitan.config.schema import JobConfig
from torchtitan.distributed import utils as dist_utils
from torchtitan.errors import TorchTitanError, another_rank_reported, report_user_error
from torchtitan.observability.log import add_log_file, init_logger, logger
from torchtitan.resilience.preemption import Interrupted, Preempted, Preemption
from torchtitan.resilience.watchdog import HangWatchdog
from torchtitan.train import builders, runtime
from torchtitan.train.loop import Loop


def train(job_config: JobConfig) -> None:
    startup = runtime.StartupTimer()  # logged after the first step

    # ---- processes, devices, the checked plan of the job, seeds
    rt = builders.init_runtime(job_config)
    _log_start(job_config, rt)
    # a stop signal from here on is acted on after a step: saved there, exit code 160
    preemption = Preemption(job_config.resilience.preemption_signals)
    startup.lap("config and process group")

    # ---- tokenizer and data: each data-parallel rank reads its own share of every step
    tokenizer = builders.build_tokenizer(job_config)
    dataloader = builders.build_dataloader(job_config, rt, tokenizer)
    val_loader = builders.build_validation_loader(job_config, rt, tokenizer)
    startup.lap("tokenizer and data")

    # ---- model: described once, built on the meta device, cut into this rank's pipeline
    #      stages, parallelized by the family's plan, then materialized
    model = builders.build_model(job_config, rt, tokenizer.n_words, on_meta=startup.lap)
    runner = builders.build_step_runner(job_config, rt, model)
    # validation, and downstream tasks (eval.tasks) read now: a malformed file stops the run here
    validator, evaluator = builders.build_evaluators(job_config, runner, val_loader, tokenizer)
    startup.lap("parallelize and materialize")

    # ---- optimizer and schedule
    optimizer, lr_scheduler = builders.build_optimizer(job_config, rt, model)
    train_state = TrainState()

    # ---- replica groups (fault_tolerance): in step, or meeting every sync_steps (DiLoCo)
    replicas = builders.build_replica_groups(
        job_config, rt, model, optimizer, lr_scheduler, train_state
    )

    # ---- checkpoints: resume from the newest complete one in the folder, if any
    checkpointer = builders.build_checkpointer(
        job_config,
        rt,
        model,
        optimizer=optimizer,
        lr_scheduler=lr_scheduler,
        dataloader=dataloader,
        train_state=train_state,
        tokenizer=tokenizer,
        replicas=replicas,
    )
    if job_config.checkpoint.create_seed_checkpoint:  # initial weights for later runs, then stop
        checkpointer.save_seed()
        return
    checkpointer.load()

    # ---- metrics: console lines with the share done and the ETA, TensorBoard (a resumed run
    #      continues its run folder, one curve across resumes)
    metrics = builders.build_metrics(job_config, rt, model, dataloader, train_state.step)
    startup.lap("optimizer, metrics, checkpoint")

    # ---- the training loop, then one summary of the run
    loop = Loop(
        job_config=job_config,
        rt=rt,
        parts=model.parts,
        runner=runner,
        optimizer=optimizer,
        lr_scheduler=lr_scheduler,
        metrics=metrics,
        checkpointer=checkpointer,
        validator=validator,
        evaluator=evaluator,
        train_state=train_state,
        preemption=preemption,
        replicas=replicas,
    )
    try:
        loop.run(iter(dataloader), startup)
    except (Interrupted, Preempted):  # a clean stop, its step saved: what the run did
        loop.print_summary()
        raise
    checkpointer.close()  # the last background save, if any, is written and marked complete
    metrics.close()
    logger.info("Training finished")
    loop.print_summary()


def _log_start(job_config: JobConfig, rt: builders.Runtime) -> None:
    add_log_file(os.path.join(job_config.job.dump_folder, "logs", f"rank_{rt.rank}.log"))
    logger.info(f"Starting job: {job_config.job.description}")
    if not os.environ.get("TORCHTITAN_CONFIG_CHECKED"):  # the launcher printed them already
        for line in job_config.warnings:
            logger.warning(line)
    logger.info(
        f"world_size={rt.world_size} {rt.dims.layout()} device={rt.device} "
        f"backend={dist_utils.dist_backend}"
    )
    if job_config.job.print_config and rt.rank == 0:
        print(job_config.to_toml(), flush=True)
    if job_config.job.save_config_file and rt.rank == 0:
        path = save_config(job_config)
        logger.info(f"Resolved config written to {path} (job.save_config_file)")
    logger.info(f"Seed {rt.seed}, deterministic={job_config.debug.deterministic}")
    t = job_config.training
    logger.info(
        f"Global batch {rt.plan.global_batch_size} sequences = local {t.local_batch_size} x dp "
        f"{rt.dims.dp} x {rt.plan.grad_accum_steps} accumulation steps"
        + (f" x {rt.plan.groups} replica groups" if rt.plan.groups > 1 else "")
        + f"; training {t.steps} steps"
    )


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "-h" in argv or "--help" in argv:
        print_help()
        return 0
    init_logger()
    try:
        train(parse_args(argv))
        # The model, its DDP reducer and their pending communication work sit in reference
        # cycles: free them now, while the interpreter is whole. Left to the collector at exit,
        # after the process group is gone, they made a rank abort (SIGABRT) after a good run.
        gc.collect()
        if dist.is_initialized():
            # Leave together: a rank that tears down its gloo connections while a peer is still
            # finishing can make that peer abort (SIGABRT) after a successful run.
            dist.barrier()
    except KeyboardInterrupt:  # Ctrl-C before the listener is up (start-up) or after the loop
        report_user_error(Interrupted("stopped by Ctrl-C before or after training: nothing saved"))
        return Interrupted.exit_code
    except TorchTitanError as e:
        report_user_error(e)
        return e.exit_code
    except Exception as e:
        if another_rank_reported():
            return 1  # a peer stopped on a user error; our broken collective is only a consequence
        if (timeout := dist_utils.collective_timeout(e, stacks=HangWatchdog.written)) is not None:
            report_user_error(timeout)  # every waiting rank: one line each
            return timeout.exit_code
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


def print_help() -> None:
    """Every key with its help; a reader that stops early (``| head``) is not an error."""
    try:
        print(help_text(), flush=True)
    except BrokenPipeError:
        # Python would report the pipe again when it flushes stdout at exit: point it elsewhere
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


if __name__ == "__main__":
    sys.exit(main())
