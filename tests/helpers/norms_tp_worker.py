"""Run by tests/e2e/test_norms.py under torchrun: 2 CPU processes over gloo, tensor parallel 2.

Every rank builds a 2-layer debug model with the same weights (norm scales perturbed away from
one so that their gradients matter) and runs one forward and backward: once without parallelism
with ``rmsnorm`` (the reference), then under TP + sequence parallel with ``rmsnorm``,
``fused_rmsnorm`` and ``compiled_rmsnorm`` (with ``--compiled-blocks`` also the last two inside
blocks compiled with ``fullgraph=True``, as ``compile.enable`` does). The sequence-parallel norms
receive DTensors. Rank 0 prints, for each variant but the first, the largest error of the logits
and of any gradient relative to the reference (per tensor, over its largest magnitude)::

    RESULT <variant> <logits err> <grad err>

and the script fails if a norm weight's gradient has other placements than with ``rmsnorm``.
On CPU the fused norm takes its PyTorch path (no kernel); the DTensor handling is the same.
"""

from __future__ import annotations

import dataclasses
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from torchtitan.distributed.tensor_parallel import apply_tp, decoder_block_plan
from torchtitan.models.llama.flavors import llama3_configs
from torchtitan.models.llama.model import Transformer

VOCAB = 2256


def build(norm_type: str, state: dict | None = None) -> Transformer:
    args = dataclasses.replace(
        llama3_configs["debugmodel"], vocab_size=VOCAB, n_layers=2, norm_type=norm_type
    )
    torch.manual_seed(0)
    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device="cpu")
    model.init_weights()
    if state is None:
        g = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.mul_(1 + 0.3 * torch.randn(p.shape, generator=g))
    else:
        model.load_state_dict(state)
    return model


def step(model: Transformer, tokens: torch.Tensor, dlogits: torch.Tensor):
    logits = model(tokens)
    (logits * dlogits).sum().backward()
    grads = {}
    for name, p in model.named_parameters():
        grads[name] = p.grad
    return logits.detach(), grads


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((full(a) - b).abs().max() / b.abs().max()).item()


def main() -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    g = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, VOCAB, (2, 16), generator=g)
    dlogits = torch.randn(2, 16, VOCAB, generator=g)

    reference = build("rmsnorm")
    state = {k: v.clone() for k, v in reference.state_dict().items()}
    ref_logits, ref_grads = step(reference, tokens, dlogits)

    placements = {}
    variants = ["rmsnorm", "fused_rmsnorm", "compiled_rmsnorm"]
    if "--compiled-blocks" in sys.argv:
        variants += ["fused_rmsnorm+compiled_blocks", "compiled_rmsnorm+compiled_blocks"]
    for variant in variants:
        norm_type, _, blocks = variant.partition("+")
        model = build(norm_type, state)
        apply_tp(model, mesh, decoder_block_plan, loss_parallel=False, compiled_blocks=bool(blocks))
        if blocks:  # as parallelize_decoder does with compile.enable
            for block in model.layers.values():
                block.compile(fullgraph=True)
        logits, grads = step(model, tokens, dlogits)
        norm_grads = {n: gr for n, gr in grads.items() if n.endswith("norm.weight")}
        assert norm_grads and all(isinstance(gr, DTensor) for gr in norm_grads.values())
        placements[variant] = {n: tuple(gr.placements) for n, gr in norm_grads.items()}
        assert placements[variant] == placements["rmsnorm"], placements
        logits_err = rel(logits, ref_logits)
        grad_errs = {n: rel(grads[n], ref_grads[n]) for n in ref_grads}  # collectives: all ranks
        grad_err = max(grad_errs.values())
        if dist.get_rank() == 0 and grad_err > 1e-5:
            print(variant, "gradient errors:", grad_errs, flush=True)
        if dist.get_rank() == 0 and variant != "rmsnorm":
            print(f"RESULT {variant} {logits_err:.3e} {grad_err:.3e}", flush=True)
    if dist.get_rank() == 0:
        print("norm weight gradient placements:", set(placements["rmsnorm"].values()))
    dist.barrier()  # neither rank tears its gloo pairs down while another still uses them
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
