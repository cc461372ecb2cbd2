"""Every parallel layout the checks accept trains the numbers of one process: no layout unproven.

The candidates are every combination of degrees (data_parallel_replicate, data_parallel_shard,
tensor, pipeline and context parallel; expert parallel and whole or split experts for the
mixture-of-experts model) whose product is 2 or 4 processes. Each is put to the launcher's own
check (``python -m torchtitan.preflight``, as ``run_llama_train.sh`` runs it): a refused layout must be
refused in one line, and every accepted one trains 3 steps of the same global batch (8 sequences
of 64 tokens, seeded, deterministic, the equivalence suites' parameter groups) and must match one
process: step 1 within 1e-4, every step's
loss within 1e-3 and its gradient norm within 1e-3 relative (read at full precision from
TensorBoard).

The accepted layouts of one world size run one after another in one torchrun launch
(``layout_sweep_worker.py``: ``train.py``'s ``train()`` per case, its own mesh each time), so the
sweep costs a few seconds per layout instead of a process start-up each. A layout that "Applied
DDP" beside tensor parallel once trained with every gradient at zero and exited 0: this is the
test that keeps any such combination from hiding.
"""

from __future__ import annotations

import contextlib
import io
import itertools
import json
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest
from launcher import EQUIVALENCE_ARGS, tensorboard_scalars, train_env
from repo_paths import ROOT

# 3 steps: the first step's gradients, then two updates (AdamW's moments used once and twice)
# and the gradients after them; the equivalence suites train 8 steps of the main layouts. A step
# of four ranks on two cores costs ~1 s in collectives (docs/getting_started.md: tests), and the
# sweep 61 layouts: the fourth step was a minute of CI.
STEPS, GLOBAL_BATCH = 3, 8
# the equivalence suites' settings (parameter groups with their own learning rates included),
# for STEPS steps
COMMON = [
    *EQUIVALENCE_ARGS,
    "--training.steps",
    str(STEPS),  # the last value given wins
    # a case that fails on some ranks only ends in a minute, not ten
    "--comm.init_timeout_seconds",
    "60",
    "--comm.train_timeout_seconds",
    "60",
]
MODELS = {"llama3": "debug_model.toml", "llama4": "llama4_debug.toml"}  # dense, mixture of experts
# Llama 3's debug model cut from 6 identical blocks to 4 (one per stage of the 4-stage pipeline):
# each block adds its own collectives to every step of every layout; Llama 4's has 4 already
# (MoE on each, the fourth without rotary embeddings)
MODEL_ARGS = {"llama3": ["--model.n_layers", "4"], "llama4": []}
WORLDS = (2, 4)
DEGREES = ("dp_replicate", "dp_shard", "tp", "pp", "cp")
_KEY = {
    "dp_replicate": "data_parallel_replicate_degree",
    "dp_shard": "data_parallel_shard_degree",
    "tp": "tensor_parallel_degree",
    "pp": "pipeline_parallel_degree",
    "cp": "context_parallel_degree",
    "ep": "expert_parallel_degree",
    "etp": "expert_tensor_parallel_degree",
}


def _factorizations(n: int, k: int) -> list[tuple[int, ...]]:
    """Every k-tuple of positive integers whose product is n."""
    return [t for t in itertools.product(range(1, n + 1), repeat=k) if _prod(t) == n]


def _prod(t: tuple[int, ...]) -> int:
    out = 1
    for d in t:
        out *= d
    return out


def candidates(model: str, world: int) -> dict[str, dict[str, int]]:
    """id -> degrees, for every combination on ``world`` processes (EP only with experts)."""
    out = {}
    for t in _factorizations(world, len(DEGREES)):
        base = dict(zip(DEGREES, t))
        variants = [{}]
        if model == "llama4":  # expert parallel over any divisor; whole experts (etp 1,
            # the default) or split like the dense layers (etp = tp)
            variants += [{"ep": ep} for ep in (2, 4) if ep <= world]
            if base["tp"] > 1:
                variants += [{"ep": ep, "etp": base["tp"]} for ep in (2, 4) if ep <= world]
        for extra in variants:
            degrees = base | extra
            name = "_".join(f"{k}{v}" for k, v in degrees.items() if v > 1)
            out[f"{model}-{world}-{name}"] = degrees
    return out


def layout_args(model: str, degrees: dict[str, int]) -> list[str]:
    """The case's arguments: its degrees, a local batch keeping the global batch, and one
    sequence per pipeline micro-batch."""
    args = ["--job.config_file", str(ROOT / "train_configs" / MODELS[model]), *MODEL_ARGS[model]]
    for name, value in degrees.items():
        args += [f"--parallelism.{_KEY[name]}", str(value)]
    dp = degrees["dp_replicate"] * degrees["dp_shard"]
    args += ["--training.local_batch_size", str(GLOBAL_BATCH // dp)]
    if degrees["pp"] > 1:
        args += ["--parallelism.pipeline_parallel_microbatch_size", "1"]
    return [*COMMON, *args]


ALL = {
    case: (model, world, degrees)
    for model in MODELS
    for world in WORLDS
    for case, degrees in candidates(model, world).items()
}


@cache
def preflight(case: str) -> str:
    """The launcher's check of the case: '' when accepted, else what it printed."""
    from torchtitan import preflight as check

    model, world, degrees = ALL[case]
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = check.main(["--world-size", str(world), *layout_args(model, degrees)])
    return "" if code == 0 else err.getvalue() or f"exit {code} without a line"


def _run(cmd: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)


@pytest.fixture(scope="module")
def sweep(tmp_path_factory) -> Path:
    """Every accepted case trained, one torchrun launch per world size; one process per model
    for the baselines. Returns the folder holding ``<case>/`` and ``one-<model>/``."""
    out = tmp_path_factory.mktemp("layout_sweep")
    env = train_env(out) | {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    for model in MODELS:
        one_process = layout_args(model, dict.fromkeys(DEGREES, 1))
        folder = ["--job.dump_folder", str(out / f"one-{model}")]
        one = _run([sys.executable, str(ROOT / "train.py"), *one_process, *folder], env)
        assert one.returncode == 0, one.stdout[-3000:] + one.stderr[-3000:]
    worker = str(ROOT / "tests" / "helpers" / "layout_sweep_worker.py")
    for world in WORLDS:
        accepted = [c for c, (_, w, _) in ALL.items() if w == world and not preflight(c)]
        spec = out / f"cases-{world}.json"
        cases = {c: layout_args(ALL[c][0], ALL[c][2]) for c in accepted}
        spec.write_text(json.dumps({"out": str(out), "common": [], "cases": cases}))
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        run = _run([*torchrun, f"--nproc-per-node={world}", worker, str(spec)], env)
        (out / f"sweep-{world}.log").write_text(run.stdout + run.stderr)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("case", list(ALL))
def test_layout_is_refused_in_one_line_or_matches_one_process(case, sweep):
    model, world, degrees = ALL[case]
    refusal = preflight(case)
    if refusal:
        lines = refusal.strip().splitlines()
        print(f"\n{case}: refused: {lines}")
        assert len(lines) == 1 and lines[0].startswith("error: "), refusal
        return
    folder = sweep / case
    log = (sweep / f"sweep-{world}.log").read_text()
    failed = sorted(folder.glob("rank_*.failed"))
    assert not failed, "\n".join(f"{f.name}: {f.read_text()}" for f in failed)
    done = sorted(f.name for f in folder.glob("rank_*.done"))
    assert len(done) == world, f"{case} did not finish on every rank ({done}):\n{log[-4000:]}"
    one = sweep / f"one-{model}"
    for tag, abs_tol, rel_tol in (("loss", 1e-3, 0), ("grad_norm", 0, 1e-3)):
        got, want = tensorboard_scalars(folder, tag), tensorboard_scalars(one, tag)
        assert sorted(got) == list(range(1, STEPS + 1)), got
        worst = max(abs(got[s] - want[s]) for s in want)
        print(f"\n{case}: {tag} max |diff| {worst:.2e}")
        for step in want:
            tol = 1e-4 if tag == "loss" and step == 1 else max(abs_tol, rel_tol * abs(want[step]))
            assert abs(got[step] - want[step]) <= tol, (tag, step, got, want)
