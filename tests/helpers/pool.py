"""Warm worker pools: N processes with torch imported and a gloo process group up, started once,
running test cases as functions.

``WorkerPool(world_size).run("module:function", *args, **kwargs)`` runs ``function`` on every
rank (``module`` importable from the test paths, e.g. a file in tests/helpers) and returns each
rank's return value, rank 0 first. Every case starts from the same state: seeds reset, a fresh
scratch folder (``pool_scratch()``), and after it the pool checks that the case left nothing
behind: process groups it created and did not destroy, compiled code (dynamo's caches), a
default group that is gone. Leftovers are cleaned and the case fails with a line naming them.

A case that raises on any rank fails with that rank's traceback; one that does not finish within
its timeout fails as hung. Either way the ranks that are still inside the case are killed and the
pool starts again at the next case, so one bad case never takes the session down. The idea is
PyTorch's ``MultiProcContinuousTest`` (torch.testing._internal.common_distributed).
"""

from __future__ import annotations

import importlib
import multiprocessing as mp
import os
import shutil
import sys
import tempfile
import time
import traceback
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Any

_SCRATCH = "TORCHTITAN_POOL_SCRATCH"


class CaseFailed(AssertionError):
    """A pool case raised, hung or left state behind (the message says which, and where)."""


def pool_scratch() -> str:
    """The running case's own empty folder (shared by its ranks)."""
    return os.environ[_SCRATCH]


# ----------------------------------------------------------------------------- worker side


class SharedMeshGroups:
    """``DeviceMesh``'s ``new_group`` for a process that builds one mesh after another (a pool's
    rank, the layout sweep's): a later case gets the groups an earlier one made for the same
    ranks and timeout (perhaps under another dimension's name) instead of new ones. torch 2.13
    makes new groups for every mesh and keeps them all (destroying them breaks later meshes:
    DTensor's caches hold the old meshes, equal to the new ones), and each idle gloo group has a
    thread that keeps waking: late in the layout sweep, with 154 such threads per rank, the
    machine made 63,000 context switches a second and spent 40% of its time in the kernel
    (measured 2026-11-30). Within a case a group is never handed out twice, so a case has as
    many distinct groups as a launch of it. Every rank makes the same calls in the same order, so
    every rank reuses alike."""

    def __init__(self, create: Any) -> None:
        self.create = create
        self.made: dict[tuple, list[Any]] = {}  # key -> the groups made for it, in order
        self.handed: dict[tuple, int] = {}  # key -> how many of them this case has

    def new_case(self) -> None:
        self.handed.clear()

    def __call__(self, ranks: Any = None, timeout: Any = None, backend: Any = None, **kw: Any):
        if kw.get("pg_options") is not None or kw.get("use_local_synchronization"):
            return self.create(ranks=ranks, timeout=timeout, backend=backend, **kw)
        key = (tuple(ranks or ()), str(timeout), backend)
        made, i = self.made.setdefault(key, []), self.handed.get(key, 0)
        if i == len(made):
            made.append(self.create(ranks=ranks, timeout=timeout, backend=backend, **kw))
        self.handed[key] = i + 1
        return made[i]


def share_mesh_groups() -> SharedMeshGroups:
    """Install :class:`SharedMeshGroups` as ``DeviceMesh``'s ``new_group`` in this process."""
    from torch.distributed import device_mesh

    shared = SharedMeshGroups(device_mesh.new_group)
    device_mesh.new_group = shared
    return shared


_SHARED: SharedMeshGroups | None = None  # this rank's, in a pool's worker


def _worker(
    rank: int, world: int, init_file: str, conn: Connection, path: list[str], env: dict
) -> None:
    sys.path[:] = path
    os.environ.update(env)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
    os.environ.update(LOCAL_WORLD_SIZE=str(world), GROUP_RANK="0")
    import torch.distributed as dist

    from torchtitan.distributed.utils import per_rank_compile_cache

    per_rank_compile_cache()  # as train.py's init_distributed does

    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=600),
    )
    global _SHARED
    _SHARED = share_mesh_groups()
    conn.send(("ready", rank))
    while (message := _next_case(conn)) is not None:
        conn.send(_run_case(*message))
    dist.destroy_process_group()


def _next_case(conn: Connection) -> tuple | None:
    """The next case, or None when the pool closes or its process is gone (the pipe's end)."""
    try:
        return conn.recv()
    except (EOFError, OSError):
        return None


def _groups() -> set[Any]:
    import torch.distributed as dist

    return set(dist.distributed_c10d._world.pg_map) - {dist.GroupMember.WORLD}


def _fresh_state(seed: int) -> None:
    import random

    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _leftovers(before: set[Any], compiles: bool, meshes: bool) -> list[str]:
    """What the case left behind, cleaned up: process groups it created and kept, and compiled
    graphs in dynamo's caches unless the case said it ``compiles`` (they are reset either way)."""
    import torch
    import torch.distributed as dist

    found = []
    kept = _groups() - before
    if kept and meshes:  # groups of device meshes, which later cases reuse (SharedMeshGroups)
        pass
    elif kept:
        found.append(f"{len(kept)} process group(s) it created and did not destroy")
        for group in kept:
            dist.destroy_process_group(group)
    compiled = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    if compiled and not compiles:
        found.append(f"{compiled} compiled graph(s) in dynamo's caches")
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    return found


def _run_case(
    ref: str, args: tuple, kwargs: dict, scratch: str, seed: int, compiles: bool, meshes: bool
) -> tuple[str, Any]:
    import torch.distributed as dist

    os.environ[_SCRATCH] = scratch
    if _SHARED is not None:
        _SHARED.new_case()
    _fresh_state(seed)
    before = _groups()
    try:
        module, _, name = ref.partition(":")
        value = getattr(importlib.import_module(module), name)(*args, **kwargs)
    except BaseException:
        return "raised", traceback.format_exc()
    if not dist.is_initialized():
        return "broken", "the case destroyed the default process group"
    left = _leftovers(before, compiles, meshes)
    if left:
        return "left", "; ".join(left)
    return "ok", value


# ----------------------------------------------------------------------------- test side


class WorkerPool:
    """``world_size`` warm ranks; started at the first case and again after a case killed them."""

    def __init__(
        self,
        world_size: int,
        *,
        case_timeout_s: float = 300.0,
        grace_s: float = 5.0,
        env: dict[str, str] | None = None,
    ):
        """``env``: set in the ranks' environment (e.g. ``launcher.train_env``'s offline
        caches)."""
        self.world_size, self.case_timeout_s, self.grace_s = world_size, case_timeout_s, grace_s
        self.env = dict(env or {})
        self._procs: list[Any] = []
        self._conns: list[Connection] = []
        self._root = tempfile.mkdtemp(prefix="pool-")
        self.cases = self.starts = 0

    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        init_file = os.path.join(self._root, f"init-{self.starts}")
        pipes = [ctx.Pipe() for _ in range(self.world_size)]
        self._procs = [
            ctx.Process(
                target=_worker, args=(r, self.world_size, init_file, child, sys.path, self.env)
            )
            for r, (_, child) in enumerate(pipes)
        ]
        for p in self._procs:
            # not daemonic: a case may start processes of its own (data loader workers); a rank
            # whose test process is gone reads the pipe's end and leaves
            p.start()
        self._conns = [parent for parent, _ in pipes]
        self.starts += 1
        replies = self._collect(120.0, what="start")
        if any(status != "ready" for status, _ in replies):
            self.close()
            raise CaseFailed(f"the pool's ranks did not start: {replies}")

    def run(
        self,
        ref: str,
        *args: Any,
        timeout_s: float | None = None,
        seed: int = 0,
        compiles: bool = False,
        meshes: bool = False,
        **kwargs: Any,
    ) -> list[Any]:
        """Each rank's return value of ``ref(*args, **kwargs)``; CaseFailed otherwise.
        ``compiles``: the case uses torch.compile (its caches are reset after it, not a fault);
        ``meshes``: it builds device meshes, whose process groups stay for the next case's
        meshes (``SharedMeshGroups``)."""
        if not self._procs:
            self._start()
        self.cases += 1
        scratch = os.path.join(self._root, f"case-{self.cases}")
        os.makedirs(scratch)
        for conn in self._conns:
            conn.send((ref, args, kwargs, scratch, seed, compiles, meshes))
        replies = self._collect(timeout_s or self.case_timeout_s, what=ref)
        bad = [(r, s, v) for r, (s, v) in enumerate(replies) if s != "ok"]
        if bad:
            if any(s in ("hung", "broken", "lost") for _, s, _ in bad):
                self.close()  # a rank is stuck inside the case or gone: start afresh next time
            raise CaseFailed(_describe(ref, bad))
        return [v for _, v in replies]

    def _collect(self, timeout_s: float, what: str) -> list[tuple[str, Any]]:
        """Every rank's reply; a rank that has none by the deadline (or within ``grace_s`` of a
        peer's failure) is 'hung', one whose process died is 'lost'."""
        deadline = time.monotonic() + timeout_s
        replies: list[tuple[str, Any] | None] = [None] * self.world_size
        while any(r is None for r in replies):
            for rank, conn in enumerate(self._conns):
                if replies[rank] is None and conn.poll(0.05):
                    try:
                        replies[rank] = conn.recv()
                    except EOFError:
                        replies[rank] = ("lost", f"rank {rank}'s process died")
                elif replies[rank] is None and not self._procs[rank].is_alive():
                    code = self._procs[rank].exitcode
                    replies[rank] = ("lost", f"rank {rank}'s process exited (code {code})")
                if replies[rank] is not None and replies[rank][0] not in ("ok", "ready"):
                    deadline = min(deadline, time.monotonic() + self.grace_s)  # peers: a grace
            if time.monotonic() > deadline:
                late = (
                    f"no reply within {timeout_s:g} s (or {self.grace_s:g} s after a peer failed)"
                )
                replies = [r if r is not None else ("hung", late) for r in replies]
        return replies  # type: ignore[return-value]

    def close(self) -> None:
        for conn in self._conns:
            try:
                conn.send(None)
            except (BrokenPipeError, OSError):
                pass
        for p in self._procs:
            p.join(timeout=2)
            if p.is_alive():
                p.kill()
                p.join()
        self._procs, self._conns = [], []

    def shutdown(self) -> None:
        self.close()
        shutil.rmtree(self._root, ignore_errors=True)


def _describe(ref: str, bad: list[tuple[int, str, Any]]) -> str:
    what = {
        "raised": "raised",
        "hung": "hung",
        "lost": "died",
        "broken": "broke the pool",
        "left": "left state behind",
    }
    lines = [f"pool case {ref}:"]
    for rank, status, value in bad:
        lines.append(f"  rank {rank} {what[status]}: {str(value).rstrip()}")
    return "\n".join(lines)
