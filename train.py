"""Pretrain a language model: ``python train.py --job.config_file train_configs/debug_model.toml``.

Read top to bottom, this file is the story of a run: configuration, processes and devices, data,
model, parallelism, optimizer, checkpoint, then the training loop. How each part is built lives in
``torchtitan/train/builders.py``; how a batch goes through the model, in ``torchtitan/train/step.py``.
"""

from __future__ import annotations

import gc
import os
import sys
import time
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch
import torch.distributed as dist

from torchtitan.checkpoint import CheckpointManager, TrainState
from torchtitan.config.help import help_text, save_config
from torchtitan.config.parse import parse_args
from torchtitan.config.schema import JobConfig
from torchtitan.distributed import utils as dist_utils
from torchtitan.distributed.expert_load import ExpertLoad
from torchtitan.errors import TorchTitanError, another_rank_reported, report_user_error
from torchtitan.observability.log import add_log_file, init_logger, logger
from torchtitan.observability.metrics import MetricsProcessor, build_sinks, mean_over
from torchtitan.observability.profiling import profiled_steps
from torchtitan.observability.run_summary import Summary, summary_lines
from torchtitan.quantization import float8
from torchtitan.resilience.guards import LossSpikeGuard, stop_if_diverged
from torchtitan.resilience.preemption import Interrupted, Preempted, Preemption
from torchtitan.resilience.stragglers import StragglerReport
from torchtitan.resilience.watchdog import HangWatchdog
from torchtitan.train import builders, runtime
from torchtitan.train.step import StepRunner
from torchtitan.train.validation import Validator


def train(job_config: JobConfig) -> None:
    startup = runtime.StartupTimer()  # logged after the first step

    # ---- processes, devices, the checked plan of the job, seeds
    rt = builders.init_runtime(job_config)
    _log_start(job_config, rt)
    # a stop signal from here on is acted on after a step: saved there, exit code 160
    preemption = Preemption(job_config.resilience.preemption_signals)
    startup.lap("config and process group")

    # ---- tokenizer and data: each data-parallel rank reads its own share of every step
    tokenizer = builders.build_tokenizer(job_config, rt.spec)
    dataloader = builders.build_dataloader(job_config, rt, tokenizer)
    val_loader = builders.build_validation_loader(job_config, rt, tokenizer)
    startup.lap("tokenizer and data")

    # ---- model: described once, built on the meta device, cut into this rank's pipeline
    #      stages, parallelized by the family's plan, then materialized
    model = builders.build_model(job_config, rt, tokenizer.n_words, on_meta=startup.lap)
    runner = builders.build_step_runner(job_config, rt, model)
    validator = Validator(job_config, dataloader=val_loader, runner=runner) if val_loader else None
    startup.lap("parallelize and materialize")

    # ---- optimizer and schedule
    optimizer, lr_scheduler = builders.build_optimizer(job_config, rt, model)

    # ---- checkpoints: resume from the newest complete one in the folder, if any
    train_state = TrainState()
    checkpointer = builders.build_checkpointer(
        job_config, rt, model, optimizer=optimizer, lr_scheduler=lr_scheduler,
        dataloader=dataloader, train_state=train_state, tokenizer=tokenizer,
    )  # fmt: skip
    if job_config.checkpoint.create_seed_checkpoint:  # initial weights for later runs, then stop
        checkpointer.save_seed()
        return
    checkpointer.load()

    # ---- metrics: console lines with the share done and the ETA, TensorBoard (a resumed run
    #      continues its run folder, one curve across resumes)
    metrics = MetricsProcessor(
        flops_per_token=model.flops_per_token,
        log_freq=job_config.metrics.log_freq,
        sinks=build_sinks(job_config, rt.rank, resumed_step=train_state.step),
        color=not job_config.metrics.disable_color_printing,
        is_rank0=rt.rank == 0,
        data_tokens=getattr(dataloader, "tokens_per_source", None),  # a mixture's shares
        total_steps=job_config.training.steps,
    )
    startup.lap("optimizer, metrics, checkpoint")

    # ---- the training loop, then one summary of the run
    loop = Loop(job_config, rt, model.parts, runner, optimizer, lr_scheduler, metrics,
                checkpointer, validator, train_state, preemption)  # fmt: skip
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
        f"{rt.dims.dp} x {rt.plan.grad_accum_steps} accumulation steps; training {t.steps} steps"
    )


@dataclass
class Loop:
    """The training steps: batch -> step runner -> clip -> guards -> optimizer -> metrics ->
    validation -> checkpoint, from the step after the one resumed."""

    job_config: JobConfig
    rt: builders.Runtime
    parts: list[torch.nn.Module]
    runner: StepRunner
    optimizer: Any
    lr_scheduler: Any
    metrics: MetricsProcessor
    checkpointer: CheckpointManager
    validator: Validator | None
    train_state: TrainState
    preemption: Preemption
    _mean_loss: tuple[int, float] = (0, 0.0)  # (step, its loss averaged over the ranks)
    # this run's first step, the tokens trained before it, and when the loop started and ended
    _began: tuple[int, int, float, float] = (0, 0, 0.0, 0.0)

    @property
    def trained(self) -> bool:
        """Whether this run trained a step."""
        return 0 < self._began[0] <= self.train_state.step

    def print_summary(self) -> None:
        """Rank 0 prints the summary block of a run that trained a step."""
        if self.rt.rank == 0 and self.trained:
            for line in summary_lines(self.summary()):
                logger.info(line)

    def summary(self) -> Summary:
        """What this run did, and where its outputs are."""
        first, tokens_before, t0, t1 = self._began
        tps, mfu = self.metrics.throughput()
        return Summary(
            first_step=first,
            last_step=self.train_state.step,
            tokens_run=self.train_state.ntokens_seen - tokens_before,
            tokens_all=self.train_state.ntokens_seen,
            wall_s=runtime.process_age(),
            train_s=t1 - t0,
            loss=self.metrics.last_loss,
            validation=self.metrics.last_validation,
            tokens_per_s=tps,
            mfu_pct=mfu,
            checkpoint=self.checkpointer.newest_complete(),
            hf_export=self.checkpointer.last_hf_export,
            tensorboard=self.metrics.tensorboard_folder,
        )

    @cached_property
    def expert_load(self) -> ExpertLoad:
        """Mixture-of-experts load balancing and its metrics (empty for a dense model)."""
        moe = self.job_config.moe
        return ExpertLoad(self.parts, self.rt.plan.model_args.n_layers, tp=self.rt.dims.tp,
                          coeff=moe.load_balance_coeff, aux_coeff=moe.aux_loss_coeff,
                          device=self.rt.device)  # fmt: skip

    def hang_watchdog(self) -> HangWatchdog:
        r = self.job_config.resilience
        comm = self.job_config.comm
        return HangWatchdog(
            self.job_config.job.dump_folder,
            self.rt.rank,
            factor=r.hang_watchdog_factor,
            floor_s=r.hang_watchdog_floor_seconds,
            timeouts_s=(comm.init_timeout_seconds, comm.train_timeout_seconds),
        )

    @cached_property
    def stragglers(self) -> StragglerReport:
        """The slowest rank every log step (docs/reliability.md); off with one rank."""
        return StragglerReport(self.job_config.resilience.straggler_threshold, rank=self.rt.rank,
                               world_size=self.rt.world_size, device=self.rt.device)  # fmt: skip

    @cached_property
    def spike_guard(self) -> LossSpikeGuard:
        r = self.job_config.resilience
        return LossSpikeGuard(r.loss_spike_zscore, r.loss_spike_window, r.loss_spike_warmup_steps,
                              r.loss_spike_max_consecutive)  # fmt: skip

    @cached_property
    def params(self) -> list[torch.nn.Parameter]:
        """This rank's parameters, listed once for gradient clipping."""
        return [p for m in self.parts for p in m.parameters()]

    def run(self, data_iter: Any, startup: runtime.StartupTimer | None) -> None:
        t, first = self.job_config.training, self.train_state.step + 1
        if first > t.steps:
            logger.info(f"Already trained to step {first - 1} of {t.steps}: nothing to do")
            return
        self._began = (first, self.train_state.ntokens_seen, time.perf_counter(), 0.0)
        self.metrics.begin()
        try:
            self._run_steps(data_iter, startup, first)
        finally:
            self._began = (*self._began[:3], time.perf_counter())

    def _run_steps(self, data_iter: Any, startup: runtime.StartupTimer | None, first: int) -> None:
        t = self.job_config.training
        gc_handler = runtime.GarbageCollection(t.gc_freq)
        with (
            self.preemption,
            self.hang_watchdog() as watchdog,
            profiled_steps(self.job_config, self.rt.rank, first - 1) as profiler,
        ):
            for step in range(first, t.steps + 1):
                gc_handler.run(step)
                watchdog.begin(step)
                self.stragglers.begin(step)
                loss, grad_norm = self.step(data_iter)
                stop_if_diverged(step, loss, grad_norm, self.checkpointer)
                lr = self.optimizer_step(step, skip=self.skips_update(step, loss))
                self.stragglers.end(step, data_wait_s=self.metrics.data_loading_times[-1])
                if self.metrics.should_log(step) or step == t.steps:  # the last step always
                    self.log(step, loss, grad_norm, lr)
                watchdog.end(step)
                if self.validator is not None and self.validator.due(step):
                    self.metrics.log_validation(step, *self.validator.run())
                if not self.spike_guard.consecutive or step == t.steps:  # not amid spikes
                    self.checkpointer.maybe_save(step)
                if step < t.steps:
                    self.stop_if_preempted(step)
                profiler.step(step)
                if startup is not None:  # first step of this run (compilation happens here)
                    dist_utils.set_train_timeout(self.job_config.comm)
                    startup.lap("first step")
                    logger.info(startup.summary())
                    startup = None

    def log(
        self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor, lr: dict[str, float]
    ) -> None:
        """The step's metrics: the loss averaged over the ranks, learning rates, MoE load,
        stragglers, spikes."""
        extra = {k: v for k, v in lr.items() if k != "lr"}
        extra |= self.expert_load.metrics() if self.expert_load else {}
        extra |= self.stragglers.report(step)
        if self.spike_guard.enabled:
            extra["loss_spikes/skipped"] = float(self.spike_guard.skipped)
        self.metrics.log(step, self.mean_loss(step, loss), float(grad_norm), lr["lr"], extra=extra)

    def mean_loss(self, step: int, loss: torch.Tensor) -> float:
        """The step's loss averaged over the ranks: one all-reduce, however often it is asked."""
        if self._mean_loss[0] != step:
            self._mean_loss = (step, mean_over(loss, self.rt.dims.loss_mesh))
        return self._mean_loss[1]

    def skips_update(self, step: int, loss: torch.Tensor) -> bool:
        """Whether the loss spike guard skips this step's update (the loss over every rank)."""
        if not self.spike_guard.enabled:
            return False
        batch = self.rt.plan.global_batch_size
        position = (f"global batch {step} of the data stream: its sequences {(step - 1) * batch}"
                    f"-{step * batch - 1}, after {self.train_state.ntokens_seen:,} tokens")  # fmt: skip
        return self.spike_guard.skips(step, self.mean_loss(step, loss), position, self.checkpointer)

    def stop_if_preempted(self, step: int) -> None:
        """After a stop signal or Ctrl-C reached any rank, every rank saves this step and exits
        (code 160 for a preemption, 130 for Ctrl-C)."""
        if (sig := self.preemption.agreed()) is None:
            return
        ctrl_c = self.preemption.is_ctrl_c(sig)
        what = "Ctrl-C (again: stop at once, without saving)" if ctrl_c else sig.name
        logger.warning(f"{what} received: saving step {step} before stopping")
        path = self.checkpointer.save_before_exit(step)
        if path:
            saved = f"saved to {path}"
        elif self.job_config.checkpoint.enable:
            saved = "its save failed (see the log), the newest complete checkpoint stays"
        else:
            saved = "nothing saved (checkpoint.enable is false)"
        if ctrl_c:
            resume = "; run the same command to resume" if path else ""
            raise Interrupted(f"stopped by Ctrl-C after step {step}: {saved}{resume}")
        raise Preempted(
            f"preempted by {sig.name} after step {step}: {saved}; start the job again to resume"
        )

    def step(self, data_iter: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward and backward over the accumulation steps: (summed loss, clipped grad norm).
        The step's micro-batches are read first: the loss is the mean over their valid tokens."""
        self.optimizer.zero_grad()
        t0 = time.perf_counter()
        batches = [next(data_iter) for _ in range(self.rt.plan.grad_accum_steps)]
        self.metrics.data_loading_times.append(time.perf_counter() - t0)
        self.runner.begin_step(batches)
        if self.expert_load:
            self.expert_load.begin_step(sum(len(b.inputs) for b in batches))
        loss = torch.zeros((), device=self.rt.device)
        for batch in batches:
            # tokens per device: TP/PP/CP ranks of one data-parallel replica share a batch
            n = batch.labels.numel() // self.rt.dims.non_data_parallel_size
            self.metrics.ntokens_since_last_log += n
            loss += self.runner.forward_backward(batch)
        max_norm = self.job_config.training.max_norm
        return loss, dist_utils.clip_grad_norm_(
            self.params, max_norm, pp_group=self.rt.dims.pp_group
        )

    def optimizer_step(self, step: int, skip: bool = False) -> dict[str, float]:
        """The update (after a background save has copied the weights it needs); the learning
        rates it used. A skipped update changes nothing, nor does the schedule move; the batch is
        consumed."""
        self.checkpointer.wait_for_staging()
        lr = self.learning_rates()
        if not skip:
            self.optimizer.step()
            if self.expert_load:  # the routing biases move with the step's load
                self.expert_load.end_step()
            float8.after_optimizer_step(self.parts, self.job_config)
            self.lr_scheduler.step()
        tokens = self.rt.plan.global_batch_size * self.job_config.training.seq_len
        self.train_state.step = step
        self.train_state.ntokens_seen += tokens
        return lr

    def learning_rates(self) -> dict[str, float]:
        """The next step's ``lr`` (optimizer.lr on its schedule) and, with Muon, ``lr/muon``
        (optimizer.muon_lr on the same schedule); parameter groups scale them by their multiplier."""
        cfg, factor = self.job_config.optimizer, self.lr_scheduler.factor()
        lrs = {"lr": cfg.lr * factor}
        if cfg.name == "Muon":
            lrs["lr/muon"] = cfg.muon_lr * factor
        return lrs


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
