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
from launcher import COMPILE_AOT_EAGER, PP2_1F1B, expert_parallel, local_batch
from moe_layouts import BLOCK_CAUSAL, CP2, ETP2, TP2, MoELayoutSuite
from repo_paths import ROOT

CONFIG = str(ROOT / "train_configs" / "qwen3_next_debug.toml")
CP4 = ["--parallelism.context_parallel_degree", "4"]
MTP1 = ["--model.num_mtp_layers", "1"]
_batch = local_batch
# id -> (processes, arguments[, the model arguments of the one-process baseline]); local batch
# sizes keep the global batch at 8 sequences
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
    # the prediction depth (a gated softmax-attention MoE block) trained beside the main loss,
    # against one process with it; on the last pipeline stage under PP
    "fsdp2_mtp": (2, [*MTP1, *_batch(4)], MTP1),
    "pp2_mtp": (2, [*MTP1, *PP2_1F1B, *_batch(8)], MTP1),
}


SUITE = MoELayoutSuite(CONFIG, "Model qwen3_next debugmodel")


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_qwen3_next_layout_matches_one_process(pools, tmp_path, tmp_path_factory, layout):
    SUITE.check(pools, tmp_path, tmp_path_factory.mktemp, layout, *LAYOUTS[layout])
