"""Qwen3 under the parallelisms trains the same model on the same data as one process.

Like ``test_parallel_equivalence.py`` (which proves it for Llama), for the qwen3 debug flavor
(``train_configs/qwen3_debug.toml``): 8 steps through ``./run_llama_train.sh`` (real processes,
gloo on CPU), fixed seed, deterministic mode, a global batch of 8 sequences; every step's loss
(read at full precision from TensorBoard) must match the single-process run's within 1e-4. What
Qwen3 adds to the generic code is checked here: the QK norms under tensor parallel (their
replicated weight sees only its rank's heads; the gradient must be summed over the TP ranks), a
head_dim that is not dim / n_heads, the half-split rotary table sharded by context parallel, and
the pipeline split (of the untied debug flavor: pipelining refuses tied embeddings).

The QK-norm gradients are also compared directly under TP 2
(``test_qk_norm_gradients_under_tensor_parallel``); this file is then its own torchrun worker.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from launcher import (
    EQUIVALENCE_STEPS,
    LAYOUT_SUITE_ARGS,
    PP2_1F1B,
    pooled,
    tensorboard_scalars,
    train_env,
)
from repo_paths import HELPERS, ROOT

STEPS, COMMON = EQUIVALENCE_STEPS, LAYOUT_SUITE_ARGS

# id -> (processes, extra arguments); local batch sizes keep the global batch at 8 sequences
UNTIED = ["--model.flavor", "debugmodel_untied"]
LAYOUTS = {
    # (FSDP 2 alone: Qwen3's attention under FSDP is trained by test_moe_parallel.py's
    # qwen3_moe_fsdp2, and FSDP with TP below)
    "tp2": (2, ["--parallelism.tensor_parallel_degree", "2", "--training.local_batch_size", "8"]),
    # pipeline parallel refuses tied embeddings: the untied debug flavor, against its own baseline
    "pp2_1f1b_untied": (
        2,
        [
            *UNTIED,
            *PP2_1F1B,
            "--training.local_batch_size",
            "8",
        ],
    ),
    "cp2": (2, ["--parallelism.context_parallel_degree", "2", "--training.local_batch_size", "8"]),
    # every parameter, the QK norms' included, is a DTensor on the TP mesh when FSDP shards it
    "fsdp2_tp2": (
        4,
        ["--parallelism.tensor_parallel_degree", "2", "--training.local_batch_size", "4"],
    ),
}


def _run(pools, tmp_path, ngpu: int, extra: list[str]) -> dict[int, float]:
    config = str(ROOT / "train_configs" / "qwen3_debug.toml")
    out = pooled(pools, tmp_path, *COMMON, *extra, ngpu=ngpu, config=config)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "Model qwen3 debugmodel" in out.stdout, out.stdout[-3000:]
    if any("pipeline_parallel_degree" in a for a in extra):
        assert "Pipeline schedule 1F1B" in out.stdout, out.stdout[-3000:]
    losses = tensorboard_scalars(tmp_path / "out")
    assert sorted(losses) == list(range(1, STEPS + 1)), losses
    return losses


@pytest.fixture(scope="module")
def baselines(pools, tmp_path_factory):
    """``baseline(flavor_args)``: the losses of one process, local batch 4 with 2 accumulation
    steps (global batch 8), run once per flavor."""
    cache: dict[tuple[str, ...], dict[int, float]] = {}

    def baseline(flavor_args: list[str]) -> dict[int, float]:
        key = tuple(flavor_args)
        if key not in cache:
            tmp = tmp_path_factory.mktemp("single")
            losses = _run(pools, tmp, 1, [*flavor_args, "--training.local_batch_size", "4"])
            # it trains: the comparison means something (untied, 2 blocks: 8.26 -> 8.10)
            assert losses[1] - losses[STEPS] > 0.1, losses
            cache[key] = losses
        return cache[key]

    return baseline


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_qwen3_layout_matches_one_process(pools, tmp_path, baselines, layout):
    ngpu, extra = LAYOUTS[layout]
    baseline = baselines(UNTIED if UNTIED[1] in extra else [])
    losses = _run(pools, tmp_path, ngpu, extra)
    worst = max(abs(losses[s] - baseline[s]) for s in losses)
    print(f"\nqwen3 {layout}: step 1 {losses[1]:.6f} vs {baseline[1]:.6f}; max |diff| {worst:.2e}")
    for step in range(1, STEPS + 1):
        assert losses[step] == pytest.approx(baseline[step], abs=1e-4), (step, losses, baseline)


# ----------------------------------------------------------------------------- QK-norm gradients


@pytest.mark.slow
@pytest.mark.parametrize("norm_type", ["rmsnorm", "compiled_rmsnorm"])
def test_qk_norm_gradients_under_tensor_parallel(tmp_path, norm_type):
    """TP 2 (Qwen3's block plan) vs one process on the same weights and batch: the same loss and
    every gradient, the QK norms' included. Without the plan's entries for the QK norms, each
    rank's norm weight would get the gradient of its own heads only: the worker checks that this
    is a visible difference, so the comparison would catch it."""
    result = tmp_path / "result.json"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        __file__,
        norm_type,
        str(result),
    ]
    # this file runs as a script: the helpers it imports at the top come through PYTHONPATH
    pythonpath = os.pathsep.join([str(ROOT), str(HELPERS)])
    env = train_env(tmp_path, PYTHONPATH=pythonpath, OMP_NUM_THREADS="1")
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    r = json.loads(result.read_text())
    print(f"\nqwen3 tp2 {norm_type}: {r}")
    assert r["not_dtensor"] == []
    assert r["loss"] < 1e-6
    assert r["grad"] < 1e-6, r
    assert r["qk_norm_grad"] < 1e-7, r
    assert r["qk_norm_grad_without_plan"] > 1e-5, r


def _tp_worker(norm_type: str, result: str) -> None:
    """One of 2 torchrun processes: a tiny Qwen3 (head_dim != dim / n_heads, GQA) whole and
    under TP 2; max |difference| of the loss and of the (full) gradients, to ``result``."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, distribute_tensor

    from torchtitan.distributed.tensor_parallel import apply_tp
    from torchtitan.models.qwen3.block_plan import block_plan
    from torchtitan.models.qwen3.model import Qwen3Model, Qwen3ModelArgs

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    args = Qwen3ModelArgs(
        dim=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        head_dim=24,
        hidden_dim=96,
        vocab_size=96,
        max_seq_len=32,
        norm_type=norm_type,
    )
    torch.manual_seed(0)
    ref = Qwen3Model(args)
    ref.init_weights()
    with torch.no_grad():  # norms away from 1
        for name, p in ref.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    tokens = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(1))
    labels = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(2))
    loss_ref = F.cross_entropy(ref(tokens).flatten(0, 1), labels.flatten())
    loss_ref.backward()
    grads_ref = {n: p.grad for n, p in ref.named_parameters()}

    def tp_run(plan) -> tuple[float, dict[str, torch.Tensor], list[str]]:
        model = Qwen3Model(args)
        apply_tp(model, mesh, plan, loss_parallel=False)
        plain = []
        with torch.no_grad():
            for name, p in model.named_parameters():
                full = ref.state_dict()[name]
                if isinstance(p, DTensor):
                    p.copy_(distribute_tensor(full, mesh, p.placements))
                else:
                    plain.append(name)
                    p.copy_(full)
        loss = F.cross_entropy(model(tokens).flatten(0, 1), labels.flatten())
        loss.backward()
        grads = {
            n: p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            for n, p in model.named_parameters()
        }
        return abs(loss.item() - loss_ref.item()), grads, plain

    def worst(grads: dict[str, torch.Tensor], qk_only: bool) -> float:
        return max(
            (g - grads_ref[n]).abs().max().item()
            for n, g in grads.items()
            if not qk_only or n.endswith(("q_norm.weight", "k_norm.weight"))
        )

    loss_diff, grads, plain = tp_run(block_plan)

    def without_qk_norms(styles):
        return {k: v for k, v in block_plan(styles).items() if not k.endswith(("q_norm", "k_norm"))}

    _, grads_unplanned, _ = tp_run(without_qk_norms)
    out = {
        "not_dtensor": plain,
        "loss": loss_diff,
        "grad": worst(grads, qk_only=False),
        "qk_norm_grad": worst(grads, qk_only=True),
        "qk_norm_grad_without_plan": worst(grads_unplanned, qk_only=True),
    }
    if dist.get_rank() == 0:
        with open(result, "w") as f:
            json.dump(out, f)
    dist.barrier()  # neither rank tears its gloo pairs down while the other still uses them
    dist.destroy_process_group()


if __name__ == "__main__":
    _tp_worker(sys.argv[1], sys.argv[2])
