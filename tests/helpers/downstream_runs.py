"""What the downstream-evaluation tests share (tests/e2e/test_downstream_eval.py, the layouts in
the process lane; tests/e2e/test_lm_eval_oracle.py, lm-eval itself, one process): the shipped
task files, the training arguments, and the per-document samples a run writes."""

from __future__ import annotations

import json
from pathlib import Path

from repo_paths import ASSETS

EVAL = ASSETS / "eval"
TASKS = ("arc_easy", "hellaswag", "piqa", "winogrande")
STEPS = 4
# the debug model trains STEPS steps of 8 sequences of 128 in float32, scored at the last
TRAIN_ARGS = [
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
    "--eval.enable",
    "--eval.freq",
    str(STEPS),
    "--eval.tasks",
    ",".join(f"{t}:{EVAL / t}.jsonl" for t in TASKS),
]


def assert_scored(stdout: str) -> None:
    """Every task's console line at the last step."""
    for task in TASKS:
        assert f"eval: step {STEPS}  {task}  acc: " in stdout, stdout[-3000:]


def samples(out: Path) -> dict[str, list[dict]]:
    """Each task's per-document lines (eval/step-N/TASK.jsonl) of the run in ``out``."""
    folder = out / "eval" / f"step-{STEPS}"
    return {
        t: [json.loads(line) for line in (folder / f"{t}.jsonl").read_text().splitlines()]
        for t in TASKS
    }
