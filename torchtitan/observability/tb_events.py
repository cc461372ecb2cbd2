"""Read back what a run logged to TensorBoard (``{dump_folder}/tb/<run>/events...``)."""

from __future__ import annotations

from pathlib import Path

from torchtitan.errors import TorchTitanError


def read_scalars(dump_folder: str | Path, tag: str = "loss") -> dict[int, float]:
    """``{step: value}`` of one scalar over every TensorBoard run of a job (a resumed job writes
    a new run; later runs override earlier ones at the same step). ``dump_folder`` may also be
    its ``tb`` folder or one run's folder."""
    return {step: value for step, (_, value) in read_events(dump_folder, tag).items()}


def read_events(dump_folder: str | Path, tag: str = "loss") -> dict[int, tuple[float, float]]:
    """``{step: (wall time, value)}``: as :func:`read_scalars`, with when each point was written
    (seconds since the epoch), from which benchmarks take step times."""
    events = read_all_events(dump_folder).get(tag)
    if not events:
        raise TorchTitanError(f"{dump_folder}: no '{tag}' scalars in its TensorBoard events")
    return events


def read_all_events(dump_folder: str | Path) -> dict[str, dict[int, tuple[float, float]]]:
    """Every scalar tag's ``{step: (wall time, value)}``, each run's event files read once."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    merged: dict[str, dict[int, tuple[float, float]]] = {}
    for run in _runs(Path(dump_folder)):
        acc = EventAccumulator(str(run), size_guidance={"scalars": 0})  # 0: keep every point
        acc.Reload()
        for tag in acc.Tags().get("scalars", []):
            points = {e.step: (e.wall_time, e.value) for e in acc.Scalars(tag)}
            merged.setdefault(tag, {}).update(points)
    return merged


def _runs(folder: Path) -> list[Path]:
    """The run folders (those holding event files), oldest first (their names are timestamps)."""
    if not folder.is_dir():
        raise TorchTitanError(f"{folder}: no such folder (give a run's job.dump_folder)")
    for root in (folder / "tb", folder):
        runs = (
            sorted({p.parent for p in root.rglob("events.out.tfevents.*")}) if root.is_dir() else []
        )
        if runs:
            return runs
    raise TorchTitanError(
        f"{folder}: no TensorBoard events under it (give a run's job.dump_folder, which holds tb/)"
    )
