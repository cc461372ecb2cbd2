#!/usr/bin/env python
"""Rewrite a TOML train config from old upstream torchtitan key names to the current ones.

    python scripts/migrate_config.py OLD.toml [-o NEW.toml]

Without ``-o`` the file is rewritten in place (``-o -`` prints it instead). Comments and layout
are kept (tomlkit); each change is printed on stderr, one line each. Keys move to their current
section (created at the end of the file when missing), a key's end-of-line comment moves with it,
and tables left empty are dropped. Values come from the same alias table the config parser uses,
so the migrated file loads to the same settings, with no warning.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import tomlkit
from _common import run
from tomlkit.items import Table

from torchtitan.config import compat as config_aliases
from torchtitan.config.parse import parse_args
from torchtitan.config.schema import JobConfig
from torchtitan.errors import ConfigError, Problems


def _leaves(table: Any, prefix: str = "") -> list[tuple[str, Any, str]]:
    """(parent table, key, dotted key) of every value, nested tables included."""
    out = []
    for key, value in list(table.items()):
        if isinstance(value, dict):
            out += _leaves(value, f"{prefix}{key}.")
        else:
            out.append((table, key, f"{prefix}{key}"))
    return out


def _resolved(cfg: JobConfig, dotted: str) -> Any:
    section, key = dotted.split(".", 1)
    return getattr(getattr(cfg, section), key)


def _put(doc: Any, dotted: str, value: Any, comment: str) -> None:
    section, key = dotted.split(".", 1)
    if section not in doc:
        doc.add(section, tomlkit.table())
    item = tomlkit.item(value)
    if comment:
        item.comment(comment.lstrip("# "))
    doc[section][key] = item


def _drop_empty_tables(table: Any) -> None:
    for key, value in list(table.items()):
        if isinstance(value, dict):
            _drop_empty_tables(value)
            if not value:
                del table[key]


def migrate(text: str, path: str) -> tuple[str, list[str]]:
    """The migrated TOML and the change lines."""
    problems = Problems()
    cfg = parse_args(["--job.config_file", path], need_files=False, problems=problems)
    if problems.lines:  # unknown keys or bad values: the new file would not load either
        raise ConfigError("\n".join(problems.lines))
    doc = tomlkit.parse(text)
    changes = []
    for table, key, dotted in _leaves(doc):
        alias = config_aliases.ALIASES.get(dotted)
        if dotted == "model.flavor" and table[key] in config_aliases.FLAVOR_ALIASES:
            changes += _migrate_flavor(doc, table, key, cfg, path)
            continue
        if alias is None:
            renamed = config_aliases.VALUE_ALIASES.get(dotted, {})
            value = table[key]
            values = value if isinstance(value, list) else [value]
            if any(isinstance(v, str) and v in renamed for v in values):
                new = _resolved(cfg, dotted)
                table[key] = new
                changes.append(f"{path}: {dotted} = {_show(value)} -> {_show(new)}")
            continue
        comment = table[key].trivia.comment if hasattr(table[key], "trivia") else ""
        old = table[key]
        del table[key]
        if alias.new is None:
            changes.append(f"{path}: {dotted} = {_show(old)} removed ({alias.note or 'no effect'})")
            continue
        targets = [alias.new, *(alias.also(_plain(old)) if alias.also else {})]
        for target in targets:
            new = _resolved(cfg, target)
            _put(doc, target, new, comment if target == alias.new else "")
            changes.append(f"{path}: {dotted} = {_show(old)} -> {target} = {_show(new)}")
    _drop_empty_tables(doc)
    return tomlkit.dumps(doc), changes


def _migrate_flavor(doc: Any, table: Any, key: str, cfg: JobConfig, path: str) -> list[str]:
    """An upstream flavor that means a flavor here plus other keys: all of them written."""
    old = table[key]
    flavor, extra = config_aliases.FLAVOR_ALIASES[str(old)]
    table[key] = flavor
    changes = [f"{path}: model.flavor = {_show(old)} -> {_show(flavor)}"]
    for target in extra:
        new = _resolved(cfg, target)
        _put(doc, target, new, "")
        changes.append(f"{path}: model.flavor = {_show(old)} -> {target} = {_show(new)}")
    return changes


def _plain(item: Any) -> Any:
    return item.unwrap() if hasattr(item, "unwrap") else item


def _show(value: Any) -> str:
    value = _plain(value)
    return tomlkit.item(value).as_string() if not isinstance(value, Table) else str(value)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("config", help="the TOML file to migrate")
    parser.add_argument("-o", "--output", help="where to write (default: in place; - = stdout)")
    args = parser.parse_args()
    try:
        with open(args.config) as f:
            text = f.read()
    except OSError as e:
        raise ConfigError(f"{args.config}: cannot read ({e.strerror})") from None
    new_text, changes = migrate(text, args.config)
    for line in changes:
        print(line, file=sys.stderr)
    if not changes:
        print(f"{args.config}: already uses current names; nothing to change", file=sys.stderr)
    out = args.output or args.config
    if out == "-":
        sys.stdout.write(new_text)
    elif changes or args.output:
        with open(out, "w") as f:
            f.write(new_text)
        print(f"wrote {out} ({len(changes)} changes)", file=sys.stderr)


if __name__ == "__main__":
    run(main)
