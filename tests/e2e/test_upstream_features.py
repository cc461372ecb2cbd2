"""Upstream torchtitan's integration-test layouts that used to be refused here (its
``tests/integration_tests/features.py`` of early 2026): each trains the debug model through
``./run_llama_train.sh`` (real processes, gloo on CPU) to the losses of one process, through a
resume. Each case trains 2 steps and saves, then resumes to step 4; every step's loss (read at
full precision from TensorBoard) must match one unbroken process within 1e-4 (measured: at most
1.9e-6, summation order), steps 3-4 coming from the resumed run.

* ``pp4_interleaved``: upstream's PP 4 Interleaved1F1B on the 6-layer debug model: 8 stages with
  the embedding and the output counted as a layer each (an embedding-only first stage, a norm +
  output-only last one);
* ``schedule_csv``: a custom order of each rank's actions from a CSV file
  (``PipelineScheduleMulti``; forward, full backward, and backward split into input and weight);
* ``early_step_fsdp2_tp2``: ``optimizer.early_step_in_backward`` under FSDP x TP (each parameter
  steps after its reduce-scatter; TP's norm weights hold a sum still to take). Nothing is
  clipped then, so every run here leaves ``training.max_norm`` out of reach (1e9); the logged
  gradient norm, gathered as the gradients are freed, must still be the whole gradient's;
* ``dataloader_workers``: upstream's data loader keys (2 workers, pinned memory, persistent
  workers, 4 batches ahead), under FSDP.
"""

from __future__ import annotations

import pytest
from launcher import pooled, tensorboard_scalars_all_runs
from repo_paths import ASSETS

STEPS = 4
COMMON = [
    "--training.seq_len",
    "64",
    "--training.global_batch_size",
    "8",
    "--lr_scheduler.warmup_steps",
    "2",
    "--metrics.log_freq",
    "1",
    "--metrics.enable_tensorboard",
    "--debug.seed",
    "42",
    "--debug.deterministic",
    "--training.max_norm",
    "1e9",
    "--checkpoint.enable",
    "--checkpoint.interval",
    "2",
]

CASES = {
    "pp4_interleaved": (
        4,
        [
            "--parallelism.pipeline_parallel_degree",
            "4",
            "--parallelism.pipeline_parallel_schedule",
            "Interleaved1F1B",
            "--training.local_batch_size",
            "8",
        ],
    ),
    "schedule_csv": (
        2,
        [
            "--parallelism.pipeline_parallel_degree",
            "2",
            "--parallelism.pipeline_parallel_schedule",
            "PipelineScheduleMulti",
            "--parallelism.pipeline_parallel_schedule_csv",
            str(ASSETS / "pipeline" / "split_backward_pp2.csv"),
            "--parallelism.pipeline_parallel_microbatch_size",
            "2",
            "--training.local_batch_size",
            "8",
        ],
    ),
    "early_step_fsdp2_tp2": (
        4,
        [
            "--optimizer.early_step_in_backward",
            "--parallelism.tensor_parallel_degree",
            "2",
            "--training.local_batch_size",
            "4",
        ],
    ),
    "dataloader_workers": (
        2,
        [
            "--training.dataloader.num_workers",
            "2",
            "--training.dataloader.pin_memory",
            "--training.dataloader.persistent_workers",
            "--training.dataloader.prefetch_factor",
            "4",
            "--training.local_batch_size",
            "4",
        ],
    ),
}
LOGGED = {
    "pp4_interleaved": "stage 0 (pp rank 0): tok_embeddings; stage 1 (pp rank 1): layer 0;",
    "schedule_csv": "Pipeline schedule PipelineScheduleMulti in the order of ",
    "early_step_fsdp2_tp2": "optimizer.early_step_in_backward: each parameter steps in backward",
    "dataloader_workers": "Data loader: 2 worker processes, 4 batches ahead each",
}


def _train(pools, tmp_path, steps: int, extra: list[str], ngpu: int = 1) -> str:
    """The run's rank-0 log, trained in the session's warm pool of ``ngpu`` ranks."""
    return pooled(
        pools, tmp_path, *COMMON, "--training.steps", str(steps), *extra, ngpu=ngpu
    ).stdout


@pytest.fixture(scope="module")
def one_process(pools, tmp_path_factory) -> dict[str, dict[int, float]]:
    tmp = tmp_path_factory.mktemp("one_process")
    _train(pools, tmp, STEPS, ["--training.local_batch_size", "8"])
    return {tag: tensorboard_scalars_all_runs(tmp / "out", tag) for tag in ("loss", "grad_norm")}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_upstream_case_matches_one_process_through_a_resume(pools, tmp_path, one_process, case):
    ngpu, extra = CASES[case]
    first = _train(pools, tmp_path, 2, extra, ngpu)
    assert LOGGED[case] in first
    resumed = _train(pools, tmp_path, STEPS, extra, ngpu)
    assert "Loaded training state from" in resumed and "(step 2)" in resumed
    losses = tensorboard_scalars_all_runs(tmp_path / "out")
    assert sorted(losses) == list(range(1, STEPS + 1))
    gaps = {s: abs(losses[s] - one_process["loss"][s]) for s in losses}
    assert max(gaps.values()) <= 1e-4, gaps
    norms = tensorboard_scalars_all_runs(tmp_path / "out", "grad_norm")
    expected = one_process["grad_norm"]
    assert all(abs(norms[s] / expected[s] - 1) <= 1e-3 for s in expected), (norms, expected)
