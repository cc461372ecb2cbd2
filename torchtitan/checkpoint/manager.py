"""Checkpoints: the whole training state through ``torch.distributed.checkpoint`` (DCP).

Layout: ``{job.dump_folder}/{checkpoint.folder}/step-{N}/`` holds DCP's ``.metadata`` and one
``*.distcp`` file per writing rank, then ``COMPLETE`` (JSON: step, whether it holds model weights
only, the world size that wrote it). ``COMPLETE`` is written last, by rank 0, after every rank's
data and the metadata are on disk: a folder without it is a save that did not finish, which
readers ignore and rank 0 deletes.

What is saved, keyed by name so that any parallel layout can load it (DCP reshards DTensors):
``model`` (parameter FQNs), ``optimizer`` (flattened per FQN), ``lr_scheduler``, ``dataloader``
(one entry per virtual data shard), ``train_state`` (step, tokens seen) and ``rng`` (per rank).

Auto-resume: a job whose folder holds complete checkpoints continues from the newest one with the
full training state (or ``checkpoint.load_step``); one that fails to load is reported and the one
before it is tried. Model-only checkpoints (exports, ``every_save_model_only``) are not resume
points, except a seed checkpoint at step 0, whose weights start the run.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import shutil
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)

from torchtitan.config_manager import JobConfig
from torchtitan.errors import TorchTitanError
from torchtitan.log import logger
from torchtitan.utils import full_tensor

MARKER = "COMPLETE"
STATE_KEYS = ("model", "optimizer", "lr_scheduler", "dataloader", "train_state", "rng")
_EXPORT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class CheckpointError(TorchTitanError):
    """A checkpoint that cannot be used: missing, incomplete, damaged or of another model."""

    exit_code = 1


@dataclass
class TrainState:
    step: int = 0
    ntokens_seen: int = 0

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step, "ntokens_seen": self.ntokens_seen}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.step, self.ntokens_seen = int(state["step"]), int(state["ntokens_seen"])


@dataclass(frozen=True)
class Found:
    """A checkpoint folder and what its marker says (``complete`` False: no marker)."""

    step: int
    path: str
    complete: bool
    model_only: bool = False


def scan(folder: str) -> list[Found]:
    """Every ``step-N`` folder under ``folder``, oldest first."""
    found = []
    if not os.path.isdir(folder):
        return found
    for name in os.listdir(folder):
        path = os.path.join(folder, name)
        if not (name.startswith("step-") and name[5:].isdigit() and os.path.isdir(path)):
            continue
        marker = os.path.join(path, MARKER)
        info: dict[str, Any] = {}
        if os.path.isfile(marker):
            try:
                with open(marker) as f:
                    info = json.load(f)
            except (OSError, ValueError):
                info = {}  # an unreadable marker is no marker
        found.append(Found(int(name[5:]), path, bool(info), bool(info.get("model_only", False))))
    return sorted(found, key=lambda c: c.step)


# ----------------------------------------------------------------------------- state dicts


class ModelState:
    """The model parts (pipeline stages) as one state dict keyed by parameter FQN."""

    def __init__(self, parts: list[nn.Module]) -> None:
        self.parts = parts

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {}
        for part in self.parts:
            state.update(get_model_state_dict(part))
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for part in self.parts:
            own = get_model_state_dict(part).keys()
            set_model_state_dict(part, {k: state[k] for k in own}, options=StateDictOptions())


class RNGState:
    """This rank's torch RNG states (CPU, and CUDA where present), keyed by global rank."""

    def __init__(self, rank: int) -> None:
        self.key = f"rank_{rank}"

    def state_dict(self) -> dict[str, Any]:
        state = {"cpu": torch.get_rng_state()}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            state["cuda"] = torch.cuda.get_rng_state()
        return {self.key: state}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        mine = state.get(self.key)
        if not mine:
            return
        torch.set_rng_state(mine["cpu"])
        if "cuda" in mine and torch.cuda.is_available():
            torch.cuda.set_rng_state(mine["cuda"])


# ----------------------------------------------------------------------------- manager


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
        job_config: JobConfig,
        *,
        model_parts: list[nn.Module],
        optimizers: Any,
        lr_schedulers: Any,
        dataloader: Any,
        train_state: TrainState,
        rank: int,
        world_size: int,
        model_args: Any = None,
        tokenizer: Any = None,
        hf_adapter: Any = None,
        export_tokenizer: Any = None,
        pp_rank: int = 0,
        pp_degree: int = 1,
    ) -> None:
        self.cfg = job_config.checkpoint
        self.enabled = self.cfg.enable
        self.folder = os.path.join(job_config.job.dump_folder, self.cfg.folder)
        self.total_steps = job_config.training.steps
        self.rank, self.world_size = rank, world_size
        self.train_state = train_state
        self.model_parts = model_parts
        self.model_args, self.tokenizer = model_args, tokenizer
        # the family's HFStateDictAdapter class and tokenizer-file writer (from its train spec)
        self.hf_adapter, self.export_tokenizer = hf_adapter, export_tokenizer
        # initial_load_in_hf reads checkpoint.initial_load_path, else the model.hf_assets_path
        # folder: (folder, the key it came from), None if neither is set
        self.hf_load_path = hf_load_source(job_config)
        self.pp_rank, self.pp_degree = pp_rank, pp_degree
        # the rank that writes its pipeline stage's weights in a Hugging Face export: the first
        # rank of each stage (the mesh puts pp outermost)
        self.stage_writer = rank % (world_size // pp_degree) == 0
        self.async_mode = self.cfg.async_mode if self.enabled else "disabled"
        self._pending: _PendingSave | None = None
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
            "model": ModelState(model_parts),
            "optimizer": optimizers,
            "lr_scheduler": lr_schedulers,
            "dataloader": dataloader,
            "train_state": train_state,
            "rng": RNGState(rank),
        }

    # ---- saving

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
            self.export_hf(step)

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

    def save_seed(self) -> str:
        """``step-0`` with the freshly initialized weights (float32): every later run of this
        job, whatever its layout, starts from them."""
        return self.save(0, model_only=True, export=False)

    def save(self, step: int, *, model_only: bool, export: bool = False) -> str:
        """Write ``step-{step}``; with ``async_mode`` the write continues in the background and
        ``COMPLETE`` follows when it has finished (see ``poll``)."""
        self.wait()  # one save in flight at a time
        path = os.path.join(self.folder, f"step-{step}")
        t0 = time.perf_counter()
        if self.rank == 0 and os.path.isdir(path):
            shutil.rmtree(path)  # a save of this step that did not finish (or an older run's)
        _barrier()
        state = self._state(model_only, cast=export)
        what = "model weights" if model_only else "training state"
        if self.async_mode == "disabled":
            dcp.save(state, checkpoint_id=path)
            self._finish(path, step, model_only)
            _barrier()
            logger.info(f"Saved {what} at step {step} to {path} in {time.perf_counter() - t0:.2f}s")
            return path
        self._pending = self._start_async(state, path, step, model_only)
        logger.info(
            f"Saving {what} at step {step} to {path} in the background "
            f"(training resumed after {time.perf_counter() - t0:.2f}s)"
        )
        return path

    def _start_async(self, state: dict, path: str, step: int, model_only: bool) -> _PendingSave:
        writer = dcp.FileSystemWriter(path)
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
        """Mark a finished background save complete (cheap; called every step)."""
        if self._pending is not None and self._pending.upload.done():
            self.wait()

    def wait(self) -> None:
        """Block until the save in flight (if any) is written, then mark it complete."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        try:
            pending.upload.result()
        except BaseException as e:  # noqa: B036 - DCP raises CheckpointException (BaseException)
            logger.error(
                f"Background save to {pending.path} failed ({type(e).__name__}: "
                f"{_first_line(e)}); it stays unmarked and will be removed"
            )
            return
        self._finish(pending.path, pending.step, pending.model_only)
        logger.info(
            f"Saved {'model weights' if pending.model_only else 'training state'} at step "
            f"{pending.step} to {pending.path} (written {time.perf_counter() - pending.t0:.2f}s "
            "after training resumed)"
        )

    def _finish(self, path: str, step: int, model_only: bool) -> None:
        if self.rank != 0:  # rank 0's save returns after every rank's data and the metadata
            return
        try:
            self._mark_complete(path, step, model_only)
            self._purge(keep=path)
        except OSError as e:  # only rank 0 is here: raising would leave the others waiting
            logger.error(
                f"Checkpoint {path} could not be marked complete ({e}); it stays unmarked and "
                "will be removed at the next start"
            )

    def close(self) -> None:
        """End of training: the last background save is finished and marked."""
        self.wait()
        if self._stager is not None:
            self._stager.close()
            self._stager = None

    def _state(self, model_only: bool, cast: bool) -> dict[str, Any]:
        """What a save writes; ``cast``: model weights in ``checkpoint.export_dtype``."""
        keys = ("model",) if model_only else STATE_KEYS
        state = {k: self.objects[k].state_dict() for k in keys}
        if cast and self.cfg.export_dtype != "float32":
            dtype = _EXPORT_DTYPES[self.cfg.export_dtype]
            state["model"] = {k: v.to(dtype) for k, v in state["model"].items()}
        return state

    def _mark_complete(self, path: str, step: int, model_only: bool) -> None:
        info = {"step": step, "model_only": model_only, "world_size": self.world_size}
        tmp = os.path.join(path, f".{MARKER}.tmp")
        with open(tmp, "w") as f:
            json.dump(info, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, os.path.join(path, MARKER))

    def _purge(self, keep: str) -> None:
        """Keep the newest ``keep_latest_k`` complete checkpoints of each kind (resumable, and
        model weights only), and always ``keep``, the one just written (0: keep all)."""
        k = self.cfg.keep_latest_k
        if k <= 0:
            return
        complete = [c for c in scan(self.folder) if c.complete]
        for model_only in (False, True):
            same_kind = [c for c in complete if c.model_only == model_only]
            for old in same_kind[:-k]:
                if os.path.abspath(old.path) == os.path.abspath(keep):
                    continue
                shutil.rmtree(old.path, ignore_errors=True)
                kind = "model-only" if model_only else "resumable"
                logger.info(f"Removed checkpoint {old.path} (keeping the newest {k} {kind} ones)")

    def newest_complete(self) -> str | None:
        """The newest complete checkpoint in the folder (None if none or disabled)."""
        complete = [c for c in scan(self.folder) if c.complete] if self.enabled else []
        return complete[-1].path if complete else None

    # ---- loading

    def load(self) -> bool:
        """Resume from the folder (or ``initial_load_path``); True if a checkpoint was loaded."""
        if not self.enabled:
            return False
        found = scan(self.folder)
        if self.rank == 0:
            for c in found:
                if not c.complete:
                    logger.warning(f"Removing incomplete checkpoint {c.path} (no {MARKER} marker)")
                    shutil.rmtree(c.path, ignore_errors=True)
        _barrier()
        complete = [c for c in found if c.complete]
        if self.cfg.load_step != -1:
            candidates = [self._requested(complete)]
        else:
            candidates = [c for c in complete if not c.model_only or c.step == 0]
            for skipped in [c for c in complete if c not in candidates]:
                logger.info(
                    f"Checkpoint {skipped.path} holds model weights only: not a resume point"
                )
        loaded, failed = self._load_newest(candidates)
        self._set_aside_newer(complete, loaded.step if loaded else 0, failed)
        if loaded is not None:
            return True
        if self.cfg.initial_load_in_hf and self.hf_load_path is not None:
            self._load_hf(*self.hf_load_path)
            return True
        if self.cfg.initial_load_path:
            path = self.cfg.initial_load_path
            if not os.path.isfile(os.path.join(path, ".metadata")):
                raise CheckpointError(
                    f"checkpoint.initial_load_path: '{path}' is not a DCP checkpoint folder (no "
                    "'.metadata' in it); give a step-N folder written by this library"
                )
            self._load(path, self.cfg.initial_load_model_only, step=None)
            return True
        return False

    def _requested(self, complete: list[Found]) -> Found:
        step = self.cfg.load_step
        match = [c for c in complete if c.step == step]
        if not match:
            have = ", ".join(str(c.step) for c in complete) or "none"
            raise CheckpointError(
                f"checkpoint.load_step: no complete checkpoint for step {step} in {self.folder} "
                f"(complete steps: {have})"
            )
        return match[0]

    def _load_newest(self, candidates: list[Found]) -> tuple[Found | None, list[Found]]:
        """Load the newest candidate that loads, falling back past damaged ones; returns it (None
        when there are no candidates) and the ones that failed. Every rank takes the same path:
        ``_load`` fails on all ranks or on none."""
        failed: list[Found] = []
        for c in reversed(candidates):
            try:
                self._load(c.path, model_only=c.model_only, step=c.step)
            except CheckpointError as e:
                failed.append(c)
                if c is candidates[0]:
                    raise
                logger.warning(f"{e}; falling back to the checkpoint before it")
                continue
            if failed and c.model_only:
                # the failed load may have written part of the optimizer state in place; this
                # start from weights only must begin with none, like a fresh run
                self.objects["optimizer"].reset_state()
            return c, failed
        return None, failed

    def _set_aside_newer(self, complete: list[Found], start: int, failed: list[Found]) -> None:
        """This run continues from step ``start``; complete checkpoints of later steps belong to
        another history (a ``load_step`` resume, a fall-back past a damaged one, a fresh start over
        old model-only saves). They are renamed, never deleted, so that the next auto-resume and
        retention only ever see this run's own history."""
        if self.rank == 0:
            for c in (c for c in complete if c.step > start):
                suffix = "unloadable" if c in failed else "superseded"
                dest = f"{c.path}.{suffix}"
                if os.path.exists(dest):
                    dest = f"{dest}-{time.strftime('%Y%m%d-%H%M%S')}"
                os.replace(c.path, dest)
                logger.warning(
                    f"Moved {c.path} to {dest}: this run continues from step {start}, so later "
                    "checkpoints in the folder are no longer part of its history"
                )
        _barrier()

    def _load(self, path: str, model_only: bool, step: int | None) -> None:
        keys = ("model",) if model_only else STATE_KEYS
        keys = tuple(k for k in keys if k not in self.cfg.exclude_from_loading)
        state = {k: self.objects[k].state_dict() for k in keys}
        error = None
        try:
            available = _checkpoint_keys(path)
            rng_prefix = f"rng.{self.objects['rng'].key}."
            if "rng" in state and not any(k.startswith(rng_prefix) for k in available):
                logger.info(f"{path}: no RNG state for this rank (saved by another world size)")
                del state["rng"]
            _check_model_keys(path, state.get("model", {}), available)
            if step is not None and self.model_args is not None:  # this job's own history
                _check_block_count(path, self.model_args.n_layers, available)
        except CheckpointError as e:  # e.g. a pipeline stage whose layers the checkpoint lacks
            error = str(e)
        _agree(error)  # every rank loads, or every rank raises the same error
        t0 = time.perf_counter()
        try:
            dcp.load(
                state,
                storage_reader=SafeFileSystemReader(path),
                planner=SafeLoadPlanner(),
            )
        except (Exception, CheckpointException) as e:  # DCP gathers every rank's read error
            raise CheckpointError(
                f"checkpoint {path} cannot be loaded ({type(e).__name__}: {_first_line(e)})"
            ) from e
        for k, v in state.items():
            self.objects[k].load_state_dict(v)
        if model_only:
            self.train_state.load_state_dict({"step": 0, "ntokens_seen": 0})
        logger.info(
            f"Loaded {'model weights' if model_only else 'training state'} from {path}"
            + (f" (step {self.train_state.step})" if not model_only else "")
            + f" in {time.perf_counter() - t0:.2f}s"
        )

    # ---- Hugging Face

    def _load_hf(self, path: str, key: str = "checkpoint.initial_load_path") -> None:
        """Start from Hugging Face weights: every rank reads the files and keeps its shards.
        ``key``: the setting that named ``path``, for errors."""
        from torchtitan.checkpoint.hf_files import read_folder

        t0 = time.perf_counter()
        expected = {}
        for part in self.model_parts:
            expected.update({k: v.shape for k, v in get_model_state_dict(part).items()})
        try:
            state = self._adapter(key).from_hf(read_folder(path), expected)
        except TorchTitanError as e:
            raise CheckpointError(f"{key}: {e}") from e
        for part in self.model_parts:
            own = {k: state[k] for k in get_model_state_dict(part)}
            set_model_state_dict(part, own, options=StateDictOptions(full_state_dict=True))
        self.train_state.load_state_dict({"step": 0, "ntokens_seen": 0})
        logger.info(f"Loaded Hugging Face weights from {path} in {time.perf_counter() - t0:.2f}s")

    def _adapter(self, key: str) -> Any:
        if self.hf_adapter is None:
            raise CheckpointError(
                f"{key}: this model family has no Hugging Face state-dict adapter in its train spec"
            )
        return self.hf_adapter(self.model_args)

    def export_hf(self, step: int) -> str | None:
        """``step-{step}-hf``: config.json, safetensors and tokenizer files that ``transformers``
        loads (``AutoModelForCausalLM``, ``AutoTokenizer``). Parameters
        are gathered one at a time onto the CPU of each stage's first rank; with pipeline
        parallelism every stage writes its own file and rank 0 the index."""
        from torchtitan.checkpoint.hf_files import INDEX, write_folder

        adapter = self._adapter("checkpoint.last_save_in_hf")

        final = os.path.join(self.folder, f"step-{step}-hf")
        tmp = final + ".partial"
        t0 = time.perf_counter()
        dtype = _EXPORT_DTYPES[self.cfg.export_dtype]
        state: dict[str, torch.Tensor] = {}
        for part in self.model_parts:
            for name, value in get_model_state_dict(part).items():
                full = full_tensor(
                    value
                )  # a collective over the part's mesh, same order everywhere
                if self.stage_writer:
                    state[name] = full.detach().to("cpu", dtype)
        hf_state = adapter.to_hf(state) if self.stage_writer else {}
        tok = self.tokenizer
        config = adapter.hf_config(
            dtype=dtype,
            bos_id=getattr(tok, "bos_id", None),
            eos_id=getattr(tok, "eos_id", None),
        )
        # Writing can fail on one rank only (a full disk): each step ends in _agree, so every
        # rank stops with the same error instead of the others waiting at a barrier.
        _agree(_attempt(lambda: self.rank == 0 and os.path.isdir(tmp) and shutil.rmtree(tmp)))

        def write() -> None:
            if self.rank == 0 and tok is not None and self.export_tokenizer is not None:
                self.export_tokenizer(tmp, tok, self.model_args.max_seq_len)
            if self.pp_degree == 1 and self.rank == 0:
                write_folder(tmp, hf_state, config)
            elif self.pp_degree > 1 and self.stage_writer:
                from safetensors.torch import save_file

                os.makedirs(tmp, exist_ok=True)
                save_file(hf_state, os.path.join(tmp, stage_file), metadata={"format": "pt"})

        stage_file = f"model-{self.pp_rank + 1:05d}-of-{self.pp_degree:05d}.safetensors"
        _agree(_attempt(write))
        if self.pp_degree > 1:
            keys: list[Any] = [None] * self.world_size
            mine = {k: stage_file for k in hf_state} if self.stage_writer else {}
            dist.all_gather_object(keys, mine)
            weight_map = {k: v for d in keys for k, v in d.items()}

            def write_index() -> None:
                if self.rank == 0:
                    with open(os.path.join(tmp, INDEX), "w") as f:
                        json.dump({"metadata": {}, "weight_map": weight_map}, f, indent=2)
                    with open(os.path.join(tmp, "config.json"), "w") as f:
                        json.dump(config, f, indent=2)

            _agree(_attempt(write_index))

        def publish() -> None:  # the export appears whole or not at all
            if self.rank == 0:
                if os.path.isdir(final):
                    shutil.rmtree(final)
                os.replace(tmp, final)

        _agree(_attempt(publish))
        logger.info(f"Exported Hugging Face weights to {final} in {time.perf_counter() - t0:.2f}s")
        return final


def hf_load_source(job_config: JobConfig) -> tuple[str, str] | None:
    """``(folder, key)`` that ``checkpoint.initial_load_in_hf`` reads its weights from:
    ``checkpoint.initial_load_path`` when set, else ``model.hf_assets_path`` (a Hugging Face
    model folder), else None."""
    if job_config.checkpoint.initial_load_path:
        return job_config.checkpoint.initial_load_path, "checkpoint.initial_load_path"
    hf_assets_path = getattr(job_config.model, "hf_assets_path", None)
    if hf_assets_path:
        return hf_assets_path, "model.hf_assets_path"
    return None


def read_model_weights(path: str, progress: Any = None) -> dict[str, torch.Tensor]:
    """The model weights of a DCP checkpoint folder, whole, on this one process's CPU (for the
    conversion and generation scripts). ``progress(done, total)`` is called per layer read."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    try:
        metadata = SafeFileSystemReader(path).read_metadata()
    except Exception as e:
        raise CheckpointError(
            f"checkpoint {path} has no readable DCP metadata ({type(e).__name__}: {_first_line(e)})"
        ) from e
    shapes = {
        key.removeprefix("model."): md
        for key, md in metadata.state_dict_metadata.items()
        if key.startswith("model.") and isinstance(md, TensorStorageMetadata)
    }
    if not shapes:
        raise CheckpointError(f"checkpoint {path} holds no model weights")
    groups: dict[str, list[str]] = {}
    for name in shapes:  # read layer by layer: bounded extra memory, and progress to report
        groups.setdefault(
            ".".join(name.split(".")[:2]) if name.startswith("layers.") else "", []
        ).append(name)
    state: dict[str, torch.Tensor] = {}
    for i, names in enumerate(groups.values()):
        part = {n: torch.empty(shapes[n].size, dtype=shapes[n].properties.dtype) for n in names}
        dcp.load(
            {"model": part},
            storage_reader=SafeFileSystemReader(path),
            planner=SafeLoadPlanner(),
            no_dist=True,
        )
        state.update(part)
        if progress is not None:
            progress(i + 1, len(groups))
    return state


def _checkpoint_keys(path: str) -> set[str]:
    """The flattened keys a DCP checkpoint holds (``model.layers.0...``); CheckpointError if its
    metadata is missing or unreadable."""
    try:
        metadata = SafeFileSystemReader(path).read_metadata()
    except Exception as e:
        raise CheckpointError(
            f"checkpoint {path} has no readable DCP metadata ({type(e).__name__}: {_first_line(e)})"
        ) from e
    return set(metadata.state_dict_metadata)


def _check_model_keys(path: str, model_state: dict[str, Any], available: set[str]) -> None:
    """A checkpoint of another model gives one error that lists what does not match."""
    if not model_state:
        return
    missing = sorted(k for k in model_state if f"model.{k}" not in available)
    if missing:
        shown = ", ".join(missing[:5]) + (
            f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        )
        raise CheckpointError(
            f"checkpoint {path} lacks {len(missing)} parameters of this model ({shown}); "
            "is it a checkpoint of another model or flavor?"
        )


def _check_block_count(path: str, n_layers: int, available: set[str]) -> None:
    """A resume must not quietly drop blocks: a checkpoint of more blocks than the model (e.g.
    ``model.n_layers`` lowered between runs) would otherwise load a prefix of them, since no
    parameter of the model is missing. (Fewer blocks: the rank holding the missing ones fails
    ``_check_model_keys``.)"""
    blocks = {int(k.split(".")[2]) for k in available if k.startswith("model.layers.")}
    if blocks and max(blocks) >= n_layers:
        raise CheckpointError(
            f"checkpoint {path} holds {max(blocks) + 1} transformer blocks and this model has "
            f"{n_layers}: resume with the model.flavor and model.n_layers it was saved with"
        )


# ----------------------------------------------------------------------------- safe reading
# A checkpoint may come from elsewhere (initial_load_path): nothing in it is unpickled with the
# full pickle machinery. Objects go through torch.load(weights_only=True); DCP's metadata, a
# plain pickle, through an unpickler that only builds DCP's metadata classes and plain values.

_METADATA_GLOBALS = {
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "Path"),
    ("pathlib", "PosixPath"),
    ("pathlib", "WindowsPath"),
    ("collections", "OrderedDict"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    *(
        ("torch.distributed.checkpoint.metadata", name)
        for name in (
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "Metadata",
            "MetadataIndex",
            "StorageMeta",
            "TensorProperties",
            "TensorStorageMetadata",
            "_MEM_FORMAT_ENCODING",
        )
    ),
}


def _enum_member(cls: Any, name: str) -> Any:
    """What some Python versions pickle an enum member as: ``getattr(EnumClass, name)``; only
    members of the allowed enum classes are handed out."""
    import enum

    if isinstance(cls, type) and issubclass(cls, enum.Enum) and name in cls.__members__:
        if (cls.__module__, cls.__qualname__) in _METADATA_GLOBALS:
            return cls.__members__[name]
    raise pickle.UnpicklingError(
        f"getattr({cls!r}, {name!r}) is not allowed in checkpoint metadata"
    )


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("builtins", "getattr"):
            return _enum_member
        if (module, name) in _METADATA_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(
            getattr(torch, name, None), (torch.dtype, torch.layout, torch.memory_format)
        ):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in checkpoint metadata")


class SafeFileSystemReader(dcp.FileSystemReader):
    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        with open(os.path.join(self.path, ".metadata"), "rb") as f:
            metadata = _MetadataUnpickler(f).load()
        if getattr(metadata, "storage_meta", None) is None:
            from torch.distributed.checkpoint.metadata import StorageMeta

            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0][:300] if text else ""


def _collective_device() -> torch.device:
    """Where a tensor for the default group's collectives lives (NCCL: this rank's GPU)."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _attempt(fn: Any) -> str | None:
    """Run ``fn``; the one-line description of the OSError it raised, else None."""
    try:
        fn()
    except OSError as e:
        return f"Hugging Face export failed: {e}"
    return None


def _agree(error: str | None) -> None:
    """A collective in place of a barrier: if any rank found ``error``, every rank raises it
    (the first rank's), so that no rank goes on alone to a collective the others never reach."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        errors: list[str | None] = [None] * dist.get_world_size()
        dist.all_gather_object(errors, error)
        error = next((e for e in errors if e), None)
    if error:
        raise CheckpointError(error)
