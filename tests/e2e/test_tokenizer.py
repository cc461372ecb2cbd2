"""scripts/download_tokenizer.py run as a user runs it, offline: one line on stderr. The
tokenizers and the script's other checks are in tests/unit/data/test_tokenizer.py."""

from __future__ import annotations

from download_scripts import check_offline_download_is_one_line

REPO = "meta-llama/Meta-Llama-3.1-8B"


def test_download_offline_subprocess(tmp_path):
    check_offline_download_is_one_line("download_tokenizer.py", REPO, tmp_path)
