"""Training metrics: throughput, FLOPs utilisation, memory, console lines and TensorBoard.

MFU = (model FLOPs per token x tokens per second per device) / the device's peak dense bf16 FLOPs.
Model FLOPs per token come from the model (see ``get_nparams_and_flops``): 6 x parameters except
the input embedding table + 6 x layers x dim x seq_len for causal attention. Recomputation from
activation checkpointing is not counted. On CPU there is no meaningful peak, so MFU is "n/a".
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from torchtitan.devices import peak_flops
from torchtitan.distributed.utils import device_type
from torchtitan.observability.log import logger
from torchtitan.observability.run_summary import Progress
from torchtitan.observability.sinks import TensorBoardSink


def _device_name() -> str:
    return torch.cuda.get_device_name() if device_type == "cuda" else "cpu"


class _Colors:
    def __init__(self, enabled: bool):
        codes = {
            "cyan": "\033[36m",
            "green": "\033[32m",
            "yellow": "\033[33m",
            "blue": "\033[34m",
            "magenta": "\033[35m",
            "red": "\033[31m",
            "reset": "\033[39m",
        }
        for name, code in codes.items():
            setattr(self, name, code if enabled else "")


@dataclass
class MetricsProcessor:
    """Collects per-step numbers on every rank; rank 0 prints and writes them every log_freq steps."""

    flops_per_token: int
    log_freq: int
    sinks: list[Any] = field(default_factory=list)  # where this rank's numbers are written
    color: bool = True
    is_rank0: bool = True
    data_tokens: Callable[[], dict[str, int]] | None = None  # tokens each data source has given
    total_steps: int = 0  # the run's last step: each step line says the share done and the ETA
    ntokens_since_last_log: int = 0
    data_loading_times: list[float] = field(default_factory=list)
    _last_log_time: float = field(default_factory=time.perf_counter)
    # for the run summary: the last values, and (tokens per device, seconds) over the logged
    # intervals after this run's first (compilation and first loads)
    last_loss: float | None = None
    last_validation: tuple[float, float] | None = None
    _intervals: int = 0
    _steady: list[float] = field(default_factory=lambda: [0.0, 0.0])
    _first: list[float] = field(default_factory=lambda: [0.0, 0.0])

    def __post_init__(self) -> None:
        name = _device_name()
        self.peak = peak_flops(name) if device_type == "cuda" else None
        if device_type == "cuda" and self.peak is None:
            logger.warning(f"Unknown peak FLOP/s for '{name}': MFU will be reported as n/a")
        self.colors = _Colors(self.color and sys.stdout.isatty())
        self.progress = Progress(self.total_steps) if self.total_steps else None
        tb = (sink.folder for sink in self.sinks if isinstance(sink, TensorBoardSink))
        self.tensorboard_folder = next(tb, None)  # this rank's TensorBoard run, if it writes one

    def begin(self) -> None:
        """The training loop starts: intervals and throughput count from here."""
        self._last_log_time = time.perf_counter()

    def should_log(self, step: int) -> bool:
        return step == 1 or step % self.log_freq == 0

    def log(
        self, step: int, loss: float, grad_norm: float, lr: float, extra: dict | None = None
    ) -> dict[str, float]:
        """Print (rank 0) and write the step's numbers; ``extra``: more of them (the ``moe/``
        load-balancing metrics and the multi-token-prediction loss ``mtp/loss`` get console
        lines of their own)."""
        elapsed = time.perf_counter() - self._last_log_time
        tps = self.ntokens_since_last_log / elapsed
        counted = self._steady if self._intervals else self._first
        counted[0] += self.ntokens_since_last_log
        counted[1] += elapsed
        self._intervals += 1
        self.last_loss = loss
        if self.progress is not None:
            self.progress.mark(step)
        tflops = self.flops_per_token * tps / 1e12
        mfu = 100 * self.flops_per_token * tps / self.peak if self.peak else None
        mem_peak, mem_reserved = device_memory()
        data_pct = 100 * sum(self.data_loading_times) / elapsed
        values = {
            "loss": loss,
            "grad_norm": grad_norm,
            "lr": lr,
            "throughput/tps": tps,
            "throughput/tflops": tflops,
            "memory/peak_active_gib": mem_peak,
            "memory/peak_reserved_gib": mem_reserved,
            "time/data_loading_pct": data_pct,
        }
        if mfu is not None:
            values["throughput/mfu_pct"] = mfu
        values.update(extra or {})
        sources = self.data_tokens() if self.data_tokens is not None else {}
        if len(sources) > 1:  # a mixture: how much of the data each source has given so far
            values.update({f"data/tokens/{name}": float(n) for name, n in sources.items()})
        if self.is_rank0:
            self._print(step, values, mfu)
            if len(sources) > 1:
                logger.info(_sources_line(sources))
            moe = moe_console_line(values)
            if moe is not None:
                logger.info(moe)
            if "mtp/loss" in values:
                logger.info(f"mtp: loss {values['mtp/loss']:.4f} (mean over the prediction depths)")
        for sink in self.sinks:
            sink.write(values, step)
        self.ntokens_since_last_log = 0
        self.data_loading_times.clear()
        reset_peak_memory()
        self._last_log_time = time.perf_counter()
        return values

    def log_downstream(self, step: int, results: list, secs: float) -> None:
        """One console line per task (rank 0) and ``eval/TASK/METRIC`` (``acc``, ``acc_norm``)
        for each (``results``: the evaluator's per-task scores)."""
        if self.is_rank0:
            c = self.colors
            for r in results:
                scores = "  ".join(f"{k}: {v:.4f}" for k, v in r.scores.items())
                logger.info(
                    f"{c.cyan}eval: step {step}  {r.name}  {scores}{c.reset}  ({r.docs} documents)"
                )
            logger.info(f"eval: step {step} took {secs:.2f}s")
        scalars = {f"eval/{r.name}/{k}": v for r in results for k, v in r.scores.items()}
        for sink in self.sinks:
            sink.write(scalars, step)

    def log_validation(
        self, step: int, loss: float, perplexity: float, batches: int, secs: float
    ) -> None:
        """One console line (rank 0) and ``validation/loss`` and ``validation/perplexity``."""
        self.last_validation = (loss, perplexity)
        if self.is_rank0:
            c = self.colors
            logger.info(
                f"{c.cyan}validation: step {step}  loss: {loss:.4f}  perplexity: {perplexity:.2f}"
                f"{c.reset}  ({batches} batches per rank, {secs:.2f}s)"
            )
        for sink in self.sinks:
            sink.write({"validation/loss": loss, "validation/perplexity": perplexity}, step)

    def _print(self, step: int, v: dict[str, float], mfu: float | None) -> None:
        c = self.colors
        mem = "rss" if device_type == "cpu" else "memory"
        mfu_s = f"{mfu:.2f}%" if mfu is not None else "n/a"
        muon = f"muon lr: {v['lr/muon']:.4e}  " if "lr/muon" in v else ""
        logger.info(
            f"{c.red}step: {step}  {c.green}loss: {v['loss']:.4f}  "
            f"{c.reset}grad_norm: {v['grad_norm']:.4f}  lr: {v['lr']:.4e}  {muon}"
            f"{c.yellow}{mem}: {v['memory/peak_active_gib']:5.2f}GiB  "
            f"{c.blue}tps: {round(v['throughput/tps']):,}  "
            f"{c.cyan}tflops: {v['throughput/tflops']:,.2f}  "
            f"{c.magenta}mfu: {mfu_s}{c.reset}"
            + (f"  {self.progress.text(step)}" if self.progress is not None else "")
        )

    def throughput(self) -> tuple[float | None, float | None]:
        """(tokens/s per device, MFU %) over this run's logged intervals after its first (all of
        them when there is only one); (None, None) before any."""
        tokens, secs = self._steady if self._intervals > 1 else self._first
        if secs <= 0:
            return None, None
        tps = tokens / secs
        return tps, (100 * self.flops_per_token * tps / self.peak if self.peak else None)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()
        self.sinks = []


def moe_console_line(values: dict[str, Any]) -> str | None:
    """``moe: load max/mean 1.41 (worst 1.87, layer 2)  aux loss 1.0312  expert bias |max|
    0.0040``, or None without MoE metrics."""
    if "moe/load_max_over_mean" not in values:
        return None
    line = (
        f"moe: load max/mean {values['moe/load_max_over_mean']:.2f} "
        f"(worst {values['moe/load_max_over_mean_worst']:.2f}, "
        f"layer {int(values['moe/load_worst_layer'])})"
    )
    if "moe/aux_loss" in values:
        line += f"  aux loss {values['moe/aux_loss']:.4f}"
    return line + f"  expert bias |max| {values['moe/expert_bias_abs_max']:.4f}"


def _sources_line(sources: dict[str, int]) -> str:
    """``data: web 70.0% (1.2M tokens)  code 30.0% (0.5M tokens)``: shares of the tokens so far."""
    total = sum(sources.values()) or 1
    return "data: " + "  ".join(
        f"{name} {100 * n / total:.1f}% ({_si(n)} tokens)" for name, n in sources.items()
    )


def _si(n: float) -> str:
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.1f}{unit}"
    return f"{n:.0f}"


def mean_over(value: Any, mesh: Any) -> float:
    """The mean of a scalar tensor over the ranks of ``mesh`` (None: this rank's value)."""
    if mesh is not None and mesh.size() > 1:
        value = value.clone()
        dist.all_reduce(value, op=dist.ReduceOp.AVG, group=mesh.get_group())
    return float(value)


# ----------------------------------------------------------------------------- memory


def device_memory() -> tuple[float, float]:
    """(peak allocated GiB, peak reserved GiB) on this device since the last reset; on CPU the
    process's peak resident set (VmHWM) twice: it includes the interpreter and libraries."""
    if device_type == "cuda":
        gib = 1024**3
        return torch.cuda.max_memory_allocated() / gib, torch.cuda.max_memory_reserved() / gib
    rss = _rss_gib()
    return rss, rss


def reset_peak_memory() -> None:
    if device_type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        return
    try:  # Linux: "5" resets VmHWM to the current resident set
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass  # elsewhere the peak is since the process started


def _rss_gib() -> float:
    try:
        return proc_status_kib("VmHWM") / 1024**2
    except (OSError, ValueError, StopIteration):
        return float("nan")


def proc_status_kib(field: str) -> int:
    """A memory field of ``/proc/self/status`` (``VmRSS``, ``VmHWM``, ...) in KiB (Linux)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))
