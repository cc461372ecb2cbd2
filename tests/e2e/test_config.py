"""train.py as a user runs it: --help lists every key, and config errors are one line on stderr
(the parser itself is checked in-process in tests/unit/config/test_config.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from repo_paths import DEBUG_TOML, ROOT

from torchtitan.config.schema import JobConfig


def _run(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *args], cwd=cwd, capture_output=True, text=True, timeout=120
    )


def test_train_py_help_lists_every_key():
    out = _run("train.py", "--help")
    assert out.returncode == 0
    cfg = JobConfig()

    def keys(prefix: str, values: dict) -> list[str]:  # nested tables: training.dataloader.x
        found = []
        for name, value in values.items():
            nested = isinstance(value, dict)
            found += keys(f"{prefix}.{name}", value) if nested else [f"{prefix}.{name}"]
        return found

    for section, values in cfg.to_dict().items():
        for key in keys(section, values):
            assert f"--{key} " in out.stdout, f"{key} missing from --help"


def test_help_read_in_part_ends_quietly():
    """``python train.py --help | head``: the reader closes the pipe; no BrokenPipeError."""
    train = subprocess.Popen(
        [sys.executable, "train.py", "--help"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        bufsize=0,
    )
    train.stdout.close()  # the reader is gone before the help is written (head took its lines)
    _, err = train.communicate(timeout=120)
    assert train.returncode == 0 and err == b"", err.decode()[-2000:]


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--training.steps", "-3"], "error: command line: --training.steps: -3 must be >= 1"),
        (
            ["--model.flavor", "9B"],
            "error: command line: --model.flavor: '9B' is not a flavor of llama3; valid: debugmodel",
        ),
        (
            ["--model.name", "gpt9"],
            "error: command line: --model.name: unknown model 'gpt9'; valid: deepseek_v3, gpt_oss, llama2, llama3",
        ),
        (
            ["--parallelism.data_parallel_shard_degree", "3"],
            "error: command line: --parallelism.data_parallel_shard_degree: 3, but the world size "
            "is 1",
        ),
    ],
)
def test_train_py_reports_config_errors_in_one_line(args, expected):
    out = _run("train.py", "--job.config_file", DEBUG_TOML, *args)
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip().startswith(expected), out.stderr
    assert "Traceback" not in out.stderr + out.stdout
    assert len(out.stderr.strip().splitlines()) == 1
