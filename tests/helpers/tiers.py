"""The test tiers: CI runs the default one; ``pytest --extended`` adds the tests marked
``extended`` (variations of code paths a default test already covers; see tests/conftest.py)."""

from __future__ import annotations

from collections.abc import Iterable

import pytest


def params(ids: Iterable[str], extended: Iterable[str]) -> list:
    """``ids`` as ``pytest.param`` values, those in ``extended`` marked ``extended``."""
    extended = set(extended)
    ids = list(ids)
    unknown = extended - set(ids)
    assert not unknown, f"extended ids that are not parameters: {sorted(unknown)}"
    return [pytest.param(i, marks=pytest.mark.extended if i in extended else ()) for i in ids]
