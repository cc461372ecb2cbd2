"""Errors that reach the user as one clear line (train.py prints them and exits), never a traceback."""


class TorchTitanError(Exception):
    """Base class: the message must name the offending key, file or value and what would be valid."""

    exit_code = 1


class ConfigError(TorchTitanError):
    """Bad configuration: unknown keys, wrong types or values, missing files, bad combinations."""

    exit_code = 2


class DataError(TorchTitanError):
    """Bad training data found while reading it (a row without the text field, say)."""

    exit_code = 1


class TrainingDiverged(TorchTitanError):
    """A non-finite loss or gradient norm: training stopped before that step's optimizer step."""

    exit_code = 3
