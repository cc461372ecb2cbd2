"""Downstream evaluation against lm-evaluation-harness itself (one process: the in-process lane).

The debug model trains 4 steps with ``[eval]`` on the shipped task files (tests/assets/eval) and
exports itself. lm-eval's own ``hf`` model, run on the export over the same files (local task
YAMLs whose prompts and document processing are lm-eval's own), gives the same ``acc`` and
``acc_norm`` and every choice's log-likelihood within 1e-4; so does our ``torchtitan`` lm-eval
model on the DCP checkpoint, from Python and from lm-eval's command line
(``python -m torchtitan.lm_eval``). The layouts are tests/e2e/test_downstream_eval.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from downstream_runs import EVAL, STEPS, TASKS, TRAIN_ARGS, assert_scored, samples
from launcher import launch, local_batch
from repo_paths import ROOT, TIKTOKEN_PATH

lm_eval = pytest.importorskip("lm_eval")

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


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> Path:
    """One process: the in-loop scores, the DCP checkpoint step-4 and its export step-4-hf."""
    tmp = tmp_path_factory.mktemp("one")
    args = [*TRAIN_ARGS, *local_batch(8), "--checkpoint.enable", "--checkpoint.interval"]
    out = launch(tmp, *args, str(STEPS), "--checkpoint.last_save_in_hf")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert_scored(out.stdout + out.stderr)
    return tmp / "out"


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
    worst = _assert_same_scores(samples(one_process), results)
    print(f"\nin-loop vs lm-eval hf: max |log-likelihood diff| {worst:.2e}")


@pytest.mark.slow
def test_the_torchtitan_lm_eval_model_on_the_dcp_checkpoint(one_process, task_dir, tmp_path):
    """From Python (``simple_evaluate(model=TorchTitanLM(...))``) and from lm-eval's command
    line with our model registered (``python -m torchtitan.lm_eval --model torchtitan``)."""
    from torchtitan.lm_eval import TorchTitanLM

    dcp = one_process / "checkpoint" / f"step-{STEPS}"
    lm = TorchTitanLM(checkpoint=str(dcp), flavor="debugmodel", tokenizer=str(TIKTOKEN_PATH))
    _assert_same_scores(samples(one_process), _lm_eval(lm, task_dir))

    model_args = f"checkpoint={dcp},flavor=debugmodel,tokenizer={TIKTOKEN_PATH}"
    cmd = [sys.executable, "-m", "torchtitan.lm_eval", "--model", "torchtitan"]
    cmd += ["--model_args", model_args, "--tasks", "tt_arc_easy", "--include_path", str(task_dir)]
    cmd += ["--output_path", str(tmp_path / "results"), "--batch_size", "4"]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    (written,) = list((tmp_path / "results").rglob("results_*.json"))
    acc = json.loads(written.read_text())["results"]["tt_arc_easy"]["acc,none"]
    arc = samples(one_process)["arc_easy"]
    assert acc == pytest.approx(sum(s["acc"] for s in arc) / len(arc), abs=1e-12)


@pytest.mark.slow
def test_rolling_log_likelihoods_and_greedy_text_are_the_hf_models(one_process):
    """``loglikelihood_rolling`` (a text longer than the model's 128 positions: several
    windows) and ``generate_until`` (greedy, a stop string, a token budget) of our model on the
    export against lm-eval's ``hf`` model on the same folder."""
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    from torchtitan.lm_eval import TorchTitanLM

    export = str(one_process / "checkpoint" / f"step-{STEPS}-hf")
    ours = TorchTitanLM(checkpoint=export, batch_size=4)
    theirs = HFLM(pretrained=export, device="cpu", batch_size=4, dtype="float32")
    texts = ["def main(args):\n    return 0\n", "The module reads the files it is given. " * 30]
    rolling = [Instance("loglikelihood_rolling", {}, (t,), i) for i, t in enumerate(texts)]
    mine, hf = ours.loglikelihood_rolling(rolling), theirs.loglikelihood_rolling(rolling)
    assert all(abs(a - b) < 1e-3 for a, b in zip(mine, hf, strict=True)), (mine, hf)
    assert len(ours.tok_encode(texts[1])) > 2 * ours.max_length  # several windows
    budget = {"until": ["\n\n"], "max_gen_toks": 12, "do_sample": False}
    gen = [Instance("generate_until", {}, (p, budget), i) for i, p in enumerate(["def ", "The "])]
    assert ours.generate_until(gen) == theirs.generate_until(gen)
