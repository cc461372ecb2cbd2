"""``python -m torchtitan.plan``: the layouts of a job, ranked, traced and written as a config
that trains as written; GPU jobs planned from this machine with the device table; bad input in
one line."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest
from launcher import tensorboard_scalars, train_env
from repo_paths import ROOT
from sized_tokenizers import llama3_sized_tiktoken

DEBUG = ["--job.config_file", "train_configs/debug_model.toml"]


def _plan(tmp_path, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    out = subprocess.run(
        [sys.executable, "-m", "torchtitan.plan", *args],
        cwd=ROOT,
        env=train_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=600,
    )
    if check:
        assert out.returncode == 0, out.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def calibration(tmp_path_factory) -> str:
    """This machine's rates for 2 CPU processes, measured as the docs say."""
    tmp = tmp_path_factory.mktemp("calibration")
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node=2",
            "benchmarks/ceilings.py",
            "--collectives",
            "--size",
            "512",
            "--copy-gib",
            "0.125",
            "--gather-mib",
            "4",
            "--json",
        ],
        cwd=ROOT,
        env=train_env(tmp, OMP_NUM_THREADS="1"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    path = tmp / "calibration.json"
    path.write_text(out.stdout.strip().splitlines()[-1])
    measured = json.loads(path.read_text())
    assert measured["world_size"] == 2 and measured["matmul"]["tflops"] > 0
    assert measured["all_gather"]["gb_per_s"] > 0 and measured["all_reduce_latency_s"] > 0
    return str(path)


def test_the_best_cpu_layout_is_written_and_trains_as_written(tmp_path, calibration):
    """The planner on 2 CPU processes: layouts best first, each traced and fitting, the JSON
    list the issue names; the config it writes trains (run_llama_train.sh, 2 processes) with the
    layout it says."""
    written = tmp_path / "plan.toml"
    batch = ["--training.global_batch_size", "8", "--training.seq_len", "128"]
    out = _plan(
        tmp_path,
        "--gpus", "2", "--device-type", "cpu", "--calibration", calibration, "--top", "3",
        "--json", "--write", str(written), *DEBUG, *batch,
    )  # fmt: skip
    layouts = json.loads(out.stdout)
    assert len(layouts) == 3
    speeds = [lay["tokens_per_second_per_gpu"] for lay in layouts]
    assert speeds == sorted(speeds, reverse=True)
    for lay in layouts:
        assert lay["fits"] and 0 < lay["peak_gib"] < 2
        assert (
            lay["local_batch_size"]
            * lay["gradient_accumulation_steps"]
            * (lay["degrees"]["dp_replicate"] * lay["degrees"]["dp_shard"])
            == 8
        )
        assert lay["limit"] in lay["terms_seconds"] and lay["mfu"] > 0
    best = layouts[0]
    text = written.read_text()
    assert text.startswith("# written by: python -m torchtitan.plan")
    dump = tmp_path / "run"
    run = subprocess.run(
        [
            "bash", "run_llama_train.sh", "--training.steps", "2", "--metrics.log_freq", "1",
            "--job.dump_folder", str(dump),
        ],
        cwd=ROOT,
        env=train_env(tmp_path, CONFIG_FILE=str(written), NGPU="2"),
        capture_output=True,
        text=True,
        timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, (run.stdout + run.stderr)[-3000:]
    assert len(tensorboard_scalars(dump, "loss")) == 2
    from torchtitan.config.parse import parse_args
    from torchtitan.planning.layouts import config_layout

    trained = config_layout(parse_args(["--job.config_file", str(written)], need_files=False), 2)
    assert {k: getattr(trained, k) for k in best["degrees"]} == best["degrees"]
    assert trained.ac == best["activation_checkpoint"]
    assert trained.local_batch == best["local_batch_size"]


def test_command_line_keys_fix_the_layout_and_the_table_explains(tmp_path, calibration):
    out = _plan(
        tmp_path,
        "--gpus", "2", "--device-type", "cpu", "--calibration", calibration, "--top", "2",
        "--no-write", *DEBUG, "--training.global_batch_size", "8", "--training.seq_len", "128",
        "--parallelism.tensor_parallel_degree", "2", "--activation_checkpoint.mode", "full",
    )  # fmt: skip
    lines = out.stdout.splitlines()
    assert lines[0].startswith("Layouts for llama3 debugmodel"), out.stdout
    rows = [ln for ln in lines if ln.strip()[:2].strip() in ("1", "2")]
    assert rows and all("tp 2" in r and "AC full" in r for r in rows), out.stdout
    assert "(the config's own)" in out.stdout
    assert not (tmp_path / "plan.toml").exists() and not (ROOT / "plan.toml").exists()


@pytest.mark.slow
def test_llama3_8b_on_eight_h100s_planned_from_this_machine(tmp_path):
    """From a machine without the GPU, with the device table: the best layouts fit the H100's
    memory with their traced peaks, FSDP alone among the best; TP 8 asked for is kept."""
    tokenizer = llama3_sized_tiktoken(tmp_path / "llama3.model")
    base = [
        "--gpus", "8", "--gpu-type", "h100", "--top", "2", "--max-traces", "6", "--json",
        "--no-write", "--job.config_file", "train_configs/llama3_8b.toml",
        "--model.tokenizer_path", str(tokenizer), "--training.seq_len", "4096",
    ]  # fmt: skip
    layouts = json.loads(_plan(tmp_path, *base).stdout)
    assert layouts and all(lay["fits"] and lay["peak_gib"] < 79.6 - 2 for lay in layouts)
    assert all(0.3 < lay["mfu"] < 0.8 for lay in layouts)
    tp8 = json.loads(_plan(tmp_path, *base, "--parallelism.tensor_parallel_degree", "8").stdout)
    assert tp8 and all(lay["degrees"]["tp"] == 8 for lay in tp8)
    assert tp8[0]["tokens_per_second_per_gpu"] < layouts[0]["tokens_per_second_per_gpu"]
    assert tp8[0]["terms_seconds"]["tp"] > 0


def test_expert_parallel_borrows_the_tensor_parallel_ranks_with_whole_experts(tmp_path):
    """Qwen3-MoE's debug flavor on 4 GPUs with TP 2 and EP 4 asked for: only whole experts
    (expert_tensor_parallel_degree 1, EP over the TP ranks too) make EP 4 of 4 devices, and
    the written config says so; with the experts split over TP as well, EP 4 has only
    dp_shard x cp = 2 ranks to borrow and nothing fits."""
    plan_toml = tmp_path / "plan.toml"
    base = [
        "--gpus", "4", "--gpu-type", "h100", "--top", "2", "--max-traces", "4",
        "--job.config_file", "train_configs/qwen3_moe_debug.toml",
        "--parallelism.tensor_parallel_degree", "2", "--parallelism.expert_parallel_degree", "4",
    ]  # fmt: skip
    layouts = json.loads(_plan(tmp_path, *base, "--json", "--write", str(plan_toml)).stdout)
    assert layouts and all(lay["fits"] for lay in layouts)
    for lay in layouts:
        assert lay["degrees"]["ep"] == 4 and lay["degrees"]["etp"] == 1, lay
        assert lay["overrides"]["parallelism.expert_tensor_parallel_degree"] == 1
        assert lay["terms_seconds"]["ep"] > 0
    assert "expert_tensor_parallel_degree = 1" in plan_toml.read_text()
    split = ["--parallelism.expert_tensor_parallel_degree", "2", "--no-write"]
    out = _plan(tmp_path, *base, *split, check=False)
    assert out.returncode == 1, out.stdout[-2000:] + out.stderr[-2000:]
    assert "expert_parallel_degree: 4 must divide" in out.stdout, out.stdout


def test_no_layout_of_405b_fits_eight_gpus(tmp_path):
    """Its model state alone is 16 bytes x 405e9 / 8 per device: every layout is ruled out
    before a trace, and the planner says so in one line and exits 1."""
    tokenizer = llama3_sized_tiktoken(tmp_path / "llama3.model")
    out = _plan(
        tmp_path,
        "--gpus", "8", "--gpu-type", "h100", "--no-write",
        "--job.config_file", "train_configs/llama3_405b.toml",
        "--model.tokenizer_path", str(tokenizer),
    check=False)  # fmt: skip
    assert out.returncode == 1, out.stderr[-2000:]
    assert "0 traced" in out.stdout and "no layout fits 77.6 GiB per device" in out.stdout


@pytest.mark.parametrize(
    "args, says",
    [
        (["--gpus", "0"], "--gpus: 0 must be >= 1"),
        (["--gpus", "2", "--gpu-type", "h1000"], "--gpu-type: 'h1000' is not a known GPU"),
        (["--gpus", "2", "--device-type", "cpu"], "--calibration: planning for CPU processes"),
        (["--gpus", "2", "--gpu-type", "h100", "--device-memory-gib", "1"], "--device-memory-gib"),
        (["--gpus", "2", "--gpu-type", "h100", "--model.flavr", "x"], "model.flavr"),
        (["--gpus", "2", "--gpu-type", "h100", "--write", "/nonexistent/plan.toml"], "--write"),
        (["--gpus", "2", "--gpu-type", "h100", "--write", "/tmp"], "--write: /tmp is a folder"),
    ],
)
def test_bad_input_is_one_line(tmp_path, args, says):
    out = _plan(tmp_path, *args, *DEBUG, check=False)
    assert out.returncode != 0
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and says in lines[0], out.stderr


def test_ctrl_c_stops_the_planner_quietly(tmp_path):
    """Ctrl-C while it traces: exit 130 as a shell's commands do, no traceback, no config
    written."""
    tokenizer = llama3_sized_tiktoken(tmp_path / "llama3.model")
    plan_toml = tmp_path / "plan.toml"
    proc = subprocess.Popen(
        [sys.executable, "-m", "torchtitan.plan", "--gpus", "8", "--gpu-type", "h100",
         "--write", str(plan_toml), "--job.config_file", "train_configs/llama3_8b.toml",
         "--model.tokenizer_path", str(tokenizer)],
        cwd=ROOT, env=train_env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    time.sleep(12)  # imported and tracing (the whole plan takes a minute)
    assert proc.poll() is None, proc.communicate()
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err[-3000:]
    assert "Traceback" not in err and out == "", (out, err)
    assert not plan_toml.exists()
