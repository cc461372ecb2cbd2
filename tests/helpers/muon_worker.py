"""Run by tests/e2e/test_muon_sharded.py under torchrun: 4 CPU processes over gloo, a 2 x 2 mesh.

For each way of splitting a parameter (the placements FSDP, tensor parallel, expert parallel and
expert tensor parallel give it), Muon's orthogonalization of the split update must equal the
orthogonalization of the whole tensor on one process to the last bit, and a stack of experts
split only on the expert dim must be orthogonalized without any communication. Rank 0 prints one
line per case::

    RESULT <case> <equal: 0|1> <collectives run>
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode

from torchtitan.optim.muon import orthogonalize, orthogonalize_all

GROUP = {"ns_coefficients": (3.4445, -4.775, 2.0315), "ns_steps": 5, "eps": 1e-7}
R, S0, S1, S2 = Replicate(), Shard(0), Shard(1), Shard(2)
# name -> (shape, placements on the 2 x 2 mesh)
CASES = {
    "experts_ep_x_efsdp": ((8, 16, 12), (S0, S0)),  # whole experts, split over all 4 ranks
    "experts_uneven": ((6, 16, 12), (S0, S0)),  # 2, 2, 1, 1 experts per rank
    "experts_ep": ((8, 16, 12), (S0, R)),
    "experts_ep_x_etp": ((8, 16, 12), (S0, S2)),  # each expert's hidden width split over TP
    "experts_fsdp_rows": ((8, 16, 12), (R, S1)),
    "matrix_fsdp_x_tp": ((16, 12), (S0, S1)),
    "matrix_tp": ((16, 12), (R, S0)),
}


def main() -> None:
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b"))
    for name, (shape, placements) in CASES.items():
        whole = torch.randn(shape, generator=torch.Generator().manual_seed(len(name)))
        expected = orthogonalize(whole, GROUP)
        split = distribute_tensor(whole, mesh, placements)
        with CommDebugMode() as comm:
            ortho = orthogonalize(split, GROUP)
        assert ortho.placements == split.placements, (name, ortho.placements)
        equal = torch.equal(ortho.full_tensor(), expected)
        if dist.get_rank() == 0:
            print(f"RESULT {name} {int(equal)} {comm.get_total_counts()}", flush=True)
    shared_out(dist.get_world_size())
    dist.barrier()  # neither rank tears its gloo pairs down while another still uses them
    dist.destroy_process_group()


def shared_out(world: int) -> None:
    """``orthogonalize_all`` over a list like an FSDP model's: row-split matrices of several
    sizes (uneven, and with fewer rows than ranks) in two dtypes, between an expert stack and a
    column-split matrix, which keep their own path. Each result equal to the whole tensor's."""
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    shapes = [(16, 12), (6, 5), (3, 7), (8, 8, 4), (17, 9), (12, 16), (20, 4), (5, 5), (9, 2)]
    placements = [(S0,)] * 9
    placements[3], placements[6] = (S0,), (S1,)  # the stack (own experts), a column split
    dtypes = [torch.float32] * 9
    dtypes[4] = dtypes[7] = torch.bfloat16
    wholes = [
        torch.randn(s, generator=torch.Generator().manual_seed(i)).to(d)
        for i, (s, d) in enumerate(zip(shapes, dtypes))
    ]
    splits = [distribute_tensor(w, mesh, p) for w, p in zip(wholes, placements)]
    with CommDebugMode() as comm:
        orthos = orthogonalize_all([(u, GROUP) for u in splits])
    equal = all(
        o.placements == u.placements and torch.equal(o.full_tensor(), orthogonalize(w, GROUP))
        for o, u, w in zip(orthos, splits, wholes)
    )
    if dist.get_rank() == 0:
        # float32 row splits: 5 matrices (2 turns of 4 ranks), bfloat16: 2 (1 turn), 2 all-to-alls
        # a turn; the column split: one all-gather; the stack: nothing
        print(f"RESULT shared_out {int(equal)} {comm.get_total_counts()}", flush=True)


if __name__ == "__main__":
    main()
