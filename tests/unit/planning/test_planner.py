"""The planner's walk (torchtitan/planning/planner.py): its floor is a lower bound for what a
job keeps (LoRA, Muon, bfloat16 moments, no gradients kept), and a command line no layout can
keep is said in one line naming the keys."""

from __future__ import annotations

import pytest

from torchtitan.config.parse import parse_args
from torchtitan.devices import device_by_key
from torchtitan.errors import ConfigError
from torchtitan.planning.cost import Layout, gpu_hardware
from torchtitan.planning.planner import _facts, _Walk, plan

DEBUG = ["--job.config_file", "train_configs/debug_model.toml"]
LAYOUT = Layout(1, 4, 1, 1, 1, ac="full", local_batch=1)


def _floor(*args: str) -> float:
    cfg = parse_args([*DEBUG, *args], need_files=False)
    walk = _Walk(cfg, 4, gpu_hardware(device_by_key("h100")), "cuda", _facts(cfg), 4)
    return walk._floor_gib(LAYOUT)


def test_the_floor_follows_what_the_job_keeps():
    adamw = _floor()
    lora = ("--lora.enable", "true", "--checkpoint.enable", "true")
    lora += ("--checkpoint.initial_load_path", "/nonexistent/base")
    assert _floor(*lora) < adamw / 3  # the base weights alone
    assert _floor("--optimizer.name", "Muon") < adamw
    assert _floor("--optimizer.state_dtype", "bfloat16") < adamw
    # gradients and activations are never all alive together: the larger of the two counts
    assert _floor("--optimizer.early_step_in_backward", "true") <= adamw


def test_layout_keys_no_layout_can_keep_are_one_line():
    cfg = parse_args([*DEBUG, "--parallelism.tensor_parallel_degree", "3"], need_files=False)
    with pytest.raises(ConfigError) as e:
        plan(
            cfg,
            ["--parallelism.tensor_parallel_degree", "3"],
            8,
            gpu_hardware(device_by_key("h100")),
        )
    message = str(e.value)
    assert "\n" not in message
    assert message.startswith("no layout of 8 devices keeps the global batch of ")
    assert "(parallelism.tensor_parallel_degree)" in message


def _walk(*args: str) -> _Walk:
    cfg = parse_args([*DEBUG, *args], need_files=False)
    return _Walk(cfg, 4, gpu_hardware(device_by_key("h100")), "cuda", _facts(cfg), 8)


@pytest.mark.parametrize(
    "schedule, most",
    [
        # pp 2, 4 micro-batches. 1F1B: rank 0 holds 2, then 2 beside its gradients
        ("1F1B", 2),
        ("1f1b", 2),  # the names the config accepts
        # torch's own orders, not "every forward first" (which would hold 8 = 4 x 2 stages)
        ("Interleaved1F1B", 5),
        ("ZBVZeroBubble", 4),
        ("DualPipeV", 5),
    ],
)
def test_the_floor_under_pp_walks_the_schedules_own_order(schedule, most):
    """The most micro-batches the first and last rank's stages hold together, in the order
    torch's schedule runs them; the floor stays the gathered weights alone where the order is
    not known (a CSV file's)."""
    walk = _walk()
    lay = Layout(1, 2, 1, 1, 2, ac="full", local_batch=4, schedule=schedule, microbatch=1)
    snapshots, _, v = walk._schedule(lay)
    assert max(held for held, _ in snapshots) == most
    assert v == (1 if schedule.lower() == "1f1b" else 2)
    csv = _walk("--parallelism.pipeline_parallel_schedule_csv", "x.csv")
    assert csv._schedule(lay) is None
    params, _ = csv._sizes(lay)
    gathered, _ = csv._pipelined_fsdp_bytes(lay, params)
    assert csv._floor_gib(lay) == pytest.approx((csv.fixed_bytes * params + gathered) / 1024**3)
