"""Muon for sharded parameters: ``torch.optim.Muon`` whose orthogonalization sees whole matrices.

Muon (Keller Jordan et al., 2024) keeps a momentum buffer per hidden matrix and applies its
orthogonalized update: a few Newton-Schulz iterations on the (Nesterov) momentum. Everything but
the Newton-Schulz step is elementwise, so under FSDP and tensor parallel it runs on each rank's
shard as is; the orthogonalization needs the whole matrix. For a ``DTensor`` parameter this
optimizer gathers the update (``full_tensor``: an all-gather over the parameter's mesh), every
rank orthogonalizes the same whole matrix, and keeps its own shard of the result
(``distribute_tensor`` with ``src_data_rank=None``: no communication). One process and every
layout therefore orthogonalize the same matrices. A 3-D parameter (the stacked routed experts of a
mixture-of-experts layer) is a batch of matrices, each orthogonalized on its own; split on the
expert dim (expert parallel, FSDP), each rank orthogonalizes only its own experts, gathered only
where a split runs through the matrices (expert tensor parallel). Matrices split by rows over one
mesh dim (FSDP) are not orthogonalized on every rank: the optimizer step shares them out, one
matrix per rank in each turn (``turns``).

The arithmetic is torch's own (``torch.optim._muon``: the Newton-Schulz iteration in bfloat16 and
the learning-rate adjustment by shape); the state (``momentum_buffer``) is torch's, so the
optimizer state dict is the same as ``torch.optim.Muon``'s. On CPU the iteration's bfloat16 matrix
products run as float32 GEMMs rounded to bfloat16 (``newton_schulz_bf16_in_fp32_gemms``: 20x
faster where the CPU has no bfloat16 instructions).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.optim._muon import _adjust_lr, _zeropower_via_newtonschulz

from torchtitan.optim.bf16_state import closure_loss, keep_state_dtype, with_grads


def orthogonalize(update: torch.Tensor, group: dict[str, Any]) -> torch.Tensor:
    """Newton-Schulz of the whole matrix (or of each matrix of a 3-D stack), as ``update``."""
    if isinstance(update, DTensor) and update.ndim == 3:
        return _orthogonalize_own_experts(update, group)
    whole = update.full_tensor() if isinstance(update, DTensor) else update
    ortho = _newton_schulz(whole, group).to(update.dtype)
    if isinstance(update, DTensor):  # this rank's shard of the same whole result
        return distribute_tensor(ortho, update.device_mesh, update.placements, src_data_rank=None)
    return ortho


def orthogonalize_all(updates: list[tuple[torch.Tensor, dict[str, Any]]]) -> list[torch.Tensor]:
    """``orthogonalize`` of each ``(update, group)``, the same numbers, turn by turn
    (``turns``)."""
    out: list[torch.Tensor] = [torch.empty(0)] * len(updates)
    for turn in turns([u for u, _ in updates]):
        for i, ortho in zip(turn, orthogonalize_turn([updates[i] for i in turn])):
            out[i] = ortho
    return out


def turns(tensors: list[torch.Tensor]) -> list[list[int]]:
    """The indices of ``tensors`` grouped as they are orthogonalized. Matrices split by rows over
    a one-dimensional mesh (FSDP; column-wise tensor parallel) are shared out: a turn holds up to
    W of them (W the mesh's ranks, one dtype), and in it each rank receives the rows of one
    matrix (an all-to-all), orthogonalizes it, and sends every rank its rows back (a second
    all-to-all). A mesh of W ranks so does each Newton-Schulz once rather than W times, for the
    traffic of one all-gather. Any other tensor is a turn of its own. Every rank of a mesh must
    list the same tensors in the same order (an optimizer's parameters are)."""
    out: list[list[int]] = []
    filling: dict[tuple, list[int]] = {}  # (mesh, dtype) -> its turn being filled
    for i, t in enumerate(tensors):
        if not _rows_split_on_one_dim(t):
            out.append([i])
            continue
        turn = filling.get((t.device_mesh, t.dtype))
        if turn is None or len(turn) == t.device_mesh.size():
            turn = filling[(t.device_mesh, t.dtype)] = []
            out.append(turn)
        turn.append(i)
    return out


def orthogonalize_turn(turn: list[tuple[torch.Tensor, dict[str, Any]]]) -> list[torch.Tensor]:
    """The orthogonalized updates of one of ``turns``."""
    first = turn[0][0]
    if _rows_split_on_one_dim(first):
        return _shared_out(turn, first.device_mesh)
    return [orthogonalize(update, group) for update, group in turn]


def _rows_split_on_one_dim(update: torch.Tensor) -> bool:
    return (
        isinstance(update, DTensor)
        and update.ndim == 2
        and update.device_mesh.ndim == 1
        and update.placements == (Shard(0),)
        and update.device_mesh.size() > 1
    )


def _row_counts(rows: int, ranks: int) -> list[int]:
    """Each rank's rows of a ``Shard(0)`` split (``torch.chunk``'s: ceil-sized, the last short)."""
    size = -(-rows // ranks)
    return [max(0, min(rows, (r + 1) * size) - r * size) for r in range(ranks)]


def _shared_out(turn: list[tuple[DTensor, dict[str, Any]]], mesh: Any) -> list[DTensor]:
    """Rank ``i`` of the mesh orthogonalizes the whole ``turn[i]`` (a turn has at most one
    matrix per rank); every rank gets its rows of each result back."""
    ranks, me, pg = mesh.size(), mesh.get_local_rank(), mesh.get_group()
    rows = [_row_counts(u.shape[0], ranks) for u, _ in turn]
    cols = [u.shape[1] for u, _ in turn]
    local = [u.to_local() for u, _ in turn]
    assert all(t.shape[0] == rows[i][me] for i, t in enumerate(local)), "unexpected FSDP split"
    mine = me < len(turn)  # whether this rank orthogonalizes one matrix of the turn
    gathered = local[0].new_empty((turn[me][0].numel(),) if mine else (0,))
    send = torch.cat([t.reshape(-1) for t in local])
    sent = [rows[i][me] * cols[i] for i in range(len(turn))] + [0] * (ranks - len(turn))
    received = [rows[me][r] * cols[me] if mine else 0 for r in range(ranks)]
    dist.all_to_all_single(gathered, send, received, sent, group=pg)
    if mine:
        whole = gathered.view(turn[me][0].shape)
        result = _newton_schulz(whole, turn[me][1]).to(whole.dtype).reshape(-1)
    else:
        result = gathered
    back = local[0].new_empty(send.shape)
    dist.all_to_all_single(back, result.contiguous(), sent, received, group=pg)
    pieces = back.split(sent[: len(turn)])
    return [
        _split_like(u, piece.view(t.shape), u.placements)
        for piece, t, (u, _) in zip(pieces, local, turn)
    ]


def _split_like(update: DTensor, local: torch.Tensor, placements: Any) -> DTensor:
    """``local`` as this rank's piece of a tensor of ``update``'s global shape."""
    return DTensor.from_local(
        local,
        update.device_mesh,
        placements,
        run_check=False,
        shape=update.shape,
        stride=update.stride(),
    )


def _newton_schulz(matrices: torch.Tensor, group: dict[str, Any]) -> torch.Tensor:
    coefficients, steps, eps = group["ns_coefficients"], group["ns_steps"], group["eps"]
    one = _zeropower_via_newtonschulz
    if matrices.device.type == "cpu":
        one = newton_schulz_bf16_in_fp32_gemms
    if matrices.ndim == 2:
        return one(matrices, coefficients, steps, eps)
    return torch.stack([one(m, coefficients, steps, eps) for m in matrices])


def newton_schulz_bf16_in_fp32_gemms(
    grad: torch.Tensor, coefficients: tuple[float, float, float], steps: int, eps: float
) -> torch.Tensor:
    """torch's Newton-Schulz iteration (``_zeropower_via_newtonschulz``: bfloat16 values) with
    each matrix product done by a float32 GEMM on the bfloat16 values, its result rounded to
    bfloat16: what a bfloat16 GEMM computes (float32 accumulation, one rounding), in another
    summation order. On a CPU without bfloat16 instructions (AVX2) torch's bfloat16 GEMM is
    20-30x slower than float32 (256x256: 25 ms against 1.2 ms), which made a Muon step of the
    Llama 4 debug model take 9.5 s against AdamW's 0.15 s. The results differ from torch's by
    the summation order's rounding (relative 1e-3 to 8e-3; both 1.2e-2 from the exact
    iteration in float64: ``tests/unit/optim/test_muon.py``)."""
    a, b, c = coefficients
    x = grad.bfloat16()
    if grad.size(0) > grad.size(1):
        x = x.T
    x = x.div(x.norm().clamp(min=eps)).float()  # bfloat16 values held in float32

    def rounded(t: torch.Tensor) -> torch.Tensor:
        return t.bfloat16().float()

    for _ in range(steps):
        gram = rounded(x @ x.T)
        update = rounded(torch.addmm(gram, gram, gram, beta=b, alpha=c))
        x = rounded(torch.addmm(x, update, x, beta=a))
    x = x.bfloat16()
    return x.T if grad.size(0) > grad.size(1) else x


def _orthogonalize_own_experts(update: DTensor, group: dict[str, Any]) -> DTensor:
    """A stack of experts split on the expert dim (expert parallel, FSDP) needs no gathering
    there: each rank orthogonalizes whole matrices of its own experts. Only splits inside the
    matrices (expert tensor parallel) are gathered; the result is split back the same way."""
    mesh, placements = update.device_mesh, update.placements
    own = [p if isinstance(p, Shard) and p.dim == 0 else Replicate() for p in placements]
    mine = update.redistribute(mesh, own).to_local()
    ortho = _split_like(update, _newton_schulz(mine, group).to(update.dtype), own)
    return ortho.redistribute(mesh, placements)


class DistributedMuon(torch.optim.Optimizer):
    """``torch.optim.Muon``'s update and settings over 2-D (and 3-D expert) parameters that may
    be ``DTensor`` shards (torch's class takes 2-D parameters only)."""

    def __init__(
        self,
        params: Any,
        *,
        lr: float,
        weight_decay: float,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: tuple[float, float, float] = (3.4445, -4.775, 2.0315),
        eps: float = 1e-7,
        ns_steps: int = 5,
        adjust_lr_fn: str | None = None,
        state_dtype: torch.dtype | None = None,
    ) -> None:
        defaults = {
            "lr": lr,
            "weight_decay": weight_decay,
            "momentum": momentum,
            "nesterov": nesterov,
            "ns_coefficients": ns_coefficients,
            "eps": eps,
            "ns_steps": ns_steps,
            "adjust_lr_fn": adjust_lr_fn,
        }
        super().__init__(params, defaults)
        self.state_dtype = state_dtype  # of the momentum buffers; None: the gradient's
        for group in self.param_groups:
            for p in group["params"]:
                if p.ndim not in (2, 3):
                    raise ValueError(f"Muon takes matrices (or stacks of them), not {p.ndim}-D")

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's loading casts the buffers to the parameters' dtype: back to ``state_dtype``."""
        super().load_state_dict(state_dict)
        if self.state_dtype is not None:
            keep_state_dtype(self, ("momentum_buffer",), self.state_dtype)

    def _momentum(self, group: dict[str, Any], p: torch.Tensor, state: dict) -> torch.Tensor:
        """The momentum buffer moved by this step's gradient; the update to orthogonalize."""
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p.grad, dtype=self.state_dtype)
        buf, momentum = state["momentum_buffer"], group["momentum"]
        work = buf if buf.dtype == p.grad.dtype else buf.to(p.grad.dtype)  # bf16 state
        work.lerp_(p.grad, 1 - momentum)
        update = p.grad.lerp(work, momentum) if group["nesterov"] else work
        if work is not buf:
            buf.copy_(work)
        return update

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = closure_loss(closure)
        params = list(with_grads(self))
        # turn by turn (``turns``): one turn's updates and results are alive at a time
        for turn in turns([p.grad for _, p, _ in params]):
            batch = [params[i] for i in turn]
            updates = [(self._momentum(group, p, state), group) for group, p, state in batch]
            for (group, p, _), ortho in zip(batch, orthogonalize_turn(updates)):
                lr = group["lr"]
                p.mul_(1 - lr * group["weight_decay"])
                p.add_(ortho, alpha=-_adjust_lr(lr, group["adjust_lr_fn"], p.shape[-2:]))
        return loss
