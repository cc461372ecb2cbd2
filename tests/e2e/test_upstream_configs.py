"""Upstream-era configs, migrated by scripts/migrate_config.py (run as a user runs it), train the
debug-sized model on CPU through the launcher: the published flavor swapped for debugmodel, the
data for the offline corpus, a few short steps. The old file itself trains too, with its warnings
printed once, by the config check."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from launcher import console_losses, launch
from repo_paths import ROOT, SENTENCEPIECE_PATH, TOKENIZER, UPSTREAM

SENTENCEPIECE = str(SENTENCEPIECE_PATH)
DEBUG_SIZE = [
    "--model.flavor",
    "debugmodel",
    "--training.dataset",
    "python_docs",
    "--training.steps",
    "3",
    "--training.seq_len",
    "64",
    "--lr_scheduler.warmup_steps",
    "1",
    "--metrics.log_freq",
    "1",
    "--debug.seed",
    "7",
]


def _migrate(name: str, tmp_path: Path) -> Path:
    new = tmp_path / f"{name}.toml"
    out = subprocess.run(
        [
            sys.executable,
            "scripts/migrate_config.py",
            str(UPSTREAM / f"{name}.toml"),
            "-o",
            str(new),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert f"wrote {new}" in out.stderr
    return new


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "extra"),
    [
        ("llama3_8b_2024", ["--model.tokenizer_path", TOKENIZER]),
        ("llama3_8b_2025_mid", ["--model.tokenizer_path", TOKENIZER]),
        ("llama3_8b_2025_late", ["--model.hf_assets_path=", "--model.tokenizer_path", TOKENIZER]),
        (
            "llama2_7b_2024",
            ["--model.tokenizer_path", SENTENCEPIECE, "--model.norm_type", "rmsnorm"],
        ),
    ],
)
def test_migrated_upstream_config_trains_the_debug_model(name, extra, tmp_path):
    new = _migrate(name, tmp_path)
    out = launch(tmp_path, "--job.config_file", str(new), *DEBUG_SIZE, *extra)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "warning:" not in out.stderr  # the migrated file uses current names only
    losses = console_losses(out.stdout)
    assert sorted(losses) == [1, 2, 3] and all(0 < v < 20 for v in losses.values())


@pytest.mark.slow
def test_old_file_trains_with_its_warnings_printed_once(tmp_path):
    old = UPSTREAM / "llama3_8b_2024.toml"
    out = launch(
        tmp_path, "--job.config_file", str(old), *DEBUG_SIZE, "--model.tokenizer_path", TOKENIZER
    )
    assert out.returncode == 0, out.stderr[-3000:]
    line = f"warning: {old}: training.batch_size: old name of training.local_batch_size"
    assert (out.stdout + out.stderr).count(line) == 1
    assert "WARNING" not in out.stdout  # the workers do not repeat what the check printed
    assert sorted(console_losses(out.stdout)) == [1, 2, 3]
