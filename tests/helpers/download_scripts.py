"""The Hub download scripts under test (scripts/download_tokenizer.py, scripts/download_hf_assets.py):
loaded in-process with no token or offline setting from the caller's environment, and run as a
user runs them, offline."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
from repo_paths import ROOT, load_script

SECRET = "hf_TESTtokenNOTREAL0123456789"  # a token the scripts must never print


def load_download_script(monkeypatch: pytest.MonkeyPatch, name: str) -> ModuleType:
    """``scripts/<name>.py`` as a module, with HF_TOKEN and HF_HUB_OFFLINE unset."""
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    return load_script(name)


def check_offline_download_is_one_line(script: str, repo: str, tmp_path: Path) -> None:
    """``scripts/<script> --repo_id repo`` with HF_HUB_OFFLINE=1 and a token: exit status 1 and
    one line on stderr that names HF_HUB_OFFLINE, no traceback, the token nowhere."""
    env = dict(os.environ)
    env.update(HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf_home"), HF_TOKEN=SECRET)
    result = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / script),
            "--repo_id",
            repo,
            "--local_dir",
            str(tmp_path / "out"),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert result.returncode == 1
    assert SECRET not in result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    assert result.stderr.count("\n") == 1, result.stderr
    assert "HF_HUB_OFFLINE" in result.stderr
