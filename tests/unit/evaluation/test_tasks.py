"""Task entries and files: the built-in layouts give lm-eval's requests (checked against lm-eval
itself in tests/e2e/test_downstream_eval.py), custom layouts are Jinja over the fields, and every
mistake is one line naming the key, or the file, line and field."""

from __future__ import annotations

import json
import re

import pytest
from repo_paths import ASSETS

from torchtitan.errors import ConfigError, DataError
from torchtitan.evaluation.tasks import parse_tasks, read_task

EVAL = ASSETS / "eval"


def _one(**entry):
    return parse_tasks([entry])[0]


def test_the_command_line_names_built_in_tasks_and_files():
    specs = parse_tasks(f"arc_easy:{EVAL}/arc_easy.jsonl, piqa:{EVAL}/piqa.jsonl")
    assert [(s.name, s.path) for s in specs] == [
        ("arc_easy", f"{EVAL}/arc_easy.jsonl"),
        ("piqa", f"{EVAL}/piqa.jsonl"),
    ]
    as_json = parse_tasks(json.dumps([{"name": "dev", "layout": "piqa", "path": "p", "limit": 2}]))
    assert as_json[0].limit == 2 and as_json[0].layout.doc_to_text.startswith("Question: {{goal}}")


@pytest.mark.parametrize(
    "raw, message",
    [
        ("arc_easy", "eval.tasks: 'arc_easy' is not name:path"),
        ([{"name": "x", "path": "p", "doc_to_text": "q"}], "task 'x' is not built in"),
        ([{"name": "x", "path": "p", "layout": "mmlu"}], "layout 'mmlu' is not built in"),
        ([{"name": "piqa", "path": "p", "splt": 1}], "unknown key(s) ['splt']"),
        ([{"name": "piqa"}], "eval.tasks[0]: needs path"),
        ([{"name": "piqa", "path": "p", "limit": 0}], "limit must be a positive integer"),
        ([{"name": "piqa", "path": "a"}, {"name": "piqa", "path": "b"}], "names must differ"),
        ("[{", "eval.tasks: not valid JSON"),
    ],
)
def test_a_bad_entry_is_one_line_naming_what_is_wrong(raw, message):
    with pytest.raises(ConfigError) as e:
        parse_tasks(raw)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_built_in_layouts_give_lm_evals_requests():
    """ARC: the question as context, each choice after a space; HellaSwag: the cleaned query
    (its "[title]" made a sentence end, the second part capitalized) and endings; Winogrande:
    the choices are the contexts up to the blank, the rest of the sentence the continuation."""
    arc = read_task(_one(name="arc_easy", path=str(EVAL / "arc_easy.jsonl")))
    assert arc[0].requests[0] == (
        "Question: Which keyword defines a function in Python?\nAnswer:",
        " def",
    )
    assert [d.gold for d in arc[:4]] == [0, 2, 1, 3]
    hs = read_task(_one(name="hellaswag", path=str(EVAL / "hellaswag.jsonl")))
    assert hs[3].requests[0][0] == (
        "Fixing a bug. Find the line.: A traceback names the file and the line. The developer"
    )
    assert hs[1].gold == 1 and len(hs[1].requests) == 4
    wg = read_task(_one(name="winogrande", path=str(EVAL / "winogrande.jsonl")))
    assert wg[0].requests == (
        ("The list was longer than the tuple because the list", " held more items."),
        ("The list was longer than the tuple because the tuple", " held more items."),
    )
    assert wg[3].gold == 1 and wg[0].choices == tuple(c for c, _ in wg[0].requests)


def test_a_custom_layout_is_jinja_over_the_fields(tmp_path):
    path = tmp_path / "qa.jsonl"
    path.write_text(
        json.dumps({"q": "2 + 2", "options": ["3", "4"], "answer": "4"})
        + "\n\n"
        + json.dumps({"q": "3 + 3", "options": ["6", "5"], "answer": "6"})
        + "\n"
    )
    spec = _one(
        name="sums",
        path=str(path),
        doc_to_text="{{q}} =",
        doc_to_choice="options",
        doc_to_target="answer",
        target_delimiter="  ",
        limit=1,
    )
    docs = read_task(spec)
    assert len(docs) == 1  # limit
    assert docs[0].requests == (("2 + 2 =", "  3"), ("2 + 2 =", "  4")) and docs[0].gold == 1
    index_spec = _one(
        name="sums2",
        path=str(path),
        doc_to_text="{{q}} =",
        doc_to_choice="{{options}}",
        doc_to_target="{{options.index(answer)}}",
    )
    assert [d.gold for d in read_task(index_spec)] == [1, 0]


@pytest.mark.parametrize(
    "line, message",
    [
        ("{not json", ":2: not a JSON object"),
        ("[1, 2]", ":2: not a JSON object but list"),
        (
            '{"goal": "g", "sol1": "a", "label": 0}',
            ":2: doc_to_choice '{{[sol1, sol2]}}': 'sol2' is undefined",
        ),
        (
            '{"goal": "g", "sol1": "a", "sol2": "b", "label": 2}',
            ":2: doc_to_target gives 2, not one of the 2 choices",
        ),
    ],
)
def test_a_malformed_line_names_the_file_line_and_field(tmp_path, line, message):
    path = tmp_path / "piqa.jsonl"
    good = json.dumps({"goal": "g", "sol1": "a", "sol2": "b", "label": 0})
    path.write_text(good + "\n" + line + "\n")
    with pytest.raises(DataError) as e:
        read_task(_one(name="piqa", path=str(path)))
    assert f"{path}{message}" in str(e.value) and "\n" not in str(e.value)


def test_a_missing_or_empty_file_is_named(tmp_path):
    with pytest.raises(ConfigError, match="task 'piqa': no file"):
        read_task(_one(name="piqa", path=str(tmp_path / "none.jsonl")))
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(DataError, match="task 'piqa' has no documents"):
        read_task(_one(name="piqa", path=str(tmp_path / "empty.jsonl")))


def test_a_field_missing_from_a_later_document_is_named_not_read_as_text(tmp_path):
    """lm-eval decides once whether a key names a field (its dataset's columns): a document
    without the field is an error, not the literal text 'question_stem'."""
    path = tmp_path / "obqa.jsonl"
    good = {"question_stem": "q", "choices": {"text": ["a", "b"], "label": ["A", "B"]}}
    path.write_text(json.dumps({**good, "answerKey": "A"}) + "\n" + json.dumps({"x": 1}) + "\n")
    with pytest.raises(DataError, match=r":2: doc_to_text: no field 'question_stem'"):
        read_task(_one(name="openbookqa", path=str(path)))


def test_lm_evals_fixed_choices_and_targets(tmp_path):
    """A list (or mapping) of choices and an integer target, as lm-eval's YAML files give them."""
    path = tmp_path / "yn.jsonl"
    path.write_text(json.dumps({"q": "Is it?"}) + "\n")
    fixed = _one(
        name="yn",
        path=str(path),
        doc_to_text="{{q}}",
        doc_to_choice=["no", "yes"],
        doc_to_target=1,
    )
    (doc,) = read_task(fixed)
    assert doc.requests == (("Is it?", " no"), ("Is it?", " yes")) and doc.gold == 1
    mapping = _one(
        name="yn2",
        path=str(path),
        doc_to_text="{{q}}",
        doc_to_choice={"n": "no", "y": "yes"},
        doc_to_target=0,
    )
    assert read_task(mapping)[0].choices == ("no", "yes")


@pytest.mark.parametrize(
    "entry, message",
    [
        ({"name": "mmlu/anatomy", "path": "p", "layout": "piqa"}, "name 'mmlu/anatomy' names"),
        ({"name": "x", "path": "p", "layout": ["piqa"]}, "eval.tasks[0].layout: ['piqa'] is not"),
        ({"name": "piqa", "path": "p", "doc_to_target": 1.5}, "doc_to_target: 1.5 is not a str"),
    ],
)
def test_names_and_key_types_are_checked(entry, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        parse_tasks([entry])


def test_an_empty_choice_is_refused(tmp_path):
    path = tmp_path / "e.jsonl"
    path.write_text(json.dumps({"q": "q", "c": ["a", ""], "g": 0}) + "\n")
    spec = _one(
        name="e",
        path=str(path),
        doc_to_text="q",
        doc_to_choice="c",
        doc_to_target="g",
        target_delimiter="",
    )
    with pytest.raises(DataError, match=":1: choice 1 gives an empty continuation"):
        read_task(spec)
