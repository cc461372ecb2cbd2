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
