"""docs/config.md's generated tables (every key, every old upstream name) match the code."""

from __future__ import annotations

import sys
from pathlib import Path

from repo_paths import ROOT

sys.path.insert(0, str(ROOT / "scripts"))

from config_docs import DOC, render  # noqa: E402

from torchtitan.config.compat import ALIASES  # noqa: E402
from torchtitan.config.schema import all_keys  # noqa: E402


def test_config_doc_tables_are_current():
    text = Path(DOC).read_text()
    assert render(text) == text, "docs/config.md is stale: python scripts/config_docs.py --write"


def test_every_key_and_old_name_is_in_the_doc():
    text = Path(DOC).read_text()
    for dotted in all_keys():
        section, key = dotted.split(".", 1)
        assert f"#### `[{section}]`" in text and f"| `{key}` |" in text
    for old in ALIASES:
        assert f"| `{old}` |" in text


def test_no_key_is_declared_but_refused():
    """Nothing in the schema is a placeholder: the old 'not available yet' list is gone."""
    assert "not available yet" not in Path(DOC).read_text()
