"""Qwen3-Next under every parallelism trains the same numbers as one process.

Like ``test_gpt_oss_parallel.py``: the qwen3_next debug flavor cut to 2 blocks (a Gated DeltaNet
linear-attention layer, then a gated softmax-attention one; 8 experts top-2 and a gated shared
expert) for 8 steps in the session's warm pool of ranks (gloo on CPU), fixed seed, deterministic
mode, a global batch of 8 sequences of 64, the expert bias moving every step. Step 1 within 1e-4
and every step within 1e-3 (top-k routing is discontinuous: see test_moe_parallel.py), and the
first step's gradient norm to 3e-4. Context parallel hands the linear layer's state and
convolution tail across ranks (``distributed/context_parallel_linear.py``): at CP 4 every rank's
8-position chunks depend on states from the others.
"""

from __future__ import annotations

import pytest
from launcher import (
    COMPILE_AOT_EAGER,
    EQUIVALENCE_STEPS,
    LAYOUT_SUITE_ARGS,
    PP2_1F1B,
    expert_parallel,
    local_batch,
    pooled,
    tensorboard_scalars_all_runs,
)
from repo_paths import ROOT

STEPS, COMMON = EQUIVALENCE_STEPS, LAYOUT_SUITE_ARGS
CONFIG = str(ROOT / "train_configs" / "qwen3_next_debug.toml")
BLOCK_CAUSAL = ["--model.attn_mask_type", "block_causal"]
TP2 = ["--parallelism.tensor_parallel_degree", "2"]
ETP2 = ["--parallelism.expert_tensor_parallel_degree", "2"]
CP2 = ["--parallelism.context_parallel_degree", "2"]
CP4 = ["--parallelism.context_parallel_degree", "4"]
_batch = local_batch
# id -> (processes, arguments); local batch sizes keep the global batch at 8 sequences
LAYOUTS = {
    "fsdp2": (2, _batch(4)),
    # the linear block on stage 0, the softmax one on stage 1; each stage builds the documents'
    # mask from the batch
    "pp2": (2, [*PP2_1F1B, *_batch(8)]),
    "fsdp2_compile": (2, [*COMPILE_AOT_EAGER, *_batch(4)]),
    "fsdp2_ac": (2, ["--activation_checkpoint.mode", "full", *_batch(4)]),
    # packed documents: the linear layer's state resets and its convolution stops at each start
    "fsdp2_block_causal": (2, [*BLOCK_CAUSAL, *_batch(4)]),
    "ep2": (2, [*expert_parallel(2), *_batch(4)]),
    "ep2_fsdp2": (4, [*expert_parallel(2), *_batch(2)]),
    # 4 chunks of 16 positions; the linear layer's chunks continue from the other rank's
    "cp2": (2, [*CP2, *_batch(8)]),
    "cp2_block_causal": (2, [*CP2, *BLOCK_CAUSAL, *_batch(8)]),
    # 8 chunks of 8: every state handed across ranks, twice per rank
    "cp4": (4, [*CP4, *_batch(8)]),
    # the linear layer split by key-head group, the softmax one by kv group with its gates
    "tp2": (2, [*TP2, *_batch(8)]),
    # the experts split over EP and TP at once, the rest FSDP over the 2 data-parallel ranks
    "ep2_tp2": (4, [*expert_parallel(2), *TP2, *ETP2, *_batch(4)]),
    # each rank's heads of its chunks: states handed across CP ranks, per TP rank
    "cp2_tp2": (4, [*CP2, *TP2, *_batch(8)]),
}


def _run(pools, tmp_path, ngpu: int, extra: list[str]) -> dict[str, dict[int, float]]:
    out = pooled(pools, tmp_path, *COMMON, *extra, ngpu=ngpu, config=CONFIG)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "Model qwen3_next debugmodel" in out.stdout, out.stdout[-3000:]
    assert "moe: load max/mean" in out.stdout
    values = {
        tag: tensorboard_scalars_all_runs(tmp_path / "out", tag) for tag in ("loss", "grad_norm")
    }
    assert sorted(values["loss"]) == list(range(1, STEPS + 1)), values
    return values


@pytest.fixture(scope="module")
def baselines(pools, tmp_path_factory):
    """``baseline(masking)``: one process, local batch 4 with 2 accumulation steps."""
    cache: dict[tuple[str, ...], dict[str, dict[int, float]]] = {}

    def baseline(masking: list[str]) -> dict[str, dict[int, float]]:
        if tuple(masking) not in cache:
            values = _run(pools, tmp_path_factory.mktemp("single"), 1, [*masking, *_batch(4)])
            assert values["loss"][1] - values["loss"][STEPS] > 0.1, values  # it trains
            cache[tuple(masking)] = values
        return cache[tuple(masking)]

    return baseline


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_qwen3_next_layout_matches_one_process(pools, tmp_path, baselines, layout):
    ngpu, extra = LAYOUTS[layout]
    base = baselines(BLOCK_CAUSAL if "block_causal" in layout else [])
    got = _run(pools, tmp_path, ngpu, extra)
    losses, baseline = got["loss"], base["loss"]
    worst = max(abs(losses[s] - baseline[s]) for s in losses)
    print(
        f"\nqwen3_next {layout}: step 1 {losses[1]:.6f} vs {baseline[1]:.6f}; max |diff| {worst:.2e}"
    )
    assert abs(losses[1] - baseline[1]) <= 1e-4, (losses, baseline)
    for step in range(1, STEPS + 1):
        assert abs(losses[step] - baseline[step]) <= 1e-3, (step, losses, baseline)
    norm, base_norm = got["grad_norm"][1], base["grad_norm"][1]
    assert norm == pytest.approx(base_norm, rel=3e-4), (norm, base_norm)
