"""Replica groups with torchft (``[fault_tolerance]``), each group its own ./run_llama_train.sh
(torchrun, gloo on CPU), torchft's real lighthouse started by the test: two groups are one job
of their global batch, and a group killed mid-run is restarted by its launcher and heals from
the live one while that one keeps training."""

from __future__ import annotations

import os
import re
import socket
import time
from pathlib import Path

import pytest
import torch
from launcher import (
    FOUR_WORKER_ARGS,
    kill_all,
    launch,
    start,
    tensorboard_scalars_all_runs,
    worker_pids,
)
from lighthouse import lighthouse
from ports import free_port
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from torchtitan.checkpoint import read_model_weights

pytest.importorskip("torchft")

# docs/reliability.md: how far a run with a group down for ~25 of 60 steps ends from an unbroken
# one (the mean loss of the last 10 steps; measured below in the test)
LOSS_TOLERANCE = 0.15
# the same for DiLoCo syncing every 4 steps, against two groups of DiLoCo never broken
DILOCO_LOSS_TOLERANCE = 0.25
TRAIN = [*FOUR_WORKER_ARGS, "--lr_scheduler.warmup_steps=2", "--checkpoint.enable"]


def _group_args(tmp_path: Path, i: int, steps: int, interval: int) -> list[str]:
    return [
        *TRAIN,
        f"--training.steps={steps}",
        f"--checkpoint.interval={interval}",
        f"--checkpoint.folder={tmp_path / 'ckpt'}",
        "--fault_tolerance.enable",
        "--fault_tolerance.group_size=2",
        f"--fault_tolerance.replica_id={i}",
    ]


def _finish(procs, timeout: float = 600) -> list[str]:
    outputs = []
    for proc in procs:
        out, _ = proc.communicate(timeout=timeout)
        outputs.append(out)
        assert proc.returncode == 0, out[-4000:]
    return outputs


def _weights(path: Path) -> dict[str, torch.Tensor]:
    return read_model_weights(str(path))


@pytest.mark.slow
def test_two_replica_groups_are_one_job_of_their_global_batch(tmp_path):
    """Two groups of one rank, each reading half of a global batch of 8, against one process
    reading all 8 in two micro-batches: the mean of the groups' losses is the one process's
    loss at every step, and the groups end with the same weights, bit for bit."""
    steps, local = 5, ["--training.local_batch_size=4", "--training.global_batch_size=8"]
    one = launch(tmp_path / "one", *TRAIN, *local, f"--training.steps={steps}", timeout=600)
    assert one.returncode == 0, one.stderr[-3000:]
    # group 0's launcher runs the lighthouse (every quorum waits for both groups), group 1 is
    # pointed at it
    port = str(free_port())
    own = {"FT_LIGHTHOUSE": "start", "FT_LIGHTHOUSE_PORT": port, "FT_MIN_REPLICAS": "2"}
    url = {"FT_LIGHTHOUSE": f"http://{socket.gethostname()}:{port}"}
    procs = [
        start(tmp_path / f"g{i}", *_group_args(tmp_path, i, steps, steps), *local, ngpu=1, **env)
        for i, env in ((0, own), (1, url))
    ]
    try:
        outputs = _finish(procs)
    finally:
        kill_all(procs)
    assert f"launch: torchft lighthouse at http://{socket.gethostname()}:{port}" in outputs[0]
    assert "global batch: 8 sequences from 2 live replica groups of 2" in outputs[0]
    reference = tensorboard_scalars_all_runs(tmp_path / "one" / "out")
    groups = [tensorboard_scalars_all_runs(tmp_path / f"g{i}" / "out") for i in (0, 1)]
    for step in range(1, steps + 1):
        mean = (groups[0][step] + groups[1][step]) / 2
        assert abs(mean - reference[step]) < 2e-5, (step, mean, reference[step])
    w0, w1 = (_weights(tmp_path / "ckpt" / f"replica-{i}" / f"step-{steps}") for i in (0, 1))
    w = _weights(tmp_path / "one" / "out" / "checkpoint" / f"step-{steps}")
    for name in w:
        assert torch.equal(w0[name], w1[name]), name
        torch.testing.assert_close(w0[name], w[name], rtol=1e-4, atol=1e-5)


def _step_times(log: Path) -> list[tuple[float, int]]:
    """(seconds since midnight, step) of each step line of a rank-0 log file."""
    out = []
    for h, m, s, step in re.findall(r"(\d\d):(\d\d):(\d\d),\d+ INFO step: (\d+) ", log.read_text()):
        out.append((int(h) * 3600 + int(m) * 60 + int(s), int(step)))
    return out


def _wait_for(condition, what: str, procs, timeout: float = 600, logs: tuple[Path, ...] = ()):
    """Until ``condition()``; a failure shows the end of each of ``logs``."""
    deadline = time.monotonic() + timeout
    while not condition():
        ended, late = any(p.poll() is not None for p in procs), time.monotonic() > deadline
        if ended or late:
            tails = "".join(
                f"\n--- {log}:\n" + "\n".join(log.read_text().splitlines()[-15:])
                for log in logs
                if log.exists()
            )
            problem = f"a group ended before {what}" if ended else f"no {what} after {timeout}s"
            pytest.fail(problem + tails)
        time.sleep(0.1)


@pytest.mark.slow
def test_a_killed_group_heals_from_the_live_one_which_keeps_training(tmp_path):
    """Two groups of two ranks: group 1's workers are SIGKILLed at step 8; group 0 retries the
    step it was in and trains on alone (its steps keep rising, it is never restarted); group 1's
    torchrun restarts it, it resumes its own checkpoint of step 5, takes group 0's state at its
    first step and skips its share of the steps it missed. At a step both groups saved after
    that, their weights are the same, bit for bit, and their loss is within a documented
    tolerance of an unbroken run's."""
    healed, common, killed_at, killed_step, (text0, text1) = _kill_and_heal(tmp_path, [], 5)
    assert "Loaded training state" not in text0  # group 0 never restarted
    assert "step not committed (a group failed during it); retrying it" in text0
    own = _resumed_save(text1, killed_step, 5)
    assert healed[1] == str(own) and int(healed[2]) > killed_step, healed[0]
    skipped = re.search(rf"skipped its share of steps {own + 1}-(\d+) \((\d+) batches", text1)
    assert skipped and int(skipped[2]) == int(healed[2]) - own == int(skipped[1]) - own, skipped
    assert f"step-{own} (step {own})" in text1
    _kept_training(tmp_path, killed_at, healed)
    assert "global batch: 4 sequences from 1 live replica group of 2" in text0
    _same_weights(tmp_path, common)
    # the unbroken run: one process that trained every step on the whole batch
    one = launch(tmp_path / "one", *TRAIN, *CONSTANT_LR, f"--training.steps={common}")
    assert one.returncode == 0, one.stderr[-3000:]
    ref = tensorboard_scalars_all_runs(tmp_path / "one" / "out")
    _loss_near_unbroken(tmp_path, common, LOSS_TOLERANCE, ref)


# two groups of two ranks, 400 steps at most: a warm-up of 20 steps (which a heal lands in: the
# schedule's state must come over), then a constant learning rate (an unbroken run's loss does
# not depend on its length)
CONSTANT_LR = [
    "--lr_scheduler.warmup_steps=20",
    "--lr_scheduler.decay_ratio=0",
    "--training.local_batch_size=2",
]
HEALED = r"healed from the live groups: step (\d+) -> (\d+)"


def _log(tmp_path: Path, i: int) -> Path:
    return tmp_path / f"g{i}" / "out" / "logs" / "rank_0.log"


def _steps(text: str) -> list[int]:
    return [int(s) for s in re.findall(r"INFO step: (\d+) ", text)]


def _resumed_save(text: str, killed_step: int, interval: int) -> int:
    """The step of the save a group killed after ``killed_step`` resumed: its last save before
    the kill, or the one before (the last may have been in flight)."""
    resumed = re.search(r"Loaded training state from \S+ \(step (\d+)\)", text)
    last = killed_step // interval * interval
    assert resumed and int(resumed[1]) in (last - interval, last) and int(resumed[1]) > 0, (
        resumed,
        killed_step,
    )
    return int(resumed[1])


def _kill_and_heal(tmp_path: Path, extra: list[str], interval: int, join_timeout_ms: int = 1000):
    """Group 1's workers SIGKILLed once it has logged step 8 (or a later one: a group that
    starts later than the lighthouse's join timeout takes the other's state at its first sync and
    skips its share of the steps up to there, 8 among them on a loaded machine); its torchrun
    restarts it and it heals from group 0. Returns (the heal's match, a save both groups made 10+
    steps after it, the time of the kill, group 1's last step logged before it, both rank-0 logs
    (group 1's from the kill on))."""
    args = [[*_group_args(tmp_path, i, 400, interval), *CONSTANT_LR, *extra] for i in (0, 1)]
    text = [
        lambda i=i: _log(tmp_path, i).read_text() if _log(tmp_path, i).exists() else ""
        for i in (0, 1)
    ]

    def saved(i: int, step: int) -> bool:
        return (tmp_path / "ckpt" / f"replica-{i}" / f"step-{step}" / "COMPLETE").exists()

    with lighthouse(min_replicas=1, join_timeout_ms=join_timeout_ms) as env:
        procs = [start(tmp_path / "g0", *args[0], ngpu=2, **env)]
        procs.append(start(tmp_path / "g1", *args[1], ngpu=2, MAX_RESTARTS="1", **env))
        try:
            logs = (_log(tmp_path, 0), _log(tmp_path, 1))
            _wait_for(
                lambda: max(_steps(text[1]()), default=0) >= 8,
                "step 8 in group 1",
                procs,
                logs=logs,
            )
            victims = worker_pids(str(tmp_path / "g1")).values()
            assert len(victims) == 2, victims
            before = len(text[1]())  # a group that starts late heals at its start too
            killed_step = max(_steps(text[1]()))
            for pid in victims:
                os.kill(pid, 9)
            killed_at = time.time()
            _wait_for(
                lambda: re.search(HEALED, text[1]()[before:]), "heal of group 1", procs, logs=logs
            )
            healed = re.search(HEALED, text[1]()[before:])
            common = (int(healed[2]) // interval + 3) * interval
            _wait_for(
                lambda: saved(0, common) and saved(1, common), f"step {common}", procs, logs=logs
            )
        finally:
            kill_all(procs, pids=worker_pids(str(tmp_path)).values())
    return healed, common, killed_at, killed_step, (text[0](), text[1]()[before:])


def _kept_training(tmp_path: Path, killed_at: float, healed) -> None:
    """While group 1 was down, group 0 logged steps one after another."""
    midnight = time.mktime(time.localtime(killed_at)[:3] + (0, 0, 0, 0, 0, -1))
    during = [s for t, s in _step_times(_log(tmp_path, 0)) if t >= int(killed_at - midnight)]
    during = [s for s in during if s <= int(healed[2])]
    assert len(during) > 3 and during == sorted(during), during


def _same_weights(tmp_path: Path, step: int) -> dict[str, torch.Tensor]:
    w0, w1 = (_weights(tmp_path / "ckpt" / f"replica-{i}" / f"step-{step}") for i in (0, 1))
    for name in w0:
        assert torch.equal(w0[name], w1[name]), name
    return w0


def _loss_near_unbroken(
    tmp_path: Path, common: int, tolerance: float, ref: dict[int, float]
) -> None:
    """The mean loss of the 10 steps up to the common save (both groups back, the mean of their
    halves) against an unbroken run's (``ref``: step -> loss)."""
    groups = [tensorboard_scalars_all_runs(tmp_path / f"g{i}" / "out") for i in (0, 1)]
    last = range(common - 9, common + 1)
    broken = sum(groups[0][s] + groups[1][s] for s in last) / 20
    unbroken = sum(ref[s] for s in last) / 10
    print(
        f"steps {last.start}-{common}: mean loss {broken:.4f} with the kill, {unbroken:.4f} unbroken"
    )
    assert abs(broken - unbroken) < tolerance, (broken, unbroken)


def _outer(method: str, every: int, *extra: str) -> list[str]:
    return [
        f"--fault_tolerance.semi_sync_method={method}",
        f"--fault_tolerance.sync_steps={every}",
        *extra,
    ]


def _pair(
    tmp_path: Path, name: str, steps: int, *args: str, interval: int = 1, own=((), ())
) -> list[dict]:
    """Two groups of one rank, started together, every quorum waiting for both (``own``: each
    group's own arguments); their losses (step -> loss)."""
    with lighthouse(min_replicas=2, join_timeout_ms=30000) as env:
        procs = [
            start(
                tmp_path / name / f"g{i}",
                *_group_args(tmp_path / name, i, steps, interval),
                *args,
                "--training.local_batch_size=4",
                *own[i],
                ngpu=1,
                OMP_NUM_THREADS="1",  # two processes on this machine's cores
                **env,
            )
            for i in (0, 1)
        ]
        try:
            _finish(procs)
        finally:
            kill_all(procs)
    return [tensorboard_scalars_all_runs(tmp_path / name / f"g{i}" / "out") for i in (0, 1)]


@pytest.mark.slow
def test_diloco_without_outer_momentum_at_lr_1_is_local_sgd(tmp_path):
    """Semi-synchronous groups meeting every 2 steps: between syncs they train apart (their
    weights differ after step 3), at a sync they leave with the same weights, bit for bit.
    DiLoCo's outer step with lr 1 and no momentum moves the synced weights by the mean of the
    groups' changes, to the mean of their weights: local SGD's average (to rounding)."""
    steps = 4
    _pair(tmp_path, "local_sgd", steps, *_outer("local_sgd", 2))
    _pair(
        tmp_path,
        "diloco",
        steps,
        *_outer("diloco", 2, "--fault_tolerance.outer_lr=1", "--fault_tolerance.outer_momentum=0"),
    )

    def w(name, i, step):
        return _weights(tmp_path / name / "ckpt" / f"replica-{i}" / f"step-{step}")

    for name in ("local_sgd", "diloco"):
        assert any(
            not torch.equal(a, b) for a, b in zip(w(name, 0, 3).values(), w(name, 1, 3).values())
        )
        for step in (2, 4):
            a, b = w(name, 0, step), w(name, 1, step)
            for k in a:
                assert torch.equal(a[k], b[k]), (name, step, k)
    a, b = w("local_sgd", 0, steps), w("diloco", 0, steps)
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6)


def _diloco_state(tmp_path: Path, i: int, step: int) -> dict[str, dict[str, torch.Tensor]]:
    """The DiLoCo state a group saved at ``step`` (synced weights, outer momentum)."""
    out = tmp_path / f"diloco-{i}-{step}.pt"
    dcp_to_torch_save(str(tmp_path / "ckpt" / f"replica-{i}" / f"step-{step}"), str(out))
    return torch.load(out, weights_only=False)["diloco"]


@pytest.mark.slow
def test_a_killed_diloco_group_heals_at_the_next_sync(tmp_path):
    """DiLoCo, syncing every 4 steps, two groups of two ranks: group 1's workers are SIGKILLed
    at step 8; group 0 trains on alone (its steps keep rising, it is never restarted); group
    1's torchrun restarts it from its own checkpoint, it takes inner steps to its next sync,
    and there takes group 0's state (weights, optimizers, DiLoCo's synced weights and outer
    momentum, step) and skips its share of the steps it missed. At a later sync both groups
    hold the same weights and DiLoCo state, bit for bit; the outer step between two syncs is
    Nesterov SGD (lr 0.7, momentum 0.9) on the averaged weight change; the loss is within a
    documented tolerance of an unbroken run's."""
    every = 4
    healed, common, killed_at, killed_step, (text0, text1) = _kill_and_heal(
        tmp_path, _outer("diloco", every), every, join_timeout_ms=20000
    )
    assert "Loaded training state" not in text0  # group 0 never restarted
    resumed = _resumed_save(text1, killed_step, every)
    own, live = int(healed[1]), int(healed[2])
    assert own == resumed + every and live % every == 0 and live > own, healed[0]
    assert f"skipped its share of steps {own + 1}-{live} ({live - own} batches" in text1
    _kept_training(tmp_path, killed_at, healed)
    _same_weights(tmp_path, common)
    s0, s1 = _diloco_state(tmp_path, 0, common), _diloco_state(tmp_path, 1, common)
    before = _diloco_state(tmp_path, 0, common - every)
    weights = _weights(tmp_path / "ckpt" / "replica-0" / f"step-{common}")
    lr, mu = 0.7, 0.9
    for name in weights:
        for key in ("synced", "momentum"):
            assert torch.equal(s0[key][name], s1[key][name]), (key, name)
        assert torch.equal(weights[name], s0["synced"][name]), name
        # Nesterov SGD: m' = mu m + g; w' = w - lr (g + mu m')
        g = s0["momentum"][name] - mu * before["momentum"][name]
        expect = before["synced"][name] - lr * (g + mu * s0["momentum"][name])
        torch.testing.assert_close(weights[name], expect, rtol=1e-4, atol=1e-6)
    # the unbroken run: the same two groups (of one rank) syncing every 4 steps, never killed
    p0, p1 = _pair(
        tmp_path, "unbroken", common, *CONSTANT_LR, *_outer("diloco", every), interval=common
    )
    ref = {s: (p0[s] + p1[s]) / 2 for s in p0}
    _loss_near_unbroken(tmp_path, common, DILOCO_LOSS_TOLERANCE, ref)


@pytest.mark.slow
def test_diloco_groups_that_start_apart_take_the_first_groups_weights(tmp_path):
    """Two DiLoCo groups initialized from different seeds (as without debug.seed) meet after
    step 2 holding different synced weights: the fingerprint tells them apart, group 1 takes
    group 0's state, is left out of the average, and from then on both hold the same weights."""
    _pair(tmp_path, "apart", 4, *_outer("diloco", 2), own=((), ("--debug.seed=7",)))

    def w(i, step):
        return _weights(tmp_path / "apart" / "ckpt" / f"replica-{i}" / f"step-{step}")

    assert any(not torch.equal(a, b) for a, b in zip(w(0, 1).values(), w(1, 1).values()))
    for step in (2, 3, 4):
        a, b = w(0, step), w(1, step)
        assert all(torch.equal(a[k], b[k]) for k in a) == (step != 3), step
    log = (tmp_path / "apart" / "g1" / "out" / "logs" / "rank_0.log").read_text()
    assert "group(s) [1] hold other synced weights than group 0; they take its state" in log
