"""gpt-oss under every parallelism trains the same numbers as one process.

Like ``test_deepseek_parallel.py``: the gpt_oss debug flavor cut to 2 blocks (a sliding layer
with a 32-key window over the 64-token sequences, then a full one; attention sinks; a biased
router and biased clamped-SwiGLU experts, 8 of them, top-4) for 8 steps in the session's warm
pool of ranks (gloo on CPU), fixed seed, deterministic mode, a global batch of 8 sequences, the
expert bias moving every step. Step 1 within 1e-4 and every step within 1e-3 (top-k routing is
discontinuous: see test_moe_parallel.py), and the first step's gradient norm to 3e-4: the sinks'
and biases' gradients are in it.
"""

from __future__ import annotations

import pytest
from launcher import COMPILE_AOT_EAGER, PP2_1F1B, expert_parallel, local_batch
from moe_layouts import BLOCK_CAUSAL, CP2, ETP2, TP2, MoELayoutSuite
from repo_paths import ROOT

CONFIG = str(ROOT / "train_configs" / "gpt_oss_debug.toml")
_batch = local_batch
# id -> (processes, arguments); local batch sizes keep the global batch at 8 sequences
LAYOUTS = {
    "fsdp2": (2, _batch(4)),
    # the sliding block on stage 0, the full one on stage 1
    "pp2": (2, [*PP2_1F1B, *_batch(8)]),
    "fsdp2_compile": (2, [*COMPILE_AOT_EAGER, *_batch(4)]),
    # each block recomputed in backward (the sinks' and biases' gradients through the recompute)
    "fsdp2_ac": (2, ["--activation_checkpoint.mode", "full", *_batch(4)]),
    # packed documents: each window also stops at its document's start
    "fsdp2_block_causal": (2, [*BLOCK_CAUSAL, *_batch(4)]),
    # the sinks split with their query heads, wqkv's bias with its rows, wo's added once, the
    # experts' w1/w3 biases with their hidden slices and w2's added on one rank
    "tp2": (2, [*TP2, *_batch(8)]),
    # the experts' biases with their experts
    "ep2": (2, [*expert_parallel(2), *_batch(4)]),
    "ep2_fsdp2": (4, [*expert_parallel(2), *_batch(2)]),
    # whole experts under TP, each TP rank its share of the routed rows
    "ep2_tp2_etp1": (2, [*expert_parallel(2), *TP2, *_batch(8)]),
    # the experts split over EP and TP at once (a 2-D mesh: w1/w3 biases with their hidden
    # slices, w2's added on one TP rank), the rest FSDP over the 2 data-parallel ranks
    "ep2_tp2": (4, [*expert_parallel(2), *TP2, *ETP2, *_batch(4)]),
    # 4 chunks of 16 positions: the 32-key window reaches into the other rank's chunks
    "cp2": (2, [*CP2, *_batch(8)]),
    "cp2_block_causal": (2, [*CP2, *BLOCK_CAUSAL, *_batch(8)]),
}


SUITE = MoELayoutSuite(CONFIG, "Model gpt_oss debugmodel")


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_gpt_oss_layout_matches_one_process(pools, tmp_path, tmp_path_factory, layout):
    SUITE.check(pools, tmp_path, tmp_path_factory.mktemp, layout, *LAYOUTS[layout])
