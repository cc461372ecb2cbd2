"""Checkpoints: the whole training state through ``torch.distributed.checkpoint`` (DCP).

Layout (``folder``): ``{job.dump_folder}/{checkpoint.folder}/step-{N}/`` holds DCP's ``.metadata``
and one ``*.distcp`` file per writing rank, then ``COMPLETE`` (JSON: step, whether it holds model
weights only, the world size that wrote it). ``COMPLETE`` is written last, by rank 0, after every
rank's data and the metadata are on disk: a folder without it is a save that did not finish, which
readers ignore and rank 0 deletes.

What is saved (``states``), keyed by name so that any parallel layout can load it (DCP reshards
DTensors): ``model`` (parameter FQNs), ``optimizer`` (flattened per FQN), ``lr_scheduler``,
``dataloader`` (one entry per virtual data shard), ``train_state`` (step, tokens seen) and ``rng``
(per rank).

Auto-resume: a job whose folder holds complete checkpoints continues from the newest one with the
full training state (or ``checkpoint.load_step``); one that fails to load is reported and the one
before it is tried. Model-only checkpoints (exports, ``every_save_model_only``) are not resume
points, except a seed checkpoint at step 0, whose weights start the run.

A save that fails (disk full, permission, I/O error) leaves the previous complete checkpoint as
it is (nothing is purged before a new one is marked), its own folder is removed, and every rank
takes the same decision at the same point (``checkpoint.on_save_error``: stop with
``CheckpointSaveFailed``, or log and train on): DCP raises a write or metadata error on every
rank; the marker's error (rank 0's) and a background save's (found at different steps) are
agreed on in one small collective where the ranks meet anyway (``_settle``).

The rest of the package: ``folder`` (scan, marker, and the choices of what to load, set aside and
purge), ``states``, ``safe_read`` (safe unpickling, ``read_model_weights``), ``collectives``,
``save_failure`` (what a failed save says), ``hf_exchange`` (Hugging Face load and export) and
``hf_files`` (Hugging Face folder I/O).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.api import CheckpointException

from torchtitan.checkpoint import mismatch, storage
from torchtitan.checkpoint.collectives import (
    _agree,
    _barrier,
    _collective_device,
    _first_line,
    _first_of_all,
)
from torchtitan.checkpoint.errors import CheckpointError
from torchtitan.checkpoint.folder import (
    MARKER,
    Found,
    fall_back,
    read_marker,
    requested,
    resume_candidates,
    scan,
    set_aside,
    step_path,
    to_purge,
    write_marker,
)
from torchtitan.checkpoint.hf_exchange import (
    ExportRanks,
    HFExchange,
    export_hf,
    load_hf,
)
from torchtitan.checkpoint.safe_read import (
    SafeLoadPlanner,
    _check_block_count,
    _checkpoint_keys,
    _read_metadata,
    reader_for,
)
from torchtitan.checkpoint.save_failure import (
    STOP,
    SaveFailure,
    continue_line,
    describe,
    found_line,
    stop_line,
    writer_for,
)
from torchtitan.checkpoint.states import (
    _EXPORT_DTYPES,
    STATE_KEYS,
    ModelState,
    RNGState,
    TrainState,
)
from torchtitan.checkpoint.unfused import apply_merges, plan_unfused_load
from torchtitan.config.schema import Checkpoint as CheckpointConfig
from torchtitan.errors import CheckpointSaveFailed
from torchtitan.observability.log import logger
from torchtitan.remote import StorageError, access_problem, check_reachable

__all__ = ["CheckpointError", "CheckpointManager"]

_MODEL = ("vocab_size", "parameters")  # the recorded facts of the model itself


@dataclass
class _PendingSave:
    path: str
    step: int
    model_only: bool
    t0: float
    upload: Any  # Future: the files are written
    staging: Any  # Future: the state is copied off the live tensors (None: already)


class CheckpointManager:
    """Saves every ``checkpoint.interval`` steps and at the end; loads on start-up."""

    def __init__(
        self,
        cfg: CheckpointConfig,
        *,
        dump_folder: str,
        total_steps: int,
        model_parts: list[nn.Module],
        optimizers: Any,
        lr_schedulers: Any,
        dataloader: Any,
        train_state: TrainState,
        rank: int,
        world_size: int,
        model_args: Any = None,
        hf: HFExchange | None = None,
        run_facts: dict[str, Any] | None = None,
        trainable_only: bool = False,
        extra_states: dict[str, Any] | None = None,
    ) -> None:
        """``extra_states``: more objects saved with the training state (``state_dict`` /
        ``load_state_dict``), each under its name; a checkpoint without one loads without it
        (the object keeps what it has)."""
        self.cfg = cfg
        # frozen parameters (LoRA's base) come from the initial load, on every start: only the
        # trained ones are saved (see ModelState)
        self.trainable_only = trainable_only
        self.run_facts = run_facts or {}  # recorded in each marker; a resume must match them
        self.last_hf_export: str | None = None  # the folder of this run's last HF export
        self.enabled = self.cfg.enable
        # a URL (object storage) is used as given; a local folder lives in the dump folder
        self.dump_folder = dump_folder
        self.folder = os.path.join(dump_folder, self.cfg.folder)
        if storage.is_url(self.cfg.folder):
            self.folder = self.cfg.folder
            if self.enabled:
                check_reachable(self.folder, "checkpoint.folder")
        self.total_steps = total_steps
        self.rank, self.world_size = rank, world_size
        self.train_state = train_state
        self.model_parts = model_parts
        self.model_args = model_args
        self.hf = hf or HFExchange()
        # who writes what in a Hugging Face export: the first rank of each pipeline stage its
        # stage's weights (the mesh puts pp outermost), rank 0 the rest
        self.export_ranks = ExportRanks(rank, world_size, self.hf.pp_rank, self.hf.pp_degree)
        self.async_mode = self.cfg.async_mode if self.enabled else "disabled"
        self._pending: _PendingSave | None = None
        # the (step, model_only) of the newest save started and not known to have failed, and
        # this rank's failed save that the ranks have not agreed on yet (see _settle)
        self._started: tuple[int, bool] | None = None
        self._failure: SaveFailure | None = None
        self._last_save_time = (
            time.monotonic()
        )  # checkpoint.interval_type = "seconds" counts from it
        self._stager: Any = None
        # Async saves talk over their own gloo group from a background thread, never over the
        # training group (whose collectives they would interleave with).
        self._pg = (
            dist.new_group(backend="gloo")
            if self.async_mode != "disabled" and dist.is_initialized()
            else None
        )
        self.objects: dict[str, Any] = {
            "model": ModelState(model_parts, "trainable" if trainable_only else "all"),
            "optimizer": optimizers,
            "lr_scheduler": lr_schedulers,
            "dataloader": dataloader,
            "train_state": train_state,
            "rng": RNGState(rank),
            **(extra_states or {}),
        }
        self.state_keys = STATE_KEYS + tuple(extra_states or {})

    # ---- saving

    @property
    def hf_load_path(self) -> tuple[str, str] | None:
        """Where ``checkpoint.initial_load_in_hf`` reads: ``checkpoint.initial_load_path``, else
        the ``model.hf_assets_path`` folder, as (folder, the key it came from); None if neither."""
        return self.hf.load_source

    def maybe_save(self, step: int) -> None:
        if not self.enabled:
            return
        self.poll()
        last = step == self.total_steps
        first = step == 1 and self.cfg.enable_first_step_checkpoint
        if not (last or self._due(step) or first):
            return
        model_only = self.cfg.every_save_model_only or (last and self.cfg.last_save_model_only)
        self.save(step, model_only=model_only, export=model_only)
        if last and self.cfg.last_save_in_hf:
            self.last_hf_export = self.export_hf(step)

    def _due(self, step: int) -> bool:
        """Whether ``checkpoint.interval`` has passed: steps, or seconds since the last save (or
        the start) by every rank's clock, the latest deciding (one small collective a step)."""
        if self.cfg.interval_type == "steps":
            return step % self.cfg.interval == 0
        elapsed = time.monotonic() - self._last_save_time
        due = torch.tensor([1 if elapsed >= self.cfg.interval else 0], device=_collective_device())
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(due, op=dist.ReduceOp.MAX)
        if due.item():
            self._last_save_time = time.monotonic()
        return bool(due.item())

    def save_seed(self) -> str | None:
        """``step-0`` with the freshly initialized weights (float32): every later run of this
        job, whatever its layout, starts from them."""
        return self.save(0, model_only=True, export=False)

    def save_before_exit(self, step: int) -> str | None:
        """The full training state at ``step``, written before this call returns whatever
        ``async_mode`` says (a preempted run exits right after); a save of this step already
        started (in the background, or an interval save just done) is finished instead of
        written again. None when checkpointing is off, or when the save failed with
        ``checkpoint.on_save_error = "continue"`` (logged; with "stop" it raises)."""
        if not self.enabled:
            return None
        if self._started == (step, False):  # the same on every rank: saves start together
            return step_path(self.folder, step) if self.wait() else None
        return self.save(step, model_only=False, sync=True)

    def save(
        self, step: int, *, model_only: bool, export: bool = False, sync: bool = False
    ) -> str | None:
        """Write ``step-{step}``; with ``async_mode`` (unless ``sync``) the write continues in the
        background and ``COMPLETE`` follows when it has finished (see ``poll``). A save that fails
        raises ``CheckpointSaveFailed`` on every rank, or with ``checkpoint.on_save_error =
        "continue"`` is logged and returns None; the previous complete checkpoint stays."""
        self._collect()  # one save in flight at a time
        path = step_path(self.folder, step)
        t0 = time.perf_counter()
        if self.rank == 0:
            # a save of this step that did not finish (or an older run's); one that cannot be
            # removed (or storage that does not answer) makes DCP fail below, on every rank
            try:
                if storage.exists(path):
                    storage.remove(path, first=MARKER)
            except Exception as e:
                logger.warning(f"cannot clear {path} before saving: {_first_line(e)}")
        self._settle()  # (the barrier after the removal) how the previous save went, agreed
        self._started = (step, model_only)
        state = self._state(model_only, cast=export)
        what = "model weights" if model_only else "training state"
        if self.async_mode == "disabled" or sync:
            self._failure = self._write(state, path, step, model_only)
            if self._settle() is not None:
                return None
            logger.info(f"Saved {what} at step {step} to {path} in {time.perf_counter() - t0:.2f}s")
            return path
        self._pending = self._start_async(state, path, step, model_only)
        logger.info(
            f"Saving {what} at step {step} to {path} in the background "
            f"(training resumed after {time.perf_counter() - t0:.2f}s)"
        )
        return path

    def _write(self, state: dict, path: str, step: int, model_only: bool) -> SaveFailure | None:
        """A synchronous save: DCP's write (its errors reach every rank), then the marker."""
        try:
            dcp.save(state, storage_writer=writer_for(path))
        except (Exception, CheckpointException) as e:  # DCP gathers every rank's write error
            return self._failed(path, step, e)
        return self._finish(path, step, model_only)

    def _start_async(self, state: dict, path: str, step: int, model_only: bool) -> _PendingSave:
        writer = writer_for(path)
        if self.async_mode == "async":
            # staged (copied to CPU) before async_save returns; written by a thread
            future = dcp.async_save(state, storage_writer=writer, process_group=self._pg)
            return _PendingSave(path, step, model_only, time.perf_counter(), future, None)
        # async_with_pinned_mem: staged into reused (pinned, on CUDA) CPU buffers while the next
        # step computes; only the optimizer step has to wait for that copy
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        cuda = torch.cuda.is_available()
        if self._stager is None:
            self._stager = DefaultStager(StagingOptions(cuda, False, True, cuda))
        if cuda:
            # the stager copies on its own CUDA stream: the work queued on the training stream
            # (the last optimizer step, an export cast) must have finished before it reads
            torch.cuda.current_stream().synchronize()
        response = dcp.async_save(
            state, storage_writer=writer, process_group=self._pg, async_stager=self._stager
        )
        return _PendingSave(
            path,
            step,
            model_only,
            time.perf_counter(),
            response.upload_completion,
            response.staging_completion,
        )

    def wait_for_staging(self) -> None:
        """Call before the optimizer step: a background copy of the weights must finish first."""
        if self._pending is not None and self._pending.staging is not None:
            self._pending.staging.result()
            self._pending.staging = None

    def poll(self) -> None:
        """Mark a finished background save complete (cheap, no collective; called every step).
        A failure is only noted here: the ranks find out at different steps, and act on it
        together at the next save, a save before exit or the end (``wait``)."""
        if self._pending is not None and self._pending.upload.done():
            self._collect()

    def wait(self) -> bool:
        """Block until the save in flight (if any) is written and marked complete, then agree
        with every rank on how the saves since the last agreement went (a collective: every
        rank calls it at the same point). False when one failed and training goes on
        (``on_save_error = "continue"``); with "stop", ``CheckpointSaveFailed`` is raised."""
        self._collect()
        return self._settle() is None

    def _collect(self) -> None:
        """This rank's end of the background save in flight: wait for its files, then rank 0
        marks it complete; a failure is kept (and logged) for ``_settle``."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        try:
            pending.upload.result()
        except BaseException as e:  # noqa: B036 - DCP raises CheckpointException (BaseException)
            self._failure = self._failed(pending.path, pending.step, e)
        else:
            self._failure = self._finish(pending.path, pending.step, pending.model_only)
        if self._failure is not None:
            self._failure = replace(self._failure, logged=True)
            last = pending.step >= self.total_steps
            logger.error(
                found_line(self._failure, self.cfg.on_save_error, self.newest_complete(), last)
            )
            return
        logger.info(
            f"Saved {'model weights' if pending.model_only else 'training state'} at step "
            f"{pending.step} to {pending.path} (written {time.perf_counter() - pending.t0:.2f}s "
            "after training resumed)"
        )

    def _finish(self, path: str, step: int, model_only: bool) -> SaveFailure | None:
        """Rank 0 marks ``path`` complete once every rank's data and the metadata are written
        (its DCP save returns only then), and only then purges older ones."""
        if self.rank != 0:
            return None
        try:
            write_marker(path, step, model_only, self.world_size, run=self.run_facts)
        except Exception as e:  # only rank 0 knows: _settle tells the others
            return self._failed(path, step, e)
        try:
            self._purge(keep=path)
        except Exception as e:  # retention is housekeeping: the save itself is whole
            logger.warning(f"Retention after the save of {path} failed: {_first_line(e)}")
        return None

    def _failed(self, path: str, step: int, e: BaseException) -> SaveFailure:
        """The save into ``path`` failed: rank 0 removes its folder (never marked; every rank's
        writing has ended, DCP reports an error only after gathering them all) to free the
        space, as far as it can."""
        if self.rank == 0:
            storage.remove(path, first=MARKER)
        return SaveFailure(path, step, describe(e, self.world_size))

    def _settle(self) -> SaveFailure | None:
        """Every rank agrees (one small collective) on the failure any rank holds, and acts on
        it alike: with ``on_save_error = "stop"`` all raise ``CheckpointSaveFailed``, else the
        ranks that have not logged it yet do, and training goes on. Returns the failure."""
        mine, self._failure = self._failure, None
        failure = _first_of_all(mine)
        if failure is None:
            return None
        if self._started is not None and self._started[0] == failure.step:
            self._started = None  # not written: a save before exit at that step writes anew
        newest = self.newest_complete()
        if self.cfg.on_save_error == STOP:
            raise CheckpointSaveFailed(stop_line(failure, newest))
        if mine is None or not mine.logged:
            logger.error(continue_line(failure, newest, last=failure.step >= self.total_steps))
        return failure

    def close(self) -> None:
        """End of training: the last background save is finished and marked (or its failure,
        and any earlier one not yet agreed on, is acted on)."""
        try:
            self.wait()
        finally:
            if self._stager is not None:
                self._stager.close()
                self._stager = None

    def _state(self, model_only: bool, cast: bool) -> dict[str, Any]:
        """What a save writes; ``cast``: model weights in ``checkpoint.export_dtype``."""
        keys = ("model",) if model_only else self.state_keys
        state = {k: self.objects[k].state_dict() for k in keys}
        if cast and self.cfg.export_dtype != "float32":
            dtype = _EXPORT_DTYPES[self.cfg.export_dtype]
            state["model"] = {k: v.to(dtype) for k, v in state["model"].items()}
        return state

    def _purge(self, keep: str) -> None:
        """Keep the newest ``keep_latest_k`` complete checkpoints of each kind (resumable, and
        model weights only), and always ``keep``, the one just written (0: keep all)."""
        k = self.cfg.keep_latest_k
        if k <= 0:
            return
        for old in to_purge(scan(self.folder), k, keep):
            storage.remove(old.path, first=MARKER)
            kind = "model-only" if old.model_only else "resumable"
            logger.info(f"Removed checkpoint {old.path} (keeping the newest {k} {kind} ones)")

    def newest_complete(self) -> str | None:
        """The newest complete checkpoint in the folder (None if none or disabled)."""
        complete = [c for c in scan(self.folder) if c.complete] if self.enabled else []
        return complete[-1].path if complete else None

    # ---- loading

    def load(self) -> bool:
        """Resume from the folder (or ``initial_load_path``); True if a checkpoint was loaded."""
        if not self.enabled:
            self._warn_if_checkpoints_left()
            return False
        found = self._scan_on_rank_0()
        if self.rank == 0:
            for c in found:
                if not c.complete:
                    logger.warning(f"Removing incomplete checkpoint {c.path} (no {MARKER} marker)")
                    storage.remove(c.path)
        _barrier()
        complete = [c for c in found if c.complete]
        if self.trainable_only and not self._initial_load():
            raise CheckpointError(
                "lora.enable: no base model was loaded; set checkpoint.initial_load_path or "
                "checkpoint.initial_load_in_hf with model.hf_assets_path"
            )
        if self.cfg.load_step != -1:
            candidates = [requested(complete, self.cfg.load_step, self.folder)]
        else:
            candidates, skipped = resume_candidates(complete)
            for c in skipped:
                logger.info(f"Checkpoint {c.path} holds model weights only: not a resume point")
        loaded, failed = self._load_newest(candidates)
        self._set_aside_newer(complete, loaded.step if loaded else 0, failed)
        if loaded is not None:
            return True
        return self.trainable_only or self._initial_load()

    def _scan_on_rank_0(self) -> list[Found]:
        """The folder as rank 0 finds it, the same on every rank (ranks that listed it each on
        their own could see different folders, a save landing or a request failing between
        them); a StorageError is raised on every rank alike."""
        found: list[Found] | None = None
        error: str | None = None
        if self.rank == 0:
            try:
                found = scan(self.folder)
            except StorageError as e:
                error = str(e)
        found, error = _first_of_all((found, error)) or (found, error)
        if error is not None:
            raise StorageError(error)
        return found or []

    def _warn_if_checkpoints_left(self) -> None:
        """Checkpointing is off, but the folder holds a run's checkpoints: starting over from
        step 1 is then rarely what was meant, so say so once."""
        try:
            resumable, _ = resume_candidates([c for c in scan(self.folder) if c.complete])
        except Exception:  # object storage out of reach: nothing to say, none is used
            return
        if resumable:
            logger.warning(
                f"{self.folder} holds checkpoints (the newest: {resumable[-1].path}) but "
                "checkpoint.enable is false: this run starts from step 1 and saves none; pass "
                "--checkpoint.enable to resume from the newest"
            )

    def _initial_load(self) -> bool:
        """No checkpoint of this job's own: the starting weights of ``initial_load_path`` (or,
        with ``initial_load_in_hf``, of a Hugging Face folder); False if there are none. A run
        that trains some parameters only loads the frozen ones from there (on every start)."""
        if self.cfg.initial_load_in_hf and self.hf_load_path is not None:
            load_hf(
                *self.hf_load_path,
                model_parts=self.model_parts,
                hf_adapter=self.hf.adapter,
                model_args=self.model_args,
                train_state=self.train_state,
                frozen_only=self.trainable_only,
            )
            return True
        if self.cfg.initial_load_path:
            path = self.cfg.initial_load_path
            if storage.is_url(path):
                check_reachable(path, "checkpoint.initial_load_path")
            if not storage.exists(storage.join(path, ".metadata")):
                raise CheckpointError(
                    f"checkpoint.initial_load_path: '{path}' is not a DCP checkpoint folder (no "
                    "'.metadata' in it); give a step-N folder written by this library"
                )
            frozen = ModelState(self.model_parts, "frozen") if self.trainable_only else None
            only = self.cfg.initial_load_model_only or frozen is not None
            self._load(path, only, step=None, model=frozen)
            return True
        return False

    def _load_newest(self, candidates: list[Found]) -> tuple[Found | None, list[Found]]:
        """Load the newest candidate that loads, falling back past damaged ones (``fall_back``);
        returns it (None when there are no candidates) and the ones that failed. Every rank
        takes the same path: ``_load`` fails on all ranks or on none."""
        loaded, failed = fall_back(
            candidates, lambda c: self._load(c.path, model_only=c.model_only, step=c.step)
        )
        if failed and loaded is not None and loaded.model_only:
            # the failed load may have written part of the optimizer state in place; this
            # start from weights only must begin with none, like a fresh run
            self.objects["optimizer"].reset_state()
        return loaded, failed

    def _set_aside_newer(self, complete: list[Found], start: int, failed: list[Found]) -> None:
        """This run continues from step ``start``; complete checkpoints of later steps belong to
        another history (a ``load_step`` resume, a fall-back past a damaged one, a fresh start over
        old model-only saves). They are renamed, never deleted, so that the next auto-resume and
        retention only ever see this run's own history."""
        error = None
        if self.rank == 0:
            try:
                for c, suffix in set_aside(complete, start, failed):
                    self._move_aside(c, suffix, start)
            except Exception as e:  # the others wait below: every rank stops alike
                error = f"cannot set a later checkpoint aside ({type(e).__name__}: {e})"
        _agree(error)

    def _move_aside(self, c: Found, suffix: str, start: int) -> None:
        dest = f"{c.path}.{suffix}"
        if storage.exists(dest):
            dest = f"{dest}-{time.strftime('%Y%m%d-%H%M%S')}"
        storage.move(c.path, dest, last=MARKER)
        logger.warning(
            f"Moved {c.path} to {dest}: this run continues from step {start}, so later "
            "checkpoints in the folder are no longer part of its history"
        )

    def _load(
        self, path: str, model_only: bool, step: int | None, model: ModelState | None = None
    ) -> None:
        """Load ``path`` into this run's objects (``model``: another view of the model's
        state, the frozen parameters of a base model)."""
        objects = self.objects if model is None else {**self.objects, "model": model}
        keys = ("model",) if model_only else self.state_keys
        keys = tuple(k for k in keys if k not in self.cfg.exclude_from_loading)
        state = {k: objects[k].state_dict() for k in keys}
        error, unreachable, merges, adapter = None, None, [], self._adapter()
        try:
            available = _checkpoint_keys(path)
            rng_prefix = f"rng.{self.objects['rng'].key}."
            if "rng" in state and not any(k.startswith(rng_prefix) for k in available):
                logger.info(f"{path}: no RNG state for this rank (saved by another world size)")
                del state["rng"]
            for k in set(state) - set(STATE_KEYS):
                if not any(key.startswith(f"{k}.") for key in available):
                    logger.info(f"{path}: no {k} state (saved without it); {k} starts afresh")
                    del state[k]
            merges = plan_unfused_load(state, available, adapter)
        except CheckpointError as e:  # no readable metadata: a damaged checkpoint
            error = str(e)
        except StorageError as e:  # out of reach: fatal on every rank, nothing to fall back to
            unreachable = str(e)
        if (unreachable := _first_of_all(unreachable)) is not None:
            raise StorageError(unreachable)
        _agree(error)  # every rank loads, or every rank raises the same error
        self._stop_if_mismatched(path, state, model_only, step)
        t0 = time.perf_counter()
        try:
            dcp.load(
                state,
                storage_reader=reader_for(path),
                planner=SafeLoadPlanner(),
            )
        except (Exception, CheckpointException) as e:  # DCP gathers every rank's read error
            if storage.is_url(path) and (problem := access_problem(e)) is not None:
                raise StorageError(f"checkpoint {path} cannot be read: {problem}") from None
            raise CheckpointError(
                f"checkpoint {path} cannot be loaded ({type(e).__name__}: {_first_line(e)})"
            ) from e
        if merges:
            apply_merges(state, merges, adapter)
            logger.info(
                f"{path}: written before the fused attention projection; merged its "
                f"{len(merges)} separate wq/wk/wv entries"
            )
        for k, v in state.items():
            objects[k].load_state_dict(v)
        if model_only:
            self.train_state.load_state_dict({"step": 0, "ntokens_seen": 0})
        logger.info(
            f"Loaded {'model weights' if model_only else 'training state'} from {path}"
            + (f" (step {self.train_state.step})" if not model_only else "")
            + f" in {time.perf_counter() - t0:.2f}s"
        )

    def _stop_if_mismatched(
        self, path: str, state: dict[str, Any], model_only: bool, step: int | None
    ) -> None:
        """A checkpoint of another configuration stops the run with one line per difference
        (``CheckpointMismatch``) before anything is read and before any fall-back: it is not
        damaged, and an older one would not fit either. One that lacks what its own run wrote is
        damaged (``CheckpointError``: the manager falls back past it). The ranks agree: pipeline
        stages load different entries."""
        from torch.distributed.checkpoint._nested_dict import flatten_state_dict

        # checkpoint.initial_load_path (step None) may start another model from some of the
        # saved weights on purpose: only what this run loads is compared, not the recorded run
        saved = read_marker(path).get("run", {}) if step is not None else {}
        if model_only:  # weights alone: the data, batch and optimizer do not matter
            saved = {k: v for k, v in saved.items() if k.startswith("model.") or k in _MODEL}
        flat, _ = flatten_state_dict(state)
        try:
            metadata = _read_metadata(path).state_dict_metadata
        except (CheckpointError, StorageError) as e:  # this rank alone may fail: agree first
            kind = "storage" if isinstance(e, StorageError) else "damaged"
            _raise_agreed(_first_of_all((kind, str(e))))
        found = None
        if step is not None and self.model_args is not None:
            try:  # this job's own history: no blocks may be dropped quietly (said first: the
                # count of blocks is the most precise thing to name)
                _check_block_count(path, self.model_args.n_layers, set(metadata))
            except CheckpointError as e:
                found = ("mismatch", str(e))
        found = found or mismatch.check(path, saved, self.run_facts, flat, metadata)
        _raise_agreed(_first_of_all(found))

    def _adapter(self) -> Any:
        """The family's state-dict adapter for this model (None where it has none): it knows
        which parameters are fused and how."""
        if self.hf.adapter is None or self.model_args is None:
            return None
        return self.hf.adapter(self.model_args)

    # ---- Hugging Face

    def export_hf(self, step: int) -> str | None:
        """``step-{step}-hf``: config.json, safetensors and tokenizer files that ``transformers``
        loads (see ``hf_exchange.export_hf``)."""
        return export_hf(
            storage.join(self.folder, f"step-{step}-hf"),
            model_parts=self.model_parts,
            hf_adapter=self.hf.adapter,
            model_args=self.model_args,
            export_dtype=self.cfg.export_dtype,
            tokenizer=self.hf.tokenizer,
            export_tokenizer=self.hf.export_tokenizer,
            ranks=self.export_ranks,
            adapters=self.hf.adapters,
            # an export into object storage is written here first, then uploaded
            staging=os.path.join(self.dump_folder, "export-staging", f"step-{step}"),
        )


def _raise_agreed(agreed: tuple[str, str] | None) -> None:
    """Raise what the ranks agreed on: a mismatch, storage out of reach, or damage."""
    if agreed is not None:
        kind, text = agreed
        errors = {"mismatch": mismatch.CheckpointMismatch, "storage": StorageError}
        raise errors.get(kind, CheckpointError)(text)
