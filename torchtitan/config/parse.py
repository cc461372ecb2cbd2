"""Reading a :class:`~torchtitan.config.schema.JobConfig` from defaults < TOML file < command line.

:func:`parse_args` builds the config through upstream's old names (:mod:`~torchtitan.config.compat`)
and checks it once (:mod:`~torchtitan.config.checks`); any problem raises
:class:`~torchtitan.errors.ConfigError` with one line naming the key as the user wrote it.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import importlib.util
import os
import sys
import types
import typing
from dataclasses import dataclass, field
from typing import Any

from torchtitan.config import compat as config_aliases
from torchtitan.config.checks import check_values, config_warnings
from torchtitan.config.schema import (
    JobConfig,
    all_keys,
    owner,
    sections,
    strip_optional,
    type_name,
)
from torchtitan.errors import ConfigError, Problems

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

# ----------------------------------------------------------------------------- value conversion

_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off"}


def _convert(raw: Any, tp: Any, from_cli: bool) -> Any:
    """Convert a TOML value or CLI string to the key's type, or raise ConfigError (the caller
    puts the key and where it was written in front of the message)."""
    base, optional = strip_optional(tp)
    if optional and (
        raw is None or (from_cli and isinstance(raw, str) and raw.lower() in ("none", ""))
    ):
        return None
    want = type_name(tp)
    if base is bool:
        if isinstance(raw, bool):
            return raw
        if from_cli and isinstance(raw, str) and raw.lower() in _TRUE | _FALSE:
            return raw.lower() in _TRUE
    elif base is int:
        if isinstance(raw, int) and not isinstance(raw, bool):
            return raw
        if from_cli and isinstance(raw, str):
            try:
                return int(raw)
            except ValueError:
                pass
    elif base is float:
        if isinstance(raw, (int, float)) and not isinstance(raw, bool):
            return float(raw)
        if from_cli and isinstance(raw, str):
            try:
                return float(raw)
            except ValueError:
                pass
    elif base is str:
        if isinstance(raw, str):
            return raw
    elif base is list:  # tables (training.datasets) or an old key's raw list
        if isinstance(raw, list):
            return raw
        if isinstance(raw, str):  # the key's own parser reads the text (training.datasets)
            return raw
    elif typing.get_origin(base) is list:
        if isinstance(raw, str):
            return [s.strip() for s in raw.split(",") if s.strip()]
        if isinstance(raw, list) and all(isinstance(s, str) for s in raw):
            return list(raw)
    raise ConfigError(f"{raw!r} is not a valid {want}")


# ----------------------------------------------------------------------------- reading settings


@dataclass(frozen=True)
class Setting:
    """One key as the user wrote it: where (a TOML file or the command line), name and value."""

    origin: str  # the TOML file's path, or "command line"
    written: str  # section.key as written (a current name, an old upstream name, or a typo)
    raw: Any
    from_cli: bool = False

    def where(self) -> str:
        """``FILE: key`` or ``command line: --key``, the prefix of any line about this setting."""
        return f"{self.origin}: {'--' if self.from_cli else ''}{self.written}"


def split_cli(argv: list[str]) -> list[Setting]:
    """Turn ``--a.b v``, ``--a.b=v`` and bare boolean ``--a.b`` into settings (unknown keys are
    reported later, together with every other problem)."""
    out: list[Setting] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--") or len(arg) == 2:
            raise ConfigError(
                f"command line: unexpected argument '{arg}'; options look like --section.key value"
            )
        body = arg[2:]
        if "=" in body:
            key, value = body.split("=", 1)
            out.append(Setting(CLI, key, value, True))
            i += 1
            continue
        nxt = argv[i + 1] if i + 1 < len(argv) else None
        takes_value = nxt is not None and (not nxt.startswith("--") or _looks_numeric(nxt))
        if _is_bool_key(body) and (nxt is None or nxt.lower() not in _TRUE | _FALSE):
            takes_value = False
            out.append(Setting(CLI, body, "true", True))
        elif takes_value:
            out.append(Setting(CLI, body, nxt, True))
        elif _is_bool_key(body) is None:  # unknown: reported with the other problems
            out.append(Setting(CLI, body, "true", True))
        else:
            tp = all_keys().get(body) or config_aliases.old_type(body, all_keys())
            raise ConfigError(f"command line: --{body} needs a value ({type_name(tp)})")
        i += 2 if takes_value else 1
    return out


CLI = "command line"


def _is_bool_key(dotted: str) -> bool | None:
    """Whether the key (current or old name) is a boolean; None when the key is unknown."""
    keys = all_keys()
    tp = keys.get(dotted) or config_aliases.old_type(dotted, keys)
    return None if tp is None else strip_optional(tp)[0] is bool


def _looks_numeric(s: str) -> bool:
    try:
        float(s)
        return True
    except ValueError:
        return False


def _load_toml(path: str) -> dict[str, Any]:
    if not os.path.isfile(path):
        raise ConfigError(
            f"job.config_file: '{path}' does not exist or is not a file; give a TOML file such as train_configs/debug_model.toml"
        )
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"job.config_file: '{path}' is not valid TOML: {e}") from None
    except OSError as e:
        raise ConfigError(f"job.config_file: cannot read '{path}': {e.strerror}") from None


def toml_settings(path: str, problems: Problems) -> list[Setting]:
    """A TOML file's keys as settings; nested tables (``[quantize.linear.float8]``) give dotted
    keys. Top-level values are problems."""
    out: list[Setting] = []

    def walk(table: dict[str, Any], prefix: str) -> None:
        for key, value in table.items():
            if isinstance(value, dict):
                walk(value, f"{prefix}{key}.")
            elif not prefix:
                problems.add(f"{path}: '{key}' must be in a [section] table, not a top-level value")
            else:
                out.append(Setting(path, f"{prefix}{key}", value))

    walk(_load_toml(path), "")
    return out


# ----------------------------------------------------------------------------- applying settings


class _Builder:
    """Applies settings in order (defaults < TOML < command line) to a JobConfig, through the
    alias table, recording where each key was set and collecting every problem."""

    def __init__(self, cfg: JobConfig, problems: Problems):
        self.cfg, self.problems = cfg, problems
        self.keys = all_keys(type(cfg))
        self.sections = sections(type(cfg))
        self.order: dict[str, int] = {}  # current key -> when it was last set
        self.deferred: list[tuple[int, Setting, Any]] = []
        self.implied: list[tuple[int, Setting, dict[str, Any]]] = []

    def apply(self, n: int, s: Setting) -> None:
        alias = config_aliases.ALIASES.get(s.written)
        if alias is None and s.written not in self.keys:
            raise ConfigError(self._unknown(s))
        if alias is None:
            self._set(n, s, s.written, self._typed(s, self.keys[s.written]))
            return
        value = self._typed(s, alias.old_type or self.keys[alias.new])
        if alias.only is not None and value not in alias.only:
            raise ConfigError(f"{s.where()}: {value!r}: {alias.why}")
        self._warn(s, alias.warning(s.where(), s.origin))
        if alias.compute is not None:  # needs other keys: done once every layer is applied
            self.deferred.append((n, s, value))
            return
        if alias.new is None:
            return
        if alias.convert is not None:
            value = alias.convert(value, self._get(alias.new))
        self._set(n, s, alias.new, value)
        for key, extra in (alias.also(value) if alias.also else {}).items():
            self._set(n, s, key, extra)

    def finish(self) -> None:
        for n, s, extra in self.implied:  # keys an old flavor name implies, unless set later
            for key, value in extra.items():
                if self.order.get(key, -1) <= n:
                    self._set(n, s, key, value)
        for n, s, value in self.deferred:
            alias = config_aliases.ALIASES[s.written]
            if alias.new is not None and self.order.get(alias.new, -1) > n:
                continue  # the current key was set later (higher precedence)
            with self.problems.collect():
                try:
                    computed = alias.compute(value, self.cfg)
                except ConfigError as e:  # where the old key was set, as every other line
                    raise ConfigError(f"{s.where()}: {e}") from None
                if alias.new is not None:
                    self._set(n, s, alias.new, computed)

    def _typed(self, s: Setting, tp: Any) -> Any:
        try:
            return _convert(s.raw, tp, s.from_cli)
        except ConfigError as e:
            raise ConfigError(f"{s.where()}: {e}") from None

    def _get(self, dotted: str) -> Any:
        return getattr(*owner(self.cfg, dotted))

    def _set(self, n: int, s: Setting, dotted: str, value: Any) -> None:
        if dotted == "model.flavor" and value in config_aliases.FLAVOR_ALIASES:
            value = self._old_flavor(n, s, value)
        renamed = config_aliases.VALUE_ALIASES.get(dotted, {})
        items = value if isinstance(value, list) else [value]
        for item in items:
            if isinstance(item, str) and item in renamed:
                self._warn(s, f"{s.where()}: {item!r} is now {renamed[item]!r}")
        if isinstance(value, list) and all(isinstance(v, str) for v in value):
            value = list(dict.fromkeys(renamed.get(v, v) for v in value))
        elif isinstance(value, str):
            value = renamed.get(value, value)
        setattr(*owner(self.cfg, dotted), value)
        self.order[dotted] = n
        self.cfg.origins[dotted] = s

    def _old_flavor(self, n: int, s: Setting, old: str) -> str:
        """An upstream flavor name that means a flavor here plus other keys (applied in
        ``finish`` unless a later setting gives them): the flavor, and one warning line."""
        flavor, extra = config_aliases.FLAVOR_ALIASES[old]
        self.implied.append((n, s, extra))
        keys = " with ".join(
            [f"model.flavor = {flavor!r}", *(f"{k} = {v!r}" for k, v in extra.items())]
        )
        self._warn(
            s,
            f"{s.where()}: {old!r} is upstream's debug model with document masking; "
            f"here it is {keys} (FlexAttention on CUDA, SDPA with a document mask on CPU)",
        )
        return flavor

    def _warn(self, s: Setting, line: str) -> None:
        if line not in self.cfg.warnings:
            self.cfg.warnings.append(line)

    def _unknown(self, s: Setting) -> str:
        if "." not in s.written:
            return f"{s.where()}: not of the form section.key (see python train.py --help)"
        section = s.written.split(".", 1)[0]
        hint = config_aliases.suggest(s.written, self.keys)
        if hint:
            return f"{s.where()}: unknown key; did you mean '{hint}'?"
        return f"{s.where()}: unknown key; see python train.py --help for the keys of [{section}]"

    def in_known_sections(self, settings: list[Setting]) -> list[Setting]:
        """The settings whose section exists (here, or as an old upstream section). A section
        that does not is one problem line per file (or for the command line), with the section
        it most likely meant; its keys are not judged one by one."""
        kept: list[Setting] = []
        unknown: dict[tuple[str, str], list[Setting]] = {}
        for s in settings:
            section = s.written.split(".", 1)[0]
            if "." not in s.written or section in self.sections:
                kept.append(s)
            elif config_aliases.is_old_section(section):
                kept.append(s)
            else:
                unknown.setdefault((s.origin, section), []).append(s)
        for (origin, section), group in unknown.items():
            where = origin
            if origin == CLI:
                where += ": " + ", ".join(f"--{s.written}" for s in group)
            self.problems.add(
                f"{where}: unknown section [{section}]; {self._meant(section, group)}"
            )
        return kept

    def _meant(self, section: str, group: list[Setting]) -> str:
        """``did you mean [x]?`` for an unknown section: a close name, else the one section
        holding most of its keys (more than half); else the list of sections."""
        close = difflib.get_close_matches(section, list(self.sections), n=1, cutoff=0.75)
        if not close:
            names = {s.written.split(".", 1)[1] for s in group}
            fits = {sec: sum(f"{sec}.{k}" in self.keys for k in names) for sec in self.sections}
            best = sorted(fits, key=lambda sec: -fits[sec])[:2]
            if 2 * fits[best[0]] > len(names) and fits[best[0]] > fits[best[1]]:
                close = best[:1]
        if close:
            return f"did you mean [{close[0]}]?"
        return f"sections: {', '.join(self.sections)}"


def parse_args(
    argv: list[str] | None = None, *, need_files: bool = True, problems: Problems | None = None
) -> JobConfig:
    """Build and validate a JobConfig from defaults, ``--job.config_file`` and CLI overrides.

    Every problem found is reported at once (ConfigErrors, one line each), or, when ``problems``
    is given, added to it (the config is then returned as far as it could be built, so that
    later checks can report theirs too). Old upstream key names are applied through the alias
    table and leave one line each in ``cfg.warnings``. ``need_files=False`` skips the checks that
    input files exist (for tools that only read the configuration, like the memory estimate)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    cli = split_cli(argv)
    found = Problems() if problems is None else problems
    config_file = next((s.raw for s in reversed(cli) if s.written == "job.config_file"), None)
    settings = toml_settings(config_file, found) if config_file else []
    settings += [s for s in cli if s.written != "job.config_file"]
    cfg = _config_class(settings, found)()
    builder = _Builder(cfg, found)
    for n, s in enumerate(builder.in_known_sections(settings)):
        with found.collect():
            builder.apply(n, s)
    builder.finish()
    cfg.job.config_file = config_file
    with found.collect():
        check_values(cfg, need_files=need_files)
    for line in config_warnings(cfg):
        if line not in cfg.warnings:
            cfg.warnings.append(line)
    if problems is None:
        found.raise_if_any()
    return cfg


def _config_class(settings: list[Setting], problems: Problems) -> type[JobConfig]:
    """JobConfig, extended by ``job.custom_config_module`` when one is given."""
    names = ("job.custom_config_module", "experimental.custom_args_module")
    module = next((s for s in reversed(settings) if s.written in names), None)
    if module is None or not module.raw:
        return JobConfig
    with problems.collect():
        return extend_job_config(str(module.raw), module.where())
    return JobConfig


def extend_job_config(module_name: str, where: str = "job.custom_config_module") -> type:
    """JobConfig merged with the ``JobConfig`` dataclass of a user's module (a dotted module name
    or a .py file): its new sections are added and its keys join ours in shared sections."""
    mod = import_user_module(module_name, where, "a JobConfig dataclass")
    custom = getattr(mod, "JobConfig", None)
    if not dataclasses.is_dataclass(custom):
        raise ConfigError(f"{where}: '{module_name}' defines no JobConfig dataclass")
    ours = sections()
    merged = []
    for name, section_cls in sections(custom).items():
        if name in ours and section_cls is not ours[name]:
            section_cls = dataclasses.make_dataclass(
                ours[name].__name__, [], bases=(section_cls, ours[name])
            )
        merged.append((name, section_cls, field(default_factory=section_cls)))
    return dataclasses.make_dataclass("JobConfig", merged, bases=(JobConfig,))


def import_user_module(name: str, where: str, what: str) -> types.ModuleType:
    """A user's module, by dotted name or .py file path; ConfigError naming ``where`` if it
    cannot be imported (``what``: what the module should provide, for the message)."""
    try:
        if not name.endswith(".py"):
            return importlib.import_module(name)
        module_name = os.path.basename(name)[:-3]
        spec = importlib.util.spec_from_file_location(module_name, name)
        if spec is None or spec.loader is None:
            raise ImportError(f"cannot load {name}")
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module  # so that its dataclasses resolve their annotations
        spec.loader.exec_module(module)
        return module
    except (ImportError, OSError, SyntaxError) as e:
        raise ConfigError(
            f"{where}: cannot import '{name}' ({e}); give an importable module name or a .py "
            f"file that provides {what}"
        ) from None
