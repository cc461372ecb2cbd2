"""``python -m torchtitan.plan``: the best layouts of a job on N GPUs, predicted and explained.

    python -m torchtitan.plan --gpus N [--gpu-type KEY] [--gpus-per-node 8] [--top 5] [--json]
        [--write plan.toml | --no-write] [--device-memory-gib X] [--network-gb-s X]
        [--matmul-efficiency F] [--device-type cpu --calibration FILE]
        --job.config_file F [--section.key value ...]

The layout keys given among the ``--section.key value`` arguments (degrees, activation
checkpointing, local batch, pipeline schedule and micro-batch) are kept as given; the global
batch (``training.global_batch_size``, else the config's local batch on each data-parallel rank
of its own layout) and the sequence length are the job's. The fastest layout that fits is
written as a config (the job's TOML with the layout's keys set) to use directly.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from torchtitan.checkpoint.storage import write_atomic
from torchtitan.config.parse import parse_args
from torchtitan.devices import DEVICES, device_by_key, find_device
from torchtitan.errors import ConfigError, TorchTitanError
from torchtitan.planning.calibrate import cpu_hardware
from torchtitan.planning.cost import Hardware, gpu_hardware
from torchtitan.planning.layouts import cli_overrides, given_keys
from torchtitan.planning.planner import Plan, Planned, plan
from torchtitan.train.memory_fit import checked_memory_gib


def main(argv: list[str] | None = None) -> int:
    try:
        with _ctrl_c_exits():
            return _main(list(sys.argv[1:] if argv is None else argv))
    except TorchTitanError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:  # Ctrl-C while it writes: stop quietly, as a shell does
        return 130


def _exit_130(signum: int, frame: Any) -> None:
    try:
        sys.stdout.flush()
    except (OSError, RuntimeError):  # a write it interrupted: what is buffered is dropped
        pass
    os._exit(130)


@contextlib.contextmanager
def _ctrl_c_exits(handler: Any = _exit_130) -> Iterator[None]:
    """Ctrl-C ends the planner at once with 130, as a shell's commands do, with nothing written.
    Not as a KeyboardInterrupt while it traces: one raised inside a callback torch runs from C++
    (a weak reference's, as a traced tensor is freed) aborts the process (seen: exit -6,
    "terminate called after throwing an instance of 'python_error'"). :func:`write_config` takes
    Python's own handler back (``handler``) for the write, which leaves the old config or the new
    one. Off the main thread, where no handler can be set, nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m torchtitan.plan", description=__doc__.splitlines()[0], allow_abbrev=False
    )
    p.add_argument("--gpus", type=int, required=True, help="devices of the job")
    p.add_argument("--gpu-type", help="torchtitan/devices.py key (default: this machine's GPU)")
    p.add_argument("--gpus-per-node", type=int, help="devices a node holds (GPU default 8)")
    p.add_argument("--device-memory-gib", help="the memory of one device, in place of the table's")
    p.add_argument("--network-gb-s", type=float, help="scale-out GB/s per device, each way")
    p.add_argument(
        "--matmul-efficiency", type=float, help="the fraction of the peak a matmul reaches"
    )
    p.add_argument("--device-type", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--calibration", help="cpu: the JSON of benchmarks/ceilings.py --collectives")
    p.add_argument("--top", type=int, default=5, help="layouts to show")
    p.add_argument("--max-traces", type=int, default=24, help="memory traces at most")
    p.add_argument("--json", action="store_true", help="the layouts as one JSON list")
    p.add_argument("--write", default="plan.toml", help="the best layout's config (TOML)")
    p.add_argument("--no-write", action="store_true")
    return p


def _main(argv: list[str]) -> int:
    a, train_args = _parser().parse_known_args(argv)
    if a.gpus < 1:
        raise ConfigError(f"--gpus: {a.gpus} must be >= 1")
    if not a.no_write:  # said before the traces, not after
        folder = os.path.dirname(a.write) or "."
        if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
            raise ConfigError(f"--write: {a.write}: the folder {folder} is not a writable folder")
        if os.path.isdir(a.write):
            raise ConfigError(f"--write: {a.write} is a folder; give a file name (plan.toml)")
    job_config = parse_args(train_args, need_files=False)
    hardware = _hardware(a)
    result = plan(job_config, train_args, a.gpus, hardware, a.device_type, a.top, a.max_traces)
    written = None
    if result.layouts and not a.no_write:
        written = write_config(job_config, train_args, result.layouts[0], a.write, argv)
    if a.json:
        print(json.dumps([p.as_json() for p in result.layouts]))
    else:
        print(format_plan(result, written))
    return 0 if result.layouts else 1


def _hardware(a: argparse.Namespace) -> Hardware:
    memory = checked_memory_gib(a.device_memory_gib) if a.device_memory_gib else None
    if a.device_type == "cpu":
        if not a.calibration:
            raise ConfigError(
                "--calibration: planning for CPU processes needs this machine's measured rates; "
                "run torchrun --nproc-per-node N benchmarks/ceilings.py --collectives --json > "
                "FILE and give --calibration FILE"
            )
        return cpu_hardware(a.calibration, a.gpus, a.gpus_per_node, memory)
    if a.gpu_type:
        device = device_by_key(a.gpu_type)
    else:
        device = _this_gpu()
    return gpu_hardware(
        device,
        a.gpus_per_node or 8,
        matmul_efficiency=a.matmul_efficiency,
        network_gb_s=a.network_gb_s,
        memory_gib=memory,
    )


def _this_gpu():
    import torch

    valid = ", ".join(d.key for d in DEVICES)
    if not torch.cuda.is_available():
        raise ConfigError(f"--gpu-type: this machine has no GPU; name the job's ({valid})")
    name = torch.cuda.get_device_name()
    device = find_device(name)
    if device is None:
        raise ConfigError(
            f"--gpu-type: this machine's GPU ({name}) is not in the table; name one ({valid})"
        )
    return device


def format_plan(result: Plan, written: str | None) -> str:
    m, hw = result.facts, result.hardware
    tokens = result.global_batch * result.seq_len
    lines = [
        f"Layouts for {m.name} ({m.parameters / 1e9:.3g} B parameters, "
        f"{m.flops_per_token / 1e9:.3g} GFLOP per token) on {result.world} x {hw.name} "
        f"({hw.memory_gib:.1f} GiB, {hw.devices_per_node} per node)",
        f"  global batch {result.global_batch} x seq {result.seq_len} = {tokens:,} tokens a step; "
        f"{result.candidates} layouts listed, {result.traced} traced for memory",
        f"  rates: {hw.source}",
        "",
        f"  {'#':>2} {'tokens/s/GPU':>12} {'MFU':>6} {'step s':>8} {'peak GiB':>9}  "
        f"{'limit':<11} layout",
    ]
    for i, p in enumerate(result.layouts, 1):
        lines.append(_row(str(i), p))
    if result.reference is not None:
        lines.append(_row("cf", result.reference) + "  (the config's own)")
    lines += [f"  note: {n}" for n in result.notes]
    if not result.layouts:
        lines.append(
            f"  no layout fits {hw.memory_gib - hw.reserve_gib:.1f} GiB per device within the traces "
            "made; more devices, a smaller local batch, or --max-traces"
        )
    if written:
        best = result.layouts[0]
        lines += [
            "",
            f"  wrote {written}: CONFIG_FILE={written} NGPU={result.world} ./run_llama_train.sh",
            "  or add: " + " ".join(cli_overrides(best.layout, result.global_batch)),
        ]
    lines.append(
        "  predictions: docs/planning.md (the cost model, its calibration, where it is wrong)"
    )
    return "\n".join(lines)


def _row(label: str, p: Planned) -> str:
    peak = f"{p.peak_gib:9.1f}" if p.peak_gib is not None else f"{'-':>9}"
    fits = "" if p.fits in (None, True) else " (does not fit)"
    return (
        f"  {label:>2} {p.tokens_per_second_per_device:12,.0f} {100 * p.mfu:5.1f}% "
        f"{p.cost.seconds:8.3f} {peak}  {p.cost.limit:<11} {p.layout.describe()}{fits}"
    )


def write_config(
    job_config, train_args: list[str], best: Planned, path: str, argv: list[str]
) -> str:
    """The job's TOML (comments kept) with the keys given on the command line and the best
    layout's set: the job as planned, to run as it is."""
    import tomlkit

    source = job_config.job.config_file
    doc = tomlkit.parse(Path(source).read_text()) if source else tomlkit.document()
    given = {}
    for key in given_keys(train_args):
        value = job_config
        for part in key.split("."):
            value = getattr(value, part)
        if value is not None:  # TOML has no null: an unset key stays out
            given[key] = value
    for key, value in {**given, **best.overrides}.items():
        *sections, name = key.split(".")
        table = doc
        for section in sections:
            if section not in table:
                table[section] = tomlkit.table()
            table = table[section]
        table[name] = value
    header = (
        f"# written by: python -m torchtitan.plan {' '.join(argv)}\n"
        f"# predicted: {best.tokens_per_second_per_device:,.0f} tokens/s per GPU, "
        f"MFU {100 * best.mfu:.1f}%, peak {best.peak_gib:.1f} GiB per device\n"
    )
    try:
        with _ctrl_c_exits(signal.default_int_handler):
            write_atomic(path, (header + tomlkit.dumps(doc)).encode())  # whole, or the old kept
    except OSError as e:
        raise ConfigError(f"--write: {path}: {e.strerror or e}") from None
    return path
