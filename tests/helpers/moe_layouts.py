"""What the MoE families' layout suites share (``test_gpt_oss_parallel.py``,
``test_qwen3_next_parallel.py``): a family's debug model cut to 2 blocks, trained for
``EQUIVALENCE_STEPS`` steps in the session's warm pool, against one process with the same global
batch (local batch 4, 2 accumulation steps), cached per masking. Step 1 within 1e-4 and every
step within 1e-3 (top-k routing is discontinuous: see test_moe_parallel.py), and the first step's
gradient norm to 3e-4."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from launcher import (
    EQUIVALENCE_STEPS,
    LAYOUT_SUITE_ARGS,
    local_batch,
    pooled,
    tensorboard_scalars_all_runs,
)

BLOCK_CAUSAL = ["--model.attn_mask_type", "block_causal"]
TP2 = ["--parallelism.tensor_parallel_degree", "2"]
ETP2 = ["--parallelism.expert_tensor_parallel_degree", "2"]  # experts split over TP too
CP2 = ["--parallelism.context_parallel_degree", "2"]
Values = dict[str, dict[int, float]]


class MoELayoutSuite:
    """The runs of one family (``config``: its debug train config; ``model``: the start-up
    log's model line, e.g. ``"Model gpt_oss debugmodel"``; ``moe``: whether that model has
    experts, whose load the run logs)."""

    def __init__(self, config: str, model: str, moe: bool = True) -> None:
        self.config, self.model, self.moe = config, model, moe
        self._baselines: dict[tuple[str, ...], Values] = {}

    def run(self, pools, tmp_path, ngpu: int, extra: list[str]) -> Values:
        out = pooled(pools, tmp_path, *LAYOUT_SUITE_ARGS, *extra, ngpu=ngpu, config=self.config)
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
        assert self.model in out.stdout, out.stdout[-3000:]
        assert ("moe: load max/mean" in out.stdout) == self.moe, out.stdout[-3000:]
        values = {
            tag: tensorboard_scalars_all_runs(tmp_path / "out", tag)
            for tag in ("loss", "grad_norm")
        }
        assert sorted(values["loss"]) == list(range(1, EQUIVALENCE_STEPS + 1)), values
        return values

    def baseline(self, pools, factory: Callable, model_args: list[str]) -> Values:
        """One process (local batch 4, 2 accumulation steps) with ``model_args``, once."""
        if tuple(model_args) not in self._baselines:
            values = self.run(pools, factory("single"), 1, [*model_args, *local_batch(4)])
            assert values["loss"][1] - values["loss"][EQUIVALENCE_STEPS] > 0.1, values  # trains
            self._baselines[tuple(model_args)] = values
        return self._baselines[tuple(model_args)]

    def check(
        self,
        pools,
        tmp_path,
        factory: Callable,
        layout: str,
        ngpu: int,
        extra: list[str],
        model_args: list[str] | None = None,
    ) -> None:
        """Layout ``layout`` (``ngpu`` ranks, ``extra`` arguments) against one process with
        ``model_args`` too (default: the block-causal mask for a layout named
        ``*block_causal*``, else none)."""
        if model_args is None:
            model_args = BLOCK_CAUSAL if "block_causal" in layout else []
        base = self.baseline(pools, factory, model_args)
        got = self.run(pools, tmp_path, ngpu, extra)
        losses, baseline = got["loss"], base["loss"]
        worst = max(abs(losses[s] - baseline[s]) for s in losses)
        name = self.model.split()[1]
        print(
            f"\n{name} {layout}: step 1 {losses[1]:.6f} vs {baseline[1]:.6f}; max |diff| {worst:.2e}"
        )
        assert abs(losses[1] - baseline[1]) <= 1e-4, (losses, baseline)
        for step in range(1, EQUIVALENCE_STEPS + 1):
            assert abs(losses[step] - baseline[step]) <= 1e-3, (step, losses, baseline)
        norm, base_norm = got["grad_norm"][1], base["grad_norm"][1]
        assert norm == pytest.approx(base_norm, rel=3e-4), (norm, base_norm)
