"""Will the job fit (torchtitan/train/memory_fit.py): the floor of parameters, gradients and
optimizer state per device, checked by the launcher's preflight for CUDA jobs."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from sized_tokenizers import llama3_sized_tiktoken

from torchtitan.config.parse import parse_args
from torchtitan.train import preflight
from torchtitan.train.memory_fit import GIB, DeviceMemory, state_floor_gib, verdict


def test_the_floor_counts_float32_weights_and_gradients_and_the_optimizer_moments():
    model = nn.Linear(1024, 1024, bias=False)  # 2**20 parameters
    cfg = parse_args([])
    assert state_floor_gib(cfg, model, 1) * GIB == 2**20 * (4 + 4 + 2 * 4)
    assert state_floor_gib(cfg, model, 4) * GIB == 2**20 * 16 / 4
    cfg = parse_args(["--optimizer.state_dtype", "bfloat16", "--optimizer.early_step_in_backward"])
    assert state_floor_gib(cfg, model, 1) * GIB == 2**20 * (4 + 0 + 2 * 2)
    model.requires_grad_(False)  # frozen (a LoRA base): the weights alone
    assert state_floor_gib(parse_args([]), model, 1) * GIB == 2**20 * 4


def test_the_verdict_keeps_a_reserve():
    memory = DeviceMemory(80.0, "80 GiB (--device-memory-gib)")
    assert verdict(78.0, memory, "x is")[0]
    fits, line = verdict(78.5, memory, "x is")
    assert not fits
    assert line == (
        "does not fit: x is 78.5 GiB per device (+ 2 GiB kept for the CUDA context and NCCL) "
        "against 80 GiB (--device-memory-gib)"
    )


@pytest.fixture(scope="module")
def llama3_tokenizer(tmp_path_factory) -> str:
    return str(llama3_sized_tiktoken(tmp_path_factory.mktemp("tok") / "llama3.model"))


def _preflight(capsys, *args: str) -> tuple[int, str]:
    rc = preflight.main(list(args))
    return rc, capsys.readouterr().err.strip()


def test_405b_on_8_gpus_is_refused_in_one_line(capsys, llama3_tokenizer, tmp_path, monkeypatch):
    """Without pipeline parallel or with it, 405B's state alone is 756 GiB per device on 8: no
    GPU holds it (checked, on a machine without a GPU and none named, against the largest
    listed)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    rc, err = _preflight(
        capsys,
        "--world-size",
        "8",
        "--device-type",
        "cuda",
        "--job.config_file",
        "train_configs/llama3_405b.toml",
        "--parallelism.tensor_parallel_degree",
        "1",
        "--parallelism.pipeline_parallel_degree",
        "1",
        "--model.tokenizer_path",
        llama3_tokenizer,
        "--job.dump_folder",
        str(tmp_path),
    )
    assert rc == 2 and "\n" not in err, err
    assert err.startswith(
        "error: llama3 405B (405,853,388,800 parameters) on 8 device(s) does not fit: "
        "parameters, gradients and optimizer state take at least 756.0 GiB per device"
    ), err
    assert "against 192.0 GiB of one mi300x, the largest GPU listed" in err
    assert (
        "it needs at least 32 such devices, 24 with optimizer.state_dtype = bfloat16, give "
        "--gpu-type KEY or --device-memory-gib for yours" in err
    ), err


def test_8b_on_8_h100s_with_fsdp_passes(capsys, llama3_tokenizer, tmp_path):
    args = ["--job.config_file", "train_configs/llama3_8b.toml"]
    args += ["--model.tokenizer_path", llama3_tokenizer, "--job.dump_folder", str(tmp_path)]
    # the GPU's options may come anywhere among train.py's
    assert preflight.main(["--world-size", "8", *args, "--gpu-type", "h100"]) == 0
    out = capsys.readouterr()
    assert out.err == "", out.err
    # the whole step's traced peak is stated against the device (8B, seq 8192, batch 1,
    # selective AC: about 50 GiB)
    line = out.out.strip()
    assert line.startswith("preflight: fits: the traced peak of a training step is "), line
    peak = float(line.split(" is ")[1].split(" GiB")[0])
    assert 30 < peak < 77.6 and line.endswith("against 79.6 GiB of one h100"), line
    rc, err = _preflight(capsys, "--world-size", "1", "--gpu-type", "h100", *args)
    assert rc == 2 and "at least 119.7 GiB per device" in err, err
    assert "against 79.6 GiB of one h100" in err
    assert "needs at least 2 such devices, 2 with optimizer.state_dtype = bfloat16;" in err
    # a seed checkpoint's job holds the weights alone (29.9 GiB), and fits
    seed = ["--checkpoint.enable", "--checkpoint.create_seed_checkpoint"]
    assert _preflight(capsys, "--world-size", "1", "--gpu-type", "h100", *args, *seed) == (0, "")


@pytest.mark.parametrize(
    "own, message",
    [
        (["--gpu-type", "h10"], "error: --gpu-type: 'h10' is not a known GPU; valid: "),
        (["--device-memory-gib", "nan"], "error: --device-memory-gib: 'nan' must be a number"),
        (["--device-memory-gib", "1.5"], "error: --device-memory-gib: '1.5' must be a number"),
        (["--device-type", "cpu", "--gpu-type", "h100"], "error: --device-type: cpu, but a GPU"),
        (
            ["--memory-check", "none"],
            "error: --memory-check: 'none' is not one of: trace, floor, off",
        ),
    ],
)
def test_bad_gpu_options_are_one_line(capsys, own, message, tmp_path):
    rc, err = _preflight(capsys, *own, "--job.dump_folder", str(tmp_path))
    assert rc == 2 and err.startswith(message) and "\n" not in err, err


def test_a_cpu_job_is_not_judged_against_any_gpu(capsys, llama3_tokenizer, tmp_path):
    args = ["--job.config_file", "train_configs/llama3_8b.toml", "--job.dump_folder", str(tmp_path)]
    args += ["--model.tokenizer_path", llama3_tokenizer]
    assert _preflight(capsys, "--world-size", "1", "--device-type", "cpu", *args) == (0, "")


def test_a_job_whose_step_does_not_fit_is_refused_with_the_planner_command(
    capsys, llama3_tokenizer, tmp_path
):
    """The floor passes (8B's state on 8 devices is 15 GiB each), the step does not: 4 x 8192
    tokens a device without checkpointing hold hundreds of GiB of activations."""
    args = ["--job.config_file", "train_configs/llama3_8b.toml", "--gpu-type", "h100"]
    args += ["--model.tokenizer_path", llama3_tokenizer, "--job.dump_folder", str(tmp_path)]
    args += ["--training.local_batch_size", "4", "--activation_checkpoint.mode", "none"]
    rc, err = _preflight(capsys, "--world-size", "8", *args)
    assert rc == 2 and "\n" not in err, err
    assert err.startswith("error: llama3 8B on 8 device(s), dp_replicate=1 dp_shard=8"), err
    assert "does not fit: the traced peak of a training step is " in err
    assert "against 79.6 GiB of one h100" in err
    assert (
        "python -m torchtitan.plan --gpus 8 --gpu-type h100 --job.config_file "
        "train_configs/llama3_8b.toml lists the layouts that fit" in err
    ), err
    assert (
        "MEMORY_CHECK=floor ./run_llama_train.sh, or preflight's --memory-check floor, skips "
        "this prediction)" in err
    ), err
    # the floor alone (no trace) lets it through; so does no check
    for check in ("floor", "off"):
        assert _preflight(capsys, "--memory-check", check, "--world-size", "8", *args) == (0, "")
    assert capsys.readouterr().out == ""


def test_memory_check_off_skips_the_floor_too(capsys, llama3_tokenizer, tmp_path):
    args = ["--job.config_file", "train_configs/llama3_8b.toml", "--gpu-type", "h100"]
    args += ["--model.tokenizer_path", llama3_tokenizer, "--job.dump_folder", str(tmp_path)]
    rc, err = _preflight(capsys, "--world-size", "1", "--memory-check", "floor", *args)
    assert rc == 2 and "at least 119.7 GiB per device" in err, err
    assert _preflight(capsys, "--world-size", "1", "--memory-check", "off", *args) == (0, "")
