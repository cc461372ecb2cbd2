"""The two lanes of a ``pytest -n 2`` run (pytest-xdist): which worker runs which test.

* the process lane: every test that starts several training processes (the warm pools, torchrun,
  the launchers, Slurm), all in one scope, so on one worker, one test at a time, in file order;
* the in-process lane: the rest (the unit tier, scripts and launches of one process, whole files
  or single tests of the process lane's files), each test a scope of its own, so the other
  worker runs them while the process lane leaves a core idle.

Two multi-process tests at a time on two cores measured 61% slower each (``--dist loadfile``,
docs/getting_started.md): the lanes never run two of them at once. (xdist's own ``loadgroup``
does not group under pytest 9.2: it renames ``item._nodeid``, which pytest 9.2 no longer reads.)
"""

from __future__ import annotations

from xdist.scheduler import LoadScopeScheduling

PROCESSES = "processes"
# e2e files whose tests start at most one training or script process and use no pool
ONE_PROCESS_E2E = frozenset(
    {
        "test_config.py",
        "test_data_errors.py",
        "test_dataloader_throughput.py",
        "test_estimate_memory.py",
        "test_loss_compare.py",
        "test_mla_benchmark.py",
        "test_tokenizer.py",
        "test_upstream_configs.py",
    }
)
# tests of the process lane's files that train in one process at a time (a one-rank pool, or
# ``train.py``/the launcher with one worker): the in-process lane runs them too. Measured one at
# a time (2026-11-27, 2-core VM), each of them kept one core busy and left the other idle.
ONE_PROCESS_TESTS = {
    "test_benchmarks.py": (
        "test_train_throughput_table_from_the_real_runs",
        "test_plain_loop_reports_both_step_times_and_their_ratio",
        "test_startup_breakdown_covers_the_launch",
        "test_plain_loop_refuses_steps_off_the_logging_grid",
    ),
    "test_checkpoint.py": (
        "test_resume_gives_the_same_losses_as_an_unbroken_run",
        "test_block_causal_training_resumes_exactly",
        "test_incomplete_damaged_and_old_checkpoints",
        "test_only_checkpoint_damaged_and_missing_load_step_are_one_line_errors",
        "test_excluded_state_is_not_loaded",
        "test_model_only_saves_are_exports_not_resume_points",
        "test_resume_refuses_a_checkpoint_with_other_block_counts",
    ),
    "test_checkpoint_disk.py": ("test_a_filesystem_gone_read_only_stops_the_run_at_its_next_save",),
    "test_moe_parallel.py": ("test_the_expert_bias_keeps_the_load_balanced_on_the_debug_data",),
    "test_norms.py": (
        "test_compiled_matches_eager",
        "test_benchmark_script_json",
        "test_fused_rmsnorm_refused_on_cpu",
    ),
    "test_train_e2e.py": (
        "test_deterministic_cpu_runs_repeat_bit_for_bit",
        "test_print_config_and_unset_seed_is_drawn_and_logged",
        "test_llama2_with_sentencepiece_tokenizer_trains",
        "test_step_one_every_log_freq_and_the_last_step_are_logged",
    ),
}


def lane(nodeid: str) -> str:
    """``PROCESSES`` for a test of the process lane, else the test's own id."""
    path, _, test = nodeid.partition("::")
    if path.startswith("tests/unit/"):
        return nodeid
    name = path.rsplit("/", 1)[-1]
    if path.startswith("tests/e2e/") and (
        name in ONE_PROCESS_E2E or test.split("[")[0] in ONE_PROCESS_TESTS.get(name, ())
    ):
        return nodeid
    return PROCESSES


class LaneScheduling(LoadScopeScheduling):
    """xdist's scope scheduling with :func:`lane` as the scope: the largest scope (the process
    lane) goes to one worker first, the single tests to whichever worker is free."""

    def _split_scope(self, nodeid: str) -> str:
        return lane(nodeid)
