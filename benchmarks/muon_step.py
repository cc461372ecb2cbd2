"""Muon's orthogonalization under FSDP: every rank doing every matrix vs sharing them out.

Muon orthogonalizes each hidden matrix whole. With the matrices split by rows over W ranks (FSDP),
either every rank gathers every matrix and orthogonalizes all of them (``orthogonalize`` per
matrix: an all-gather each, W times the Newton-Schulz work in all), or the matrices are shared
out (``orthogonalize_all``: in turns of W matrices, each rank receives the rows of one, does its
Newton-Schulz, and sends the rows back; two all-to-alls a turn). Both give the same numbers: the
benchmark checks that bit for bit.

The matrices are those Muon trains in a model flavor (built on the meta device, so any size
works), with random values. Usage (CPU processes over gloo; on GPUs, CUDA and NCCL)::

    python benchmarks/muon_step.py [--ranks 2] [--model llama3] [--flavor debugmodel] \\
        [--repeats 5] [--json]

Prints one row: ranks, matrices, their parameters, the median time of an orthogonalization of
all of them each way, the speedup, and whether the results are equal.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GROUP = {"ns_coefficients": (3.4445, -4.775, 2.0315), "ns_steps": 5, "eps": 1e-7}


def hidden_shapes(model: str, flavor: str) -> list[tuple[int, ...]]:
    """The shapes of the parameters Muon trains in ``model``'s ``flavor`` (2-D matrices)."""
    import torch

    from torchtitan.models.spec import get_model_args, get_model_spec
    from torchtitan.optim.param_groups import categories, for_muon

    # the vocabulary sizes only the embeddings and the output, which Muon does not train
    margs = dataclasses.replace(get_model_args(model, flavor), vocab_size=2048)
    with torch.device("meta"):
        m = get_model_spec(model).cls(margs)
    kinds = categories(m)
    return [
        tuple(p.shape) for n, p in m.named_parameters() if p.ndim == 2 and for_muon(kinds[n], p)
    ]


def timed(fn, device) -> float:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    result = fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start, result


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from torchtitan.optim.muon import orthogonalize, orthogonalize_all

    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo")
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    shapes = hidden_shapes(args.model, args.flavor)
    torch.manual_seed(0)  # one whole matrix at a time: a rank keeps only its rows of each
    updates = [distribute_tensor(torch.randn(s, device=device), mesh, [Shard(0)]) for s in shapes]
    times: dict[str, list[float]] = {"every_rank_s": [], "shared_out_s": []}
    for _ in range(args.repeats + 1):  # the first round warms up
        dist.barrier()
        t_all, every = timed(lambda: [orthogonalize(u, GROUP) for u in updates], device)
        dist.barrier()
        t_shared, shared = timed(lambda: orthogonalize_all([(u, GROUP) for u in updates]), device)
        times["every_rank_s"].append(t_all)
        times["shared_out_s"].append(t_shared)
    equal = all(torch.equal(a.to_local(), b.to_local()) for a, b in zip(every, shared))
    same = torch.tensor([int(equal)], device=device)
    dist.all_reduce(same, op=dist.ReduceOp.MIN)
    if dist.get_rank() == 0:
        row = {name: statistics.median(v[1:]) for name, v in times.items()}
        row |= {
            "ranks": dist.get_world_size(),
            "matrices": len(shapes),
            "parameters": sum(a * b for a, b in shapes),
            "equal": bool(same.item()),
            "speedup": row["every_rank_s"] / row["shared_out_s"],
        }
        print("ROW " + json.dumps(row), flush=True)
    dist.barrier()  # neither rank tears its gloo pairs down while another still uses them
    dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--model", default="llama3")
    parser.add_argument("--flavor", default="debugmodel")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return 0
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(args.ranks),
        __file__,
        "--worker",
        "--model",
        args.model,
        "--flavor",
        args.flavor,
        "--repeats",
        str(args.repeats),
    ]
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    )
    env.setdefault("OMP_NUM_THREADS", "1")
    out = subprocess.run(cmd, env=env, capture_output=True, text=True)
    rows = [json.loads(ln[4:]) for ln in out.stdout.splitlines() if ln.startswith("ROW ")]
    if out.returncode != 0 or not rows:
        print(f"error: the benchmark's processes failed:\n{out.stderr[-3000:]}", file=sys.stderr)
        return 1
    row = rows[0]
    if args.json:
        print(json.dumps(row))
        return 0
    print(
        "| ranks | matrices | parameters | every rank does all (ms) | shared out (ms) | speedup "
        "| same result |"
    )
    print("| ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    print(
        f"| {row['ranks']} | {row['matrices']} | {row['parameters']:,} | "
        f"{1e3 * row['every_rank_s']:.1f} | {1e3 * row['shared_out_s']:.1f} | "
        f"{row['speedup']:.2f}x | {'bit for bit' if row['equal'] else 'NO'} |"
    )
    return 0 if row["equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
