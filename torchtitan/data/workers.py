"""``[training.dataloader]``: the training data read and tokenized in worker processes, resume
kept exact.

``num_workers = W`` forks W processes when iteration starts; worker ``k`` reads rows ``i`` of
every local batch with ``i % W == k``, from its own copy of the rank's loader
(:meth:`~torchtitan.data.loader.HFDataLoader.next_rows`; each row has a reader of its own, so
the shares are independent), and keeps up to ``prefetch_factor`` of its shares ready in a queue
of its own. The training process takes one share from each queue in turn and puts the rows back
in order: the batches are those the loader yields in the training process. (Not torch's
``DataLoader``: inside its workers the ``datasets`` library splits a streamed dataset between
them by itself, which would change the data.)

Each share carries its rows' loader state after them (``state_dict(positions)``) and the blend's
window counts. :meth:`WorkerLoader.state_dict` is the union of the last share the training loop
took from every worker: the position after the last batch consumed, however far ahead the
workers have read. A checkpoint made with workers resumes with or without them, and the other
way round. The training loader makes one endless pass, so its workers live for the whole run
(``persistent_workers`` changes nothing there); ``pin_memory`` puts each batch in page-locked
memory when CUDA is available (a no-op on CPU).
"""

from __future__ import annotations

import atexit
import functools
import multiprocessing as mp
import os
import queue
import signal
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from torchtitan.data.batch import Batch, make_batch
from torchtitan.data.loader import HFDataLoader, stack_rows
from torchtitan.errors import ConfigError, DataError, TorchTitanError
from torchtitan.observability.log import logger

# Signals the training process acts on (a preemption saves at the next step): a worker ignores
# them, so that a signal sent to the whole process group (Slurm) leaves it serving that step; it
# ends when the training process does (killed at its exit, or on finding itself orphaned).
_IGNORED_SIGNALS = ("SIGTERM", "SIGINT", "SIGUSR1", "SIGUSR2", "SIGHUP")


def _share(worker: int, num_workers: int, local_batch_size: int) -> list[int]:
    """The rows of every local batch that ``worker`` reads."""
    return [i for i in range(local_batch_size) if i % num_workers == worker]


def _worker(loader: HFDataLoader, worker: int, num_workers: int, out: Any) -> None:
    """A worker process: its rows of every batch, each share with the state of its rows after
    it, into ``out``. An error is sent as a share (the library's own as itself, any other as a
    one-line DataError) and ends the worker."""
    for name in _IGNORED_SIGNALS:
        signal.signal(getattr(signal, name), signal.SIG_IGN)
    parent = os.getppid()
    mine = _share(worker, num_workers, loader.local_batch_size)
    try:
        while (rows := loader.next_rows(mine)) is not None:
            tokens, starts = stack_rows(rows, loader.seq_len + 1)
            # by value (numpy): a tensor would be shared through this process, which may end
            share = {
                "tokens": tokens.numpy(),
                "starts": starts,
                "state": loader.state_dict(mine),
                "counts": list(loader.blend.counts),
            }
            if not _put(out, share, parent):
                return
        share = {"error": DataError(f"dataset {loader.label}: the training data ended")}
    except TorchTitanError as e:
        share = {"error": e}
    except Exception as e:  # noqa: BLE001 - reported in the training process, one line
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        share = {"error": DataError(f"data loader worker {worker}: {type(e).__name__}: {first}")}
    _put(out, share, parent)


def _put(out: Any, share: dict[str, Any], parent: int) -> bool:
    """``share`` into the queue once there is room; False if the training process is gone."""
    while os.getppid() == parent:
        try:
            out.put(share, timeout=5)
            return True
        except queue.Full:
            continue
    return False


def _kill(procs: list[Any]) -> None:
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()


class WorkerLoader:
    """An :class:`HFDataLoader` (an infinite one: the training data) read by worker processes;
    the same batches, ``state_dict`` and ``load_state_dict``. Anything else (``names``,
    ``rows_of``, ...) is the wrapped loader's."""

    def __init__(
        self,
        loader: HFDataLoader,
        num_workers: int,
        *,
        prefetch_factor: int = 2,
        pin_memory: bool = False,
        persistent_workers: bool = False,
    ) -> None:
        if not 1 <= num_workers <= loader.local_batch_size:
            raise ConfigError(
                f"training.dataloader.num_workers: {num_workers} workers, but each reads whole "
                f"rows of every batch and training.local_batch_size is {loader.local_batch_size}; "
                f"use 1 to {loader.local_batch_size} (or 0: no workers)"
            )
        self.loader, self.num_workers = loader, num_workers
        self.prefetch_factor, self.persistent_workers = prefetch_factor, persistent_workers
        self.pin_memory = pin_memory and torch.cuda.is_available()
        self._consumed: dict[int, dict[str, Any]] = {}  # worker -> its last share taken
        logger.info(
            f"Data loader: {num_workers} worker processes, {prefetch_factor} batches ahead each"
            + (", pinned memory" if self.pin_memory else "")
        )

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["loader"], name)

    def __iter__(self) -> Iterator[Batch]:
        if self._consumed:  # a new pass continues where the last batch taken left off
            self.loader.load_state_dict(self.state_dict())
            self._consumed = {}
        ctx = mp.get_context("fork")  # each worker starts from a copy of the loader as it is
        queues = [ctx.Queue(maxsize=self.prefetch_factor) for _ in range(self.num_workers)]
        procs = [
            ctx.Process(target=_worker, args=(self.loader, k, self.num_workers, q), daemon=True)
            for k, q in enumerate(queues)
        ]
        for p in procs:
            p.start()
        stop = functools.partial(_kill, procs)
        atexit.register(stop)  # they ignore SIGTERM, which multiprocessing's exit would send
        try:
            while True:
                yield self._batch([_get(q, p, k) for k, (q, p) in enumerate(zip(queues, procs))])
        finally:
            stop()
            atexit.unregister(stop)

    def _batch(self, shares: list[dict[str, Any]]) -> Batch:
        """One batch from every worker's share, its rows in order."""
        n, window = self.loader.local_batch_size, self.loader.seq_len + 1
        tokens = torch.empty((n, window), dtype=torch.long)
        starts = np.zeros((n, window), dtype=np.uint8)  # marks (see data/batch.py)
        for worker, share in enumerate(shares):
            if "error" in share:
                raise share["error"]
            rows = _share(worker, self.num_workers, n)
            tokens[rows], starts[rows] = torch.from_numpy(share["tokens"]), share["starts"]
        self._consumed = dict(enumerate(shares))
        batch = make_batch(tokens, starts, self.loader.mask_document_starts)
        return Batch(*(t.pin_memory() for t in batch)) if self.pin_memory else batch

    def tokens_per_source(self) -> dict[str, int]:
        """Input tokens each source has given the global stream up to the last batch taken."""
        if not self._consumed:
            return self.loader.tokens_per_source()
        counts = self._consumed[0]["counts"]
        return {n: c * self.loader.seq_len for n, c in zip(self.loader.names, counts, strict=True)}

    def state_dict(self) -> dict[str, Any]:
        """The loader's position after the last batch taken (see the module docstring)."""
        if not self._consumed:
            return self.loader.state_dict()
        state: dict[str, Any] = {}
        for part in self._consumed.values():
            state.update(part["state"])  # disjoint rows; the blend's position is everyone's
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.loader.load_state_dict(state_dict)
        self._consumed = {}


def _get(q: Any, proc: Any, worker: int) -> dict[str, Any]:
    """The next share of ``worker``; a DataError if the worker died without sending one."""
    while True:
        try:
            return q.get(timeout=5)
        except queue.Empty:
            if not proc.is_alive():
                raise DataError(
                    f"data loader worker {worker} (pid {proc.pid}) exited with code "
                    f"{proc.exitcode} (killed for memory?); see training.dataloader.num_workers"
                ) from None
