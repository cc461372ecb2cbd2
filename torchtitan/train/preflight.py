"""The launcher's check before torchrun: the job plan (:func:`~torchtitan.train.plan.plan_job`)
plus the tokenizer against the flavor, every problem at once.

``python -m torchtitan.preflight --world-size N [train.py arguments]`` exits 0 when the job can
start on N processes, or prints one ``error: ...`` line and exits 2, so that a bad config is
reported once, before torchrun starts any worker (and without torchrun's failure report).
"""

from __future__ import annotations

import os
import sys

from torchtitan.config.checks import located
from torchtitan.config.parse import parse_args
from torchtitan.config.schema import JobConfig
from torchtitan.data.tokenizer import build_tokenizer
from torchtitan.errors import ConfigError, ConfigErrors, Problems, TorchTitanError, error_lines
from torchtitan.models.spec import get_model_spec
from torchtitan.optim.param_groups import parse_rules
from torchtitan.train.plan import check_vocab, plan_job, resolve_model_args


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(argv)
    except KeyboardInterrupt:  # Ctrl-C while the launcher checks: stop quietly, as a shell does
        return 130


def _main(argv: list[str] | None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        world_size, device_type, argv = _own_options(argv)
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


def _own_options(argv: list[str]) -> tuple[int, str | None, list[str]]:
    """``--world-size N`` and ``--device-type cuda|cpu`` (before the train.py arguments)."""
    world_size, device_type = 1, None
    while argv[:1] and argv[0] in ("--world-size", "--device-type"):
        if len(argv) < 2:
            raise ConfigError(f"{argv[0]}: needs a value")
        name, value, argv = argv[0], argv[1], argv[2:]
        if name == "--world-size":
            if not value.isdigit() or int(value) < 1:
                raise ConfigError(f"--world-size: {value!r} must be a positive integer")
            world_size = int(value)
        elif value not in ("cuda", "cpu"):
            raise ConfigError(f"--device-type: {value!r} is not one of: cuda, cpu")
        else:
            device_type = value
    return world_size, device_type, argv


if __name__ == "__main__":
    sys.exit(main())
