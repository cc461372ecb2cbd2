"""The checks of a parsed config that need no process group, model or data (bounds, choices,
keys that need each other, input files, the batch arithmetic), every problem at once with where
each key was set in front; and the warnings for settings that are valid but probably not meant."""

from __future__ import annotations

import importlib.util
import os

from torchtitan.config.schema import JobConfig, all_keys, keys, owner, sections
from torchtitan.errors import ConfigError, ConfigErrors, Problems


def locate(cfg: JobConfig, line: str) -> str:
    """Put where a key was set in front of a problem line that starts with ``section.key:``:
    ``FILE: key`` (its old name too, when an alias set it) or ``command line: --key``."""
    key, sep, rest = line.partition(": ")
    setting = cfg.origins.get(key) if sep else None
    if setting is None:
        if sep and key in all_keys(type(cfg)):
            return f"{key} (default): {rest}"
        return line
    if setting.written != key:
        return f"{setting.where()} (now {key}): {rest}"
    return f"{setting.where()}: {rest}"


def located(cfg: JobConfig, e: ConfigError) -> ConfigError:
    """``e`` with every line passed through :func:`locate`."""
    lines = [locate(cfg, line) for line in str(e).splitlines()]
    return ConfigErrors(lines) if len(lines) > 1 else ConfigError(lines[0])


# ----------------------------------------------------------------------------- validation


def _check_bounds(cfg: JobConfig, problems: Problems) -> None:
    for section, cls in sections(type(cfg)).items():
        for key, (f, _) in keys(cls).items():
            value = getattr(*owner(cfg, f"{section}.{key}"))
            meta, name = f.metadata, f"{section}.{key}"
            if value is None:
                continue
            with problems.collect():
                for item in value if isinstance(value, list) else [value]:
                    if meta.get("choices") and item not in meta["choices"]:
                        valid = ", ".join(str(c) for c in meta["choices"])
                        raise ConfigError(f"{name}: {item!r} is not one of: {valid}")
                if meta.get("ge") is not None and value < meta["ge"]:
                    raise ConfigError(f"{name}: {value} must be >= {meta['ge']}")
                if meta.get("gt") is not None and value <= meta["gt"]:
                    raise ConfigError(f"{name}: {value} must be > {meta['gt']}")
                if meta.get("le") is not None and value > meta["le"]:
                    raise ConfigError(f"{name}: {value} must be <= {meta['le']}")


def check_values(cfg: JobConfig, *, need_files: bool = True) -> None:
    """Checks that need no process group, model or data: every problem, one line each, where
    each key was set in front (ConfigError / ConfigErrors)."""
    problems = Problems()
    _check_bounds(cfg, problems)
    for check in _CHECKS:
        with problems.collect():
            check(cfg)
    if need_files:
        with problems.collect():
            _check_files(cfg)
    if problems.lines:
        raise located(cfg, ConfigErrors(problems.lines))


def config_warnings(cfg: JobConfig) -> list[str]:
    """Settings that are valid but probably not meant, one line each, where each key was set in
    front: a warm-up that outlasts training (the learning rate never reaches optimizer.lr, and
    the schedule's stable and decay phases never come)."""
    t, lr = cfg.training, cfg.lr_scheduler
    if t.steps < 1 or lr.warmup_steps < 1 or (lr.total_steps or 1) < 1:
        return []  # invalid values are reported as errors
    warmup = min(lr.warmup_steps, lr.total_steps or t.steps)  # as lr_scheduling.lr_factor
    if warmup < t.steps:
        return []
    last = t.steps / (warmup + 1)
    return [
        locate(
            cfg,
            f"lr_scheduler.warmup_steps: {lr.warmup_steps} warm-up steps, but training.steps is "
            f"{t.steps}: the whole run is warm-up, the learning rate rising to {last:.0%} of "
            "optimizer.lr at the last step, never reaching it or decaying; make warmup_steps "
            "smaller than training.steps",
        )
    ]


def _check_wandb(cfg: JobConfig) -> None:
    if cfg.metrics.enable_wandb and importlib.util.find_spec("wandb") is None:
        raise ConfigError(
            "metrics.enable_wandb: the wandb package is not installed; pip install wandb, or "
            "leave it false"
        )


def _check_profiling(cfg: JobConfig) -> None:
    pr = cfg.profiling
    if pr.enable_profiling and pr.profiler_warmup + pr.profiler_active > pr.profile_freq:
        raise ConfigError(
            f"profiling.profiler_warmup: profiler_warmup + profiler_active ({pr.profiler_warmup} "
            f"+ {pr.profiler_active}) must be <= profiling.profile_freq ({pr.profile_freq})"
        )


def _check_checkpoint(cfg: JobConfig) -> None:
    ck, problems = cfg.checkpoint, Problems()
    if ck.initial_load_in_hf and not (ck.initial_load_path or cfg.model.hf_assets_path):
        problems.add(
            "checkpoint.initial_load_in_hf: needs checkpoint.initial_load_path or "
            "model.hf_assets_path (a Hugging Face model folder with config.json and *.safetensors)"
        )
    if ck.initial_load_in_hf and "://" in (ck.initial_load_path or ""):
        problems.add(
            f"checkpoint.initial_load_path: '{ck.initial_load_path}' is a URL, and a Hugging Face "
            "folder is read from a local disk; download it first (a DCP checkpoint may be a URL)"
        )
    if ck.initial_load_in_hf and not ck.initial_load_model_only:
        problems.add(
            "checkpoint.initial_load_model_only: must be true with initial_load_in_hf (Hugging "
            "Face folders hold model weights only)"
        )
    for key in ("initial_load_path", "last_save_in_hf"):
        if getattr(ck, key) and not ck.enable:
            problems.add(f"checkpoint.{key}: needs checkpoint.enable = true")
    if ck.create_seed_checkpoint and not ck.enable:
        problems.add(
            "checkpoint.create_seed_checkpoint: needs checkpoint.enable = true (the seed is "
            "written to the checkpoint folder)"
        )
    problems.raise_if_any()


def _check_lora(cfg: JobConfig) -> None:
    lo, ck = cfg.lora, cfg.checkpoint
    if not lo.enable:
        return
    problems = Problems()
    if not ck.enable:
        problems.add(
            "lora.enable: needs checkpoint.enable = true (the base model loads through the "
            "checkpointer, and a resume loads it again under the saved adapters)"
        )
        problems.raise_if_any()  # the base model's keys need it first
    if not (ck.initial_load_path or (ck.initial_load_in_hf and cfg.model.hf_assets_path)):
        problems.add(
            "lora.enable: needs a base model to adapt: checkpoint.initial_load_path (a DCP "
            "checkpoint, or a Hugging Face folder with checkpoint.initial_load_in_hf), or "
            "model.hf_assets_path with checkpoint.initial_load_in_hf"
        )
    if "float8" in cfg.model.converters:
        problems.add("lora.enable: not with model.converters = ['float8'] (adapt bf16/fp32 layers)")
    if ck.create_seed_checkpoint:
        problems.add("lora.enable: a seed checkpoint of a LoRA run would hold only the adapters")
    if not lo.target_modules or not all(isinstance(p, str) and p for p in lo.target_modules):
        problems.add(
            f"lora.target_modules: {lo.target_modules!r} must be a non-empty list of globs over "
            "linear layer names (wqkv, layers.*.feed_forward.w2)"
        )
    problems.raise_if_any()


def global_batch(local_batch_size: int, global_batch_size: int, dp: int = 1) -> tuple[int, int]:
    """``(global batch, gradient accumulation steps)`` of ``local_batch_size`` sequences per
    rank on ``dp`` data-parallel ranks; ``global_batch_size`` -1 means one local batch per rank.
    The one place the batch arithmetic is checked (config, job plan and data loader call it)."""
    per_step = local_batch_size * dp
    total = per_step if global_batch_size == -1 else global_batch_size
    if total < 1:
        raise ConfigError(
            f"training.global_batch_size: {global_batch_size} must be -1 (derived) or >= 1"
        )
    if total % per_step:
        times = (
            "" if dp == 1 else f" x data-parallel degree = {local_batch_size} x {dp} = {per_step}"
        )
        raise ConfigError(
            f"training.global_batch_size: {total} must be a multiple of "
            f"training.local_batch_size{times or f' ({local_batch_size})'}"
        )
    return total, total // per_step


def _check_batch(cfg: JobConfig) -> None:
    t = cfg.training
    if t.local_batch_size >= 1:  # else reported by the bounds check
        global_batch(t.local_batch_size, t.global_batch_size)


def _check_debug(cfg: JobConfig) -> None:
    if cfg.debug.deterministic and cfg.debug.seed is None:
        raise ConfigError("debug.deterministic: needs debug.seed to be set (e.g. --debug.seed 42)")


def _check_files(cfg: JobConfig) -> None:
    m, problems = cfg.model, Problems()
    if m.hf_assets_path and not os.path.isdir(m.hf_assets_path):
        problems.add(
            f"model.hf_assets_path: '{m.hf_assets_path}' is not a folder; give a Hugging Face "
            "model folder (see scripts/download_hf_assets.py)"
        )
    path, key = m.tokenizer_source()
    if key == "model.tokenizer_path" and not os.path.exists(path):
        problems.add(
            f"model.tokenizer_path: '{path}' does not exist; give a tokenizer file (tiktoken, "
            "SentencePiece or tokenizer.json) or a Hugging Face model folder (see "
            "scripts/download_hf_assets.py)"
        )
    template = cfg.training.chat_template
    if template and not os.path.exists(template):
        problems.add(
            f"training.chat_template: '{template}' does not exist; give a .jinja file, a "
            "tokenizer_config.json or a folder holding one"
        )
    problems.raise_if_any()


def _check_fault_tolerance(cfg: JobConfig) -> None:
    ft, problems = cfg.fault_tolerance, Problems()
    if not ft.enable:
        if ft.semi_sync_method is not None:
            raise ConfigError(
                f"fault_tolerance.semi_sync_method: {ft.semi_sync_method} is how replica groups "
                "train together; set fault_tolerance.enable (and group_size) too, or unset it"
            )
        return
    if ft.group_size < 1:
        problems.add(
            "fault_tolerance.group_size: how many replica groups train together must be set "
            "(>= 1) with fault_tolerance.enable"
        )
    elif ft.replica_id >= ft.group_size:
        problems.add(
            f"fault_tolerance.replica_id: {ft.replica_id} is not a group of group_size "
            f"{ft.group_size}; valid: 0 .. {ft.group_size - 1}"
        )
    if ft.group_size >= 1 and ft.min_replica_size > ft.group_size:
        problems.add(
            f"fault_tolerance.min_replica_size: {ft.min_replica_size} groups can never meet in "
            f"a job of group_size {ft.group_size}; give 1 .. {ft.group_size}"
        )
    if cfg.parallelism.data_parallel_replicate_degree not in (1, -1):
        problems.add(
            "parallelism.data_parallel_replicate_degree: the replica groups are the replicate "
            "dimension with fault_tolerance.enable; use 1 (and data_parallel_shard_degree "
            "inside each group)"
        )
    # what each group would decide alone, where the groups must act as one at every step
    # (semi-synchronous groups take their inner steps alone anyway)
    if ft.semi_sync_method is None and cfg.optimizer.early_step_in_backward:
        problems.add(
            "optimizer.early_step_in_backward: updates each parameter in the backward, before "
            "the groups average the gradients and commit the step; set it false with "
            "fault_tolerance.enable (or use fault_tolerance.semi_sync_method)"
        )
    if ft.semi_sync_method is None and cfg.resilience.loss_spike_zscore > 0:
        problems.add(
            "resilience.loss_spike_zscore: each replica group would judge its own loss and skip "
            "updates the others make; set loss_spike_zscore = 0 with fault_tolerance.enable "
            "(or train the groups semi-synchronously: fault_tolerance.semi_sync_method)"
        )
    problems.raise_if_any()


_CHECKS = (
    _check_wandb,
    _check_profiling,
    _check_checkpoint,
    _check_lora,
    _check_fault_tolerance,
    _check_batch,
    _check_debug,
)
