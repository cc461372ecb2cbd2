"""Compare two runs' per-step losses from their TensorBoard events.

    python scripts/loss_compare.py RUN_A RUN_B [--assert-equal] [--tolerance X] [--plot out.png]

RUN_A and RUN_B are job dump folders (each holds tb/). Prints the steps side by side with the
gap B - A and a summary line. With --assert-equal, exits 1 when a common step differs by more
than --tolerance (default 0: bit-equal) or a step is logged by one run only. --plot draws both
curves to a PNG (needs matplotlib). --tag compares another scalar (grad_norm, lr, ...).
"""

from __future__ import annotations

import argparse
import sys

from _common import run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_a", help="the first run's job.dump_folder")
    parser.add_argument("run_b", help="the second run's job.dump_folder")
    parser.add_argument("--tag", default="loss", help="the scalar to compare (default: loss)")
    parser.add_argument("--assert-equal", action="store_true", help="exit 1 if the runs differ")
    parser.add_argument("--tolerance", type=float, default=0.0, help="allowed |gap| (default 0)")
    parser.add_argument("--plot", metavar="PNG", help="draw both curves to this PNG file")
    a = parser.parse_args()
    if a.tolerance < 0:
        parser.error(f"--tolerance: {a.tolerance} must be >= 0")

    from torchtitan.errors import ConfigError
    from torchtitan.observability.tb_events import read_scalars

    if a.plot:  # before the reading: a missing plotting library is known at once
        try:
            import matplotlib
        except ImportError as e:
            raise ConfigError("--plot needs matplotlib: pip install matplotlib") from e
        matplotlib.use("Agg")
    runs = read_scalars(a.run_a, a.tag), read_scalars(a.run_b, a.tag)
    differs = _print_table(a.tag, *runs, a.tolerance)
    if a.plot:
        _plot(a.plot, a.tag, runs, (a.run_a, a.run_b))
        print(f"plot: {a.plot}")
    if a.assert_equal and differs:
        sys.exit(1)


def _print_table(tag: str, a: dict[int, float], b: dict[int, float], tolerance: float) -> bool:
    """Print the side-by-side table and the summary; True if the runs differ."""
    steps = sorted(set(a) | set(b))
    print(f"{'step':>6}  {tag + ' A':>14}  {tag + ' B':>14}  {'B - A':>11}")
    worst, worst_step, over = 0.0, None, 0
    for step in steps:
        va, vb = a.get(step), b.get(step)
        if va is None or vb is None:
            show = (f"{v:14.6f}" if v is not None else f"{'-':>14}" for v in (va, vb))
            print(f"{step:>6}  " + "  ".join(show) + f"  {'only one':>11}")
            continue
        gap = vb - va
        over += abs(gap) > tolerance
        if worst_step is None or abs(gap) > abs(worst):
            worst, worst_step = gap, step
        print(f"{step:>6}  {va:14.6f}  {vb:14.6f}  {gap:11.3e}")
    only = len(steps) - len(set(a) & set(b))
    common = len(steps) - only
    summary = f"{common} common steps, max |B - A| = {abs(worst):.3e}"
    summary += f" at step {worst_step}" if worst_step is not None else ""
    summary += f"; {over} over the tolerance {tolerance:g}; {only} steps logged by one run only"
    print(summary)
    return over > 0 or only > 0


def _plot(path: str, tag: str, runs: tuple[dict, dict], names: tuple[str, str]) -> None:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for values, name, style in zip(runs, names, ("-", "--")):
        steps = sorted(values)
        ax.plot(steps, [values[s] for s in steps], style, label=name)
    ax.set_xlabel("step")
    ax.set_ylabel(tag)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    run(main)
