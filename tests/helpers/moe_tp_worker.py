"""Run by tests/e2e/test_moe_parallel.py under torchrun: 2 CPU processes over gloo, tensor
parallel 2, for each MoE family named on the command line.

Every rank builds the family's debug model with the same weights (routers scaled up so that the
routing is spread out and its gradient matters) and runs one forward and backward without
parallelism (the reference), then again under the family's TP plan (sequence parallel, the
experts split on their hidden width; with ``--compiled-blocks`` each block also compiled with
``fullgraph=True``, as ``compile.enable`` does). Rank 0 prints the largest error of the logits and of any
gradient relative to the reference (per tensor, over its largest magnitude), and the parameter
with the largest gradient error::

    RESULT <family> <logits err> <grad err> <worst parameter>
"""

from __future__ import annotations

import dataclasses
import sys

import torch
import torch.distributed as dist
from norms_tp_worker import rel, step  # the same one-step run and per-tensor error
from torch.distributed.device_mesh import init_device_mesh

from torchtitan.distributed.tensor_parallel import apply_tp
from torchtitan.train_spec import get_model_args, get_train_spec

VOCAB = 2256


def build(family: str, state: dict | None = None) -> torch.nn.Module:
    args = dataclasses.replace(get_model_args(family, "debugmodel"), vocab_size=VOCAB)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = get_train_spec(family).cls(args)
    model.to_empty(device="cpu")
    model.init_weights()
    with torch.no_grad():
        if state is not None:
            model.load_state_dict(state)
        else:
            for name, p in model.named_parameters():
                if "router" in name:
                    p.mul_(20)
    return model


def main() -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    compiled = "--compiled-blocks" in sys.argv
    for family in [a for a in sys.argv[1:] if not a.startswith("--")]:
        g = torch.Generator().manual_seed(2)
        tokens = torch.randint(0, VOCAB, (2, 32), generator=g)
        dlogits = torch.randn(2, 32, VOCAB, generator=g)
        reference = build(family)
        state = {k: v.clone() for k, v in reference.state_dict().items()}
        ref_logits, ref_grads = step(reference, tokens, dlogits)
        model = build(family, state)
        # the family's own block plan (what parallelize_decoder applies)
        block_plan = get_train_spec(family).parallelize_fn.keywords["block_plan"]
        apply_tp(model, mesh, block_plan, loss_parallel=False, compiled_blocks=compiled)
        if compiled:
            for block in model.layers.values():
                block.compile(fullgraph=True)
        logits, grads = step(model, tokens, dlogits)
        errs = {n: rel(grads[n], ref_grads[n]) for n in ref_grads}  # collectives: every rank
        worst = max(errs, key=errs.get)
        if dist.get_rank() == 0:
            print(f"RESULT {family} {rel(logits, ref_logits):.3e} {errs[worst]:.3e} {worst}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
