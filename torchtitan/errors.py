"""Errors that reach the user as one clear line (train.py prints them and exits), never a traceback."""

from __future__ import annotations

import os
import sys


class TorchTitanError(Exception):
    """Base class: the message must name the offending key, file or value and what would be valid."""

    exit_code = 1
    prefix = "error: "  # how its lines start where no launcher prints them
    names_rank = True  # in a job of several ranks, lines start with "rank R: "


class ConfigError(TorchTitanError):
    """Bad configuration: unknown keys, wrong types or values, missing files, bad combinations."""

    exit_code = 2
    names_rank = False  # every rank finds the same problem


class DataError(TorchTitanError):
    """Bad training data found while reading it (a row without the text field, say)."""

    exit_code = 1


class HFFormatError(TorchTitanError):
    """Hugging Face weights that do not fit this model (names or shapes), or unreadable files."""

    exit_code = 1


class TrainingDiverged(TorchTitanError):
    """A non-finite loss or gradient norm: training stopped before that step's optimizer step."""

    exit_code = 3


class CollectiveTimeout(TorchTitanError):
    """A collective that waited past the timeout for its peers (a rank stopped, died or lags):
    every rank that was waiting reports its line (the launcher prints them all)."""

    exit_code = 4


class CheckpointSaveFailed(TorchTitanError):
    """A checkpoint save that failed (disk full, permission, I/O error) with
    ``checkpoint.on_save_error = "stop"``: every rank stops together, the previous complete
    checkpoint kept."""

    exit_code = 5


class ConfigErrors(ConfigError):
    """Several configuration problems found in one pass: one line each, all reported at once."""

    def __init__(self, lines: list[str]):
        self.lines = list(lines)
        super().__init__("\n".join(self.lines))


class Problems:
    """Collects ConfigErrors from independent checks, so that one run reports every problem.

    ``with problems.collect(): check()`` records the check's error instead of raising it;
    ``raise_if_any()`` then raises them together (a single problem stays a plain ConfigError).
    """

    def __init__(self) -> None:
        self.lines: list[str] = []

    def add(self, line: str) -> None:
        if line not in self.lines:
            self.lines.append(line)

    def collect(self) -> _Collect:
        return _Collect(self)

    def raise_if_any(self) -> None:
        if len(self.lines) == 1:
            raise ConfigError(self.lines[0])
        if self.lines:
            raise ConfigErrors(self.lines)


class _Collect:
    def __init__(self, problems: Problems) -> None:
        self.problems = problems
        self.failed = False

    def __enter__(self) -> _Collect:
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc is None or not isinstance(exc, ConfigError):
            return False
        self.failed = True
        for line in exc.lines if isinstance(exc, ConfigErrors) else [str(exc)]:
            self.problems.add(line)
        return True


def error_lines(e: TorchTitanError) -> list[str]:
    """The ``error: ...`` lines to print for ``e`` (one per problem)."""
    return [f"error: {line}" for line in str(e).splitlines() or [""]]


def report_user_error(e: TorchTitanError) -> None:
    """One line, no traceback: to the launcher's error file when there is one, else to stderr."""
    rank = int(os.environ.get("RANK", "0"))
    several = int(os.environ.get("WORLD_SIZE", "1")) > 1
    where = f"rank {rank}: " if several and e.names_rank else ""
    error_file = os.environ.get("TORCHTITAN_ERROR_FILE")
    if error_file:
        with open(error_file, "a") as f:
            f.writelines(f"{e.exit_code}\t{where}{line}\n" for line in str(e).splitlines())
    elif rank == 0 or e.names_rank:
        lines = (f"{e.prefix}{where}{line}" for line in str(e).splitlines())
        print("\n".join(lines), file=sys.stderr, flush=True)


def another_rank_reported() -> bool:
    """Whether a peer already wrote a user error to the launcher's error file."""
    error_file = os.environ.get("TORCHTITAN_ERROR_FILE")
    return bool(error_file) and os.path.isfile(error_file) and os.path.getsize(error_file) > 0
