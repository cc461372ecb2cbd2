"""Downstream evaluation against lm-evaluation-harness itself.

The debug model trains 4 steps with ``[eval]`` on the shipped task files (ARC, HellaSwag, PIQA
and Winogrande layouts, tests/assets/eval) and exports itself. lm-eval's own ``hf`` model, run on
the export over the same files (local task YAMLs whose prompts and document processing are
lm-eval's own), gives the same ``acc`` and ``acc_norm`` and every choice's log-likelihood within
1e-4; so does our ``torchtitan`` lm-eval model on the DCP checkpoint, from Python and from the
command line. FSDP 2, TP 2, PP 2 and CP 2 score as one process.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from launcher import PP2_1F1B, local_batch, pooled
from repo_paths import ASSETS, ROOT, TIKTOKEN_PATH

lm_eval = pytest.importorskip("lm_eval")

EVAL = ASSETS / "eval"
TASKS = ("arc_easy", "hellaswag", "piqa", "winogrande")
STEPS = 4
EVAL_ARGS = [
    "--eval.enable",
    "--eval.freq",
    str(STEPS),
    "--eval.tasks",
    ",".join(f"{t}:{EVAL / t}.jsonl" for t in TASKS),
]
# lm-eval task YAMLs over our files: lm-eval 0.4's prompts, and its own document processing
_YAML = {
    "arc_easy": 'doc_to_text: "Question: {{question}}\\nAnswer:"\n'
    'doc_to_target: "{{choices.label.index(answerKey)}}"\n'
    'doc_to_choice: "{{choices.text}}"\n',
    "hellaswag": "process_docs: !function lm_eval_functions.hellaswag_docs\n"
    'doc_to_text: "{{query}}"\ndoc_to_target: "{{label}}"\ndoc_to_choice: "choices"\n',
    "piqa": 'doc_to_text: "Question: {{goal}}\\nAnswer:"\ndoc_to_target: label\n'
    'doc_to_choice: "{{[sol1, sol2]}}"\n',
    "winogrande": "doc_to_text: !function lm_eval_functions.winogrande_text\n"
    "doc_to_target: !function lm_eval_functions.winogrande_target\n"
    "doc_to_choice: !function lm_eval_functions.winogrande_choice\n",
}
_FUNCTIONS = """\
from lm_eval.tasks.hellaswag.utils import process_docs as hellaswag_docs
from lm_eval.tasks.winogrande.preprocess_winogrande import (
    doc_to_choice as winogrande_choice,
    doc_to_target as winogrande_target,
    doc_to_text as winogrande_text,
)
"""


def _run(pools, tmp_path: Path, ngpu: int, *args: str) -> Path:
    out = pooled(
        pools,
        tmp_path,
        "--training.steps",
        str(STEPS),
        "--training.seq_len",
        "128",
        "--training.global_batch_size",
        "8",
        "--training.mixed_precision_param",
        "float32",
        "--debug.seed",
        "42",
        "--debug.deterministic",
        *EVAL_ARGS,
        *args,
        ngpu=ngpu,
    )
    for task in TASKS:
        assert f"eval: step {STEPS}  {task}  acc: " in out.stdout, out.stdout[-3000:]
    return tmp_path / "out"


def _samples(out: Path) -> dict[str, list[dict]]:
    folder = out / "eval" / f"step-{STEPS}"
    return {
        t: [json.loads(line) for line in (folder / f"{t}.jsonl").read_text().splitlines()]
        for t in TASKS
    }


@pytest.fixture(scope="module")
def one_process(pools, tmp_path_factory):
    """One process: the in-loop scores, the DCP checkpoint step-4 and its export step-4-hf."""
    tmp = tmp_path_factory.mktemp("one")
    return _run(
        pools,
        tmp,
        1,
        *local_batch(8),
        "--checkpoint.enable",
        "--checkpoint.interval",
        str(STEPS),
        "--checkpoint.last_save_in_hf",
    )


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("lm_eval_tasks")
    (folder / "lm_eval_functions.py").write_text(_FUNCTIONS)
    for task in TASKS:
        metrics = ["acc"] if task == "winogrande" else ["acc", "acc_norm"]
        (folder / f"tt_{task}.yaml").write_text(
            f"task: tt_{task}\ndataset_path: json\n"
            f"dataset_kwargs:\n  data_files:\n    validation: {EVAL / task}.jsonl\n"
            "output_type: multiple_choice\nvalidation_split: validation\n"
            + _YAML[task]
            + "metric_list:\n"
            + "".join(f"  - metric: {m}\n" for m in metrics)
        )
    return folder


def _lm_eval(model, task_dir: Path, **kwargs) -> dict:
    from lm_eval.tasks import TaskManager

    return lm_eval.simple_evaluate(
        model=model,
        tasks=[f"tt_{t}" for t in TASKS],
        task_manager=TaskManager(include_path=str(task_dir)),
        log_samples=True,
        batch_size=8,
        **kwargs,
    )


def _assert_same_scores(ours: dict[str, list[dict]], results: dict) -> float:
    """Every task's acc and acc_norm equal, every choice's log-likelihood within 1e-4; the
    largest difference."""
    worst = 0.0
    for task in TASKS:
        theirs = sorted(results["samples"][f"tt_{task}"], key=lambda s: s["doc_id"])
        assert len(theirs) == len(ours[task])
        for mine, their in zip(ours[task], theirs):
            lls = [float(r[0]) for r in their["filtered_resps"]]
            worst = max(worst, *(abs(a - b) for a, b in zip(mine["lls"], lls)))
            assert len(lls) == len(mine["lls"])
        scores = results["results"][f"tt_{task}"]
        n = len(ours[task])
        for metric in ("acc", "acc_norm") if task != "winogrande" else ("acc",):
            mean = sum(s[metric] for s in ours[task]) / n
            assert scores[f"{metric},none"] == pytest.approx(mean, abs=1e-12), (task, metric)
    assert worst < 1e-4, worst
    return worst


@pytest.mark.slow
def test_in_loop_scores_are_lm_evals_on_the_export(one_process, task_dir):
    results = _lm_eval(
        "hf",
        task_dir,
        model_args={"pretrained": str(one_process / "checkpoint" / f"step-{STEPS}-hf")},
        device="cpu",
    )
    worst = _assert_same_scores(_samples(one_process), results)
    print(f"\nin-loop vs lm-eval hf: max |log-likelihood diff| {worst:.2e}")


@pytest.mark.slow
def test_the_torchtitan_lm_eval_model_on_the_dcp_checkpoint(one_process, task_dir, tmp_path):
    """From Python (``simple_evaluate(model=TorchTitanLM(...))``) and from lm-eval's command
    line with our model registered (``python -m torchtitan.lm_eval --model torchtitan``)."""
    from torchtitan.lm_eval import TorchTitanLM

    dcp = one_process / "checkpoint" / f"step-{STEPS}"
    lm = TorchTitanLM(checkpoint=str(dcp), flavor="debugmodel", tokenizer=str(TIKTOKEN_PATH))
    _assert_same_scores(_samples(one_process), _lm_eval(lm, task_dir))

    model_args = f"checkpoint={dcp},flavor=debugmodel,tokenizer={TIKTOKEN_PATH}"
    cmd = [sys.executable, "-m", "torchtitan.lm_eval", "--model", "torchtitan"]
    cmd += ["--model_args", model_args, "--tasks", "tt_arc_easy", "--include_path", str(task_dir)]
    cmd += ["--output_path", str(tmp_path / "results"), "--batch_size", "4"]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    (written,) = list((tmp_path / "results").rglob("results_*.json"))
    acc = json.loads(written.read_text())["results"]["tt_arc_easy"]["acc,none"]
    arc = _samples(one_process)["arc_easy"]
    assert acc == pytest.approx(sum(s["acc"] for s in arc) / len(arc), abs=1e-12)


LAYOUTS = {
    "fsdp2": (2, local_batch(4)),
    "tp2": (2, [*local_batch(8), "--parallelism.tensor_parallel_degree", "2"]),
    "pp2": (2, [*local_batch(8), *PP2_1F1B]),
    "cp2": (2, [*local_batch(8), "--parallelism.context_parallel_degree", "2"]),
}


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_layout_scores_as_one_process(pools, one_process, tmp_path, layout):
    ngpu, args = LAYOUTS[layout]
    ours, base = _samples(_run(pools, tmp_path, ngpu, *args)), _samples(one_process)
    worst = 0.0
    for task in TASKS:
        for mine, one in zip(ours[task], base[task], strict=True):
            assert (mine["acc"], mine["acc_norm"]) == (one["acc"], one["acc_norm"]), task
            worst = max(worst, *(abs(a - b) for a, b in zip(mine["lls"], one["lls"])))
    print(f"\n{layout}: max |log-likelihood diff| vs one process {worst:.2e}")
    assert worst < 1e-4
