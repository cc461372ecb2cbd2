"""``[eval]`` mistakes found by the job plan (preflight), each in one line before anything runs."""

from __future__ import annotations

import pytest
from repo_paths import ASSETS, ROOT

from torchtitan.config.parse import parse_args
from torchtitan.errors import ConfigError
from torchtitan.train.plan import plan_job

CONFIG = str(ROOT / "train_configs" / "debug_model.toml")
PIQA = f"piqa:{ASSETS / 'eval' / 'piqa.jsonl'}"


@pytest.mark.parametrize(
    "overrides, world, message",
    [
        ([], 1, "eval.enable: true, but eval.tasks is empty"),
        (["--eval.tasks", "piqa:/no/such.jsonl"], 1, "eval.tasks: task 'piqa': no file /no/such"),
        (["--eval.tasks", "mmlu:x.jsonl"], 1, "task 'mmlu' is not built in"),
        (
            [
                "--eval.tasks",
                PIQA,
                "--eval.seq_len",
                "64",
                "--parallelism.pipeline_parallel_degree",
                "2",
            ],
            2,
            "eval.seq_len / local_batch_size: with pp=2 eval batches must have the training shape",
        ),
        (["--eval.tasks", PIQA, "--eval.seq_len", "100000"], 1, "eval.seq_len: 100000 is longer"),
    ],
)
def test_preflight_names_what_is_wrong_with_eval(overrides, world, message):
    cfg = parse_args(["--job.config_file", CONFIG, "--eval.enable", *overrides])
    with pytest.raises(ConfigError) as e:
        plan_job(cfg, world_size=world)
    assert message in str(e.value)


def test_a_good_eval_section_plans():
    cfg = parse_args(["--job.config_file", CONFIG, "--eval.enable", "--eval.tasks", PIQA])
    assert plan_job(cfg, world_size=1).global_batch_size > 0
