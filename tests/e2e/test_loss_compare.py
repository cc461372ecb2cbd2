"""scripts/loss_compare.py on TensorBoard event files written the way training writes them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from repo_paths import ROOT
from torch.utils.tensorboard import SummaryWriter

SCRIPT = str(ROOT / "scripts" / "loss_compare.py")


def _run(dump: Path, losses: dict[int, float], name: str = "20260101-000000") -> Path:
    writer = SummaryWriter(str(dump / "tb" / name))
    for step, loss in losses.items():
        writer.add_scalar("loss", loss, step)
    writer.close()
    return dump


def _compare(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, SCRIPT, *args], capture_output=True, text=True, timeout=120
    )


BASE = {1: 8.25, 2: 7.5, 3: 7.0}


def test_equal_runs_pass_and_print_the_table(tmp_path):
    a, b = _run(tmp_path / "a", BASE), _run(tmp_path / "b", BASE)
    out = _compare(str(a), str(b), "--assert-equal")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].split() == ["step", "loss", "A", "loss", "B", "B", "-", "A"]
    assert lines[1].split() == ["1", "8.250000", "8.250000", "0.000e+00"]
    assert lines[-1].startswith("3 common steps, max |B - A| = 0.000e+00")


def test_a_gap_fails_assert_equal_unless_within_the_tolerance(tmp_path):
    a = _run(tmp_path / "a", BASE)
    b = _run(tmp_path / "b", {**BASE, 2: 7.5 + 2**-10})  # exact in float32, as TensorBoard keeps it
    out = _compare(str(a), str(b), "--assert-equal")
    assert out.returncode == 1
    assert "max |B - A| = 9.766e-04 at step 2; 1 over the tolerance 0" in out.stdout
    assert _compare(str(a), str(b), "--assert-equal", "--tolerance", "2e-3").returncode == 0
    assert _compare(str(a), str(b)).returncode == 0  # without --assert-equal: a report only


def test_steps_of_one_run_only_are_shown_and_fail_assert_equal(tmp_path):
    a = _run(tmp_path / "a", BASE)
    b = _run(tmp_path / "b", {1: 8.25, 2: 7.5})
    out = _compare(str(a), str(b), "--assert-equal", "--tolerance", "1")
    assert out.returncode == 1
    assert (
        "only one" in out.stdout.splitlines()[3] and "1 steps logged by one run only" in out.stdout
    )


def test_a_resumed_run_reads_as_one_history(tmp_path):
    """A resume writes a second TensorBoard run; its steps override the first run's."""
    a = _run(tmp_path / "a", BASE)
    b = _run(tmp_path / "b", {1: 8.25, 2: 9.0}, name="20260101-000000")
    _run(b, {2: 7.5, 3: 7.0}, name="20260101-000100")
    assert _compare(str(a), str(b), "--assert-equal").returncode == 0


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    a, b = _run(tmp_path / "a", BASE), _run(tmp_path / "b", {**BASE, 3: 6.5})
    png = tmp_path / "curves.png"
    out = _compare(str(a), str(b), "--plot", str(png))
    assert out.returncode == 0, out.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000


def test_a_folder_without_events_is_a_one_line_error(tmp_path):
    a = _run(tmp_path / "a", BASE)
    (tmp_path / "empty").mkdir()
    out = _compare(str(a), str(tmp_path / "empty"))
    assert out.returncode == 1 and "Traceback" not in out.stderr
    assert out.stderr.strip() == (
        f"error: {tmp_path / 'empty'}: no TensorBoard events under it (give a run's "
        "job.dump_folder, which holds tb/)"
    )
    out = _compare(str(a), str(a), "--tag", "nope")
    assert out.stderr.strip() == f"error: {a}: no 'nope' scalars in its TensorBoard events"
