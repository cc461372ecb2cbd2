"""Data tests run offline, with the ``datasets`` and torchtitan caches in temporary folders."""

from __future__ import annotations

from pathlib import Path

import datasets
import huggingface_hub.constants


def use_offline_caches(monkeypatch, hf_cache: Path, torchtitan_cache: Path | None = None) -> None:
    """No Hub access, and no writes to the user's caches (environment and already-read config)."""
    monkeypatch.setenv("HF_DATASETS_CACHE", str(hf_cache))
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", hf_cache)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    if torchtitan_cache is not None:
        monkeypatch.setenv("TORCHTITAN_CACHE", str(torchtitan_cache))
