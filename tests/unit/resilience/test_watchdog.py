"""Hang evidence in one process: the watchdog writes every thread's stack once, named by step
and rank, for a step far over the median (not for ordinary steps, nor the first: compilation);
a collective's timeout becomes one line naming the collective and the library frame calling it."""

from __future__ import annotations

import time

import pytest
from log_capture import logged

from torchtitan.resilience.watchdog import SHARE_OF_TIMEOUT, HangWatchdog


@pytest.fixture
def warnings_logged():
    with logged() as lines:
        yield lines


def _stuck_in_a_collective(seconds: float) -> None:
    time.sleep(seconds)


def _steps(dog: HangWatchdog, first: int, seconds: list[float]) -> None:
    for i, s in enumerate(seconds):
        dog.before_step(first + i)
        _stuck_in_a_collective(s)
        dog.after_step(first + i)


def test_a_step_over_the_limit_writes_every_threads_stack_once(tmp_path, warnings_logged):
    # times well apart, for a loaded machine: 10 ms steps, a 0.6 s floor (60 steps' worth), a
    # 1.6 s stuck step
    dog = HangWatchdog(str(tmp_path), rank=3, factor=3.0, floor_s=0.6, poll_s=0.05)
    try:
        # the first step (compilation) is slow and not counted; then 10 ms steps: the floor
        _steps(dog, 1, [0.8, 0.01, 0.01])
        assert dog.limit() == pytest.approx(0.6)
        assert not (tmp_path / "hangs").exists()
        _steps(dog, 4, [1.6])  # over twice the limit: still one file
        _steps(dog, 5, [0.01])
    finally:
        dog.close()
    files = sorted(p.relative_to(tmp_path).as_posix() for p in (tmp_path / "hangs").rglob("*"))
    assert files == ["hangs/step-4", "hangs/step-4/rank_3.txt"]
    text = (tmp_path / "hangs/step-4/rank_3.txt").read_text()
    assert text.startswith("rank 3, step 4: running for")
    assert "_stuck_in_a_collective" in text and "hang-watchdog" not in text.split("\n")[0]
    assert "Current thread" in text or "Thread 0x" in text  # faulthandler's every-thread dump
    said = [line for line in warnings_logged if "Hang watchdog" in line]
    assert len(said) == 2, said
    assert "step 4 has run" in said[0] and "rank_3.txt" in said[0]
    assert "step 4 completed after" in said[1] and "training goes on" in said[1]


def test_the_limit_follows_the_median_above_the_floor(tmp_path):
    dog = HangWatchdog(str(tmp_path), rank=0, factor=10.0, floor_s=0.05, poll_s=10)
    try:
        assert dog.limit() is None  # nothing to compare with yet
        _steps(dog, 1, [0.2])
        assert dog.limit() is None  # the first step does not count
        assert dog.durations == []
        _steps(dog, 2, [0.0])
        assert len(dog.durations) == 1
        dog.durations = [0.01, 0.03, 0.02]
        assert dog.limit() == pytest.approx(0.2)  # 10 x the median 20 ms
        dog.durations = [0.001, 0.002, 0.003]
        assert dog.limit() == pytest.approx(0.05)  # the floor
    finally:
        dog.close()


def test_factor_zero_starts_no_thread(tmp_path):
    dog = HangWatchdog(str(tmp_path), rank=0, factor=0.0, floor_s=0.01, poll_s=0.01)
    assert dog._thread is None
    _steps(dog, 1, [0.0, 0.0, 0.1])
    dog.close()
    assert not (tmp_path / "hangs").exists()


def _raise_in_a_collective(message: str) -> None:
    """Raise ``message`` from a frame that looks like torch.distributed's all_reduce."""
    code = compile(
        f"def all_reduce():\n    raise RuntimeError({message!r})\n",
        "/site-packages/torch/distributed/distributed_c10d.py",
        "exec",
    )
    space: dict = {}
    exec(code, space)
    space["all_reduce"]()


def test_a_collective_timeout_becomes_one_line_naming_the_collective_and_its_caller():
    from torchtitan.distributed.utils import collective_timeout

    try:
        _raise_in_a_collective("[gloo/unbound_buffer.cc:78] Timed out waiting 20000ms for recv")
    except RuntimeError as e:
        found = collective_timeout(e)
    assert found is not None and found.exit_code == 4
    line = str(found)
    assert "\n" not in line
    assert line.startswith("a collective timed out after 20s waiting in all_reduce (from ")
    assert "tests/unit/resilience/test_watchdog.py" in line and "_raise_in_a_collective" in line


def test_other_errors_are_not_collective_timeouts():
    from torchtitan.distributed.utils import collective_timeout

    try:
        _raise_in_a_collective("Connection reset by peer")
    except RuntimeError as e:
        assert collective_timeout(e) is None
    assert collective_timeout(RuntimeError("timed out, but not in a collective")) is None
    assert collective_timeout(ValueError("Timed out waiting 5ms")) is None


def test_the_limit_stays_under_the_collective_timeout_whatever_the_floor(tmp_path):
    """A floor (60 s) above the timeout (12 s) would let a collective time out first and leave
    no stacks: the limit is capped at a share of the timeout in force, the first step's (init)
    before one step ended, the training one after."""
    timeouts = (600.0, 12.0)
    dog = HangWatchdog(
        str(tmp_path), rank=0, factor=10.0, floor_s=60.0, poll_s=10, timeouts_s=timeouts
    )
    with dog:
        assert dog.limit() == pytest.approx(SHARE_OF_TIMEOUT * 600)  # first step, no median yet
        for step in (1, 2, 3):
            dog.before_step(step)
            dog.after_step(step)
        assert dog.limit() == pytest.approx(SHARE_OF_TIMEOUT * 12) and SHARE_OF_TIMEOUT < 1


def test_stacks_are_written_before_the_timeout_and_the_folder_is_remembered(tmp_path):
    timeouts = (0.2, 0.2)
    dog = HangWatchdog(
        str(tmp_path), rank=2, factor=10.0, floor_s=60.0, poll_s=0.02, timeouts_s=timeouts
    )
    with dog:
        dog.before_step(1)
        deadline = time.monotonic() + 5
        path = tmp_path / "hangs" / "step-1" / "rank_2.txt"
        while not path.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
    assert path.exists()
    assert HangWatchdog.written == path.parent
