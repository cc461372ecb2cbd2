#!/usr/bin/env python
"""The generated tables of docs/config.md: every key, and every old upstream name.

    python scripts/config_docs.py           # exit 1 (and say so) when docs/config.md is stale
    python scripts/config_docs.py --write   # rewrite the tables in docs/config.md

The tables sit between ``<!-- generated: NAME -->`` and ``<!-- end: NAME -->`` markers; the
text around them is written by hand. tests/unit/config/test_config_docs.py fails when they are stale.
"""

from __future__ import annotations

import argparse
import os
import re
import sys

from _common import run

from torchtitan.config import compat as config_aliases
from torchtitan.config.schema import default_of, keys, sections, toml_value, type_name

DOC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "config.md")


def _bounds(meta: dict) -> str:
    parts = []
    if meta.get("choices"):
        parts.append(", ".join(f"`{c}`" for c in meta["choices"]))
    for name, sign in (("ge", "≥"), ("gt", ">"), ("le", "≤")):
        if meta.get(name) is not None:
            parts.append(f"{sign} {meta[name]}")
    return "; ".join(parts)


def keys_table() -> str:
    out = []
    for section, cls in sections().items():
        out += [f"#### `[{section}]`", "", "| key | type | default | allowed | description |"]
        out.append("| --- | --- | --- | --- | --- |")
        for key, (f, tp) in keys(cls).items():
            default = default_of(f)
            shown = "unset" if default is None else toml_value(default)
            help_text = f.metadata.get("help", "").replace("|", "\\|")
            out.append(
                f"| `{key}` | {type_name(tp)} | `{shown}` | {_bounds(f.metadata)} | {help_text} |"
            )
        out.append("")
    return "\n".join(out).rstrip() + "\n"


def aliases_table() -> str:
    out = ["| old key (upstream) | now | notes |", "| --- | --- | --- |"]
    for old, alias in config_aliases.ALIASES.items():
        if alias.new is None and alias.only is not None:
            now = "accepted at " + " / ".join(f"`{toml_value(v)}`" for v in alias.only)
            notes = f"{alias.note}; other values: {alias.why}"
        elif alias.new is None:
            now, notes = "ignored", alias.note
        else:
            now, notes = f"`{alias.new}`", alias.note
            if alias.only is not None:
                notes += f"; {alias.why}"
            if alias.also is not None:
                notes = notes or "also sets other keys"
        out.append(f"| `{old}` | {now} | {notes.strip('; ')} |")
    out += ["", "| key | old value | now |", "| --- | --- | --- |"]
    for key, values in config_aliases.VALUE_ALIASES.items():
        for old, new in values.items():
            out.append(f"| `{key}` | `{toml_value(old)}` | `{toml_value(new)}` |")
    return "\n".join(out) + "\n"


TABLES = {"keys": keys_table, "aliases": aliases_table}


def render(text: str) -> str:
    """``text`` with every generated table brought up to date."""
    for name, make in TABLES.items():
        pattern = re.compile(
            rf"(<!-- generated: {name} -->\n).*?(<!-- end: {name} -->)", flags=re.DOTALL
        )
        if not pattern.search(text):
            raise SystemExit(f"error: {DOC}: no '<!-- generated: {name} -->' marker")
        text = pattern.sub(
            lambda m, make=make: m.group(1) + "\n" + make() + "\n" + m.group(2), text
        )
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", action="store_true", help="rewrite docs/config.md")
    args = parser.parse_args()
    with open(DOC) as f:
        text = f.read()
    new = render(text)
    if args.write:
        with open(DOC, "w") as f:
            f.write(new)
        print(f"wrote {DOC}")
    elif new != text:
        print(f"{DOC} is stale: run python scripts/config_docs.py --write", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    run(main)
