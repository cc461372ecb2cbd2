"""Multiple-choice tasks read from local JSON-lines files, in lm-evaluation-harness' document shape.

A task is a file of documents (one JSON object per line) plus how to read a document: lm-eval's
``doc_to_text`` (the context), ``doc_to_choice`` (the choices) and ``doc_to_target`` (the gold
choice: its index, or its text), each the name of a field or a Jinja template over the
document's fields, rendered as lm-eval renders them (``StrictUndefined``, trailing newlines
kept; a rendered list or number read back as a Python literal), and the ``target_delimiter``
put between the context and each choice (default one space). The requests of a document are
lm-eval's: ``(context, delimiter + choice)`` for each choice; for a task whose ``doc_to_text``
gives an index (Winogrande: the choices are contexts ending at the blank), ``(choice, delimiter
+ target)`` for each choice, the gold being that index.

The layouts of common public tasks are built in (:data:`BUILTIN`, copied from lm-eval 0.4's task
YAML files, with HellaSwag's preprocessing); a task entry names one of them with ``name``, or
gives its own fields. A task entry (a table of ``eval.tasks``):

* ``name``: the task's name in logs and metrics; a built-in name takes that layout;
* ``path``: the JSON-lines file;
* ``doc_to_text``, ``doc_to_choice``, ``doc_to_target``, ``target_delimiter``: a layout of its
  own (all three ``doc_to_*`` keys, or a built-in ``layout`` to start from);
* ``layout``: a built-in layout for a task named otherwise (``name = "arc_easy_dev"``);
* ``limit``: read at most this many documents (default: all).

A malformed file stops the run with one line naming the file, the line and the field.
"""

from __future__ import annotations

import ast
import json
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torchtitan.errors import ConfigError, DataError

__all__ = ["BUILTIN", "Doc", "Layout", "TaskSpec", "parse_tasks", "read_task"]


@dataclass(frozen=True)
class Layout:
    """How a document becomes requests: lm-eval's keys, each a field name, a Jinja template, or
    (built in only) a function of the document. ``prepare``: a function applied to each document
    first (lm-eval's ``process_docs``, one document at a time); ``multiple_input``: whether
    ``doc_to_text`` gives the gold index and ``doc_to_choice`` the contexts (Winogrande)."""

    doc_to_text: str | Callable[[dict], Any]
    doc_to_choice: str | Callable[[dict], Any]
    doc_to_target: str | Callable[[dict], Any]
    target_delimiter: str = " "
    prepare: Callable[[dict], dict] | None = None
    metrics: tuple[str, ...] = ("acc", "acc_norm")  # what the task reports (lm-eval's list)


def _hellaswag_clean(text: str) -> str:
    text = text.strip().replace(" [title]", ". ")
    return re.sub("\\[.*?\\]", "", text).replace("  ", " ")


def _hellaswag(doc: dict) -> dict:
    """lm-eval's ``hellaswag/utils.py`` ``process_docs``: the query and the cleaned endings."""
    ctx = doc["ctx_a"] + " " + doc["ctx_b"].capitalize()
    return {
        **doc,
        "query": _hellaswag_clean(doc["activity_label"] + ": " + ctx),
        "choices": [_hellaswag_clean(e) for e in doc["endings"]],
        "gold": int(doc["label"]),
    }


def _winogrande_gold(doc: dict) -> int:
    return {"1": 0, "2": 1}[str(doc["answer"])]


def _winogrande_target(doc: dict) -> str:
    return doc["sentence"][doc["sentence"].index("_") + 1 :].strip()


def _winogrande_contexts(doc: dict) -> list[str]:
    blank = doc["sentence"].index("_")
    return [doc["sentence"][:blank] + opt for opt in (doc["option1"], doc["option2"])]


_ARC = Layout(
    "Question: {{question}}\nAnswer:",
    "{{choices.text}}",
    "{{choices.label.index(answerKey)}}",
)
#: lm-eval 0.4's layouts of common public multiple-choice tasks (their Hugging Face datasets'
#: fields), by task name
BUILTIN: dict[str, Layout] = {
    "hellaswag": Layout("{{query}}", "choices", "{{label}}", prepare=_hellaswag),
    "arc_easy": _ARC,
    "arc_challenge": _ARC,
    "piqa": Layout("Question: {{goal}}\nAnswer:", "{{[sol1, sol2]}}", "label"),
    "openbookqa": Layout(
        "question_stem", "{{choices.text}}", "{{choices.label.index(answerKey.lstrip())}}"
    ),
    "winogrande": Layout(
        _winogrande_gold, _winogrande_contexts, _winogrande_target, metrics=("acc",)
    ),
    "sciq": Layout(
        "{{support.lstrip()}}\nQuestion: {{question}}\nAnswer:",
        "{{[distractor1, distractor2, distractor3, correct_answer]}}",
        "3",
    ),
}


@dataclass(frozen=True)
class TaskSpec:
    """One entry of ``eval.tasks``, checked: its name, file, layout and document limit."""

    name: str
    path: str
    layout: Layout
    limit: int | None = None


@dataclass(frozen=True)
class Doc:
    """One document's requests ``(context, continuation)``, the choices as lm-eval measures
    their length (``acc_norm``), and the gold index."""

    requests: tuple[tuple[str, str], ...]
    choices: tuple[str, ...]
    gold: int
    index: int = 0  # the document's place in its file
    extra: dict = field(default_factory=dict, compare=False)


_KEYS = ("name", "path", "layout", "limit", "doc_to_text", "doc_to_choice", "doc_to_target")
_KEYS += ("target_delimiter",)
# what each key may hold (lm-eval's YAML forms: a field or template, a fixed index, a list or a
# mapping of the choices)
_TYPES: dict[str, tuple[type, ...]] = {
    "layout": (str,),
    "target_delimiter": (str,),
    "doc_to_text": (str, int),
    "doc_to_choice": (str, list, dict),
    "doc_to_target": (str, int),
}


def parse_tasks(raw: Any, key: str = "eval.tasks") -> list[TaskSpec]:
    """The checked task entries of ``raw``: ``[[eval.tasks]]`` tables, JSON of them, or the
    command line's ``name:path,name:path`` (built-in layouts)."""
    if isinstance(raw, str):
        raw = _parse_text(raw, key)
    if not isinstance(raw, list) or not raw:
        raise ConfigError(f"{key}: expected a list of task tables with name and path, got {raw!r}")
    specs = [_spec(entry, f"{key}[{i}]") for i, entry in enumerate(raw)]
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise ConfigError(f"{key}: task names must differ, got {names}")
    return specs


def _parse_text(text: str, key: str) -> list:
    text = text.strip()
    if text.startswith("["):
        try:
            return json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{key}: not valid JSON ({e.msg} at character {e.pos})") from e
    entries = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, sep, path = part.partition(":")
        if not sep or not name or not path:
            raise ConfigError(
                f"{key}: '{part}' is not name:path (e.g. hellaswag:data/hellaswag.jsonl)"
            )
        entries.append({"name": name, "path": path})
    return entries


def _spec(entry: Any, where: str) -> TaskSpec:
    if not isinstance(entry, dict):
        raise ConfigError(f"{where}: expected a table with name and path, got {entry!r}")
    unknown = sorted(set(entry) - set(_KEYS))
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {unknown}; valid: {', '.join(_KEYS)}")
    for k in ("name", "path"):
        if not isinstance(entry.get(k), str) or not entry[k]:
            raise ConfigError(f"{where}: needs {k} (a string)")
    name = entry["name"]
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", name):
        raise ConfigError(
            f"{where}: name {name!r} names metrics and sample files: use letters, digits, '_', "
            "'.' and '-'"
        )
    for k, kinds in _TYPES.items():
        if k in entry and not isinstance(entry[k], kinds):
            want = " or ".join(t.__name__ for t in kinds)
            raise ConfigError(f"{where}.{k}: {entry[k]!r} is not a {want}")
    base_name = entry.get("layout", name if name in BUILTIN else None)
    if base_name is not None and base_name not in BUILTIN:
        raise ConfigError(
            f"{where}: layout '{base_name}' is not built in; built in: {', '.join(BUILTIN)}"
        )
    own = {k: entry[k] for k in ("doc_to_text", "doc_to_choice", "doc_to_target") if k in entry}
    if base_name is None and len(own) < 3:
        missing = sorted({"doc_to_text", "doc_to_choice", "doc_to_target"} - set(own))
        raise ConfigError(
            f"{where}: task '{name}' is not built in ({', '.join(BUILTIN)}): give layout, or "
            f"doc_to_text, doc_to_choice and doc_to_target (missing {', '.join(missing)})"
        )
    base = BUILTIN[base_name] if base_name is not None else Layout("", "", "")
    delimiter = entry.get("target_delimiter", base.target_delimiter)
    layout = Layout(
        **{**base.__dict__, **own, "target_delimiter": delimiter}  # type: ignore[arg-type]
    )
    limit = entry.get("limit")
    if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or limit < 1):
        raise ConfigError(f"{where}: limit must be a positive integer, got {limit!r}")
    return TaskSpec(name, entry["path"], layout, limit)


# ----------------------------------------------------------------------------- documents


def read_task(spec: TaskSpec) -> list[Doc]:
    """The task's documents (at most ``spec.limit``), each as its requests; a line that is not
    a JSON object, or whose fields do not give a context, choices and a gold choice, raises a
    DataError naming the file, the line and the field."""
    if not os.path.isfile(spec.path):
        raise ConfigError(f"eval.tasks: task '{spec.name}': no file {spec.path}")
    docs: list[Doc] = []
    fields: set[str] = set()  # the first document's: what names a field (lm-eval's columns)
    with open(spec.path, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            if spec.limit is not None and len(docs) >= spec.limit:
                break
            where = f"{spec.path}:{number}"
            try:
                raw = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{where}: not a JSON object ({e.msg})") from e
            if not isinstance(raw, dict):
                raise DataError(f"{where}: not a JSON object but {type(raw).__name__}")
            doc = _prepared(spec.layout, raw, where)
            if not docs:
                fields = set(doc)
            docs.append(_doc(spec.layout, doc, where, len(docs), fields))
    if not docs:
        raise DataError(f"{spec.path}: task '{spec.name}' has no documents")
    return docs


def _prepared(layout: Layout, raw: dict, where: str) -> dict:
    try:
        return layout.prepare(raw) if layout.prepare is not None else raw
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise DataError(f"{where}: this task's documents need field {e}") from e


def _doc(layout: Layout, doc: dict, where: str, index: int, fields: set[str]) -> Doc:
    """A (prepared) document's requests, choices and gold index."""
    text = _render(layout.doc_to_text, doc, where, "doc_to_text", fields)
    choices = _render(layout.doc_to_choice, doc, where, "doc_to_choice", fields)
    if isinstance(choices, dict):  # lm-eval: a mapping's values are the choices
        choices = list(choices.values())
    target = _render(layout.doc_to_target, doc, where, "doc_to_target", fields)
    if (
        not isinstance(choices, list)
        or len(choices) < 2
        or not all(isinstance(c, str) for c in choices)
    ):
        raise DataError(
            f"{where}: doc_to_choice must give a list of 2 or more strings, got {choices!r}"
        )
    delim = layout.target_delimiter
    if isinstance(text, int):  # the choices are contexts, the target the one continuation
        requests = tuple((c, f"{delim}{target}") for c in choices)
        gold = text
    else:
        if not isinstance(text, str):
            raise DataError(f"{where}: doc_to_text must give a string, got {text!r}")
        requests = tuple((text, f"{delim}{c}") for c in choices)
        gold = choices.index(target) if isinstance(target, str) and target in choices else target
    empty = [i for i, (_, cont) in enumerate(requests) if not cont]
    if empty:  # nothing to score (lm-eval stops on it too)
        raise DataError(
            f"{where}: choice {empty[0]} gives an empty continuation (target_delimiter "
            f"{delim!r}); every choice needs text"
        )
    if isinstance(gold, bool) or not isinstance(gold, int) or not 0 <= gold < len(choices):
        raise DataError(
            f"{where}: doc_to_target gives {target!r}, not one of the {len(choices)} choices "
            "or their index"
        )
    return Doc(requests, tuple(choices), gold, index)


def _render(how: Any, doc: dict, where: str, key: str, fields: set[str]) -> Any:
    """lm-eval's reading of a ``doc_to_*`` key: a function of the document, a fixed value (an
    index, a list of choices), a field's value (a field of the task's first document: missing
    from a later one is an error, not a literal), or a Jinja template whose text is read back as
    a literal where it looks like one (a list, or an index)."""
    if callable(how):
        try:
            return how(doc)
        except (KeyError, ValueError, IndexError, TypeError) as e:
            raise DataError(f"{where}: {key}: this task's documents need field {e}") from e
    if not isinstance(how, str):
        return how
    if how in fields:
        if how not in doc:
            raise DataError(f"{where}: {key}: no field '{how}' (the task's first document has it)")
        return doc[how]
    from jinja2 import StrictUndefined, TemplateError
    from jinja2.sandbox import SandboxedEnvironment

    class Strict(StrictUndefined):  # a missing field inside a list literal too
        def __repr__(self) -> str:
            self._fail_with_undefined_error()
            return ""

    env = SandboxedEnvironment(undefined=Strict, keep_trailing_newline=True)
    env.filters["regex_replace"] = lambda text, pattern, repl, count=0: re.sub(
        pattern, repl, text, count=count
    )  # lm-eval's filter
    try:
        text = env.from_string(how).render(**doc)
    except TemplateError as e:
        raise DataError(f"{where}: {key} '{how}': {e.message}") from e
    except (KeyError, ValueError, IndexError, TypeError) as e:
        raise DataError(f"{where}: {key} '{how}': {type(e).__name__} {e}") from e
    if key != "doc_to_choice" and text.isdigit():  # an index
        return int(text)
    if key == "doc_to_text" or (text[:1], text[-1:]) != ("[", "]"):
        return text
    try:
        return ast.literal_eval(text)
    except (SyntaxError, ValueError):
        return text
