"""Device, process group and the tensor helpers every parallelism shares: one code path, CUDA +
NCCL when there is a GPU, else CPU + gloo."""

from __future__ import annotations

import os
import re
import traceback
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from torchtitan.errors import CollectiveTimeout

device_type = "cuda" if torch.cuda.is_available() else "cpu"
dist_backend = "nccl" if device_type == "cuda" else "gloo"
_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def world_size_from_env() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def init_device() -> torch.device:
    if device_type == "cuda":
        device = torch.device("cuda", local_rank() % torch.cuda.device_count())
        torch.cuda.set_device(device)
        return device
    return torch.device("cpu")


def init_distributed(device: torch.device, comm: Any = None, dump_folder: str = ".") -> None:
    """Create the default process group when launched by torchrun (WORLD_SIZE set), with
    ``comm.init_timeout_seconds`` until the first step ends (see :func:`set_train_timeout`)."""
    if "RANK" not in os.environ or dist.is_initialized():
        return
    per_rank_compile_cache()
    timeout_s = comm.init_timeout_seconds if comm is not None else 600
    if comm is not None and device_type == "cuda":
        _nccl_flight_recorder(comm, dump_folder)
    kwargs = {}
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    if restart != "0" and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        # After torchrun restarts the workers, the agent's store still holds the previous
        # attempt's process-group keys, and gloo then connects to dead peers' addresses (seen
        # with torch 2.13: "Connection refused" or a hang). Keys of this attempt get their own
        # prefix.
        store = dist.TCPStore(
            os.environ["MASTER_ADDR"],
            int(os.environ["MASTER_PORT"]),
            is_master=False,
            timeout=timedelta(seconds=timeout_s),
        )
        kwargs = {
            "store": dist.PrefixStore(f"torchtitan/attempt_{restart}", store),
            "rank": int(os.environ["RANK"]),
            "world_size": int(os.environ["WORLD_SIZE"]),
        }
    dist.init_process_group(
        backend=dist_backend,
        timeout=timedelta(seconds=timeout_s),
        device_id=device if device_type == "cuda" else None,
        **kwargs,
    )


def per_rank_compile_cache() -> None:
    """Key torch.compile's on-disk graph caches by rank: ``torch.compiler.config.cache_key_tag``
    gets ``rank_<RANK>`` (after a tag the user set), so a rank only ever loads graphs it compiled.

    torch 2.13's AOTAutograd cache keys a DTensor by its spec (mesh, placements, global shape),
    the same on every rank, while the compiled backward can depend on the rank (which shard of a
    gradient it keeps; pytorch/pytorch#188390, fixed there for CUDA devices only). With one key
    for all ranks a warm run then loads another rank's graph: measured here, a tensor-parallel
    MoE block compiled around a graph break gave the second rank another rank's norm gradients
    (108% off) on the second run. The tag is part of the AOTAutograd and FX graph cache keys but
    not of a compiled kernel's, which is keyed by its own source: the ranks keep sharing the one
    cache folder, and the first rank to reach a kernel compiles it for the others (inductor holds
    a file lock per kernel), where a folder per rank had every rank run the C++ compiler (or
    Triton) for the same kernels."""
    rank = os.environ.get("RANK")
    if rank is None:
        return
    import torch.compiler.config as compiler_config

    own = f"rank_{rank}"
    tag = compiler_config.cache_key_tag
    if tag != own and not tag.endswith(f"/{own}"):  # not twice
        compiler_config.cache_key_tag = f"{tag}/{own}" if tag else own


# what a collective's timeout says: gloo's transport, and NCCL's watchdog when it raises (with
# TORCH_NCCL_ASYNC_ERROR_HANDLING=1, torchrun's default, it aborts the process instead)
_TIMEOUT_TEXT = re.compile(
    r"Timed out waiting (\d+)ms|Watchdog caught collective operation timeout"
)
_COLLECTIVE_FILES = ("distributed_c10d.py", "_functional_collectives.py")


def collective_timeout(exc: BaseException, stacks: Any = None) -> CollectiveTimeout | None:
    """``exc`` as one line if a collective raised it on timing out, else None: the collective it
    waited in and the library frame that called it, from the traceback, and ``stacks``, the
    folder where the hang watchdog wrote every waiting rank's stacks, if it did. Start-up
    timeouts (the rendezvous, the store) are not collectives and stay as they are."""
    found = _TIMEOUT_TEXT.search(str(exc)) if isinstance(exc, RuntimeError) else None
    frames = traceback.extract_tb(exc.__traceback__)
    ops = [f for f in frames if os.path.basename(f.filename) in _COLLECTIVE_FILES]
    if found is None or not ops:
        return None
    ours = [
        f
        for f in frames
        if _ROOT in os.path.abspath(f.filename) and "site-packages" not in f.filename
    ]
    waited = f" after {int(found.group(1)) / 1000:g}s" if found.group(1) else ""
    caller = (
        f" (from {os.path.relpath(ours[-1].filename, _ROOT)}:{ours[-1].lineno} {ours[-1].name})"
        if ours
        else ""
    )
    return CollectiveTimeout(
        f"a collective timed out{waited} waiting in {ops[-1].name}{caller}: a peer rank stopped, "
        "died or lags far behind (comm.init_timeout_seconds until the first step ends, then "
        "comm.train_timeout_seconds); "
        + (
            f"every waiting rank's stacks are in {stacks}/"
            if stacks
            else "no stacks were written (the hang watchdog watches training steps, when "
            "resilience.hang_watchdog_factor is above 0)"
        )
    )


def _nccl_flight_recorder(comm: Any, dump_folder: str) -> None:
    """NCCL keeps its last ``trace_buf_size`` collectives per rank and dumps them on a timeout
    to ``{dump_folder}/{save_traces_folder}/rank_N`` (read with torch's fr_trace tool). Values the
    user exported themselves win."""
    os.environ.setdefault("TORCH_NCCL_TRACE_BUFFER_SIZE", str(comm.trace_buf_size))
    if comm.trace_buf_size > 0:
        folder = os.path.join(dump_folder, comm.save_traces_folder)
        os.makedirs(folder, exist_ok=True)
        os.environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
        os.environ.setdefault("TORCH_NCCL_DEBUG_INFO_TEMP_FILE", os.path.join(folder, "rank_"))


def set_train_timeout(comm: Any) -> None:
    """After the first step (compile, checkpoint loading), collectives get the usually shorter
    ``comm.train_timeout_seconds``."""
    if not dist.is_initialized() or comm.train_timeout_seconds == comm.init_timeout_seconds:
        return
    timeout = timedelta(seconds=comm.train_timeout_seconds)
    for group in [dist.group.WORLD, *_all_groups()]:
        dist.distributed_c10d._set_pg_timeout(timeout, group)


def _all_groups() -> list[Any]:
    return list(dist.distributed_c10d._world.pg_map)


def waited(t: torch.Tensor) -> torch.Tensor:
    """``t``, or a plain copy of it if it is a functional collective's result not yet waited for
    (``AsyncCollectiveTensor``, e.g. the TP embedding's reduce-scatter). Handed to compiled code
    as is, its gradient comes back wrong (measured on torch 2.13: the embedding gradient is lost
    under FSDP x TP, backward fails under TP alone). The copy, ``[B, T / tp, dim]`` once per step,
    is where the wait happens."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    return t.clone() if isinstance(t, AsyncCollectiveTensor) else t


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """A plain tensor: a DTensor (sharded, replicated or partial) gathered whole, else ``t``."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


class SteppedGradNorms:
    """Squared norms of the gradients that ``optimizer.early_step_in_backward`` consumed and
    freed during backward (``torchtitan/optim/optimizers.py``), so that the step still reports the norm
    of its whole gradient. Summed locally per mesh and placements as backward produces them;
    :meth:`take` reduces each sum over the mesh dims its gradients are split on (a dim they are
    replicated on holds the same values on every rank) and starts again."""

    def __init__(self) -> None:
        self.sums: dict[Any, torch.Tensor] = {}

    def add(self, grad: torch.Tensor) -> None:
        from torch.distributed.tensor import DTensor, Replicate

        key, local = None, grad
        if isinstance(grad, DTensor):
            if any(p.is_partial() for p in grad.placements):  # a sum still to take (TP's norms)
                whole = [Replicate() if p.is_partial() else p for p in grad.placements]
                grad = grad.redistribute(placements=whole)
            key, local = (grad.device_mesh, tuple(grad.placements)), grad.to_local()
        sq = torch.linalg.vector_norm(local.detach(), dtype=torch.float32).square()
        self.sums[key] = self.sums[key] + sq if key in self.sums else sq

    def take(self) -> torch.Tensor | None:
        """The global squared norm of what was added since the last call (None: nothing)."""
        if not self.sums:
            return None
        total = torch.zeros((), dtype=torch.float32)
        for key, sq in self.sums.items():
            if key is not None:
                mesh, placements = key
                for dim, placement in enumerate(placements):
                    if not placement.is_replicate() and mesh.size(dim) > 1:
                        dist.all_reduce(sq, group=mesh.get_group(dim))
            total = total.to(sq.device) + sq
        self.sums = {}
        return total


# the process's record (the training loop's clip_grad_norm_ reads it)
stepped_grad_norms = SteppedGradNorms()


def clip_grad_norm_(
    params: list[torch.Tensor], max_norm: float, pp_group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """Clip by the global L2 norm over all parameters, whether plain, DTensor or pipeline-split.

    DTensor gradients (FSDP, TP) give their global norm through ``full_tensor()``, one group of
    gradients on the same mesh at a time (expert parallelism puts the routed experts on a mesh of
    their own); with pipeline parallelism each rank holds other parameters, so squared norms are
    summed over ``pp_group``. Gradients already applied and freed in backward
    (``optimizer.early_step_in_backward``) count in the norm (:data:`stepped_grad_norms`) but
    cannot be clipped.
    """
    groups: dict[Any, list[torch.Tensor]] = {}
    for p in params:
        if p.grad is not None:
            groups.setdefault(getattr(p.grad, "device_mesh", None), []).append(p)
    norms = [
        full_tensor(
            torch.nn.utils.get_total_norm([p.grad for p in group], norm_type=2.0, foreach=True)
        )
        for group in (groups.values() or [[]])
    ]
    stepped = stepped_grad_norms.take()
    if stepped is not None:
        norms.append(stepped.sqrt().to(norms[0].device))
    total = torch.stack(norms).square().sum().sqrt() if len(norms) > 1 else norms[0]
    if pp_group is not None:
        squared = total**2
        dist.all_reduce(squared, group=pp_group)
        total = squared.sqrt()
    for group in groups.values():
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, total, foreach=True)
    return total


def block_slots(model: Any) -> list[tuple[Any, str]]:
    """Where each transformer block of a decoder sits, as ``(container, name)``: the entries of
    ``model.layers``, then each multi-token-prediction depth's ``block`` (``model.mtp_layers``).
    Every parallelism treats them alike (EP, AC, compile, FSDP); a wrapper replaces a block
    with ``setattr(container, name, wrapped)``."""
    slots = [(model.layers, name) for name in model.layers]
    mtp = getattr(model, "mtp_layers", None)
    if mtp is not None:
        slots += [(layer, "block") for layer in mtp.values()]
    return slots


def blocks(model: Any) -> list[Any]:
    """The transformer blocks of :func:`block_slots`, in order."""
    return [getattr(container, name) for container, name in block_slots(model)]
