"""The training loop: batch -> step runner -> clip -> guards -> optimizer -> metrics -> validation
-> checkpoint, step after step from the one after the step resumed, and the summary of the run.

``train.py`` builds the parts (:mod:`torchtitan.train.builders`) and hands them to :class:`Loop`
by name.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Protocol

import torch

from torchtitan.checkpoint import CheckpointManager, TrainState
from torchtitan.config.schema import JobConfig
from torchtitan.distributed import utils as dist_utils
from torchtitan.distributed.expert_load import ExpertLoad
from torchtitan.distributed.replica_groups import ReplicaGroups
from torchtitan.observability.log import logger
from torchtitan.observability.metrics import MetricsProcessor, mean_over
from torchtitan.observability.profiling import profiled_steps
from torchtitan.observability.run_summary import Summary, summary_lines
from torchtitan.quantization import float8
from torchtitan.resilience.guards import LossSpikeGuard, finite_verdict
from torchtitan.resilience.preemption import Preemption
from torchtitan.resilience.stragglers import StragglerReport
from torchtitan.resilience.verdict import GO_ON, Action, Verdict
from torchtitan.resilience.watchdog import HangWatchdog
from torchtitan.train import runtime
from torchtitan.train.builders import Runtime
from torchtitan.train.downstream import DownstreamEvaluator
from torchtitan.train.loss import MTPLoss
from torchtitan.train.step import StepRunner
from torchtitan.train.validation import Validator


class StepHook(Protocol):
    """Runs around every training step: the garbage collection, the hang watchdog, the
    straggler report and the profiler."""

    def before_step(self, step: int) -> None: ...

    def after_step(self, step: int) -> None: ...


@dataclass(kw_only=True)
class Loop:
    """The training steps: batch -> step runner -> clip -> guards -> optimizer -> metrics ->
    validation -> downstream evaluation -> checkpoint, from the step after the one resumed."""

    job_config: JobConfig
    rt: Runtime
    parts: list[torch.nn.Module]
    runner: StepRunner
    optimizer: Any
    lr_scheduler: Any
    metrics: MetricsProcessor
    checkpointer: CheckpointManager
    validator: Validator | None
    evaluator: DownstreamEvaluator | None
    train_state: TrainState
    preemption: Preemption
    # fault_tolerance.enable: torchft's manager of this replica group (gradients averaged with
    # the other groups, updates only when every group commits)
    replicas: ReplicaGroups | None = None
    _groups_logged: int = 0  # the number of live groups last logged
    _attempt_tokens: int = 0  # this rank's tokens in the step being trained
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
        return ExpertLoad(
            self.parts,
            # rows for the main layers and the multi-token-prediction depths after them
            self.rt.plan.model_args.n_layers
            + getattr(self.rt.plan.model_args, "num_mtp_layers", 0),
            tp=self.rt.dims.tp,
            # a LoRA run keeps its base's routing: the expert biases are frozen with the rest
            coeff=0.0 if self.job_config.lora.enable else moe.load_balance_coeff,
            aux_coeff=moe.aux_loss_coeff,
            device=self.rt.device,
        )

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
        return StragglerReport(
            self.job_config.resilience.straggler_threshold,
            rank=self.rt.rank,
            world_size=self.rt.world_size,
            device=self.rt.device,
            data_wait=lambda: (self.metrics.data_loading_times or [0.0])[-1],
        )

    @cached_property
    def spike_guard(self) -> LossSpikeGuard:
        r = self.job_config.resilience
        return LossSpikeGuard(
            r.loss_spike_zscore,
            r.loss_spike_window,
            r.loss_spike_warmup_steps,
            r.loss_spike_max_consecutive,
        )

    @cached_property
    def params(self) -> list[torch.nn.Parameter]:
        """This rank's parameters, listed once for gradient clipping."""
        return [p for m in self.parts for p in m.parameters()]

    def run(self, data_iter: Any, startup: runtime.StartupTimer | None) -> None:
        t, first = self.job_config.training, self.train_state.step + 1
        self._began = (first, self.train_state.ntokens_seen, time.perf_counter(), 0.0)
        try:
            if first > t.steps:
                logger.info(f"Already trained to step {first - 1} of {t.steps}: nothing to do")
                return
            self.metrics.begin()
            self._run_steps(data_iter, startup, first)
        finally:
            self._began = (*self._began[:3], time.perf_counter())
            if self.replicas is not None:  # this group leaves the quorums
                self.replicas.shutdown()

    def _run_steps(self, data_iter: Any, startup: runtime.StartupTimer | None, first: int) -> None:
        t = self.job_config.training
        with (
            self.preemption,
            self.hang_watchdog() as watchdog,
            profiled_steps(
                self.job_config.profiling, self.job_config.job.dump_folder, self.rt.rank, first - 1
            ) as profiler,
        ):
            hooks: list[StepHook] = [
                runtime.GarbageCollection(t.gc_freq),
                watchdog,
                self.stragglers,
                profiler,
            ]
            step = first
            while step <= t.steps:
                step = self.start_step(data_iter, step)
                for hook in hooks:
                    hook.before_step(step)
                loss, grad_norm = self.step(data_iter)
                self.act(step, finite_verdict(step, loss, grad_norm))
                skip = self.act(step, self.spike_verdict(step, loss))
                lr = self.optimizer_step(step, skip=skip)
                if lr is None:  # not committed by every replica group: the step is retried
                    self.forget_attempt()
                    for hook in hooks:
                        hook.after_step(step)
                    continue
                step = self.outer_sync(data_iter, step)
                if self.metrics.should_log(step) or step == t.steps:  # the last step always
                    self.log(step, loss, grad_norm, lr)
                for hook in hooks:
                    hook.after_step(step)
                if self.validator is not None and self.validator.due(step):
                    self.metrics.log_validation(step, *self.validator.run())
                if self.evaluator is not None and self.evaluator.due(step):
                    self.metrics.log_downstream(step, *self.evaluator.run(step))
                if not self.spike_guard.consecutive or step == t.steps:  # not amid spikes
                    self.checkpointer.maybe_save(step)
                if step < t.steps:
                    self.act(step, self.preemption.verdict(step))
                if startup is not None:  # first step of this run (compilation happens here)
                    dist_utils.set_train_timeout(self.job_config.comm)
                    startup.lap("first step")
                    logger.info(startup.summary())
                    startup = None
                step += 1

    def act(self, step: int, verdict: Verdict) -> bool:
        """What the loop does with a guard's verdict: whether to skip this step's update; a stop
        saves this step (preemption, Ctrl-C) or closes the checkpointer with nothing from this
        step on saved (divergence), then raises the verdict's error, one line."""
        if not verdict.stops:
            return verdict.action is Action.SKIP_UPDATE
        if verdict.save:
            path = self.checkpointer.save_before_exit(step)
            if path:
                saved = f"saved to {path}"
            elif self.job_config.checkpoint.enable:
                saved = "its save failed (see the log), the newest complete checkpoint stays"
            else:
                saved = "nothing saved (checkpoint.enable is false)"
            resumable = path or self.job_config.checkpoint.enable
            message = f"{verdict.reason}: {saved}" + (f"; {verdict.advice}" if resumable else "")
        else:
            self.checkpointer.close()  # a background save of an earlier step is written, marked
            newest = self.checkpointer.newest_complete() or "none"
            message = f"{verdict.reason} (newest checkpoint: {newest}). {verdict.advice}"
        error = verdict.error(message)
        if verdict.names_rank is not None:
            error.names_rank = verdict.names_rank
        raise error

    def log(
        self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor, lr: dict[str, float]
    ) -> None:
        """The step's metrics: the loss averaged over the ranks, learning rates, MoE load,
        stragglers, spikes."""
        extra = {k: v for k, v in lr.items() if k != "lr"}
        extra |= self.expert_load.metrics() if self.expert_load else {}
        if isinstance(self.runner.loss_fn, MTPLoss):
            extra |= self.runner.loss_fn.metrics(self.rt.device)
        extra |= self.stragglers.report(step)
        if self.spike_guard.enabled:
            extra["loss_spikes/skipped"] = float(self.spike_guard.skipped)
        self.metrics.log(step, self.mean_loss(step, loss), float(grad_norm), lr["lr"], extra=extra)

    def mean_loss(self, step: int, loss: torch.Tensor) -> float:
        """The step's loss averaged over the ranks: one all-reduce, however often it is asked."""
        if self._mean_loss[0] != step:
            self._mean_loss = (step, mean_over(loss, self.rt.dims.loss_mesh))
        return self._mean_loss[1]

    def spike_verdict(self, step: int, loss: torch.Tensor) -> Verdict:
        """The loss spike guard's verdict on this step (the loss over every rank)."""
        if not self.spike_guard.enabled:
            return GO_ON
        batch = self.rt.plan.global_batch_size
        position = (
            f"global batch {step} of the data stream: its sequences {(step - 1) * batch}"
            f"-{step * batch - 1}, after {self.train_state.ntokens_seen:,} tokens"
        )
        return self.spike_guard.verdict(step, self.mean_loss(step, loss), position)

    def step(self, data_iter: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward and backward over the accumulation steps: (summed loss, clipped grad norm).
        The step's micro-batches are read first: the loss is the mean over their valid tokens."""
        self.optimizer.zero_grad()
        t0 = time.perf_counter()
        batches = [next(data_iter) for _ in range(self.rt.plan.grad_accum_steps)]
        self.metrics.data_loading_times.append(time.perf_counter() - t0)
        divisor = self.runner.step_tokens(batches).divisor
        if self.expert_load:
            self.expert_load.begin_step(sum(len(b.inputs) for b in batches))
        if isinstance(self.runner.loss_fn, MTPLoss):
            self.runner.loss_fn.begin_step()
        loss = torch.zeros((), device=self.rt.device)
        self._attempt_tokens = 0
        for batch in batches:
            # tokens per device: TP/PP/CP ranks of one data-parallel replica share a batch
            n = batch.labels.numel() // self.rt.dims.non_data_parallel_size
            self.metrics.ntokens_since_last_log += n
            self._attempt_tokens += n
            loss += self.runner.forward_backward(batch, divisor)
        if self.in_step is not None:
            self.in_step.average_gradients(self.params)
        max_norm = self.job_config.training.max_norm
        return loss, dist_utils.clip_grad_norm_(
            self.params, max_norm, pp_group=self.rt.dims.pp_group
        )

    def optimizer_step(self, step: int, skip: bool = False) -> dict[str, float] | None:
        """The update (after a background save has copied the weights it needs); the learning
        rates it used. A skipped update changes nothing, nor does the schedule move; the batch is
        consumed. With replica groups: None when the step was not committed (nothing changed,
        the step is retried); a group that healed in it has taken the live groups' state, and
        updates as they do."""
        self.checkpointer.wait_for_staging()
        if self.in_step is not None and not self.in_step.commit():
            return None
        lr = self.learning_rates()
        if not skip:
            self.optimizer.step()
            if self.expert_load:  # the routing biases move with the step's load
                self.expert_load.end_step()
            float8.after_optimizer_step(
                self.parts, self.job_config.model.converters, self.job_config.float8
            )
            self.lr_scheduler.step()
        tokens = self.step_sequences() * self.job_config.training.seq_len
        self.train_state.step = step
        self.train_state.ntokens_seen += tokens
        return lr

    @property
    def in_step(self) -> ReplicaGroups | None:
        """The replica groups when they train in step (a quorum, gradients averaged and a
        commit vote every step); None without groups, or when they meet every sync_steps."""
        return self.replicas if self.replicas is not None and self.replicas.outer is None else None

    def start_step(self, data_iter: Any, step: int) -> int:
        """The step about to be trained: ``step``, or with replica groups in step, after the
        quorum, the live groups' next step when this group was behind them and has just taken
        their state (its data reader then skips its share of the steps it missed)."""
        if self.replicas is not None and self.replicas.outer is not None:
            self.replicas.outer.begin()  # semi-synchronous: the groups meet after the step
        if self.in_step is None:
            return step
        self.in_step.quorum(self.train_state.step)  # torchft's step is the training step
        if self.train_state.step + 1 != step:
            self.catch_up(data_iter, step - 1, self.train_state.step)
        return self.train_state.step + 1

    def outer_sync(self, data_iter: Any, step: int) -> int:
        """Semi-synchronous replica groups (DiLoCo, local SGD) meet after every sync_steps-th
        step; a group behind the live ones takes their state there and goes on from their
        step (its reader skipping its share of the steps it missed). The step trained to."""
        outer = None if self.replicas is None else self.replicas.outer
        if outer is None or not outer.due(step):
            return step
        outer.sync(step)
        # the weights changed outside the optimizer: float8's precomputed scales follow them
        float8.after_optimizer_step(
            self.parts, self.job_config.model.converters, self.job_config.float8
        )
        if self.train_state.step != step:
            self.catch_up(data_iter, step, self.train_state.step)
        return self.train_state.step

    def forget_attempt(self) -> None:
        """A step that was not committed: its tokens, data wait and loss are not the run's."""
        self.metrics.ntokens_since_last_log -= self._attempt_tokens
        if self.metrics.data_loading_times:
            self.metrics.data_loading_times.pop()
        self._mean_loss = (0, 0.0)

    def catch_up(self, data_iter: Any, own: int, healed: int) -> None:
        """This replica group had trained to step ``own`` and took the live groups' state of
        step ``healed``: its reader skips its share of the steps between, so that it reads the
        same part of every global batch as if it had never stopped."""
        batches = (healed - own) * self.rt.plan.grad_accum_steps
        t0 = time.perf_counter()
        for _ in range(batches):
            next(data_iter)
        logger.info(
            f"replica group {self.job_config.fault_tolerance.replica_id} healed from the live "
            f"groups: step {own} -> {healed}; its data reader skipped its share of steps "
            f"{own + 1}-{healed} ({batches} batches, {time.perf_counter() - t0:.2f}s)"
        )

    def step_sequences(self) -> int:
        """The global batch of this step: with replica groups, the live groups' batches."""
        plan = self.rt.plan
        if self.replicas is None:
            return plan.global_batch_size
        live = self.replicas.participants
        if live != self._groups_logged:
            self._groups_logged = live
            logger.info(
                f"global batch: {live * plan.global_batch_size // plan.groups} sequences from "
                f"{live} live replica group{'s' * (live != 1)} of {plan.groups}"
            )
        return live * plan.global_batch_size // plan.groups

    def learning_rates(self) -> dict[str, float]:
        """The next step's ``lr`` (optimizer.lr on its schedule) and, with Muon, ``lr/muon``
        (optimizer.muon_lr on the same schedule); parameter groups scale them by their multiplier."""
        cfg, factor = self.job_config.optimizer, self.lr_scheduler.factor()
        lrs = {"lr": cfg.lr * factor}
        if cfg.name == "Muon":
            lrs["lr/muon"] = cfg.muon_lr * factor
        return lrs
