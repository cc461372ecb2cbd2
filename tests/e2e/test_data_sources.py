"""Training on a pretokenized corpus mixed with text, shuffled, through ./run_llama_train.sh (real
processes, gloo on CPU): parallel layouts against one process, exact resume on another layout,
tokens per source in the metrics, and one small text file training with a global batch larger
than its one row."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from launcher import (
    EQUIVALENCE_ARGS,
    EQUIVALENCE_STEPS,
    console_losses,
    pooled,
    tensorboard_run,
    tensorboard_scalars,
    tensorboard_scalars_all_runs,
    train_env,
)
from repo_paths import DEBUG_TOML, ROOT


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """The debug corpus (python_docs), pretokenized with the debug tokenizer by the script."""
    tmp = tmp_path_factory.mktemp("corpus")
    out = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "tokenize_dataset.py"),
            "--job.config_file",
            DEBUG_TOML,
            "--output",
            str(tmp / "python_docs_tok"),
            "--workers",
            "2",
        ],
        cwd=ROOT,
        env=train_env(tmp),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    return tmp / "python_docs_tok"


def mixture(corpus: Path) -> list[str]:
    """60% the text corpus tokenized on the fly, 40% the pretokenized one, both shuffled."""
    entries = [
        {"dataset": "python_docs", "weight": 0.6, "name": "text"},
        {"path": str(corpus), "weight": 0.4, "name": "tokens"},
    ]
    return ["--training.datasets", json.dumps(entries), "--training.data_seed", "7"]


LAYOUTS = {
    "fsdp2": (2, ["--training.local_batch_size", "4"]),
    "pp2_tp2": (
        4,
        [
            "--parallelism.pipeline_parallel_degree",
            "2",
            "--parallelism.tensor_parallel_degree",
            "2",
            "--parallelism.pipeline_parallel_microbatch_size",
            "2",
            "--training.local_batch_size",
            "8",
        ],
    ),
}


def _run(pools, tmp_path: Path, corpus: Path, ngpu: int, *extra: str) -> str:
    out = pooled(pools, tmp_path, *EQUIVALENCE_ARGS, *mixture(corpus), *extra, ngpu=ngpu)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out.stdout


@pytest.fixture(scope="module")
def one_process(pools, tmp_path_factory, corpus) -> tuple[dict[int, float], Path, str]:
    tmp = tmp_path_factory.mktemp("mixed_single")
    stdout = _run(pools, tmp, corpus, 1, "--training.local_batch_size", "4")
    losses = tensorboard_scalars(tmp / "out")
    assert sorted(losses) == list(range(1, EQUIVALENCE_STEPS + 1))
    # it trains, so that matching losses mean something (8 shuffled steps fall less than 0.2)
    assert losses[EQUIVALENCE_STEPS] < losses[1] - 0.02 and len(set(losses.values())) == 8, losses
    return losses, tmp / "out", stdout


@pytest.mark.slow
def test_the_mixture_is_logged_and_counted_per_source(one_process):
    _, out, stdout = one_process
    assert "Data mixture of 2 sources, 60.0%/40.0% of the windows" in stdout
    assert "pretokenized" in stdout and "shuffled with seed 7" in stdout
    # 8 steps x 8 windows of 64 tokens, blended 60/40: 38.4 of 64 windows are text
    last = [line for line in stdout.splitlines() if "data: text" in line][-1]
    assert "text 59.4% (2.4K tokens)  tokens 40.6% (1.7K tokens)" in last, last
    acc = tensorboard_run(out)
    text = {e.step: e.value for e in acc.Scalars("data/tokens/text")}
    tokens = {e.step: e.value for e in acc.Scalars("data/tokens/tokens")}
    assert text[EQUIVALENCE_STEPS] + tokens[EQUIVALENCE_STEPS] == EQUIVALENCE_STEPS * 8 * 64


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_mixed_shuffled_data_trains_alike_under_every_layout(
    pools, tmp_path, corpus, one_process, layout
):
    ngpu, extra = LAYOUTS[layout]
    _run(pools, tmp_path, corpus, ngpu, *extra)
    losses, baseline = tensorboard_scalars(tmp_path / "out"), one_process[0]
    for step in range(1, EQUIVALENCE_STEPS + 1):
        assert abs(losses[step] - baseline[step]) <= 1e-4, (step, losses, baseline)


@pytest.mark.slow
def test_mixed_shuffled_data_resumes_exactly_on_another_layout(
    pools, tmp_path, corpus, one_process
):
    """4 steps on 2 ranks with a checkpoint, then the last 4 on one process."""
    ckpt = ["--checkpoint.enable", "--checkpoint.interval", "4"]
    first = ["--training.steps", "4", "--lr_scheduler.total_steps", str(EQUIVALENCE_STEPS)]
    _run(pools, tmp_path, corpus, 2, "--training.local_batch_size", "4", *ckpt, *first)
    stdout = _run(pools, tmp_path, corpus, 1, "--training.local_batch_size", "8", *ckpt)
    assert "(step 4)" in stdout
    resumed = tensorboard_scalars_all_runs(tmp_path / "out")
    for step in range(1, EQUIVALENCE_STEPS + 1):
        assert abs(resumed[step] - one_process[0][step]) <= 1e-4, (step, resumed, one_process[0])


@pytest.mark.slow
def test_one_small_text_file_trains_with_a_larger_global_batch(pools, tmp_path):
    """A 40 kB .txt is one document; the global batch of 8 sequences is cut from its tokens."""
    book = tmp_path / "book.txt"
    lines = [
        f"Chapter {i}. The quick brown fox jumps over the lazy dog {i} times." for i in range(600)
    ]
    book.write_text("\n".join(lines))
    assert 35_000 < book.stat().st_size < 50_000
    out = pooled(
        pools,
        tmp_path,
        "--training.dataset_path",
        str(book),
        "--training.steps",
        "4",
        "--training.seq_len",
        "128",
        "--training.global_batch_size",
        "8",
        "--training.local_batch_size",
        "4",
        "--metrics.log_freq",
        "1",
        ngpu=2,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "fewer rows than the global batch: tokenized whole, cut by tokens" in out.stdout
    assert sorted(console_losses(out.stdout)) == [1, 2, 3, 4]
