"""Data errors as train.py reports them: one ``error:`` line naming the file, line or key, found
while the data is built (before the model), and the default validation set without a network in
seconds, not after a minute of retries (the loader's messages themselves are checked in-process in
tests/unit/data/test_datasets.py)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from launcher import train_env
from repo_paths import DEBUG_TOML, ROOT


def _train(tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable,
        "train.py",
        "--job.config_file",
        DEBUG_TOML,
        "--job.dump_folder",
        str(tmp_path / "out"),
        "--training.steps",
        "1",
        *args,
    ]
    return subprocess.run(
        cmd,
        cwd=ROOT,
        env={**train_env(tmp_path), **env},
        capture_output=True,
        text=True,
        timeout=300,
    )


def _error_lines(out: subprocess.CompletedProcess) -> list[str]:
    assert "Traceback" not in out.stdout + out.stderr, out.stderr[-3000:]
    return [line for line in out.stderr.splitlines() if line.startswith("error: ")]


def _jsonl(path: Path, rows: list[dict], bad_line: int | None = None) -> Path:
    lines = [json.dumps(r) for r in rows]
    if bad_line is not None:
        lines[bad_line - 1] = '{"text": "cut short'
    path.write_text("\n".join(lines) + "\n")
    return path


def test_a_malformed_json_line_is_one_line_with_its_number(tmp_path):
    rows = [{"text": f"document {i} " * 10} for i in range(400)]
    path = _jsonl(tmp_path / "data.jsonl", rows, bad_line=301)
    out = _train(tmp_path, "--training.dataset_path", str(path))
    assert out.returncode == 1, out.stderr[-3000:]
    assert _error_lines(out) == [
        f"error: training.dataset_path: '{path}' line 301 is not valid JSON: Unterminated string "
        "starting at column 10; fix or remove that line"
    ]
    assert "Failed to load JSON" not in out.stderr  # the datasets reader's own line, row of a block


def test_a_wrong_text_field_stops_before_the_model_is_built(tmp_path):
    path = _jsonl(tmp_path / "data.jsonl", [{"content": f"doc {i}", "id": i} for i in range(50)])
    out = _train(tmp_path, "--training.dataset_path", str(path))
    assert out.returncode == 1, out.stderr[-3000:]
    assert _error_lines(out) == [
        f"error: dataset '{path}': row 0 of virtual shard 0 (of 8) has no field 'text' (missing "
        "or null); the row has fields ['content', 'id']; set training.dataset_text_field to the "
        "field that holds the text"
    ]
    assert "Tokenizer " in out.stdout and "Model llama3" not in out.stdout


# timed: alone, at the normal CPU priority (tests/helpers/lanes.py)
@pytest.mark.exclusive
def test_the_default_validation_set_without_a_network_fails_in_seconds(tmp_path):
    """HF_HUB_OFFLINE not set, the Hub's address refusing connections: one line naming the key
    and a local alternative, instead of datasets' retries (about 25 s for a refused connection,
    minutes for a silent network)."""
    with socket.socket() as closed:  # bound, never listening: connections are refused
        closed.bind(("127.0.0.1", 0))
        endpoint = f"http://127.0.0.1:{closed.getsockname()[1]}"
        env = {**train_env(tmp_path), "HF_ENDPOINT": endpoint}
        env.pop("HF_HUB_OFFLINE")
        cmd = [
            sys.executable,
            "train.py",
            "--job.config_file",
            DEBUG_TOML,
            "--job.dump_folder",
            str(tmp_path / "out"),
            "--training.steps",
            "1",
            "--validation.enable",
        ]
        start = time.monotonic()
        out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        elapsed = time.monotonic() - start
    assert out.returncode == 2, out.stderr[-3000:]
    assert _error_lines(out) == [
        "error: validation.dataset: 'c4_validation' is allenai/c4 (config en, split validation) "
        "on the Hugging Face Hub, which cannot be used here (no answer from "
        f"{endpoint}: Connection refused) and is not in the datasets cache; set "
        "validation.dataset_path to a local copy (a .jsonl, .parquet or .txt file, or a folder "
        "of them), or validation.dataset = 'python_docs'"
    ]
    assert "Retrying" not in out.stderr
    # the whole run: start-up and the training data (seconds on an idle machine), then one probe.
    # The retries are ruled out above; this bound rules out minutes, with room for a slow CI
    # machine (33.6 s seen on one whose cores a leaked process shared)
    assert elapsed < 60, elapsed
