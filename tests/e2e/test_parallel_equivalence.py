"""Every parallel layout trains the same model on the same data as one process: the proof.

Each layout runs the debug model, cut to 2 blocks, for 8 steps in the warm pool of real gloo
processes (``train.py``'s ``train()``, the losses of ``./run_llama_train.sh``) with a fixed seed,
deterministic mode and a global batch of 8 sequences, and its per-step losses (read at full precision from TensorBoard) must match the single-process run's:
step 1 and every later step within 1e-4 (the issue's bar is 2e-3 after step 1; layouts measure
under 2e-6). Parameters are initialized from (seed, name) whatever
their sharding and the data order depends only on (dataset, step), so any difference left is
floating-point summation order. A second suite does the same with block-causal attention and
documents' first tokens unpredicted, against its own one-process baseline.
"""

from __future__ import annotations

import re

import pytest
from launcher import (
    EQUIVALENCE_STEPS,
    LAYOUT_SUITE_ARGS,
    PP2_1F1B,
    tensorboard_scalars,
)

STEPS, COMMON = EQUIVALENCE_STEPS, LAYOUT_SUITE_ARGS

# id -> (processes, extra arguments); local batch sizes keep the global batch at 8 sequences
LAYOUTS = {
    "ddp2": (
        2,
        ["--parallelism.data_parallel_replicate_degree", "2", "--training.local_batch_size", "4"],
    ),
    "fsdp2": (2, ["--training.local_batch_size", "4"]),
    "hsdp2x2": (
        4,
        ["--parallelism.data_parallel_replicate_degree", "2", "--training.local_batch_size", "2"],
    ),
    "tp2": (2, ["--parallelism.tensor_parallel_degree", "2", "--training.local_batch_size", "8"]),
    "pp2_gpipe": (
        2,
        [
            "--parallelism.pipeline_parallel_degree",
            "2",
            "--parallelism.pipeline_parallel_schedule",
            "GPipe",
            "--parallelism.pipeline_parallel_microbatch_size",
            "2",
            "--training.local_batch_size",
            "8",
        ],
    ),
    "pp2_1f1b": (
        2,
        [
            *PP2_1F1B,
            "--training.local_batch_size",
            "8",
        ],
    ),
    "pp2_interleaved": (
        2,
        [
            "--parallelism.pipeline_parallel_degree",
            "2",
            "--parallelism.pipeline_parallel_schedule",
            "Interleaved1F1B",
            "--parallelism.pipeline_parallel_microbatch_size",
            "2",
            "--training.local_batch_size",
            "8",
        ],
    ),
    "fsdp2_tp2": (
        4,
        ["--parallelism.tensor_parallel_degree", "2", "--training.local_batch_size", "4"],
    ),
    "pp2_fsdp2": (
        4,
        [
            "--parallelism.pipeline_parallel_degree",
            "2",
            "--parallelism.pipeline_parallel_microbatch_size",
            "2",
            "--training.local_batch_size",
            "4",
        ],
    ),
    "pp2_tp2": (
        4,
        [
            "--parallelism.pipeline_parallel_degree",
            "2",
            "--parallelism.tensor_parallel_degree",
            "2",
            "--parallelism.pipeline_parallel_microbatch_size",
            "2",
            "--training.local_batch_size",
            "8",
        ],
    ),
    "cp2": (2, ["--parallelism.context_parallel_degree", "2", "--training.local_batch_size", "8"]),
    "fsdp2_cp2_ac_op": (
        4,
        [
            "--parallelism.context_parallel_degree",
            "2",
            "--activation_checkpoint.mode",
            "selective",
            "--activation_checkpoint.selective_ac_option",
            "op",
            "--training.local_batch_size",
            "4",
        ],
    ),
    "ddp2_cp2": (
        4,
        [
            "--parallelism.data_parallel_replicate_degree",
            "2",
            "--parallelism.context_parallel_degree",
            "2",
            "--training.local_batch_size",
            "4",
        ],
    ),
    "pp2_cp2": (
        4,
        [
            "--parallelism.pipeline_parallel_degree",
            "2",
            "--parallelism.context_parallel_degree",
            "2",
            "--parallelism.pipeline_parallel_microbatch_size",
            "2",
            "--training.local_batch_size",
            "8",
        ],
    ),
    # also guards TP x compile: before the embedding output was materialized for compiled
    # blocks, FSDP x TP x compile lost the embedding gradient (steps 2+ off by up to 2.6e-3)
    "cp2_tp2_compile": (
        4,
        [
            "--parallelism.context_parallel_degree",
            "2",
            "--parallelism.tensor_parallel_degree",
            "2",
            "--compile.enable",
            "--training.local_batch_size",
            "8",
        ],
    ),
    "ac_full": (1, ["--activation_checkpoint.mode", "full", "--training.local_batch_size", "8"]),
    "ac_op": (
        1,
        [
            "--activation_checkpoint.mode",
            "selective",
            "--activation_checkpoint.selective_ac_option",
            "op",
            "--training.local_batch_size",
            "8",
        ],
    ),
    "ac_every_2nd_layer": (
        1,
        [
            "--activation_checkpoint.mode",
            "selective",
            "--activation_checkpoint.selective_ac_option",
            "2",
            "--training.local_batch_size",
            "8",
        ],
    ),
    "compile": (1, ["--compile.enable", "--training.local_batch_size", "8"]),
    # the output projection and loss in pieces of the sequence (training.loss_chunks): with
    # FSDP x vocab-parallel TP, on a pipeline's last stage, and compiled (model and loss)
    "fsdp2_tp2_loss_chunks": (
        4,
        [
            "--parallelism.tensor_parallel_degree",
            "2",
            "--training.loss_chunks",
            "4",
            "--training.local_batch_size",
            "4",
        ],
    ),
    # every block's parameters freed after its forward, the root's kept until backward: the
    # loss calls the output projection itself (once crashed: sharded weights outside FSDP)
    "loss_chunks_fsdp2_reshard_always": (
        2,
        [
            "--parallelism.fsdp_reshard_after_forward",
            "always",
            "--training.loss_chunks",
            "4",
            "--training.local_batch_size",
            "4",
        ],
    ),
    "pp2_1f1b_loss_chunks": (
        2,
        [
            *PP2_1F1B,
            "--training.loss_chunks",
            "3",
            "--training.local_batch_size",
            "8",
        ],
    ),
    "loss_chunks_compile": (
        1,
        [
            "--compile.enable",
            "--compile.components",
            "model,loss",
            "--training.loss_chunks",
            "4",
            "--training.local_batch_size",
            "8",
        ],
    ),
}


# Layouts run once, with block-causal attention and each document's first token left unpredicted
# (so micro-batches and ranks hold uneven numbers of valid labels, which the loss must weigh by
# token), against their own one-process baseline. How a layout shards, splits or recomputes the
# model does not depend on the mask; the causal kernel runs in every layout left in LAYOUTS (CP's
# causal path in its four CP layouts). GPipe is checked against one process by
# tests/e2e/test_pipeline.py's worker, with every other schedule (Interleaved1F1B is also trained
# against one process there, by test_train_py_pipelined_losses_match_one_process). Compile alone is left to the
# layouts that combine it (cp2_tp2_compile, loss_chunks_compile) and, for the masked attention,
# to test_moe_parallel.py::test_blocks_compiled_with_inductor_give_eager_gradients (its chunked layers
# take the same document mask, compared with eager gradient by gradient).
BLOCK_CAUSAL = ["--model.attn_mask_type", "block_causal", "--training.mask_document_starts"]
del LAYOUTS["pp2_gpipe"], LAYOUTS["pp2_interleaved"], LAYOUTS["compile"]
BLOCK_CAUSAL_LAYOUTS = {
    name: LAYOUTS.pop(name) for name in ("ddp2", "fsdp2", "tp2", "pp2_1f1b", "cp2", "ac_op")
}
BLOCK_CAUSAL_LAYOUTS["cp2_tp2"] = (
    4,
    [
        "--parallelism.context_parallel_degree",
        "2",
        "--parallelism.tensor_parallel_degree",
        "2",
        "--training.local_batch_size",
        "8",
    ],
)


def _run(pools, tmp_path, ngpu: int, extra: list[str]) -> tuple[dict[int, float], str]:
    """``train()`` of the layout in the session's warm pool of ``ngpu`` ranks (the same losses
    as ``run_llama_train.sh``, tests/e2e/test_pool.py), writing to ``tmp_path/out``; its
    losses and rank 0's log."""
    out = tmp_path / "out"
    args = [*COMMON, *extra]
    compiles = "--compile.enable" in args
    pools(ngpu).run("pool_cases:train", args, str(out), meshes=True, compiles=compiles)
    losses = tensorboard_scalars(out)
    assert sorted(losses) == list(range(1, STEPS + 1)), losses
    return losses, (out / "logs" / "rank_0.log").read_text()


@pytest.fixture(scope="module")
def baseline(pools, tmp_path_factory) -> dict[int, float]:
    """One process, local batch 4 with 2 accumulation steps (global batch 8)."""
    losses, _ = _run(
        pools, tmp_path_factory.mktemp("single"), 1, ["--training.local_batch_size", "4"]
    )
    # it trains: the comparison means something (8.26 -> 8.11 measured with 2 blocks)
    assert losses[1] - losses[STEPS] > 0.1, losses
    return losses


@pytest.fixture(scope="module")
def block_causal_baseline(pools, tmp_path_factory, baseline) -> dict[int, float]:
    """One process as ``baseline``, with block-causal attention and masked document starts."""
    extra = ["--training.local_batch_size", "4", *BLOCK_CAUSAL]
    losses, stdout = _run(pools, tmp_path_factory.mktemp("single_block_causal"), 1, extra)
    assert losses[1] - losses[STEPS] > 0.1, losses
    # the settings change the numbers: the suite is not the causal one again
    assert max(abs(losses[s] - baseline[s]) for s in losses) > 1e-3, (losses, baseline)
    return losses


def _assert_matches(layout: str, losses: dict[int, float], baseline: dict[int, float]) -> None:
    worst = max(abs(losses[s] - baseline[s]) for s in losses)
    print(f"\n{layout}: step 1 {losses[1]:.6f} vs {baseline[1]:.6f}; max |diff| {worst:.2e}")
    assert losses[1] == pytest.approx(baseline[1], abs=1e-4), (losses, baseline)
    for step in range(1, STEPS + 1):
        # The issue asks for 2e-3; layouts measure under 2e-6, so 1e-4 catches real bugs sooner.
        assert losses[step] == pytest.approx(baseline[step], abs=1e-4), (step, losses, baseline)


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(BLOCK_CAUSAL_LAYOUTS))
def test_block_causal_layout_matches_one_process(pools, tmp_path, block_causal_baseline, layout):
    ngpu, extra = BLOCK_CAUSAL_LAYOUTS[layout]
    losses, stdout = _run(pools, tmp_path, ngpu, [*extra, *BLOCK_CAUSAL])
    _assert_matches(f"{layout} block_causal", losses, block_causal_baseline)
    _check_logs(layout, stdout)


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_matches_one_process(pools, tmp_path, baseline, layout):
    ngpu, extra = LAYOUTS[layout]
    losses, stdout = _run(pools, tmp_path, ngpu, extra)
    _assert_matches(layout, losses, baseline)
    _check_logs(layout, stdout)


def _check_logs(layout: str, stdout: str) -> None:
    if layout == "compile":  # compile.components defaults to both
        assert "Compiled each transformer block" in stdout and "Compiled the loss" in stdout
    if layout == "cp2_tp2_compile":
        assert "Loss not compiled: the vocab-parallel loss" in stdout
    if layout.startswith("fsdp2"):
        # Each rank holds about half of the parameters (a TP rank's share of them, halved again).
        m = re.search(r"Parameters on this rank: ([\d,]+) of ([\d,]+)", stdout)
        assert m, stdout[-3000:]
        local, total = (int(g.replace(",", "")) for g in m.groups())
        share = 1 / 2 if layout == "fsdp2" else 1 / 4
        assert abs(local / total - share) < 0.02, (local, total)


# Muon for the hidden matrices, AdamW for the rest: every layout orthogonalizes the whole matrices
# (gathered from FSDP and TP shards), so it follows the one process as AdamW does.
MUON = ["--optimizer.name", "Muon", "--optimizer.muon_lr", "0.02"]
MUON_LAYOUTS = {name: LAYOUTS[name] for name in ("fsdp2_tp2", "pp2_tp2")} | {
    name: BLOCK_CAUSAL_LAYOUTS[name] for name in ("fsdp2", "tp2", "pp2_1f1b")
}


@pytest.fixture(scope="module")
def muon_baseline(pools, tmp_path_factory, baseline) -> dict[int, float]:
    """One process as ``baseline``, with Muon."""
    extra = ["--training.local_batch_size", "4", *MUON]
    folder = tmp_path_factory.mktemp("single_muon")
    losses, stdout = _run(pools, folder, 1, extra)
    assert "Muon, weight decay 0.1: " in stdout, stdout[-3000:]  # the groups logged
    # both learning rates are logged, each from its own peak on the one schedule (warm-up here)
    lr, muon_lr = (tensorboard_scalars(folder / "out", tag) for tag in ("lr", "lr/muon"))
    assert lr[1] < lr[2] and all(muon_lr[s] == pytest.approx(25 * lr[s]) for s in lr), (lr, muon_lr)
    assert f"muon lr: {muon_lr[1]:.4e}" in stdout, stdout[-3000:]
    assert losses[1] - losses[STEPS] > 0.1, losses  # it trains
    assert max(abs(losses[s] - baseline[s]) for s in losses) > 1e-3, (losses, baseline)
    return losses


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(MUON_LAYOUTS))
def test_muon_layout_matches_one_process(pools, tmp_path, muon_baseline, layout):
    ngpu, extra = MUON_LAYOUTS[layout]
    losses, _ = _run(pools, tmp_path, ngpu, [*extra, *MUON])
    _assert_matches(f"{layout} muon", losses, muon_baseline)
