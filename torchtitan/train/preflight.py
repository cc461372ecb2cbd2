"""The launcher's check before torchrun: the job plan (:func:`~torchtitan.train.plan.plan_job`)
plus the tokenizer against the flavor, every problem at once.

``python -m torchtitan.preflight --world-size N [train.py arguments]`` exits 0 when the job can
start on N processes, or prints one ``error: ...`` line and exits 2, so that a bad config is
reported once, before torchrun starts any worker (and without torchrun's failure report).

A CUDA job (this machine's devices, or ``--device-type cuda``) is also checked against its
devices' memory (:mod:`torchtitan.train.memory_fit`): ``--gpu-type KEY`` (the table of
``torchtitan/devices.py``) or ``--device-memory-gib X`` give the memory when planning from a
machine without the GPU; without either, this machine's smallest GPU, or the largest GPU
listed. A job whose parameters, gradients and optimizer state alone exceed it is refused; else
one training step is traced on fake tensors (:mod:`torchtitan.train.memory_estimate`, the fast
trace: seconds) and its peak per device is stated against the memory, or refused when over it,
with the layout planner's command (``python -m torchtitan.plan``). ``--memory-check floor`` stops
after the floor (no trace), ``--memory-check off`` skips both (for a job the prediction refuses
but that is known to fit; the launcher's ``MEMORY_CHECK``).
"""

from __future__ import annotations

import copy
import dataclasses
import math
import os
import sys
from dataclasses import dataclass

import torch

from torchtitan.config.checks import located
from torchtitan.config.parse import parse_args
from torchtitan.config.schema import JobConfig
from torchtitan.data.tokenizer import build_tokenizer
from torchtitan.devices import device_by_key
from torchtitan.distributed import utils as dist_utils
from torchtitan.errors import ConfigError, ConfigErrors, Problems, TorchTitanError, error_lines
from torchtitan.models.spec import get_model_spec
from torchtitan.optim.param_groups import parse_rules
from torchtitan.train.memory_estimate import TRACE_FAILURES, estimate_job
from torchtitan.train.memory_fit import (
    RESERVE_GIB,
    DeviceMemory,
    checked_memory_gib,
    device_memory,
    largest_device,
    state_floor_gib,
    verdict,
)
from torchtitan.train.plan import check_vocab, plan_job, resolve_model_args


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(argv)
    except KeyboardInterrupt:  # Ctrl-C while the launcher checks: stop quietly, as a shell does
        return 130


def _main(argv: list[str] | None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        world_size, device, memory_check, argv = _own_options(argv)
    except ConfigError as e:
        print("\n".join(error_lines(e)), file=sys.stderr)
        return e.exit_code
    if "-h" in argv or "--help" in argv:
        return 0  # train.py prints the help itself
    problems = Problems()
    try:
        job_config = parse_args(argv, problems=problems)
        for line in job_config.warnings:
            print(f"warning: {line}", file=sys.stderr)
        vocab = None
        with problems.collect():
            vocab = _check_job(job_config, world_size, device.type)
        problems.raise_if_any()
        if (device.type or dist_utils.device_type) == "cuda" and memory_check != "off":
            _check_memory(job_config, world_size, device, vocab, memory_check == "trace")
    except TorchTitanError as e:
        print("\n".join(error_lines(e)), file=sys.stderr)
        return e.exit_code
    except Exception:
        if not problems.lines:
            raise
        # a check tripped over a value already reported as invalid: report those
        print("\n".join(error_lines(ConfigErrors(problems.lines))), file=sys.stderr)
        return ConfigError.exit_code
    return 0


def _check_job(job_config: JobConfig, world_size: int, device_type: str | None) -> int | None:
    """The plan's checks, then the tokenizer against the flavor: every problem of both. The
    tokenizer's size, when it was read."""
    problems = Problems()
    with problems.collect():
        plan_job(job_config, world_size, device_type)
    with problems.collect():
        parse_rules(job_config.optimizer.param_groups)
    try:  # the family and flavor resolve (else plan_job has reported why)
        get_model_spec(job_config.model.name)
        model_args = resolve_model_args(job_config)
    except ConfigError:
        problems.raise_if_any()
        raise
    vocab = None
    with problems.collect():
        path, key = job_config.model.tokenizer_source()
        try:
            if os.path.exists(path):  # a missing one is reported by the config's file checks
                vocab = build_tokenizer(path, key=key).n_words
                check_vocab(job_config, model_args, vocab)
        except ConfigError as e:
            raise located(job_config, e) from None
    problems.raise_if_any()
    return vocab


def _check_memory(
    job_config: JobConfig, world_size: int, device: _Device, vocab: int | None, trace: bool
) -> None:
    """The floor of the job's memory per device (parameters, gradients, optimizer state)
    against its devices': refused, in one line, when over; then (``trace``) the traced step's
    peak."""
    memory = device_memory("cuda", device.gpu_type, device.memory_gib)
    guessed = memory is None
    memory = memory or largest_device()
    model = _meta_model(job_config, vocab)
    if job_config.lora.enable:  # only the adapters train: the base weights alone are certain
        model.requires_grad_(False)
    seed = job_config.checkpoint.create_seed_checkpoint  # weights only, written and done
    floor = state_floor_gib(job_config, model, world_size, weights_only=seed)
    fits, line = verdict(floor, memory, "parameters, gradients and optimizer state take at least")
    if fits:
        if trace and not seed:  # a seed checkpoint's job never steps: its weights are all it holds
            _check_traced_peak(job_config, world_size, memory, vocab, device)
        return
    usable = memory.gib - RESERVE_GIB
    hints = [f"it needs at least {math.ceil(floor * world_size / usable)} such devices"]
    trains = any(p.requires_grad for p in model.parameters())
    if not seed and trains and job_config.optimizer.state_dtype == "float32":
        bf16 = dataclasses.replace(job_config.optimizer, state_dtype="bfloat16")
        lighter = state_floor_gib(dataclasses.replace(job_config, optimizer=bf16), model, 1)
        hints.append(f"{math.ceil(lighter / usable)} with optimizer.state_dtype = bfloat16")
    if guessed:
        hints.append("give --gpu-type KEY or --device-memory-gib for yours")
    n = sum(p.numel() for p in model.parameters())
    raise ConfigError(
        f"{job_config.model.name} {job_config.model.flavor} ({n:,} parameters) on {world_size} "
        f"device(s) {line} (no layout holds less: they are spread evenly over every device); "
        f"{', '.join(hints)}; {_planner_command(job_config, device, 'N')} lists the layouts that "
        "fit"
    )


def _check_traced_peak(
    job_config: JobConfig, world_size: int, memory: DeviceMemory, vocab: int | None, device
) -> None:
    """The whole step's peak per device (the memory estimate's fast trace, seconds) against the
    device's memory: stated in one line when it fits, refused in one line when not. A job the
    trace cannot follow is let through with a line saying so (the floor has passed)."""
    try:
        estimate = estimate_job(copy.deepcopy(job_config), world_size, "cuda", True, vocab)
    except TRACE_FAILURES as e:
        why = (str(e).splitlines() or [""])[0][:160]
        print(f"preflight: no memory estimate for this job ({type(e).__name__}: {why})")
        return
    fits, line = verdict(estimate["peak_gib"], memory, "the traced peak of a training step is")
    if fits:
        print(f"preflight: {line}")
        return
    m = job_config.model
    raise ConfigError(
        f"{m.name} {m.flavor} on {world_size} device(s), {estimate['layout']}, "
        f"{line}; {_planner_command(job_config, device, str(world_size))} lists the layouts "
        "that fit (scripts/estimate_memory.py shows this one's breakdown; MEMORY_CHECK=floor "
        "./run_llama_train.sh, or preflight's --memory-check floor, skips this prediction)"
    )


def _planner_command(job_config: JobConfig, device, gpus: str) -> str:
    """The layout planner's command line for this job and its devices."""
    if device.gpu_type:
        target = f"--gpu-type {device.gpu_type}"
    elif device.memory_gib is not None:
        target = f"--gpu-type KEY --device-memory-gib {device.memory_gib:g}"
    else:
        target = "--gpu-type KEY"
    source = job_config.job.config_file or "F"
    return f"python -m torchtitan.plan --gpus {gpus} {target} --job.config_file {source}"


def _meta_model(job_config: JobConfig, vocab: int | None) -> torch.nn.Module:
    """The model on the meta device, its embedding sized as train.py sizes it (``vocab``: the
    tokenizer's size, read by the checks)."""
    model_args = resolve_model_args(job_config)
    if vocab is not None and (
        model_args.vocab_size <= 0 or job_config.model.vocab_size_from_tokenizer
    ):
        model_args = dataclasses.replace(model_args, vocab_size=vocab)
    with torch.device("meta"):
        return get_model_spec(job_config.model.name).cls(model_args)


@dataclass
class _Device:
    type: str | None = None  # --device-type; None: this machine's
    gpu_type: str | None = None  # --gpu-type
    memory_gib: float | None = None  # --device-memory-gib


MEMORY_CHECKS = ("trace", "floor", "off")


def _own_options(argv: list[str]) -> tuple[int, _Device, str, list[str]]:
    """``--world-size N``, ``--device-type cuda|cpu``, ``--gpu-type KEY``,
    ``--device-memory-gib X`` and ``--memory-check trace|floor|off``, anywhere among the train.py
    arguments (whose keys all have a dot)."""
    world_size, device, memory_check, rest = 1, _Device(), "trace", []
    own = ("--world-size", "--device-type", "--gpu-type", "--device-memory-gib", "--memory-check")
    while argv:
        if argv[0] not in own:
            rest.append(argv.pop(0))
            continue
        if len(argv) < 2:
            raise ConfigError(f"{argv[0]}: needs a value")
        name, value, argv = argv[0], argv[1], argv[2:]
        if name == "--world-size":
            if not value.isdigit() or int(value) < 1:
                raise ConfigError(f"--world-size: {value!r} must be a positive integer")
            world_size = int(value)
        elif name == "--gpu-type":
            device_by_key(value)
            device.gpu_type = value
        elif name == "--device-memory-gib":
            device.memory_gib = checked_memory_gib(value)
        elif name == "--memory-check":
            if value not in MEMORY_CHECKS:
                raise ConfigError(
                    f"--memory-check: {value!r} is not one of: {', '.join(MEMORY_CHECKS)}"
                )
            memory_check = value
        elif value not in ("cuda", "cpu"):
            raise ConfigError(f"--device-type: {value!r} is not one of: cuda, cpu")
        else:
            device.type = value
    if device.gpu_type or device.memory_gib:
        if device.type == "cpu":
            raise ConfigError(
                "--device-type: cpu, but a GPU is named (--gpu-type or --device-memory-gib)"
            )
        device.type = "cuda"  # a GPU named: the job is planned for it
    return world_size, device, memory_check, rest


if __name__ == "__main__":
    sys.exit(main())
