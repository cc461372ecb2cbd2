"""A dense Qwen3.5 language model under the layouts where it differs from Qwen3-Next's MoE one
(``test_qwen3_next_parallel.py``, the same model code) trains the same numbers as one process:
the qwen3_5 debug flavor cut to 2 blocks (a Gated DeltaNet layer, then a gated softmax-attention
one, each with a SwiGLU feed-forward), as that suite runs it (``moe_layouts.py``)."""

from __future__ import annotations

import pytest
from launcher import local_batch
from moe_layouts import CP2, TP2, MoELayoutSuite
from repo_paths import ROOT

CONFIG = str(ROOT / "train_configs" / "qwen3_5_debug.toml")
_batch = local_batch
LAYOUTS = {
    "fsdp2": (2, _batch(4)),
    # the linear layer split by key-head group, the feed-forward column- then row-wise
    "tp2": (2, [*TP2, *_batch(8)]),
    # the linear layer's state and convolution tail handed across the two ranks
    "cp2": (2, [*CP2, *_batch(8)]),
}
SUITE = MoELayoutSuite(CONFIG, "Model qwen3_5 debugmodel", moe=False)


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_dense_qwen3_5_layout_matches_one_process(pools, tmp_path, tmp_path_factory, layout):
    SUITE.check(pools, tmp_path, tmp_path_factory.mktemp, layout, *LAYOUTS[layout])
