"""The launcher's check before torchrun: the job plan (:func:`~torchtitan.train.plan.plan_job`)
plus the tokenizer against the flavor, every problem at once.

``python -m torchtitan.preflight --world-size N [train.py arguments]`` exits 0 when the job can
start on N processes, or prints one ``error: ...`` line and exits 2, so that a bad config is
reported once, before torchrun starts any worker (and without torchrun's failure report).

A CUDA job (this machine's devices, or ``--device-type cuda``) is also checked against its
devices' memory (:mod:`torchtitan.train.memory_fit`): ``--gpu-type KEY`` (the table of
``torchtitan/devices.py``) or ``--device-memory-gib X`` give the memory when planning from a
machine without the GPU; without either, the largest GPU listed. A job whose parameters,
gradients and optimizer state alone exceed it is refused; otherwise one line on stderr says how
much of the memory they take.
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys

import torch

from torchtitan.config.checks import located
from torchtitan.config.parse import parse_args
from torchtitan.config.schema import JobConfig
from torchtitan.data.tokenizer import build_tokenizer
from torchtitan.distributed import utils as dist_utils
from torchtitan.errors import ConfigError, ConfigErrors, Problems, TorchTitanError, error_lines
from torchtitan.models.spec import get_model_spec
from torchtitan.optim.param_groups import parse_rules
from torchtitan.train.memory_fit import (
    RESERVE_GIB,
    DeviceMemory,
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
        world_size, device_type, device, argv = _own_options(argv)
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
        with problems.collect():
            _check_job(job_config, world_size, device_type)
        problems.raise_if_any()
        if (device_type or dist_utils.device_type) == "cuda":
            _check_memory(job_config, world_size, device)
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


def _check_job(job_config: JobConfig, world_size: int, device_type: str | None) -> None:
    """The plan's checks, then the tokenizer against the flavor: every problem of both."""
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
    with problems.collect():
        path, key = job_config.model.tokenizer_source()
        try:
            if os.path.exists(path):  # a missing one is reported by the config's file checks
                tokenizer = build_tokenizer(path, key=key)
                check_vocab(job_config, model_args, tokenizer.n_words)
        except ConfigError as e:
            raise located(job_config, e) from None
    problems.raise_if_any()


def _check_memory(job_config: JobConfig, world_size: int, device: DeviceMemory | None) -> None:
    """The floor of the job's memory per device (parameters, gradients, optimizer state)
    against its devices': refused when over, else one line on stderr."""
    memory = device or largest_device()
    model_args = resolve_model_args(job_config)
    if model_args.vocab_size <= 0 or job_config.model.vocab_size_from_tokenizer:
        path, key = job_config.model.tokenizer_source()  # checked to exist by _check_job
        vocab = build_tokenizer(path, key=key).n_words
        model_args = dataclasses.replace(model_args, vocab_size=vocab)
    with torch.device("meta"):
        model = get_model_spec(job_config.model.name).cls(model_args)
    if job_config.lora.enable:  # only the adapters train: the base weights alone are certain
        model.requires_grad_(False)
    floor = state_floor_gib(job_config, model, world_size)
    fits, line = verdict(floor, memory, "parameters, gradients and optimizer state take at least")
    if fits:
        print(f"preflight: memory: {line}", file=sys.stderr)
        return
    usable = max(memory.gib - RESERVE_GIB, 1e-9)
    at_least = math.ceil(floor * world_size / usable)
    n = sum(p.numel() for p in model.parameters())
    raise ConfigError(
        f"{job_config.model.name} {job_config.model.flavor} ({n:,} parameters) on {world_size} "
        f"device(s) {line} (no layout holds less: they are spread evenly over every device); "
        f"it needs at least {at_least} such devices (or optimizer.state_dtype = bfloat16); "
        f"python scripts/estimate_memory.py --world-size N gives the whole step's peak"
    )


def _own_options(argv: list[str]) -> tuple[int, str | None, DeviceMemory | None, list[str]]:
    """``--world-size N``, ``--device-type cuda|cpu``, ``--gpu-type KEY`` and
    ``--device-memory-gib X`` (before the train.py arguments)."""
    world_size, device_type, gpu_type, memory_gib = 1, None, None, None
    own = ("--world-size", "--device-type", "--gpu-type", "--device-memory-gib")
    while argv[:1] and argv[0] in own:
        if len(argv) < 2:
            raise ConfigError(f"{argv[0]}: needs a value")
        name, value, argv = argv[0], argv[1], argv[2:]
        if name == "--world-size":
            if not value.isdigit() or int(value) < 1:
                raise ConfigError(f"--world-size: {value!r} must be a positive integer")
            world_size = int(value)
        elif name == "--gpu-type":
            gpu_type = value
        elif name == "--device-memory-gib":
            try:
                memory_gib = float(value)
            except ValueError:
                raise ConfigError(f"--device-memory-gib: {value!r} must be a number") from None
        elif value not in ("cuda", "cpu"):
            raise ConfigError(f"--device-type: {value!r} is not one of: cuda, cpu")
        else:
            device_type = value
    if (gpu_type or memory_gib) and device_type is None:
        device_type = "cuda"  # a GPU named: the job is planned for it
    device = device_memory(device_type or dist_utils.device_type, gpu_type, memory_gib)
    return world_size, device_type, device, argv


if __name__ == "__main__":
    sys.exit(main())
