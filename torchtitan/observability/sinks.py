"""Where a rank's metrics are written besides the console: a TensorBoard run folder (continued
when a run resumes) and a Weights & Biases run. Each sink has ``write(values, step)`` and
``close()``; :class:`~torchtitan.observability.metrics.MetricsProcessor` calls them."""

from __future__ import annotations

import os
import re
from datetime import datetime
from typing import Any

from torchtitan.config.schema import Metrics as MetricsConfig
from torchtitan.observability.log import logger


class TensorBoardSink:
    """``purge_step``: the first step this run writes, when it resumes into an existing run
    folder; TensorBoard hides the points of that step and later from before (a run that went on
    past the checkpoint it is resumed from), so the curve stays one line."""

    def __init__(self, folder: str, purge_step: int | None = None) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.folder = folder
        self.writer = SummaryWriter(folder, max_queue=1000, purge_step=purge_step)
        resumed = f" (continuing its run from step {purge_step})" if purge_step else ""
        logger.info(f"TensorBoard metrics go to {folder}{resumed}")

    def write(self, values: dict[str, float], step: int) -> None:
        for key, value in values.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    """A Weights & Biases run in ``{dump_folder}/wandb`` with the job's config. ``WANDB_PROJECT``
    (default torchtitan), ``WANDB_NAME``, ``WANDB_ENTITY`` and ``WANDB_MODE=offline`` work as
    wandb documents them; with every rank writing, the ranks' runs share a group."""

    def __init__(self, dump_folder: str, run_config: dict, rank: int, all_ranks: bool) -> None:
        import wandb

        group = os.environ.get("TORCHELASTIC_RUN_ID") if all_ranks else None
        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", "torchtitan"),
            dir=dump_folder,
            config=run_config,
            group=group,
            name=f"rank_{rank}" if all_ranks else None,
        )
        logger.info(f"Weights & Biases run {self.run.name} ({self.run.dir})")

    def write(self, values: dict[str, float], step: int) -> None:
        self.run.log(values, step=step)

    def close(self) -> None:
        self.run.finish()


def build_sinks(
    m: MetricsConfig, dump_folder: str, rank: int, *, resumed_step: int = 0, run_config: dict
) -> list[Any]:
    """TensorBoard and W&B writers for this rank: rank 0's, or every rank's with
    ``metrics.save_for_all_ranks`` (TensorBoard then in ``{tb folder}/rank_{rank}/``). A run
    resumed from a checkpoint (``resumed_step`` > 0) writes into the newest TensorBoard run.
    ``run_config``: the whole resolved config, recorded with a W&B run."""
    if rank != 0 and not m.save_for_all_ranks:
        return []
    sinks: list[Any] = []
    if m.enable_tensorboard:
        folder = os.path.join(dump_folder, m.save_tb_folder)
        if m.save_for_all_ranks:
            folder = os.path.join(folder, f"rank_{rank}")
        run = newest_tb_run(folder) if resumed_step > 0 else None
        if run is not None:
            sinks.append(TensorBoardSink(run, purge_step=resumed_step + 1))
        else:
            sinks.append(TensorBoardSink(tb_run_dir(folder)))
    if m.enable_wandb:
        sinks.append(WandbSink(dump_folder, run_config, rank, m.save_for_all_ranks))
    return sinks


def tb_run_dir(folder: str) -> str:
    """``{folder}/<YYYYmmdd-HHMMSS>``: one subfolder per run."""
    return os.path.join(folder, datetime.now().strftime("%Y%m%d-%H%M%S"))


def newest_tb_run(folder: str) -> str | None:
    """The newest run subfolder of ``folder`` (names are start times) holding events, if any."""
    if not os.path.isdir(folder):
        return None
    runs = sorted(
        name
        for name in os.listdir(folder)
        if re.fullmatch(r"\d{8}-\d{6}", name)
        and any(f.startswith("events.out.tfevents") for f in os.listdir(os.path.join(folder, name)))
    )
    return os.path.join(folder, runs[-1]) if runs else None
