"""Data tests run offline, with the ``datasets`` and torchtitan caches in temporary folders; a
byte-level tokenizer for them."""

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


class ByteTokenizer:
    """UTF-8 bytes 0..255, BOS 256, EOS 257: every document starts with the one token 256."""

    n_words = 258
    bos_id = 256
    eos_id = 257

    def encode(self, text: str, *, bos: bool, eos: bool) -> list[int]:
        ids = list(text.encode("utf-8"))
        return ([self.bos_id] if bos else []) + ids + ([self.eos_id] if eos else [])

    def decode(self, ids) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")
