"""The two lanes of a ``pytest -n 2`` run (pytest-xdist): which worker runs which test.

* the process lane: every test that starts four ranks, a pool, or processes it times or signals
  (the layout suites, torchrun, the launchers, Slurm), all in one scope, so on one worker, one
  test at a time, in file order, at the normal CPU priority;
* the in-process lane: the rest (the unit tier, scripts and launches of one process, and the
  two-rank checks named in ``BESIDE_TESTS``), each test a scope of its own, on the other worker
  at ``SCHED_IDLE`` (:func:`cpu_priority`): on the cycles the process lane leaves idle only.

The process lane's processes get one intra-op thread each (:func:`process_threads`). Its tests
marked ``exclusive`` run at its end (tests/conftest.py sorts them there), when the in-process lane
has ended or nearly.

Four gloo ranks on two cores leave a sixth to a third of the machine idle (three ranks waiting
in a collective for the fourth), yet anything beside them at the normal priority slows them by
about its own length: two multi-process tests at a time measured 61% slower each (``--dist
loadfile``), and 21 one-process tests (180 s alone) beside the layout sweep made it take 413 s
against 235 s (2026-11-27, clean clones of edd7c00 and 23ce8ce). At idle priority a rank that
wakes takes its core back at once: the parallel-equivalence suite beside the unit tier and the
memory estimator's tests (warm caches, ``-n 2``) took 123 s, against 192 s with both lanes at the
normal priority; in a whole run, the process lane's first 179 tests took 934 s beside the
in-process lane and 895 s alone. Running the in-process lane first and the process lane after it
instead was slower: pytest 1925 s against 1807 s (2026-11-28, clean clones of 08073fb).
(xdist's own ``loadgroup`` does not group under pytest 9.2: it renames ``item._nodeid``, which
pytest 9.2 no longer reads.)
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

from xdist.scheduler import LoadScopeScheduling

PROCESSES = "processes"
# e2e files whose tests start at most one training or script process and use no pool
ONE_PROCESS_E2E = frozenset(
    {
        "test_config.py",
        "test_data_errors.py",
        "test_dataloader_throughput.py",
        "test_estimate_memory.py",
        "test_lm_eval_oracle.py",
        "test_memory_trace.py",
        "test_loss_compare.py",
        "test_mla_benchmark.py",
        "test_tokenizer.py",
        "test_upstream_configs.py",
    }
)


# tests of the process lane's files that run in the in-process lane instead (without their
# parameters): one process, or two ranks (torchrun or the launcher) checking numbers with no
# clock in their assertions; never a pool (each worker would start its own) or four ranks. At
# idle priority beside the process lane they are off its critical path.
BESIDE_TESTS = frozenset(
    {
        "tests/e2e/test_divergence.py::test_a_non_finite_step_stops_training_and_saves_nothing_after_it",
        "tests/e2e/test_loss_spike.py::test_spikes_in_a_row_stop_the_run_and_nothing_from_them_is_saved",
        "tests/e2e/test_metrics_sinks.py::test_wandb_offline_logs_the_same_scalars_and_the_config",
        "tests/e2e/test_moe_parallel.py::test_blocks_compiled_with_inductor_give_eager_gradients",
        "tests/e2e/test_moe_parallel.py::test_gradients_under_tensor_parallel_are_the_one_process_gradients",
        "tests/e2e/test_norms.py::test_compiled_matches_eager",
        "tests/e2e/test_norms.py::test_fused_rmsnorm_refused_on_cpu",
        "tests/e2e/test_norms.py::test_model_logits_identical_across_norm_types",
        "tests/e2e/test_norms.py::test_benchmark_script_json",
        "tests/e2e/test_object_storage.py::test_unreachable_storage_is_one_line_naming_the_key",
        "tests/e2e/test_object_storage.py::test_training_data_read_from_s3_gives_the_local_losses",
        "tests/e2e/test_norms.py::test_fused_and_compiled_under_tensor_parallel",
        "tests/e2e/test_pipeline.py::test_every_schedule_gives_the_unsplit_gradients",
        "tests/e2e/test_plan.py::test_bad_input_is_one_line",
        "tests/e2e/test_plan.py::test_llama3_8b_on_eight_h100s_planned_from_this_machine",
        "tests/e2e/test_plan.py::test_no_layout_of_405b_fits_eight_gpus",
        "tests/e2e/test_qwen3_parallel.py::test_qk_norm_gradients_under_tensor_parallel",
        "tests/e2e/test_train_e2e.py::test_default_debug_run_loss_falls_and_writes_tensorboard",
        "tests/e2e/test_train_e2e.py::test_deterministic_cpu_runs_repeat_bit_for_bit",
        "tests/e2e/test_train_e2e.py::test_launcher_reports_bad_config_before_torchrun",
        "tests/e2e/test_train_e2e.py::test_launcher_passes_memory_check_to_preflight",
        "tests/e2e/test_train_e2e.py::test_print_config_and_unset_seed_is_drawn_and_logged",
        "tests/e2e/test_train_e2e.py::test_llama2_with_sentencepiece_tokenizer_trains",
        "tests/e2e/test_train_e2e.py::test_step_one_every_log_freq_and_the_last_step_are_logged",
    }
)


def lane(nodeid: str) -> str:
    """``PROCESSES`` for a test of the process lane, else the test's own id."""
    path = nodeid.split("::")[0]
    if path.startswith("tests/unit/"):
        return nodeid
    if path.startswith("tests/e2e/") and path.rsplit("/", 1)[-1] in ONE_PROCESS_E2E:
        return nodeid
    if nodeid.split("[")[0] in BESIDE_TESTS:
        return nodeid
    return PROCESSES


class LaneScheduling(LoadScopeScheduling):
    """xdist's scope scheduling with :func:`lane` as the scope: the largest scope (the process
    lane) goes to one worker first, the single tests to whichever worker is free."""

    def _split_scope(self, nodeid: str) -> str:
        return lane(nodeid)


@contextlib.contextmanager
def cpu_priority(nodeid: str, alone: bool) -> Iterator[None]:
    """A test of the in-process lane (and every process it starts) at ``SCHED_IDLE``: it runs on
    the cycles the process lane leaves idle, and a process-lane rank that wakes takes the core
    back at once, so the lockstep ranks are not slowed by it. The process lane's tests, and tests
    that hold the machine alone, keep the normal policy."""
    idle = lane(nodeid) != PROCESSES and not alone
    if not idle or not _set_policy("SCHED_IDLE"):
        yield
        return
    try:
        yield
    finally:
        # without CAP_SYS_NICE (or an RLIMIT_NICE allowing nice 0) there is no way back: the
        # worker stays idle, which only its last tests could notice (the lanes keep to a worker)
        _set_policy("SCHED_OTHER")


@contextlib.contextmanager
def process_threads(nodeid: str, alone: bool) -> Iterator[None]:
    """The processes a test of the process lane starts while the in-process lane runs beside it
    get one intra-op thread each (``OMP_NUM_THREADS=1``, where the environment does not set it),
    as the pools' ranks have. ``run_llama_train.sh`` alone gives a CPU worker the cores divided
    by the processes: two threads for one process here. Beside the idle lane two threads lose
    their cores at every barrier: the debug run took 128 s beside two ``chrt -i 0`` busy loops,
    against 56 s with one thread (29 s and 48 s alone; 2026-11-28, this 2-core VM). Tests held
    ``alone`` keep the launcher's own choice, which tests/ops/test_launching.py checks."""
    if lane(nodeid) != PROCESSES or alone or "OMP_NUM_THREADS" in os.environ:
        yield
        return
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        yield
    finally:
        del os.environ["OMP_NUM_THREADS"]


def _set_policy(name: str) -> bool:
    """This thread's scheduling policy (inherited by the processes it starts); False where the
    platform or the sandbox does not allow it."""
    policy = getattr(os, name, None)
    if policy is None:
        return False
    try:
        os.sched_setscheduler(0, policy, os.sched_param(0))
    except OSError:
        return False
    return True
